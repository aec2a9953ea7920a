"""Serving policies compared in `bench serving`, looked up by name: FlowMaker and the published baselines.

Every policy turns the same inputs (tasks with their SLOs, trace kind, load level, the load level's
segment workload, models, profiles, an empty cluster) into a `Plan`: instances on GPUs (each with
its deploy time) and, per task, how requests are routed. The simulator then serves the same
arrivals with every plan. Tasks are deployed one after another at the segment's staggered deploy
times (`flowmaker.eval.traces.SegmentWorkload`). The baselines get exactly the profiles, cluster and
simulator FlowMaker gets; their fixed choices are documented below and in docs/evaluation.md, and
none was tuned against the results.

* `flowmaker`: the exact selector over each task's 3 candidates; each selection sees the instances
  the earlier tasks left and their CURRENT load -- measured by `ctx.monitor` just before the
  deploy (in the bench: the simulator serving the deployed tasks' real arrivals over the trace
  minute before the deploy) -- and plans the task at its arrival rate measured over that same
  minute (what the front end saw), never below the rate the task declared. It may reuse running instances.
  It selects under the GPU-sharing contract (docs/selection-spec.md, "Extension: GPU sharing": busy
  shares per GPU, slowdown from co-residents, load-aware placement) with busy-time capacity (prefill
  counted), as the orchestrator does.
* `flowmaker-paper`: `flowmaker` under the paper-literal contract (output-token capacity, memory-only
  placement, GPUs shared as if free), for comparison.
* `flowmaker-noreuse`: the same with `allow_reuse=False`.
* `flowmaker-heuristic`: the paper's three-step heuristic instead of the exact selector.
* `flowmaker-plannedload`: `flowmaker`, but an instance's load is the sum of what the selections
  planned (what the orchestrator records today), not a measurement.
* `langchain`: what a developer writes by hand: each task's fixed workflow (`EvalTask.fixed_workflow`),
  one model for every stage -- by default the smallest catalog model whose accuracy meets the task's
  target (`LANGCHAIN_MODEL_RULES`) -- at the smallest tensor-parallel degree that fits (pp=1), ONE
  INSTANCE PER STAGE, placed first fit by memory (lowest-numbered GPUs with room, fragmentation
  included). A task whose stages cannot all be placed fails (its placed instances are released) and
  is reported in `Plan.placement_failures`. Nothing is sized for load.
* `routellm[-min-cost|-balanced|-max-quality]`: each task's fixed workflow; every request is routed
  to Qwen2.5-14B-Instruct (strong) or Qwen2.5-7B-Instruct (weak) by a router score (a seeded hash)
  against a threshold: 20% / 50% / 100% of requests to the strong model (not tuned; the accuracy-SLO
  hit rate is reported). One pool per model serves all tasks; each pool's tp is the smallest (pp=1)
  with which a lone request of every task meets its latency target at the sizing request (the trace's
  mean request), and it has as many replicas as the segment's mean rate needs (busy time of prefill +
  pure decode at the mean request) under the utilisation cap. A request goes to the least-loaded
  replica of its model (least outstanding work).
* `murakkab[-maxload]`: each task's fixed workflow; model and config chosen per stage by the same
  exact optimiser, with reuse, planned offline: each task at its mean rate over the segment or, for
  `-maxload`, at its peak rate over any trace minute of the segment; the loads it reuses by are its
  own planned estimates (no monitor). Busy-time capacity like every optimiser-based policy; GPU sharing
  as the experiment declares (FlowMaker's contract, or ignored as published); a task it cannot place under
  the sharing contract is placed as the published, sharing-blind Murakkab would (best effort).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from flowmaker.domain import (
    CapacityModel,
    Cluster,
    Gpu,
    GpuSharing,
    GpuType,
    Instance,
    Model,
    Profile,
    SelectionOptions,
    SelectionRequest,
    SelectionResult,
    Workflow,
    default_gpu_price,
)
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.tasks import EvalTask
from flowmaker.eval.traces import Arrival, SegmentWorkload
from flowmaker.selection import select
from flowmaker.selection.placement import NodeGpus, place_least_loaded
from flowmaker.sharing import add_offered, occupancy
from flowmaker.sim.cluster import DEFAULT_COLOCATION, Route, SimInstance, TaskDeployment, simulate


# What a policy that decides reuse from the CURRENT load reads before a deployment at time `at`: the load
# each running instance carries now (output tokens/s, busy-time equivalent), given what is deployed so far.
class MeasuredLoad(NamedTuple):
    """What a monitor reads of one running instance over its window."""

    load: float  # busy-time-equivalent output tokens/s (InstanceMetrics.busy_equiv_tokens_per_s)
    busy_share: float  # fraction of the time a call is in flight, from the calls offered (flowmaker.sharing)


LoadMonitor = Callable[[Sequence[SimInstance], Sequence[TaskDeployment], float], Mapping[str, MeasuredLoad]]

DEFAULT_UTILIZATION_CAP = 0.8  # every policy that sizes for load keeps 20% headroom for bursts

LANGCHAIN_DEFAULT_MODEL = "Qwen2.5-14B-Instruct"
ROUTELLM_STRONG = "Qwen2.5-14B-Instruct"
ROUTELLM_WEAK = "Qwen2.5-7B-Instruct"
ROUTELLM_STRONG_SHARE = {"min-cost": 0.2, "balanced": 0.5, "max-quality": 1.0}
ROUTELLM_SIZE_STAT = "mean"  # the request the router pools are sized at (the trace's mean request)
# How the hand-written LangChain deployment picks its one model per task: "smallest" -- the smallest catalog
# model whose accuracy meets the task's target (the developer knows the target, and pays for GPUs);
# "strong" -- Qwen2.5-14B-Instruct everywhere (the most accurate model that fits one 48 GB GPU).
LANGCHAIN_MODEL_RULES = ("smallest", "strong")


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """Everything a policy may look at. `load` is the run's level (fraction of each task's nominal rate)."""

    tasks: tuple[EvalTask, ...]
    trace_kind: str
    load: float
    models: tuple[Model, ...]
    profiles: tuple[Profile, ...]
    cluster: Cluster
    gpu_type: GpuType
    seed: int = 0
    utilization_cap: float = DEFAULT_UTILIZATION_CAP
    # Measures the running instances' current load (None: only the loads the selections planned are known).
    monitor: LoadMonitor | None = None
    plan_tokens: str = "median"  # which request every policy sizes stages with ("median" or "mean")
    # The load level's replay (deploy times, measured and offline rates); None: every task deployed at 0 and
    # planned at load x nominal rate.
    workload: SegmentWorkload | None = None
    langchain_model: str = "smallest"
    # Capacity model of every optimiser-based policy (busy time: prefill counted) and kappa of the GPU-sharing
    # contract FlowMaker's policies select under (1: processor sharing, what the simulator does).
    capacity_model: CapacityModel = CapacityModel.BUSY_TIME
    interference: float = 1.0
    # The declared experiment's baseline settings (flowmaker/eval/data/*.toml; the defaults are the older
    # setup): Murakkab plans with the same GPU-sharing contract as FlowMaker; RouteLLM's pools are sized at
    # the declared rate ("declared") or the segment's mean ("segment-mean"), within a GPU budget (0: none).
    baseline_sharing: bool = False
    routellm_rate: str = "segment-mean"
    routellm_gpu_budget_gb: float = 0.0
    # FlowMaker's policies plan for the bursts they have seen (`planning_rates`); False: at the measured rate,
    # never below the declared one (the published system; a sensitivity run).
    burst_headroom: bool = True
    # Sensitivity: the selector-based policies choose only configurations of at most this many GPUs per
    # instance (0: any). The selection objective (memory x latency) favours wide tensor parallelism, which
    # takes the compute of many GPUs for one task; this measures what that costs when the cluster is loaded.
    max_instance_gpus: int = 0
    # FlowMaker's selector-based policies price every GPU a new instance spans at this many GB more
    # (docs/selection-spec.md, priced GPUs; 0: the paper's memory-only objective).
    gpu_price_gb: float = 0.0

    def deploy_time(self, task: EvalTask) -> float:
        return self.workload.deploy_time(task.name) if self.workload is not None else 0.0

    def nominal_rate(self, task: EvalTask) -> float:
        return task.nominal_rate_rps * self.load

    def current_rate(self, task: EvalTask) -> float:
        """The task's arrival rate over the monitor window just before its deploy."""
        w = self.workload
        if w is None:
            return self.nominal_rate(task)
        d = w.deploy_time(task.name)
        return w.rate_in(task.name, max(0.0, d - w.window_s), d)

    def planning_rate(self, task: EvalTask) -> float:
        """What FlowMaker plans a task at: the rate measured over the window before its deploy, never below the
        rate the task declared (a task whose first requests have not arrived yet is not sized for nothing)."""
        return max(self.current_rate(task), self.nominal_rate(task))

    def burst_rate(self, task: EvalTask) -> float:
        """The task's share of the densest burst in the history known at its deploy, over windows of its latency
        SLO (`SegmentWorkload.burst_rate`): requests that arrive within one SLO must be served within about one
        SLO, so the instances they share need that rate of capacity, not the mean's."""
        w = self.workload
        if w is None or not self.burst_headroom:
            return 0.0
        return w.burst_rate(task.name, task.max_latency_s, w.deploy_time(task.name))

    def planning_rates(self, task: EvalTask) -> tuple[float, ...]:
        """What FlowMaker's policies plan a task at, in the order tried (`plan_rates`)."""
        return plan_rates(self.burst_rate(task), self.current_rate(task), self.nominal_rate(task))

    def mean_rate(self, task: EvalTask) -> float:
        return self.workload.mean_rate(task.name) if self.workload is not None else self.nominal_rate(task)

    def peak_rate(self, task: EvalTask) -> float:
        return self.workload.peak_rate(task.name) if self.workload is not None else self.nominal_rate(task)

    def offline_rate(self, task: EvalTask) -> float:
        """What an offline planner knows: the preceding stretch's rate when the replay has one (causal), else
        the segment's own mean."""
        return self.workload.offline_rate(task.name) if self.workload is not None else self.nominal_rate(task)

    def offline_peak_rate(self, task: EvalTask) -> float:
        return self.workload.offline_peak_rate(task.name) if self.workload is not None else self.nominal_rate(task)

    def routellm_sizing_rate(self, task: EvalTask) -> float:
        return self.nominal_rate(task) if self.routellm_rate == "declared" else self.mean_rate(task)


