"""`flowmaker bench adapt`: deploy-once vs adaptive re-selection on a real Azure trace segment, simulated.

Per trace kind and load level, the same replay as `bench serving` (`build_segment_workload`: a contiguous
segment, >= 10 trace minutes, one time-scale factor, the 7 tasks deployed one after another) is served by:

* `deploy-once`: the `flowmaker` policy as `bench serving` runs it (each task selected once, at its deploy,
  with the arrival rate of the trace minute before and the measured load of what runs);
* `adaptive`: the same deploys, and then, every control period, the live orchestrator's rule for following
  the load. Each deployed task's observed arrival rate and p95 latency over a window
  (`flowmaker.orchestration.adapt.ArrivalMeter`) go through the SAME pure drift rule
  (`flowmaker.orchestration.adapt.drifted`, `LoadPolicy`: band, hold-down); a drifted task is re-selected
  with the selector at the observed rate against the simulated cluster as it is then, as the orchestrator's
  `reselect_for_load` does: (A) keeping its instances (its own share taken off their measured load) and
  (B) a fresh variant without the instances only it uses; the current variant is kept when it still fits and
  costs no more, else the new one is switched to make-before-break: its new instances are deployed (and
  charged) from the re-selection, requests arriving from `ready` later go to the new variant, and the old
  instances no task uses any more are retired then and released once their in-flight calls finish
  (`SimInstance.end_s`).

What the controller sees at time t is the simulator's own history up to t (the same arrivals and plan,
simulated up to t: causal, so it is exactly what happened in the final run before t): per-instance busy-time
load over the last window, completed requests' latencies, which retired instances have drained.

Clocks. The replay compresses (or stretches) the trace's clock by `scale` (replay s per trace s) to reach the
load level's mean rate; the minute-to-minute swings are compressed with it. The controller runs on the same
compressed clock: its period, window, hold-down and the deploy-to-ready delay are given in TRACE seconds and
multiplied by `scale`, so that it sees each trace minute as a real deployment at the trace's own pace would.
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flowmaker.bench.serving import GPU_TYPE, _json_safe, add_cell_rows, bench_cluster, code_version
from flowmaker.domain import (
    MAX_REPLICAS,
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
    Variant,
)
from flowmaker.errors import InvalidSpec
from flowmaker.eval.experiment import Experiment
from flowmaker.eval.policies import (
    DEFAULT_UTILIZATION_CAP,
    alone_latency,
    plan_rates,
    planned_load,
    simulated_monitor,
)
from flowmaker.eval.slo import with_rule_slos
from flowmaker.eval.tasks import EVAL_TASKS, NOMINAL_STATS, EvalTask
from flowmaker.eval.trace_stats import TRACE_KINDS
from flowmaker.eval.traces import (
    DEFAULT_SEGMENT_S,
    LOAD_LEVELS,
    Arrival,
    SegmentWorkload,
    Trace,
    build_request_segment_workload,
    build_segment_workload,
    find_trace,
    get_trace,
)
from flowmaker.orchestration.adapt import ArrivalMeter, LoadPolicy, TaskLoad, drifted
from flowmaker.orchestration.cluster import SATURATED_LOAD_TOK_S
from flowmaker.orchestration.task import Reselection, TaskRecord, TaskState
from flowmaker.selection import select
from flowmaker.sharing import occupancy
from flowmaker.sim import DEFAULT_COLOCATION, Route, SimInstance, SimResult, TaskDeployment, simulate

POLICIES = ("deploy-once", "adaptive")
ADAPT_COLOCATION_MODES = ("dynamic", "ignore")  # worst-case counts instances that never overlap in time


@dataclass(frozen=True, slots=True)
class AdaptConfig:
    """The controller's settings; times in trace seconds (multiplied by the replay's scale)."""

    band: float = LoadPolicy().band
    hold_down_trace_s: float = LoadPolicy().hold_down_s
    period_trace_s: float = 60.0  # the controller looks every trace minute
    window_trace_s: float = 60.0  # observed rate and latency over the last trace minute
    ready_trace_s: float = 15.0  # a new variant's instances serve this long after the re-selection
    colocation: str = DEFAULT_COLOCATION
    plan_tokens: str = "median"
    utilization_cap: float = DEFAULT_UTILIZATION_CAP
    seed: int = 0
    segment_s: float = DEFAULT_SEGMENT_S
    max_replicas: int = 4  # a re-selection may scale a stage out to this many replicas (as the orchestrator)
    capacity_model: str = "busy_time"  # of every selection (both policies): busy_time or output_tokens
    # GPU sharing of every selection (both policies): interference (docs/selection-spec.md) or ignore (the paper).
    gpu_sharing: str = "interference"
    saturation_slowdown: float = 4.0  # re-selections see an instance this much slower than alone as full (0: off)

    def validate(self) -> AdaptConfig:
        if not self.band > 1:
            raise InvalidSpec(f"must be > 1, got {self.band}", field="band")
        for name in ("hold_down_trace_s", "ready_trace_s"):
            if not getattr(self, name) >= 0:
                raise InvalidSpec(f"must be >= 0, got {getattr(self, name)}", field=name)
        for name in ("period_trace_s", "window_trace_s", "segment_s"):
            if not getattr(self, name) > 0:
                raise InvalidSpec(f"must be > 0, got {getattr(self, name)}", field=name)
        if self.colocation not in ADAPT_COLOCATION_MODES:
            raise InvalidSpec(f"unknown colocation mode {self.colocation!r}; known: {list(ADAPT_COLOCATION_MODES)}",
                              field="colocation")
        if not 1 <= self.max_replicas <= MAX_REPLICAS:
            raise InvalidSpec(f"must be within [1, {MAX_REPLICAS}], got {self.max_replicas}", field="max_replicas")
        if self.capacity_model.upper() not in CapacityModel.__members__:
            raise InvalidSpec(f"unknown capacity model {self.capacity_model!r}; known: busy_time, output_tokens",
                              field="capacity_model")
        if self.gpu_sharing.upper() not in GpuSharing.__members__:
            raise InvalidSpec(f"unknown GPU sharing {self.gpu_sharing!r}; known: interference, ignore",
                              field="gpu_sharing")
        if self.plan_tokens not in NOMINAL_STATS:
            raise InvalidSpec(f"unknown statistic {self.plan_tokens!r}; known: {list(NOMINAL_STATS)}",
                              field="plan_tokens")
        return self


@dataclass(frozen=True, slots=True)
class _Schedule:
    """Time-varying routing of one task: route k serves the requests arriving from `switch_at[k]` on."""

    switch_at: tuple[float, ...]

    def __call__(self, a: Arrival, k: int, outstanding: Callable[[str], float]) -> int:
        return max(0, bisect.bisect_right(self.switch_at, a.time_s) - 1)


@dataclass
class _TaskState:
    task: EvalTask
    deploy_s: float
    routes: list[Route]
    switch_at: list[float]
    planned_rate: float
    shares: dict[str, float]  # instance id -> output tokens/s the current (or pending) variant planned on it
    variant: Variant | None = None
    pending: Variant | None = None  # a switch under way (its route starts at switch_at[-1])
    pending_rate: float = 0.0
    last: Reselection | None = None
    # GPU sharing: instance id -> call-seconds/s the current (or pending) variant offers it; and the slowdown the
    # task tolerates on its instances (latency SLO / the variant's latency alone; 0: unknown).
    offered: dict[str, float] = field(default_factory=dict)
    tolerance: float = 0.0
    # The rate the follower never scales in below (LoadPolicy.floor_at_declared): what the task's deploy planned
    # for, its burst headroom included (plan_rates), as a user declares the rate it wants capacity for.
    declared_rate: float = 0.0

    def record(self) -> TaskRecord:
        slo = replace(self.task.slo(), arrival_rate_rps=self.declared_rate)
        return TaskRecord(id=self.task.name, description="", slo=slo, state=TaskState.ACTIVE,
                          planned_rate_rps=self.planned_rate, last_reselection=self.last, next_variant=self.pending)

    def current_route(self, t: float) -> Route:
        return self.routes[max(0, bisect.bisect_right(self.switch_at, t) - 1)]


@dataclass
class _Controller:
    """The adaptive run: deploys and re-selections on a growing list of instances."""

    tasks: tuple[EvalTask, ...]
    kind: str
    wl: SegmentWorkload
    models: tuple[Model, ...]
    profiles: tuple[Profile, ...]
    gpus: tuple[Gpu, ...]
    gpu_type: GpuType
    cfg: AdaptConfig
    adaptive: bool = True
    load: float = 1.0  # the cell's load level: a task is planned at no less than its declared rate x load
    instances: dict[str, SimInstance] = field(default_factory=dict)
    live: dict[str, _TaskState] = field(default_factory=dict)
    released: dict[str, float] = field(default_factory=dict)  # retired instance -> when its memory came free
    events: list[dict[str, Any]] = field(default_factory=list)
    observations: int = 0
    _n: int = 0

    def __post_init__(self) -> None:
        self.by_id = {m.id: m for m in self.models}
        self.prof = {p.key: p for p in self.profiles}
        self.scale = self.wl.scale
        self.window = self.cfg.window_trace_s * self.scale
        self.policy = LoadPolicy(band=self.cfg.band, hold_down_s=self.cfg.hold_down_trace_s * self.scale)
        self.meter = ArrivalMeter(window_s=self.window)
        self.since: dict[str, float] = {}
        self.monitor = simulated_monitor(self.wl, self.gpus, self.by_id, self.gpu_type, self.cfg.colocation)
        self.by_task: dict[str, list[Arrival]] = {}
        for a in self.wl.arrivals:
            self.by_task.setdefault(a.task, []).append(a)
        self.arr_by_id = {a.req_id: a for a in self.wl.arrivals}
        self.tokens: dict[Any, int] = {}  # request id -> the meter's token while it waits
        self.fed_arrivals: dict[str, int] = {}
        self.fed_until = 0.0

    # ---- the plan so far -------------------------------------------------------------------------

    def deployments(self, exclude: str = "") -> tuple[TaskDeployment, ...]:
        return tuple(TaskDeployment(s.task, tuple(s.routes), _Schedule(tuple(s.switch_at)))
                     for name, s in self.live.items() if name != exclude)

    def observe(self, t: float, exclude: str = "", latencies: bool = False) -> SimResult:
        """The simulator's history up to t: the scored arrivals before t, served by the plan as it was."""
        self.observations += 1
        arr = [a for a in self.wl.arrivals if a.time_s < t and a.task in self.live and a.task != exclude]
        return simulate(tuple(self.instances.values()), self.deployments(exclude), arr, self.gpus, self.by_id,
                        self.gpu_type, duration_s=t, measure_from_s=max(0.0, t - self.window),
                        colocation=self.cfg.colocation, keep_latencies=latencies)

    def referenced(self, exclude: str = "") -> set[str]:
        """Instances a task's route serves or will serve (the current and any pending one)."""
        out: set[str] = set()
        for name, s in self.live.items():
            if name == exclude:
                continue
            out.update(i for _, i in s.routes[-1].stage_instances)
            if s.pending is not None and len(s.routes) > 1:
                out.update(i for _, i in s.routes[-2].stage_instances)
        return out

    def holding(self, t: float) -> list[SimInstance]:
        """Instances holding GPU memory at t: not retired, or retired and not drained yet (asks the history)."""
        undecided = [i for i in self.instances.values() if i.end_s <= t and i.id not in self.released]
        if undecided:
            res = self.observe(t)
            until = {m.id: self.instances[m.id].start_s + m.residence_s for m in res.per_instance}
            for i in undecided:
                if until[i.id] <= t + 1e-9:
                    self.released[i.id] = until[i.id]
        return [i for i in self.instances.values() if i.id not in self.released]

    def cluster(self, t: float, loads: dict[str, float], hide: frozenset[str] | set[str] = frozenset(),
                busy: dict[str, float] | None = None, exclude: str = "", measured_only: bool = False) -> Cluster:
        """The selector's view at t: GPU memory of every instance holding it; offered for reuse, the instances a
        task uses (their load: the larger of measured and planned, plus what pending switches will put there;
        their busy share, the larger of measured and planned; the least slowdown their tasks tolerate), less
        `hide`. `exclude`: a task re-selecting (its own plan is not counted). `measured_only`: loads and busy
        shares as measured alone (the policy's fallback that lends the headroom booked before)."""
        busy = busy or {}
        planned: dict[str, float] = {}
        offered: dict[str, float] = {}
        tol: dict[str, float] = {}
        for name, s in self.live.items():
            if name == exclude or measured_only:
                continue
            for iid, x in s.shares.items():
                planned[iid] = planned.get(iid, 0.0) + x
            for iid, n in s.offered.items():
                offered[iid] = offered.get(iid, 0.0) + n
                if s.tolerance > 0:
                    tol[iid] = min(tol.get(iid, math.inf), s.tolerance)
        hold = self.holding(t)
        used = {g.id: 0.0 for g in self.gpus}
        for i in hold:
            for g in i.gpu_ids:
                used[g] += i.profile.memory_gb_per_gpu
        gpus = tuple(Gpu(g.id, g.node, g.memory_total_gb, used[g.id], g.gpu_type) for g in self.gpus)
        refs = self.referenced()
        pend: dict[str, float] = {}
        for s in self.live.values():
            if s.pending is not None:
                for iid, x in s.shares.items():
                    pend[iid] = pend.get(iid, 0.0) + x
        inst = tuple(Instance(i.id, i.profile.model_id, i.profile.tp, i.profile.pp, i.gpu_ids,
                              max(max(0.0, loads.get(i.id, 0.0)) + pend.get(i.id, 0.0), planned.get(i.id, 0.0)),
                              max_slowdown=tol.get(i.id, 0.0),
                              busy_share=min(1.0, max(busy.get(i.id, 0.0), occupancy(offered.get(i.id, 0.0)))))
                     for i in hold if i.id in refs and i.id not in hide and i.end_s > t)
        return Cluster(gpus, inst)

    def _select(self, task: EvalTask, rate: float, cluster: Cluster, *, scale_out: bool = False,
                cap: float | None = None) -> Variant | None:
        """The selector's answer; deploys (both policies alike) as the `flowmaker` policy of bench serving,
        re-selections (`scale_out`) may also scale a stage out to replicas. `cap`: utilization cap (default the
        config's)."""
        slo = replace(task.slo(), arrival_rate_rps=max(rate, 1e-6))
        req = SelectionRequest(slo=slo, workflows=task.nominal_workflows(self.kind, self.cfg.plan_tokens),
                               models=self.models, profiles=self.profiles, cluster=cluster,
                               options=SelectionOptions(utilization_cap=cap or self.cfg.utilization_cap,
                                                        allow_reuse=True,
                                                        seed=self.cfg.seed,
                                                        max_replicas=self.cfg.max_replicas if scale_out else 1,
                                                        capacity_model=CapacityModel[self.cfg.capacity_model.upper()],
                                                        gpu_sharing=GpuSharing[self.cfg.gpu_sharing.upper()]))
        return select(req, "exact").variant

    def _materialise(self, task: EvalTask, v: Variant, t: float, rate: float
                     ) -> tuple[Route, dict[str, float], dict[str, float], float]:
        """Create the variant's new instances; its route, and what it plans on each instance (`_planned_on`)."""
        new_ids: dict[str, str] = {}
        for ni in v.new_instances:
            p = self.prof[(ni.model_id, ni.tp, ni.pp)]
            iid = f"i{self._n}-{p.model_id}-tp{p.tp}pp{p.pp}"
            self._n += 1
            self.instances[iid] = SimInstance(iid, p, ni.gpu_ids, deployed_by=task.name, start_s=t)
            new_ids[ni.key] = iid
        stage_map: list[tuple[str, str]] = []
        for a in v.assignments:  # a stage on a replica group: one entry per replica
            keys = (a.instance_id,) if a.reused else tuple(new_ids[k] for k in a.replica_keys or (a.new_key,))
            stage_map.extend((a.stage_id, iid) for iid in keys)
        route = Route(v.workflow_id, tuple(stage_map))
        return (route, *self._planned_on(task, v, rate, route))

    def _planned_on(self, task: EvalTask, v: Variant, rate: float, route: Route
                    ) -> tuple[dict[str, float], dict[str, float], float]:
        """Per instance of the route: the load the variant plans on it (busy-time equivalent under BUSY_TIME, as
        the monitor measures it) and the call-seconds/s it offers; and the slowdown the task tolerates."""
        wf = next(w for w in task.nominal_workflows(self.kind, self.cfg.plan_tokens) if w.id == v.workflow_id)
        busy = self.cfg.capacity_model.upper() == CapacityModel.BUSY_TIME.name
        stage = {s.id: s for s in wf.stages}
        shares: dict[str, float] = {}
        offered: dict[str, float] = {}
        profs: dict[str, Profile] = {}
        for a in v.assignments:
            p = profs[a.stage_id] = self.prof[(a.model_id, a.tp, a.pp)]
            s = stage[a.stage_id]
            ids = route.replicas_for(a.stage_id)
            n = rate * s.calls_per_request * p.call_latency_s(s.input_tokens, s.output_tokens) / len(ids)
            ld = planned_load(p, wf, a.load_output_tokens_per_s / len(ids), busy)
            for iid in ids:
                shares[iid] = shares.get(iid, 0.0) + ld
                offered[iid] = offered.get(iid, 0.0) + n
        alone = alone_latency(wf, profs)
        return shares, offered, (max(1.0, task.slo().max_latency_s / alone) if alone > 0 else 0.0)

    # ---- events ----------------------------------------------------------------------------------

    def deploy(self, task: EvalTask, at: float) -> None:
        """As the `flowmaker` policy deploys a task (same monitor, same rate, same selector)."""
        loads: dict[str, float] = {}
        busy: dict[str, float] = {}
        if self.live:
            seen = self.monitor(tuple(self.instances.values()), self.deployments(), at)
            loads = {k: float(m.load) for k, m in seen.items()}
            busy = {k: float(m.busy_share) for k, m in seen.items()}
        # As PolicyContext.planning_rates: the burst rate, then the rate measured before the deploy, then the
        # declared one, each tried when nothing fits at the one before.
        tries = plan_rates(self.wl.burst_rate(task.name, task.max_latency_s, at),
                           self.wl.rate_in(task.name, max(0.0, at - self.wl.window_s), at),
                           task.nominal_rate_rps * self.load)
        cluster = self.cluster(at, loads, busy=busy)
        v = None
        for rate in tries:
            v = self._select(task, rate, cluster)
            if v is not None:
                break
        if v is None and self.cfg.utilization_cap < 1.0:  # ... and then without the burst headroom
            v = self._select(task, rate, cluster, cap=1.0)
        if v is None and self.live:  # ... and on what is measured alone, as the policy does
            v = self._select(task, rate, self.cluster(at, loads, busy=busy, measured_only=True), cap=1.0)
        if v is None:
            self.events.append({"t": at, "task": task.name, "kind": "deploy", "outcome": "UNPLACED", "rate": rate})
            return
        route, shares, offered, tol = self._materialise(task, v, at, rate)
        self.live[task.name] = _TaskState(task, at, [route], [at], rate, shares, v, offered=offered, tolerance=tol,
                                          declared_rate=rate)
        self.events.append({"t": at, "task": task.name, "kind": "deploy", "outcome": "DONE", "rate": rate,
                            "workflow": v.workflow_id, "instances": sorted(set(i for _, i in route.stage_instances))})

    def tick(self, t: float) -> None:
        """Meter, drift rule, re-selections."""
        res = self.observe(t, latencies=True)
        arr_by_id = self.arr_by_id
        done = sorted((arr_by_id[rid].time_s + lat, arr_by_id[rid].task, lat, rid) for rid, lat, _ in res.latencies)
        for name in self.live:
            xs = self.by_task.get(name, [])
            k = self.fed_arrivals.get(name, 0)
            while k < len(xs) and xs[k].time_s < t:
                # The meter's token ends this request's wait when it completes (waiting requests count).
                self.tokens[xs[k].req_id] = self.meter.arrived(name, xs[k].time_s)
                k += 1
            self.fed_arrivals[name] = k
        for fin, name, lat, rid in done:
            if self.fed_until < fin <= t:
                self.meter.finished(name, fin, lat, self.tokens.pop(rid, 0))
        self.fed_until = t
        loads: dict[str, TaskLoad] = {}
        for name in self.live:
            ld = self.meter.load(name, t)
            if ld is not None:
                loads[name] = ld
        for name, rate, why in drifted({n: s.record() for n, s in self.live.items()}, loads, self.since, t,
                                       self.policy):
            self.reselect(name, rate, why, t)

    def reselect(self, name: str, rate: float, why: str, t: float) -> None:
        """The orchestrator's `reselect_for_load`, on the simulated cluster."""
        st = self.live[name]
        others = self.observe(t, exclude=name)  # the measured load without this task's own share
        loads = {m.id: m.busy_equiv_tokens_per_s for m in others.per_instance}
        busy = {m.id: occupancy(m.offered) for m in others.per_instance}
        if self.cfg.saturation_slowdown > 0:
            # As the deployer's saturation meter: an instance whose recent calls took saturation_slowdown x
            # their time alone (all tasks' traffic) is full, whatever its token load says: no headroom.
            for m in self.observe(t).per_instance:
                if m.slowdown >= self.cfg.saturation_slowdown:
                    loads[m.id] = SATURATED_LOAD_TOK_S
        mine = {i for _, i in st.routes[-1].stage_instances}
        exclusive = mine - self.referenced(exclude=name)
        seen = self.cluster(t, loads, busy=busy, exclude=name)
        a = self._select(st.task, rate, seen, scale_out=True)
        b = self._select(st.task, rate, self.cluster(t, loads, hide=exclusive, busy=busy, exclude=name),
                         scale_out=True) if exclusive else None
        cur = dict(st.routes[-1].stage_instances)
        fits = a is not None and a.workflow_id == st.routes[-1].workflow_id and not a.new_instances and \
            {x.stage_id: x.instance_id for x in a.assignments if x.reused} == cur and \
            len(cur) == len(st.routes[-1].stage_instances)  # a stage on replicas is not "the same" as one instance
        chosen, same = a or b, False
        if fits and a is not None:
            keep_cost = sum(self.instances[i].memory_gb for i in exclusive) * a.latency_s
            chosen, same = (a, True) if b is None or keep_cost <= b.cost else (b, False)
        ev: dict[str, Any] = {"t": t, "task": name, "kind": "reselect", "why": why, "rate": rate,
                              "planned_before": st.planned_rate, "from_workflow": st.routes[-1].workflow_id,
                              "from_instances": sorted(mine)}
        if chosen is None:
            st.last = Reselection(t, why, rate, "FAILED")
            self.events.append({**ev, "outcome": "FAILED"})
            return
        if same:
            st.planned_rate, st.variant = rate, chosen
            st.shares, st.offered, st.tolerance = self._planned_on(st.task, chosen, rate, st.routes[-1])
            st.last = Reselection(t, why, rate, "KEPT")
            self.events.append({**ev, "outcome": "KEPT"})
            return
        ready = t + self.cfg.ready_trace_s * self.scale
        route, shares, offered, tol = self._materialise(st.task, chosen, t, rate)
        st.routes.append(route)
        st.switch_at.append(ready)
        st.shares, st.pending, st.pending_rate = shares, chosen, rate
        st.offered, st.tolerance = offered, tol
        st.last = Reselection(t, why, rate, "IN_PROGRESS")
        self.events.append({**ev, "outcome": "SWITCH", "ready_s": ready, "to_workflow": chosen.workflow_id,
                            "to_instances": sorted(set(i for _, i in route.stage_instances)),
                            "new_instances": [f"{n.model_id} tp{n.tp}pp{n.pp}" for n in chosen.new_instances]})

    def finish_switches(self, t: float) -> None:
        """Switches whose new variant serves from t: requests go there; retire what no task uses any more."""
        for s in self.live.values():
            if s.pending is not None and s.switch_at[-1] <= t + 1e-12:
                old = {i for _, i in s.routes[-2].stage_instances}
                s.variant, s.pending, s.planned_rate = s.pending, None, s.pending_rate
                s.last = replace(s.last, outcome="DONE") if s.last else None
                for iid in old - self.referenced():
                    self.instances[iid] = replace(self.instances[iid], end_s=s.switch_at[-1])

    def run(self) -> None:
        wl = self.wl
        deploys = [(d, n) for n, d in wl.deploy_s]
        period = self.cfg.period_trace_s * self.scale
        ticks = [k * period for k in range(1, int(wl.duration_s / period + 1e-9) + 1) if k * period < wl.duration_s]
        by_name = {t.name: t for t in self.tasks}
        di = ti = 0
        while True:
            pend = [s.switch_at[-1] for s in self.live.values() if s.pending is not None]
            nxt = deploys[di][0] if di < len(deploys) else math.inf
            nxt_tick = ticks[ti] if self.adaptive and ti < len(ticks) else math.inf
            nxt_sw = min(pend, default=math.inf)
            t = min(nxt, nxt_tick, nxt_sw)
            if t == math.inf:
                break
            if nxt_sw <= t:
                self.finish_switches(t)
            elif nxt <= t:
                self.deploy(by_name[deploys[di][1]], t)
                di += 1
            else:
                self.tick(t)
                ti += 1

    def result(self) -> tuple[tuple[SimInstance, ...], tuple[TaskDeployment, ...]]:
        return tuple(self.instances.values()), self.deployments()


