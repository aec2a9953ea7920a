"""Discrete-event simulator of a GPU cluster serving multi-step LLM workflows from a request trace.

What it models (and what it does not):

* Each deployed instance is a `flowmaker.engine.EngineModel` (iteration-level continuous
  batching, the SAME model the emulated engine uses), parameterised by the instance's
  profile, with the KV budget and batch limit the analytic profiles reserve memory for.
* An instance holds its GPU memory from its deploy time (`SimInstance.start_s`) until the run
  window ends or its own last call finishes, whichever is later; cost charges each instance for
  its own residence. Several tasks may send requests to the same instance (reuse). An instance
  retired mid-run (`SimInstance.end_s`: no new request is routed to it from then on, make-before-break)
  holds its memory until `end_s` or until its in-flight calls finish, whichever is later.
* GPU sharing (`colocation`): by default ("dynamic") the instances placed on one GPU share its
  bandwidth and compute while they are busy: at every event boundary each instance runs at
  1 / (the most busy instances on any of its GPUs, itself included), where busy means it has a
  call in flight; the engine model stretches the rest of its work accordingly
  (`EngineModel.set_speed`). "ignore" runs each at full speed (the selection spec's
  assumption); "worst-case" slows each by the most instances on any of its GPUs all the time.
* A request follows its workflow's DAG: a stage starts when all the stages it depends on
  have finished; a TOOL stage takes its `latency_s`; an LLM stage makes `calls_per_request`
  calls one after another (the selection spec's latency model multiplies the per-call
  latency, so calls are sequential here too).
* A request's accuracy is the least accuracy of the models that served its LLM stages (the
  spec's variant accuracy). It counts toward goodput when it completes within its task's
  latency SLO and that accuracy meets the task's accuracy SLO.
* Cost = sum over instances of GB reserved x residence time x the GPU's price per GB-second.
* Per instance, the load it actually carried (`InstanceMetrics`): output tokens/s and a
  busy-time equivalent that also counts prefill -- what a policy that decides reuse from
  the current load reads (`flowmaker.eval.policies.simulated_monitor`).

There is no randomness inside: the same inputs give the same result. (Randomness, e.g. a
router's, lives in the inputs and is seeded by the caller.)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from flowmaker.domain import Gpu, GpuType, Model, Profile, Workflow
from flowmaker.engine import Completion, EngineModel
from flowmaker.errors import InvalidSpec
from flowmaker.eval.tasks import EvalTask
from flowmaker.eval.traces import Arrival, quantile
from flowmaker.selection.placement import EPS_GB
from flowmaker.sharing import validate_interference

# KV budget and batch limit of one instance: what the analytic profiles reserve memory for
# (flowmaker.profiling.analytic.KV_RESERVED_TOKENS / MAX_BATCH; repeated here so the
# simulator does not depend on how profiles were obtained).
DEFAULT_KV_TOKENS = 32768
DEFAULT_MAX_BATCH = 256
# How instances that share a GPU (by memory, as the selection spec places them) share its compute:
# "ignore" -- each runs at its profile's speed, as if alone (the spec's and the selector's assumption);
# "worst-case" -- each is slowed by the most instances on any of its GPUs, as if they were all busy all the
# time (prefill and decode times x k, throughput / k). The truth lies in between; see docs/evaluation.md.
# "dynamic" -- the default: an instance is slowed only while its GPU neighbours are busy (module doc).
COLOCATION_MODES = ("dynamic", "ignore", "worst-case")
DEFAULT_COLOCATION = "dynamic"


def colocation_factor(instances: Sequence[SimInstance]) -> dict[str, int]:
    """Per instance: the most instances (itself included) placed on any one of its GPUs."""
    per_gpu: dict[str, int] = {}
    for i in instances:
        for g in i.gpu_ids:
            per_gpu[g] = per_gpu.get(g, 0) + 1
    return {i.id: max((per_gpu[g] for g in i.gpu_ids), default=1) for i in instances}


def _slowed(p: Profile, k: float) -> Profile:
    if k <= 1:
        return p
    return replace(p, prefill_s_per_token=p.prefill_s_per_token * k, decode_s_per_token=p.decode_s_per_token * k,
                   max_output_tokens_per_s=p.max_output_tokens_per_s / k,
                   decode_tokens_per_s=p.decode_tokens_per_s / k)


@dataclass(frozen=True, slots=True)
class SimInstance:
    """A deployed instance: which profile, on which GPUs, deployed by which task (for the reuse ablation)."""

    id: str
    profile: Profile
    gpu_ids: tuple[str, ...]
    deployed_by: str = ""  # task whose selection created it
    start_s: float = 0.0  # deploy time: residence (and cost) starts here
    # Retire time (inf: serves to the end of the run): routers send no new request to it from then on; it keeps
    # its memory (and is charged) until its last call finishes, when that is later.
    end_s: float = math.inf

    @property
    def memory_gb(self) -> float:
        return self.profile.total_memory_gb


@dataclass(frozen=True, slots=True)
class Route:
    """One way to serve a task's request: a candidate workflow and, per LLM stage, an instance id."""

    workflow_id: str
    # (LLM stage id, instance id); a stage scaled out to replicas appears once per replica, and each of its
    # calls goes to the replica with the least outstanding work.
    stage_instances: tuple[tuple[str, str], ...]

    def instance_for(self, stage_id: str) -> str:
        for s, i in self.stage_instances:
            if s == stage_id:
                return i
        raise KeyError(stage_id)

    def replicas_for(self, stage_id: str) -> list[str]:
        return [i for s, i in self.stage_instances if s == stage_id]


