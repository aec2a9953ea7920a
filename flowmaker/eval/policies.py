"""Serving policies compared in `bench serving`, looked up by name: FlowMaker and the published baselines.

Every policy turns the same inputs (tasks, trace kind, load level, models, profiles, an
empty cluster) into a `Plan`: instances on GPUs and, per task, how requests are routed.
The simulator then serves the same arrivals with every plan. The baselines get exactly
the profiles, cluster and simulator FlowMaker gets; their fixed choices are documented
below and in docs/evaluation.md, and none was tuned against the results.

* `flowmaker`: the exact selector over each task's 3 candidates, tasks deployed one after
  another into one cluster; each selection sees the instances the earlier tasks left and their
  CURRENT load -- measured by `ctx.monitor` (in the bench: the simulator serving a preceding
  window of the same load level; busy-time equivalent, so prefill and the token tail count) --
  and may reuse them. Planned at the run's load level.
* `flowmaker-noreuse`: the same with `allow_reuse=False`.
* `flowmaker-heuristic`: the paper's three-step heuristic instead of the exact selector.
* `flowmaker-plannedload`: `flowmaker`, but an instance's load is the sum of what the
  selections planned (what the orchestrator records today), not a measurement.
* `langchain`: what a developer writes by hand: each task's first candidate (the plain one),
  one model for every stage -- Qwen2.5-14B-Instruct, the most accurate model that fits one
  48 GB GPU, or, where the task's accuracy SLO is above it, the smallest catalog model that
  meets the SLO -- at the smallest tensor-parallel degree that fits (pp=1), on a dedicated
  instance per task, no reuse.
* `routellm[-min-cost|-balanced|-max-quality]`: each task's first candidate; every request
  is routed to Qwen2.5-14B-Instruct (strong) or Qwen2.5-7B-Instruct (weak) by a router score
  against a threshold (20% / 50% / 80% of requests to the strong model); a request's accuracy
  is the model it went to. One pool per model serves all tasks, tp=1, with as many replicas
  as the planned busy time (prefill + decode share) needs under the utilisation cap.
* `murakkab[-maxload]`: each task's first candidate; model and config chosen per stage by
  the same exact optimiser, with reuse, but planned offline once: from the average load of
  the run levels (62.5% of nominal) or, for `-maxload`, from the maximum (100%), whatever
  load the run then sees; the loads it reuses by are its own planned estimates (no monitor).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from flowmaker.domain import (
    Cluster,
    Gpu,
    GpuType,
    Instance,
    Model,
    Profile,
    SelectionOptions,
    SelectionRequest,
    Workflow,
)
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.tasks import EvalTask
from flowmaker.eval.traces import LOAD_LEVELS, Arrival
from flowmaker.selection import select
from flowmaker.selection.placement import NodeGpus, place_least_loaded
from flowmaker.sim.cluster import Route, SimInstance, TaskDeployment, simulate

# What a policy that decides reuse from the CURRENT load reads before each deployment: the load each
# running instance carries now (output tokens/s, busy-time equivalent), given what is deployed so far.
LoadMonitor = Callable[[Sequence[SimInstance], Sequence[TaskDeployment]], Mapping[str, float]]

DEFAULT_UTILIZATION_CAP = 0.8  # every policy that sizes for load keeps 20% headroom for bursts

LANGCHAIN_DEFAULT_MODEL = "Qwen2.5-14B-Instruct"
ROUTELLM_STRONG = "Qwen2.5-14B-Instruct"
ROUTELLM_WEAK = "Qwen2.5-7B-Instruct"
ROUTELLM_STRONG_SHARE = {"min-cost": 0.2, "balanced": 0.5, "max-quality": 0.8}


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
        self.prof = {p.key: p for p in ctx.profiles}

    def as_cluster(self) -> Cluster:
        gpus = tuple(Gpu(g.id, g.node, g.memory_total_gb, g.memory_total_gb - self.free[g.id], g.gpu_type)
                     for g in self.gpus)
        inst = tuple(Instance(i.id, i.profile.model_id, i.profile.tp, i.profile.pp, i.gpu_ids, self.load[i.id])
                     for i in self.instances)
        return Cluster(gpus, inst)

    def add(self, profile: Profile, gpu_ids: tuple[str, ...], task: str, load: float) -> SimInstance:
        iid = f"i{len(self.instances)}-{profile.model_id}-tp{profile.tp}pp{profile.pp}"
        for g in gpu_ids:
            self.free[g] -= profile.memory_gb_per_gpu
        inst = SimInstance(iid, profile, gpu_ids, deployed_by=task)
        self.instances.append(inst)
        self.load[iid] = load
        return inst

    def place(self, profile: Profile, task: str, load: float) -> SimInstance | None:
        """A new instance placed LeastLoaded (the spec's rule), or None when no node has room."""
        spot = place_least_loaded(self.layout, self.free, profile.gpus, profile.memory_gb_per_gpu)
        if spot is None:
            return None
        return self.add(profile, spot[1], task, load)


def _stage_load(wf: Workflow, rate: float) -> dict[str, float]:
    return {s.id: rate * s.calls_per_request * s.output_tokens for s in wf.llm_stages}


def _select_in_sequence(ctx: PolicyContext, *, strategy: str, allow_reuse: bool, plan_load: float,
                        fixed_workflow: bool, measured: bool) -> Plan:
    """Deploy tasks one after another with the selector; each sees what the earlier ones deployed.

    `measured`: before each deployment the running instances' loads are replaced by what
    `ctx.monitor` measures (the current load); otherwise they are the sums of the planned loads.
    """
    st = _ClusterState(ctx)
    deployments: list[TaskDeployment] = []
    unplaced: list[tuple[str, str]] = []
    decisions: list[StageDecision] = []
    for task in ctx.tasks:
        if measured and ctx.monitor is not None and st.instances and allow_reuse:
            seen = ctx.monitor(tuple(st.instances), tuple(deployments))
            for iid in st.load:
                st.load[iid] = max(0.0, float(seen.get(iid, 0.0)))
        wfs = task.nominal_workflows(ctx.trace_kind, ctx.plan_tokens)
        if fixed_workflow:
            wfs = wfs[:1]
        req = SelectionRequest(slo=task.slo(plan_load), workflows=wfs, models=ctx.models, profiles=ctx.profiles,
                               cluster=st.as_cluster(),
                               options=SelectionOptions(utilization_cap=ctx.utilization_cap, allow_reuse=allow_reuse,
                                                        seed=ctx.seed))
        res = select(req, strategy)
        if res.variant is None:
            why = res.reason.value if res.reason is not None else "INFEASIBLE"
            unplaced.append((task.name, f"{why}: {res.reason_detail}" if res.reason_detail else why))
            continue
        v = res.variant
        new_ids: dict[str, str] = {}
        for ni in v.new_instances:
            inst = st.add(st.prof[(ni.model_id, ni.tp, ni.pp)], ni.gpu_ids, task.name, ni.load_output_tokens_per_s)
            new_ids[ni.key] = inst.id
        for iid, added in v.reuse:
            st.load[iid] += added
        stage_map = []
        for a in v.assignments:
            iid = a.instance_id if a.reused else new_ids[a.new_key]
            stage_map.append((a.stage_id, iid))
            decisions.append(StageDecision(task.name, v.workflow_id, a.stage_id, iid, a.model_id, a.tp, a.pp,
                                           a.reused))
        deployments.append(TaskDeployment(task, (Route(v.workflow_id, tuple(stage_map)),)))
    return Plan("", tuple(st.instances), tuple(deployments), tuple(unplaced), tuple(decisions),
                planned_loads=tuple(st.load.items()))


def simulated_monitor(arrivals: Sequence[Arrival], gpus: Sequence[Gpu], models: Mapping[str, Model],
                      gpu_type: GpuType, duration_s: float) -> LoadMonitor:
    """A load monitor backed by the simulator: it serves `arrivals` (a window of the same load level that
    precedes the evaluated one, so the policy never sees the requests it is scored on) with what is
    deployed so far and reports each instance's busy-time-equivalent load (`InstanceMetrics`)."""
    def monitor(instances: Sequence[SimInstance], deployments: Sequence[TaskDeployment]) -> Mapping[str, float]:
        live = {d.task.name for d in deployments}
        res = simulate(instances, deployments, [a for a in arrivals if a.task in live], gpus, models, gpu_type,
                       duration_s=duration_s)
        return {m.id: m.busy_equiv_tokens_per_s for m in res.per_instance}
    return monitor


# ---- FlowMaker -----------------------------------------------------------------------------------


@register("flowmaker")
def flowmaker(ctx: PolicyContext) -> Plan:
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, plan_load=ctx.load, fixed_workflow=False,
                               measured=True)