BURST_STEPS = 4  # rates tried from the burst rate down to the measured one (plan_rates)


def plan_rates(burst: float, measured: float, declared: float) -> tuple[float, ...]:
    """The rates FlowMaker plans a task at, first to last, each tried when nothing fits at the one before: the
    burst rate (the task's share of the densest SLO-long window it has seen), the rate measured over the window
    before its deploy, the rate it declared; each never below the next (a task is never sized for less than it
    declared), duplicates dropped."""
    out: list[float] = []
    floor = max(declared, 1e-6)
    hi, mid = max(burst, measured, floor), max(measured, floor)
    # Between the burst and the measured rate, geometric steps: a task that cannot have all of its burst
    # headroom on a crowded cluster still gets as much of it as fits.
    steps = [hi * (mid / hi) ** (k / BURST_STEPS) for k in range(BURST_STEPS)]
    for r in (*steps, mid, floor):
        if not out or r < out[-1] * (1 - 1e-9):
            out.append(r)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class StageDecision:
    """Reuse-ablation record: which instance served a stage and whether the policy reused it."""

    task: str
    workflow_id: str
    stage_id: str
    instance_id: str
    model_id: str
    tp: int
    pp: int
    reused: bool  # the instance existed before this task was deployed (deployed by another task)


@dataclass(frozen=True, slots=True)
class Plan:
    policy: str
    instances: tuple[SimInstance, ...]
    deployments: tuple[TaskDeployment, ...]
    unplaced: tuple[tuple[str, str], ...] = ()  # (task, why)
    decisions: tuple[StageDecision, ...] = ()
    planning_s: float = 0.0
    notes: str = ""
    # (instance id, load the policy believed it carries at the end of planning, output tokens/s)
    planned_loads: tuple[tuple[str, float], ...] = ()
    # (task, stage, why) for every instance a plain deployment could not place (LangChain)
    placement_failures: tuple[tuple[str, str, str], ...] = ()
    planned_rates: tuple[tuple[str, float], ...] = ()  # (task, the arrival rate it was planned at)
    # tasks no plan served within their SLOs on the shared GPUs, deployed as the sharing-blind contract places them
    best_effort: tuple[str, ...] = ()


