"""What a serving task's latency is predicted to be on the CURRENT placement, at its planned load. Pure.

A selection checks a variant against the cluster it saw with the selector's sharing bound (docs/selection-spec.md,
"Extension: GPU sharing": latency alone x an M/M/1-like multiplier). Tasks deployed later may land on the same GPUs,
and deletions or re-selections may free them, so that figure goes stale; and as a bound it is not what a call
takes on average. `predict_on_placement` re-derives each task's expected latency on the whole placement as it
stands, with the engine's own load model (`flowmaker.engine.loaded`, the analytic twin of the engine model the
emulated node and the simulator run): every instance gets the calls its tasks' committed variants send it (each
LLM stage's planned tokens per call, at the task's planned rate over the stage's replicas, `calls_per_request`
calls one after another; parallel stages of one request on one instance arrive together), the co-residents' busy
shares are solved together with the calls' latencies (prompt stalls, batched decode, queueing at the slowed
speed), each LLM stage takes its calls' mean latency (the slowest replica of a group), TOOL stages their own, and
the task the longest path.

Measured busy shares and metered rates are left out on purpose: the prediction moves when the plan moves (a deploy,
a delete, a switch), not with every scrape; the load follower meters what really happens
(flowmaker.orchestration.adapt).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flowmaker.domain import Instance, Profile, Workflow
from flowmaker.engine.loaded import Arrivals, Call, InstanceLoad, Loaded, placement_latencies
from flowmaker.orchestration.cluster import TOLERATING_STATES, longest_path_s
from flowmaker.orchestration.task import REPLICA_SEP, TaskRecord, TaskState, replicas_of
from flowmaker.sharing import busy_share

Key = tuple[str, int, int]
# Rounds of re-solving a placement with its instances' clustering of the round before.
DISPERSION_ROUNDS = 8
# A clustering that moves by less than this (relative) has settled: it only scales a spread.
CLUSTERING_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class Prediction:
    """A task's predicted latency on a placement (model seconds; inf: an instance it uses cannot keep up)."""

    latency_s: float
    stage_latency_s: dict[str, float]  # LLM stage id -> its mean latency (a replica group: its slowest replica)

    def differs(self, t: TaskRecord) -> bool:
        """Whether `t` stores another prediction (relative 1e-9: the same figure re-derived is not a change)."""
        def same(a: float, b: float) -> bool:
            return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-9 * max(abs(a), abs(b)))
        return not same(self.latency_s, t.predicted_latency_s) or self.stage_latency_s.keys() != \
            t.predicted_stage_latency_s.keys() or not all(same(x, t.predicted_stage_latency_s[k])
                                                          for k, x in self.stage_latency_s.items())


def _committed(t: TaskRecord) -> Iterable[tuple[Workflow, dict[str, str], float]]:
    """The task's committed variants as (workflow, stage slot -> instance, planned rate): the current one at the rate
    it was planned for and, during a switch, the next one at the re-selection's rate (as `task_uses` counts them)."""
    next_rate = t.last_reselection.rate_rps if t.last_reselection is not None and \
        t.last_reselection.rate_rps > 0 else t.plan_rate_rps
    for v, stage_instances, rate in ((t.variant, t.stage_instances, t.plan_rate_rps),
                                     (t.next_variant, t.next_stage_instances, next_rate)):
        wf = next((w for w in t.candidates if w.id == v.workflow_id), None) if v is not None else None
        if wf is not None and stage_instances:
            yield wf, stage_instances, rate


