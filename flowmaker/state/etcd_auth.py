"""etcd's own authentication for FlowMaker: one etcd user and role per service, key-prefix permissions.

The roles are data (`ROLES`, pure, below): which key prefixes of `flowmaker.state.keys` each service may read
or write. `provision()` makes an etcd match them through etcd's Auth API (aetcd's raw gRPC stubs), idempotently:
the root user (password from a file), one role and one user per service (user name = the service name = the
common name of its certificate, so that under `--client-cert-auth` a service's certificate maps to the same
user as its password), then `AuthEnable`. A second run with the same passwords changes nothing.

What the roles enforce (docs/state.md, "Who may touch what"):
- only the orchestrator writes tasks, owners, task names, users, user names, tokens and its replicas/leader keys;
- only deployers (and the orchestrator, whose selection commit reserves GPU memory and creates PENDING instances,
  and whose reconciler marks instances of a lost node LOST) write instances, GPUs and reuse keys; only deployers
  write node records;
- only the profiler writes profiles, models and profiling jobs;
- the selector only reads (the live cluster, profiles, tasks for the sharing tolerances);
- the generator and the gateway have no etcd user at all: their credentials open nothing in etcd;
- `admin` (the operator's certificate, the CLI's direct writes such as `profiles measure-interference`) reads and
  writes the FlowMaker key space, but is not etcd's root (it cannot change users or roles).
Engine API keys are not readable from instance records by anyone but the deployer and the orchestrator: they
are sealed (`flowmaker.state.records`, AES-GCM with a key only those two hold), so a role that reads instances (the
selector, admin) sees ciphertext.

`python -m flowmaker.state.etcd_auth provision --endpoints HOST:PORT --secrets-dir DIR` is the one-shot job of
compose and Kubernetes; `flowmaker up` calls `provision` after starting etcd.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import itertools
import os
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowmaker.state import keys

ROOT_USER = "root"
ROOT_ROLE = "root"
PASSWORD_SUFFIX = ".password"
ENGINE_KEY_SECRET = "engine-keys.secret"  # the deployer's and the orchestrator's sealing key, beside the passwords
PING_PREFIX = "/__ping__/"  # `EtcdStore.ping` reads it; every role may (it holds nothing)


class Perm(enum.Enum):
    READ = 0  # authpb.Permission.Type values
    WRITE = 1
    READWRITE = 2


@dataclass(frozen=True, slots=True)
class Grant:
    """`perm` on every key under `prefix` (a `keys.*` prefix, before the store's namespace)."""

    prefix: str
    perm: Perm


@dataclass(frozen=True, slots=True)
class Role:
    name: str
    grants: tuple[Grant, ...]
    doc: str = ""


def _r(*prefixes: str) -> tuple[Grant, ...]:
    return tuple(Grant(p, Perm.READ) for p in prefixes)


def _rw(*prefixes: str) -> tuple[Grant, ...]:
    return tuple(Grant(p, Perm.READWRITE) for p in prefixes)


# One role per etcd-using service; the user of the same name has exactly that role.
ROLES: Mapping[str, Role] = {
    "orchestrator": Role("orchestrator", (
        *_rw(keys.TASKS, keys.OWNERS, keys.TASK_NAMES, keys.USERS, keys.USER_NAMES, keys.TOKENS,
             keys.ORCHESTRATORS, keys.GPUS, keys.INSTANCES, keys.REUSE),
        *_r(keys.NODES, keys.PROFILES, keys.MODELS, keys.INTERFERENCE, PING_PREFIX)),
        "front door and reconciler: tasks, owners, users, tokens; selection commits (GPUs, instances, reuse)"),
    "deployer": Role("deployer", (
        *_rw(keys.NODES, keys.GPUS, keys.INSTANCES, keys.REUSE),
        *_r(keys.PROFILES, keys.INTERFERENCE, PING_PREFIX)),
        "node agent: its node record, GPUs, instances and their reuse keys"),
    "profiler": Role("profiler", (
        *_rw(keys.PROFILES, keys.MODELS, keys.PROFILING_JOBS),
        *_r(keys.NODES, keys.GPUS, PING_PREFIX)),
        "profiles, the model registry and profiling jobs; reads which GPU type the nodes have"),
    "selector": Role("selector", _r(keys.NODES, keys.GPUS, keys.INSTANCES, keys.REUSE, keys.PROFILES, keys.MODELS,
                                    keys.INTERFERENCE, keys.TASKS, PING_PREFIX),
                     "read-only: the live cluster, profiles and tasks (sharing tolerances)"),
    "admin": Role("admin", _rw(keys.ROOT, PING_PREFIX),
                  "the operator's CLI (its certificate's common name): the FlowMaker key space, not etcd's auth"),
}
# Services that never talk to etcd: no user, so their certificates (or anything else they hold) open nothing.
NO_ETCD_ACCESS = ("generator", "gateway")
USERS: tuple[str, ...] = tuple(ROLES)


def prefix_range_end(key: bytes) -> bytes:
    """etcd's range end of every key starting with `key` (the key with its last byte below 0xff incremented)."""
    b = bytearray(key)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[:i + 1])
    return b"\0"


