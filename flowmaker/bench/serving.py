"""`flowmaker bench serving`: both Azure traces x 4 load levels x every policy on a simulated 8xA6000 cluster.

Every policy plans with the same models, analytic profiles and empty cluster, and the
same simulator serves the same arrivals with each plan; see docs/evaluation.md. Per trace
and load level: a contiguous trace segment replayed with one time-scale factor, tasks deployed
at staggered times, latency SLOs by rule (`flowmaker.eval.slo`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.domain import Cluster, GpuType, Model, Profile, StageKind, default_gpu_price
from flowmaker.domain.selection import MAX_GPU_PRICE_GB
from flowmaker.errors import InvalidSpec
from flowmaker.eval.bound import goodput_upper_bound
from flowmaker.eval.experiment import Experiment, load_experiment
from flowmaker.eval.policies import (
    ALL_POLICIES,
    LANGCHAIN_MODEL_RULES,
    ROUTELLM_SIZE_STAT,
    ROUTELLM_STRONG,
    ROUTELLM_STRONG_SHARE,
    ROUTELLM_WEAK,
    PolicyContext,
    get_policy,
    langchain_model,
    plan,
    simulated_monitor,
)
from flowmaker.eval.tasks import EVAL_TASKS, NOMINAL_STATS, EvalTask
from flowmaker.eval.trace_stats import TRACE_KINDS
from flowmaker.eval.traces import build_request_segment_workload, find_trace, get_trace
from flowmaker.profiling.analytic import profiles_for
from flowmaker.sharing import validate_interference
from flowmaker.sim import COLOCATION_MODES, DEFAULT_COLOCATION, DEFAULT_KV_TOKENS, simulate

GPU_TYPE = "A6000"
GPUS_PER_NODE = 8

# The published comparison (the seed paper), as (min, max, avg) where it gives them; None where it gives no
# number (the comparison is still reported, with "-" beside it).
PUBLISHED: dict[str, dict[str, Any]] = {
    "noreuse_vs_murakkab_high_load_cost": {"min": 1.24, "max": 1.95, "avg": None},
    "routellm_max_quality_accuracy_hit": {"min": 1.0, "max": 1.0, "avg": None},  # "met every accuracy target"
    "langchain_instances": {"min": 15, "max": 15, "avg": None},  # 15 instances for 6 tasks
    "langchain_colocated_mean_latency_s": {"min": None, "max": None, "avg": 426.0},  # 4 instances on one GPU
    "vs_langchain_goodput": {"min": 1.13, "max": 12.84, "avg": 5.2},
    "vs_langchain_cost": {"min": 2.2, "max": 4.0, "avg": 2.93},
    "vs_routellm_max_quality_cost": {"min": 2.06, "max": 3.84, "avg": None},
    "vs_routellm_max_quality_goodput_drop_pct": {"min": None, "max": None, "avg": 5.8},
    # the same published figure as a ratio: FlowMaker's goodput 5.8% below RouteLLM max-quality's, 1 - 0.058
    "vs_routellm_max_quality_goodput": {"min": None, "max": None, "avg": 0.942},
    "vs_murakkab_high_load_goodput": {"min": 1.45, "max": 10.14, "avg": 4.73},
    "vs_murakkab_high_load_cost": {"min": 1.56, "max": 2.77, "avg": 1.95},
    "reuse_vs_noreuse_low_load_cost": {"min": 1.47, "max": 1.73, "avg": None},
}
HIGH_LOADS = (0.75, 1.0)
LOW_LOADS = (0.25, 0.5)


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return math.inf if a > 0 else math.nan
    return a / b


def _summ(vals: Sequence[float]) -> dict[str, Any]:
    fin = [v for v in vals if math.isfinite(v)]
    return {"min": min(fin) if fin else None, "max": max(fin) if fin else None,
            "avg": sum(fin) / len(fin) if fin else None, "n": len(vals), "n_infinite": sum(1 for v in vals
                                                                                          if math.isinf(v))}


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def compute_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The published comparisons, from our rows: per (trace, load) values and their min/max/avg."""
    by = {(r["trace"], r["load"], r["policy"]): r for r in rows}
    cells = sorted({(r["trace"], r["load"]) for r in rows})
    out: dict[str, Any] = {}
    # "Low" and "high" load: the lower and the upper half of the run's load levels (25-50% and 75-100% by
    # default; 1-2x and 3-4x in a run at four times the load).
    lv = sorted({r["load"] for r in rows})
    low_loads, high_loads = (tuple(lv[:len(lv) // 2]), tuple(lv[len(lv) // 2:])) if len(lv) > 1 else (LOW_LOADS,
                                                                                                    HIGH_LOADS)

    def series(name: str, base: str, metric: str, loads: Sequence[float] | None = None,
               ours: str = "flowmaker") -> None:
        vals, per = [], []
        for tr, ld in cells:
            if loads is not None and ld not in loads:
                continue
            a, b = by.get((tr, ld, ours)), by.get((tr, ld, base))
            if a is None or b is None:
                continue
            if metric == "goodput":
                v = _ratio(a["goodput"], b["goodput"])
            elif metric == "cost":
                v = _ratio(b["cost_usd"], a["cost_usd"])  # how many times cheaper we are
            else:  # goodput drop, percent of the baseline's goodput
                v = 100.0 * (b["goodput"] - a["goodput"]) / b["goodput"] if b["goodput"] else math.nan
            vals.append(v)
            per.append({"trace": tr, "load": ld, "value": v})
        if per:
            out[name] = {"ours": _summ(vals), "published": PUBLISHED.get(name), "cells": per}

    def absolute(name: str, pol: str, key: str) -> None:
        vals, per = [], []
        for tr, ld in cells:
            r = by.get((tr, ld, pol))
            if r is None:
                continue
            vals.append(float(r[key]))
            per.append({"trace": tr, "load": ld, "value": float(r[key])})
        if per:
            out[name] = {"ours": _summ(vals), "published": PUBLISHED.get(name), "cells": per}

    series("vs_langchain_goodput", "langchain", "goodput")
    series("vs_langchain_cost", "langchain", "cost")
    series("vs_routellm_max_quality_cost", "routellm-max-quality", "cost")
    series("vs_routellm_max_quality_goodput_drop_pct", "routellm-max-quality", "drop")
    series("vs_murakkab_high_load_goodput", "murakkab", "goodput", high_loads)
    series("vs_murakkab_high_load_cost", "murakkab", "cost", high_loads)
    series("vs_murakkab_maxload_high_load_goodput", "murakkab-maxload", "goodput", high_loads)
    series("vs_murakkab_maxload_high_load_cost", "murakkab-maxload", "cost", high_loads)
    series("vs_murakkab_low_load_goodput", "murakkab", "goodput", low_loads)
    series("vs_murakkab_low_load_cost", "murakkab", "cost", low_loads)
    series("noreuse_vs_murakkab_high_load_goodput", "murakkab", "goodput", high_loads, ours="flowmaker-noreuse")
    series("noreuse_vs_murakkab_high_load_cost", "murakkab", "cost", high_loads, ours="flowmaker-noreuse")
    series("noreuse_vs_murakkab_low_load_cost", "murakkab", "cost", low_loads, ours="flowmaker-noreuse")
    series("noreuse_vs_murakkab_noreuse_high_load_cost", "murakkab-noreuse", "cost", high_loads,
           ours="flowmaker-noreuse")
    series("reuse_vs_noreuse_low_load_cost", "flowmaker-noreuse", "cost", low_loads)
    series("reuse_vs_noreuse_low_load_goodput", "flowmaker-noreuse", "goodput", low_loads)
    for setting in ROUTELLM_STRONG_SHARE:
        pol = f"routellm-{setting}"
        series(f"vs_routellm_{setting.replace('-', '_')}_goodput", pol, "goodput")
        if setting != "max-quality":
            series(f"vs_routellm_{setting.replace('-', '_')}_cost", pol, "cost")
        absolute(f"routellm_{setting.replace('-', '_')}_goodput", pol, "goodput")
        absolute(f"routellm_{setting.replace('-', '_')}_accuracy_hit", pol, "accuracy_hit_rate")
    absolute("flowmaker_goodput", "flowmaker", "goodput")
    absolute("flowmaker_accuracy_hit", "flowmaker", "accuracy_hit_rate")
    absolute("langchain_instances", "langchain", "instances")
    absolute("langchain_placement_failures", "langchain", "placement_failure_count")
    absolute("langchain_unplaced_tasks", "langchain", "unplaced_count")
    absolute("langchain_colocated_mean_latency_s", "langchain", "mean_latency_s")
    series("exact_vs_heuristic_goodput", "flowmaker-heuristic", "goodput")
    series("exact_vs_heuristic_cost", "flowmaker-heuristic", "cost")
    return out


def _plots(rows: Sequence[dict[str, Any]], out_dir: Path, policies: Sequence[str]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    traces = sorted({r["trace"] for r in rows})
    for metric, label in (("goodput", "goodput (share of requests meeting both SLOs)"), ("cost_usd", "cost (USD)"),
                          ("gb_reserved", "GB reserved"), ("accuracy_hit_rate", "accuracy-SLO hit rate")):
        fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2), squeeze=False)
        for ax, tr in zip(axes[0], traces, strict=True):
            for pol in policies:
                pts = sorted((r["load"], r[metric]) for r in rows if r["trace"] == tr and r["policy"] == pol)
                if pts:
                    ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="o", label=pol,
                            linewidth=2.5 if pol == "flowmaker" else 1.2)
            ax.set_title(f"{tr} trace")
            ax.set_xlabel("load (% of nominal rate)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        short = {"goodput": "goodput", "cost_usd": "cost", "gb_reserved": "gb", "accuracy_hit_rate": "accuracy"}[metric]
        f = out_dir / f"serving_{short}.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(str(f))
    return files


def code_version() -> dict[str, Any]:
    """The git commit the bench ran from and which tracked files differed from it (best effort)."""
    import subprocess
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--name-only", "HEAD"], cwd=root, capture_output=True, text=True,
                               timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": []}
    return {"commit": head, "modified": dirty}


def bench_cluster(gpu_type: str = GPU_TYPE, gpus: int = GPUS_PER_NODE
                  ) -> tuple[tuple[Model, ...], GpuType, tuple[Profile, ...], Cluster, dict[str, Model]]:
    """The simulated cluster every serving benchmark runs on: the catalog's models, the GPU type, their analytic
    profiles on one node of `gpus` x `gpu_type`, the empty cluster, and the models by id."""
    models = default_models()
    gpu = get_gpu_type(gpu_type)
    profiles = profiles_for(models, gpu, max_gpus=gpus)
    return (models, gpu, profiles, make_cluster(gpu_type, nodes=1, gpus_per_node=gpus), {m.id: m for m in models})


BASELINE_WORKFLOWS = ("fixed", "single-stage")


def single_stage_baselines(tasks: Sequence[EvalTask]) -> tuple[EvalTask, ...]:
    """The tasks with the baselines' fixed workflow replaced by the candidate with the fewest LLM stages (ties:
    the first listed): how much of FlowMaker's gain is workflow choice by construction."""
    out = []
    for t in tasks:
        best = min(t.candidates, key=lambda c: sum(1 for s in c.stages if s.kind is StageKind.LLM))
        out.append(dataclasses.replace(t, fixed_workflow=best.id,
                                       fixed_rationale="sensitivity: the task's single-stage candidate"))
    return tuple(out)


def run_serving_bench(out_dir: str | Path, traces_dir: str | Path | None = None, seed: int = 0,
                      policies: Sequence[str] | None = None, loads: Sequence[float] | None = None,
                      traces: Sequence[str] = TRACE_KINDS, console: Console | None = None,
                      plots: bool = True, plan_tokens: str = "median", colocation: str = DEFAULT_COLOCATION,
                      langchain_rule: str = "smallest", experiment: Experiment | None = None,
                      segment_requests: int | None = None, baseline_workflow: str = "fixed",
                      baseline_sharing: bool = True, quiet: bool = False,
                      burst_headroom: bool = True, max_instance_gpus: int = 0,
                      gpu_price_gb: float = 0.0, colocation_kappa: float = 1.0) -> dict[str, Any]:
    """Run the matrix, write `serving.json` (+ PNG plots) into `out_dir`, print the tables; return the report.

    `experiment`: the declared experiment (default: `flowmaker/eval/data/paper-scale.toml`): tasks' accuracy
    targets, SLO rule, rates, the replayed segment's size, baseline sizing. `traces_dir` holds
    AzureLLMInferenceTrace_{code,conv}.csv; a missing file is replaced by the synthetic trace of that kind
    (the report says which was used). `plan_tokens`: the request every selector-based policy sizes stages
    with ("median" or "mean"). `colocation`: how instances sharing a GPU share it in the scored simulation
    (`flowmaker.sim.COLOCATION_MODES`, default "dynamic"). `segment_requests` overrides the experiment's
    segment size (tests). `baseline_workflow`: "fixed" (the declared fixed workflows) or "single-stage" (a
    sensitivity run). `baseline_sharing`: Murakkab plans under FlowMaker's GPU-sharing contract (the
    declared setting) or sharing-blind (a sensitivity run). `burst_headroom`: FlowMaker's policies plan for the
    bursts seen before each deploy (default) or at the measured rate (the published system; sensitivity).
    `max_instance_gpus`: the selector-based policies choose configurations of at most this many GPUs (0: any;
    a sensitivity). `gpu_price_gb`: the selector-based policies price each GPU a new instance spans at this many
    GB (docs/selection-spec.md, priced GPUs; 0: memory only, negative: one GPU's memory; a sensitivity).
    `colocation_kappa`: how much a busy co-resident slows an instance in the simulation (`flowmaker.sim.simulate`;
    1: time sharing); the selector-based policies plan with the same kappa, as they would once the profiler has
    measured it (`flowmaker profiles measure-interference`). A sensitivity.
    `langchain_rule`: how the LangChain baseline picks its model (`LANGCHAIN_MODEL_RULES`).
    Every setup choice is recorded in the JSON's "setup", with the experiment file's SHA-256.
    """
    t_start = time.perf_counter()
    exp = experiment or load_experiment()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pols = list(policies) if policies else list(ALL_POLICIES)
    for p in pols:
        get_policy(p)  # unknown name -> NotFound before any work
    lvls = list(loads) if loads else list(exp.loads)
    if plan_tokens not in NOMINAL_STATS:
        raise InvalidSpec(f"unknown statistic {plan_tokens!r}; known: {list(NOMINAL_STATS)}", field="plan_tokens")
    if colocation not in COLOCATION_MODES:
        raise InvalidSpec(f"unknown colocation mode {colocation!r}; known: {list(COLOCATION_MODES)}",
                          field="colocation")
    if langchain_rule not in LANGCHAIN_MODEL_RULES:
        raise InvalidSpec(f"unknown LangChain model rule {langchain_rule!r}; known: {list(LANGCHAIN_MODEL_RULES)}",
                          field="langchain_rule")
    if baseline_workflow not in BASELINE_WORKFLOWS:
        raise InvalidSpec(f"unknown baseline workflow {baseline_workflow!r}; known: {list(BASELINE_WORKFLOWS)}",
                          field="baseline_workflow")
    validate_interference(colocation_kappa, "colocation_kappa")
    if colocation == "ignore" and colocation_kappa != 1.0:
        raise InvalidSpec("has no effect under colocation 'ignore' (instances never slow each other there)",
                          field="colocation_kappa")
    if max_instance_gpus < 0:
        raise InvalidSpec(f"must be >= 0 (0: any), got {max_instance_gpus}", field="max_instance_gpus")
    if not -1.0 <= gpu_price_gb <= MAX_GPU_PRICE_GB:
        raise InvalidSpec(f"must be within [-1, {MAX_GPU_PRICE_GB:g}] (negative: one GPU's memory), got {gpu_price_gb}",
                          field="gpu_price_gb")
    n_req = exp.segment_requests if segment_requests is None else segment_requests
    if n_req < 1:
        raise InvalidSpec(f"must be >= 1, got {n_req}", field="segment_requests")
    con = console or Console(width=200)
    models, gpu, profiles, cluster, by_id = bench_cluster(exp.gpu_type, exp.gpus)
    gpu_price_gb = default_gpu_price(gpu_price_gb, cluster)
    rows: list[dict[str, Any]] = []
    ablation: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    segments: list[dict[str, Any]] = []
    slos: dict[str, Any] = {}
    t_plan = t_sim = 0.0
    for kind in traces:
        trace = get_trace(kind, traces_dir, seed)
        sources[kind] = trace.source if find_trace(kind, traces_dir) else f"{trace.source} (no file in {traces_dir})"
        tasks = exp.tasks_for(kind, profiles, by_id, gpu)
        if baseline_workflow == "single-stage":
            tasks = single_stage_baselines(tasks)
        ref_ctx, ref_gen = exp.reference_tokens(kind)
        slos[kind] = [{"task": t.name, "k": t.slo_k, "standalone_s": t.max_latency_s / t.slo_k,
                       "latency_slo_s": t.max_latency_s, "accuracy_slo": t.min_accuracy,
                       "rate_100_rps": t.nominal_rate_rps, "fixed_workflow": t.fixed.id,
                       "reference_request": [ref_ctx, ref_gen]} for t in tasks]
        for load in lvls:
            rates = [(t.name, t.nominal_rate_rps * load) for t in tasks]
            wl = build_request_segment_workload(rates, trace, load, seed, n_req, exp.deploy_span_fraction,
                                                exp.monitor_window_fraction)
            segments.append({"trace": kind, "load": load, "offset_s": wl.offset_s, "segment_s": wl.segment_s,
                             "scale": wl.scale, "replay_s": wl.duration_s, "segment_requests": wl.segment_requests,
                             "segment_rate_rps": wl.segment_rate_rps, "scored_requests": len(wl.arrivals),
                             "monitor_window_s": wl.window_s,
                             "deploy_s": [list(d) for d in wl.deploy_s],
                             "task_rates": [{"task": t.name, "target": r, "mean": wl.mean_rate(t.name),
                                             "peak_window": wl.peak_rate(t.name),
                                             "offline": wl.offline_rate(t.name),
                                             "offline_peak": wl.offline_peak_rate(t.name)}
                                            for t, (_, r) in zip(tasks, rates, strict=True)]})
            # What no plan can beat (flowmaker.eval.bound); it relies on GPUs splitting their time (speeds on a GPU
            # summing to at most 1), which "ignore" does not model, nor a kappa below 1.
            no_bound = colocation == "ignore" or colocation_kappa < 1.0
            segments[-1]["goodput_upper_bound"] = None if no_bound else goodput_upper_bound(
                wl.arrivals, tasks, models, profiles, cluster.gpus, DEFAULT_KV_TOKENS).as_json()
            monitor = simulated_monitor(wl, cluster.gpus, by_id, gpu, colocation, colocation_kappa)
            ctx = PolicyContext(tasks, kind, load, models, profiles, cluster, gpu, seed=seed, monitor=monitor,
                                plan_tokens=plan_tokens, workload=wl, langchain_model=langchain_rule,
                                utilization_cap=exp.utilization_cap, baseline_sharing=baseline_sharing,
                                burst_headroom=burst_headroom, max_instance_gpus=max_instance_gpus,
                                gpu_price_gb=gpu_price_gb, interference=colocation_kappa,
                                routellm_rate="declared", routellm_gpu_budget_gb=exp.routellm_gpu_budget_gb)
            for pol in pols:
                t0 = time.perf_counter()
                pl = plan(pol, ctx)
                t1 = time.perf_counter()
                res = simulate(pl.instances, pl.deployments, wl.arrivals, cluster.gpus, by_id, gpu,
                               unplaced=dict(pl.unplaced), duration_s=wl.duration_s, colocation=colocation,
                               colocation_kappa=colocation_kappa)
                t2 = time.perf_counter()
                t_plan += t1 - t0
                t_sim += t2 - t1
                planned = dict(pl.planned_loads)
                seen = {m.id: m for m in res.per_instance}
                met_acc = sum(m.met_accuracy for m in res.per_task)
                rows.append({
                    "trace": kind, "load": load, "policy": pol, **res.summary(),
                    "accuracy_hit_rate": met_acc / res.requests if res.requests else math.nan,
                    "gb_seconds": res.gb_seconds, "speed_changes": res.speed_changes,
                    "unplaced": [list(u) for u in res.unplaced], "unplaced_count": len(res.unplaced),
                    "placement_failures": [list(f) for f in pl.placement_failures],
                    "placement_failure_count": len(pl.placement_failures),
                    "planning_s": pl.planning_s, "sim_s": t2 - t1, "notes": pl.notes,
                    "planned_rates": [list(r) for r in pl.planned_rates], "best_effort": list(pl.best_effort),
                    "instance_list": [{"id": i.id, "model": i.profile.model_id, "tp": i.profile.tp,
                                       "pp": i.profile.pp, "gpus": list(i.gpu_ids), "gb": i.memory_gb,
                                       "deployed_by": i.deployed_by, "deployed_at_s": i.start_s,
                                       "capacity_tokens_per_s": i.profile.max_output_tokens_per_s,
                                       "planned_load_tokens_per_s": planned.get(i.id),
                                       "measured_output_tokens_per_s": seen[i.id].output_tokens_per_s,
                                       "measured_busy_equiv_tokens_per_s": seen[i.id].busy_equiv_tokens_per_s,
                                       "measured_utilization": seen[i.id].utilization,
                                       "busy_fraction": seen[i.id].busy_fraction,
                                       "residence_s": seen[i.id].residence_s, "cost_usd": seen[i.id].cost_usd}
                                      for i in pl.instances],
                    "per_task": [{"task": m.task, "requests": m.requests, "goodput": m.goodput,
                                  "met_accuracy": m.met_accuracy, "met_latency": m.met_latency,
                                  "mean_latency_s": m.mean_latency_s, "p99_latency_s": m.p99_latency_s}
                                 for m in res.per_task],
                })
                ablation.append({"trace": kind, "load": load, "policy": pol,
                                 "instances_deployed": len(pl.instances),
                                 "stages_on_reused_instances": sum(1 for d in pl.decisions if d.reused),
                                 "stages": len(pl.decisions),
                                 "decisions": [{"task": d.task, "workflow": d.workflow_id, "stage": d.stage_id,
                                                "instance": d.instance_id, "model": d.model_id, "tp": d.tp,
                                                "pp": d.pp, "reused": d.reused}
                                               for d in pl.decisions]})
    ratios = compute_ratios(rows)
    files = _plots(rows, out, pols) if plots else []
    wall = time.perf_counter() - t_start
    report = {"setup": {
        "gpu_type": GPU_TYPE, "gpus": len(cluster.gpus), "models": [m.id for m in models],
        "profiles": len(profiles), "loads": lvls, "policies": pols, "seed": seed, "trace_sources": sources,
        "code_version": code_version(),
        "seeds": {"run": seed,
                  "segment_start": f"random.Random('flowmaker-request-segment/<trace>/{seed}').randint (every load)",
                  "task_of_request": f"random.Random('flowmaker-assign/<trace>/{seed}/<i>') (every load)",
                  "router_score": f"blake2b('{seed}/<request id>')",
                  "synthetic_trace": f"random.Random('flowmaker-trace/<trace>/{seed}') (only without the files)"},
        "experiment": {"name": exp.name, "sha256": exp.sha256, "source": exp.source, "settings": exp.as_json()},
        "plan_tokens": plan_tokens, "colocation": colocation, "colocation_kappa": colocation_kappa,
        "utilization_cap": exp.utilization_cap,
        "segment_requests": n_req, "baseline_workflow": baseline_workflow, "baseline_sharing": baseline_sharing,
        "burst_headroom": burst_headroom, "max_instance_gpus": max_instance_gpus, "gpu_price_gb": gpu_price_gb,
        "monitor_window_fraction": exp.monitor_window_fraction,
        "deploy_span_fraction": exp.deploy_span_fraction, "segments": segments,
        "slo_reference_deployment": {"model": exp.reference_model, "tp": exp.reference_tp, "pp": 1,
                                     "workflow": "each task's fixed workflow, one instance per LLM stage",
                                     "request": f"the trace's {exp.reference_quantile} request shape, alone"},
        "slos": slos,
        "tasks": [{"task": t.name, "fixed_workflow": t.fixed.id, "fixed_rationale": t.fixed_rationale,
                   "slo_k": exp.slo_k[t.name], "slo_k_rationale": t.slo_k_rationale,
                   "accuracy_slo": exp.accuracy[t.name],
                   "langchain_model": langchain_model(dataclasses.replace(t, min_accuracy=exp.accuracy[t.name]),
                                                      models, langchain_rule)} for t in EVAL_TASKS],
        "langchain_rule": langchain_rule,
        "routellm": {"strong": ROUTELLM_STRONG, "weak": ROUTELLM_WEAK, "strong_share": ROUTELLM_STRONG_SHARE,
                     "size_request": ROUTELLM_SIZE_STAT, "dispatch": "least outstanding work",
                     "size_rate": "the declared rate (load x 100% rate)",
                     "gpu_budget_gb": exp.routellm_gpu_budget_gb,
                     "tp": "smallest with which a lone request of every task meets its latency SLO"},
        "murakkab": {"rate": "per task, its rate over the stretch of the trace just before the segment",
                     "maxload_rate": "that stretch's peak monitor-window rate",
                     "gpu_sharing": "the same contract as FlowMaker's" if baseline_sharing else "ignored"},
        "flowmaker": {"rate": "arrivals in the trace minute before its deploy",
                      "current_load": "simulated serving of the deployed tasks over the trace minute before"}},
              "rows": rows, "ratios": ratios, "reuse_ablation": ablation, "plots": files,
              "timing": {"wall_s": wall, "planning_s": t_plan, "simulation_s": t_sim}}
    jf = out / "serving.json"
    jf.write_text(json.dumps(_json_safe(report), indent=1))
    report["json"] = str(jf)
    if not quiet:
        _print(con, rows, ratios, ablation, report)
    return report


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec)



