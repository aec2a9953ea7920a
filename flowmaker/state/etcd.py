"""StateStore on a real etcd v3 cluster through `aetcd` (asyncio); the only etcd client in the process.

Why aetcd: it is asyncio-native and works with protobuf 7 / grpcio 1.85 (etcd3 0.12 does
not import). Two etcd client libraries in one process clash on their bundled kv.proto,
so nothing else in FlowMaker may import another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import aetcd
import aetcd.exceptions as aerr
import grpc
from aetcd import rpc as arpc
from aetcd import transactions as atx
from aetcd import utils as autils

from flowmaker.cancel import wait_for
from flowmaker.errors import (
    AlreadyExists,
    Conflict,
    InvalidSpec,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from flowmaker.rpc.tls import TlsFiles
from flowmaker.state.store import (
    CasOps,
    Compare,
    EventKind,
    Json,
    KeyValue,
    Listing,
    Op,
    PrefixState,
    Put,
    Target,
    TxnResult,
    WatchEvent,
    check_txn_keys,
)

log = logging.getLogger(__name__)


def encode(value: Json) -> bytes:
    # Sorted keys and no spaces: equal values give equal bytes (etcd VALUE compares, diffs).
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes) -> Json:
    try:
        return json.loads(raw)
    except ValueError:  # written by something else than FlowMaker; hand it over as text
        return raw.decode(errors="replace")


def parse_endpoint(ep: str) -> tuple[str, int]:
    """'http://127.0.0.1:2379', '127.0.0.1:2379' or '[::1]:2379' -> (host, port)."""
    s = ep.strip()
    for scheme in ("http://", "https://"):
        if s.startswith(scheme):
            s = s[len(scheme):]
    s = s.rstrip("/")
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidSpec(f"etcd endpoint must look like host:port, got {ep!r}", field="etcd_endpoints")
    return host.strip("[]"), int(port)


def _raise_mapped(e: BaseException, what: str) -> NoReturn:
    """aetcd / gRPC failures -> FlowMaker errors. Connection trouble is Unavailable (retryable)."""
    if isinstance(e, aerr.RevisionCompactedError):
        raise Conflict(f"{what}: revision compacted below {e.compacted_revision}; re-list and watch again",
                       reason="REVISION_COMPACTED") from e
    if isinstance(e, grpc.aio.AioRpcError):
        detail = e.details() or e.code().name
        code = e.code()
    else:
        detail = str(e) or type(e).__name__
        code = None
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in detail:
        # etcd auth (flowmaker.state.etcd_auth): this identity's role does not cover the key. Not retryable.
        raise PermissionDenied(f"etcd {what}: {detail}", reason="ETCD_PERMISSION_DENIED") from e
    if "authentication failed" in detail or "user name is empty" in detail:
        raise Unauthenticated(f"etcd {what}: {detail}", reason="ETCD_UNAUTHENTICATED") from e
    if "lease not found" in detail:
        raise NotFound(f"{what}: {detail}", reason="LEASE_NOT_FOUND") from e
    if code == grpc.StatusCode.INVALID_ARGUMENT or isinstance(e, aerr.InvalidArgumentError):
        raise InvalidSpec(f"{what}: etcd rejected the request: {detail}") from e
    raise Unavailable(f"etcd {what} failed: {detail}", reason="ETCD_UNAVAILABLE") from e


_ETCD_ERRORS = (aerr.ClientError, grpc.aio.AioRpcError, OSError, TimeoutError)


# The etcd client identity of this process (mTLS to etcd), set by the service bootstrap from its
# settings (`etcd_tls`); stores created without an explicit `tls` use it when they connect.
_process_tls: TlsFiles | None = None


def configure_etcd_tls(files: TlsFiles | None) -> None:
    global _process_tls
    _process_tls = files


@dataclass(frozen=True, slots=True)
class EtcdCredentials:
    """An etcd user (flowmaker.state.etcd_auth: one per service) and its password."""

    user: str
    password: str

    def __repr__(self) -> str:  # never the password
        return f"EtcdCredentials({self.user!r})"

    @staticmethod
    def from_file(user: str, password_file: str) -> EtcdCredentials:
        with open(password_file) as f:
            return EtcdCredentials(user, f.read().strip())


# The etcd user of this process, set by the service bootstrap from its settings (`etcd_user`,
# `etcd_password_file`); stores created without explicit `auth` log in with it. None = no etcd auth.
_process_auth: EtcdCredentials | None = None


def configure_etcd_auth(creds: EtcdCredentials | None) -> None:
    global _process_auth
    _process_auth = creds


# Errors after which a fresh token (Authenticate again) makes the call work: the simple token expired
# (--auth-token-ttl seconds unused), the auth store changed, or auth was enabled after we connected. etcd refuses
# them before applying anything, so the call is safe to make again.
_RELOGIN = ("invalid auth token", "revision of auth store is old", "user name is empty")


def _needs_login(e: BaseException) -> bool:
    detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
    return any(m in (detail or "") for m in _RELOGIN)


T = TypeVar("T")


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel presenting a client certificate (aetcd itself only dials
    plaintext): the same connect, with `grpc.aio.secure_channel`."""

    def __init__(self, tls: TlsFiles, **kw: Any) -> None:
        super().__init__(**kw)
        self._tls_files = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            await wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            from aetcd import watcher as _watcher

            from flowmaker.rpc.tls import channel_credentials

            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", channel_credentials(self._tls_files),
                                                   options=list(self._options.items()))
            self.kvstub = arpc.KVStub(self.channel)
            self.clusterstub = arpc.ClusterStub(self.channel)
            self.leasestub = arpc.LeaseStub(self.channel)
            self.maintenancestub = arpc.MaintenanceStub(self.channel)
            self._watcher = _watcher.Watcher(arpc.WatchStub(self.channel), timeout=self._timeout,
                                             metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdStore(CasOps):
    """StateStore on etcd. Every key is prefixed with `namespace` (tests and parallel stacks
    get disjoint key spaces; `keys.*` stays absolute), and it is stripped again on reads."""

    def __init__(self, endpoints: Sequence[str] | str = "127.0.0.1:2379", *, namespace: str = "",
                 timeout_s: float = 5.0, tls: TlsFiles | None = None, auth: EtcdCredentials | None = None) -> None:
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        eps = [e for part in eps for e in part.split(",") if e.strip()]
        if not eps:
            raise InvalidSpec("at least one etcd endpoint is required", field="etcd_endpoints")
        self._endpoints = [parse_endpoint(e) for e in eps]
        self._ep_index = 0
        self.namespace = namespace.rstrip("/")
        self.timeout_s = timeout_s
        self._client: aetcd.Client | None = None
        self._lock = asyncio.Lock()
        self._tls = tls  # None: the process's etcd identity (configure_etcd_tls), if any, at connect time
        self._auth = auth  # None: the process's etcd user (configure_etcd_auth), if any, at connect time

    def __repr__(self) -> str:
        return f"EtcdStore({self.endpoint!r}, namespace={self.namespace!r})"

    @property
    def endpoint(self) -> str:
        host, port = self._endpoints[self._ep_index]
        return f"{host}:{port}"

    # -- plumbing -----------------------------------------------------------------------------

    def _k(self, key: str) -> bytes:
        return (self.namespace + key).encode()

    def _unk(self, raw: bytes) -> str:
        return raw.decode()[len(self.namespace):]

    def _kv(self, kv: Any) -> KeyValue:
        return KeyValue(self._unk(kv.key), decode(kv.value), kv.mod_revision, kv.create_revision, kv.lease)

    async def _c(self) -> aetcd.Client:
        async with self._lock:
            if self._client is None:
                host, port = self._endpoints[self._ep_index]
                # `timeout` bounds every unary call: a hung etcd (e.g. SIGSTOPped) becomes
                # DEADLINE_EXCEEDED -> Unavailable instead of blocking the caller forever.
                tls = self._tls or _process_tls
                if tls is not None:
                    self._client = _TlsClient(tls, host=host, port=port, timeout=self.timeout_s)  # type: ignore[arg-type]
                else:
                    self._client = aetcd.Client(host=host, port=port, timeout=self.timeout_s)  # type: ignore[arg-type]
                try:
                    await self._client.connect()
                    await self._login(self._client)
                except BaseException:
                    client, self._client = self._client, None
                    with contextlib.suppress(Exception):
                        await client.close()
                    raise
            return self._client

    @property
    def credentials(self) -> EtcdCredentials | None:
        return self._auth or _process_auth

    async def _login(self, client: aetcd.Client) -> None:
        """With an etcd user configured: get a token (etcd's Authenticate) and send it with every call from now on,
        new watch streams included. Without one, calls go unauthenticated (or as the TLS certificate's name)."""
        creds = self.credentials
        if creds is None:
            return
        try:
            resp = await arpc.AuthStub(client.channel).Authenticate(
                arpc.AuthenticateRequest(name=creds.user, password=creds.password), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if "authentication is not enabled" in (e.details() or ""):
                client.metadata = None  # auth off (not provisioned yet): plain calls work; re-login once it is on
                return
            raise
        client.metadata = (("token", resp.token),)
        # Watches share one stream per watcher, whose token is fixed when it opens: a fresh token gets a fresh
        # watcher (watches already open keep theirs).
        from aetcd import watcher as _watcher

        old = client._watcher
        client._watcher = _watcher.Watcher(arpc.WatchStub(client.channel), timeout=self.timeout_s,
                                           metadata=client.metadata)
        if old is not None and not old._callbacks:  # nothing watches through it any more
            with contextlib.suppress(Exception):
                await old.shutdown()

    async def _run(self, what: str, call: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """One etcd call; with an etcd user, an expired or stale token is renewed and the call made once more."""
        for attempt in (0, 1):
            client = None
            try:
                client = await self._c()
                return await call(client)
            except _ETCD_ERRORS as e:
                if attempt == 0 and client is not None and self.credentials is not None and _needs_login(e):
                    try:
                        await self._login(client)
                    except _ETCD_ERRORS as e2:
                        await self._failed(e2, what)
                    continue
                await self._failed(e, what)
        raise AssertionError("unreachable")

    async def _failed(self, e: BaseException, what: str) -> NoReturn:
        # Move to the next endpoint for the next call; a later call reconnects lazily.
        if len(self._endpoints) > 1 and not isinstance(e, aerr.RevisionCompactedError):
            async with self._lock:
                client, self._client = self._client, None
                self._ep_index = (self._ep_index + 1) % len(self._endpoints)
            if client is not None:
                try:
                    await client.close()
                except Exception:  # closing a broken channel may fail; nothing to do about it
                    log.debug("closing etcd client failed", exc_info=True)
        _raise_mapped(e, what)

    async def close(self) -> None:
        async with self._lock:
            client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def ping(self) -> int:
        """Read the current revision (a cheap linearizable round trip); Unavailable when down."""
        return (await self.get_prefix("/__ping__/")).revision

    # -- reads --------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        r = await self._run(f"get {key}", lambda c: c.get(self._k(key)))
        return None if r is None else self._kv(r)

    async def get_prefix(self, prefix: str) -> Listing:
        r = await self._run(f"get_prefix {prefix}", lambda c: c.get_prefix(self._k(prefix)))
        return Listing(tuple(self._kv(kv) for kv in r.kvs), r.header.revision)

    async def prefix_state(self, prefix: str) -> PrefixState:
        # One key (the newest by mod_revision, keys only) and the count of the whole range: etcd counts every key in
        # the range whatever the limit. aetcd's get_prefix has no limit, hence the raw Range.
        key = self._k(prefix)
        req = arpc.RangeRequest(key=key, range_end=autils.prefix_range_end(key), limit=1, keys_only=True,
                                sort_order=arpc.RangeRequest.DESCEND, sort_target=arpc.RangeRequest.MOD)
        r = await self._run(f"prefix_state {prefix}",
                            lambda c: c.kvstub.Range(req, timeout=self.timeout_s, metadata=c.metadata))
        return PrefixState(int(r.count), int(r.kvs[0].mod_revision) if r.kvs else 0, int(r.header.revision))

    # -- writes -------------------------------------------------------------------------------

    async def put(self, key: str, value: Json, *, lease: int = 0) -> int:
        r = await self._run(f"put {key}", lambda c: c.put(self._k(key), encode(value), lease=lease or None))
        return int(r.header.revision)

    async def create(self, key: str, value: Json, *, lease: int = 0) -> int:
        res = await self.txn([Compare.absent(key)], [Put(key, value, lease)])
        if not res.succeeded:
            raise AlreadyExists(f"{key} already exists", field="key", metadata={"key": key})
        return res.revision

    async def delete(self, key: str, *, etag: int | None = None) -> bool:
        if etag is not None:
            return await self._delete_unchanged(key, etag)
        r = await self._run(f"delete {key}", lambda c: c.delete(self._k(key)))
        return r is not None

    async def delete_prefix(self, prefix: str) -> int:
        r = await self._run(f"delete_prefix {prefix}", lambda c: c.delete_prefix(self._k(prefix)))
        return int(r.deleted)

    def _compare(self, c: Compare) -> Any:
        cmp: atx.BaseCompare = atx.Mod(self._k(c.key)) if c.target is Target.MOD else atx.Create(self._k(c.key))
        cmp.value = c.value
        cmp.op = {Op.EQ: arpc.Compare.EQUAL, Op.NE: arpc.Compare.NOT_EQUAL,
                  Op.LT: arpc.Compare.LESS, Op.GT: arpc.Compare.GREATER}[c.op]
        return cmp.build_message()

    async def txn(self, compares: Sequence[Compare], puts: Sequence[Put] = (),
                  deletes: Sequence[str] = ()) -> TxnResult:
        check_txn_keys(puts, deletes)
        # Built on the raw KV stub (not aetcd's transaction()) to keep the response header's
        # revision, which callers use as the new etag / the revision to watch from.
        success = [arpc.RequestOp(request_put=arpc.PutRequest(key=self._k(p.key), value=encode(p.value),
                                                               lease=p.lease)) for p in puts]
        success += [arpc.RequestOp(request_delete_range=arpc.DeleteRangeRequest(key=self._k(k))) for k in deletes]
        # On failure read back every compared key, so the caller learns which ones moved.
        compared = list(dict.fromkeys(c.key for c in compares))
        failure = [arpc.RequestOp(request_range=arpc.RangeRequest(key=self._k(k))) for k in compared]
        req = arpc.TxnRequest(compare=[self._compare(c) for c in compares], success=success, failure=failure)
        resp = await self._run("txn", lambda c: c.kvstub.Txn(req, timeout=self.timeout_s, metadata=c.metadata))
        if resp.succeeded:
            return TxnResult(True, int(resp.header.revision))
        current: dict[str, KeyValue] = {}
        for op in resp.responses:
            for kv in op.response_range.kvs:
                v = self._kv(kv)
                current[v.key] = v
        failed = tuple(dict.fromkeys(c.key for c in compares if not c.holds(current.get(c.key))))
        return TxnResult(False, int(resp.header.revision), failed)

    # -- leases -------------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self._run("lease grant", lambda c: c.lease(int(ttl_s)))
        return int(lease.id)

    async def refresh_lease(self, lease_id: int) -> int:
        reply = await self._run(f"lease keepalive {lease_id:x}", lambda c: c.refresh_lease(lease_id))
        # etcd answers an expired/unknown lease with TTL 0 (not an error).
        return 0 if reply is None else int(reply.TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        await self._run(f"lease revoke {lease_id:x}", lambda c: c.revoke_lease(lease_id))

    # -- watch --------------------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        if self.credentials is not None:
            # A watch etcd refuses is not an error in aetcd (it just never sees an event): check the read permission
            # (and renew a stale token, which the watch stream would carry) with a cheap read first.
            await self._run(f"watch {prefix}", lambda c: c.kvstub.Range(
                arpc.RangeRequest(key=self._k(prefix), range_end=autils.prefix_range_end(self._k(prefix)),
                                  count_only=True), timeout=self.timeout_s, metadata=c.metadata))
        try:
            client = await self._c()
            w = await client.watch(self._k(prefix), range_end=autils.prefix_range_end(self._k(prefix)),
                                   start_revision=start_revision)
        except _ETCD_ERRORS as e:
            await self._failed(e, f"watch {prefix}")
        try:
            async for ev in w:
                if ev.kind == EventKind.PUT.value:
                    yield WatchEvent(EventKind.PUT, self._unk(ev.kv.key), decode(ev.kv.value), ev.kv.mod_revision)
                else:
                    yield WatchEvent(EventKind.DELETE, self._unk(ev.kv.key), None, ev.kv.mod_revision)
        except _ETCD_ERRORS as e:
            _raise_mapped(e, f"watch {prefix}")
        finally:
            try:
                await wait_for(w.cancel(), timeout=self.timeout_s)
            except Exception:  # the stream may already be gone; nothing left to cancel
                log.debug("watch cancel failed", exc_info=True)