# (request, its index within the task, outstanding work of an instance id in engine seconds) -> index into routes.
# The third argument lets a router dispatch to the least-loaded replica.
Router = Callable[[Arrival, int, Callable[[str], float]], int]


@dataclass(frozen=True, slots=True)
class TaskDeployment:
    """How a policy serves one task: its routes, and how a request picks one (default: the first)."""

    task: EvalTask
    routes: tuple[Route, ...]
    router: Router | None = None


@dataclass(frozen=True, slots=True)
class TaskMetrics:
    task: str
    requests: int
    completed: int
    rejected: int  # the task had no deployment
    good: int
    met_accuracy: int
    met_latency: int
    goodput: float
    mean_latency_s: float
    p50_latency_s: float
    p99_latency_s: float


@dataclass(frozen=True, slots=True)
class InstanceMetrics:
    """What one instance served over the run, and its measured load.

    `busy_equiv_tokens_per_s` is the load in the unit of the selection spec's capacity
    (output tokens/s), but counting prefill too: (output tokens / pure-decode tokens/s +
    prefill_s_per_token x prompt tokens) / window x max_output_tokens_per_s. It is what a
    deployer would report as "current load" from the engine's busy time; the spec's planned
    load (rho x output tokens at the median request) leaves out prefill and the token tail.
    """

    id: str
    calls: int
    output_tokens: int
    prompt_tokens: int
    output_tokens_per_s: float  # over the window
    busy_equiv_tokens_per_s: float
    utilization: float  # busy_equiv / max_output_tokens_per_s
    busy_fraction: float = 0.0  # share of its residence its batch was non-empty (at whatever co-location speed)
    # End-to-end time of the window's finished calls over their time alone on the profile (0: none finished);
    # calls still running at the end are not counted, so an instance that has stopped finishing reads low.
    slowdown: float = 0.0
    # Call-seconds per second offered over the window at each call's latency alone (what a GPU-sharing planner
    # reads: busy share = 1 - exp(-offered), flowmaker.sharing.occupancy).
    offered: float = 0.0
    # Per (task, stage) served here: the window's finished calls' end-to-end time over their time alone. Calls of
    # different shapes see different slowdowns on one engine (a short call waits for others' prefills).
    stage_slowdowns: tuple[tuple[str, str, float], ...] = ()
    residence_s: float = 0.0
    cost_usd: float = 0.0


