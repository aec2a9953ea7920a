"""A peer dialled at an address its certificate does not name (a Kubernetes deployer at its pod IP, whose
certificate says `deployer`): `channel(..., tls_server_name=...)` checks the certificate against that name.
Real gRPC with mTLS on loopback, a server certificate whose only SAN is `deployer`."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from flowmaker.api.deployer.v1 import deployer_pb2
from flowmaker.rpc import channels
from flowmaker.rpc.tls import TlsFiles, ensure_pki, pki_files, server_credentials
from services.orchestrator.clients import Clients


def _deployer_only_cert(pki: Path) -> TlsFiles:
    """A `deployer` certificate signed by the suite's CA with SAN `deployer` only (no loopback names)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "deployer")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("deployer")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (pki / "deployer-only.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (pki / "deployer-only.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                              serialization.PrivateFormat.PKCS8,
                                                              serialization.NoEncryption()))
    return TlsFiles(str(pki / "ca.pem"), str(pki / "deployer-only.pem"), str(pki / "deployer-only.key"))


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    return ensure_pki(tmp_path / "pki", ["orchestrator"])


@pytest.fixture
async def server(pki: Path) -> AsyncIterator[str]:
    """A TLS-only server (client certificates required) on 127.0.0.1 with the `deployer`-only certificate."""
    srv = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    port = srv.add_secure_port("127.0.0.1:0", server_credentials(_deployer_only_cert(pki), require_client_cert=True))
    await srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


async def _health(ch: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await ch.close(None)
    return grpc.StatusCode.OK


async def test_server_name_override_verifies_the_named_identity(server: str, pki: Path) -> None:
    me = pki_files(pki, "orchestrator")
    # Without the override the certificate is checked against 127.0.0.1, which it does not name.
    assert await _health(channels.channel(server, tls=me, tracing=False)) == grpc.StatusCode.UNAVAILABLE
    assert await _health(channels.channel(server, tls=me, tracing=False,
                                          tls_server_name="deployer")) == grpc.StatusCode.OK
    # The name must be one the certificate carries: the override is no way around the check.
    assert await _health(channels.channel(server, tls=me, tracing=False,
                                          tls_server_name="selector")) == grpc.StatusCode.UNAVAILABLE


async def test_orchestrator_clients_dial_deployers_by_the_configured_name(server: str, pki: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    me = pki_files(pki, "orchestrator")
    monkeypatch.setattr(channels, "_client_tls", None)
    channels.configure_client_tls(SimpleNamespace(tls_enabled=True, tls_ca_file=me.ca, tls_cert_file=me.cert,
                                                  tls_key_file=me.key))
    for name, handshake in (("deployer", True), ("", False)):
        clients = Clients(server, timeout_s=5, deployer_tls_server_name=name)
        try:
            # The test server has no DeployerService: past the handshake the call is UNIMPLEMENTED.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await clients.deployer(server).ListInstances(deployer_pb2.ListInstancesRequest(), timeout=5)
            want = grpc.StatusCode.UNIMPLEMENTED if handshake else grpc.StatusCode.UNAVAILABLE
            assert err.value.code() == want, name
            # Other channels (the selector here) keep verifying the host they dial.
            assert clients.channel(server) is not clients.channel(server, "deployer")
        finally:
            await clients.close()
