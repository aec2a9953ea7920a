"""`bayesopt`: Aquatope-style constrained Bayesian optimisation over (workflow, per-stage option).

Gaussian-process BO (scikit-optimize `gp_minimize`, expected improvement): 10
random initial points, then sequential trials up to `max_trials` (default 200,
as the published baseline ran; at most 1000). It stops before a trial that would end after the
time budget (default 120 s; the selector service also applies the call's deadline). A point is a workflow plus, per LLM stage, an
integer option: reuse running instance r, open a new instance of profile p
(profiles ordered by total memory so that neighbouring integers are similar),
or share the instance of an earlier stage. Infeasible points are penalised
above every feasible cost, more the earlier the constraint they break.

Why scikit-optimize: its GP needs only numpy/scipy/scikit-learn (optuna's
GPSampler needs torch, a multi-GB dependency for one baseline); it is an
optional extra (`pip install flowmaker[bayesopt]`) because its last release is
from 2024.
"""

from __future__ import annotations

import time
import warnings

from flowmaker.domain import SelectionRequest, SelectionResult
from flowmaker.errors import FailedPrecondition
from flowmaker.selection.problem import NEW, REUSE, Choice, Problem, better, infeasible_result
from flowmaker.selection.registry import register

DEFAULT_TRIALS = 200
MAX_TRIALS = 1000
INITIAL_POINTS = 10
DEFAULT_BUDGET_S = 120.0


@register("bayesopt")
def select_bayesopt(req: SelectionRequest) -> SelectionResult:
    try:
        from skopt import gp_minimize
        from skopt.space import Integer, Space
        from skopt.utils import cook_estimator
    except ImportError as e:  # optional extra
        raise FailedPrecondition("the bayesopt strategy needs scikit-optimize: pip install 'flowmaker[bayesopt]'",
                                 field="strategy", reason="OPTIONAL_DEPENDENCY_MISSING") from e
    started = time.perf_counter()
    pb = Problem(req)
    # Trials are capped: each GP fit costs O(trials^3), so a huge count would hold the worker for minutes.
    trials = min(req.options.max_trials or DEFAULT_TRIALS, MAX_TRIALS)
    deadline = started + (req.options.time_budget_s or DEFAULT_BUDGET_S)
    R, P = len(pb.reusable), len(pb.profiles)
    order = sorted(range(P), key=lambda pi: (pb.p_mem[pi], pi))
    max_n = max(len(pw.llm) for pw in pb.workflows)
    n_opts = R + P + max_n - 1
    if R + P == 0:
        return infeasible_result(pb, "bayesopt", 1, started, 0)
    # Penalties sit above any feasible cost: every new instance of the largest profile on every stage.
    worst = max(pb.p_mem, default=1.0) * max_n * pb.lam + 1.0
    best: tuple[float, float, int] | None = None
    best_at = None
    level = 1
    evaluated = 0

    def decode(x: list[int]) -> tuple[int, list[Choice], list[int]] | None:
        w = x[0] % len(pb.workflows)
        pw = pb.workflows[w]
        choice: list[Choice] = []
        slots: list[int] = []
        for j in range(len(pw.llm)):
            o = x[1 + j]
            if o < R:
                choice.append((REUSE, o))
            elif o < R + P:
                choice.append((NEW, len(slots)))
                slots.append(order[o - R])
            else:
                src = o - R - P  # share the instance of an earlier stage
                if src >= j:
                    return None
                choice.append(choice[src])
        return w, choice, slots

    def objective(x: list[int]) -> float:
        nonlocal best, best_at, level, evaluated
        evaluated += 1
        dec = decode([int(v) for v in x])
        if dec is None:
            return worst * 6
        w, choice, slots = dec
        pw = pb.workflows[w]
        res, places = pb.check(pw, choice, slots)
        level = max(level, res)
        if res < 5:
            return worst * (1 + (5 - res))
        key = pb.score(pw, choice, slots, places)
        if better(*key, best):
            best, best_at = key, (pw, list(choice), list(slots), places)
        return key[0]

    timed_out = False
    last = [time.perf_counter(), 0.0]  # end of the previous trial, duration of the longest one

    def stop(_res: object) -> bool:
        # Stop when the next trial would not end before the deadline (a GP fit cannot be interrupted).
        nonlocal timed_out
        now = time.perf_counter()
        last[1] = max(last[1], now - last[0])
        last[0] = now
        if now + last[1] > deadline:
            timed_out = True
            return True
        return False

    dims = [Integer(0, len(pb.workflows) - 1 if len(pb.workflows) > 1 else 1)]
    dims += [Integer(0, max(n_opts - 1, 1)) for _ in range(max_n)]
    # One start for the GP hyperparameter fit (skopt's default is 2 restarts): the fit dominates
    # the run time and extra restarts did not change the answers on the benchmark tasks.
    gp = cook_estimator("GP", space=Space(dims), random_state=req.options.seed, noise="gaussian",
                        n_restarts_optimizer=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skopt warns on repeated points; expected on small spaces
        gp_minimize(objective, dims, base_estimator=gp, n_calls=max(trials, INITIAL_POINTS + 1), n_initial_points=INITIAL_POINTS,
                    random_state=req.options.seed, acq_func="EI", acq_optimizer="sampling", n_points=1000,
                    callback=[stop])
    if best_at is None:
        return infeasible_result(pb, "bayesopt", level, started, evaluated, timed_out)
    return pb.result("bayesopt", best_at, started, evaluated, timed_out)