# ---- one cell --------------------------------------------------------------------------------------


def _series(res: SimResult, wl: SegmentWorkload, instances: Sequence[SimInstance], bin_s: float) -> dict[str, Any]:
    """Per bin (one trace minute of replay): arrivals/s (all, the trace's swings), goodput of the requests that
    arrived in it (scored ones), GB reserved (time average over the bin)."""
    n = max(1, math.ceil(wl.duration_s / bin_s - 1e-9))
    arr = [0] * n
    for a in wl.all_arrivals:
        arr[min(n - 1, int(a.time_s / bin_s))] += 1
    at = {a.req_id: a.time_s for a in wl.arrivals}
    scored, good = [0] * n, [0] * n
    for rid, _, ok in res.latencies:
        k = min(n - 1, int(at[rid] / bin_s))
        scored[k] += 1
        good[k] += 1 if ok else 0
    resid = {m.id: m.residence_s for m in res.per_instance}
    gb = [0.0] * n
    for i in instances:
        s, e = i.start_s, i.start_s + resid[i.id]
        for k in range(n):
            lo, hi = k * bin_s, (k + 1) * bin_s
            ov = min(e, hi) - max(s, lo)
            if ov > 0:
                gb[k] += i.memory_gb * ov / bin_s
    return {"bin_s": bin_s, "scale": wl.scale, "t_trace_min": [k * bin_s / wl.scale / 60.0 for k in range(n)],
            "arrivals_rps": [x / bin_s for x in arr], "scored": scored, "good": good,
            "goodput": [g / s if s else None for g, s in zip(good, scored, strict=True)], "gb_reserved": gb}