def permissions(role: Role, namespace: str = "") -> set[tuple[bytes, bytes, int]]:
    """The (key, range_end, perm type) triples `role` has in an etcd whose FlowMaker keys are under `namespace`."""
    ns = namespace.rstrip("/")
    out = set()
    for g in role.grants:
        k = (ns + g.prefix).encode()
        out.add((k, prefix_range_end(k), g.perm.value))
    return out


def allowed(role: Role, key: str, *, write: bool) -> bool:
    """Whether `role` may read (or write) `key` (no namespace): the check etcd makes, for tests and docs."""
    return any(key.startswith(g.prefix) and (g.perm is Perm.READWRITE or g.perm is (Perm.WRITE if write else Perm.READ))
               for g in role.grants)


# ---- secrets on disk ---------------------------------------------------------------------------

def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _write_private(path: Path, data: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


OPERATOR_DIR = "root"  # nested layout: the root's and admin's passwords (only the provisioning job mounts it)
ENGINE_DIR = "engine"  # nested layout: the engine-key secret (the deployer and the orchestrator mount it)


def password_file(secrets_dir: str | os.PathLike[str], user: str, *, nested: bool = False) -> Path:
    """Where `user`'s password is: `<dir>/<user>.password`, or with `nested` (compose: one volume per service, so
    a container holds its own password only) `<dir>/<user>/<user>.password`, root's and admin's in `<dir>/root/`."""
    d = Path(secrets_dir)
    if nested:
        d = d / (OPERATOR_DIR if user in (ROOT_USER, "admin") else user)
    return d / f"{user}{PASSWORD_SUFFIX}"


def engine_key_file(secrets_dir: str | os.PathLike[str], *, nested: bool = False) -> Path:
    return Path(secrets_dir) / (ENGINE_DIR if nested else "") / ENGINE_KEY_SECRET


def read_secret(path: str | os.PathLike[str]) -> str:
    return Path(path).read_text().strip()


def _ensure_file(p: Path) -> str:
    _private_dir(p.parent)
    if not p.exists() or not read_secret(p):
        _write_private(p, secrets.token_urlsafe(32) + "\n")
    os.chmod(p, 0o600)
    return read_secret(p)


def ensure_secrets(secrets_dir: str | os.PathLike[str], users: Sequence[str] = (ROOT_USER, *USERS), *,
                   engine_key: bool = True, nested: bool = False) -> dict[str, str]:
    """A random password per user in its `password_file` (0600, its dir 0700), created once and kept; with
    `engine_key` also the engine-key sealing secret. Returns {user: password}."""
    _private_dir(Path(secrets_dir))
    out = {u: _ensure_file(password_file(secrets_dir, u, nested=nested)) for u in users}
    if engine_key:
        _ensure_file(engine_key_file(secrets_dir, nested=nested))
    return out


# ---- provisioning ------------------------------------------------------------------------------

class ProvisionError(RuntimeError):
    pass


@dataclass
class ProvisionReport:
    """What `provision` changed ("user add deployer", "grant selector READ /flowmaker/v1/nodes/", ...)."""

    changes: list[str] = field(default_factory=list)
    auth_was_enabled: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def _code(e: BaseException) -> str:
    import grpc

    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e)


async def _channel(endpoint: str, tls: Any) -> Any:
    import grpc

    from flowmaker.state.etcd import parse_endpoint

    host, port = parse_endpoint(endpoint)
    target = f"{host}:{port}"
    if tls is None:
        return grpc.aio.insecure_channel(target)
    from flowmaker.rpc.tls import channel_credentials

    return grpc.aio.secure_channel(target, channel_credentials(tls))


