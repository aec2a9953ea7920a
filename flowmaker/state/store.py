"""The StateStore protocol: the etcd operations FlowMaker needs, with JSON values and etags.

Semantics follow etcd v3 (and Patroni's use of it):
- every key carries `mod_revision`; it is the key's etag;
- create = transaction on `create_revision == 0` (AlreadyExists otherwise);
- update = compare-and-set on `mod_revision` (Conflict otherwise);
- `txn` commits several puts/deletes atomically iff every compare still holds, so a
  caller can re-check every key it based a decision on (a selection commit);
- keys put with a lease vanish when the lease expires; `LeaseKeeper` refreshes one
  well within its TTL;
- list a prefix, then `watch_prefix(prefix, start_revision=listing.revision + 1)`.
Connection failures surface as `flowmaker.errors.Unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from flowmaker.cancel import wait_for
from flowmaker.errors import Conflict, FlowMakerError, InvalidSpec, NotFound

log = logging.getLogger(__name__)

Json = Any  # a JSON-serialisable value (dict, list, str, number, bool, None)


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: Json
    mod_revision: int  # the etag: pass it back to cas()/delete()/Compare.unchanged()
    create_revision: int
    lease: int = 0  # 0 = not bound to a lease

    @property
    def etag(self) -> int:
        return self.mod_revision


@dataclass(frozen=True, slots=True)
class Listing:
    """A prefix read: its items (sorted by key) and the store revision they were read at."""

    items: tuple[KeyValue, ...]
    revision: int

    def by_key(self) -> dict[str, KeyValue]:
        return {kv.key: kv for kv in self.items}


@dataclass(frozen=True, slots=True)
class PrefixState:
    """What a prefix holds now, in brief (one small linearizable read): how many keys, the highest mod_revision among
    them (0 when none), and the store revision it was read at. A copy of the prefix known to reflect it exactly as of
    revision W still does now iff `max_mod_revision <= W` and it holds `count` keys: a write since W would carry a
    higher mod_revision, and a deletion since W alone would lower the count."""

    count: int
    max_mod_revision: int
    revision: int


class Target(enum.Enum):
    """What a Compare looks at (etcd's compare targets)."""

    MOD = "MOD"  # mod_revision; 0 when the key does not exist
    CREATE = "CREATE"  # create_revision; 0 when the key does not exist


class Op(enum.Enum):
    EQ = "=="
    NE = "!="
    LT = "<"
    GT = ">"


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction: `key.<target> <op> value`. Build with the helpers."""

    key: str
    target: Target
    op: Op
    value: int

    @staticmethod
    def unchanged(key: str, etag: int) -> Compare:
        """The key still has the mod_revision read earlier (etag 0 = it was absent and still is).
        Catches updates, deletes and re-creates: the check a selection commit uses."""
        return Compare(key, Target.MOD, Op.EQ, etag)

    @staticmethod
    def not_modified_since(key: str, revision: int) -> Compare:
        """mod_revision <= revision (a Listing's revision). A key deleted since also passes
        (its mod_revision reads as 0): use `unchanged` when deletion matters."""
        return Compare(key, Target.MOD, Op.LT, revision + 1)

    @staticmethod
    def absent(key: str) -> Compare:
        return Compare(key, Target.CREATE, Op.EQ, 0)

    @staticmethod
    def present(key: str) -> Compare:
        return Compare(key, Target.CREATE, Op.GT, 0)

    def holds(self, kv: KeyValue | None) -> bool:
        """Evaluate against the key's current state (None = absent), as etcd does."""
        actual = 0 if kv is None else (kv.mod_revision if self.target is Target.MOD else kv.create_revision)
        return {Op.EQ: actual == self.value, Op.NE: actual != self.value,
                Op.LT: actual < self.value, Op.GT: actual > self.value}[self.op]


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: Json
    lease: int = 0


class EventKind(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: EventKind
    key: str
    value: Json  # None for DELETE
    mod_revision: int  # for DELETE: the revision of the deletion


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int  # store revision after the txn (unchanged when it failed)
    failed: tuple[str, ...] = field(default=())  # keys whose compare did not hold


@runtime_checkable
class StateStore(Protocol):
    """Async key-value store with etcd semantics. Keys are absolute (`flowmaker.state.keys`)."""

    async def get(self, key: str) -> KeyValue | None: ...

    async def get_prefix(self, prefix: str) -> Listing: ...

    async def prefix_state(self, prefix: str) -> PrefixState:
        """The prefix's key count and highest mod_revision, without its values (`PrefixState`)."""
        ...

    async def put(self, key: str, value: Json, *, lease: int = 0) -> int:
        """Unconditional write; returns the new mod_revision."""
        ...

    async def create(self, key: str, value: Json, *, lease: int = 0) -> int:
        """Write only if absent; AlreadyExists otherwise. Returns the new mod_revision."""
        ...

    async def cas(self, key: str, value: Json, *, etag: int, lease: int = 0) -> int:
        """Write only if the key's mod_revision == etag; Conflict otherwise (NotFound if absent)."""
        ...

    async def delete(self, key: str, *, etag: int | None = None) -> bool:
        """Delete; with an etag only if unchanged (Conflict otherwise). True if a key was deleted."""
        ...

    async def delete_prefix(self, prefix: str) -> int: ...

    async def txn(self, compares: Sequence[Compare], puts: Sequence[Put] = (),
                  deletes: Sequence[str] = ()) -> TxnResult:
        """Apply puts and deletes atomically iff every compare holds. Never raises on a failed
        compare (see `commit` for the raising form); `failed` names the keys that moved."""
        ...

    async def grant_lease(self, ttl_s: int) -> int: ...

    async def refresh_lease(self, lease_id: int) -> int:
        """Keep a lease alive; returns the remaining TTL in seconds, <= 0 when it has expired."""
        ...

    async def revoke_lease(self, lease_id: int) -> None: ...

    def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        """Events under `prefix` from `start_revision` (inclusive; None = from now)."""
        ...

    async def close(self) -> None: ...


async def commit(store: StateStore, compares: Sequence[Compare], puts: Sequence[Put] = (),
                 deletes: Sequence[str] = (), *, what: str = "transaction") -> int:
    """`store.txn` that raises Conflict (ABORTED: re-read and retry) naming the keys that moved."""
    from flowmaker.errors import Conflict

    res = await store.txn(compares, puts, deletes)
    if not res.succeeded:
        raise Conflict(f"{what}: state changed concurrently ({', '.join(res.failed) or 'unknown keys'}); "
                       "re-read and retry", metadata={"keys": ",".join(res.failed)[:1000]})
    return res.revision


def check_txn_keys(puts: Sequence[Put], deletes: Sequence[str]) -> None:
    """etcd rejects a transaction that writes one key twice; say so with the key's name."""
    seen: set[str] = set()
    for k in [p.key for p in puts] + list(deletes):
        if k in seen:
            raise InvalidSpec(f"transaction writes {k!r} more than once", field="txn")
        seen.add(k)


class CasOps:
    """`cas` and the etag-guarded `delete`, built on `txn` + `get`: shared by every StateStore
    implementation so the etcd store and the in-memory one fail the same way."""

    async def txn(self, compares: Sequence[Compare], puts: Sequence[Put] = (),
                  deletes: Sequence[str] = ()) -> TxnResult:
        raise NotImplementedError

    async def get(self, key: str) -> KeyValue | None:
        raise NotImplementedError

    async def cas(self, key: str, value: Json, *, etag: int, lease: int = 0) -> int:
        res = await self.txn([Compare.unchanged(key, etag)], [Put(key, value, lease)])
        if not res.succeeded:
            if etag and await self.get(key) is None:
                raise NotFound(f"{key} no longer exists", metadata={"key": key})
            raise _changed(key, etag)
        return res.revision

    async def _delete_unchanged(self, key: str, etag: int) -> bool:
        res = await self.txn([Compare.unchanged(key, etag)], deletes=[key])
        if not res.succeeded:
            raise _changed(key, etag)
        return True


def _changed(key: str, etag: int) -> Conflict:
    return Conflict(f"{key} changed since it was read (etag {etag}); re-read and retry",
                    metadata={"key": key, "etag": str(etag)})


class LeaseKeeper:
    """Owns one lease: grants it, refreshes it every ttl/3 in the background, revokes it.

    `lost` is set (and `on_lost` awaited) when the store reports the lease expired,
    i.e. every key bound to it is gone; the owner decides whether to re-register.
    Refresh failures (store unreachable) are retried until the TTL runs out.
    """

    def __init__(self, store: StateStore, ttl_s: int,
                 on_lost: Callable[[], Awaitable[None]] | None = None) -> None:
        if ttl_s < 2:
            raise InvalidSpec(f"lease TTL must be >= 2 s, got {ttl_s}", field="lease_ttl_s")
        self.store = store
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self.id = 0
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self.id = await self.store.grant_lease(self.ttl_s)
        self.lost.clear()
        self._task = asyncio.create_task(self._run(), name=f"lease-keepalive-{self.id:x}")
        return self.id

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # Refreshing at a third of the TTL leaves two more tries before expiry.
        interval = self.ttl_s / 3.0
        last_ok = loop.time()
        while True:
            await asyncio.sleep(interval)
            try:
                remaining = await wait_for(self.store.refresh_lease(self.id), timeout=interval)
            except (FlowMakerError, TimeoutError) as e:
                if loop.time() - last_ok < self.ttl_s:
                    log.warning("lease %x refresh failed (%s); retrying", self.id, e)
                    continue
                remaining = 0
            if remaining > 0:
                last_ok = loop.time()
                continue
            log.error("lease %x expired: keys bound to it are gone", self.id)
            self.lost.set()
            if self.on_lost is not None:
                try:
                    await self.on_lost()
                except Exception:  # the callback's failure must not kill silently; log it
                    log.exception("lease-lost callback failed")
            return

    async def stop(self, *, revoke: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if revoke and self.id and not self.lost.is_set():
            try:
                await self.store.revoke_lease(self.id)
            except FlowMakerError as e:  # shutting down anyway: the TTL will clean up
                log.warning("could not revoke lease %x: %s", self.id, e)
