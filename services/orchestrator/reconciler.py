"""The orchestrator's reconciler loop and routing cache: the I/O around `flowmaker.orchestration.reconcile`.

One loop, woken by etcd watches on tasks, instances and nodes and at least every `reconcile_interval_s`:
read one snapshot (tasks, instances, nodes, reuse references), let the pure planner decide, carry the
actions out through the Orchestrator (each in a tracked background worker, at most one per task and per
instance). An etcd outage only makes passes fail; the next pass after it sees the world as it is then.

The same snapshots and watch events keep a routing cache (task records and instance records by id, each
with the etcd revision it came from, so an older snapshot never overwrites a newer watch event). Invoke
reads routes from it, so a stalled etcd does not stall requests to tasks that already serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flowmaker import metrics
from flowmaker.errors import FlowMakerError
from flowmaker.orchestration.adapt import LoadPolicy, drifted
from flowmaker.orchestration.reconcile import Action, Kind, Memory, Observed, Policy, plan
from flowmaker.orchestration.task import TaskRecord
from flowmaker.state import keys
from flowmaker.state.records import InstanceRecord, InstanceState
from flowmaker.state.store import EventKind, StateStore

if TYPE_CHECKING:
    from services.orchestrator.orchestrator import Orchestrator

log = logging.getLogger(__name__)


class _Cache:
    """key -> (mod_revision, decoded value or None for a deletion seen by watch)."""

    def __init__(self, decode: Callable[[Any], Any]) -> None:
        self.decode = decode
        self.items: dict[str, tuple[int, Any]] = {}

    def apply(self, key: str, rev: int, raw: Any) -> None:
        cur = self.items.get(key)
        if cur is not None and cur[0] > rev:
            return
        try:
            self.items[key] = (rev, None if raw is None else self.decode(raw))
        except Exception as e:  # one unreadable record must not break routing for the others
            log.warning("ignoring unreadable record %s: %s", key, e)

    def replace(self, listing_revision: int, items: dict[str, tuple[int, Any]]) -> None:
        """Merge a full listing taken at `listing_revision`: entries a watch brought in later are kept."""
        merged: dict[str, tuple[int, Any]] = {}
        for key, (rev, raw) in items.items():
            cur = self.items.get(key)
            if cur is not None and cur[0] > listing_revision:
                merged[key] = cur
            else:
                try:
                    merged[key] = (rev, self.decode(raw))
                except Exception as e:
                    log.warning("ignoring unreadable record %s: %s", key, e)
        for key, cur in self.items.items():
            if key not in items and cur[0] > listing_revision:
                merged[key] = cur  # created (or deleted) after the listing
        self.items = merged

    def values(self) -> dict[str, Any]:
        return {k: v for k, (_, v) in self.items.items() if v is not None}


class Reconciler:
    def __init__(self, orch: Orchestrator, store: StateStore, policy: Policy, *, interval_s: float,
                 heal: bool = True, load_policy: LoadPolicy | None = None) -> None:
        self.orch = orch
        self.store = store
        self.policy = policy
        self.interval_s = interval_s
        self.heal = heal
        self.memory = Memory()
        self.load_policy = load_policy  # None: deploy-once (no re-selection for load)
        self._drift_since: dict[str, float] = {}
        self._tasks = _Cache(TaskRecord.from_json)
        self._instances = _Cache(InstanceRecord.from_json)
        self._kick = asyncio.Event()
        self._loops: list[asyncio.Task[Any]] = []
        self._actions: set[asyncio.Task[Any]] = set()
        self.synced = asyncio.Event()  # set after the first successful pass
        self._probing: set[str] = set()  # instances whose engine a probe is on (`_probe_cut_off`)
        self.probe_timeout_s = 1.0
        self.passes = 0

    # ---- routing cache -----------------------------------------------------------------------

    def task(self, task_id: str) -> TaskRecord | None:
        hit = self._tasks.items.get(keys.task(task_id))
        return hit[1] if hit is not None else None

    def instance(self, iid: str) -> InstanceRecord | None:
        hit = self._instances.items.get(keys.instance(iid))
        return hit[1] if hit is not None else None

    @property
    def fresh(self) -> bool:
        return self.synced.is_set()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._loops = [asyncio.create_task(self._run())]
        for prefix in (keys.TASKS, keys.INSTANCES, keys.NODES):
            self._loops.append(asyncio.create_task(self._watch(prefix)))

    async def stop(self) -> None:
        for t in (*self._loops, *self._actions):
            t.cancel()
        await asyncio.gather(*self._loops, *self._actions, return_exceptions=True)
        self._loops.clear()

    def kick(self) -> None:
        self._kick.set()

    async def _watch(self, prefix: str) -> None:
        delay = 0.2
        while True:
            try:
                async for ev in self.store.watch_prefix(prefix):
                    delay = 0.2
                    raw = ev.value if ev.kind is EventKind.PUT else None
                    if prefix == keys.TASKS:
                        self._tasks.apply(ev.key, ev.mod_revision, raw)
                    elif prefix == keys.INSTANCES:
                        self._instances.apply(ev.key, ev.mod_revision, raw)
                    self._kick.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd gone or restarted: watch again; the periodic pass resyncs
                log.debug("watch %s ended: %s", prefix, e)
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, 5.0)
            self._kick.set()

    async def _run(self) -> None:
        while True:
            self._kick.clear()
            try:
                with metrics.time_reconcile("orchestrator"):  # flowmaker_reconcile_duration_seconds
                    await self.pass_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd unavailable (or a bug): the next pass tries again
                log.warning("reconcile pass failed: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.interval_s)
            await asyncio.sleep(0.05)  # coalesce a burst of watch events into one pass

    # ---- one pass ----------------------------------------------------------------------------

    async def observe(self) -> Observed:
        tasks_l = await self.store.get_prefix(keys.TASKS)
        inst_l = await self.store.get_prefix(keys.INSTANCES)
        nodes_l = await self.store.get_prefix(keys.NODES)
        refs_l = await self.store.get_prefix(keys.REUSE)
        self._tasks.replace(tasks_l.revision, {kv.key: (kv.mod_revision, kv.value) for kv in tasks_l.items})
        self._instances.replace(inst_l.revision, {kv.key: (kv.mod_revision, kv.value) for kv in inst_l.items})
        refs: dict[str, set[str]] = {}
        for kv in refs_l.items:
            iid, tid = keys.parse_reuse(kv.key)
            refs.setdefault(iid, set()).add(tid)
        tasks = {t.id: t for t in self._tasks.values().values()}
        instances = {i.id: i for i in self._instances.values().values()}
        return Observed(tasks, instances, frozenset(keys.parse_node(kv.key) for kv in nodes_l.items),
                        {i: frozenset(ts) for i, ts in refs.items()})

    async def pass_once(self) -> list[Action]:
        obs = await self.observe()
        self.synced.set()
        self.passes += 1
        self.memory.busy_tasks = self.orch.busy_tasks()
        now = time.time()
        self._probe_cut_off(obs, now)
        actions = plan(obs, self.memory, now, self.policy)
        if not self.heal:
            return actions
        for a in actions:
            self._carry_out(a)
        if self.load_policy is not None:
            busy = self.memory.busy_tasks
            loads = {tid: ld for tid in obs.tasks if tid not in busy
                     and (ld := self.orch.observed_load(tid, now)) is not None}
            for tid, rate, why in drifted({t: x for t, x in obs.tasks.items() if t not in busy}, loads,
                                          self._drift_since, now, self.load_policy):
                log.warning("reconcile: RESELECT_FOR_LOAD %s (%s)", tid, why)
                self.orch.start_worker(tid, self.orch.reselect_for_load(tid, rate, why))
        return actions

    def answers(self, iid: str) -> bool:
        """Whether the engine of `iid`, an instance on a node out of the live cluster, answered its last probe
        recently: it may still be routed to (a LOST instance that serves)."""
        return self.memory.answers(iid, time.time(), self.policy.lost_answer_fresh_s)

    def _probe_cut_off(self, obs: Observed, now: float) -> None:
        """Probe, in the background, the engines of instances whose node is out of the live cluster (a stalled
        agent, a lease lost to an etcd outage): an engine that still answers keeps serving its tasks while they
        move off it (`Kind.MOVE_OFF_LOST`). Probing starts when the node goes missing, well before the grace
        after which its instances are marked LOST, so the answer is known by then."""
        cut_off = {iid: r.endpoint for iid, r in obs.instances.items() if r.node not in obs.nodes and r.endpoint
                   and r.state in (InstanceState.READY, InstanceState.LOST)}
        for iid in list(self.memory.answering):
            if iid not in cut_off:
                del self.memory.answering[iid]
        for iid, endpoint in cut_off.items():
            if iid in self._probing:
                continue
            self._probing.add(iid)

            async def probe(iid: str = iid, endpoint: str = endpoint) -> None:
                try:
                    if await self.orch.engines.alive(endpoint, timeout_s=self.probe_timeout_s):
                        self.memory.answering[iid] = time.time()
                    else:
                        self.memory.answering.pop(iid, None)
                finally:
                    self._probing.discard(iid)
            self._spawn(probe())

    def note_task(self, t: TaskRecord) -> None:
        """A record this process has just written: visible to routing now (the watch event follows)."""
        key = keys.task(t.id)
        cur = self._tasks.items.get(key)
        self._tasks.items[key] = (cur[0] if cur else 0, t)

    def _carry_out(self, a: Action) -> None:
        if a.kind not in (Kind.RESUME_SELECT, Kind.RESUME_DEPLOY, Kind.RESUME_DELETE, Kind.CLEAR_HEALING):
            log.warning("reconcile: %s %s%s", a.kind.value, a.task_id or a.instance_id,
                        f" ({a.detail})" if a.detail else "")
        o = self.orch
        if a.kind is Kind.RESTART:
            self.memory.busy_instances.add(a.instance_id)
            self.memory.restarts[a.instance_id].append(time.time())
            self._spawn(o.restart_instance(a.instance_id, a.task_ids, a.detail),
                        done=lambda: self.memory.busy_instances.discard(a.instance_id))
        elif a.kind is Kind.MARK_LOST:
            self._spawn(o.mark_lost(a.instance_id, a.detail))
        elif a.kind is Kind.RESELECT:
            o.start_worker(a.task_id, o.reselect(a.task_id, a.detail))
        elif a.kind is Kind.CLEAR_HEALING:
            self._spawn(o.clear_healing(a.task_id))
        elif a.kind is Kind.RESUME_SELECT:
            o.start_worker(a.task_id, o.select_commit_deploy(a.task_id))
        elif a.kind is Kind.RESUME_DEPLOY:
            o.start_worker(a.task_id, o.deploy(a.task_id))
        elif a.kind is Kind.RESUME_DELETE:
            o.start_worker(a.task_id, o.finish_delete(a.task_id))
        elif a.kind is Kind.ROLLBACK_DEPLOY:
            o.start_worker(a.task_id, o.rollback(a.task_id, a.detail))
        elif a.kind is Kind.RELEASE_TASK_REFS:
            o.start_worker(a.task_id, o.release_failed(a.task_id))
        elif a.kind is Kind.DROP_REF:
            self._spawn(o.drop_reference(a.instance_id, a.task_ids[0], a.node))
        elif a.kind is Kind.STOP_ORPHAN:
            self._spawn(o.stop_orphan(a.instance_id, a.node))
        elif a.kind is Kind.RESUME_SWITCH:
            o.start_worker(a.task_id, o.switch_variant(a.task_id))
        elif a.kind is Kind.MOVE_OFF_LOST:
            t = self.task(a.task_id)
            o.start_worker(a.task_id, o.reselect_for_load(a.task_id, t.plan_rate_rps if t else 0.0, a.detail))
        elif a.kind is Kind.REPLAN_DEPLOY:
            o.replan_deploy(a.task_id, a.detail)
        elif a.kind is Kind.ABORT_SWITCH:
            o.start_worker(a.task_id, o.abort_switch(a.task_id, a.detail))

    def _spawn(self, coro: Any, done: Callable[[], None] | None = None) -> None:
        async def run() -> None:
            try:
                await coro
            except FlowMakerError as e:
                log.warning("reconcile action failed: %s", e)
            except Exception:
                log.exception("reconcile action failed")
            finally:
                if done is not None:
                    done()
                self._kick.set()
        t = asyncio.create_task(run())
        self._actions.add(t)
        t.add_done_callback(self._actions.discard)