def _arrivals(task_id: str, wf: Workflow, stage_instances: dict[str, str], rate: float,
              clustering: Mapping[str, float]) -> Iterable[tuple[str, Arrivals]]:
    """(instance id, arrivals) of one committed variant: per LLM stage and replica, rate / replicas of its calls
    (keyed (task id, stage id)); stages with the same predecessors, one call each, mapped to the same instance,
    reach it together. A task's requests arrive as Poisson; an LLM stage sends its calls on as clustered as they
    came times its instances' `clustering` (instance id -> Loaded.clustering; over replicas, their mean), a TOOL
    stage as they came, and a stage gets the most clustered of its predecessors'."""
    if not (rate >= 0 and math.isfinite(rate)):
        return
    by_stage: dict[str, list[str]] = {}
    for slot, iid in stage_instances.items():
        by_stage.setdefault(slot.split(REPLICA_SEP, 1)[0], []).append(iid)
    stages = {s.id: s for s in wf.stages}
    sent: dict[str, float] = {}

    def into(deps: Iterable[str]) -> float:
        return max((out(d) for d in deps if d in stages), default=1.0)

    def out(sid: str) -> float:  # the dispersion of what stage `sid` sends on (a DAG: memoised recursion ends)
        if sid not in sent:
            st = stages[sid]
            factors = [clustering.get(i, 1.0) for i in by_stage.get(sid, [])] if st.is_llm else []
            sent[sid] = into(st.depends_on) * (statistics.fmean(factors) if factors else 1.0)
        return sent[sid]

    together: dict[tuple[str, tuple[str, ...], float], list[Call]] = {}
    for s in wf.stages:
        iids = by_stage.get(s.id, [])
        if not s.is_llm or not iids:
            continue
        call = Call((task_id, s.id), float(s.input_tokens), float(s.output_tokens))
        per = rate / len(iids)
        for iid in iids:
            if s.calls_per_request == 1:
                together.setdefault((iid, tuple(sorted(s.depends_on)), per), []).append(call)
            else:
                yield iid, Arrivals(per * s.calls_per_request, (call,), into(s.depends_on))
    for (iid, deps, per), calls in together.items():
        yield iid, Arrivals(per, tuple(calls), into(deps))


def predict_on_placement(tasks: Iterable[TaskRecord], instances: Iterable[Instance],
                         profiles: Mapping[Key, Profile], kappa: float, *,
                         only: frozenset[str] | None = None) -> dict[str, Prediction]:
    """By task id, the prediction of each ACTIVE task (of `only`, when given) on the placement `instances`. Every
    task holding a committed variant (DEPLOYING, ACTIVE, a switch's next variant too) sends its planned calls. A
    task with a stage whose profile or instance is unknown gets none (its stored prediction stands); an instance
    whose profile is unknown is placed but sends nothing known, and a stage on it is unknown."""
    tasks = list(tasks)
    insts = {i.id: i for i in instances}
    committed = [(t.id, c) for t in tasks if t.state in TOLERATING_STATES for c in _committed(t)]
    # How clustered each instance leaves the calls through it feeds the stages after them, and the solution gives
    # it (its prompt-stall share): start from Poisson everywhere and re-solve until no instance's clustering moves.
    # Each round's dispersions are products along a task's DAG, so they stay finite; the rounds only follow the
    # stall shares, which move with co-residents' busy shares. One that cannot keep up sends on nothing finite:
    # its tasks are unpredictable anyway.
    clustering: dict[str, float] = {}
    solved: dict[str, Loaded] = {}
    for _ in range(DISPERSION_ROUNDS):
        arrivals: dict[str, list[Arrivals]] = {iid: [] for iid in insts}
        for task_id, (wf, stage_instances, rate) in committed:
            for iid, a in _arrivals(task_id, wf, stage_instances, rate, clustering):
                if iid in arrivals:
                    arrivals[iid].append(a)
        loads = {i.id: InstanceLoad(profiles[i.key], tuple(i.gpu_ids), tuple(arrivals[i.id]))
                 for i in insts.values()
                 if i.key in profiles and (arrivals[i.id] or not i.load_output_tokens_per_s > 0)}
        # An instance none of these tasks sends calls to but that carries a planned load (its tasks' records
        # unread) is seen as the selector sees a running instance: busy min(1, load / capacity).
        others = {i.id: (tuple(i.gpu_ids), min(1.0, busy_share(i.load_output_tokens_per_s,
                                                               profiles[i.key].max_output_tokens_per_s)))
                  for i in insts.values()
                  if i.key in profiles and not arrivals[i.id] and i.load_output_tokens_per_s > 0}
        solved = placement_latencies(loads, kappa, fixed_busy=others)
        now = {iid: x.clustering for iid, x in solved.items() if math.isfinite(x.clustering)}
        if now.keys() == clustering.keys() and all(abs(now[k] - clustering[k]) <= CLUSTERING_TOLERANCE * now[k]
                                                   for k in now):
            break
        clustering = now
    out: dict[str, Prediction] = {}
    for t in tasks:
        task_wf = t.workflow
        if t.state is not TaskState.ACTIVE or (only is not None and t.id not in only) or task_wf is None \
                or t.variant is None or t.variant.workflow_id != task_wf.id:
            continue
        own: dict[str, float | None] = {}
        stages: dict[str, float] = {}
        for s in task_wf.stages:
            if not s.is_llm:
                own[s.id] = s.latency_s
                continue
            iids = replicas_of(t.stage_instances, s.id)
            if not iids or any(i not in solved for i in iids):  # gone, of unknown profile
                own[s.id] = None
                break
            lats = [solved[i].latency_s.get((t.id, s.id), math.inf) for i in iids]
            own[s.id] = stages[s.id] = s.calls_per_request * max(lats)
        total = longest_path_s(task_wf, own) if all(x is not None for x in own.values()) else None
        if total is not None:
            out[t.id] = Prediction(total, stages)
    return out


