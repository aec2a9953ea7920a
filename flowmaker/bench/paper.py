"""`flowmaker bench paper`: the published comparison on the declared experiment, with seed spread and
sensitivity rows, in one command.

It runs `bench serving` for every seed the experiment declares (`[seeds] spread`) under the default GPU
sharing of the simulator, then the sensitivity runs (each sharing mode; the baselines on each task's
single-stage workflow; LangChain deployed as published under a sustained load; `SENSITIVITY`) on the same seeds,
and prints: the published comparisons with our figure (mean of the per-seed averages, the per-seed spread, all
cells' min-max) beside the published one and how far apart they are; the same comparisons under each sensitivity
setting; the default's comparisons on each trace alone; and, per cell and seed, FlowMaker's goodput against
the best other policy (its own ablations included). Every result carries the experiment file's SHA-256.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flowmaker.bench.serving import PUBLISHED, run_serving_bench
from flowmaker.eval.experiment import Experiment, load_experiment, variant

SUSTAINED_LABEL = "published LangChain deployment, sustained x4"
# The sensitivity settings: (label, run_serving_bench keyword arguments); "experiment" entries are functions of
# the declared experiment (a variant of it, recorded under its own name and hash).
SENSITIVITY: tuple[tuple[str, dict[str, Any]], ...] = (
    ("colocation ignore", {"colocation": "ignore"}),
    ("colocation worst-case", {"colocation": "worst-case"}),
    ("single-stage baselines", {"baseline_workflow": "single-stage"}),
    ("sharing-blind Murakkab", {"baseline_sharing": False}),
    ("product accuracy targets", {"experiment": "product-targets"}),
    ("loads x4", {"loads": "x4"}),
    ("no burst headroom", {"burst_headroom": False}),
    ("loads x4 max-2-GPU instances", {"loads": "x4", "max_instance_gpus": 2}),
    # Generated tokens x 4 (flowmaker.eval.experiment.PUBLISHED_LATENCY_GENERATED_SCALE): the longest standalone
    # latencies and the loosest SLO at the published scale (111 s and 508 s; published 119 s and 510 s).
    ("published latency scale", {"experiment": "published-latency-scale"}),
    # LangChain deployed as published and overloaded long enough for its queues to form: the tasks' own accuracy
    # targets give it the published deployment (15 instances, one per LLM stage, 4 on one GPU; the declared targets
    # give 13 and one task unplaced), at four times the load over a segment five times as long (1,312-1,853 scored
    # requests, so outside the declared 150-600). Only the policies the LangChain comparison needs, to keep it short.
    (SUSTAINED_LABEL, {"experiment": "product-targets", "loads": "x4", "segment_requests": 2400,
                       "policies": ("flowmaker", "flowmaker-noreuse", "langchain")}),
)


DOMINANCE_TOLERANCE = 0.02  # issue 18: FlowMaker within 0.02 of the best other policy in every cell
GOODPUT_TARGET = 0.90


def _pub_text(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    rng = "" if p.get("min") is None else f"{p['min']}-{p['max']}"
    avg = "" if p.get("avg") is None else f" avg {p['avg']}"
    return (rng + avg).strip() or "-"


def off_by(ours: float, p: dict[str, Any] | None) -> float | None:
    """How many times apart ours and the published figure are (>= 1; None without a published number): against
    its average when it gives one, else against its range (1.0 inside it)."""
    if not p or not math.isfinite(ours) or ours <= 0:
        return None
    if p.get("avg") is not None and p["avg"] > 0:
        return max(ours / p["avg"], p["avg"] / ours)
    lo, hi = p.get("min"), p.get("max")
    if lo is None or hi is None or lo <= 0:
        return None
    if lo <= ours <= hi:
        return 1.0
    return lo / ours if ours < lo else ours / hi


def summarize_ratios(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per comparison over several seeds' reports: the mean and spread of the per-seed averages, all cells' range."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(n for r in reports for n in r["ratios"]):
        avgs = [r["ratios"][name]["ours"]["avg"] for r in reports if name in r["ratios"]]
        avgs = [a for a in avgs if a is not None and math.isfinite(a)]
        cells = [c["value"] for r in reports if name in r["ratios"] for c in r["ratios"][name]["cells"]]
        cells = [c for c in cells if c is not None and math.isfinite(c)]
        if not avgs:
            continue
        mean = statistics.fmean(avgs)
        # The same statistic on each trace alone (its cells only): the two traces differ in burstiness (code's
        # inter-arrival CV is 13, conv's 1.1), and several deviations from the published figures are one trace's.
        by_trace: dict[str, float] = {}
        for tr in sorted({c["trace"] for r in reports if name in r["ratios"] for c in r["ratios"][name]["cells"]}):
            per_seed = []
            for r in reports:
                vs = [c["value"] for c in r["ratios"].get(name, {}).get("cells", [])
                      if c["trace"] == tr and c["value"] is not None and math.isfinite(c["value"])]
                if vs:
                    per_seed.append(statistics.fmean(vs))
            if per_seed:
                by_trace[tr] = statistics.fmean(per_seed)
        out[name] = {"mean_of_seed_avgs": mean, "by_trace": by_trace, "seed_avg_min": min(avgs), "seed_avg_max": max(avgs),
                     "seed_avg_stdev": statistics.pstdev(avgs) if len(avgs) > 1 else 0.0,
                     "cell_min": min(cells), "cell_max": max(cells), "seeds": len(avgs),
                     "published": PUBLISHED.get(name), "off_by": off_by(mean, PUBLISHED.get(name))}
    return out


def dominance(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per seed and cell: FlowMaker's goodput and cost, the best other policy's goodput, the no-reuse ablation's
    cost (reuse must never cost more)."""
    rows = []
    for rep in reports:
        seed = rep["setup"]["seed"]
        cells: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
        for r in rep["rows"]:
            cells.setdefault((r["trace"], r["load"]), {})[r["policy"]] = r
        for (tr, ld), c in sorted(cells.items()):
            fm = c.get("flowmaker")
            if fm is None:
                continue
            others = [(v["goodput"], p) for p, v in c.items() if p != "flowmaker"]
            best_g, best_p = max(others) if others else (math.nan, "-")
            nr = c.get("flowmaker-noreuse")
            rows.append({"seed": seed, "trace": tr, "load": ld, "flowmaker": fm["goodput"], "best_other": best_g,
                         "best_policy": best_p, "gap": fm["goodput"] - best_g,
                         "within": fm["goodput"] >= best_g - DOMINANCE_TOLERANCE,
                         "unplaced": fm["unplaced_count"], "cost": fm["cost_usd"],
                         "noreuse_cost": nr["cost_usd"] if nr else None,
                         "reuse_not_dearer": nr is None or fm["cost_usd"] <= nr["cost_usd"] * (1 + 1e-9)})
    return rows