Policy = Callable[[PolicyContext], Plan]
POLICIES: dict[str, Policy] = {}


def register(name: str) -> Callable[[Policy], Policy]:
    def deco(fn: Policy) -> Policy:
        POLICIES[name] = fn
        return fn
    return deco


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise NotFound(f"unknown policy {name!r}; known: {sorted(POLICIES)}", field="policy",
                       reason="UNKNOWN_POLICY") from None


def plan(name: str, ctx: PolicyContext) -> Plan:
    """Run the named policy and time it."""
    fn = get_policy(name)
    t0 = time.perf_counter()
    p = fn(ctx)
    return replace(p, policy=name, planning_s=time.perf_counter() - t0)


# ---- shared cluster bookkeeping ----------------------------------------------------------------


class _ClusterState:
    """GPUs, running instances and their load while a policy deploys tasks one after another."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.gpus = list(ctx.cluster.gpus)
        self.layout = NodeGpus.of(self.gpus)
        self.free = {g.id: g.memory_total_gb - g.memory_used_gb for g in self.gpus}
        self.instances: list[SimInstance] = []
        self.load: dict[str, float] = {}
        # GPU sharing: the slowdown the tasks using an instance tolerate (min over them of SLO / latency alone).
        self.tolerance: dict[str, float] = {}
        # GPU sharing: call-seconds per second offered to an instance (planned), or its measured busy share.
        self.offered: dict[str, float] = {}
        self.plan_load: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.prof = {p.key: p for p in ctx.profiles}
        self._n = 0

    def as_cluster(self, measured: Mapping[str, MeasuredLoad] | None = None) -> Cluster:
        """The cluster the next selection sees; `measured`: running instances at their measured load and busy share
        alone (not the larger of planned and measured)."""
        gpus = tuple(Gpu(g.id, g.node, g.memory_total_gb, g.memory_total_gb - self.free[g.id], g.gpu_type)
                     for g in self.gpus)
        if measured is not None:
            zero = MeasuredLoad(0.0, 0.0)
            inst = tuple(Instance(i.id, i.profile.model_id, i.profile.tp, i.profile.pp, i.gpu_ids,
                                  measured.get(i.id, zero).load, max_slowdown=self.tolerance.get(i.id, 0.0),
                                  busy_share=min(1.0, measured.get(i.id, zero).busy_share))
                         for i in self.instances)
            return Cluster(gpus, inst)
        inst = tuple(Instance(i.id, i.profile.model_id, i.profile.tp, i.profile.pp, i.gpu_ids, self.load[i.id],
                              max_slowdown=self.tolerance.get(i.id, 0.0),
                              busy_share=min(1.0, self.busy.get(i.id, occupancy(self.offered.get(i.id, 0.0)))))
                     for i in self.instances)
        return Cluster(gpus, inst)

    def add(self, profile: Profile, gpu_ids: tuple[str, ...], task: str, load: float,
            start_s: float = 0.0) -> SimInstance:
        iid = f"i{self._n}-{profile.model_id}-tp{profile.tp}pp{profile.pp}"
        self._n += 1
        for g in gpu_ids:
            self.free[g] -= profile.memory_gb_per_gpu
        inst = SimInstance(iid, profile, gpu_ids, deployed_by=task, start_s=start_s)
        self.instances.append(inst)
        self.load[iid] = load
        self.plan_load[iid] = load
        return inst

    def remove(self, inst: SimInstance) -> None:
        for g in inst.gpu_ids:
            self.free[g] += inst.profile.memory_gb_per_gpu
        self.instances.remove(inst)
        del self.load[inst.id]

    def place(self, profile: Profile, task: str, load: float, start_s: float = 0.0) -> SimInstance | None:
        """A new instance placed LeastLoaded (the spec's rule), or None when no node has room."""
        spot = place_least_loaded(self.layout, self.free, profile.gpus, profile.memory_gb_per_gpu)
        if spot is None:
            return None
        return self.add(profile, spot[1], task, load, start_s)

    def place_first_fit(self, profile: Profile, task: str, start_s: float) -> SimInstance | None:
        """A plain deployment: the lowest-numbered GPUs of one node that each have room (first fit by memory)."""
        need = profile.memory_gb_per_gpu
        by_node: dict[str, list[Gpu]] = {}
        for g in self.gpus:
            by_node.setdefault(g.node, []).append(g)
        for gs in by_node.values():
            ok = [g.id for g in gs if self.free[g.id] + 1e-9 >= need]
            if len(ok) >= profile.gpus:
                return self.add(profile, tuple(ok[:profile.gpus]), task, 0.0, start_s)
        return None


def _stage_load(wf: Workflow, rate: float) -> dict[str, float]:
    return {s.id: rate * s.calls_per_request * s.output_tokens for s in wf.llm_stages}


def _select_in_sequence(ctx: PolicyContext, *, strategy: str, allow_reuse: bool,
                        rate: Callable[[EvalTask], float | tuple[float, ...]], fixed_workflow: bool, measured: bool,
                        sharing: bool = True, capacity_model: CapacityModel | None = None,
                        fallback: bool = False, best_effort: bool = False, overload_steps: bool = False) -> Plan:
    """Deploy tasks one after another with the selector; each sees what the earlier ones deployed.

    `measured`: before each deployment the running instances' loads are replaced by what
    `ctx.monitor` measures (the current load); otherwise they are the sums of the planned loads.
    `rate`: the arrival rate a task is planned at, or several (`plan_rates`), each tried when nothing fits at
    the one before. `fallback`: when nothing fits at the last, the headroom kept for bursts is given up, then
    the headroom booked by earlier tasks is lent. `best_effort`: when still nothing fits under the GPU-sharing
    contract, the task is deployed where the sharing-blind contract places it (`Plan.best_effort`): served in
    part, not refused. `overload_steps` (FlowMaker's policies): before that, the plan for the largest part of the rate
    that keeps every SLO (`largest_rate_plan`), when there is one; at every step a plan that spans more than
    SCALE_OUT_SHARE of the cluster's GPUs is re-planned scaled out (`choose`); and a plan still that wide, the
    best-effort one included, is made for the part of the rate that a plan within that share carries (`narrow_plan`).
    """
    st = _ClusterState(ctx)
    deployments: list[TaskDeployment] = []
    unplaced: list[tuple[str, str]] = []
    decisions: list[StageDecision] = []
    rates: list[tuple[str, float]] = []
    served_best_effort: list[str] = []
    wide = len(ctx.cluster.gpus) * SCALE_OUT_SHARE
    gpu_price = default_gpu_price(-1.0, ctx.cluster)  # one GPU's memory

    def choose(q: SelectionRequest) -> SelectionResult:
        """`select`, and for FlowMaker's policies (`overload_steps`) a plan that spans more than SCALE_OUT_SHARE of the
        cluster's GPUs re-planned scaled out (GPUs priced, replicas allowed), kept when it spans fewer."""
        got = select(q, strategy)
        if overload_steps and got.variant is not None and got.variant.new_gpus > wide:
            alt = select(replace(q, options=replace(q.options, max_replicas=SCALE_OUT_REPLICAS, gpu_price_gb=gpu_price)),
                         strategy)
            if alt.variant is not None and alt.variant.new_gpus < got.variant.new_gpus:
                return alt
        return got

    for task in ctx.tasks:
        at = ctx.deploy_time(task)
        seen: Mapping[str, MeasuredLoad] | None = None
        if measured and ctx.monitor is not None and st.instances and allow_reuse:
            seen = ctx.monitor(tuple(st.instances), tuple(deployments), at)
            for iid in st.load:
                # As the orchestrator does: the larger of the planned and the measured figure (a quiet window
                # does not make a loaded instance look free).
                m = seen.get(iid)
                st.load[iid] = max(st.plan_load.get(iid, 0.0), m.load if m is not None else 0.0)
                st.busy[iid] = max(occupancy(st.offered.get(iid, 0.0)), m.busy_share if m is not None else 0.0)
        wfs = (task.fixed_nominal(ctx.trace_kind, ctx.plan_tokens),) if fixed_workflow else \
            task.nominal_workflows(ctx.trace_kind, ctx.plan_tokens)
        got = rate(task)
        tries = [max(x, 1e-6) for x in (got if isinstance(got, tuple) else (got,))]
        r = tries[0]  # a quiet minute still deploys the task, sized for almost nothing
        rates.append((task.name, r))
        slo = replace(task.slo(), arrival_rate_rps=r)
        profiles = ctx.profiles if ctx.max_instance_gpus <= 0 else \
            tuple(p for p in ctx.profiles if p.gpus <= ctx.max_instance_gpus)
        req = SelectionRequest(slo=slo, workflows=wfs, models=ctx.models, profiles=profiles,
                               cluster=st.as_cluster(),
                               options=SelectionOptions(
                                   utilization_cap=ctx.utilization_cap, allow_reuse=allow_reuse, seed=ctx.seed,
                                   capacity_model=capacity_model or ctx.capacity_model,
                                   gpu_sharing=GpuSharing.INTERFERENCE if sharing else GpuSharing.IGNORE,
                                   interference=ctx.interference, gpu_price_gb=ctx.gpu_price_gb))
        res = choose(req)
        for r2 in tries[1:]:
            if res.variant is not None:
                break
            # A burst asked for more than fits: the task still gets the plan for a lower rate, down to the one it
            # declared (the load follower scales out if the burst comes), rather than no plan at all.
            r = r2
            rates[-1] = (task.name, r)
            slo = replace(task.slo(), arrival_rate_rps=r)
            req = replace(req, slo=slo)
            res = choose(req)
        if res.variant is None and fallback and req.options.utilization_cap < 1.0:
            # Still nothing: the headroom kept for bursts is given up before the task itself is.
            req = replace(req, options=replace(req.options, utilization_cap=1.0))
            res = choose(req)
        if res.variant is None and fallback and seen is not None:
            # Still nothing: the headroom booked by the tasks before this one (their planned loads above what is
            # measured) is lent to it, as the load follower would give it back once they scale in.
            req = replace(req, cluster=st.as_cluster(seen))
            res = choose(req)
        if res.variant is None and overload_steps and req.options.gpu_sharing is GpuSharing.INTERFERENCE:
            # Still nothing: the task is planned for the largest part of its rate that some plan carries with every
            # SLO kept on the shared GPUs (`largest_rate_plan`), so that its excess traffic queues on its own
            # instances rather than slowing every co-resident of a sharing-blind plan.
            got_p = largest_rate_plan(req, choose)
            if got_p is not None:
                req, res = got_p
                rates[-1] = (task.name, req.slo.arrival_rate_rps)
                served_best_effort.append(task.name)
        if res.variant is None and best_effort and req.options.gpu_sharing is GpuSharing.INTERFERENCE:
            # Still nothing: no plan keeps every SLO on the shared GPUs. The task is served best-effort, as the
            # published (sharing-blind) contract places it, rather than refused: some of its requests meet the SLO.
            req = replace(req, options=replace(req.options, gpu_sharing=GpuSharing.IGNORE))
            res = select(req, strategy)
            if res.variant is not None:
                served_best_effort.append(task.name)
        if overload_steps and sharing and res.variant is not None and res.variant.new_gpus > wide:
            # Scaled out, the plan (one that keeps the SLOs, or the best-effort one) still spans more than
            # SCALE_OUT_SHARE of the cluster, which would leave the tasks after it only busy, shared GPUs: the task
            # gets the first lower rate it was to be tried at whose plan spans no more, else the largest part of the
            # lowest one that such a plan carries; its excess queues on its own instances. When no plan that narrow
            # carries any part of it, the wide plan stands.
            got_n = narrow_plan(req, [x for x in tries if x < req.slo.arrival_rate_rps], choose, wide)
            if got_n is not None:
                req, res = got_n
                rates[-1] = (task.name, req.slo.arrival_rate_rps)
                if req.slo.arrival_rate_rps < tries[-1] and task.name not in served_best_effort:
                    served_best_effort.append(task.name)
        if res.variant is None:
            why = res.reason.value if res.reason is not None else "INFEASIBLE"
            unplaced.append((task.name, f"{why}: {res.reason_detail}" if res.reason_detail else why))
            continue
        v = res.variant
        busy = req.options.capacity_model is CapacityModel.BUSY_TIME
        vwf = next(w for w in wfs if w.id == v.workflow_id)
        new_ids: dict[str, str] = {}
        for ni in v.new_instances:
            p = st.prof[(ni.model_id, ni.tp, ni.pp)]
            inst = st.add(p, ni.gpu_ids, task.name, planned_load(p, vwf, ni.load_output_tokens_per_s, busy), at)
            new_ids[ni.key] = inst.id
        for iid, added in v.reuse:
            p = next(i.profile for i in st.instances if i.id == iid)
            st.load[iid] += planned_load(p, vwf, added, busy)
            st.plan_load[iid] = st.plan_load.get(iid, 0.0) + planned_load(p, vwf, added, busy)
        stage_map = []
        alone = alone_latency(vwf, {a.stage_id: st.prof[(a.model_id, a.tp, a.pp)] for a in v.assignments})
        tol = max(1.0, slo.max_latency_s / alone) if alone > 0 else 0.0
        stage_of = {s.id: s for s in vwf.stages}
        for a in v.assignments:
            # a stage scaled out to replicas: each replica serves its share (the simulator routes each call to the
            # replica with the least outstanding work)
            iids = [a.instance_id] if a.reused else [new_ids[k] for k in (a.replica_keys or (a.new_key,))]
            s = stage_of[a.stage_id]
            p = st.prof[(a.model_id, a.tp, a.pp)]
            n = r * s.calls_per_request * p.call_latency_s(s.input_tokens, s.output_tokens) / len(iids)
            for iid in iids:
                stage_map.append((a.stage_id, iid))
                if iid in st.busy:  # measured before: the new calls join what was measured
                    st.busy[iid] = add_offered(st.busy[iid], n)
                st.offered[iid] = st.offered.get(iid, 0.0) + n
                if tol > 0:
                    st.tolerance[iid] = min(st.tolerance.get(iid, math.inf), tol)
            decisions.append(StageDecision(task.name, v.workflow_id, a.stage_id, iids[0], a.model_id, a.tp, a.pp,
                                           a.reused))
        deployments.append(TaskDeployment(task, (Route(v.workflow_id, tuple(stage_map)),)))
    return Plan("", tuple(st.instances), tuple(deployments), tuple(unplaced), tuple(decisions),
                planned_loads=tuple(st.load.items()), planned_rates=tuple(rates), best_effort=tuple(served_best_effort))


PARTIAL_HALVINGS = 6  # `largest_rate_plan`: the rate is found to within 1/64 of the last one tried
# A FlowMaker plan whose new instances span more than this share of the cluster's GPUs is re-planned scaled out: every
# GPU priced at one GPU's memory (docs/selection-spec.md, priced GPUs: the orchestrator's default) and up to
# SCALE_OUT_REPLICAS replicas per new instance (as the orchestrator's load follower may scale a stage out), and the
# re-plan is kept when it spans fewer GPUs. One task on most of the cluster leaves the tasks after it only shared,
# busy GPUs: under a sustained 4x overload chat took a Qwen2.5-14B tp8 and six of seven tasks were then served best
# effort. Measured (`bench serving`, seeds 0-3): the declared cells unchanged (no plan spans more than half there;
# on seed 4 one does, code at 100%, and is re-planned cheaper at the same goodput); sustained 4x and 8x, conv 0.518 ->
# 0.717 mean goodput (LangChain 0.541), code unchanged (0.266 -> 0.264). With 2 GPUs (a quarter) as the mark instead,
# the dominance fell to 26/32 declared cells and the overload gained nothing.
SCALE_OUT_SHARE = 0.5
SCALE_OUT_REPLICAS = 4


def largest_rate_plan(req: SelectionRequest, choose: Callable[[SelectionRequest], SelectionResult]
                      ) -> tuple[SelectionRequest, SelectionResult] | None:
    """The plan for the largest rate in (0, req's rate) at which `req` has a variant, to within 2^-PARTIAL_HALVINGS
    of that rate, by bisection: a variant that keeps every SLO at some rate keeps them at any lower one (less load,
    less busy time, the same placement), so the rates with a variant form an interval. None when not even the
    smallest rate tried has one.

    Measured under sustained overload (`bench serving --seed S --loads L --segment-requests 2400`, S = 0-3, L = 4, 8),
    against serving such a task sharing-blind at its whole rate: FlowMaker's mean goodput 0.213 -> 0.266 (code) and
    0.461 -> 0.518 (conv); at the declared loads no task gets this far, and no cell changes."""
    hi = req.slo.arrival_rate_rps
    lo, got = 0.0, None
    for _ in range(PARTIAL_HALVINGS):
        mid = (lo + hi) / 2
        trial = replace(req, slo=replace(req.slo, arrival_rate_rps=mid))
        res = choose(trial)
        if res.variant is not None:
            lo, got = mid, (trial, res)
        else:
            hi = mid
    return got


def narrow_plan(req: SelectionRequest, lower: Sequence[float], choose: Callable[[SelectionRequest], SelectionResult],
                wide: float) -> tuple[SelectionRequest, SelectionResult] | None:
    """A plan for `req`'s task whose new instances span at most `wide` GPUs: at the first of the `lower` rates
    (descending) that has one, else for the largest part of the lowest rate tried (`largest_rate_plan`); None when
    no such plan carries any part of it.

    Measured under a sustained overload (`bench serving --seed S --loads L --segment-requests 2400 --policies
    flowmaker,langchain`, S = 0-5, L = 4, 6, 8), both uses (plans that keep the SLOs, and sharing-blind best-effort
    plans): FlowMaker's mean goodput on the code trace 0.279 / 0.254 / 0.235 -> 0.318 / 0.297 / 0.345 (LangChain 0.344
    / 0.293 / 0.262); 17 of the 18 code cells gained or held, one fell (seed 4 at 6x, 0.196 -> 0.134); conv held,
    but seed 5 at 8x rose 0.574 -> 0.627. In the declared experiment (`bench serving --seed S`, S = 0-5) only seed 5's
    code trace changed: FlowMaker 0.304 -> 0.473 (75%) and 0.294 -> 0.519 (100%)."""
    def narrowed(q: SelectionRequest) -> SelectionResult:
        got = choose(q)
        return replace(got, variant=None) if got.variant is not None and got.variant.new_gpus > wide else got

    top = req.slo.arrival_rate_rps
    for x in lower:
        trial = replace(req, slo=replace(req.slo, arrival_rate_rps=x))
        res = narrowed(trial)
        if res.variant is not None:
            return trial, res
        top = x
    return largest_rate_plan(replace(req, slo=replace(req.slo, arrival_rate_rps=top)), narrowed)


def alone_latency(wf: Workflow, prof: Mapping[str, Profile]) -> float:
    """The workflow's latency with each LLM stage on its profile, alone on its GPUs."""
    fin: dict[str, float] = {}
    for k in wf.topo_order():
        s = wf.stages[k]
        lat = s.calls_per_request * prof[s.id].call_latency_s(s.input_tokens, s.output_tokens) if s.is_llm \
            else s.latency_s
        fin[s.id] = max((fin[d] for d in s.depends_on), default=0.0) + lat
    return max(fin.values(), default=0.0)


def planned_load(p: Profile, wf: Workflow, load: float, busy: bool) -> float:
    """The load a selection planned for an instance, as the next selection reads running loads: under busy-time
    capacity its busy-time equivalent (the busy fraction at wf's mean request x max_output_tokens_per_s, what
    the monitor measures), else the output tokens/s themselves."""
    if not busy:
        return load
    from flowmaker.selection.busytime import busy_capacity, mean_request

    return load * p.max_output_tokens_per_s / busy_capacity(p, *mean_request(wf))


def simulated_monitor(workload: SegmentWorkload, gpus: Sequence[Gpu], models: Mapping[str, Model],
                      gpu_type: GpuType, colocation: str = DEFAULT_COLOCATION,
                      colocation_kappa: float = 1.0) -> LoadMonitor:
    """A load monitor backed by the simulator: before a deploy at `at` it serves the deployed tasks' real
    arrivals of the two monitor windows before `at` (the first warms the instances up) with what is
    deployed so far, and reports each instance's busy-time-equivalent load over the last window
    (`InstanceMetrics`) and its busy share (from the call-seconds offered in that window, at each call's
    latency alone). Only the past is seen: nothing after `at`."""
    w = workload.window_s

    def monitor(instances: Sequence[SimInstance], deployments: Sequence[TaskDeployment],
                at: float) -> Mapping[str, MeasuredLoad]:
        live = {d.task.name for d in deployments}
        arr = [a for a in workload.arrivals if a.task in live and at - 2 * w <= a.time_s < at]
        res = simulate(instances, deployments, arr, gpus, models, gpu_type, duration_s=at,
                       measure_from_s=max(0.0, at - w), colocation=colocation, colocation_kappa=colocation_kappa)
        return {m.id: MeasuredLoad(m.busy_equiv_tokens_per_s, occupancy(m.offered)) for m in res.per_instance}
    return monitor


# ---- FlowMaker -----------------------------------------------------------------------------------


@register("flowmaker")
def flowmaker(ctx: PolicyContext) -> Plan:
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, rate=ctx.planning_rates, fixed_workflow=False,
                               measured=True, fallback=True, best_effort=True, overload_steps=True)


