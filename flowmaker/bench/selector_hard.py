"""Randomized families of hard selection requests (issue 24): the recipes `exact` was not tuned on.

Each family is a recipe, not a fixed list: `hard_instance(family, seed, size)` draws one request from it with
`random.Random(f"{family}-{seed}")`, so a fresh seed is a fresh instance and the same seed is the same request.
`size="large"` is what `flowmaker bench selector --section hard` measures; `size="small"` draws the same
structure scaled down until the spec's brute force (tests/unit/test_selection_properties.py) can enumerate it,
which is how the property tests use it. Pure: no I/O, no clock.

Families (large size):

- `chain_clones`: one chain of 15-20 LLM stages, the 11 catalog models plus 20-40 near-identical clones
  (accuracy +-0.003, latency coefficients and capacity within +-1%, memory sometimes +0-0.5%).
- `wide_fan`: head -> 8-12 parallel LLM stages -> join, a few clones, a loose-to-tight latency SLO.
- `fragmented`: 8 nodes x 8 GPUs (48 / 80 GB) with fragmented free memory (every GPU partly used) and 40-60
  running 1-2 GPU instances at 30-95% of their capacity (partial headroom), a DAG of 6-10 stages.
- `dag_mix`: 2-4 workflows, each a random DAG of 4-10 stages (sometimes a deep chain, some TOOL stages), on
  2-8 nodes with fragmented memory, 3-10 clones, 10-40 running instances.
- `memory_ties`: 2-4 identical nodes x 4-8 GPUs whose free memory ties exactly between nodes and GPUs, with
  non-dyadic memory figures (7.1, 13.7 GB ...) so that float sums would break the ties, a DAG of 4-8 stages.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from flowmaker.catalog import default_models, get_gpu_type
from flowmaker.domain import (
    Cluster,
    Gpu,
    Instance,
    Model,
    Profile,
    SelectionOptions,
    SelectionRequest,
    Slo,
    Stage,
    StageKind,
    Workflow,
)
from flowmaker.profiling.analytic import profiles_for

HARD_FAMILIES = ("chain_clones", "wide_fan", "fragmented", "dag_mix", "memory_ties")
SIZES = ("small", "large")
# Memory figures that are not exact in binary: sums of them drift, the spec's integer units do not.
NON_DYADIC_GB = (2.7, 7.1, 9.3, 13.7, 17.3, 21.1)


@dataclasses.dataclass(frozen=True)
class HardInstance:
    family: str
    seed: int
    size: str
    request: SelectionRequest
    recipe: dict[str, Any]  # what was drawn (reported by the bench)


def hard_instance(family: str, seed: int, size: str = "large") -> HardInstance:
    """One request of `family` (see HARD_FAMILIES), seeded."""
    if family not in HARD_FAMILIES:
        raise ValueError(f"unknown hard family {family!r}; known: {HARD_FAMILIES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {SIZES}")
    rng = random.Random(f"{family}-{seed}-{size}")
    small = size == "small"
    recipe: dict[str, Any] = {}
    if family == "chain_clones":
        n_clones = rng.randint(2, 3) if small else rng.randint(20, 40)
        models, profiles = _catalog(rng, small, n_clones)
        wfs = [_chain(rng, "chain", rng.randint(3, 4) if small else rng.randint(15, 20))]
        cluster = _cluster(rng, small, nodes=2 if small else 4, per_node=(2, 4) if small else (8, 8),
                           n_running=rng.randint(0, 2) if small else rng.randint(10, 30), profiles=profiles,
                           frag=0.4)
    elif family == "wide_fan":
        n_clones = rng.randint(1, 2) if small else rng.randint(3, 8)
        models, profiles = _catalog(rng, small, n_clones)
        wfs = [_fan(rng, rng.randint(2, 3) if small else rng.randint(8, 12), small)]
        cluster = _cluster(rng, small, nodes=2 if small else 4, per_node=(2, 4) if small else (8, 8),
                           n_running=rng.randint(0, 2) if small else rng.randint(15, 35), profiles=profiles,
                           frag=0.5)
    elif family == "fragmented":
        n_clones = rng.randint(0, 1) if small else rng.randint(2, 6)
        models, profiles = _catalog(rng, small, n_clones)
        wfs = [_dag(rng, "dag", rng.randint(3, 4) if small else rng.randint(6, 10), tool_share=0.15)]
        cluster = _cluster(rng, small, nodes=3 if small else 8, per_node=(2, 2) if small else (8, 8),
                           n_running=rng.randint(1, 3) if small else rng.randint(40, 60), profiles=profiles,
                           frag=0.8)
    elif family == "dag_mix":
        n_clones = rng.randint(0, 2) if small else rng.randint(3, 10)
        models, profiles = _catalog(rng, small, n_clones)
        n_wf = 2 if small else rng.randint(2, 4)
        wfs = []
        for w in range(n_wf):
            n = rng.randint(2, 3) if small else rng.randint(4, 10)
            wfs.append(_chain(rng, f"w{w}", n) if rng.random() < 0.3 else _dag(rng, f"w{w}", n, tool_share=0.2))
        nodes = rng.randint(2, 3) if small else rng.randint(2, 8)
        cluster = _cluster(rng, small, nodes=nodes, per_node=(2, 4) if small else (4, 8),
                           n_running=rng.randint(0, 3) if small else rng.randint(10, 40), profiles=profiles,
                           frag=0.6)
    else:  # memory_ties
        models, profiles = _catalog(rng, small, 0)
        profiles = tuple(dataclasses.replace(p, memory_gb_per_gpu=rng.choice(NON_DYADIC_GB)) for p in profiles)
        wfs = [_dag(rng, "ties", rng.randint(3, 4) if small else rng.randint(4, 8), tool_share=0.0)]
        cluster = _tied_cluster(rng, small, profiles)
        n_clones = 0
    alpha = _alpha(rng, models)
    u = rng.choice((0.5, 0.7, 1.0))
    # Loads comparable to one instance's capacity, so that capacity decides what shares an instance: the mean
    # LLM stage puts 10-80% of the median qualifying profile's usable capacity on it.
    acc = {m.id: m.accuracy for m in models}
    caps = sorted(p.max_output_tokens_per_s for p in profiles if acc[p.model_id] >= alpha)
    calls = [s.calls_per_request * s.output_tokens for w in wfs for s in w.stages if s.is_llm]
    rate = rng.uniform(0.1, 0.8) * u * caps[len(caps) // 2] / (sum(calls) / len(calls)) if caps else 1.0
    slack = rng.uniform(1.03, 1.5)
    lam = max(_fastest_latency(w, profiles, models, alpha) for w in wfs) * slack
    req = SelectionRequest(Slo(alpha, lam, rate), tuple(wfs), models, profiles, cluster,
                           SelectionOptions(utilization_cap=u))
    recipe.update(family=family, seed=seed, size=size, workflows=len(wfs),
                  stages=[len(w.stages) for w in wfs],
                  llm_stages=sum(1 for w in wfs for s in w.stages if s.is_llm), models=len(models),
                  clones=n_clones, profiles=len(profiles), nodes=len({g.node for g in cluster.gpus}),
                  gpus=len(cluster.gpus), running=len(cluster.instances), alpha=alpha, latency_slack=slack,
                  rate_rps=rate, utilization_cap=u)
    return HardInstance(family, seed, size, req, recipe)


# ------------------------------------------------------------------ catalog


def _catalog(rng: random.Random, small: bool, clones: int) -> tuple[tuple[Model, ...], tuple[Profile, ...]]:
    """Catalog models with their A6000 profiles plus `clones` near-identical copies. Small: two random models
    with one or two profiles of at most 2 GPUs each, so that the brute force can enumerate the space."""
    base = default_models()
    profiles = list(profiles_for(base, get_gpu_type("A6000"), max_gpus=8))
    models = list(base)
    if small:
        fits = [m for m in base[1:] if any(p.model_id == m.id and p.tp * p.pp <= 2 for p in profiles)]
        models = sorted(rng.sample(fits, 2), key=lambda m: base.index(m))
        keep: list[Profile] = []
        for m in models:
            own = [p for p in profiles if p.model_id == m.id and p.tp * p.pp <= 2]
            keep += rng.sample(own, min(len(own), rng.randint(1, 2)))
        profiles = keep
    for c in range(clones):
        t = rng.choice(models[1:] if len(models) > 1 else models)
        m = dataclasses.replace(t, id=f"{t.id}-clone{c}",
                                accuracy=min(1.0, max(0.0, t.accuracy + rng.uniform(-0.003, 0.003))))
        own = [p for p in profiles if p.model_id == t.id]
        if small:
            own = own[:1]
        models.append(m)
        for p in own:
            f = 1 + rng.uniform(-0.01, 0.01)
            profiles.append(dataclasses.replace(
                p, model_id=m.id, fixed_s=p.fixed_s * f, prefill_s_per_token=p.prefill_s_per_token * f,
                decode_s_per_token=p.decode_s_per_token * f, max_output_tokens_per_s=p.max_output_tokens_per_s / f,
                memory_gb_per_gpu=p.memory_gb_per_gpu * (1 + rng.choice((0.0, 0.0, rng.uniform(0, 0.005))))))
    return tuple(models), tuple(profiles)


def _alpha(rng: random.Random, models: Sequence[Model]) -> float:
    """An accuracy target that about 40-85% of the models meet."""
    accs = sorted(m.accuracy for m in models)
    return accs[int(len(accs) * rng.uniform(0.15, 0.6))]


# ------------------------------------------------------------------ clusters


def _cluster(rng: random.Random, small: bool, nodes: int, per_node: tuple[int, int], n_running: int,
             profiles: Sequence[Profile], frag: float) -> Cluster:
    """`nodes` nodes of per_node GPUs (48 or 80 GB), each GPU partly used by something outside the request
    (up to `frag` of it, in 0.1 GB steps: fragmented free memory), and `n_running` running 1-2 GPU instances
    of the request's profiles placed where they fit, at 30-95% of their capacity (partial headroom)."""
    totals: dict[str, float] = {}
    for n in range(nodes):
        for g in range(rng.randint(*per_node)):
            totals[f"n{n}-g{g}"] = 48.0 if small else rng.choice((48.0, 80.0))
    used = {g: round(rng.uniform(0, frag) * t, 1) for g, t in totals.items()}
    small_p = [p for p in profiles if p.tp * p.pp <= 2]
    instances: list[Instance] = []
    tries = 0
    while small_p and len(instances) < n_running and tries < 30 * max(1, n_running):
        tries += 1
        p = rng.choice(small_p)
        node = rng.randrange(nodes)
        ids = [g for g in totals if g.startswith(f"n{node}-") and totals[g] - used[g] >= p.memory_gb_per_gpu]
        if len(ids) < p.tp * p.pp:
            continue
        gids = tuple(sorted(rng.sample(ids, p.tp * p.pp)))
        for gid in gids:
            used[gid] += p.memory_gb_per_gpu
        instances.append(Instance(f"run{len(instances)}", p.model_id, p.tp, p.pp, gids,
                                  rng.uniform(0.3, 0.95) * p.max_output_tokens_per_s))
    gpus = tuple(Gpu(g, g.split("-")[0], totals[g], min(used[g], totals[g])) for g in totals)
    return Cluster(gpus, tuple(instances))