@dataclass(frozen=True, slots=True)
class SimResult:
    requests: int
    completed: int
    rejected: int
    good: int
    goodput: float  # good / requests (rejected requests count as not good)
    mean_latency_s: float  # over completed requests
    p50_latency_s: float
    p99_latency_s: float
    cost_usd: float
    instances: int
    gb_reserved: float
    gpus_used: int
    residence_s: float  # the longest instance residence
    per_task: tuple[TaskMetrics, ...]
    unplaced: tuple[tuple[str, str], ...]  # (task, why)
    peak_gpu_memory_gb: tuple[tuple[str, float, float], ...]  # (gpu id, reserved, total)
    tokens_asked: int  # output tokens the requests' LLM calls asked for
    tokens_emitted: int  # output tokens the engines produced
    prompt_tokens_asked: int
    prompt_tokens_processed: int
    engine_calls: int
    latencies: tuple[tuple[str, float, bool], ...] = field(default=(), repr=False)  # (req id, latency, good)
    per_instance: tuple[InstanceMetrics, ...] = ()
    gb_seconds: float = 0.0  # sum over instances of GB x own residence
    speed_changes: int = 0  # co-location speed changes applied (dynamic mode)

    def summary(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in (
            "requests", "completed", "rejected", "good", "goodput", "mean_latency_s", "p50_latency_s",
            "p99_latency_s", "cost_usd", "instances", "gb_reserved", "gpus_used", "residence_s")}


@dataclass(slots=True)
class _Req:
    arrival: Arrival
    task: EvalTask
    wf: Workflow
    route: Route
    accuracy: float
    pending: dict[str, int]  # stage id -> unfinished dependencies
    left: int  # stages not finished
    finish: float = math.nan


def _peak_per_gpu(instances: Sequence[SimInstance], gpu_ids: Sequence[str],
                  release: Mapping[str, float] | None = None) -> dict[str, float]:
    """The most GB reserved at once on each GPU: an instance holds its memory over [start_s, release) (release:
    `end_s` unless given). When no instance is ever released this is the plain sum per GPU."""
    ev: dict[str, list[tuple[float, int, float]]] = {g: [] for g in gpu_ids}
    for inst in instances:
        end = inst.end_s if release is None else release[inst.id]
        for gid in inst.gpu_ids:
            if gid in ev and end > inst.start_s:
                ev[gid].append((inst.start_s, 1, inst.profile.memory_gb_per_gpu))
                ev[gid].append((end, 0, -inst.profile.memory_gb_per_gpu))  # a release at t frees before a deploy at t
    peak = {}
    for gid, es in ev.items():
        cur = best = 0.0
        for _, _, d in sorted(es):
            cur += d
            best = max(best, cur)
        peak[gid] = best
    return peak


def check_memory(instances: Sequence[SimInstance], gpus: Sequence[Gpu]) -> dict[str, float]:
    """Peak GB reserved per GPU (instances overlapping in time, `start_s`..`end_s`); InvalidSpec when an instance
    is on an unknown GPU or a GPU is over-committed."""
    total = {g.id: g.memory_total_gb for g in gpus}
    for inst in instances:
        if len(inst.gpu_ids) != inst.profile.gpus or len(set(inst.gpu_ids)) != len(inst.gpu_ids):
            raise InvalidSpec(f"instance {inst.id!r}: needs {inst.profile.gpus} distinct GPUs, got {inst.gpu_ids}",
                              field="instances.gpu_ids")
        for gid in inst.gpu_ids:
            if gid not in total:
                raise InvalidSpec(f"instance {inst.id!r} is on unknown GPU {gid!r}", field="instances.gpu_ids")
    used = _peak_per_gpu(instances, list(total))
    for gid, u in used.items():
        if u > total[gid] + EPS_GB:
            raise InvalidSpec(f"GPU {gid!r} over-committed: {u:.2f} GB reserved of {total[gid]:.2f} GB",
                              field="instances")
    return used


