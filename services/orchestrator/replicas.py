"""The replicas' board: each orchestrator replica publishes a record (its id, address, the load it measured per
task and its engine calls in flight per instance) under `keys.orchestrator_replica`, bound to its own lease (so it goes when the replica dies),
rewritten when it changes; each replica reads the others' every second.

Requests are spread over the replicas, so each meters only its share of a task's arrivals. The load follower
(on the leader) and GetTask's observed rate read the sum (`load`), not this replica's share; a switch drains an old
instance of every replica's calls (`inflight_elsewhere`), not only the leader's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from flowmaker.errors import FlowMakerError
from flowmaker.orchestration.adapt import ArrivalMeter, TaskLoad, combined
from flowmaker.state import keys
from flowmaker.state.store import LeaseKeeper, StateStore

log = logging.getLogger(__name__)

class ReplicaBoard:
    def __init__(self, store: StateStore, replica_id: str, arrivals: ArrivalMeter, inflight: Mapping[str, int], *,
                 time_scale: float,
                 interval_s: float, ttl_s: int, identity: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self.replica_id = replica_id
        self.arrivals = arrivals
        self.inflight = inflight  # the router's engine calls in flight per instance
        self.time_scale = time_scale
        self.interval_s = interval_s
        self.identity = identity  # this replica's id and address, as published (the leader is in the leader key)
        self.ttl_s = max(2, ttl_s)
        self._lease = LeaseKeeper(store, self.ttl_s)
        self.peers: dict[str, dict[str, Any]] = {}  # replica id -> its last record (not this replica's)
        self._published: dict[str, Any] | None = None
        self.published = asyncio.Event()  # set once the record is written
        self._published_lease = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(Exception):
            await self._lease.stop()  # revoked: the record goes at once

    def own_loads(self, now: float) -> dict[str, TaskLoad]:
        return {tid: ld for tid in self.arrivals.tasks()
                if (ld := self.arrivals.load(tid, now, self.time_scale)) is not None}

    def load(self, task_id: str, now: float) -> TaskLoad | None:
        """The task's load over every replica: this one's meter plus the fresh records of the others."""
        parts = []
        own = self.arrivals.load(task_id, now, self.time_scale)
        if own is not None:
            parts.append(own)
        for rec in self.peers.values():  # a replica that died: its record went with its lease
            x = rec.get("loads", {}).get(task_id)
            if isinstance(x, list) and len(x) in (3, 4):  # (a replica of an older version publishes 3)
                parts.append(TaskLoad(float(x[0]), float(x[1]), int(x[2]), float(x[3]) if len(x) == 4 else 0.0))
        return combined(parts)

    def inflight_elsewhere(self, iid: str) -> int:
        """Engine calls in flight to `iid` from the other replicas, as they last published them."""
        return sum(int(rec.get("inflight", {}).get(iid, 0)) for rec in self.peers.values())

    async def _run(self) -> None:
        while True:
            try:
                await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd unavailable: this replica's share is missing from the sum meanwhile
                log.debug("replica record not published: %s", e)
            await asyncio.sleep(self.interval_s)

    async def publish(self) -> None:
        if not self._lease.id or self._lease.lost.is_set():
            await self._lease.start()
        now = time.time()
        loads = {tid: [round(ld.rate_rps, 4), round(ld.latency_q_s, 4), ld.samples, round(ld.burst_rps, 4)]
                 for tid, ld in self.own_loads(now).items()}
        record = {**self.identity(), "loads": loads,
                  "inflight": {iid: n for iid, n in sorted(self.inflight.items()) if n > 0}}
        try:
            # Written when it changed (or the lease is new): an idle replica writes nothing.
            if record != self._published or self._lease.id != self._published_lease:
                await self.store.put(keys.orchestrator_replica(self.replica_id), record, lease=self._lease.id)
                self._published, self._published_lease = record, self._lease.id
                self.published.set()
        except FlowMakerError:
            # Maybe a lease etcd no longer knows (it lapsed in an outage): a new one next time.
            await self._lease.stop(revoke=False)
            self._lease = LeaseKeeper(self.store, self.ttl_s)
            raise
        listing = await self.store.get_prefix(keys.ORCHESTRATORS + "replicas/")
        self.peers = {str(kv.value.get("replica", kv.key)): kv.value for kv in listing.items
                      if isinstance(kv.value, dict) and kv.value.get("replica") != self.replica_id}
