"""`flowmaker bench selector`: the selection strategies side by side at paper scale, in depth and in catalog size.

Three experiments, one run, written as JSON + a table + PNG plots:
1. paper scale — the 7 evaluation tasks x 3 workflows, 11 models x 10 configs,
   8xA6000, on an empty cluster and on clusters whose running instances carry
   low / high load;
2. depth — chains of 1..10 LLM stages with the 11 models (11..15 for exact alone, under the adversarial budget);
3. catalog — 11 / 25 / 50 / 125 models at 3 stages (extra models synthesised);
4. adversarial — seeded hard instances for `exact` under its anytime contract (time budget): fan and
   diamond DAGs and chains of 8-15 LLM stages on 4 nodes x 8 mixed GPUs with 30+ running instances at
   30-95% load, near-identical model clones, all-reuse optima, unplaceable stages, utilization cap 0.5
   and latency SLOs at the edge of feasibility; reports time, whether optimality was proven, and the
   proven gap.
5. hard (not in the default run: `--section hard`) — fresh instances of the randomized hard families of
   `flowmaker/bench/selector_hard.py` (long chains with many clones, wide fans, fragmented 8x8 clusters, DAG
   mixes, exact memory ties), `hard_count` per family from seed `seed`, `exact` in-process under
   `hard_budget_s`: the share proven within 1 s and 2 s, the gap of the unproven, the worst case, per family,
   with the load average; `hard_burn` busy processes load the machine meanwhile, and `answers_digest`
   lets two runs (at two loads) be compared answer for answer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from flowmaker.catalog import default_models, get_gpu_type, make_cluster, params_from_arch
from flowmaker.domain import (
    Cluster,
    Gpu,
    GpuSharing,
    Instance,
    Model,
    Profile,
    SelectionOptions,
    SelectionRequest,
    SelectionResult,
    Slo,
    Stage,
    Variant,
    Workflow,
)
from flowmaker.errors import DeadlineExceeded, InvalidSpec
from flowmaker.eval.tasks import EVAL_TASKS
from flowmaker.eval.traces import quantile
from flowmaker.profiling.analytic import profiles_for
from flowmaker.selection import select

STRATEGIES = ("exact", "heuristic", "exhaustive", "bayesopt")
Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    repeats: int = 5  # exact/heuristic are timed this many times per case (median reported)
    exhaustive_budget_s: float = 20.0
    bayesopt_budget_s: float = 15.0
    bayesopt_trials: int = 200
    bayesopt_states: tuple[str, ...] = ("empty",)  # BO is slow; run it on these cluster states only
    depth_max: int = 10
    depth_exact_max: int = 15  # deeper chains for exact alone (the others only time out there)
    depth_rate_rps: float = 1.0
    depth_budget_s: float = 5.0
    catalog_sizes: tuple[int, ...] = (11, 25, 50, 125)
    seed: int = 0
    adversarial_per_kind: int = 4  # seeded instances per adversarial kind (0: skip the section)
    adversarial_budget_s: float = 1.9  # exact's time budget on them (the answer must come within 2 s)
    sections: tuple[str, ...] = ("paper", "depth", "catalog", "adversarial")
    hard_count: int = 20  # instances per hard family (`--section hard`)
    hard_budget_s: float = 2.0  # exact's time budget on them
    hard_burn: int = 0  # busy-loop processes that load the machine during the hard section
    hard_families: tuple[str, ...] = ()  # empty: all of selector_hard.HARD_FAMILIES
    # The selection contract of every request: "ignore" (the paper's, the base contract) or "interference"
    # (docs/selection-spec.md, "Extension: GPU sharing").
    gpu_sharing: str = "ignore"


# ------------------------------------------------------------------ cluster states


def _running_cluster(models: Sequence[Model], profiles: Sequence[Profile], load_frac: float) -> Cluster:
    """Deploy every evaluation task once (exact, reuse on) into an empty 8xA6000 node, then set each
    running instance's load to `load_frac` of its capacity: the 'low'/'high' load states."""
    cluster = make_cluster("A6000", nodes=1, gpus_per_node=8)
    prof = {p.key: p for p in profiles}
    instances: list[Instance] = []
    used = {g.id: g.memory_used_gb for g in cluster.gpus}
    for t in EVAL_TASKS:
        req = SelectionRequest(t.slo(), t.nominal_workflows(), tuple(models), tuple(profiles),
                               Cluster(tuple(dataclasses.replace(g, memory_used_gb=used[g.id]) for g in cluster.gpus),
                                       tuple(instances)))
        res = _select(req, "exact")
        if res.variant is None:
            continue
        for n in res.variant.new_instances:
            for g in n.gpu_ids:
                used[g] += n.memory_gb_per_gpu
            instances.append(Instance(f"{t.name}-{n.key}", n.model_id, n.tp, n.pp, n.gpu_ids, 0.0))
    loaded = tuple(dataclasses.replace(i, load_output_tokens_per_s=load_frac * prof[i.key].max_output_tokens_per_s)
                   for i in instances)
    gpus = tuple(dataclasses.replace(g, memory_used_gb=min(used[g.id], g.memory_total_gb)) for g in cluster.gpus)
    return Cluster(gpus, loaded)


