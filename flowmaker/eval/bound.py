"""An upper bound on the goodput ANY plan can reach on a replayed segment (the bench's "capacity bound"). Pure.

`bench serving` asks FlowMaker for goodput of at least 0.90 in every cell unless no plan can reach it. This
module says when none can, from three facts of the simulator that hold whatever is deployed, routed or shared:

1. **Latency floor.** An LLM call alone on profile p takes `p.call_latency_s(in, out)` (the engine model's
   lone-request time) and nothing makes it faster: batching, queueing and GPU sharing only add. So a request
   of task t can meet its SLO only if some candidate workflow of t, each LLM stage on its fastest profile
   whose model meets t's accuracy target, has a critical path within the SLO (the longest path is monotone in
   every stage's latency, so stage-wise fastest profiles give the least path). Requests above it are misses.
2. **GPU work.** Serving a call on an instance of p (k = tp x pp GPUs) takes at least
   `w = k x (in x prefill_s_per_token + out / D(p))` GPU-seconds, D the pure-decode throughput: prefill is paid
   per request (it is not batched), a decode step of b tokens lasts at least b / D, and an instance slowed to
   speed s uses s of each of its GPUs, with the speeds on one GPU summing to at most 1 (the simulator's
   "dynamic" and "worst-case" co-location; NOT "ignore", where every instance runs at full speed). A request
   that meets its SLO had all its work done between its arrival and arrival + SLO. For a run of consecutive
   arrivals i..j, every good one among them was served within [t_i, max(t + SLO)], on `gpus` GPUs; at most the
   largest number of them whose least works fit `gpus x` that span can be good (smallest first is optimal).
   Spans that do not overlap add up: the most forced misses over disjoint spans is a weighted interval
   scheduling problem.
3. **GPU memory.** A call holds `in + out` tokens of its instance's KV budget (`kv_tokens`, reserved whole for
   the call's life, as the engine model does) for at least its engine time alone, and an instance of p holds
   `p.total_memory_gb` for its budget, so the call holds at least `mem(p) x (in + out) / kv_tokens x engine time`
   GB-seconds of the cluster's memory. Spans count it as in 2 against the cluster's total GB x the span;
   a span forces the larger of the two resources' misses.

The floors take, per request, the least over every plan (workflows, models meeting the accuracy target,
tp/pp; the resources over the plans that meet the SLO alone), each separately: valid, not tight.
The bound = (requests - latency misses - work misses) / requests. `tests/unit/test_goodput_bound.py` checks
each piece against a brute force and the bound against the simulator, on real plans and on overloads.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flowmaker.domain import Gpu, Model, Profile, Workflow
from flowmaker.errors import InvalidSpec
from flowmaker.eval.tasks import EvalTask
from flowmaker.eval.traces import Arrival


@dataclass(frozen=True, slots=True)
class GoodputBound:
    requests: int
    latency_misses: int  # requests no plan serves within their SLO even alone
    work_misses: int  # further requests that some burst forces to miss (GPU-seconds)
    worst_span: tuple[float, float, int, int]  # (start s, end s, requests in it, forced misses) of the worst span

    @property
    def bound(self) -> float:
        return (self.requests - self.latency_misses - self.work_misses) / self.requests if self.requests else 1.0

    def as_json(self) -> dict[str, object]:
        return {"goodput_upper_bound": self.bound, "requests": self.requests, "latency_misses": self.latency_misses,
                "work_misses": self.work_misses, "worst_span_s": list(self.worst_span[:2]),
                "worst_span_requests": self.worst_span[2], "worst_span_forced_misses": self.worst_span[3]}


def call_work_s(p: Profile, input_tokens: int, output_tokens: int) -> float:
    """The least GPU-seconds one call of these tokens takes on an instance of p (module doc, fact 2)."""
    return p.gpus * (input_tokens * p.prefill_s_per_token + output_tokens / p.pure_decode_tokens_per_s)


def call_memory_s(p: Profile, input_tokens: int, output_tokens: int, kv_tokens: int) -> float:
    """The least GB-seconds of GPU memory one call holds on an instance of p (module doc, fact 3): its KV
    reservation (in + out tokens of the instance's `kv_tokens`) for at least its engine time alone."""
    engine_s = input_tokens * p.prefill_s_per_token + output_tokens * p.decode_s_per_token
    return p.total_memory_gb * (input_tokens + output_tokens) / kv_tokens * engine_s


def _pareto(opts: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """The options no other is at least as good as in all three numbers (and better in one)."""
    opts = sorted(set(opts))
    out: list[tuple[float, float, float]] = []
    for o in opts:
        if not any(q[0] <= o[0] and q[1] <= o[1] and q[2] <= o[2] for q in out):
            out.append(o)
    return out


def request_floors(wfs: Sequence[Workflow], profiles: Sequence[Profile], kv_tokens: int, slo_s: float
                   ) -> tuple[float, float, float]:
    """(least latency, least GPU-seconds, least memory GB-seconds) of a request over its candidate workflows
    (already sized for it) with each LLM stage on any of `profiles` (those whose model meets the accuracy
    target); the two resources over the plans whose latency alone is within `slo_s` only (inf when none)."""
    best = [math.inf, math.inf, math.inf]
    if not profiles:
        return best[0], best[1], best[2]
    for wf in wfs:
        order = [wf.stages[k] for k in wf.topo_order()]
        llm = [s for s in order if s.is_llm]
        options = [_pareto([(s.calls_per_request * p.call_latency_s(s.input_tokens, s.output_tokens),
                             s.calls_per_request * call_work_s(p, s.input_tokens, s.output_tokens),
                             s.calls_per_request * call_memory_s(p, s.input_tokens, s.output_tokens, kv_tokens))
                            for p in profiles]) for s in llm]
        for combo in itertools.product(*options):
            lat_of = {s.id: c[0] for s, c in zip(llm, combo, strict=True)}
            fin: dict[str, float] = {}
            for s in order:
                fin[s.id] = max((fin[d] for d in s.depends_on), default=0.0) + lat_of.get(s.id, s.latency_s)
            lat = max(fin.values(), default=0.0)
            best[0] = min(best[0], lat)
            if lat <= slo_s + 1e-9:
                best[1] = min(best[1], sum(c[1] for c in combo))
                best[2] = min(best[2], sum(c[2] for c in combo))
    return best[0], best[1], best[2]


class _Greedy:
    """The most items of one resource that fit a growing capacity, smallest first; `rest` counts the others."""

    def __init__(self) -> None:
        self.kept: list[float] = []  # max-heap (negated) of the smallest items, their sum within the capacity
        self.rest: list[float] = []  # min-heap of the others
        self.total = 0.0

    def add(self, x: float, cap: float) -> int:
        """Add an item, the capacity having grown to `cap` (never shrinks); the items that do not fit."""
        if self.kept and x < -self.kept[0]:  # keep the smallest: x takes the place of the largest kept
            y = -heapq.heappushpop(self.kept, -x)
            self.total += x - y
            x = y
        heapq.heappush(self.rest, x)
        while self.rest and self.total + self.rest[0] <= cap:
            y = heapq.heappop(self.rest)
            self.total += y
            heapq.heappush(self.kept, -y)
        return len(self.rest)


def _span_misses(times: Sequence[float], ends: Sequence[float],
                 resources: Sequence[tuple[Sequence[float], float]]) -> list[tuple[float, float, int, int, int]]:
    """Every span of consecutive requests i..j that forces misses: (start, end, i, j, misses). `resources`: per
    resource the least amount each request needs and what the cluster supplies per second."""
    out: list[tuple[float, float, int, int, int]] = []
    n = len(times)
    for i in range(n):
        greedy = [_Greedy() for _ in resources]
        end = -math.inf
        for j in range(i, n):
            end = max(end, ends[j])
            span = end - times[i]
            m = max(g.add(need[j], rate * span) for g, (need, rate) in zip(greedy, resources, strict=True))
            if m:
                out.append((times[i], end, i, j, m))
    return out


def disjoint_forced_misses(times: Sequence[float], ends: Sequence[float],
                           resources: Sequence[tuple[Sequence[float], float]]
                           ) -> tuple[int, tuple[float, float, int, int]]:
    """The most forced misses over spans that do not overlap in time, and the worst single span
    (start, end, requests, misses). `times` sorted; `ends[i]` >= `times[i]` (arrival + SLO)."""
    spans = _span_misses(times, ends, resources)
    if not spans:
        return 0, (0.0, 0.0, 0, 0)
    worst = max(spans, key=lambda s: (s[4], -(s[3] - s[2])))
    spans.sort(key=lambda s: s[1])
    ends_sorted = [s[1] for s in spans]
    best = [0] * (len(spans) + 1)  # best[k]: the most misses using the first k spans (by end)
    for k, (start, _end, _i, _j, m) in enumerate(spans):
        # spans that end by this one's start (touching is fine: a point holds no resource)
        prev = bisect.bisect_right(ends_sorted, start, 0, k)
        best[k + 1] = max(best[k], best[prev] + m)
    return best[-1], (worst[0], worst[1], worst[3] - worst[2] + 1, worst[4])


def goodput_upper_bound(arrivals: Sequence[Arrival], tasks: Sequence[EvalTask], models: Sequence[Model],
                        profiles: Sequence[Profile], gpus: Sequence[Gpu], kv_tokens: int) -> GoodputBound:
    """The bound of the module doc for these scored arrivals served on `gpus`, each instance reserving
    `kv_tokens` of KV cache (the simulator's budget)."""
    if not gpus:
        raise InvalidSpec("need at least one GPU", field="gpus")
    if kv_tokens < 1:
        raise InvalidSpec(f"must be >= 1, got {kv_tokens}", field="kv_tokens")
    by_task = {t.name: t for t in tasks}
    acc: Mapping[str, float] = {m.id: m.accuracy for m in models}
    usable = {t.name: tuple(p for p in profiles if acc.get(p.model_id, -1.0) >= t.min_accuracy - 1e-12)
              for t in tasks}
    cache: dict[tuple[str, int, int], tuple[float, float, float]] = {}
    lat_miss = 0
    keep: list[tuple[float, float, float, float]] = []  # (arrival, arrival + SLO, least GPU-s, least GB-s)
    for a in sorted(arrivals, key=lambda x: (x.time_s, x.task, x.req_id)):
        t = by_task.get(a.task)
        if t is None:
            raise InvalidSpec(f"arrival {a.req_id!r} is for unknown task {a.task!r}", field="arrivals")
        key = (a.task, a.context_tokens, a.generated_tokens)
        got = cache.get(key)
        if got is None:
            wfs = tuple(t.sized(c, a.context_tokens, a.generated_tokens) for c in t.candidates)
            got = cache[key] = request_floors(wfs, usable[t.name], kv_tokens, t.max_latency_s)
        lat, work, mem = got
        if not lat <= t.max_latency_s + 1e-9:
            lat_miss += 1
            continue
        keep.append((a.time_s, a.time_s + t.max_latency_s, work, mem))
    resources = (([k[2] for k in keep], float(len(gpus))),
                 ([k[3] for k in keep], sum(g.memory_total_gb for g in gpus)))
    misses, worst = disjoint_forced_misses([k[0] for k in keep], [k[1] for k in keep], resources)
    return GoodputBound(len(arrivals), lat_miss, misses, worst)