def _tied_cluster(rng: random.Random, small: bool, profiles: Sequence[Profile]) -> Cluster:
    """Identical nodes: the same totals and used memory (non-dyadic figures) GPU for GPU, and running instances
    mirrored on every node, so that free memory ties exactly between nodes and between GPUs."""
    nodes = 2 if small else rng.randint(2, 4)
    per = rng.randint(2, 3) if small else rng.randint(4, 8)
    total = rng.choice((48.0, 80.0))
    used = [round(rng.choice((0.0, 0.0, rng.uniform(5, 30))), 1) for _ in range(per)]
    gpus = tuple(Gpu(f"n{n}-g{g}", f"n{n}", total, used[g]) for n in range(nodes) for g in range(per))
    instances: list[Instance] = []
    ones = [p for p in profiles if p.tp * p.pp == 1]
    if ones and rng.random() < 0.6:
        p = rng.choice(ones)
        load = rng.uniform(0.3, 0.9) * p.max_output_tokens_per_s
        for n in range(nodes):  # the same instance, memory already in `used`, on every node
            instances.append(Instance(f"run{n}", p.model_id, p.tp, p.pp, (f"n{n}-g0",), load))
    return Cluster(gpus, tuple(instances))


# ------------------------------------------------------------------ workflows


def _stage(rng: random.Random, i: int, deps: tuple[str, ...], tool: bool = False) -> Stage:
    if tool:
        return Stage(f"s{i}", StageKind.TOOL, deps, latency_s=round(rng.uniform(0.05, 0.5), 3))
    return Stage(f"s{i}", StageKind.LLM, deps, input_tokens=rng.randint(200, 2000), output_tokens=rng.randint(60, 300),
                 calls_per_request=1 if rng.random() < 0.85 else 2)


