"""The load follower, run by the reconciler on the elected leader: make-before-break re-selection of a serving
task for the rate it really gets (flowmaker.orchestration.adapt says which tasks drifted), the switch to the new
variant, the drain and release of the old one, and the rollback of a switch that cannot finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace

from flowmaker.api.common.v1 import selection_pb2
from flowmaker.domain import Variant, priced_memory_gb
from flowmaker.errors import NoCapacity, NotFound
from flowmaker.orchestration.cluster import excluding_task, read_live_cluster
from flowmaker.orchestration.commit import CommitPlan, ReleaseAction, commit_ops, plan_commit, plan_instances
from flowmaker.orchestration.task import DeployedInstance, Reselection, TaskRecord, TaskState, selected_prediction
from flowmaker.state import keys
from flowmaker.state.records import (
    ClusterView,
    InstanceRecord,
    InstanceState,
    new_instance_id,
    reuse_load,
    reuse_value,
)
from flowmaker.state.store import Compare, Put, StateStore
from services.orchestrator.cache import RoutingCache
from services.orchestrator.deployments import Deployers
from services.orchestrator.records import TaskStore, is_transient
from services.orchestrator.selecting import Selections
from services.orchestrator.settings import OrchestratorSettings

log = logging.getLogger(__name__)


def kept_cost(exclusive: list[InstanceRecord], latency_s: float, gpu_price_gb: float) -> float:
    """What keeping the current variant costs in the selector's objective: the instances only this task uses,
    as if new (their memory, each GPU priced at `gpu_price_gb`: docs/selection-spec.md), x its latency. Reckoned
    otherwise than the fresh variant it is compared with, a keep would win or lose for the arithmetic alone."""
    return sum(priced_memory_gb(r.memory_gb_per_gpu, r.tp * r.pp, gpu_price_gb) for r in exclusive) * latency_s


class LoadFollower:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, *, deployers: Deployers,
                 selections: Selections, cache: RoutingCache, inflight: Callable[[str], int]) -> None:
        self.settings = settings
        self.store = store
        self.tasks = TaskStore(store)
        self.deployers = deployers
        self.selections = selections
        self.cache = cache
        # Engine calls in flight to an instance (this replica's router's, plus what the other replicas last
        # published): a switch drains the old instances of them before releasing them.
        self.inflight = inflight

    async def reselect_for_load(self, task_id: str, rate_rps: float, why: str) -> None:
        """Make-before-break re-selection of a serving task for the rate it really gets: select against the
        live cluster, commit the new variant beside the current one in one guarded txn, deploy it, switch
        requests to it, drain and release the old one. The task keeps serving on its current variant
        throughout; on any failure it stays there.

        Two selections: (A) the task may keep its instances at the new rate (its own share taken off them),
        which says whether the current variant still fits; (B) the instances only it uses are not offered
        (they would be released), which says what a fresh variant costs. Reuse is free in the spec's cost,
        so without (B) a task would never give back capacity it no longer needs. The current variant is
        kept when it fits and costs no more (its exclusive memory x its latency, each GPU priced as the options
        price it) than (B)'s. Under GPU sharing a move is then checked with the live prediction (`_breaks`): if it
        would push a co-resident that meets its SLO past it, both are selected again with that co-resident's
        instances protected (`cluster.protected`: no room, no compute beside them); if that choice breaks one too,
        or there is none, the task stays."""
        _, t = await self.tasks.get(task_id)
        if t.state is not TaskState.ACTIVE or t.healing is not None or t.next_variant is not None:
            return
        log.warning("task %s: re-selecting for load at %.3g req/s (%s)", task_id, rate_rps, why)
        listing = (await self.store.get_prefix(keys.REUSE)).items
        refs = {keys.parse_reuse(kv.key)[0]: reuse_load(kv.value) for kv in listing
                if keys.parse_reuse(kv.key)[1] == task_id}
        shared = {keys.parse_reuse(kv.key)[0] for kv in listing if keys.parse_reuse(kv.key)[1] != task_id}
        exclusive = set(refs) - shared
        note = Reselection(time.time(), why, rate_rps, previous_shares=refs)
        capacity_model: selection_pb2.CapacityModel | None = None
        gpu_price = 0.0  # the options' priced GPUs: the kept variant's cost is reckoned as the selector's
        for attempt in range(1, self.settings.commit_retries + 1):
            view = await read_live_cluster(self.store)
            if capacity_model is None:
                opts = await self.selections.options(t, view.cluster)
                capacity_model, gpu_price = opts.capacity_model, opts.gpu_price_gb
            seen = excluding_task(view, refs)
            reps = self.settings.load_max_replicas  # scaling a stage out is one of the answers
            fresh = replace(seen.cluster, instances=tuple(i for i in seen.cluster.instances if i.id not in exclusive))
            # Co-residents the first choice would push past their SLO (by the live prediction) are protected in a
            # second selection (`cluster.protected`): it neither reuses their instances nor places beside them.
            protect: set[str] = set()
            broke = ""  # who the first choice broke, for the note
            for check in (1, 2):
                a = await self.selections.select_at(t, rate_rps, seen.cluster, max_replicas=reps, protect=protect)
                b = await self.selections.select_at(t, rate_rps, fresh, max_replicas=reps, protect=protect) \
                    if exclusive else None
                tkv, cur = await self.tasks.get(task_id)
                if cur.state is not TaskState.ACTIVE or cur.next_variant is not None:
                    return
                fits = a is not None and a.workflow_id == (cur.variant.workflow_id if cur.variant else "") and \
                    not a.new_instances and {x.stage_id: x.instance_id for x in a.assignments if x.reused} == \
                    cur.stage_instances
                chosen: Variant | None = a or b
                same = False
                if fits and a is not None:
                    mem = {i.id: i for i in view.instances.values()}
                    keep_cost = kept_cost([mem[i] for i in exclusive if i in mem], a.latency_s, gpu_price)
                    chosen, same = (a, True) if b is None or keep_cost <= b.cost else (b, False)
                if chosen is None:
                    await self._note_reselection(task_id, replace(note, outcome="FAILED", reason=(
                        f"{why}; no feasible variant at {rate_rps:.3g} req/s" + (
                            f" that keeps {broke}" if protect else ""))))
                    return
                v = chosen
                scale = await self.selections.load_scale(t, v, view.cluster, capacity_model,
                                                          await self.selections.models())
                plan = plan_commit(task_id, v, [new_instance_id(n.model_id) for n in v.new_instances],
                                   load_scale=scale)
                if same or not self.selections.shares_gpus(cur):
                    break
                broken, used = await self._breaks(cur, v, plan, rate_rps, view, exclusive)
                if not broken:
                    break
                broke = "co-resident task(s) " + ", ".join(
                    f"{tid} ({x:.3g}s -> {y:.3g}s)" for tid, (x, y) in sorted(broken.items())) + \
                    " within their latency SLO by the live prediction"
                if check == 2 or not used:
                    await self._note_reselection(task_id, replace(note, outcome="FAILED", reason=(
                        f"{why}; kept the current variant: none selected at {rate_rps:.3g} req/s keeps {broke}")))
                    return
                protect = used
            now = time.time()
            if same:
                # The current variant still fits the new rate and costs no more: only its shares move.
                new_t = replace(cur, update_time=now, planned_rate_rps=rate_rps, variant=v,
                                **selected_prediction(v), last_reselection=replace(
                                    note, outcome="DONE", reason=f"{why}; the current variant fits"))
            else:
                new_t = replace(cur, update_time=now, next_variant=v, next_stage_instances=plan.stage_instances,
                                next_new_instances=plan.deploy, last_reselection=note)
            try:
                compares, puts = commit_ops(plan, view, tkv, new_t, now, held=refs)
            except NoCapacity:
                continue
            res = await self.store.txn(compares, puts)
            if not res.succeeded:
                await asyncio.sleep(random.uniform(0.005, 0.05) * attempt)
                continue
            if same:
                return
            log.info("task %s: switching (attempt %d) %s", task_id, attempt, plan.describe())
            await self.switch_variant(task_id)
            return
        await self._note_reselection(task_id, replace(note, outcome="FAILED",
                                                      reason=f"{why}; the cluster kept changing"))

    async def _breaks(self, cur: TaskRecord, v: Variant, plan: CommitPlan, rate_rps: float, view: ClusterView,
                      exclusive: set[str]) -> tuple[dict[str, tuple[float, float]], set[str]]:
        """`Selections.breaks` of the switch to `v`: the task's new variant and instances in, what only its old
        one used out."""
        moved = replace(cur, variant=v, stage_instances=plan.stage_instances, planned_rate_rps=rate_rps,
                        next_variant=None, next_stage_instances={}, next_new_instances=(), last_reselection=None)
        return await self.selections.breaks(moved, view, plan_instances(plan),
                                            exclusive - set(plan.stage_instances.values()))

    async def switch_variant(self, task_id: str) -> None:
        """Deploy the task's next variant, route requests to it, drain and release what only the old one used.
        Idempotent (the reconciler resumes it); past its deadline, or when the deploy fails, the next variant
        is rolled back and the task keeps its current one."""
        _, t = await self.tasks.get(task_id)
        if t.next_variant is None:
            return
        nodes = await self.deployers.node_endpoints()
        todo = list(t.next_new_instances)
        new_ids = {d.instance_id for d in todo}
        for iid in sorted(set(t.next_stage_instances.values()) - new_ids):
            kv = await self.store.get(keys.instance(iid))
            rec = InstanceRecord.from_json(kv.value) if kv else None
            if rec is not None and rec.state is not InstanceState.READY:
                todo.append(DeployedInstance(iid, "", rec.model_id, rec.tp, rec.pp, rec.node, rec.gpu_ids,
                                             rec.memory_gb_per_gpu, 0.0))
        results = await asyncio.gather(*(self.deployers.deploy_one(task_id, d, nodes) for d in todo), return_exceptions=True)
        errs = [r for r in results if isinstance(r, BaseException)]
        if errs:
            if is_transient(errs[0]):
                raise errs[0]  # the reconciler resumes the switch after the outage
            await self.abort_switch(task_id, f"deploying the new variant failed: {errs[0]}")
            return

        def swap(x: TaskRecord) -> TaskRecord | None:
            if x.next_variant is None or x.state is not TaskState.ACTIVE:
                return None
            note = x.last_reselection
            return replace(x, update_time=time.time(), variant=x.next_variant, stage_instances=x.next_stage_instances,
                           new_instances=x.next_new_instances, next_variant=None, next_stage_instances={},
                           next_new_instances=(), planned_rate_rps=note.rate_rps if note else x.planned_rate_rps,
                           **selected_prediction(x.next_variant),
                           last_reselection=replace(note, outcome="DONE") if note else None)
        old = set(t.stage_instances.values())
        got = await self.tasks.update_rev(task_id, swap)
        if got is None:
            return
        new, rev = got
        self.cache.note_task(new, rev)
        log.warning("task %s: switched to %s", task_id, new.stage_instances)
        await self._drain_and_release(task_id, old - set(new.stage_instances.values()))

    async def _drain_and_release(self, task_id: str, instance_ids: set[str]) -> None:
        """Let requests already routed to the old instances finish (bounded), then drop the task's references."""
        end = time.monotonic() + self.settings.drain_timeout_s
        while any(self.inflight(i) for i in instance_ids) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        nodes = await self.deployers.node_endpoints()
        recs = {}
        for iid in instance_ids:
            kv = await self.store.get(keys.instance(iid))
            if kv is not None:
                recs[iid] = InstanceRecord.from_json(kv.value)
        await asyncio.gather(*(self.deployers.release_one(task_id, ReleaseAction(iid, r.node, False), nodes)
                               for iid, r in sorted(recs.items())))

    async def abort_switch(self, task_id: str, why: str) -> None:
        """Roll back a next variant: drop its references (stopping what only it used), restore the current
        variant's shares, keep serving on the current variant."""
        _, t = await self.tasks.get(task_id)
        if t.next_variant is None:
            return
        old_ids = set(t.stage_instances.values())
        nodes = await self.deployers.node_endpoints()
        for iid in sorted(set(t.next_stage_instances.values()) - old_ids):
            kv = await self.store.get(keys.instance(iid))
            if kv is not None:
                await self.deployers.release_one(task_id, ReleaseAction(iid, InstanceRecord.from_json(kv.value).node, False),
                                        nodes)
        # The shares of instances both variants use were moved to the new rate: back to what they were.
        before = t.last_reselection.previous_shares if t.last_reselection else {}
        for iid in sorted(old_ids & set(t.next_stage_instances.values())):
            if iid in before:
                await self._set_share(iid, task_id, before[iid])

        def clear(x: TaskRecord) -> TaskRecord | None:
            if x.next_variant is None:
                return None
            note = x.last_reselection
            return replace(x, update_time=time.time(), next_variant=None, next_stage_instances={},
                           next_new_instances=(), last_reselection=replace(note, outcome="FAILED", reason=f"{note.reason}; {why}")
                           if note else None)
        await self.tasks.update(task_id, clear)
        log.warning("task %s: switch aborted (%s); it keeps its current variant", task_id, why)

    async def _set_share(self, iid: str, task_id: str, load: float) -> None:
        """Rewrite one reuse reference's load and the instance's planned load by the difference (one txn)."""
        for _ in range(self.settings.commit_retries):
            ikv, rkv = await self.store.get(keys.instance(iid)), await self.store.get(keys.reuse(iid, task_id))
            if ikv is None or rkv is None:
                return
            rec = InstanceRecord.from_json(ikv.value)
            new = replace(rec, load_output_tokens_per_s=round(max(0.0, rec.load_output_tokens_per_s
                                                                  - reuse_load(rkv.value) + load), 6))
            res = await self.store.txn([Compare.unchanged(ikv.key, ikv.mod_revision),
                                        Compare.unchanged(rkv.key, rkv.mod_revision)],
                                       [Put(ikv.key, new.to_json()), Put(rkv.key, reuse_value(iid, task_id, load))])
            if res.succeeded:
                return

    async def _note_reselection(self, task_id: str, note: Reselection) -> None:
        def fn(x: TaskRecord) -> TaskRecord | None:
            return replace(x, last_reselection=note, update_time=time.time()) if x.state is TaskState.ACTIVE else None
        with contextlib.suppress(NotFound):
            await self.tasks.update(task_id, fn)
        log.warning("task %s: re-selection for load %s: %s", task_id, note.outcome, note.reason)
