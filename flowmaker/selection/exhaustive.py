"""`exhaustive`: enumerate the whole variant space of the spec, streaming, within a time budget.

The reference answer: every variant is checked from scratch by `Problem.check`
(no incremental state, no bounds). Only subtrees whose prefix already uses a
model below the accuracy SLO are skipped — every variant in them fails
constraint 1, so they are counted, not visited. Memory stays constant: a
depth-first generator holds one choice at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from flowmaker.domain import SelectionRequest, SelectionResult
from flowmaker.selection.problem import NEW, REUSE, Choice, Problem, PWorkflow, better, infeasible_result
from flowmaker.selection.registry import register

DEFAULT_BUDGET_S = 60.0


def _choices(problem: Problem, pw: PWorkflow, counter: list[int]) -> Iterator[tuple[list[Choice], list[int]]]:
    """Yield every (choice, slot profiles) of the workflow whose models all meet alpha.
    `counter[0]` is increased by the size of each skipped (accuracy-failing) subtree."""
    n = len(pw.llm)
    choice: list[Choice] = []
    slots: list[int] = []

    def rec(j: int) -> Iterator[tuple[list[Choice], list[int]]]:
        if j == n:
            yield choice, slots
            return
        for r, pi in enumerate(problem.r_prof):
            if not problem.p_ok[pi]:
                counter[0] += problem.space_size(pw, j + 1, len(slots))
                continue
            choice.append((REUSE, r))
            yield from rec(j + 1)
            choice.pop()
        for k in range(len(slots)):  # open slots already passed the accuracy test
            choice.append((NEW, k))
            yield from rec(j + 1)
            choice.pop()
        for pi in range(len(problem.profiles)):
            if not problem.p_ok[pi]:
                counter[0] += problem.space_size(pw, j + 1, len(slots) + 1)
                continue
            choice.append((NEW, len(slots)))
            slots.append(pi)
            yield from rec(j + 1)
            slots.pop()
            choice.pop()

    yield from rec(0)


@register("exhaustive")
def select_exhaustive(req: SelectionRequest) -> SelectionResult:
    started = time.perf_counter()
    problem = Problem(req)
    budget = req.options.time_budget_s or DEFAULT_BUDGET_S
    deadline = started + budget
    best: tuple[float, float, int] | None = None
    best_at: tuple[PWorkflow, list[Choice], list[int], list] | None = None
    level = 1  # the tightest failed constraint seen so far (5 = feasible)
    skipped = [0]
    visited = 0
    timed_out = False
    for pw in problem.workflows:
        for choice, slots in _choices(problem, pw, skipped):
            visited += 1
            if visited & 1023 == 0 and time.perf_counter() > deadline:
                timed_out = True
                break
            res, places = problem.check(pw, choice, slots)
            level = max(level, res)
            if res < 5:
                continue
            key = problem.score(pw, choice, slots, places)
            if better(*key, best):
                best = key
                best_at = (pw, list(choice), list(slots), places)
        if timed_out:
            break
    evaluated = visited + skipped[0]
    if best_at is None:
        return infeasible_result(problem, "exhaustive", level, started, evaluated, timed_out,
                                 optimal=not timed_out)
    return problem.result("exhaustive", best_at, started, evaluated, timed_out, optimal=not timed_out)
