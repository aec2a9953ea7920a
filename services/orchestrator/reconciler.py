"""The reconciler loop, run by the elected leader: the I/O around `flowmaker.orchestration.reconcile`.

One loop, woken by the routing cache's etcd watches (tasks, instances, nodes) and at least every
`reconcile_interval_s`: read one snapshot (tasks, instances, nodes, reuse references), let the pure planner
decide, carry the actions out through the roles that own them (lifecycle workers, healing actions, the load
follower), each in a tracked background job, at most one per task and per instance. An etcd outage only makes
passes fail; the next pass after it sees the world as it is then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from flowmaker import metrics
from flowmaker.cancel import wait_for
from flowmaker.errors import FlowMakerError
from flowmaker.orchestration.adapt import LoadPolicy, drifted
from flowmaker.orchestration.reconcile import Action, Kind, Memory, Observed, Policy, plan, to_probe
from services.orchestrator.cache import RoutingCache
from services.orchestrator.engines import EngineClient
from services.orchestrator.follower import LoadFollower
from services.orchestrator.healing import Healer
from services.orchestrator.lifecycle import Lifecycle
from services.orchestrator.predictions import Predictions
from services.orchestrator.workers import Workers

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(self, cache: RoutingCache, policy: Policy, *, workers: Workers, lifecycle: Lifecycle,
                 healer: Healer, follower: LoadFollower, engines: EngineClient, interval_s: float,
                 heal: bool = True, load_policy: LoadPolicy | None = None,
                 predictions: Predictions | None = None) -> None:
        self.cache = cache
        self.policy = policy
        self.workers = workers
        self.lifecycle = lifecycle
        self.healer = healer
        self.follower = follower
        self.engines = engines
        self.interval_s = interval_s
        self.heal = heal
        self.memory = Memory()
        self.load_policy = load_policy  # None: deploy-once (no re-selection for load)
        self.predictions = predictions  # None: tasks keep their selections' predictions
        self._drift_since: dict[str, float] = {}
        self._drift_peak: dict[str, float] = {}
        self._loop: asyncio.Task[Any] | None = None
        self._actions: set[asyncio.Task[Any]] = set()
        self._probing: set[str] = set()  # instances whose engine a probe is on (`_probe_cut_off`)
        self.probe_timeout_s = 1.0
        self.passes = 0

    @property
    def running(self) -> bool:
        return self._loop is not None and not self._loop.done()

    def start(self) -> None:
        if not self.running:
            self._loop = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop the loop and the actions in flight (shutdown, or leadership lost); the memory starts afresh."""
        pending = [*self._actions, *([self._loop] if self._loop is not None else [])]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._loop = None
        self.memory = Memory()
        self._drift_since.clear()
        self._drift_peak.clear()
        if self.predictions is not None:
            self.predictions.forget()

    def kick(self) -> None:
        self.cache.kick()

    async def _run(self) -> None:
        while True:
            self.cache.changed.clear()
            try:
                with metrics.time_reconcile("orchestrator"):  # flowmaker_reconcile_duration_seconds
                    await self.pass_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd unavailable (or a bug): the next pass tries again
                log.warning("reconcile pass failed: %s", e)
            with contextlib.suppress(TimeoutError):
                await wait_for(self.cache.changed.wait(), self.interval_s)
            await asyncio.sleep(0.05)  # coalesce a burst of watch events into one pass

    # ---- one pass ----------------------------------------------------------------------------

    async def pass_once(self) -> list[Action]:
        obs = await self.cache.observe()
        self.passes += 1
        self.memory.busy_tasks = self.workers.busy_tasks()
        now = time.time()
        self._probe_cut_off(obs, now)
        actions = plan(obs, self.memory, now, self.policy)
        tasks = obs.tasks
        if self.predictions is not None:
            try:  # the placement moved: serving tasks' predictions re-derived (their drift is seen below)
                tasks = {**tasks, **await self.predictions.refresh(obs)}
            except Exception as e:  # etcd unavailable (or a bug): healing goes on; the next pass tries again
                self.predictions.forget()
                log.warning("re-deriving predictions failed (%s); the next pass tries again", e)
        if not self.heal:
            return actions
        for a in actions:
            self._carry_out(a)
        if self.load_policy is not None:
            busy = self.memory.busy_tasks
            loads = {tid: ld for tid in tasks if tid not in busy
                     and (ld := self.lifecycle.observed_load(tid, now)) is not None}
            for tid, rate, why in drifted({t: x for t, x in tasks.items() if t not in busy}, loads,
                                          self._drift_since, now, self.load_policy, peaks=self._drift_peak):
                log.warning("reconcile: RESELECT_FOR_LOAD %s (%s)", tid, why)
                self.workers.start(tid, self.follower.reselect_for_load(tid, rate, why))
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
        cut_off = to_probe(obs)
        for iid in list(self.memory.answering):
            if iid not in cut_off:
                del self.memory.answering[iid]
        for iid, endpoint in cut_off.items():
            if iid in self._probing:
                continue
            self._probing.add(iid)

            async def probe(iid: str = iid, endpoint: str = endpoint) -> None:
                try:
                    if await self.engines.alive(endpoint, timeout_s=self.probe_timeout_s):
                        self.memory.answering[iid] = time.time()
                    else:
                        self.memory.answering.pop(iid, None)
                finally:
                    self._probing.discard(iid)
            self._spawn(probe())

    def _carry_out(self, a: Action) -> None:
        if a.kind not in (Kind.RESUME_SELECT, Kind.RESUME_DEPLOY, Kind.RESUME_DELETE, Kind.CLEAR_HEALING):
            log.warning("reconcile: %s %s%s", a.kind.value, a.task_id or a.instance_id,
                        f" ({a.detail})" if a.detail else "")
        w, lc, h, f = self.workers, self.lifecycle, self.healer, self.follower
        if a.kind is Kind.RESTART:
            self.memory.busy_instances.add(a.instance_id)
            self.memory.restarts[a.instance_id].append(time.time())
            self._spawn(h.restart_instance(a.instance_id, a.task_ids, a.detail),
                        done=lambda: self.memory.busy_instances.discard(a.instance_id))
        elif a.kind is Kind.MARK_LOST:
            self._spawn(h.mark_lost(a.instance_id, a.detail))
        elif a.kind is Kind.RESELECT:
            w.start(a.task_id, h.reselect(a.task_id, a.detail))
        elif a.kind is Kind.CLEAR_HEALING:
            self._spawn(h.clear_healing(a.task_id))
        elif a.kind is Kind.RESUME_SELECT:
            w.start(a.task_id, lc.select_commit_deploy(a.task_id))
        elif a.kind is Kind.RESUME_DEPLOY:
            w.start(a.task_id, lc.deploy(a.task_id))
        elif a.kind is Kind.RESUME_DELETE:
            w.start(a.task_id, lc.finish_delete(a.task_id))
        elif a.kind is Kind.ROLLBACK_DEPLOY:
            w.start(a.task_id, lc.rollback(a.task_id, a.detail))
        elif a.kind is Kind.RELEASE_TASK_REFS:
            w.start(a.task_id, h.release_failed(a.task_id))
        elif a.kind is Kind.DROP_REF:
            self._spawn(h.drop_reference(a.instance_id, a.task_ids[0], a.node))
        elif a.kind is Kind.STOP_ORPHAN:
            self._spawn(h.stop_orphan(a.instance_id, a.node))
        elif a.kind is Kind.RESUME_SWITCH:
            w.start(a.task_id, f.switch_variant(a.task_id))
        elif a.kind is Kind.MOVE_OFF_LOST:
            t = self.cache.task(a.task_id)
            w.start(a.task_id, f.reselect_for_load(a.task_id, t.plan_rate_rps if t else 0.0, a.detail))
        elif a.kind is Kind.REPLAN_DEPLOY:
            h.replan_deploy(a.task_id, a.detail)
        elif a.kind is Kind.ABORT_SWITCH:
            w.start(a.task_id, f.abort_switch(a.task_id, a.detail))

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
                self.cache.kick()
        t = asyncio.create_task(run())
        self._actions.add(t)
        t.add_done_callback(self._actions.discard)