@register("flowmaker-paper")
def flowmaker_paper(ctx: PolicyContext) -> Plan:
    """`flowmaker` under the paper-literal contract: output-token capacity, GPUs shared as if free."""
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, rate=ctx.planning_rates, fixed_workflow=False,
                               measured=True, sharing=False, capacity_model=CapacityModel.OUTPUT_TOKENS,
                               fallback=True)


@register("flowmaker-noreuse")
def flowmaker_noreuse(ctx: PolicyContext) -> Plan:
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=False, rate=ctx.planning_rates, fixed_workflow=False,
                               measured=True, fallback=True, best_effort=True, overload_steps=True)


@register("flowmaker-plannedload")
def flowmaker_plannedload(ctx: PolicyContext) -> Plan:
    """FlowMaker as the orchestrator records load today: an instance's load is the sum of the loads its tasks'
    selections planned (rho x output tokens at the median request), not a measurement."""
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, rate=ctx.planning_rates, fixed_workflow=False,
                               measured=False, fallback=True, best_effort=True, overload_steps=True)


@register("flowmaker-heuristic")
def flowmaker_heuristic(ctx: PolicyContext) -> Plan:
    return _select_in_sequence(ctx, strategy="heuristic", allow_reuse=True, rate=ctx.planning_rates,
                               fixed_workflow=False, measured=True, fallback=True, best_effort=True, overload_steps=True)


