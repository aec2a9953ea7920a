"""Latency SLOs by rule: k x the simulated standalone latency of a declared reference deployment.

The published setup sets each task's latency target at 2-5x its standalone latency. Here the
reference deployment is declared once, before any run: the task's fixed workflow
(`EvalTask.fixed_workflow`), every LLM stage on its own instance of REFERENCE_MODEL at tp=1, pp=1
(Qwen2.5-14B-Instruct: the strong model, whose accuracy meets every task's target, at its smallest
config), on an otherwise empty cluster. Its standalone latency is what the simulator measures for
one request of the trace's median shape; the SLO is `task.slo_k` (in [2, 5], fixed per task in
`flowmaker.eval.tasks`) times it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from flowmaker.catalog import make_cluster
from flowmaker.domain import GpuType, Model, Profile
from flowmaker.errors import InvalidSpec
from flowmaker.eval.tasks import EvalTask
from flowmaker.eval.traces import Arrival
from flowmaker.sim.cluster import Route, SimInstance, TaskDeployment, simulate

REFERENCE_MODEL = "Qwen2.5-14B-Instruct"
REFERENCE_TP = 1
SLO_K_RANGE = (2.0, 5.0)


def reference_profile(profiles: Sequence[Profile], model: str = REFERENCE_MODEL, tp: int = REFERENCE_TP) -> Profile:
    for p in profiles:
        if p.model_id == model and (p.tp, p.pp) == (tp, 1):
            return p
    raise InvalidSpec(f"no profile of the reference deployment {model} tp={tp}", field="profiles")


def standalone_latency_s(task: EvalTask, trace_kind: str, profiles: Sequence[Profile], models: Mapping[str, Model],
                         gpu_type: GpuType, *, tokens: tuple[int, int] | None = None,
                         reference: tuple[str, int] = (REFERENCE_MODEL, REFERENCE_TP)) -> float:
    """Simulated latency of one request alone on the reference deployment: the trace's median request, or
    `tokens` = (context, generated); `reference` = (model, tp) of the declared reference deployment."""
    prof = reference_profile(profiles, *reference)
    ctx, gen = tokens if tokens is not None else task.nominal_tokens(trace_kind, "median")
    wf = task.sized(task.fixed, ctx, gen)
    n = len(wf.llm_stages)
    cluster = make_cluster(gpu_type.name, nodes=1, gpus_per_node=max(1, n * prof.gpus))
    gids = [g.id for g in cluster.gpus]
    inst = [SimInstance(f"ref-{s.id}", prof, tuple(gids[k * prof.gpus:(k + 1) * prof.gpus]))
            for k, s in enumerate(wf.llm_stages)]
    dep = TaskDeployment(task, (Route(wf.id, tuple((s.id, f"ref-{s.id}") for s in wf.llm_stages)),))
    res = simulate(inst, [dep], [Arrival(0.0, task.name, "ref-0", ctx, gen)], cluster.gpus, models, gpu_type,
                   keep_latencies=True, colocation="ignore")
    return res.latencies[0][1]


def with_rule_slos(tasks: Sequence[EvalTask], trace_kind: str, profiles: Sequence[Profile],
                   models: Mapping[str, Model], gpu_type: GpuType) -> tuple[EvalTask, ...]:
    """The tasks with max_latency_s = slo_k x standalone latency of the reference deployment on `trace_kind`."""
    out = []
    for t in tasks:
        if not SLO_K_RANGE[0] <= t.slo_k <= SLO_K_RANGE[1]:
            raise InvalidSpec(f"task {t.name!r}: slo_k {t.slo_k} is outside {list(SLO_K_RANGE)}", field="slo_k")
        lat = standalone_latency_s(t, trace_kind, profiles, models, gpu_type)
        out.append(dataclasses.replace(t, max_latency_s=t.slo_k * lat))
    return tuple(out)
