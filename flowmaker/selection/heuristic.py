"""`heuristic`: the published three-step pruning selector, kept as a comparison (it may miss the optimum).

1. drop models whose accuracy < alpha;
2. keep only model assignments (a model per LLM stage) whose reuse-aware total
   active parameters — each distinct model counted once, models with a running
   reusable instance counted 0 — do not exceed the budget of the minimal
   models that meet alpha (n_stages x the smallest qualifying model);
3. for each remaining assignment, in ascending parameter order (generated
   best-first, so the smallest assignments come out without listing the
   exponentially many others first), enumerate TP/PP
   configs (one instance per distinct model, shared by its stages; a running
   instance of the model is one more option), drop latency and capacity
   violations, place LeastLoaded and keep the assignment's least-cost feasible
   config; each workflow's FIRST feasible assignment is compared with the
   current best and the least-cost one is returned.

Like `exhaustive`, it stops at the request's time budget (default 60 s) and
then says it timed out.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator, Sequence

from flowmaker.domain import Model, SelectionRequest, SelectionResult
from flowmaker.selection.problem import NEW, REUSE, Choice, Problem, better, infeasible_result
from flowmaker.selection.registry import register

DEFAULT_BUDGET_S = 60.0


def _assignments(ok: Sequence[Model], n: int, running: set[str], budget: float) -> Iterator[tuple[str, ...]]:
    """Model assignments of n stages within the reuse-aware parameter budget, in ascending
    (total, model order). Extending an assignment never lowers its total, so a best-first
    search over prefixes yields complete assignments in order."""
    cost = {m.id: (0.0 if m.id in running else m.active_params_b) for m in ok}
    rank = {m.id: i for i, m in enumerate(ok)}
    heap: list[tuple[float, tuple[int, ...], tuple[str, ...]]] = [(0.0, (), ())]
    while heap:
        total, _, prefix = heapq.heappop(heap)
        if len(prefix) == n:
            yield prefix
            continue
        used = set(prefix)
        for m in ok:
            t = total + (0.0 if m.id in used else cost[m.id])
            if t <= budget:
                nxt = (*prefix, m.id)
                heapq.heappush(heap, (t, tuple(rank[x] for x in nxt), nxt))


@register("heuristic")
def select_heuristic(req: SelectionRequest) -> SelectionResult:
    started = time.perf_counter()
    deadline = started + (req.options.time_budget_s or DEFAULT_BUDGET_S)
    timed_out = False
    pb = Problem(req)
    # Step 1: qualifying models that can run here (a profile exists).
    deployable = {p.model_id for p in pb.profiles}
    ok = sorted((m for m in req.models if m.accuracy >= pb.alpha and m.id in deployable),
                key=lambda m: (m.active_params_b, m.id))
    evaluated = 0
    level = 1 if not ok else 2
    best: tuple[float, float, int] | None = None
    best_at = None
    running = {pb.reusable[r].model_id for r in range(len(pb.reusable))}
    # Options per model: running instances first (free), then its profiles.
    opts: dict[str, list[tuple[str, int]]] = {m.id: [] for m in ok}
    for r, inst in enumerate(pb.reusable):
        if inst.model_id in opts:
            opts[inst.model_id].append((REUSE, r))
    for pi, p in enumerate(pb.profiles):
        if p.model_id in opts:
            opts[p.model_id].append((NEW, pi))
    if ok:
        smallest = ok[0].active_params_b
        for pw in pb.workflows:
            n = len(pw.llm)
            budget = n * smallest * (1 + 1e-9)
            # Steps 2 and 3: assignments within the reuse-aware parameter budget, smallest first;
            # the least-cost feasible config of each; stop at the first feasible assignment.
            for combo_ids in _assignments(ok, n, running, budget):
                if time.perf_counter() > deadline:
                    timed_out = True
                    break
                models = sorted(set(combo_ids))
                found: tuple[tuple[float, float, int], tuple] | None = None
                for cfg in itertools.product(*(opts[m] for m in models)):
                    evaluated += 1
                    if evaluated & 255 == 0 and time.perf_counter() > deadline:
                        timed_out = True
                        break
                    by_model = dict(zip(models, cfg, strict=True))
                    slot_of: dict[str, int] = {}
                    slots: list[int] = []
                    choice: list[Choice] = []
                    for mid in combo_ids:
                        kind, ref = by_model[mid]
                        if kind == REUSE:
                            choice.append((REUSE, ref))
                        else:
                            if mid not in slot_of:
                                slot_of[mid] = len(slots)
                                slots.append(ref)
                            choice.append((NEW, slot_of[mid]))
                    res, places = pb.check(pw, choice, slots)
                    level = max(level, res)
                    if res < 5:
                        continue
                    key = pb.score(pw, choice, slots, places)
                    if found is None or better(*key, found[0]):
                        found = (key, (pw, choice, slots, places))
                if found is not None:
                    if better(*found[0], best):
                        best, best_at = found
                    break
                if timed_out:
                    break
            if timed_out:
                break
    if best_at is None:
        return infeasible_result(pb, "heuristic", level, started, evaluated, timed_out)
    return pb.result("heuristic", best_at, started, evaluated, timed_out)