# ------------------------------------------------------------------ measuring


def _signature(v: Variant | None) -> Any:
    if v is None:
        return None
    return (v.workflow_id, tuple(sorted((a.stage_id, a.model_id, a.tp, a.pp, a.reused, a.instance_id)
                                        for a in v.assignments)))


_SHARING: ContextVar[GpuSharing] = ContextVar("flowmaker_bench_gpu_sharing", default=GpuSharing.IGNORE)


def _select(req: SelectionRequest, strategy: str) -> SelectionResult:
    """`select` under the bench's contract (BenchConfig.gpu_sharing)."""
    sharing = _SHARING.get()
    if req.options.gpu_sharing is not sharing:
        req = dataclasses.replace(req, options=dataclasses.replace(req.options, gpu_sharing=sharing))
    return select(req, strategy)


def _run(req: SelectionRequest, strategy: str, repeats: int) -> tuple[SelectionResult, list[float]]:
    times = []
    res = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = _select(req, strategy)
        times.append(time.perf_counter() - t0)
    assert res is not None
    return res, times


def _gap(res: SelectionResult, ref: SelectionResult) -> float | None:
    """Relative objective gap vs the reference (exhaustive); inf when it found no variant, or a costly
    one where the optimum costs nothing (reuse only)."""
    if ref.variant is None or ref.timed_out:
        return None
    if res.variant is None:
        return math.inf
    base = ref.variant.cost
    if base == 0:
        return 0.0 if res.variant.cost == 0 else math.inf
    return (res.variant.cost - base) / base


# ------------------------------------------------------------------ experiments


def paper_scale(cfg: BenchConfig, progress: Progress) -> dict[str, Any]:
    models = default_models()
    gpu = get_gpu_type("A6000")
    profiles = profiles_for(models, gpu, max_gpus=8)
    states = {"empty": make_cluster("A6000", nodes=1, gpus_per_node=8),
              "low": _running_cluster(models, profiles, 0.25),
              "high": _running_cluster(models, profiles, 0.85)}
    rows: list[dict[str, Any]] = []
    for state, cluster in states.items():
        for t in EVAL_TASKS:
            strategies = [s for s in STRATEGIES if s != "bayesopt" or state in cfg.bayesopt_states]
            opts = SelectionOptions(time_budget_s=cfg.exhaustive_budget_s)
            req = SelectionRequest(t.slo(), t.nominal_workflows(), models, profiles, cluster, opts)
            results: dict[str, tuple[SelectionResult, list[float]]] = {}
            for s in strategies:
                progress(f"paper {state:5s} {t.name:12s} {s}")
                if s == "bayesopt":
                    r = dataclasses.replace(req, options=SelectionOptions(
                        time_budget_s=cfg.bayesopt_budget_s, max_trials=cfg.bayesopt_trials, seed=cfg.seed))
                    results[s] = _run(r, s, 1)
                elif s == "exhaustive":
                    results[s] = _run(req, s, 1)
                else:
                    results[s] = _run(req, s, cfg.repeats)
            ref = results["exhaustive"][0]
            for s, (res, times) in results.items():
                rows.append({
                    "state": state, "task": t.name, "strategy": s,
                    "time_s": statistics.median(times), "variants_evaluated": res.variants_evaluated,
                    "search_space": res.search_space_size, "timed_out": res.timed_out,
                    "feasible": res.variant is not None,
                    "reason": res.reason.value if res.reason else None,
                    "cost": res.variant.cost if res.variant else None,
                    "latency_s": res.variant.latency_s if res.variant else None,
                    "gap": _gap(res, ref),
                    "same_variant": (_signature(res.variant) == _signature(ref.variant)) if not ref.timed_out
                    else None,
                    "new_instances": [(n.model_id, n.tp, n.pp) for n in res.variant.new_instances]
                    if res.variant else [],
                    "reused": [i for i, _ in res.variant.reuse] if res.variant else [],
                })
    summary = {}
    for s in STRATEGIES:
        rs = [r for r in rows if r["strategy"] == s]
        if not rs:
            continue
        gaps = [r["gap"] for r in rs if r["gap"] is not None]
        same = [r["same_variant"] for r in rs if r["same_variant"] is not None]
        summary[s] = {
            "runs": len(rs), "median_ms": 1e3 * statistics.median(r["time_s"] for r in rs),
            "p95_ms": 1e3 * quantile(sorted(r["time_s"] for r in rs), 0.95),
            "median_variants": statistics.median(r["variants_evaluated"] for r in rs),
            "max_gap": max(gaps, default=None),
            "no_answer": sum(1 for r in rs if not r["feasible"] and r["gap"] is not None),
            "mean_gap": (sum(g for g in gaps if math.isfinite(g)) / max(1, sum(1 for g in gaps if math.isfinite(g))))
            if gaps else None,
            "missed_optimum": sum(1 for g in gaps if g > 1e-9),  # includes no answer
            "same_variant_rate": (sum(same) / len(same)) if same else None,
            "timed_out": sum(1 for r in rs if r["timed_out"]),
        }
    return {"rows": rows, "summary": summary,
            "space": {t.name: next(r["search_space"] for r in rows if r["task"] == t.name) for t in EVAL_TASKS},
            "running_instances": {k: len(v.instances) for k, v in states.items()}}


