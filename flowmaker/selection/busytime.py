"""The busy-time capacity model (docs/selection-spec.md, "Extension: busy-time capacity"), for every strategy.

Under `options.capacity_model = BUSY_TIME` an instance's capacity depends on the requests it serves, so it
is not one number per profile: it is one per (workflow, profile). Each workflow is therefore a request of
the base contract of its own, with every profile's `max_output_tokens_per_s` and every running instance's
load restated at that workflow's mean request, and the strategy answers each; the best of the answers by
the spec's order (cost, L, new GPUs, then workflow order) is the answer. A strategy exact on the base
contract is therefore exact on this one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from flowmaker.domain import (
    CapacityModel,
    GpuSharing,
    Infeasibility,
    Instance,
    Profile,
    SelectionRequest,
    SelectionResult,
    Workflow,
)
from flowmaker.errors import DeadlineExceeded
from flowmaker.selection.problem import better

_LEVEL = {Infeasibility.NO_MODEL_MEETS_ACCURACY: 1, Infeasibility.NO_LATENCY: 2, Infeasibility.NO_CAPACITY: 3,
          Infeasibility.NO_GPU_MEMORY: 4}


def mean_request(wf: Workflow) -> tuple[float, float]:
    """(mean prompt tokens, mean output tokens) of the workflow's LLM calls (weights: calls_per_request)."""
    calls = [(s.calls_per_request, s.input_tokens, s.output_tokens) for s in wf.stages if s.is_llm]
    n = sum(c for c, _, _ in calls)
    return sum(c * i for c, i, _ in calls) / n, sum(c * o for c, _, o in calls) / n


def busy_capacity(p: Profile, prompt: float, output: float) -> float:
    """Output tokens/s one instance sustains when every call is the mean request: a call keeps it busy for
    prompt x prefill_s_per_token + output / decode throughput (the pure-decode figure, or
    max_output_tokens_per_s when the profile has none)."""
    busy = prompt * p.prefill_s_per_token + output / p.pure_decode_tokens_per_s
    return output / busy


def restated(req: SelectionRequest, wf: Workflow) -> SelectionRequest:
    """The base-contract request of one workflow: capacities and running loads at its mean request. A running
    instance's load (output tokens/s at the reference request) keeps its busy fraction."""
    prompt, output = mean_request(wf)
    caps = {p.key: busy_capacity(p, prompt, output) for p in req.profiles}
    profiles = tuple(replace(p, max_output_tokens_per_s=caps[p.key]) for p in req.profiles)
    ref = {p.key: p.max_output_tokens_per_s for p in req.profiles}

    def load(i: Instance) -> Instance:
        if i.key not in ref:
            return i
        return replace(i, load_output_tokens_per_s=i.load_output_tokens_per_s * caps[i.key] / ref[i.key])
    cluster = replace(req.cluster, instances=tuple(load(i) for i in req.cluster.instances))
    opts = replace(req.options, capacity_model=CapacityModel.OUTPUT_TOKENS)
    return replace(req, workflows=(wf,), profiles=profiles, cluster=cluster, options=opts)


def select_busy_time(req: SelectionRequest, name: str, strategy: Callable[[SelectionRequest], SelectionResult]
                     ) -> SelectionResult:
    """Answer `req` (capacity_model BUSY_TIME) with `strategy` (`name`) run on each workflow's restated
    request."""
    started = time.perf_counter()
    n = len(req.workflows)
    budget = req.options.time_budget_s
    best: SelectionResult | None = None
    key: tuple[float, float, int] | None = None
    level, evaluated, space, optimal, lower, timed_out = 0, 0, 0, True, math.inf, False
    stopped: DeadlineExceeded | None = None
    for k, wf in enumerate(req.workflows):
        sub = restated(req, wf)
        if budget > 0:  # what is left of the budget, shared by the workflows still to answer
            left = max(budget - (time.perf_counter() - started), 1e-3)
            sub = replace(sub, options=replace(sub.options, time_budget_s=left / (n - k)))
        try:
            res = strategy(sub)
        except DeadlineExceeded as e:
            stopped, optimal, lower, timed_out = e, False, 0.0, True
            continue
        evaluated += res.variants_evaluated
        space += res.search_space_size
        timed_out = timed_out or res.timed_out
        optimal = optimal and res.optimal
        if res.variant is None:
            level = max(level, _LEVEL[res.reason] if res.reason else 0)
            if not res.optimal:
                lower = min(lower, 0.0)
            continue
        v = res.variant
        lower = min(lower, v.cost if res.optimal else res.lower_bound)
        if better(v.cost, v.latency_s, v.new_gpus, key):
            best, key = res, (v.cost, v.latency_s, v.new_gpus)
    elapsed = time.perf_counter() - started
    sharing = req.options.gpu_sharing is GpuSharing.INTERFERENCE
    if best is None:
        if stopped is not None:
            raise stopped
        lvl = max(1, level)
        reason = next(r for r, x in _LEVEL.items() if x == lvl)
        return SelectionResult(strategy=name, variant=None, reason=reason,
                               reason_detail=f"{_SHARING_DETAIL if lvl == 4 and sharing else _DETAIL[lvl]} "
                                             "(capacity in busy time at each workflow's mean request)",
                               variants_evaluated=evaluated, search_space_size=space, elapsed_s=elapsed,
                               timed_out=timed_out, optimal=optimal)
    cost = best.variant.cost if best.variant else 0.0
    return replace(best, variants_evaluated=evaluated, search_space_size=space, elapsed_s=elapsed,
                   timed_out=timed_out, optimal=optimal,
                   lower_bound=cost if optimal else min(max(lower, 0.0), cost))


_SHARING_DETAIL = ("every variant meeting accuracy, latency and capacity needs more GPU memory than is free, or "
                   "overloads a shared GPU (its compute budget, or an instance that can no longer keep up once slowed), "
                   "or slows a running co-resident past what its tasks tolerate, or misses the latency target once "
                   "co-residents slow it")
_DETAIL = {1: "no LLM stage of any approved workflow can be served by a model that meets the accuracy target",
           2: "no variant whose models meet the accuracy target finishes within the latency target",
           3: "every variant meeting accuracy and latency overloads an instance",
           4: "every variant meeting accuracy, latency and capacity needs more GPU memory than is free"}