@register("flowmaker-noreuse")
def flowmaker_noreuse(ctx: PolicyContext) -> Plan:
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=False, plan_load=ctx.load, fixed_workflow=False,
                               measured=True)


@register("flowmaker-plannedload")
def flowmaker_plannedload(ctx: PolicyContext) -> Plan:
    """FlowMaker as the orchestrator records load today: an instance's load is the sum of the loads its tasks'
    selections planned (rho x output tokens at the median request), not a measurement."""
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, plan_load=ctx.load, fixed_workflow=False,
                               measured=False)


@register("flowmaker-heuristic")
def flowmaker_heuristic(ctx: PolicyContext) -> Plan:
    return _select_in_sequence(ctx, strategy="heuristic", allow_reuse=True, plan_load=ctx.load,
                               fixed_workflow=False, measured=True)


# ---- Murakkab ------------------------------------------------------------------------------------


@register("murakkab")
def murakkab(ctx: PolicyContext) -> Plan:
    """Fixed workflow, per-stage model/config by the optimiser, reuse planned offline at the average load."""
    avg = sum(LOAD_LEVELS) / len(LOAD_LEVELS)
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, plan_load=avg, fixed_workflow=True,
                               measured=False)


@register("murakkab-maxload")
def murakkab_maxload(ctx: PolicyContext) -> Plan:
    return _select_in_sequence(ctx, strategy="exact", allow_reuse=True, plan_load=max(LOAD_LEVELS),
                               fixed_workflow=True, measured=False)