def _chain(n: int) -> Workflow:
    return Workflow(f"chain{n}", tuple(
        Stage(f"s{i}", input_tokens=800 + 100 * i, output_tokens=150 + 20 * i,
              depends_on=(f"s{i - 1}",) if i else ()) for i in range(n)))


def depth(cfg: BenchConfig, progress: Progress) -> list[dict[str, Any]]:
    models = default_models()
    profiles = profiles_for(models, get_gpu_type("A6000"), max_gpus=8)
    cluster = make_cluster("A6000", nodes=1, gpus_per_node=8)
    rows = []
    for n in range(1, cfg.depth_max + 1):
        slo = Slo(0.2, 3.0 * n, cfg.depth_rate_rps)
        base = SelectionRequest(slo, (_chain(n),), models, profiles, cluster)
        out: dict[str, Any] = {"stages": n}
        for s in STRATEGIES:
            progress(f"depth {n:2d} {s}")
            opts = SelectionOptions(time_budget_s=cfg.depth_budget_s, max_trials=cfg.bayesopt_trials,
                                    seed=cfg.seed)
            req = dataclasses.replace(base, options=opts)
            res, times = _run(req, s, cfg.repeats if s == "exact" else 1)
            out[s] = {"time_s": statistics.median(times), "timed_out": res.timed_out,
                      "cost": res.variant.cost if res.variant else None,
                      "variants_evaluated": res.variants_evaluated}
            out["search_space"] = res.search_space_size
        ex = out["exhaustive"]
        out["exact_vs_exhaustive"] = ex["time_s"] / out["exact"]["time_s"]
        out["exact_vs_bayesopt"] = out["bayesopt"]["time_s"] / out["exact"]["time_s"]
        rows.append(out)
    for n in range(cfg.depth_max + 1, cfg.depth_exact_max + 1):
        progress(f"depth {n:2d} exact")
        req = SelectionRequest(Slo(0.2, 3.0 * n, cfg.depth_rate_rps), (_chain(n),), models, profiles, cluster,
                               SelectionOptions(time_budget_s=cfg.adversarial_budget_s))
        res, times = _run(req, "exact", cfg.repeats)
        rows.append({"stages": n, "search_space": res.search_space_size,
                     "exact": {"time_s": statistics.median(times), "timed_out": res.timed_out,
                               "cost": res.variant.cost if res.variant else None, "optimal": res.optimal,
                               "variants_evaluated": res.variants_evaluated}})
    return rows


def synth_models(n: int, seed: int = 0) -> tuple[Model, ...]:
    """The 11 catalog models plus n-11 synthetic ones: each copies a catalog architecture with its depth
    scaled by U(0.75, 1.25) (rounded to a multiple of 8 so pipeline splits stay valid), parameters
    recomputed from the architecture, and accuracy = the template's x (depth ratio)^0.15 + N(0, 0.015),
    clipped to the leaderboard's range [0.05, 0.50]."""
    base = list(default_models())
    rng = random.Random(seed)
    out = list(base)
    i = 0
    while len(out) < n:
        t = base[i % len(base)]
        i += 1
        assert t.arch is not None
        layers = max(8, round(t.arch.layers * rng.uniform(0.75, 1.25) / 8) * 8)
        arch = dataclasses.replace(t.arch, layers=layers)
        total, active = params_from_arch(arch)
        acc = t.accuracy * (layers / t.arch.layers) ** 0.15 + rng.gauss(0.0, 0.015)
        out.append(Model(f"{t.id}-syn{len(out)}", min(0.5, max(0.05, acc)), total / 1e9, active / 1e9, arch,
                         family=t.family, source="synthetic (flowmaker bench selector)"))
    return tuple(out[:n])


