"""Pool several `flowmaker bench selector --section hard` runs into one summary (`python scripts/pool_hard.py DIR...`).

Each DIR is a run's `--out` folder (its selector.json). Prints, over every instance of every run, the share proven
optimal within 1 s and 2 s, the unproven ones' median and largest gap, answers without a variant or over budget, and
the same per family and per run, as JSON and a table. Asserts nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from flowmaker.bench.selector_hard_run import summarize


def summary(rows: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """The bench's own summary of these rows, with the unproven instances named."""
    return {**summarize(rows, budget),
            "unproven_instances": [(r["family"], r["seed"], r["gap"]) for r in rows if not r["optimal"]]}


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
        print(f"| {name} | {s['instances']} | {s['proven_within_1s']} ({100 * s['share_proven_1s']:.1f}%) | "
              f"{s['proven_within_2s']} | {s['unproven']} | {pct(s['unproven_gap_median'])} | "
              f"{pct(s['unproven_gap_max'])} | {s['no_answer']} | {s['over_budget']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