# ---- LangChain -----------------------------------------------------------------------------------


def _smallest_fitting(ctx: PolicyContext, model_id: str) -> Profile | None:
    """The config a developer starts with: pp=1 and the smallest tp that fits."""
    ps = sorted((p for p in ctx.profiles if p.model_id == model_id and p.pp == 1), key=lambda p: p.tp)
    return ps[0] if ps else None


def langchain_model(task: EvalTask, models: Sequence[Model]) -> str:
    """The hand-written choice: Qwen2.5-14B-Instruct, or the smallest model meeting alpha when it does not."""
    by_id = {m.id: m for m in models}
    default = by_id.get(LANGCHAIN_DEFAULT_MODEL)
    if default is not None and default.accuracy >= task.min_accuracy:
        return default.id
    ok = sorted((m for m in models if m.accuracy >= task.min_accuracy), key=lambda m: (m.params_b, m.id))
    if ok:
        return ok[0].id
    if default is not None:
        return default.id
    raise InvalidSpec(f"no model for task {task.name!r}", field="models")


@register("langchain")
def langchain(ctx: PolicyContext) -> Plan:
    st = _ClusterState(ctx)
    deployments: list[TaskDeployment] = []
    unplaced: list[tuple[str, str]] = []
    decisions: list[StageDecision] = []
    for task in ctx.tasks:
        wf = task.nominal_workflows(ctx.trace_kind, ctx.plan_tokens)[0]
        mid = langchain_model(task, ctx.models)
        prof = _smallest_fitting(ctx, mid)
        if prof is None:
            unplaced.append((task.name, f"NO_PROFILE: {mid} has no pp=1 config on {ctx.gpu_type.name}"))
            continue
        load = sum(_stage_load(wf, task.nominal_rate_rps * ctx.load).values())
        inst = st.place(prof, task.name, load)
        if inst is None:
            unplaced.append((task.name, f"NO_GPU_MEMORY: no node has {prof.gpus} GPU(s) with "
                                        f"{prof.memory_gb_per_gpu:.1f} GB free for {mid}"))
            continue
        stage_map = tuple((s.id, inst.id) for s in wf.llm_stages)
        decisions.extend(StageDecision(task.name, wf.id, s, inst.id, mid, prof.tp, prof.pp, False)
                         for s, _ in stage_map)
        deployments.append(TaskDeployment(task, (Route(wf.id, stage_map),)))
    return Plan("", tuple(st.instances), tuple(deployments), tuple(unplaced), tuple(decisions),
                planned_loads=tuple(st.load.items()))


# ---- RouteLLM ------------------------------------------------------------------------------------


