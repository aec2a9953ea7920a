"""In-process StateStore with etcd's revision semantics, for pure unit tests only (never in a service)."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from flowmaker.errors import AlreadyExists, NotFound
from flowmaker.state.store import (
    CasOps,
    Compare,
    EventKind,
    Json,
    KeyValue,
    Listing,
    PrefixState,
    Put,
    TxnResult,
    WatchEvent,
    check_txn_keys,
)


@dataclass
class _Lease:
    ttl_s: int
    deadline: float


class MemoryStore(CasOps):
    """Single global revision, mod/create revisions per key, leases expiring on the loop clock
    (checked on every call, or force with `expire_lease`), prefix watches with history replay."""

    def __init__(self) -> None:
        self.revision = 1  # etcd starts at 1 on an empty cluster
        self._data: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x1000)
        self._history: list[WatchEvent] = []
        self._changed = asyncio.Condition()
        self.closed = False

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    @staticmethod
    def _copy(value: Json) -> Json:
        # Round-trip through JSON: the same values etcd would accept, and no aliasing.
        return json.loads(json.dumps(value))

    def _expire(self) -> list[WatchEvent]:
        now = self._now()
        dead = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        events: list[WatchEvent] = []
        for lid in dead:
            events += self._drop_lease(lid)
        return events

    def _drop_lease(self, lease_id: int) -> list[WatchEvent]:
        self._leases.pop(lease_id, None)
        keys = [k for k, kv in self._data.items() if kv.lease == lease_id]
        if not keys:
            return []
        self.revision += 1
        events = []
        for k in keys:
            del self._data[k]
            events.append(WatchEvent(EventKind.DELETE, k, None, self.revision))
        return events

    async def _publish(self, events: list[WatchEvent]) -> None:
        if events:
            self._history += events
            async with self._changed:
                self._changed.notify_all()

    def _apply_put(self, p: Put, rev: int) -> WatchEvent:
        if p.lease and p.lease not in self._leases:
            raise NotFound(f"lease {p.lease:x} not found", reason="LEASE_NOT_FOUND")
        old = self._data.get(p.key)
        self._data[p.key] = KeyValue(p.key, self._copy(p.value), rev, old.create_revision if old else rev, p.lease)
        return WatchEvent(EventKind.PUT, p.key, self._copy(p.value), rev)

    # -- StateStore ---------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        await self._publish(self._expire())
        kv = self._data.get(key)
        return None if kv is None else copy.deepcopy(kv)

    async def get_prefix(self, prefix: str) -> Listing:
        await self._publish(self._expire())
        items = tuple(copy.deepcopy(kv) for k, kv in sorted(self._data.items()) if k.startswith(prefix))
        return Listing(items, self.revision)

    async def prefix_state(self, prefix: str) -> PrefixState:
        await self._publish(self._expire())
        revs = [kv.mod_revision for k, kv in self._data.items() if k.startswith(prefix)]
        return PrefixState(len(revs), max(revs, default=0), self.revision)

    async def put(self, key: str, value: Json, *, lease: int = 0) -> int:
        return (await self.txn([], [Put(key, value, lease)])).revision

    async def create(self, key: str, value: Json, *, lease: int = 0) -> int:
        res = await self.txn([Compare.absent(key)], [Put(key, value, lease)])
        if not res.succeeded:
            raise AlreadyExists(f"{key} already exists", field="key", metadata={"key": key})
        return res.revision

    async def delete(self, key: str, *, etag: int | None = None) -> bool:
        if etag is not None:
            return await self._delete_unchanged(key, etag)
        existed = key in self._data
        await self.txn([], deletes=[key])
        return existed

    async def delete_prefix(self, prefix: str) -> int:
        keys = [k for k in self._data if k.startswith(prefix)]
        await self.txn([], deletes=keys)
        return len(keys)

    async def txn(self, compares: Sequence[Compare], puts: Sequence[Put] = (),
                  deletes: Sequence[str] = ()) -> TxnResult:
        check_txn_keys(puts, deletes)
        events = self._expire()
        failed = tuple(dict.fromkeys(c.key for c in compares if not c.holds(self._data.get(c.key))))
        if failed:
            await self._publish(events)
            return TxnResult(False, self.revision, failed)
        for p in puts:
            if p.lease and p.lease not in self._leases:
                raise NotFound(f"lease {p.lease:x} not found", reason="LEASE_NOT_FOUND")
        touched = [k for k in deletes if k in self._data]
        if puts or touched:
            # Like etcd, a txn that changes nothing does not bump the revision.
            self.revision += 1
            rev = self.revision
            for k in touched:
                del self._data[k]
                events.append(WatchEvent(EventKind.DELETE, k, None, rev))
            events += [self._apply_put(p, rev) for p in puts]
        await self._publish(events)
        return TxnResult(True, self.revision)

    async def grant_lease(self, ttl_s: int) -> int:
        lid = next(self._lease_ids)
        self._leases[lid] = _Lease(ttl_s, self._now() + ttl_s)
        return lid

    async def refresh_lease(self, lease_id: int) -> int:
        await self._publish(self._expire())
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        lease.deadline = self._now() + lease.ttl_s
        return lease.ttl_s

    async def revoke_lease(self, lease_id: int) -> None:
        if lease_id not in self._leases:
            raise NotFound(f"lease {lease_id:x} not found", reason="LEASE_NOT_FOUND")
        await self._publish(self._drop_lease(lease_id))

    async def expire_lease(self, lease_id: int) -> None:
        """Test hook: the lease runs out now."""
        await self._publish(self._drop_lease(lease_id))

    async def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        start = self.revision + 1 if start_revision is None else start_revision
        pos = 0
        while True:
            while pos < len(self._history):
                ev = self._history[pos]
                pos += 1
                if ev.mod_revision >= start and ev.key.startswith(prefix):
                    yield ev
            async with self._changed:
                if pos >= len(self._history):
                    await self._changed.wait()

    async def close(self) -> None:
        self.closed = True