# ---- Murakkab ------------------------------------------------------------------------------------


@register("murakkab")
def murakkab(ctx: PolicyContext) -> Plan:
    """Fixed workflow, per-stage model/config by the optimiser, reuse planned offline: at the preceding stretch's
    rate (the declared experiment) or the segment's mean (the older setup)."""
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, rate=ctx.offline_rate, fixed_workflow=True,
                               measured=False, sharing=ctx.baseline_sharing,
                               best_effort=True)


@register("murakkab-maxload")
def murakkab_maxload(ctx: PolicyContext) -> Plan:
    """Murakkab planned offline at each task's peak monitor-window rate (of the preceding stretch, or of the
    segment in the older setup)."""
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, rate=ctx.offline_peak_rate,
                               fixed_workflow=True, measured=False, sharing=ctx.baseline_sharing,
                               best_effort=True)


@register("murakkab-noreuse")
def murakkab_noreuse(ctx: PolicyContext) -> Plan:
    """Murakkab without reuse across tasks (a sensitivity baseline): every task's fixed workflow on instances of
    its own, planned offline as `murakkab`."""
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=False, rate=ctx.offline_rate, fixed_workflow=True,
                               measured=False, sharing=ctx.baseline_sharing,
                               best_effort=True)


# ---- LangChain -----------------------------------------------------------------------------------