def simulate(instances: Sequence[SimInstance], deployments: Sequence[TaskDeployment], arrivals: Sequence[Arrival],
             gpus: Sequence[Gpu], models: Mapping[str, Model], gpu_type: GpuType, *,
             unplaced: Mapping[str, str] | None = None, duration_s: float = 0.0,
             kv_capacity_tokens: int | None = DEFAULT_KV_TOKENS, max_batch: int = DEFAULT_MAX_BATCH,
             keep_latencies: bool = False, colocation: str = DEFAULT_COLOCATION,
             measure_from_s: float = 0.0, colocation_kappa: float = 1.0) -> SimResult:
    """Serve `arrivals` on `instances` as `deployments` say; see the module doc for the model.

    Requests of a task with no deployment are rejected (counted, not lost); `unplaced` says why.
    `colocation`: how instances sharing a GPU share its compute (`COLOCATION_MODES`).
    `colocation_kappa`: how much each busy co-resident slows an instance, the selector's kappa (flowmaker.sharing):
    with k busy instances on its most crowded GPU it runs at 1 / (1 + kappa (k - 1)) ("worst-case": k = every
    instance placed there). 1 is time sharing (throughput conserved); above 1 co-located engines lose throughput
    to each other (context switches, cache and memory-bandwidth contention), below 1 they overlap.
    `measure_from_s`: `per_instance` loads count only the calls submitted from then on, over the window
    [max(measure_from_s, the instance's start_s), end of the arrivals or duration_s] (what a load monitor
    reads just before a deploy).
    """
    used = check_memory(instances, gpus)
    unplaced = dict(unplaced or {})
    inst_by_id = {i.id: i for i in instances}
    if len(inst_by_id) != len(instances):
        raise InvalidSpec("duplicate instance id", field="instances.id")
    if colocation not in COLOCATION_MODES:
        raise InvalidSpec(f"unknown colocation mode {colocation!r}; known: {list(COLOCATION_MODES)}",
                          field="colocation")
    validate_interference(colocation_kappa, "colocation_kappa")
    slow = {i: 1.0 + colocation_kappa * (k - 1) for i, k in colocation_factor(instances).items()} \
        if colocation == "worst-case" else {}
    engines = {i.id: EngineModel(_slowed(i.profile, slow.get(i.id, 1)), max_batch=max_batch,
                                 kv_capacity_tokens=kv_capacity_tokens) for i in instances}
    order = [i.id for i in instances]  # fixed processing order, for determinism
    dynamic = colocation == "dynamic"
    gpu_insts: dict[str, list[str]] = {}
    for inst in instances:
        for gid in inst.gpu_ids:
            gpu_insts.setdefault(gid, []).append(inst.id)
    shared = {i.id for i in instances if any(len(gpu_insts[g]) > 1 for g in i.gpu_ids)}  # only these can slow
    busy_on_gpu = {g: 0 for g in gpu_insts}
    is_busy = {i: False for i in order}
    speed_changes = 0
    win_out = {i: 0 for i in order}  # output / prompt tokens of calls submitted from measure_from_s on
    win_in = {i: 0 for i in order}
    win_calls = {i: 0 for i in order}
    # Slowdown (what the deployer's saturation meter measures): end-to-end time of the calls submitted from
    # measure_from_s on, over what each takes alone on the instance's profile.
    win_lat = {i: 0.0 for i in order}
    win_lone = {i: 0.0 for i in order}
    stage_lat: dict[tuple[str, str, str], list[float]] = {}  # (instance, task, stage) -> [latency, alone] sums
    submitted: dict[str, float] = {}
    last_done = {i: 0.0 for i in order}
    deps = {d.task.name: d for d in deployments}
    for d in deployments:
        if not d.routes:
            raise InvalidSpec(f"task {d.task.name!r}: a deployment needs at least one route", field="deployments")
        for r in d.routes:
            wf = d.task.candidate(r.workflow_id)
            for s in wf.stages:
                if s.kind.value == "LLM":
                    iid = dict(r.stage_instances).get(s.id)
                    if iid not in inst_by_id:
                        raise InvalidSpec(f"task {d.task.name!r} workflow {r.workflow_id!r}: stage {s.id!r} is "
                                          f"mapped to unknown instance {iid!r}", field="deployments.routes")
            for _, iid in r.stage_instances:
                if inst_by_id[iid].profile.model_id not in models:
                    raise InvalidSpec(f"instance {iid!r} serves unknown model", field="models")

    reqs: dict[str, _Req] = {}
    wf_cache: dict[tuple[str, str, int, int], Workflow] = {}
    per_task_idx: dict[str, int] = {}
    tool_heap: list[tuple[float, int, str, str]] = []  # (time, seq, req id, stage id)
    seq = 0
    next_ev: dict[str, float | None] = {i: None for i in order}
    dirty: set[str] = set()
    asked_out = asked_in = calls = 0
    rejected: list[Arrival] = []
    done: list[_Req] = []

    def submit_call(r: _Req, stage_id: str, call: int, t: float) -> None:
        nonlocal asked_out, asked_in, calls
        st = r.wf.stage(stage_id)
        ids = r.route.replicas_for(stage_id)
        iid = ids[0] if len(ids) == 1 else min(ids, key=outstanding)
        call_id = f"{r.arrival.req_id}|{stage_id}|{call}"
        engines[iid].submit(call_id, st.input_tokens, st.output_tokens, t)
        dirty.add(iid)
        if t >= measure_from_s:
            submitted[call_id] = t
            win_lone[iid] += engines[iid].profile.call_latency_s(st.input_tokens, st.output_tokens)
            win_out[iid] += st.output_tokens
            win_in[iid] += st.input_tokens
            win_calls[iid] += 1
        asked_out += st.output_tokens
        asked_in += st.input_tokens
        calls += 1

    def start_stage(r: _Req, stage_id: str, t: float) -> None:
        nonlocal seq
        st = r.wf.stage(stage_id)
        if st.is_llm:
            submit_call(r, stage_id, 0, t)
        else:
            seq += 1
            heapq.heappush(tool_heap, (t + st.latency_s, seq, r.arrival.req_id, stage_id))

    def stage_done(r: _Req, stage_id: str, t: float) -> None:
        r.left -= 1
        if r.left == 0:
            r.finish = t
            done.append(r)
            return
        for s in r.wf.stages:
            if stage_id in s.depends_on:
                r.pending[s.id] -= 1
                if r.pending[s.id] == 0:
                    start_stage(r, s.id, t)

    def arrive(a: Arrival) -> None:
        d = deps.get(a.task)
        if d is None:
            rejected.append(a)
            return
        k = per_task_idx.get(a.task, 0)
        per_task_idx[a.task] = k + 1
        ri = d.router(a, k, outstanding) if d.router is not None else 0
        route = d.routes[ri]
        key = (a.task, route.workflow_id, a.context_tokens, a.generated_tokens)
        wf = wf_cache.get(key)
        if wf is None:
            wf = wf_cache[key] = d.task.workflow_for_request(route.workflow_id, a.context_tokens,
                                                             a.generated_tokens)
        acc = min(models[inst_by_id[route.instance_for(s.id)].profile.model_id].accuracy for s in wf.llm_stages)
        r = _Req(a, d.task, wf, route, acc, {s.id: len(s.depends_on) for s in wf.stages}, len(wf.stages))
        if a.req_id in reqs:
            raise InvalidSpec(f"duplicate request id {a.req_id!r}", field="arrivals")
        reqs[a.req_id] = r
        for s in wf.stages:
            if not s.depends_on:
                start_stage(r, s.id, a.time_s)

    def outstanding(iid: str) -> float:
        """Engine seconds of work an instance has queued or running (prompt + output tokens at full speed)."""
        e = engines[iid]
        p = e.profile
        return e.outstanding_prompt_tokens * p.prefill_s_per_token + e.outstanding_output_tokens / \
            p.pure_decode_tokens_per_s

    def handle(iid: str, comps: list[Completion]) -> None:
        for c in comps:
            rid, sid, call = c.req_id.rsplit("|", 2)
            rq = reqs[rid]
            if c.req_id in submitted:
                lat = c.finish_time - submitted.pop(c.req_id)
                win_lat[iid] += lat
                st = rq.wf.stage(sid)
                acc = stage_lat.setdefault((iid, rq.task.name, sid), [0.0, 0.0])
                acc[0] += lat
                acc[1] += engines[iid].profile.call_latency_s(st.input_tokens, st.output_tokens)
            last_done[iid] = max(last_done[iid], c.finish_time)
            if int(call) + 1 < rq.wf.stage(sid).calls_per_request:
                submit_call(rq, sid, int(call) + 1, c.finish_time)
            else:
                stage_done(rq, sid, c.finish_time)

    def recolocate(t: float) -> None:
        """Dynamic co-location: update busy counts of the instances touched at t, then their neighbours' speed."""
        nonlocal speed_changes
        touched: set[str] = set()
        for iid in list(dirty):
            if iid not in shared:
                continue
            b = engines[iid].in_flight > 0
            if b != is_busy[iid]:
                is_busy[iid] = b
                for g in inst_by_id[iid].gpu_ids:
                    busy_on_gpu[g] += 1 if b else -1
                    touched.update(gpu_insts[g])
        for iid in order:
            if iid not in touched:
                continue
            k = max(max(busy_on_gpu[g], 1) for g in inst_by_id[iid].gpu_ids)
            sp = 1.0 / (1.0 + colocation_kappa * (k - 1))  # kappa 1: exactly 1 / k
            if sp != engines[iid].speed:
                comps = engines[iid].set_speed(sp, t)
                speed_changes += 1
                dirty.add(iid)
                handle(iid, comps)

    arr = sorted(arrivals, key=lambda a: (a.time_s, a.task, a.req_id))
    ai = 0
    t = 0.0
    while True:
        if dynamic:
            while True:  # a speed change cannot complete anything at t, but stay safe if it ever did
                before = len(dirty)
                recolocate(t)
                if len(dirty) == before:
                    break
        for iid in dirty:
            next_ev[iid] = engines[iid].next_event_time()
        dirty.clear()
        t = math.inf
        if ai < len(arr):
            t = arr[ai].time_s
        if tool_heap and tool_heap[0][0] < t:
            t = tool_heap[0][0]
        for iid in order:
            e = next_ev[iid]
            if e is not None and e < t:
                t = e
        if t == math.inf:
            break
        # 1) engines whose batch changes by t (completions free stages downstream)
        for iid in order:
            e = next_ev[iid]
            if e is not None and e <= t:
                comps = engines[iid].advance(t)
                dirty.add(iid)
                handle(iid, comps)
        # 2) tool stages ending at t
        while tool_heap and tool_heap[0][0] <= t:
            tt, _, rid, sid = heapq.heappop(tool_heap)
            stage_done(reqs[rid], sid, tt)
        # 3) arrivals at t
        while ai < len(arr) and arr[ai].time_s <= t:
            arrive(arr[ai])
            ai += 1

    # ---- metrics -----------------------------------------------------------------------
    lost = [rid for rid, r in reqs.items() if math.isnan(r.finish)]
    if lost:  # pragma: no cover - an invariant; tests assert it never happens
        raise RuntimeError(f"{len(lost)} requests never completed, e.g. {lost[:3]}")
    price = gpu_type.price_per_gb_second
    # Each instance pays for its own residence: from its deploy time until the window ends (or it is retired) or its
    # last call finishes, whichever is later.
    resid = {i.id: max(duration_s if math.isinf(i.end_s) else i.end_s, last_done[i.id], i.start_s) - i.start_s
             for i in instances}
    if any(math.isfinite(i.end_s) for i in instances):  # memory held until the retired instances really drained
        used = _peak_per_gpu(instances, list(used), {i.id: i.start_s + resid[i.id] for i in instances})
    gb_s = sum(i.memory_gb * resid[i.id] for i in instances)
    cost = gb_s * price
    residence = max(resid.values(), default=0.0)

    def good(r: _Req) -> tuple[bool, bool]:
        lat = r.finish - r.arrival.time_s
        return (r.accuracy >= r.task.min_accuracy - 1e-12, lat <= r.task.max_latency_s + 1e-9)

    task_names = list(dict.fromkeys([a.task for a in arr]))
    per_task = []
    for name in task_names:
        rs = [r for r in done if r.task.name == name]
        rej = sum(1 for a in rejected if a.task == name)
        flags = [good(r) for r in rs]
        lats = sorted(r.finish - r.arrival.time_s for r in rs)
        n = len(rs) + rej
        g = sum(1 for a, lt in flags if a and lt)
        per_task.append(TaskMetrics(
            name, n, len(rs), rej, g, sum(1 for a, _ in flags if a), sum(1 for _, lt in flags if lt),
            g / n if n else math.nan, sum(lats) / len(lats) if lats else math.nan, quantile(lats, 0.5),
            quantile(lats, 0.99)))
    lats = sorted(r.finish - r.arrival.time_s for r in done)
    n_good = sum(t.good for t in per_task)
    n_all = len(done) + len(rejected)
    total_mem = {g.id: g.memory_total_gb for g in gpus}
    end = max(duration_s, arr[-1].time_s if arr else 0.0)
    per_inst = []
    for iid in order:
        eng = engines[iid]
        inst = inst_by_id[iid]
        prof = inst.profile  # the profile's own speed: load is in its capacity unit
        # the arrival window while the instance existed (not the drain)
        since = max(measure_from_s, inst.start_s)
        until = min(end, inst.end_s)
        window = until - since if until > since else 1.0
        busy = win_out[iid] / prof.pure_decode_tokens_per_s + prof.prefill_s_per_token * win_in[iid]
        per_inst.append(InstanceMetrics(iid, win_calls[iid], win_out[iid], win_in[iid],
                                        win_out[iid] / window, busy / window * prof.max_output_tokens_per_s,
                                        busy / window, busy_fraction=eng.busy_s / resid[iid] if resid[iid] > 0 else 0.0,
                                        slowdown=win_lat[iid] / win_lone[iid] if win_lone[iid] > 0 else 0.0,
                                        offered=win_lone[iid] / window,
                                        stage_slowdowns=tuple((t, sid, a[0] / a[1])
                                                              for (i, t, sid), a in sorted(stage_lat.items())
                                                              if i == iid and a[1] > 0),
                                        residence_s=resid[iid],
                                        cost_usd=inst_by_id[iid].memory_gb * resid[iid] * price))
    return SimResult(
        requests=n_all, completed=len(done), rejected=len(rejected), good=n_good,
        goodput=n_good / n_all if n_all else math.nan,
        mean_latency_s=sum(lats) / len(lats) if lats else math.nan, p50_latency_s=quantile(lats, 0.5),
        p99_latency_s=quantile(lats, 0.99), cost_usd=cost, instances=len(instances),
        gb_reserved=sum(i.memory_gb for i in instances), gpus_used=sum(1 for u in used.values() if u > 0),
        residence_s=residence, per_task=tuple(per_task), unplaced=tuple(sorted(unplaced.items())),
        peak_gpu_memory_gb=tuple((gid, used[gid], total_mem[gid]) for gid in sorted(used)),
        tokens_asked=asked_out, tokens_emitted=sum(e.tokens_emitted for e in engines.values()),
        prompt_tokens_asked=asked_in,
        prompt_tokens_processed=sum(e.prompt_tokens_processed for e in engines.values()),
        engine_calls=calls,
        latencies=tuple((r.arrival.req_id, r.finish - r.arrival.time_s, all(good(r))) for r in done)
        if keep_latencies else (),
        per_instance=tuple(per_inst), gb_seconds=gb_s, speed_changes=speed_changes,
    )