async def provision(endpoint: str, *, root_password: str, passwords: Mapping[str, str], namespace: str = "",
                    roles: Mapping[str, Role] = ROLES, tls: Any = None, timeout_s: float = 5.0) -> ProvisionReport:
    """Make the etcd at `endpoint` enforce `roles`: root user, one role + one user (with `passwords[user]`) per
    role, auth enabled. Idempotent: what already matches is left alone (no auth-revision bump, so running services
    keep their tokens). `tls`: the `TlsFiles` to dial an mTLS etcd with (any suite certificate will do before auth
    is on; after, the root password is what authorises)."""
    import grpc
    from aetcd import rpc as arpc

    missing = [u for u in roles if u not in passwords]
    if missing:
        raise ProvisionError(f"no password for etcd user(s) {missing}")
    report = ProvisionReport()
    ch = await _channel(endpoint, tls)
    try:
        auth = arpc.AuthStub(ch)
        md: tuple[tuple[str, str], ...] | None = None
        try:
            resp = await auth.Authenticate(arpc.AuthenticateRequest(name=ROOT_USER, password=root_password),
                                           timeout=timeout_s)
            md = (("token", resp.token),)
            report.auth_was_enabled = True
        except grpc.aio.AioRpcError as e:
            if "authentication is not enabled" not in (e.details() or ""):
                raise ProvisionError(f"etcd at {endpoint}: cannot log in as {ROOT_USER}: {_code(e)}") from e

        async def call(method: str, req: Any) -> Any:
            return await getattr(auth, method)(req, timeout=timeout_s, metadata=md)

        async def user_roles(name: str) -> list[str] | None:
            try:
                return list((await call("UserGet", arpc.AuthUserGetRequest(name=name))).roles)
            except grpc.aio.AioRpcError as e:
                if "user name not found" in (e.details() or ""):
                    return None
                raise

        async def password_ok(name: str, pw: str) -> bool:
            if not report.auth_was_enabled:
                return False  # cannot be checked while auth is off: set it (harmless: nobody holds a token yet)
            try:
                await auth.Authenticate(arpc.AuthenticateRequest(name=name, password=pw), timeout=timeout_s)
            except grpc.aio.AioRpcError:
                return False
            return True

        async def ensure_user(name: str, pw: str, want_roles: Sequence[str]) -> None:
            have = await user_roles(name)
            if have is None:
                await call("UserAdd", arpc.AuthUserAddRequest(name=name, password=pw))
                report.changes.append(f"user add {name}")
                have = []
            elif not await password_ok(name, pw):
                await call("UserChangePassword", arpc.AuthUserChangePasswordRequest(name=name, password=pw))
                report.changes.append(f"user password {name}")
            for r in want_roles:
                if r not in have:
                    await call("UserGrantRole", arpc.AuthUserGrantRoleRequest(user=name, role=r))
                    report.changes.append(f"user {name} grant role {r}")
            for r in have:
                if r not in want_roles:
                    await call("UserRevokeRole", arpc.AuthUserRevokeRoleRequest(name=name, role=r))
                    report.changes.append(f"user {name} revoke role {r}")

        await ensure_user(ROOT_USER, root_password, [ROOT_ROLE])
        existing_roles = set((await call("RoleList", arpc.AuthRoleListRequest())).roles)
        for role in roles.values():
            if role.name not in existing_roles:
                await call("RoleAdd", arpc.AuthRoleAddRequest(name=role.name))
                report.changes.append(f"role add {role.name}")
                have_perms: set[tuple[bytes, bytes, int]] = set()
            else:
                got = await call("RoleGet", arpc.AuthRoleGetRequest(role=role.name))
                have_perms = {(p.key, p.range_end, int(p.permType)) for p in got.perm}
            want = permissions(role, namespace)
            want_ranges = {(k, end): t for k, end, t in want}
            for k, end, t in sorted(want - have_perms):
                await call("RoleGrantPermission", arpc.AuthRoleGrantPermissionRequest(
                    name=role.name, perm=arpc.Permission(permType=t, key=k, range_end=end)))
                report.changes.append(f"role {role.name} grant {Perm(t).name} {k.decode(errors='replace')}")
            for k, end, t in sorted(have_perms - want):
                if (k, end) in want_ranges:
                    continue  # re-granted above with the wanted type (etcd replaces the type of a range)
                await call("RoleRevokePermission", arpc.AuthRoleRevokePermissionRequest(role=role.name, key=k,
                                                                                        range_end=end))
                report.changes.append(f"role {role.name} revoke {Perm(t).name} {k.decode(errors='replace')}")
        for name, role in roles.items():
            await ensure_user(name, passwords[name], [role.name])
        if not report.auth_was_enabled:
            await call("AuthEnable", arpc.AuthEnableRequest())
            report.changes.append("auth enable")
    except grpc.aio.AioRpcError as e:
        raise ProvisionError(f"etcd at {endpoint}: provisioning failed: {_code(e)}") from e
    finally:
        with contextlib.suppress(Exception):
            await ch.close()
    return report