def catalog(cfg: BenchConfig, progress: Progress) -> list[dict[str, Any]]:
    gpu = get_gpu_type("A6000")
    cluster = make_cluster("A6000", nodes=1, gpus_per_node=8)
    rows = []
    for size in cfg.catalog_sizes:
        models = synth_models(size, cfg.seed)
        profiles = profiles_for(models, gpu, max_gpus=8)
        req = SelectionRequest(Slo(0.2, 9.0, cfg.depth_rate_rps), (_chain(3),), models, profiles, cluster,
                               SelectionOptions(time_budget_s=cfg.depth_budget_s))
        out: dict[str, Any] = {"models": size, "profiles": len(profiles)}
        for s in ("exact", "heuristic", "exhaustive"):
            progress(f"catalog {size:3d} {s}")
            res, times = _run(req, s, cfg.repeats if s != "exhaustive" else 1)
            out[s] = {"time_s": statistics.median(times), "timed_out": res.timed_out,
                      "cost": res.variant.cost if res.variant else None}
            out["search_space"] = res.search_space_size
        rows.append(out)
    return rows


# ------------------------------------------------------------------ adversarial instances

ADVERSARIAL_KINDS = ("fan", "diamond", "chain15", "reuse", "unplaceable", "clones")
SECTIONS = ("paper", "depth", "catalog", "adversarial", "hard")  # `BenchConfig.sections`, in the order they run


def _adv_catalog(rng: random.Random, clones: int) -> tuple[tuple[Model, ...], tuple[Profile, ...]]:
    """The 11 catalog models (A6000 profiles) plus `clones` near-identical copies of random models:
    accuracy +-0.003, latency coefficients and capacity within +-1%, memory within +0.5%."""
    models = list(default_models())
    profiles = list(profiles_for(models, get_gpu_type("A6000"), max_gpus=8))
    for c in range(clones):
        t = rng.choice(default_models()[1:])
        m = dataclasses.replace(t, id=f"{t.id}-clone{c}", accuracy=t.accuracy + rng.uniform(-0.003, 0.003))
        models.append(m)
        for p in [p for p in profiles if p.model_id == t.id]:
            f = 1 + rng.uniform(-0.01, 0.01)
            profiles.append(dataclasses.replace(
                p, model_id=m.id, fixed_s=p.fixed_s * f, prefill_s_per_token=p.prefill_s_per_token * f,
                decode_s_per_token=p.decode_s_per_token * f, max_output_tokens_per_s=p.max_output_tokens_per_s / f,
                memory_gb_per_gpu=p.memory_gb_per_gpu * (1 + rng.choice((0.0, 0.0, rng.uniform(0, 0.005))))))
    return tuple(models), tuple(profiles)


def _adv_cluster(rng: random.Random, profiles: Sequence[Profile], n_instances: int,
                 load: tuple[float, float] = (0.3, 0.95)) -> Cluster:
    """4 nodes x 8 GPUs of mixed memory (48 / 80 GB) with `n_instances` running 1-2 GPU instances
    placed where they fit, each at a uniform share of its capacity in `load`."""
    totals = {f"n{n}-g{g}": rng.choice((48.0, 80.0)) for n in range(4) for g in range(8)}
    used = dict.fromkeys(totals, 0.0)
    small = [p for p in profiles if p.tp * p.pp <= 2 and p.memory_gb_per_gpu <= 40]
    instances: list[Instance] = []
    tries = 0
    while len(instances) < n_instances and tries < 20 * n_instances:
        tries += 1
        p = rng.choice(small)
        node = rng.randrange(4)
        ids = [g for g in totals if g.startswith(f"n{node}-") and totals[g] - used[g] >= p.memory_gb_per_gpu]
        if len(ids) < p.tp * p.pp:
            continue
        gids = tuple(sorted(rng.sample(ids, p.tp * p.pp)))
        for g in gids:
            used[g] += p.memory_gb_per_gpu
        instances.append(Instance(f"run{len(instances)}", p.model_id, p.tp, p.pp, gids,
                                  rng.uniform(*load) * p.max_output_tokens_per_s))
    gpus = tuple(Gpu(g, g.split("-")[0], totals[g], used[g]) for g in totals)
    return Cluster(gpus, tuple(instances))