def profile_keys(tasks: Iterable[TaskRecord], instances: Iterable[Instance]) -> set[Key]:
    """The (model, tp, pp) whose profiles a prediction on this placement needs: the instances' and those of every
    stage of the tasks' variants (a switch's next one too)."""
    return {i.key for i in instances} | {(a.model_id, a.tp, a.pp) for t in tasks
                                        for v in (t.variant, t.next_variant) if v is not None
                                        for a in v.assignments if a.model_id}


def slo_breaks(tasks: Iterable[TaskRecord], instances: Iterable[Instance], profiles: Mapping[Key, Profile],
               kappa: float, moved: TaskRecord, new_instances: Iterable[Instance] = (), released: Iterable[str] = (),
               *, only: frozenset[str] | None = None) -> dict[str, tuple[float, float]]:
    """The tasks a move would push past their latency SLO: by id, (prediction before, after), for every task other
    than `moved.id` (of `only`, when given) that `predict_on_placement` puts within its SLO on the placement as it
    stands and past it once `moved` (the task's record with its new variant, stage map and planned rate) replaces
    the task's record, or joins the tasks (one being deployed), `new_instances` are placed and the instances in
    `released` (what only the old variant used) are gone. The load follower asks it before a switch and an
    approval before its commit: the selector's sharing bound and this prediction are different models, and the
    second is the one the orchestrator keeps predictions with and the follower acts on (a plan the bound admits but
    the prediction rejects would make the co-residents re-select in their turn). A task already past its SLO, or
    with no prediction before, is not counted: the move did not break it."""
    tasks = list(tasks)
    insts = list(instances)
    gone = set(released)
    before = predict_on_placement(tasks, insts, profiles, kappa, only=only)
    placed = any(t.id == moved.id for t in tasks)  # a task being deployed is not on the placement yet
    after = predict_on_placement([moved if t.id == moved.id else t for t in tasks] + ([] if placed else [moved]),
                                 [i for i in insts if i.id not in gone] + list(new_instances), profiles, kappa,
                                 only=only)
    slo = {t.id: t.slo.max_latency_s for t in tasks}
    out: dict[str, tuple[float, float]] = {}
    for tid, p in sorted(after.items()):
        b = before.get(tid)
        if tid == moved.id or b is None:
            continue
        lim = slo[tid] * (1 + 1e-9)
        if b.latency_s <= lim < p.latency_s:
            out[tid] = (b.latency_s, p.latency_s)
    return out


def placement_key(tasks: Iterable[TaskRecord], instances: Iterable[Instance]) -> tuple[object, ...]:
    """What `predict_on_placement` depends on besides profiles and kappa, as one comparable value: the committed
    variants (workflow, stage -> instance maps, planned rates) and the instances (GPUs, profile, planned load). The
    orchestrator re-derives predictions when it changes; a task's own predicted figures are not part of it."""
    tk = tuple(sorted(
        (t.id, t.state.value, t.plan_rate_rps, t.variant.workflow_id if t.variant else "",
         tuple(sorted(t.stage_instances.items())), t.next_variant.workflow_id if t.next_variant else "",
         tuple(sorted(t.next_stage_instances.items())),
         t.last_reselection.rate_rps if t.last_reselection else 0.0)
        for t in tasks if t.state in TOLERATING_STATES))
    ik = tuple(sorted((i.id, tuple(i.gpu_ids), i.key, i.load_output_tokens_per_s) for i in instances))
    return (tk, ik)