def _peak_total(instances: Sequence[SimInstance], res: SimResult) -> float:
    """The most GB reserved at once over the cluster (instances from deploy until really released)."""
    resid = {m.id: m.residence_s for m in res.per_instance}
    ev = sorted([(i.start_s, 1, i.memory_gb) for i in instances]
                + [(i.start_s + resid[i.id], 0, -i.memory_gb) for i in instances])
    cur = best = 0.0
    for _, _, d in ev:
        cur += d
        best = max(best, cur)
    return best


def _row(kind: str, load: float, pol: str, res: SimResult, wl: SegmentWorkload, instances: Sequence[SimInstance],
         gpus: Sequence[Gpu], events: Sequence[dict[str, Any]], sim_s: float, ctl_s: float,
         observations: int) -> dict[str, Any]:
    resel = [e for e in events if e["kind"] == "reselect"]
    total = {g.id: g.memory_total_gb for g in gpus}
    return {
        "trace": kind, "load": load, "policy": pol, **res.summary(), "gb_seconds": res.gb_seconds,
        "instances_ever": len(instances), "peak_gb_reserved": _peak_total(instances, res),
        "gpu_overcommitted": [g for g, u, tot in res.peak_gpu_memory_gb if u > total[g] + 1e-6],
        "reselections": sum(1 for e in resel if e["outcome"] == "SWITCH"),
        "reselections_kept": sum(1 for e in resel if e["outcome"] == "KEPT"),
        "reselections_failed": sum(1 for e in resel if e["outcome"] == "FAILED"),
        "lost": res.requests - res.completed - res.rejected,
        "per_task": [{"task": m.task, "requests": m.requests, "goodput": m.goodput, "p99_latency_s": m.p99_latency_s}
                     for m in res.per_task],
        "instance_list": [{"id": i.id, "model": i.profile.model_id, "tp": i.profile.tp, "pp": i.profile.pp,
                           "gpus": list(i.gpu_ids), "gb": i.memory_gb, "deployed_by": i.deployed_by,
                           "start_s": i.start_s, "retired_s": i.end_s, "residence_s": m.residence_s,
                           "cost_usd": m.cost_usd}
                          for i, m in zip(instances, res.per_instance, strict=True)],
        "events": list(events), "series": _series(res, wl, instances, wl.window_s),
        "sim_s": sim_s, "controller_s": ctl_s, "observations": observations,
    }


