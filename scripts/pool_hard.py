"""Pool several `flowmaker bench selector --section hard` runs into one summary (`python scripts/pool_hard.py DIR...`).

Each DIR is a run's `--out` folder (its selector.json). Prints, over every instance of every run, the share proven
optimal within 1 s and 2 s, the unproven ones' median and largest gap, answers without a variant or over budget, and
the same per family and per run, as JSON and a table. Asserts nothing.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from flowmaker.bench.selector_hard_run import OVER_BUDGET_SLACK_S


def summary(rows: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    unproven = [r for r in rows if not r["optimal"]]
    gaps = sorted(r["gap"] for r in unproven if r["gap"] is not None)
    return {"n": len(rows),
            "proven_1s": sum(1 for r in rows if r["optimal"] and r["time_s"] <= 1.0),
            "proven_2s": sum(1 for r in rows if r["optimal"] and r["time_s"] <= 2.0),
            "unproven": len(unproven),
            "gap_median": statistics.median(gaps) if gaps else None,
            "gap_max": gaps[-1] if gaps else None,
            "no_answer": sum(1 for r in rows if r["answer"] == "DEADLINE_EXCEEDED"),
            "over_budget": sum(1 for r in rows if r["time_s"] > budget + OVER_BUDGET_SLACK_S),
            "unproven_instances": [(r["family"], r["seed"], r["gap"]) for r in unproven]}


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    runs: dict[str, list[dict[str, Any]]] = {}
    budget = 0.0
    for d in argv:
        res = json.loads((Path(d) / "selector.json").read_text())
        hard = res.get("hard", res)
        runs[d] = hard["rows"]
        budget = max(budget, hard["budget_s"])
    rows = [r for rs in runs.values() for r in rs]
    out = {"all": summary(rows, budget),
           "families": {f: summary([r for r in rows if r["family"] == f], budget)
                        for f in sorted({r["family"] for r in rows})},
           "runs": {d: summary(rs, budget) for d, rs in runs.items()}}
    json.dump(out, sys.stdout, indent=1)
    print("\n\n| set | n | proven <= 1 s | <= 2 s | unproven | median gap | max gap | no answer | over budget |")
    print("|---|---|---|---|---|---|---|---|---|")
    pct = lambda x: "-" if x is None else f"{100 * x:.2f}%"  # noqa: E731
    for name, s in [("all", out["all"]), *out["families"].items(), *out["runs"].items()]:
        print(f"| {name} | {s['n']} | {s['proven_1s']} ({100 * s['proven_1s'] / s['n']:.1f}%) | {s['proven_2s']} | "
              f"{s['unproven']} | {pct(s['gap_median'])} | {pct(s['gap_max'])} | {s['no_answer']} | "
              f"{s['over_budget']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
