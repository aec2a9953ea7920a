"""`heuristic`: the published three-step pruning selector, kept as a comparison (it may miss the optimum).

1. drop models whose accuracy < alpha;
2. keep only model assignments (a model per LLM stage) whose reuse-aware total
   active parameters — each distinct model counted once, models with a running
   reusable instance counted 0 — do not exceed the budget of the minimal
   models that meet alpha (n_stages x the smallest qualifying model);
3. for each remaining assignment, in ascending parameter order, enumerate TP/PP
   configs (one instance per distinct model, shared by its stages; a running
   instance of the model is one more option), drop latency and capacity
   violations, place LeastLoaded and keep the assignment's least-cost feasible
   config; each workflow's FIRST feasible assignment is compared with the
   current best and the least-cost one is returned.
"""

from __future__ import annotations

import itertools
import time

from flowmaker.domain import SelectionRequest, SelectionResult
from flowmaker.selection.problem import NEW, REUSE, Choice, Problem, better, infeasible_result
from flowmaker.selection.registry import register


@register("heuristic")
def select_heuristic(req: SelectionRequest) -> SelectionResult:
    started = time.perf_counter()
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
            # Step 2: reuse-aware parameter budget.
            assigns = []
            for combo in itertools.product(ok, repeat=n):
                distinct = {m.id: m for m in combo}
                total = sum(m.active_params_b for m in distinct.values() if m.id not in running)
                if total <= budget:
                    assigns.append((total, tuple(m.id for m in combo)))
            assigns.sort()
            # Step 3: least-cost feasible config of each assignment; stop at the first feasible one.
            for _, combo_ids in assigns:
                models = sorted(set(combo_ids))
                found: tuple[tuple[float, float, int], tuple] | None = None
                for cfg in itertools.product(*(opts[m] for m in models)):
                    evaluated += 1
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
                    key = pb.score(pw, choice, slots)
                    if found is None or better(*key, found[0]):
                        found = (key, (pw, choice, slots, places))
                if found is not None:
                    if better(*found[0], best):
                        best, best_at = found
                    break
    if best_at is None:
        return infeasible_result(pb, "heuristic", level, started, evaluated)
    return pb.result("heuristic", best_at, started, evaluated)