def _stage(rng: random.Random, i: int, deps: tuple[str, ...], scale: float = 1.0) -> Stage:
    return Stage(f"s{i}", input_tokens=int(rng.uniform(200, 2000) * scale), output_tokens=rng.randint(60, 300),
                 depends_on=deps)


def _fan(rng: random.Random, n: int) -> Workflow:
    """head -> n-2 parallel stages -> join."""
    st = [_stage(rng, 0, ())]
    st += [_stage(rng, i, ("s0",)) for i in range(1, n - 1)]
    st.append(_stage(rng, n - 1, tuple(f"s{i}" for i in range(1, n - 1))))
    return Workflow(f"fan{n}", tuple(st))


def _diamond(rng: random.Random, n: int) -> Workflow:
    """Layers of width 1-3, each stage depending on every stage of the layer before (stacked diamonds)."""
    st: list[Stage] = []
    prev: tuple[str, ...] = ()
    while len(st) < n:
        w = min(n - len(st), 1 if not prev or len(prev) > 1 else rng.randint(2, 3))
        layer = [_stage(rng, len(st) + k, prev) for k in range(w)]
        st += layer
        prev = tuple(x.id for x in layer)
    return Workflow(f"diamond{n}", tuple(st))


def _chain_adv(rng: random.Random, n: int) -> Workflow:
    return Workflow(f"chain{n}", tuple(_stage(rng, i, (f"s{i - 1}",) if i else ()) for i in range(n)))


def _fastest_latency(wf: Workflow, profiles: Sequence[Profile], models: Sequence[Model], alpha: float) -> float:
    """Longest path with every LLM stage at its fastest qualifying profile (capacity/placement ignored)."""
    acc = {m.id: m.accuracy for m in models}
    ok = [p for p in profiles if acc.get(p.model_id, 0.0) >= alpha]
    fin: dict[str, float] = {}
    for s in wf.stages:  # the generators list stages in a topological order
        lat = min(s.calls_per_request * p.call_latency_s(s.input_tokens, s.output_tokens) for p in ok)
        fin[s.id] = max((fin[d] for d in s.depends_on), default=0.0) + lat
    return max(fin.values())


def adversarial_request(kind: str, seed: int) -> SelectionRequest:
    """One seeded hard instance of `kind` (see ADVERSARIAL_KINDS)."""
    rng = random.Random(f"{kind}-{seed}")
    n = 15 if kind == "chain15" else rng.randint(8, 15)
    models, profiles = _adv_catalog(rng, 6 if kind == "clones" else 3)
    alpha = rng.choice((0.2, 0.23, 0.26))
    u = 0.5 if kind in ("fan", "clones") or rng.random() < 0.4 else 1.0
    rate = rng.uniform(0.3, 1.5)
    wf = {"fan": _fan, "clones": _fan, "diamond": _diamond}.get(kind, _chain_adv)(rng, n)
    cluster = _adv_cluster(rng, profiles, rng.randint(30, 40))
    slack = rng.uniform(1.03, 1.4)
    if kind == "reuse":
        # An all-reuse optimum: one running instance per stage of a qualifying model, each with spare
        # capacity for exactly one stage (stage loads within a factor < 2 of each other).
        acc = {m.id: m.accuracy for m in models}
        ok = [p for p in profiles if acc[p.model_id] >= alpha and p.tp * p.pp == 1]
        wf = Workflow(wf.id, tuple(dataclasses.replace(s, output_tokens=rng.randint(100, 180)) for s in wf.stages))
        top = rate * 180
        extra = []
        gpus = list(cluster.gpus)
        for i in range(n + rng.randint(0, 4)):
            p = rng.choice(ok)
            g = gpus[i % len(gpus)]
            gpus[i % len(gpus)] = dataclasses.replace(g, memory_used_gb=min(g.memory_total_gb,
                                                                            g.memory_used_gb + p.memory_gb_per_gpu))
            extra.append(Instance(f"spare{i}", p.model_id, p.tp, p.pp, (g.id,),
                                  max(0.0, u * p.max_output_tokens_per_s - top * rng.uniform(1.0, 1.1))))
        cluster = Cluster(tuple(gpus), cluster.instances + tuple(extra))
        slack = 3.0
    if kind == "unplaceable":
        # The last stage's load is so high that only 8-GPU configurations carry it, and every node has one GPU
        # with 2 GB free: no variant can be placed. The latency SLO is loose, so nothing else prunes the search.
        acc = {m.id: m.accuracy for m in models}
        ok = [p for p in profiles if acc[p.model_id] >= alpha]
        small = max(u * p.max_output_tokens_per_s for p in ok if p.tp * p.pp < 8)
        big = max(u * p.max_output_tokens_per_s for p in ok if p.tp * p.pp == 8)
        if not big > small * 1.05:
            raise AssertionError(f"unplaceable generator: 8-GPU configurations carry no more load ({seed=})")
        last = dataclasses.replace(wf.stages[-1], output_tokens=int((small * 1.02 + min(big, small * 1.3)) / 2 / rate))
        wf = Workflow(wf.id, (*wf.stages[:-1], last))
        gpus = list(cluster.gpus)
        for node in range(4):
            i = next(k for k, g in enumerate(gpus) if g.node == f"n{node}")
            gpus[i] = dataclasses.replace(gpus[i], memory_used_gb=gpus[i].memory_total_gb - 2.0)
        cluster = Cluster(tuple(gpus), cluster.instances)
        fast8 = _fastest_latency(Workflow("x", (dataclasses.replace(last, depends_on=()),)),
                                 [p for p in profiles if p.tp * p.pp == 8], models, alpha)
        rest = _fastest_latency(Workflow(wf.id, wf.stages[:-1]), profiles, models, alpha)
        return SelectionRequest(Slo(alpha, (rest + fast8) * 1.5, rate), (wf,), models, profiles, cluster,
                                SelectionOptions(utilization_cap=u))
    lam = _fastest_latency(wf, profiles, models, alpha) * slack
    return SelectionRequest(Slo(alpha, lam, rate), (wf,), models, profiles, cluster,
                            SelectionOptions(utilization_cap=u))


