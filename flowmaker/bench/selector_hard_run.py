"""`flowmaker bench selector --section hard`: `exact` on fresh instances of the hard families, in-process.

Per family and overall: the share proven optimal within 1 s and within 2 s, the proven gap of the answers
left unproven (median, max), the worst case, and whether every answer came within its budget. The load
average is read before and after (the machine may be shared), and `hard_burn` busy-loop processes can load
it on purpose: the search switches phases by work done, so the answers (`answers_digest`) are the same at
any load unless the final deadline cuts a search short.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from flowmaker.bench.selector_hard import HARD_FAMILIES, hard_instance
from flowmaker.errors import DeadlineExceeded

Progress = Callable[[str], None]
# Slack over the budget for "answered within its budget": the answer is built after the search stops.
OVER_BUDGET_SLACK_S = 0.05
WARM_BUDGET_S = 0.2  # the throwaway selection that loads the strategies' modules before any instance is timed


def _burn(n: int) -> list[subprocess.Popen[bytes]]:
    """n busy-loop processes (the bench's own load; stopped by `_stop`)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def hard(cfg: Any, progress: Progress) -> dict[str, Any]:
    """Run `exact` on cfg.hard_count instances of every hard family (seeds cfg.seed .. + count - 1)."""
    from flowmaker.bench.selector import _select

    families = tuple(cfg.hard_families) or HARD_FAMILIES
    procs = _burn(cfg.hard_burn)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    try:
        if procs:  # until the 1-minute load average shows them (at most 75 s)
            end = time.monotonic() + 75.0
            while os.getloadavg()[0] < 0.9 * cfg.hard_burn and time.monotonic() < end:
                time.sleep(1.0)
            load_before = os.getloadavg()
        # One throwaway selection first, so that no instance is timed with the imports a strategy makes on its first
        # call (HiGHS among them; the selector service makes them at start). Without it the first instance of a
        # `--section hard` run took 2.07-2.17 s at load average 4.6, against a 2 s budget (chain_clones 1031000, whose
        # search ends in 0.8-0.9 s quiet and 1.85-1.94 s under the same load once warm).
        warm = hard_instance(families[0], cfg.seed, "large")
        with contextlib.suppress(DeadlineExceeded):
            _select(dataclasses.replace(warm.request, options=dataclasses.replace(
                warm.request.options, time_budget_s=WARM_BUDGET_S)), "exact")
        for fam in families:
            for k in range(cfg.hard_count):
                seed = cfg.seed + k
                inst = hard_instance(fam, seed, "large")
                req = dataclasses.replace(inst.request, options=dataclasses.replace(
                    inst.request.options, time_budget_s=cfg.hard_budget_s))
                progress(f"hard {fam:12s} {k}")
                row: dict[str, Any] = {"family": fam, "seed": seed, "recipe": inst.recipe}
                t0 = time.perf_counter()
                try:
                    res = _select(req, "exact")
                except DeadlineExceeded:
                    row.update(time_s=time.perf_counter() - t0, answer="DEADLINE_EXCEEDED", optimal=False,
                               gap=None, cost=None, lower_bound=None, evaluated=None, variant=None)
                else:
                    v = res.variant
                    row.update(time_s=time.perf_counter() - t0, optimal=res.optimal,
                               answer="feasible" if v else (res.reason.value if res.reason else "?"),
                               cost=v.cost if v else None, lower_bound=res.lower_bound if v else None,
                               gap=res.gap if v else (0.0 if res.optimal else None),
                               evaluated=res.variants_evaluated,
                               variant=[v.workflow_id, [(a.stage_id, a.model_id, a.tp, a.pp, a.instance_id,
                                                         a.new_key, list(a.gpu_ids)) for a in v.assignments]]
                               if v else None)
                rows.append(row)
    finally:
        _stop(procs)
    load_after = os.getloadavg()
    budget = cfg.hard_budget_s
    summary = {fam: summarize([r for r in rows if r["family"] == fam], budget) for fam in families}
    summary["all"] = summarize(rows, budget)
    return {"rows": rows, "summary": summary, "budget_s": budget, "burn": cfg.hard_burn,
            "load_average_before": load_before, "load_average_after": load_after, "cpus": os.cpu_count(),
            "answers_digest": answers_digest(rows)}


def answers_digest(rows: list[dict[str, Any]]) -> str:
    """A digest of the proven answers (instance, answer, cost, variant): two runs with equal digests gave the
    same answers to everything they proved. Unproven answers stopped at the deadline, so they may differ."""
    return hashlib.sha256(json.dumps([(r["family"], r["seed"], r["answer"], _sig(r["cost"]), r["variant"])
                                      for r in rows if r["optimal"]]).encode()).hexdigest()[:16]


def _sig(x: float | None) -> str | None:
    return None if x is None else f"{x:.9g}"


def summarize(rows: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """Share proven within 1 s and 2 s, the unproven ones' gaps, answers without a variant or over budget, times and
    the worst case, over these rows (one run's, or several pooled: scripts/pool_hard.py)."""
    n = len(rows)
    unproven = [r for r in rows if not r["optimal"]]
    gaps = sorted(r["gap"] for r in unproven if r["gap"] is not None and math.isfinite(r["gap"]))
    worst = max(rows, key=lambda r: (not r["optimal"], r["gap"] or 0.0, r["time_s"]), default=None)
    times = sorted(r["time_s"] for r in rows)
    return {
        "instances": n,
        "proven_within_1s": sum(1 for r in rows if r["optimal"] and r["time_s"] <= 1.0),
        "proven_within_2s": sum(1 for r in rows if r["optimal"] and r["time_s"] <= 2.0),
        "proven": sum(1 for r in rows if r["optimal"]),
        "share_proven_1s": (sum(1 for r in rows if r["optimal"] and r["time_s"] <= 1.0) / n) if n else None,
        "share_proven_2s": (sum(1 for r in rows if r["optimal"] and r["time_s"] <= 2.0) / n) if n else None,
        "unproven": len(unproven),
        "unproven_gap_median": statistics.median(gaps) if gaps else None,
        "unproven_gap_max": gaps[-1] if gaps else None,
        "no_answer": sum(1 for r in rows if r["answer"] == "DEADLINE_EXCEEDED"),
        "over_budget": sum(1 for r in rows if r["time_s"] > budget + OVER_BUDGET_SLACK_S),
        "median_ms": 1e3 * statistics.median(times) if times else None,
        "max_ms": 1e3 * times[-1] if times else None,
        "worst": None if worst is None else {k: worst[k] for k in ("family", "seed", "time_s", "optimal", "gap")},
    }


def render_hard(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    h = result["hard"]
    la, lb = h["load_average_before"], h["load_average_after"]
    t = Table(title=f"Hard families: exact in-process, {h['budget_s']:g} s budget, {h['burn']} busy processes "
                    f"(load average {la[0]:.2f} before, {lb[0]:.2f} after, {h['cpus']} CPUs); gap = (cost - "
                    "proven lower bound) / cost")
    for c in ("family", "n", "proven <=1 s", "proven <=2 s", "unproven", "gap median", "gap max", "no answer",
              "over budget", "median ms", "max ms", "worst (seed, s, gap)"):
        t.add_column(c, justify="right")

    def pct(a: int, n: int) -> str:
        return f"{a}/{n} ({a / n:.0%})" if n else "-"

    def gap(g: float | None) -> str:
        return "-" if g is None else f"{g:.2%}"

    for fam, sm in h["summary"].items():
        w = sm["worst"]
        t.add_row(fam, str(sm["instances"]), pct(sm["proven_within_1s"], sm["instances"]),
                  pct(sm["proven_within_2s"], sm["instances"]), str(sm["unproven"]),
                  gap(sm["unproven_gap_median"]), gap(sm["unproven_gap_max"]), str(sm["no_answer"]),
                  str(sm["over_budget"]), f"{sm['median_ms']:.0f}" if sm["median_ms"] is not None else "-",
                  f"{sm['max_ms']:.0f}" if sm["max_ms"] is not None else "-",
                  "-" if w is None else f"{w['seed']}, {w['time_s']:.2f}, {gap(w['gap'])}")
    console.print(t)
    console.print(f"proven answers digest {h['answers_digest']} (equal digests: the same proven answers, variant "
                  "for variant)")