def _smallest_fitting(ctx: PolicyContext, model_id: str) -> Profile | None:
    """The config a developer starts with: pp=1 and the smallest tp that fits."""
    ps = sorted((p for p in ctx.profiles if p.model_id == model_id and p.pp == 1), key=lambda p: p.tp)
    return ps[0] if ps else None


def langchain_model(task: EvalTask, models: Sequence[Model], rule: str = "smallest") -> str:
    """The hand-written model choice (`LANGCHAIN_MODEL_RULES`); see the module doc."""
    if rule not in LANGCHAIN_MODEL_RULES:
        raise InvalidSpec(f"unknown LangChain model rule {rule!r}; known: {list(LANGCHAIN_MODEL_RULES)}",
                          field="langchain_model")
    by_id = {m.id: m for m in models}
    if rule == "strong" and LANGCHAIN_DEFAULT_MODEL in by_id:
        return LANGCHAIN_DEFAULT_MODEL
    ok = sorted((m for m in models if m.accuracy >= task.min_accuracy), key=lambda m: (m.params_b, -m.accuracy, m.id))
    if ok:
        return ok[0].id
    raise InvalidSpec(f"no catalog model meets task {task.name!r}'s accuracy target {task.min_accuracy}",
                      field="models")


@register("langchain")
def langchain(ctx: PolicyContext) -> Plan:
    st = _ClusterState(ctx)
    deployments: list[TaskDeployment] = []
    unplaced: list[tuple[str, str]] = []
    failures: list[tuple[str, str, str]] = []
    decisions: list[StageDecision] = []
    for task in ctx.tasks:
        at = ctx.deploy_time(task)
        wf = task.fixed_nominal(ctx.trace_kind, ctx.plan_tokens)
        mid = langchain_model(task, ctx.models, ctx.langchain_model)
        prof = _smallest_fitting(ctx, mid)
        if prof is None:
            unplaced.append((task.name, f"NO_PROFILE: {mid} has no pp=1 config on {ctx.gpu_type.name}"))
            continue
        placed: list[tuple[str, SimInstance]] = []
        failed = ""
        for s in wf.llm_stages:  # one instance per stage, first fit
            inst = st.place_first_fit(prof, task.name, at)
            if inst is None:
                failed = s.id
                why = (f"NO_GPU_MEMORY: stage {s.id!r} needs {prof.gpus} GPU(s) with {prof.memory_gb_per_gpu:.1f} GB "
                       f"free for {mid} (first fit)")
                failures.append((task.name, s.id, why))
                break
            placed.append((s.id, inst))
        if failed:
            for _, inst in placed:  # the deploy failed: tear down what it had started
                st.remove(inst)
            unplaced.append((task.name, failures[-1][2]))
            continue
        stage_map = tuple((sid, inst.id) for sid, inst in placed)
        decisions.extend(StageDecision(task.name, wf.id, sid, iid, mid, prof.tp, prof.pp, False)
                         for sid, iid in stage_map)
        deployments.append(TaskDeployment(task, (Route(wf.id, stage_map),)))
    return Plan("", tuple(st.instances), tuple(deployments), tuple(unplaced), tuple(decisions),
                planned_loads=tuple(st.load.items()), placement_failures=tuple(failures),
                notes=f"model rule {ctx.langchain_model!r}")