def adversarial(cfg: BenchConfig, progress: Progress) -> dict[str, Any]:
    """`exact` on every seeded adversarial instance, under its time budget."""
    rows: list[dict[str, Any]] = []
    for kind in ADVERSARIAL_KINDS:
        for k in range(cfg.adversarial_per_kind):
            seed = cfg.seed * 1000 + k
            req = adversarial_request(kind, seed)
            req = dataclasses.replace(req, options=dataclasses.replace(req.options,
                                                                       time_budget_s=cfg.adversarial_budget_s))
            progress(f"adversarial {kind:11s} {k}")
            wf = req.workflows[0]
            row: dict[str, Any] = {
                "kind": kind, "seed": seed, "stages": len(wf.stages), "instances": len(req.cluster.instances),
                "models": len(req.models), "utilization_cap": req.options.utilization_cap}
            t0 = time.perf_counter()
            try:
                res = _select(req, "exact")
            except DeadlineExceeded:
                row.update(time_s=time.perf_counter() - t0, answer="DEADLINE_EXCEEDED", optimal=False, gap=None,
                           cost=None, lower_bound=None, evaluated=None)
            else:
                row.update(time_s=time.perf_counter() - t0, optimal=res.optimal,
                           answer=("feasible" if res.variant else (res.reason.value if res.reason else "?")),
                           cost=res.variant.cost if res.variant else None,
                           lower_bound=res.lower_bound if res.variant else None,
                           gap=res.gap, evaluated=res.variants_evaluated,
                           reused=len(res.variant.reuse) if res.variant else 0,
                           new_instances=len(res.variant.new_instances) if res.variant else 0)
            rows.append(row)
    times = sorted(r["time_s"] for r in rows)
    summary = {
        "instances": len(rows),
        "answered_within_2s": sum(1 for r in rows if r["time_s"] <= 2.0 and r["answer"] != "DEADLINE_EXCEEDED"),
        "proven_optimal_within_1s": sum(1 for r in rows if r["optimal"] and r["time_s"] <= 1.0),
        "proven_optimal": sum(1 for r in rows if r["optimal"]),
        "median_ms": 1e3 * statistics.median(times) if times else None,
        "max_ms": 1e3 * times[-1] if times else None,
        "max_gap": max((r["gap"] for r in rows if r["gap"] is not None), default=None),
        "chain15_max_ms": max((1e3 * r["time_s"] for r in rows if r["kind"] == "chain15"), default=None),
    }
    return {"rows": rows, "summary": summary}


# ------------------------------------------------------------------ output