async def provision_from_dir(endpoint: str | Sequence[str], secrets_dir: str | os.PathLike[str], *, namespace: str = "",
                             tls: Any = None, create: bool = True, wait_s: float = 0.0,
                             timeout_s: float = 5.0, nested: bool = False) -> ProvisionReport:
    """`provision` with the passwords of `secrets_dir` (`password_file`s; created there first when `create`).
    `wait_s`: keep retrying while etcd cannot be reached (a one-shot job started beside etcd); with several
    endpoints (members), each retry tries the next one."""
    if create:
        pw = ensure_secrets(secrets_dir, nested=nested)
    else:
        pw = {u: read_secret(password_file(secrets_dir, u, nested=nested)) for u in (ROOT_USER, *USERS)}
    endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    deadline = time.monotonic() + wait_s
    for attempt in itertools.count():
        try:
            return await provision(endpoints[attempt % len(endpoints)], root_password=pw[ROOT_USER], passwords=pw,
                                   namespace=namespace, tls=tls, timeout_s=timeout_s)
        except ProvisionError as e:
            if time.monotonic() >= deadline or ("UNAVAILABLE" not in str(e) and "DEADLINE" not in str(e)):
                raise
        await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m flowmaker.state.etcd_auth",
                                 description="Provision etcd's users, roles and key-prefix permissions for FlowMaker.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("provision", help="idempotently create the root user, a role + user per service, enable auth")
    p.add_argument("--endpoints", default=os.environ.get("FLOWMAKER_ETCD_ENDPOINTS", "127.0.0.1:2379"),
                   help="etcd client endpoints host:port, comma-separated (tried in turn while unreachable)")
    p.add_argument("--namespace", default="", help="prefix of every FlowMaker key (as FLOWMAKER_<SVC>_ETCD_NAMESPACE)")
    p.add_argument("--secrets-dir", required=True, help="<user>.password files (root and one per service)")
    p.add_argument("--no-create", action="store_true", help="use existing password files only (mounted secrets)")
    p.add_argument("--nested", action="store_true", help="<dir>/<service>/<service>.password, root's and admin's in "
                                                         "<dir>/root/, the engine-key secret in <dir>/engine/ "
                                                         "(one volume per service)")
    p.add_argument("--tls-ca", default="")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to keep retrying while etcd is unreachable")
    sub.add_parser("roles", help="print the roles and their key prefixes")
    sp = sub.add_parser("secrets", help="create the password files (and the engine-key secret) without provisioning")
    sp.add_argument("dir")
    sp.add_argument("--nested", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "secrets":
        ensure_secrets(a.dir, nested=a.nested)
        print(f"etcd auth secrets in {a.dir}: {', '.join(f'{u}{PASSWORD_SUFFIX}' for u in (ROOT_USER, *USERS))}, "
              f"{ENGINE_KEY_SECRET}")
        return
    if a.cmd == "roles":
        for role in ROLES.values():
            print(f"{role.name}: {role.doc}")
            for g in role.grants:
                print(f"  {g.perm.name:9} {g.prefix}")
        print(f"no etcd user: {', '.join(NO_ETCD_ACCESS)}")
        return
    tls = None
    if a.tls_ca or a.tls_cert or a.tls_key:
        from flowmaker.rpc.tls import TlsFiles

        tls = TlsFiles(a.tls_ca, a.tls_cert, a.tls_key)
    endpoints = [e.strip() for e in a.endpoints.split(",") if e.strip()]
    endpoint = ",".join(endpoints)
    try:
        report = asyncio.run(provision_from_dir(endpoints, a.secrets_dir, namespace=a.namespace, tls=tls,
                                                create=not a.no_create, wait_s=a.wait, nested=a.nested))
    except (ProvisionError, OSError) as e:
        print(f"etcd auth: {e}", file=sys.stderr)
        sys.exit(1)
    for c in report.changes:
        print(c)
    print(f"etcd auth at {endpoint}: {len(report.changes)} change(s); roles {', '.join(ROLES)}")


if __name__ == "__main__":
    main()
