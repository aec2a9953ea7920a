"""mTLS for the suite: a local CA, one certificate per identity, and the gRPC credentials built from them.

`ensure_pki(dir)` (what `flowmaker up` runs in its work dir) creates, once, `ca.pem`/`ca.key` and for
each identity — the five services, `etcd`, and `admin` (the CLI) — `<name>.pem`/`<name>.key`, signed by
the CA, with the identity as the certificate's common name and SANs `localhost`, `127.0.0.1`, `::1`
and the name itself (the compose service host name). Keys are written 0600.

A service finds its files through its settings (`tls_ca_file`, `tls_cert_file`, `tls_key_file`,
env `FLOWMAKER_<SVC>_TLS_*`): the server then accepts TLS only (every service but the orchestrator
also demands a client certificate signed by the CA), and every channel it opens presents its own
certificate. The caller's identity is the common name of its verified certificate (`peer_identity`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # grpc is imported where credentials are built: the launcher imports this module too
    import grpc

SERVICES = ("generator", "profiler", "selector", "deployer", "orchestrator")
IDENTITIES = (*SERVICES, "etcd", "admin")
ADMIN = "admin"
TOKENS_FILE = "tokens.json"  # bearer tokens of the orchestrator's public API, beside the certificates


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of one identity: the CA to trust, its certificate and its key."""

    ca: str
    cert: str
    key: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.ca).read_bytes(), Path(self.cert).read_bytes(), Path(self.key).read_bytes()


def pki_files(pki_dir: str | os.PathLike[str], identity: str) -> TlsFiles:
    d = Path(pki_dir)
    return TlsFiles(str(d / "ca.pem"), str(d / f"{identity}.pem"), str(d / f"{identity}.key"))


def _write(path: Path, data: bytes, private: bool) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ensure_pki(pki_dir: str | os.PathLike[str], identities: Iterable[str] = IDENTITIES, *,
               hosts: Sequence[str] = (), days: int = 365) -> Path:
    """Create the CA and the certificates of `identities` under `pki_dir` unless they exist already
    (so restarting a stack keeps its certificates). `hosts` adds SANs (e.g. a LAN address)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(pki_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM

    def key_pem(k: Any) -> bytes:
        return k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())  # type: ignore[no-any-return]

    ca_pem, ca_key_path = d / "ca.pem", d / "ca.key"
    if ca_pem.exists() and ca_key_path.exists():
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "FlowMaker local CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        _write(ca_key_path, key_pem(ca_key), private=True)
        _write(ca_pem, ca_cert.public_bytes(pem), private=False)
    for ident in identities:
        cert_path, key_path = d / f"{ident}.pem", d / f"{ident}.key"
        if cert_path.exists() and key_path.exists():
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(ident)]
        for h in ("127.0.0.1", "::1", *hosts):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ident)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
        _write(key_path, key_pem(key), private=True)
        _write(cert_path, cert.public_bytes(pem), private=False)
    return d


def server_credentials(files: TlsFiles, *, require_client_cert: bool) -> grpc.ServerCredentials:
    """TLS for a listener: this identity's certificate; client certificates are verified against the
    CA, and demanded when `require_client_cert` (then a plaintext or certificate-less client fails the
    handshake)."""
    import grpc

    ca, cert, key = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=require_client_cert)


def channel_credentials(files: TlsFiles | None = None, *, ca_file: str = "") -> grpc.ChannelCredentials:
    """TLS for a channel: trust the CA; present this identity's certificate when `files` has one."""
    import grpc

    if files is None:
        return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes() if ca_file else None)
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def peer_identity(context: Any) -> str | None:
    """The common name of the caller's verified client certificate, None without one."""
    try:
        auth = context.auth_context() or {}
    except Exception:
        return None
    names = list(auth.get("x509_common_name") or ())
    return names[0].decode(errors="replace") if names else None


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m flowmaker.rpc.tls DIR [--host H ...]`: the CA, every identity's certificate and an admin
    token in DIR (kept when they exist): what compose's `pki` step and `flowmaker up` create."""
    import argparse

    from flowmaker.rpc.auth import ensure_admin_token

    ap = argparse.ArgumentParser(prog="python -m flowmaker.rpc.tls", description=main.__doc__)
    ap.add_argument("dir")
    ap.add_argument("--host", action="append", default=[], help="extra SAN (host name or IP) on every certificate")
    args = ap.parse_args(argv)
    d = ensure_pki(args.dir, hosts=args.host)
    ensure_admin_token(d)
    print(f"PKI in {d}: ca.pem, {', '.join(f'{i}.pem' for i in IDENTITIES)}, {TOKENS_FILE}")


if __name__ == "__main__":
    main()