def _plots(result: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[str] = []
    if "depth" not in result or "catalog" not in result:
        return files
    fig, ax = plt.subplots(figsize=(6, 4))
    d = result["depth"]
    for s in STRATEGIES:
        ax.plot([r["stages"] for r in d if s in r], [1e3 * r[s]["time_s"] for r in d if s in r], marker="o", label=s)
    ax.axhline(1e3 * result["config"]["depth_budget_s"], color="grey", linestyle="--", linewidth=0.8,
               label="time budget (exhaustive, bayesopt stop here)")
    ax.set_yscale("log")
    ax.set_xlabel("LLM stages in the chain")
    ax.set_ylabel("solver time (ms, log)")
    ax.set_title("Selection time vs depth (11 models, 8xA6000)")
    ax.legend()
    fig.tight_layout()
    p = out_dir / "selector_depth.png"
    fig.savefig(p, dpi=110)
    files.append(str(p))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    c = result["catalog"]
    for s in ("exact", "heuristic", "exhaustive"):
        ax.plot([r["models"] for r in c], [1e3 * r[s]["time_s"] for r in c], marker="o", label=s)
    ax.set_yscale("log")
    ax.set_xlabel("models in the catalog")
    ax.set_ylabel("solver time (ms, log)")
    ax.set_title("Selection time vs catalog size (3-stage chain)")
    ax.legend()
    fig.tight_layout()
    p = out_dir / "selector_catalog.png"
    fig.savefig(p, dpi=110)
    files.append(str(p))
    plt.close(fig)
    return files


def run_selector_bench(out_dir: str | Path = "out/bench-selector", cfg: BenchConfig | None = None,
                       progress: Progress | None = None) -> dict[str, Any]:
    cfg = cfg or BenchConfig()
    if cfg.gpu_sharing.upper() not in GpuSharing.__members__:
        raise InvalidSpec(f"unknown GPU sharing {cfg.gpu_sharing!r}; known: ignore, interference", field="gpu_sharing")
    for s in cfg.sections:
        if s not in SECTIONS:
            raise InvalidSpec(f"unknown section {s!r}; known: {', '.join(SECTIONS)}", field="section")
    from flowmaker.bench.selector_hard import HARD_FAMILIES

    for f in cfg.hard_families:
        if f not in HARD_FAMILIES:
            raise InvalidSpec(f"unknown hard family {f!r}; known: {', '.join(HARD_FAMILIES)}", field="family")
    _SHARING.set(GpuSharing[cfg.gpu_sharing.upper()])
    progress = progress or (lambda _m: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
    if "paper" in cfg.sections:
        result["paper"] = paper_scale(cfg, progress)
    if "depth" in cfg.sections:
        result["depth"] = depth(cfg, progress)
    if "catalog" in cfg.sections:
        result["catalog"] = catalog(cfg, progress)
    if "adversarial" in cfg.sections and cfg.adversarial_per_kind > 0:
        result["adversarial"] = adversarial(cfg, progress)
    if "hard" in cfg.sections and cfg.hard_count > 0:
        from flowmaker.bench.selector_hard_run import hard

        result["hard"] = hard(cfg, progress)
    result["wall_s"] = time.perf_counter() - started
    from flowmaker import native

    result["native"] = native.status()  # whether the class search ran compiled (`make native`) or as pure Python
    result["plots"] = _plots(result, out)
    (out / "selector.json").write_text(json.dumps(_finite(result), indent=1, allow_nan=False))
    return result


def _finite(o: Any) -> Any:
    """Strict JSON: an infinite gap (a strategy found nothing, or paid where the optimum is free) becomes "inf"."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _fmt_gap(g: float | None) -> str:
    if g is None:
        return "-"
    return f"{g:.1%}" if math.isfinite(g) else "inf (optimum free)"


def _fmt_ms(x: float) -> str:
    ms = 1e3 * x
    return f"{ms:.2f}" if ms < 10 else f"{ms:.0f}"


def render(result: dict[str, Any], console: Any) -> None:

    if "paper" in result:
        _render_paper(result, console)
    if "depth" in result:
        _render_depth(result, console)
    if "catalog" in result:
        _render_catalog(result, console)
    if "adversarial" in result:
        _render_adversarial(result, console)
    if "hard" in result:
        from flowmaker.bench.selector_hard_run import render_hard

        render_hard(result, console)
    built = result.get("native", {})
    console.print("class search: " + ("compiled (make native)" if "compiled" in built.values() else "pure Python")
                  + f"; wall time {result['wall_s']:.0f} s" + (f"; plots: {', '.join(result['plots'])}"
                                                           if result["plots"] else ""))


def _render_adversarial(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    adv = result["adversarial"]
    budget = result["config"]["adversarial_budget_s"]
    t = Table(title=f"Adversarial: exact with a {budget:g} s budget (4 nodes x 8 mixed GPUs, 30+ running "
                    "instances at 30-95% load; optimal = proven; gap = (cost - proven lower bound) / cost)")
    for c in ("kind", "seed", "stages", "running", "models", "u", "ms", "answer", "optimal", "gap", "cost",
              "lower bound", "variants"):
        t.add_column(c, justify="right")
    for r in adv["rows"]:
        t.add_row(r["kind"], str(r["seed"]), str(r["stages"]), str(r["instances"]), str(r["models"]),
                  f"{r['utilization_cap']:g}", _fmt_ms(r["time_s"]), r["answer"], "yes" if r["optimal"] else "no",
                  "-" if r["gap"] is None else (f"{r['gap']:.1%}" if math.isfinite(r["gap"]) else "inf"),
                  "-" if r["cost"] is None else f"{r['cost']:.1f}",
                  "-" if r["lower_bound"] is None else f"{r['lower_bound']:.1f}",
                  "-" if r.get("evaluated") is None else f"{r['evaluated']:,}")
    console.print(t)
    sm = adv["summary"]
    console.print(f"adversarial: {sm['answered_within_2s']}/{sm['instances']} answered within 2 s, "
                  f"{sm['proven_optimal_within_1s']}/{sm['instances']} proven optimal within 1 s "
                  f"({sm['proven_optimal']} proven in all); median {sm['median_ms']:.0f} ms, max {sm['max_ms']:.0f} ms; "
                  f"max gap {_fmt_gap(sm['max_gap'])}; 15-stage chains max {sm['chain15_max_ms']:.0f} ms")


def _render_paper(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    tab = Table(title="Paper scale: 7 tasks x 3 workflows, 11 models x 10 configs, 8xA6000 "
                      "(empty / low-load / high-load clusters)")
    for c in ("strategy", "runs", "median ms", "p95 ms", "median variants", "missed optimum", "max gap",
              "no answer", "same variant", "timed out"):
        tab.add_column(c, justify="right")
    for s, v in result["paper"]["summary"].items():
        tab.add_row(s, str(v["runs"]), f"{v['median_ms']:.2f}", f"{v['p95_ms']:.2f}", f"{v['median_variants']:.0f}",
                    str(v["missed_optimum"]), _fmt_gap(v["max_gap"]),
                    str(v["no_answer"]),
                    "-" if v["same_variant_rate"] is None else f"{v['same_variant_rate']:.0%}", str(v["timed_out"]))
    console.print(tab)
    sp = Table(title="Search space per task (variants, incl. reuse and in-variant sharing, empty cluster)")
    sp.add_column("task")
    sp.add_column("variants", justify="right")
    for k, v in result["paper"]["space"].items():
        sp.add_row(k, f"{v:,}")
    console.print(sp)


def _render_depth(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    dt = Table(title="Depth: chains of n LLM stages, 11 models (ms; * = timed out at the budget)")
    for c in ("stages", "space", "exact", "heuristic", "exhaustive", "bayesopt", "exhaustive/exact",
              "bayesopt/exact", "exact cost", "heuristic cost", "BO cost"):
        dt.add_column(c, justify="right")
    for r in result["depth"]:
        def cell(s: str, r: dict[str, Any] = r) -> str:
            if s not in r:
                return "-"
            return _fmt_ms(r[s]["time_s"]) + ("*" if r[s]["timed_out"] else "")

        def ratio(k: str, r: dict[str, Any] = r) -> str:
            return f"{r[k]:.0f}x" if k in r else "-"

        dt.add_row(str(r["stages"]), f"{r['search_space']:.3g}", cell("exact"), cell("heuristic"),
                   cell("exhaustive"), cell("bayesopt"), ratio("exact_vs_exhaustive"), ratio("exact_vs_bayesopt"),
                   *(("-" if s not in r or r[s]["cost"] is None else f"{r[s]['cost']:.1f}")
                     for s in ("exact", "heuristic", "bayesopt")))
    console.print(dt)


def _render_catalog(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    ct = Table(title="Catalog size: 3-stage chain (ms; * = timed out)")
    for c in ("models", "profiles", "space", "exact", "heuristic", "exhaustive", "exact cost", "heuristic cost"):
        ct.add_column(c, justify="right")
    for r in result["catalog"]:
        ct.add_row(str(r["models"]), str(r["profiles"]), f"{r['search_space']:.3g}",
                   _fmt_ms(r["exact"]["time_s"]), _fmt_ms(r["heuristic"]["time_s"]),
                   _fmt_ms(r["exhaustive"]["time_s"]) + ("*" if r["exhaustive"]["timed_out"] else ""),
                   "-" if r["exact"]["cost"] is None else f"{r['exact']['cost']:.1f}",
                   "-" if r["heuristic"]["cost"] is None else f"{r['heuristic']['cost']:.1f}")
    console.print(ct)