def router_score(seed: int, req_id: str) -> float:
    """The router's per-request score in [0, 1): a seeded hash, so every policy sees the same score per request."""
    h = hashlib.blake2b(f"{seed}/{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0 ** 64


@dataclass(slots=True)
class _RouteLLMRouter:
    """Strong model when the score is in the top `strong_share`; replicas of a model picked by hash."""

    seed: int
    strong_share: float
    n_strong: int
    n_weak: int
    calls: list[int] = field(default_factory=lambda: [0, 0])  # how many requests went strong / weak

    def __call__(self, a: Arrival, k: int) -> int:
        s = router_score(self.seed, a.req_id)
        rep = int(router_score(self.seed + 1, a.req_id) * 1e9)
        if s >= 1.0 - self.strong_share:
            self.calls[0] += 1
            return rep % self.n_strong
        self.calls[1] += 1
        return self.n_strong + rep % self.n_weak


def _busy_s(prof: Profile, wf: Workflow) -> float:
    """Seconds of one instance's time a request's LLM calls take at full batch: prefill stalls the batch,
    decode shares it (out / max throughput). Sizing by output tokens alone would miss the code trace's
    long prompts, so the router pools are sized generously with this."""
    return sum(s.calls_per_request * (prof.prefill_s_per_token * s.input_tokens
                                      + s.output_tokens / prof.max_output_tokens_per_s) for s in wf.llm_stages)


def _routellm(ctx: PolicyContext, setting: str) -> Plan:
    share = ROUTELLM_STRONG_SHARE[setting]
    st = _ClusterState(ctx)
    profs: dict[str, Profile] = {}
    for mid in (ROUTELLM_STRONG, ROUTELLM_WEAK):
        prof = _smallest_fitting(ctx, mid)
        if prof is None:
            raise InvalidSpec(f"routellm needs a pp=1 profile of {mid}", field="profiles")
        profs[mid] = prof
    # Replicas per model: the planned busy time of its share of every task's requests, under the cap.
    need = {ROUTELLM_STRONG: 0.0, ROUTELLM_WEAK: 0.0}
    for task in ctx.tasks:
        wf = task.nominal_workflows(ctx.trace_kind, ctx.plan_tokens)[0]
        rate = task.nominal_rate_rps * ctx.load
        need[ROUTELLM_STRONG] += share * rate * _busy_s(profs[ROUTELLM_STRONG], wf)
        need[ROUTELLM_WEAK] += (1 - share) * rate * _busy_s(profs[ROUTELLM_WEAK], wf)
    want = {m: max(1, math.ceil(need[m] / ctx.utilization_cap)) for m in need}
    pools: dict[str, list[SimInstance]] = {ROUTELLM_STRONG: [], ROUTELLM_WEAK: []}
    unplaced: list[tuple[str, str]] = []
    # Place the two pools alternately so that both get replicas when the cluster runs out of memory.
    progress = True
    while progress:
        progress = False
        for mid in (ROUTELLM_STRONG, ROUTELLM_WEAK):
            if len(pools[mid]) < want[mid]:
                inst = st.place(profs[mid], "routellm", 0.0)
                if inst is not None:
                    pools[mid].append(inst)
                    progress = True
    if not pools[ROUTELLM_STRONG] or not pools[ROUTELLM_WEAK]:
        return Plan("", tuple(st.instances), (), tuple((t.name, "NO_GPU_MEMORY: router pools do not fit")
                                                       for t in ctx.tasks))
    short = {m: want[m] - len(pools[m]) for m in want if len(pools[m]) < want[m]}
    deployments: list[TaskDeployment] = []
    decisions: list[StageDecision] = []
    for ti, task in enumerate(ctx.tasks):
        wf = task.nominal_workflows(ctx.trace_kind, ctx.plan_tokens)[0]
        routes = tuple(Route(wf.id, tuple((s.id, inst.id) for s in wf.llm_stages))
                       for inst in pools[ROUTELLM_STRONG] + pools[ROUTELLM_WEAK])
        router = _RouteLLMRouter(ctx.seed, share, len(pools[ROUTELLM_STRONG]), len(pools[ROUTELLM_WEAK]))
        deployments.append(TaskDeployment(task, routes, router))
        for inst in pools[ROUTELLM_STRONG][:1] + pools[ROUTELLM_WEAK][:1]:
            decisions.extend(StageDecision(task.name, wf.id, s.id, inst.id, inst.profile.model_id, inst.profile.tp,
                                           inst.profile.pp, ti > 0) for s in wf.llm_stages)
    return Plan("", tuple(st.instances), tuple(deployments), tuple(unplaced), tuple(decisions),
                notes=f"{share:.0%} of requests to {ROUTELLM_STRONG}; replicas strong/weak "
                      f"{len(pools[ROUTELLM_STRONG])}/{len(pools[ROUTELLM_WEAK])}"
                      + (f"; short of {short} replicas (no GPU memory)" if short else ""))


@register("routellm-min-cost")
def routellm_min_cost(ctx: PolicyContext) -> Plan:
    return _routellm(ctx, "min-cost")


@register("routellm-balanced")
def routellm_balanced(ctx: PolicyContext) -> Plan:
    return _routellm(ctx, "balanced")


@register("routellm-max-quality")
def routellm_max_quality(ctx: PolicyContext) -> Plan:
    return _routellm(ctx, "max-quality")


ALL_POLICIES: tuple[str, ...] = ("flowmaker", "flowmaker-noreuse", "flowmaker-heuristic", "flowmaker-plannedload",
                                 "langchain",
                                 "routellm-min-cost", "routellm-balanced", "routellm-max-quality", "murakkab",
                                 "murakkab-maxload")