def experiment_clock(cfg: AdaptConfig, wl: SegmentWorkload, exp: Experiment) -> AdaptConfig:
    """The controller's clock on the declared experiment's replay, whose segments hold a fixed number of requests
    (tens to hundreds of trace seconds): period and window = the experiment's monitor window; hold-down and ready
    in the same proportions to it as the defaults' (30 s and 15 s to a 60 s window)."""
    w = exp.monitor_window_fraction * wl.segment_s
    return replace(cfg, period_trace_s=w, window_trace_s=w, hold_down_trace_s=w * cfg.hold_down_trace_s / 60.0,
                   ready_trace_s=w * cfg.ready_trace_s / 60.0, utilization_cap=exp.utilization_cap)


def run_cell(tasks: Sequence[EvalTask], kind: str, trace: Trace, load: float, models: tuple[Model, ...],
             profiles: tuple[Profile, ...], gpus: tuple[Gpu, ...], gpu_type: GpuType, cfg: AdaptConfig,
             policies: Sequence[str] = POLICIES, experiment: Experiment | None = None
             ) -> tuple[SegmentWorkload, list[dict[str, Any]]]:
    """Both policies on one (trace, load) replay; rows as in the JSON. With `experiment`, the replay is the declared
    experiment's (one request segment per trace, this load's time scale) and the controller's clock follows it."""
    rates = [(t.name, t.nominal_rate_rps * load) for t in tasks]
    if experiment is not None:
        wl = build_request_segment_workload(rates, trace, load, cfg.seed, experiment.segment_requests,
                                            experiment.deploy_span_fraction, experiment.monitor_window_fraction)
        cfg = experiment_clock(cfg, wl, experiment)
    else:
        wl = build_segment_workload(rates, trace, load, seed=cfg.seed, segment_s=cfg.segment_s)
    by_id = {m.id: m for m in models}
    rows = []
    for pol in policies:
        t0 = time.perf_counter()
        if pol == "deploy-once":
            # The same deploys as adaptive (same controller, selector, capacity model and GPU sharing), no
            # re-selection afterwards.
            c0 = _Controller(tuple(tasks), kind, wl, models, profiles, tuple(gpus), gpu_type, cfg, adaptive=False,
                             load=load)
            c0.run()
            inst, deps = c0.result()
            events: list[dict[str, Any]] = list(c0.events)
            obs = c0.observations
        elif pol == "adaptive":
            c = _Controller(tuple(tasks), kind, wl, models, profiles, tuple(gpus), gpu_type, cfg, load=load)
            c.run()
            inst, deps = c.result()
            events, obs = c.events, c.observations
        else:
            raise InvalidSpec(f"unknown policy {pol!r}; known: {list(POLICIES)}", field="policies")
        t1 = time.perf_counter()
        res = simulate(inst, deps, wl.arrivals, gpus, by_id, gpu_type, duration_s=wl.duration_s,
                       colocation=cfg.colocation, keep_latencies=True)
        t2 = time.perf_counter()
        rows.append(_row(kind, load, pol, res, wl, inst, gpus, events, t2 - t1, t1 - t0, obs))
    return wl, rows


