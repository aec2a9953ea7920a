"""What a serving task's latency is predicted to be on the CURRENT placement. Pure.

A selection predicts a variant's latency on the cluster it saw (docs/selection-spec.md, "Extension: GPU
sharing"). Tasks deployed later may land on the same GPUs, and deletions or re-selections may free them, so that
prediction goes stale. `predict_on_placement` re-derives it with the same model (flowmaker.sharing) on the whole
placement as it stands: every instance's compute share rho (its planned load over its profile's
max_output_tokens_per_s, as the selector reads a running instance) and busy share b (the planned one: occupancy of
the call-seconds/s its tasks' committed variants offer it, `cluster.planned_busy_shares`; else min(1, rho) as the
selector's b0), its multiplier from its co-residents' busy shares (`sharing.placed_multipliers`), each LLM stage's
latency alone times its instance's multiplier (the largest of a replica group's), and the longest path.

Right after a task's commit, with no measured busy shares, this is the selector's own Feasibility 5 figure for it
(up to float rounding of the busy shares' sums). Measured busy shares are left out on purpose: the prediction
moves when the plan moves (a deploy, a delete, a switch), not with every scrape; the load follower meters what
really happens (flowmaker.orchestration.adapt).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from flowmaker.domain import Instance, Profile
from flowmaker.orchestration.cluster import (
    TOLERATING_STATES,
    longest_path_s,
    planned_busy_shares,
    stage_latencies_alone,
    task_uses,
)
from flowmaker.orchestration.task import TaskRecord, TaskState, replicas_of
from flowmaker.sharing import busy_share, placed_multipliers

Key = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class Prediction:
    """A task's predicted latency on a placement (model seconds; inf: an instance it uses cannot keep up)."""

    latency_s: float
    stage_latency_s: dict[str, float]  # LLM stage id -> its slowed latency (a replica group: its slowest replica)

    def differs(self, t: TaskRecord) -> bool:
        """Whether `t` stores another prediction (relative 1e-9: the same figure re-derived is not a change)."""
        def same(a: float, b: float) -> bool:
            return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-9 * max(abs(a), abs(b)))
        return not same(self.latency_s, t.predicted_latency_s) or self.stage_latency_s.keys() != \
            t.predicted_stage_latency_s.keys() or not all(same(x, t.predicted_stage_latency_s[k])
                                                          for k, x in self.stage_latency_s.items())


def predict_on_placement(tasks: Iterable[TaskRecord], instances: Iterable[Instance],
                         profiles: Mapping[Key, Profile], kappa: float, *,
                         only: frozenset[str] | None = None) -> dict[str, Prediction]:
    """By task id, the prediction of each ACTIVE task (of `only`, when given) on the placement `instances`
    (their `load_output_tokens_per_s` = the PLANNED load, the sum of their tasks' reuse shares). Every task
    holding a committed variant (DEPLOYING, ACTIVE, a switch's next variant too) counts in the busy shares. A task
    with a stage whose profile or instance is unknown gets none (its stored prediction stands)."""
    tasks = list(tasks)
    planned = planned_busy_shares(task_uses(tasks, profiles))
    placed: dict[str, tuple[tuple[str, ...], float, float]] = {}
    for i in instances:
        p = profiles.get(i.key)
        rho = busy_share(i.load_output_tokens_per_s, p.max_output_tokens_per_s) if p is not None else 0.0
        placed[i.id] = (tuple(i.gpu_ids), rho, planned.get(i.id) or min(1.0, rho))
    mult = placed_multipliers(placed, Fraction(kappa))
    out: dict[str, Prediction] = {}
    for t in tasks:
        if t.state is not TaskState.ACTIVE or (only is not None and t.id not in only):
            continue
        wf = t.workflow
        own = stage_latencies_alone(wf, t.variant, profiles) if wf is not None and t.variant is not None else None
        if wf is None or own is None:
            continue
        slowed: dict[str, float | None] = dict(own)
        stages: dict[str, float] = {}
        for s in wf.stages:
            if not s.is_llm:
                continue
            iids = replicas_of(t.stage_instances, s.id)
            lat = own.get(s.id)
            if lat is None or not iids or any(i not in mult for i in iids):
                slowed[s.id] = None
                break
            ms = [mult[i] for i in iids]
            m = math.inf if any(x is None for x in ms) else float(max(x for x in ms if x is not None))
            slowed[s.id] = stages[s.id] = lat * m
        total = longest_path_s(wf, slowed) if all(x is not None for x in slowed.values()) else None
        if total is not None:
            out[t.id] = Prediction(total, stages)
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