# ---- RouteLLM ------------------------------------------------------------------------------------


def router_score(seed: int, req_id: str) -> float:
    """The router's per-request score in [0, 1): a seeded hash, so every policy sees the same score per request."""
    h = hashlib.blake2b(f"{seed}/{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0 ** 64


@dataclass(slots=True)
class _RouteLLMRouter:
    """Strong model when the score is in the top `strong_share`; the least-loaded replica of that model."""

    seed: int
    strong_share: float
    strong: tuple[tuple[int, str], ...]  # (route index, instance id)
    weak: tuple[tuple[int, str], ...]
    calls: list[int] = field(default_factory=lambda: [0, 0])  # how many requests went strong / weak

    def __call__(self, a: Arrival, k: int, outstanding: Callable[[str], float]) -> int:
        s = router_score(self.seed, a.req_id)
        to_strong = s >= 1.0 - self.strong_share or not self.weak
        pool = self.strong if to_strong and self.strong else self.weak
        self.calls[0 if pool is self.strong else 1] += 1
        return min(pool, key=lambda ri: (outstanding(ri[1]), ri[0]))[0]


def busy_seconds(prof: Profile, wf: Workflow) -> float:
    """Engine seconds a request's LLM calls take in a full batch: prefill stalls the batch, decode shares it."""
    return sum(s.calls_per_request * (prof.prefill_s_per_token * s.input_tokens
                                      + s.output_tokens / prof.pure_decode_tokens_per_s) for s in wf.llm_stages)


def lone_latency_s(wf: Workflow, prof: Profile) -> float:
    """A lone request's latency with every LLM stage on an instance of `prof`: the DAG's critical path."""
    finish: dict[str, float] = {}
    for s in wf.stages:
        start = max((finish[d] for d in s.depends_on), default=0.0)
        dur = s.calls_per_request * prof.call_latency_s(s.input_tokens, s.output_tokens) if s.is_llm else s.latency_s
        finish[s.id] = start + dur
    return max(finish.values(), default=0.0)


def _routellm_profile(ctx: PolicyContext, model_id: str, wfs: Mapping[str, Workflow]) -> Profile:
    """The smallest tp (pp=1) with which a lone request of every task meets its latency target; when none does,
    the one with the least worst ratio of latency to target."""
    cands = sorted((p for p in ctx.profiles if p.model_id == model_id and p.pp == 1), key=lambda p: p.tp)
    if not cands:
        raise InvalidSpec(f"routellm needs a pp=1 profile of {model_id}", field="profiles")

    def worst(p: Profile) -> float:
        return max(lone_latency_s(wfs[t.name], p) / t.max_latency_s for t in ctx.tasks)
    ok = [p for p in cands if worst(p) <= 1.0]
    return ok[0] if ok else min(cands, key=lambda p: (worst(p), p.tp))


def _routellm(ctx: PolicyContext, setting: str) -> Plan:
    share = ROUTELLM_STRONG_SHARE[setting]
    st = _ClusterState(ctx)
    at = min((ctx.deploy_time(t) for t in ctx.tasks), default=0.0)
    size_wf = {t.name: t.fixed_nominal(ctx.trace_kind, ROUTELLM_SIZE_STAT) for t in ctx.tasks}
    shares = {ROUTELLM_STRONG: share, ROUTELLM_WEAK: 1.0 - share}
    profs = {m: _routellm_profile(ctx, m, size_wf) for m in shares if shares[m] > 0}
    # Replicas per model: the busy time of its share of every task's requests at the segment's mean rate, under
    # the cap.
    need = {m: sum(shares[m] * ctx.routellm_sizing_rate(t) * busy_seconds(profs[m], size_wf[t.name])
                   for t in ctx.tasks) for m in profs}
    want = {m: max(1, math.ceil(need[m] / ctx.utilization_cap)) for m in profs}
    pools: dict[str, list[SimInstance]] = {m: [] for m in profs}
    budget = ctx.routellm_gpu_budget_gb or math.inf
    capped = False
    progress = True
    while progress:  # place the pools alternately so that each gets replicas when memory runs out
        progress = False
        for mid in profs:
            if len(pools[mid]) < want[mid]:
                if sum(i.memory_gb for i in st.instances) + profs[mid].total_memory_gb > budget + 1e-9 and pools[mid]:
                    capped = True
                    continue
                inst = st.place(profs[mid], "routellm", 0.0, at)
                if inst is not None:
                    pools[mid].append(inst)
                    progress = True
    if any(not v for v in pools.values()):
        return Plan("", tuple(st.instances), (), tuple((t.name, "NO_GPU_MEMORY: router pools do not fit")
                                                       for t in ctx.tasks))
    short = {m: want[m] - len(pools[m]) for m in want if len(pools[m]) < want[m]}
    ordered = pools.get(ROUTELLM_STRONG, []) + pools.get(ROUTELLM_WEAK, [])
    deployments: list[TaskDeployment] = []
    decisions: list[StageDecision] = []
    for ti, task in enumerate(ctx.tasks):
        wf = size_wf[task.name]
        routes = tuple(Route(wf.id, tuple((s.id, inst.id) for s in wf.llm_stages)) for inst in ordered)
        idx = {inst.id: k for k, inst in enumerate(ordered)}
        router = _RouteLLMRouter(ctx.seed, share,
                                 tuple((idx[i.id], i.id) for i in pools.get(ROUTELLM_STRONG, [])),
                                 tuple((idx[i.id], i.id) for i in pools.get(ROUTELLM_WEAK, [])))
        deployments.append(TaskDeployment(task, routes, router))
        for inst in [p[0] for p in pools.values()]:
            decisions.extend(StageDecision(task.name, wf.id, s.id, inst.id, inst.profile.model_id, inst.profile.tp,
                                           inst.profile.pp, ti > 0) for s in wf.llm_stages)
    return Plan("", tuple(st.instances), tuple(deployments), (), tuple(decisions),
                notes=f"{share:.0%} of requests to {ROUTELLM_STRONG}; pools "
                      + ", ".join(f"{m} tp{profs[m].tp} x{len(pools[m])}" for m in profs)
                      + (f"; short of {short} replicas ({'capped at the GPU budget' if capped else 'no GPU memory'})"
                         if short else ""))


@register("routellm-min-cost")
def routellm_min_cost(ctx: PolicyContext) -> Plan:
    return _routellm(ctx, "min-cost")


@register("routellm-balanced")
def routellm_balanced(ctx: PolicyContext) -> Plan:
    return _routellm(ctx, "balanced")


@register("routellm-max-quality")
def routellm_max_quality(ctx: PolicyContext) -> Plan:
    return _routellm(ctx, "max-quality")


ALL_POLICIES: tuple[str, ...] = ("flowmaker", "flowmaker-paper", "flowmaker-noreuse", "flowmaker-heuristic", "flowmaker-plannedload",
                                 "langchain",
                                 "routellm-min-cost", "routellm-balanced", "routellm-max-quality", "murakkab",
                                 "murakkab-maxload", "murakkab-noreuse")