# ---- the bench -------------------------------------------------------------------------------------


def _plots(rows: Sequence[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    cells = sorted({(r["trace"], r["load"]) for r in rows})
    for tr, ld in cells:
        rs = {r["policy"]: r for r in rows if r["trace"] == tr and r["load"] == ld}
        fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
        first = next(iter(rs.values()))["series"]
        x = first["t_trace_min"]
        edges = [*x, x[-1] + first["bin_s"] / first["scale"] / 60.0]
        axes[0].stairs(first["arrivals_rps"], edges, color="black")
        axes[0].set_ylabel("requests/s (replay)")
        axes[0].set_title(f"{tr} trace, load {ld:.0%}: deploy-once vs adaptive re-selection")
        for pol, style in (("deploy-once", "--"), ("adaptive", "-")):
            r = rs.get(pol)
            if r is None:
                continue
            s = r["series"]
            axes[1].stairs([g if g is not None else math.nan for g in s["goodput"]], edges, linestyle=style,
                           label=f"{pol} (goodput {r['goodput']:.2f})", linewidth=1.8)
            axes[2].stairs(s["gb_reserved"], edges, linestyle=style, linewidth=1.8,
                           label=f"{pol} (${r['cost_usd']:.3f}, {r['reselections']} switches)")
        ad = rs.get("adaptive")
        if ad is not None:
            for e in ad["events"]:
                if e["kind"] == "reselect" and e["outcome"] == "SWITCH":
                    for ax in axes:
                        ax.axvline(e["t"] / ad["series"]["scale"] / 60.0, color="grey", alpha=0.35, linewidth=0.8)
        axes[1].set_ylabel("goodput (per minute)")
        axes[1].set_ylim(-0.02, 1.02)
        axes[2].set_ylabel("GB reserved")
        axes[2].set_xlabel("segment time (trace minutes); grey lines: adaptive switches")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=8, loc="lower left")
        axes[2].legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        f = out / f"adapt_{tr}_{round(ld * 100)}.png"
        fig.savefig(f, dpi=100)
        plt.close(fig)
        files.append(str(f))
    return files


def run_adapt_bench(out_dir: str | Path, traces_dir: str | Path | None = None, cfg: AdaptConfig | None = None,
                    loads: Sequence[float] | None = None, traces: Sequence[str] = TRACE_KINDS,
                    console: Console | None = None, plots: bool = True,
                    experiment: Experiment | None = None) -> dict[str, Any]:
    """Every (trace, load) cell with both policies; writes `adapt.json` (+ PNG per cell), prints the table.
    `experiment`: run the declared experiment's replay, tasks, SLOs and rates (else the older replay)."""
    t_start = time.perf_counter()
    cfg = (cfg or AdaptConfig()).validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lvls = list(loads) if loads else list(experiment.loads if experiment is not None else LOAD_LEVELS)
    con = console or Console(width=200)
    models, gpu, profiles, cluster, by_id = bench_cluster()
    rows: list[dict[str, Any]] = []
    segments: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    for kind in traces:
        trace = get_trace(kind, traces_dir, cfg.seed)
        sources[kind] = trace.source if find_trace(kind, traces_dir) else f"{trace.source} (no file in {traces_dir})"
        tasks = experiment.tasks_for(kind, profiles, by_id, gpu) if experiment is not None else \
            with_rule_slos(EVAL_TASKS, kind, profiles, by_id, gpu)
        for load in lvls:
            wl, rs = run_cell(tasks, kind, trace, load, models, profiles, cluster.gpus, gpu, cfg,
                              experiment=experiment)
            rows.extend(rs)
            segments.append({"trace": kind, "load": load, "offset_s": wl.offset_s, "segment_s": wl.segment_s,
                             "scale": wl.scale, "replay_s": wl.duration_s, "segment_requests": wl.segment_requests,
                             "scored_requests": len(wl.arrivals), "deploy_s": [list(d) for d in wl.deploy_s],
                             "controller_replay_s": {"period": cfg.period_trace_s * wl.scale,
                                                     "window": cfg.window_trace_s * wl.scale,
                                                     "hold_down": cfg.hold_down_trace_s * wl.scale,
                                                     "ready": cfg.ready_trace_s * wl.scale}})
    files = _plots(rows, out) if plots else []
    summary = _summary(rows)
    wall = time.perf_counter() - t_start
    report: dict[str, Any] = {
        "setup": {"gpu_type": GPU_TYPE, "gpus": len(cluster.gpus), "loads": lvls, "traces": list(traces),
                  "trace_sources": sources, "code_version": code_version(), "policies": list(POLICIES),
                  "config": {"band": cfg.band, "hold_down_trace_s": cfg.hold_down_trace_s,
                             "period_trace_s": cfg.period_trace_s, "window_trace_s": cfg.window_trace_s,
                             "ready_trace_s": cfg.ready_trace_s, "colocation": cfg.colocation,
                             "plan_tokens": cfg.plan_tokens, "utilization_cap": cfg.utilization_cap,
                             "segment_s": cfg.segment_s, "seed": cfg.seed, "max_replicas": cfg.max_replicas,
                             "capacity_model": cfg.capacity_model, "saturation_slowdown": cfg.saturation_slowdown,
                             "load_policy": {"min_rate_rps": LoadPolicy().min_rate_rps,
                                             "scale_in_factor": LoadPolicy().scale_in_factor,
                                             "scale_in_headroom": LoadPolicy().scale_in_headroom,
                                             "min_samples": LoadPolicy().min_samples,
                                             "latency_quantile": LoadPolicy().latency_quantile}},
                  "seeds": {"run": cfg.seed,
                            "segment_offset": f"random.Random('flowmaker-segment/<trace>/<load>/{cfg.seed}').uniform",
                            "task_of_request": f"random.Random('flowmaker-assign/<trace>/<load>/{cfg.seed}/<i>')",
                            "synthetic_trace": f"random.Random('flowmaker-trace/<trace>/{cfg.seed}') "
                                               "(only without the files)"},
                  "experiment": None if experiment is None else {"name": experiment.name,
                                                                  "sha256": experiment.sha256,
                                                                  "clock": "period = window = the monitor window; "
                                                                           "hold-down and ready scaled alike"},
                  "deploy_once": "the `flowmaker` policy of bench serving (selected once, at each task's deploy)",
                  "adaptive": "the same deploys; every period: ArrivalMeter + drifted(LoadPolicy) + the "
                              "orchestrator's keep-vs-fresh re-selection, make-before-break",
                  "segments": segments},
        "summary": summary, "rows": rows, "plots": files, "timing": {"wall_s": wall}}
    jf = out / "adapt.json"
    jf.write_text(json.dumps(_json_safe(report), indent=1))
    report["json"] = str(jf)
    _print(con, rows, report)
    return report


def _summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: adaptive / deploy-once goodput and cost (x > 1: adaptive has more goodput / costs more)."""
    by = {(r["trace"], r["load"], r["policy"]): r for r in rows}
    out = []
    for tr, ld in sorted({(r["trace"], r["load"]) for r in rows}):
        a, o = by.get((tr, ld, "adaptive")), by.get((tr, ld, "deploy-once"))
        if a is None or o is None:
            continue
        out.append({"trace": tr, "load": ld, "goodput_adaptive": a["goodput"], "goodput_deploy_once": o["goodput"],
                    "goodput_ratio": a["goodput"] / o["goodput"] if o["goodput"] else math.nan,
                    "cost_ratio": a["cost_usd"] / o["cost_usd"] if o["cost_usd"] else math.nan,
                    "good_per_dollar_ratio": (a["good"] / a["cost_usd"]) / (o["good"] / o["cost_usd"])
                    if o["good"] and a["cost_usd"] and o["cost_usd"] else math.nan,
                    "switches": a["reselections"], "kept": a["reselections_kept"], "failed": a["reselections_failed"]})
    return out


def _print(con: Console, rows: Sequence[dict[str, Any]], report: dict[str, Any]) -> None:
    t = Table(title="Deploy-once vs adaptive re-selection (simulated 8xA6000, Azure trace segment)")
    for c in ("trace", "load", "policy", "requests", "goodput", "cost $", "GB-h", "peak GB", "inst", "switch",
              "kept", "failed", "p99 s", "lost"):
        t.add_column(c, justify="left" if c in ("trace", "policy") else "right")
    add_cell_rows(t, rows, lambda r: (
        f"{r['cost_usd']:.4f}", f"{r['gb_seconds'] / 3600:.1f}", f"{r['peak_gb_reserved']:.0f}",
        str(r["instances_ever"]), str(r["reselections"]), str(r["reselections_kept"]), str(r["reselections_failed"]),
        "-" if not math.isfinite(r["p99_latency_s"]) else f"{r['p99_latency_s']:.1f}", str(r["lost"])))
    con.print(t)
    st = Table(title="Adaptive / deploy-once per cell (goodput x, cost x, good requests per $ x)")
    for c in ("trace", "load", "goodput x", "cost x", "good/$ x", "switches"):
        st.add_column(c, justify="left" if c == "trace" else "right")
    for c in report["summary"]:
        st.add_row(c["trace"], f"{c['load']:.0%}", f"{c['goodput_ratio']:.2f}", f"{c['cost_ratio']:.2f}",
                   f"{c['good_per_dollar_ratio']:.2f}", str(c["switches"]))
    con.print(st)
    con.print(f"wall {report['timing']['wall_s']:.1f}s; JSON {report['json']}; plots {', '.join(report['plots']) or '-'}")
