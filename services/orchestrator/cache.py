"""The watch-fed cache every orchestrator replica keeps: task records, instance records, live nodes, task owners,
task names, and the users and bearer-token digests created live (services/orchestrator/users.py).

Fed by etcd watches and by full listings (its own periodic resync, and the reconciler's snapshots on the leader),
each entry with the etcd revision it came from, so an older listing never overwrites a newer watch event. Invoke
routes from it and authorizes from it, ListTasks reads it: a stalled etcd does not stall requests to tasks that
already serve, and none of them costs an etcd round trip.

A listing must also show what another replica wrote a moment ago (read-your-writes across replicas), so ListTasks
first asks etcd how the task and owner prefixes stand now (`catch_up`: one small read, counts and the newest
mod_revision, no values) and waits until the cache has caught up, as Kubernetes' API server serves consistent
reads from its watch cache. Each watch starts from a listing, so its stream has no gap and the cache knows the
revision through which it holds a prefix exactly (`_Cache.through`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from flowmaker.cancel import wait_for
from flowmaker.errors import FlowMakerError
from flowmaker.orchestration.reconcile import Observed
from flowmaker.orchestration.task import TaskRecord
from flowmaker.state import keys
from flowmaker.state.records import InstanceRecord
from flowmaker.state.store import EventKind, PrefixState, StateStore

log = logging.getLogger(__name__)

# `catch_up`: how long etcd may take to say how a prefix stands (past it, etcd is the one behind: the cache's word
# stands, as when etcd is down), and how long the cache may then take to catch up (past it, the caller lists etcd).
CATCH_UP_ASK_S = 0.5
CATCH_UP_WAIT_S = 1.0
CATCH_UP_POLL_S = 0.005
CATCH_UP_RESYNC_S = 5.0  # the fallback listing's bound


class _Cache:
    """key -> (mod_revision, decoded value or None for a deletion seen by watch)."""

    def __init__(self, decode: Callable[[Any], Any]) -> None:
        self.decode = decode
        self.items: dict[str, tuple[int, Any]] = {}
        self.version = 0  # bumped on every change (indexes over the values rebuild when it moves)
        # The revision through which this copy holds its prefix exactly: the latest listing merged in, or watch event
        # applied (each watch starts right after a listing, so its events follow with no gap). 0: not yet known.
        self.through = 0
        # Keys whose latest record did not decode (revision): left out of the values, counted by `holds` (etcd
        # counts them), so that one unreadable record does not make every catch-up fall back to a listing.
        self.unreadable: dict[str, int] = {}

    def holds(self, now: PrefixState) -> bool:
        """Whether this copy holds the prefix as it stands in `now` (see `PrefixState`)."""
        if now.max_mod_revision > self.through:
            return False
        live = {k for k, (_, v) in self.items.items() if v is not None}
        return len(live | self.unreadable.keys()) == now.count

    def apply(self, key: str, rev: int, raw: Any) -> None:
        cur = self.items.get(key)
        if cur is not None and cur[0] > rev:
            return
        try:
            self.items[key] = (rev, None if raw is None else self.decode(raw))
            self.unreadable.pop(key, None)
        except Exception as e:  # one unreadable record must not break routing for the others
            log.warning("ignoring unreadable record %s: %s", key, e)
            self.unreadable[key] = rev
        self.version += 1

    def replace(self, listing_revision: int, items: dict[str, tuple[int, Any]]) -> None:
        """Merge a full listing taken at `listing_revision`: entries a watch brought in later are kept."""
        merged: dict[str, tuple[int, Any]] = {}
        bad = dict(self.unreadable)
        for key, (rev, raw) in items.items():
            cur = self.items.get(key)
            if cur is not None and cur[0] > listing_revision:
                merged[key] = cur
            else:
                try:
                    merged[key] = (rev, self.decode(raw))
                    bad.pop(key, None)
                except Exception as e:
                    log.warning("ignoring unreadable record %s: %s", key, e)
                    bad[key] = rev
        for key, cur in self.items.items():
            if key not in items and cur[0] > listing_revision:
                merged[key] = cur  # created (or deleted) after the listing
        self.unreadable = {k: r for k, r in bad.items() if k in items or r > listing_revision}
        self.items = merged
        self.version += 1
        self.through = max(self.through, listing_revision)

    def get(self, key: str) -> Any:
        hit = self.items.get(key)
        return hit[1] if hit is not None else None

    def values(self) -> dict[str, Any]:
        return {k: v for k, (_, v) in self.items.items() if v is not None}


def _owner_of(value: Any) -> str:
    return str(value.get("owner", "")) if isinstance(value, dict) else ""


class RoutingCache:
    def __init__(self, store: StateStore, *, resync_s: float = 10.0) -> None:
        self.store = store
        self.resync_s = resync_s
        self._tasks = _Cache(TaskRecord.from_json)
        self._instances = _Cache(InstanceRecord.from_json)
        self._nodes = _Cache(lambda v: v)
        self._owners = _Cache(_owner_of)
        self._names = _Cache(lambda v: str(v.get("task_id", "")) if isinstance(v, dict) else "")
        self._users = _Cache(lambda v: v if isinstance(v, dict) else {})
        self._tokens = _Cache(lambda v: v if isinstance(v, dict) else {})
        self._by_owner: dict[str, set[str]] = {}
        self._by_owner_version = -1
        self.changed = asyncio.Event()  # set by every watch event (and `kick`): the reconciler looks again
        self.synced = asyncio.Event()  # set after the first full listing
        self._last_listing = 0.0
        self._loops: list[asyncio.Task[Any]] = []

    # ---- reads -------------------------------------------------------------------------------

    def task(self, task_id: str) -> TaskRecord | None:
        t: TaskRecord | None = self._tasks.get(keys.task(task_id))
        return t

    def instance(self, iid: str) -> InstanceRecord | None:
        rec: InstanceRecord | None = self._instances.get(keys.instance(iid))
        return rec

    def task_entry(self, task_id: str) -> tuple[int, TaskRecord | None]:
        """(the revision the cache has the task at, the record or None when deleted); (0, None) when unseen."""
        hit = self._tasks.items.get(keys.task(task_id))
        return hit if hit is not None else (0, None)

    def task_entries(self, ids: set[str] | None = None) -> list[tuple[int, TaskRecord]]:
        """(revision, record) of every task the cache holds, or of those in `ids` (looked up, not scanned)."""
        if ids is None:
            return [(rev, t) for rev, t in self._tasks.items.values() if t is not None]
        hits = (self._tasks.items.get(keys.task(i)) for i in ids)
        return [(h[0], h[1]) for h in hits if h is not None and h[1] is not None]

    def live_nodes(self) -> set[str]:
        return {keys.parse_node(k) for k in self._nodes.values()}

    def owner(self, task_id: str) -> str | None:
        """The task's owner; None when the cache has no owner key for it ("" for an unreadable one)."""
        return self._owners.get(keys.owner(task_id))

    def named(self, owner: str, name: str) -> str | None:
        """The id of `owner`'s task named `name`; None when the cache knows of none."""
        tid: str | None = self._names.get(keys.task_name(owner, name))
        return tid or None

    def tasks_of(self, owner: str) -> set[str]:
        """The ids of the tasks `owner` owns (an index over the owner keys, rebuilt when they change)."""
        if self._by_owner_version != self._owners.version:
            idx: dict[str, set[str]] = {}
            for k, name in self._owners.values().items():
                idx.setdefault(name, set()).add(keys.parse_owner(k))
            self._by_owner, self._by_owner_version = idx, self._owners.version
        return self._by_owner.get(owner, set())

    def user(self, user_id: str) -> dict[str, Any] | None:
        """A live user's record ({id, name, admin, create_time}); None when unknown or deleted."""
        u: dict[str, Any] | None = self._users.get(keys.user(user_id))
        return u

    def token(self, digest: str) -> dict[str, Any] | None:
        """A live token's record ({token_id, user_id, expire_time, create_time}) by digest; None when unknown."""
        t: dict[str, Any] | None = self._tokens.get(keys.token(digest))
        return t

    def note_user(self, key: str, rev: int, value: dict[str, Any] | None) -> None:
        """This process wrote (or deleted, value None) a user or token key: effective here at once."""
        (self._users if key.startswith(keys.USERS) else self._tokens).apply(key, rev, value)

    @property
    def fresh(self) -> bool:
        return self.synced.is_set()

    # ---- writes this process made (visible at once; the watch event follows) ------------------

    def note_task(self, t: TaskRecord, rev: int) -> None:
        """This process wrote `t` at revision `rev`: an entry a watch event brought in at a later revision is newer
        than this write and stays."""
        key = keys.task(t.id)
        cur = self._tasks.items.get(key)
        if cur is not None and cur[0] > rev:
            return
        self._tasks.items[key] = (rev, t)
        self._tasks.version += 1

    def note_name(self, owner: str, name: str, task_id: str, rev: int = 0) -> None:
        self._names.apply(keys.task_name(owner, name), rev, {"task_id": task_id})

    def note_deleted(self, task_id: str) -> None:
        """This process deleted the task: gone from listings at once (the watch event confirms it)."""
        key = keys.task(task_id)
        cur = self._tasks.items.get(key)
        if cur is not None:
            self._tasks.items[key] = (cur[0] + 1, None)
            self._tasks.version += 1

    def note_owner(self, task_id: str, owner: str, rev: int = 0) -> None:
        self._owners.apply(keys.owner(task_id), rev, {"owner": owner})

    def note_owner_deleted(self, task_id: str) -> None:
        key = keys.owner(task_id)
        cur = self._owners.items.get(key)
        if cur is not None:
            self._owners.apply(key, cur[0] + 1, None)

    # ---- feeding -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._loops:
            return
        self._loops = [asyncio.create_task(self._resync_loop())]
        for prefix in (keys.TASKS, keys.INSTANCES, keys.NODES, keys.OWNERS, keys.TASK_NAMES, keys.USERS, keys.TOKENS):
            self._loops.append(asyncio.create_task(self._watch(prefix)))

    async def stop(self) -> None:
        for t in self._loops:
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops.clear()

    def kick(self) -> None:
        self.changed.set()

    def _cache_of(self, prefix: str) -> _Cache:
        return {keys.TASKS: self._tasks, keys.INSTANCES: self._instances, keys.NODES: self._nodes,
                keys.OWNERS: self._owners, keys.TASK_NAMES: self._names, keys.USERS: self._users,
                keys.TOKENS: self._tokens}[prefix]

    async def _watch(self, prefix: str) -> None:
        delay = 0.2
        cache = self._cache_of(prefix)
        while True:
            try:
                # List, then watch from the revision after the listing: the stream misses nothing in between, so
                # `through` may follow its events (a watch "from now" after a failure would skip what happened
                # while it was down).
                listing = await self.store.get_prefix(prefix)
                cache.replace(listing.revision, {kv.key: (kv.mod_revision, kv.value) for kv in listing.items})
                async for ev in self.store.watch_prefix(prefix, start_revision=listing.revision + 1):
                    delay = 0.2
                    cache.apply(ev.key, ev.mod_revision, ev.value if ev.kind is EventKind.PUT else None)
                    cache.through = max(cache.through, ev.mod_revision)
                    self.changed.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd gone or restarted: watch again; the periodic listing resyncs
                log.debug("watch %s ended: %s", prefix, e)
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, 5.0)
            self.changed.set()

    async def _resync_loop(self) -> None:
        while True:
            if time.monotonic() - self._last_listing >= self.resync_s or not self.synced.is_set():
                try:
                    await self.resync()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # etcd unavailable: the watches' word stands until it answers
                    log.debug("cache resync failed: %s", e)
            await asyncio.sleep(min(self.resync_s, 1.0) if not self.synced.is_set() else self.resync_s / 2)

    async def resync(self) -> None:
        """List tasks, instances, nodes, owners, task names, users and tokens once (every replica, leader or not)."""
        await self.observe()
        for prefix, cache in ((keys.OWNERS, self._owners), (keys.TASK_NAMES, self._names), (keys.USERS, self._users),
                              (keys.TOKENS, self._tokens)):
            listing = await self.store.get_prefix(prefix)
            cache.replace(listing.revision, {kv.key: (kv.mod_revision, kv.value) for kv in listing.items})

    async def catch_up(self, prefixes: tuple[str, ...] = (keys.TASKS, keys.OWNERS), *,
                       ask_s: float = CATCH_UP_ASK_S, wait_s: float = CATCH_UP_WAIT_S) -> None:
        """Return once the cache holds `prefixes` as etcd holds them now, so that a read from it shows every write
        made before the call, through any replica. When etcd does not say within `ask_s` (down, or stalled), the
        cache's word stands (reads keep working while etcd is away); when the cache has not caught up `wait_s`
        after etcd answered, it lists them from etcd (`resync`)."""
        if not self.fresh:
            return  # the caller reads etcd itself until the first listing
        try:
            now = await wait_for(asyncio.gather(*(self.store.prefix_state(p) for p in prefixes)), ask_s)
        except (FlowMakerError, TimeoutError) as e:
            log.debug("catch-up: etcd did not say how %s stand (%s); reading the cache as it is", prefixes, e)
            return
        deadline = time.monotonic() + wait_s
        while not all(self._cache_of(p).holds(st) for p, st in zip(prefixes, now, strict=True)):
            if time.monotonic() >= deadline:
                log.info("catch-up: the cache is behind etcd on %s after %gs; listing them", prefixes, wait_s)
                try:  # bounded: a slow etcd must not hold the listing for the resync's every prefix
                    await wait_for(self.resync(), CATCH_UP_RESYNC_S)
                except (FlowMakerError, TimeoutError, ValueError) as e:
                    log.warning("catch-up: listing from etcd failed (%s); reading the cache as it is", e)
                return
            await asyncio.sleep(CATCH_UP_POLL_S)

    async def observe(self) -> Observed:
        """One snapshot of tasks, instances, live nodes and reuse references (the reconciler's), merged in."""
        tasks_l = await self.store.get_prefix(keys.TASKS)
        inst_l = await self.store.get_prefix(keys.INSTANCES)
        nodes_l = await self.store.get_prefix(keys.NODES)
        refs_l = await self.store.get_prefix(keys.REUSE)
        self._tasks.replace(tasks_l.revision, {kv.key: (kv.mod_revision, kv.value) for kv in tasks_l.items})
        self._instances.replace(inst_l.revision, {kv.key: (kv.mod_revision, kv.value) for kv in inst_l.items})
        self._nodes.replace(nodes_l.revision, {kv.key: (kv.mod_revision, kv.value) for kv in nodes_l.items})
        self._last_listing = time.monotonic()
        self.synced.set()
        refs: dict[str, set[str]] = {}
        for kv in refs_l.items:
            iid, tid = keys.parse_reuse(kv.key)
            refs.setdefault(iid, set()).add(tid)
        tasks = {t.id: t for t in self._tasks.values().values()}
        instances = {i.id: i for i in self._instances.values().values()}
        return Observed(tasks, instances, frozenset(keys.parse_node(kv.key) for kv in nodes_l.items),
                        {i: frozenset(ts) for i, ts in refs.items()})