def add_cell_rows(t: Table, rows: Sequence[dict[str, Any]], rest: Callable[[dict[str, Any]], Sequence[str]]) -> None:
    """One row per (trace, load, policy) result, a section per (trace, load) cell: trace, load, policy, requests
    and goodput, then `rest(row)`."""
    last = None
    for r in rows:
        cell = (r["trace"], r["load"])
        if last is not None and cell != last:
            t.add_section()
        last = cell
        t.add_row(r["trace"], f"{r['load']:.0%}", r["policy"], str(r["requests"]), f"{r['goodput']:.3f}", *rest(r))

def _print(con: Console, rows: Sequence[dict[str, Any]], ratios: dict[str, Any], ablation: Sequence[dict[str, Any]],
           report: dict[str, Any]) -> None:
    t = Table(title="Serving on 8xA6000 (simulated): goodput / cost per trace and load")
    for c in ("trace", "load", "policy", "requests", "goodput", "acc hit", "cost $", "GB", "inst", "mean s",
              "p99 s", "unplaced"):
        t.add_column(c, justify="right" if c not in ("trace", "policy", "unplaced") else "left")
    add_cell_rows(t, rows, lambda r: (
        f"{r['accuracy_hit_rate']:.3f}", f"{r['cost_usd']:.4f}", f"{r['gb_reserved']:.0f}", str(r["instances"]),
        _fmt(r["mean_latency_s"], ".1f"), _fmt(r["p99_latency_s"], ".1f"), ",".join(u[0] for u in r["unplaced"])))
    con.print(t)
    grid = sorted({(r["trace"], r["load"]) for r in rows})
    rt = Table(title="Every published comparison, per trace and load (x = times better for the first policy; "
                     "cost x = times cheaper), beside the published figures")
    rt.add_column("comparison", no_wrap=True)
    for tr, ld in grid:
        rt.add_column(f"{tr} {ld:.0%}", justify="right")
    rt.add_column("ours min-max (avg)", justify="right")
    rt.add_column("published")
    for name, d in ratios.items():
        o, p = d["ours"], d["published"]
        pub: str = "-" if not p else ("" if p["min"] is None else f"{p['min']}-{p['max']}") + \
            ("" if p["avg"] is None else f" avg {p['avg']}")
        vals = {(c["trace"], c["load"]): c["value"] for c in d["cells"]}
        inf = f" +{o['n_infinite']} inf" if o["n_infinite"] else ""
        rt.add_row(name, *(_fmt(vals.get(c)) for c in grid),
                   f"{_fmt(o['min'])}-{_fmt(o['max'])} ({_fmt(o['avg'])}){inf}", pub)
    con.print(rt)
    it = Table(title="Instances / GB reserved per policy (LangChain: placement failures)")
    it.add_column("policy", no_wrap=True)
    for tr, ld in grid:
        it.add_column(f"{tr} {ld:.0%}", justify="right")
    byp = {(r["trace"], r["load"], r["policy"]): r for r in rows}
    for pol in dict.fromkeys(r["policy"] for r in rows):
        def cell_text(r: dict[str, Any] | None) -> str:
            if r is None:
                return "-"
            extra = f" ({r['placement_failure_count']} failed)" if r["placement_failure_count"] else ""
            return f"{r['instances']} / {r['gb_reserved']:.0f}{extra}"
        it.add_row(pol, *(cell_text(byp.get((tr, ld, pol))) for tr, ld in grid))
    con.print(it)
    at = Table(title="Reuse ablation: instances deployed / LLM stages on an instance another task deployed")
    lv = sorted({a["load"] for a in ablation})
    at.add_column("trace")
    at.add_column("policy", no_wrap=True)
    for x in lv:
        at.add_column(f"{x:.0%}")
    cells = {(a["trace"], a["policy"], a["load"]): a for a in ablation}
    for tr, pol in dict.fromkeys((a["trace"], a["policy"]) for a in ablation):
        at.add_row(tr, pol, *(f"{cl['instances_deployed']} inst {cl['stages_on_reused_instances']}/{cl['stages']}"
                              if (cl := cells.get((tr, pol, x))) else "-" for x in lv))
    con.print(at)
    bt = Table(title="Capacity bound: the most goodput ANY plan can reach (latency floor and GPU-seconds/memory per "
                     "burst; flowmaker.eval.bound) beside the best policy's")
    for c in ("trace", "load", "bound", "latency misses", "burst misses", "worst span s", "best policy", "flowmaker",
              "verdict"):
        bt.add_column(c, justify="left" if c in ("trace", "best policy", "verdict") else "right")
    seg = {(s["trace"], s["load"]): s.get("goodput_upper_bound") for s in report["setup"]["segments"]}
    for tr, ld in grid:
        b = seg.get((tr, ld))
        cell = [r for r in rows if (r["trace"], r["load"]) == (tr, ld)]
        best = max(cell, key=lambda r: r["goodput"])
        fm = next((r["goodput"] for r in cell if r["policy"] == "flowmaker"), None)
        if b is None:
            bt.add_row(tr, f"{ld:.0%}", "n/a", "-", "-", "-", f"{best['policy']} {best['goodput']:.3f}", _fmt(fm, ".3f"),
                       "no bound: GPUs do not split their time (colocation ignore, or kappa < 1)")
            continue
        bound = b["goodput_upper_bound"]
        verdict = "0.90 out of reach for any plan" if bound < 0.9 else "0.90 reachable in principle"
        bt.add_row(tr, f"{ld:.0%}", f"{bound:.3f}", str(b["latency_misses"]), str(b["work_misses"]),
                   "-" if not b["worst_span_forced_misses"] else
                   f"{b['worst_span_s'][0]:.1f}-{b['worst_span_s'][1]:.1f}",
                   f"{best['policy']} {best['goodput']:.3f}", _fmt(fm, ".3f"), verdict)
    con.print(bt)
    tm = report["timing"]
    e = report["setup"]["experiment"]
    con.print(f"experiment {e['name']} sha256 {e['sha256'][:12]} ({e['source']}); seed {report['setup']['seed']}; "
              f"colocation {report['setup']['colocation']}")
    con.print(f"wall {tm['wall_s']:.1f}s (planning {tm['planning_s']:.1f}s, simulation {tm['simulation_s']:.1f}s); "
              f"JSON {report['json']}; plots {', '.join(report['plots']) or '-'}")