def _chain(rng: random.Random, wid: str, n: int) -> Workflow:
    return Workflow(wid, tuple(_stage(rng, i, (f"s{i - 1}",) if i else ()) for i in range(n)))


def _fan(rng: random.Random, width: int, small: bool) -> Workflow:
    """head -> `width` parallel stages -> join (a TOOL join at small size, to keep the space enumerable)."""
    st = [_stage(rng, 0, ())]
    st += [_stage(rng, i, ("s0",)) for i in range(1, width + 1)]
    st.append(_stage(rng, width + 1, tuple(f"s{i}" for i in range(1, width + 1)), tool=small))
    return Workflow(f"fan{width}", tuple(st))


def _dag(rng: random.Random, wid: str, n: int, tool_share: float) -> Workflow:
    """A random DAG: each stage depends on each earlier one with probability 0.35 (at least one when it is not
    the first); stages are listed in the order drawn, and a share of them are TOOL stages (never the first)."""
    st: list[Stage] = []
    for i in range(n):
        deps = tuple(f"s{j}" for j in range(i) if rng.random() < 0.35)
        if i and not deps:
            deps = (f"s{rng.randrange(i)}",)
        st.append(_stage(rng, i, deps, tool=i > 0 and rng.random() < tool_share))
    if not any(s.is_llm for s in st[1:]) and n > 1:  # keep at least two LLM stages
        st[-1] = _stage(rng, n - 1, st[-1].depends_on)
    return Workflow(wid, tuple(st))


def _fastest_latency(wf: Workflow, profiles: Sequence[Profile], models: Sequence[Model], alpha: float) -> float:
    """Longest path with every LLM stage at its fastest profile meeting alpha (capacity and placement aside)."""
    acc = {m.id: m.accuracy for m in models}
    ok = [p for p in profiles if acc.get(p.model_id, -1.0) >= alpha]
    fin: dict[str, float] = {}
    for i in wf.topo_order():
        s = wf.stages[i]
        lat = s.latency_s if not s.is_llm else min(
            (s.calls_per_request * p.call_latency_s(s.input_tokens, s.output_tokens) for p in ok), default=1.0)
        fin[s.id] = max((fin[d] for d in s.depends_on), default=0.0) + lat
    return max(fin.values())