def run_paper_bench(out_dir: str | Path, traces_dir: str | Path | None = None,
                    experiment: Experiment | None = None, seeds: Sequence[int] | None = None,
                    sensitivity: bool = True, console: Console | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    exp = experiment or load_experiment()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    con = console or Console(width=220)
    sd = list(seeds) if seeds else list(exp.seeds)
    settings: list[tuple[str, dict[str, Any]]] = [("default", {})] + (list(SENSITIVITY) if sensitivity else [])
    runs: dict[str, list[dict[str, Any]]] = {}
    for label, kw in settings:
        runs[label] = []
        args = dict(kw)
        e = variant(exp, args.pop("experiment")) if "experiment" in args else exp
        if args.get("loads") == "x4":
            args["loads"] = [4 * x for x in exp.loads]
        for s in sd:
            con.print(f"[dim]{label}: seed {s} ...[/dim]")
            folder = out / re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-") / f"seed-{s}"
            runs[label].append(run_serving_bench(folder, traces_dir=traces_dir, seed=s, experiment=e, plots=False,
                                                 quiet=True, console=con, **args))
    summary = {label: summarize_ratios(reps) for label, reps in runs.items()}
    dom = {label: dominance(reps) for label, reps in runs.items() if label.startswith(("default", "colocation"))}
    report = {"experiment": {"name": exp.name, "sha256": exp.sha256, "source": exp.source},
              "seeds": sd, "traces": {k: v for k, v in runs["default"][0]["setup"]["trace_sources"].items()},
              "comparisons": summary, "dominance": dom,
              "requests_per_run": sorted({g["scored_requests"] for r in runs["default"]
                                          for g in r["setup"]["segments"]}),
              "sensitivity_requests_per_run": {label: sorted({g["scored_requests"] for r in reps
                                                              for g in r["setup"]["segments"]})
                                               for label, reps in runs.items() if label != "default"},
              "runs": {label: [r["json"] for r in reps] for label, reps in runs.items()},
              "wall_s": time.perf_counter() - t0}
    jf = out / "paper.json"
    jf.write_text(json.dumps(report, indent=1, default=str))
    report["json"] = str(jf)
    print_paper(con, report)
    return report


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def print_paper(con: Console, report: dict[str, Any]) -> None:
    e = report["experiment"]
    sd = report["seeds"]
    summ = report["comparisons"]
    labels = [k for k in summ if k != "default"]
    t = Table(title=f"The published comparison on experiment {e['name']} (sha256 {e['sha256'][:12]}), seeds "
                    f"{','.join(map(str, sd))}: ours = mean of the per-seed averages [per-seed range] (all cells)")
    t.add_column("comparison", no_wrap=True)
    t.add_column("ours", justify="right")
    t.add_column("seed spread", justify="right")
    t.add_column("cells", justify="right")
    t.add_column("published")
    t.add_column("x apart", justify="right")
    for lb in labels:
        t.add_column(lb, justify="right")
    for name, d in summ["default"].items():
        if d["published"] is None and not name.startswith(("vs_", "reuse_", "noreuse_", "flowmaker_goodput")):
            continue
        ob = d["off_by"]
        flag = "" if ob is None or ob <= 1.5 else " !"
        t.add_row(name, _f(d["mean_of_seed_avgs"]), f"{_f(d['seed_avg_min'])}-{_f(d['seed_avg_max'])}",
                  f"{_f(d['cell_min'])}-{_f(d['cell_max'])}", _pub_text(d["published"]), _f(ob) + flag,
                  *(_f(summ[lb].get(name, {}).get("mean_of_seed_avgs")) for lb in labels))
    con.print(t)
    traces = sorted({tr for d in summ["default"].values() for tr in d.get("by_trace", {})})
    tt = Table(title="The same comparisons on each trace alone (default; mean of the per-seed averages over that "
                     "trace's cells)")
    tt.add_column("comparison", no_wrap=True)
    tt.add_column("published")
    for tr in traces:
        tt.add_column(tr, justify="right")
        tt.add_column("x apart", justify="right")
    for name, d in summ["default"].items():
        if d["published"] is None:
            continue
        cols = []
        for tr in traces:
            v = d.get("by_trace", {}).get(tr)
            ob = off_by(v, d["published"]) if v is not None else None
            cols += [_f(v), _f(ob) + ("" if ob is None or ob <= 1.5 else " !")]
        tt.add_row(name, _pub_text(d["published"]), *cols)
    con.print(tt)
    for label, rows in report["dominance"].items():
        dt = Table(title=f"FlowMaker vs the best other policy per cell ({label}): goodput, gap; "
                         f"ok = within {DOMINANCE_TOLERANCE}")
        dt.add_column("seed")
        cells = sorted({(r["trace"], r["load"]) for r in rows})
        for tr, ld in cells:
            dt.add_column(f"{tr} {ld:.0%}", justify="right")
        for s in sd:
            by = {(r["trace"], r["load"]): r for r in rows if r["seed"] == s}
            dt.add_row(str(s), *(f"{by[c]['flowmaker']:.3f} {by[c]['gap']:+.3f}"
                                 + ("" if by[c]["within"] else " X") + ("" if by[c]["reuse_not_dearer"] else " $")
                                 for c in cells))
        n_ok = sum(r["within"] for r in rows)
        n_target = sum(r["flowmaker"] >= GOODPUT_TARGET for r in rows)
        n_cost = sum(r["reuse_not_dearer"] for r in rows)
        con.print(dt)
        con.print(f"{label}: within {DOMINANCE_TOLERANCE} of the best other policy in {n_ok}/{len(rows)} cells; "
                  f"goodput >= {GOODPUT_TARGET} in {n_target}/{len(rows)}; reuse no dearer than no reuse in "
                  f"{n_cost}/{len(rows)} (X: behind, $: dearer)")
    longer = {lb: f"{min(v)}-{max(v)}" for lb, v in report["sensitivity_requests_per_run"].items()
              if v and (min(v) < min(report["requests_per_run"]) or max(v) > max(report["requests_per_run"]))}
    if longer:
        con.print("sensitivity runs outside the declared run size (scored requests): "
                  + "; ".join(f"{lb} {r}" for lb, r in longer.items()))
    con.print(f"scored requests per run: {report['requests_per_run']}; experiment {e['source']} sha256 {e['sha256']}; "
              f"wall {report['wall_s']:.0f}s; JSON {report['json']}")
