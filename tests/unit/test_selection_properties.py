"""Property tests: `exact` == `exhaustive` == an independent brute force written from spec/selection.md.

The brute force and the feasibility re-check below share no code with
flowmaker.selection: they re-implement the spec's rules (longest path,
capacity with the utilization cap, LeastLoaded placement, cost) from scratch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowmaker.domain import (
    CapacityModel,
    Cluster,
    Gpu,
    Infeasibility,
    Instance,
    Model,
    Profile,
    SelectionOptions,
    SelectionRequest,
    Slo,
    Stage,
    StageKind,
    Variant,
    Workflow,
)
from flowmaker.selection import select

REL = 1e-9


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(1.0, abs(a), abs(b))


# ---------------------------------------------------------------- random requests


@st.composite
def requests(draw: st.DrawFn) -> SelectionRequest:
    n_nodes = draw(st.integers(1, 3))
    gpus = []
    for n in range(n_nodes):
        for g in range(draw(st.sampled_from([1, 2, 4]))):
            total = 48.0
            used = draw(st.sampled_from([0.0, 0.0, 8.0, 20.0, 40.0]))
            gpus.append(Gpu(f"n{n}-g{g}", f"n{n}", total, used))
    models = [Model(f"m{i}", draw(st.sampled_from([0.1, 0.2, 0.3, 0.4])), 1.0 + i, 1.0 + i)
              for i in range(draw(st.integers(1, 3)))]
    profiles = []
    for m in models:
        for tp, pp in draw(st.lists(st.sampled_from([(1, 1), (2, 1), (1, 2), (4, 1)]), min_size=0, max_size=2,
                                    unique=True)):
            profiles.append(Profile(
                m.id, tp, pp,
                memory_gb_per_gpu=draw(st.sampled_from([4.0, 10.0, 20.0, 30.0, 45.0])),
                fixed_s=draw(st.sampled_from([0.0, 0.01, 0.05])),
                prefill_s_per_token=draw(st.sampled_from([1e-5, 1e-4, 5e-4])),
                decode_s_per_token=draw(st.sampled_from([0.005, 0.01, 0.03])),
                max_output_tokens_per_s=draw(st.sampled_from([40.0, 200.0, 1000.0]))))
    instances = []
    for i in range(draw(st.integers(0, 2))):
        if not profiles:
            break
        p = draw(st.sampled_from(profiles))
        k = p.tp * p.pp
        node_gpus = [g for g in gpus if g.node == gpus[0].node][:k]
        if len(node_gpus) < k:
            continue
        instances.append(Instance(f"inst{i}", p.model_id, p.tp, p.pp, tuple(g.id for g in node_gpus),
                                  draw(st.sampled_from([0.0, 20.0, 150.0]))))
    workflows = []
    for w in range(draw(st.integers(1, 2))):
        stages: list[Stage] = []
        for k in range(draw(st.integers(1, 3))):
            deps = tuple(s.id for s in stages if draw(st.booleans()))
            if draw(st.integers(0, 4)) == 0:
                stages.append(Stage(f"s{k}", StageKind.TOOL, deps, latency_s=draw(st.sampled_from([0.0, 0.2, 1.0]))))
            else:
                stages.append(Stage(f"s{k}", StageKind.LLM, deps, draw(st.sampled_from([50, 500, 2000])),
                                    draw(st.sampled_from([10, 100, 300])), draw(st.sampled_from([1, 1, 2]))))
        if not any(s.is_llm for s in stages):
            stages.append(Stage("last", StageKind.LLM, (stages[-1].id,), 100, 50))
        workflows.append(Workflow(f"w{w}", tuple(stages)))
    slo = Slo(draw(st.sampled_from([0.0, 0.15, 0.25, 0.35, 0.5])), draw(st.sampled_from([0.5, 2.0, 5.0, 20.0])),
              draw(st.sampled_from([0.0, 0.1, 0.5, 2.0])))
    opts = SelectionOptions(utilization_cap=draw(st.sampled_from([1.0, 0.7])), allow_reuse=draw(st.booleans()),
                            gpu_price_gb=draw(st.sampled_from([0.0, 0.0, 0.0, 10.0, 48.0, 0.1])))
    return SelectionRequest(slo, tuple(workflows), tuple(models), tuple(profiles), Cluster(tuple(gpus),
                            tuple(instances)), opts)


# ---------------------------------------------------------------- independent spec implementation


def topo(wf: Workflow) -> list[Stage]:
    taken: list[Stage] = []
    left = list(wf.stages)
    while left:
        nxt = next(s for s in left if all(d in {t.id for t in taken} for d in s.depends_on))
        taken.append(nxt)
        left.remove(nxt)
    return taken


def stage_latency(stage: Stage, prof: Profile) -> float:
    return stage.calls_per_request * (prof.fixed_s + prof.prefill_s_per_token * stage.input_tokens
                                      + prof.decode_s_per_token * stage.output_tokens)


def longest(wf: Workflow, lat: dict[str, float]) -> float:
    fin: dict[str, float] = {}
    for s in topo(wf):
        fin[s.id] = max((fin[d] for d in s.depends_on), default=0.0) + lat[s.id]
    return max(fin.values())


def units(gb: float) -> int:
    """The spec's memory unit, 1e-6 GB: every memory figure is rounded to the nearest one first."""
    return round(gb * 1_000_000)


def spec_free(req: SelectionRequest) -> dict[str, int]:
    return {g.id: units(g.memory_total_gb) - units(g.memory_used_gb) for g in req.cluster.gpus}


def spec_place(gpus: list[Gpu], free: dict[str, int], k: int, mem: float) -> tuple[str, list[str]] | None:
    """LeastLoaded (Feasibility 4) on free memory in units; `mem` in GB."""
    need = units(mem)
    cands = []
    for node in sorted({g.node for g in gpus}):
        ids = sorted((g.id for g in gpus if g.node == node), key=lambda i: (-free[i], i))[:k]
        if len(ids) == k and all(free[i] >= need for i in ids):
            cands.append((-free[ids[-1]], node, ids))
    if not cands:
        return None
    cands.sort()
    return cands[0][1], cands[0][2]


def capacity(req: SelectionRequest, wf: Workflow, p: Profile) -> float:
    """Output tokens/s one instance of p carries for wf: the base contract's figure, or under BUSY_TIME the
    spec's out_w / (in_w * prefill_s_per_token + out_w / D(p)) at the workflow's mean request."""
    if req.options.capacity_model is not CapacityModel.BUSY_TIME:
        return p.max_output_tokens_per_s
    calls = [s for s in wf.stages if s.is_llm]
    n = sum(s.calls_per_request for s in calls)
    in_w = sum(s.calls_per_request * s.input_tokens for s in calls) / n
    out_w = sum(s.calls_per_request * s.output_tokens for s in calls) / n
    d = p.decode_tokens_per_s if p.decode_tokens_per_s > 0 else p.max_output_tokens_per_s
    return out_w / (in_w * p.prefill_s_per_token + out_w / d)


def existing(req: SelectionRequest, wf: Workflow, p: Profile, load: float) -> float:
    """A running instance's load in wf's units: its busy fraction kept (unchanged in the base contract)."""
    return load * capacity(req, wf, p) / p.max_output_tokens_per_s


Encoding = tuple[int, tuple[tuple[int, ...], ...]]  # (workflow position, per LLM stage its entry)


def brute_force(req: SelectionRequest) -> tuple[tuple[float, float, int] | None, int]:
    """((cost, L, new GPUs) of the optimum or None, tightest failed constraint 1..4 / 5 feasible)."""
    best, level, _ = brute_force_canonical(req)
    return best, level


def canonical_of(feasible: list[tuple[float, float, int, Encoding]]) -> Encoding | None:
    """The spec's canonical answer among feasible variants (listed in any order): c* the least cost; among
    costs within 1e-12 relative of it the least L; among those also within 1e-12 of L* the fewest new GPUs;
    of the variants left, the least (workflow position, encoding)."""
    if not feasible:
        return None
    c = min(f[0] for f in feasible)
    a = [f for f in feasible if f[0] <= c * (1 + 1e-12)]
    L = min(f[1] for f in a)
    b = [f for f in a if f[1] <= L * (1 + 1e-12)]
    g = min(f[2] for f in b)
    return min(f[3] for f in b if f[2] == g)


def brute_force_canonical(req: SelectionRequest) -> tuple[tuple[float, float, int] | None, int, Encoding | None]:
    """`brute_force`, and the canonical variant's encoding (docs/selection-spec.md, "Cost")."""
    R = req.options.max_replicas
    pos_i = {i.id: n for n, i in enumerate(req.cluster.instances)}
    pos_p = {(p.model_id, p.tp, p.pp): n for n, p in enumerate(req.profiles)}
    feasible: list[tuple[float, float, int, Encoding]] = []
    prof = {(p.model_id, p.tp, p.pp): p for p in req.profiles if p.model_id in {m.id for m in req.models}}
    acc = {m.id: m.accuracy for m in req.models}
    reuse = [i for i in req.cluster.instances if (i.model_id, i.tp, i.pp) in prof] if req.options.allow_reuse else []
    groups_of = [(p, r) for p in prof.values() for r in range(1, R + 1)]
    best: tuple[float, float, int] | None = None
    level = 1
    for wi, wf in enumerate(req.workflows):
        llm = [s for s in topo(wf) if s.is_llm]

        def gen(j: int, ch: list, n_open: int, llm: list[Stage] = llm):
            if j == len(llm):
                yield list(ch)
                return
            for o in ([("R", r) for r in range(len(reuse))] + [("J", g) for g in range(n_open)]
                      + [("O", g) for g in groups_of]):
                ch.append(o)
                yield from gen(j + 1, ch, n_open + (o[0] == "O"))
                ch.pop()

        for ch in gen(0, [], 0):
            groups: list[tuple[Profile, int]] = []
            where: list[tuple[str, int]] = []
            for kind, ref in ch:
                if kind == "O":
                    groups.append(ref)
                    where.append(("N", len(groups) - 1))
                elif kind == "J":
                    where.append(("N", ref))
                else:
                    where.append(("R", ref))
            models = [reuse[r].model_id if k == "R" else groups[r][0].model_id for k, r in where]
            if any(acc[m] < req.slo.min_accuracy for m in models):
                continue
            level = max(level, 2)
            lat = {s.id: s.latency_s for s in wf.stages if not s.is_llm}
            loads: dict[tuple[str, int], float] = {}
            for s, (k, r) in zip(llm, where, strict=True):
                p = prof[(reuse[r].model_id, reuse[r].tp, reuse[r].pp)] if k == "R" else groups[r][0]
                lat[s.id] = stage_latency(s, p)  # a call runs on one replica
                loads[(k, r)] = loads.get((k, r), 0.0) + req.slo.arrival_rate_rps * s.calls_per_request * \
                    s.output_tokens
            L = longest(wf, lat)
            if L > req.slo.max_latency_s * (1 + 1e-9):
                continue
            level = max(level, 3)
            ok = True
            for (k, r), ld in loads.items():
                if k == "R":
                    i = reuse[r]
                    p = prof[(i.model_id, i.tp, i.pp)]
                    tot, cap = ld + existing(req, wf, p, i.load_output_tokens_per_s), capacity(req, wf, p)
                else:
                    p, n = groups[r]
                    tot, cap = ld, n * capacity(req, wf, p)  # r replicas carry r times one
                if tot > req.options.utilization_cap * cap * (1 + 1e-9) + 1e-9:
                    ok = False
            if not ok:
                continue
            level = max(level, 4)
            free = spec_free(req)
            for p, n in groups:
                for _ in range(n):  # replica after replica, in the group's place in the order
                    pl = spec_place(list(req.cluster.gpus), free, p.tp * p.pp, p.memory_gb_per_gpu)
                    if pl is None:
                        ok = False
                        break
                    for g in pl[1]:
                        free[g] -= units(p.memory_gb_per_gpu)
                if not ok:
                    break
            if not ok:
                continue
            level = 5
            # the priced-GPUs extension: each GPU charged its memory plus gpu_price_gb (0: the base contract)
            cost = sum(n * p.tp * p.pp * (p.memory_gb_per_gpu + req.options.gpu_price_gb) for p, n in groups) * L
            gpus = sum(n * p.tp * p.pp for p, n in groups)
            key = (cost, L, gpus)
            enc = tuple((0, pos_i[reuse[ref].id]) if kind == "R" else (1, ref) if kind == "J"
                        else (2, pos_p[(ref[0].model_id, ref[0].tp, ref[0].pp)], ref[1]) for kind, ref in ch)
            if best is None or cost <= best[0] * (1 + 1e-9):
                feasible.append((cost, L, gpus, (wi, enc)))
            if (best is None or cost < best[0] - REL * max(1, cost)
                    or (close(cost, best[0]) and (L < best[1] - REL * max(1, L)
                                                  or (close(L, best[1]) and gpus < best[2])))):
                best = key
    if best is not None:
        feasible = [f for f in feasible if f[0] <= best[0] * (1 + 1e-9)]
    return best, level, canonical_of(feasible)


def encoding(req: SelectionRequest, v: Variant) -> Encoding:
    """A returned variant in the canonical order's terms: per LLM stage in topological order (0, position of
    the reused instance), (1, group number) for a new instance opened earlier, (2, profile position, replicas)
    for a new one it opens."""
    wi = next(n for n, w in enumerate(req.workflows) if w.id == v.workflow_id)
    pos_i = {i.id: n for n, i in enumerate(req.cluster.instances)}
    pos_p = {(p.model_id, p.tp, p.pp): n for n, p in enumerate(req.profiles)}
    by_stage = {a.stage_id: a for a in v.assignments}
    groups: dict[str, int] = {}
    out: list[tuple[int, ...]] = []
    for s in topo(req.workflows[wi]):
        a = by_stage.get(s.id)
        if a is None:
            continue
        if a.reused:
            out.append((0, pos_i[a.instance_id]))
        elif a.new_key in groups:
            out.append((1, groups[a.new_key]))
        else:
            groups[a.new_key] = len(groups)
            out.append((2, pos_p[(a.model_id, a.tp, a.pp)], len(a.replica_keys) or 1))
    return wi, tuple(out)


def recheck(req: SelectionRequest, v: Variant) -> None:
    """Independent feasibility re-check of a returned variant (the base contract and its extensions)."""
    wf = next(w for w in req.workflows if w.id == v.workflow_id)
    prof = {(p.model_id, p.tp, p.pp): p for p in req.profiles}
    acc = {m.id: m.accuracy for m in req.models}
    insts = {i.id: i for i in req.cluster.instances}
    news = {n.key: n for n in v.new_instances}
    assert len(news) == len(v.new_instances)
    by_stage = {a.stage_id: a for a in v.assignments}
    assert sorted(by_stage) == sorted(s.id for s in wf.stages if s.is_llm)
    lat = {s.id: s.latency_s for s in wf.stages if not s.is_llm}
    group_load: dict[tuple[str, ...], float] = {}
    reuse_load: dict[str, float] = {}
    for s in wf.stages:
        if not s.is_llm:
            continue
        a = by_stage[s.id]
        assert acc[a.model_id] >= req.slo.min_accuracy
        lat[s.id] = stage_latency(s, prof[(a.model_id, a.tp, a.pp)])
        ld = req.slo.arrival_rate_rps * s.calls_per_request * s.output_tokens
        if a.reused:
            assert req.options.allow_reuse and not a.replica_keys
            i = insts[a.instance_id]
            assert (i.model_id, i.tp, i.pp) == (a.model_id, a.tp, a.pp)
            reuse_load[a.instance_id] = reuse_load.get(a.instance_id, 0.0) + ld
            continue
        keys = a.replica_keys or (a.new_key,)
        assert keys[0] == a.new_key and len(keys) <= req.options.max_replicas
        assert all((news[k].model_id, news[k].tp, news[k].pp) == (a.model_id, a.tp, a.pp) for k in keys)
        group_load[keys] = group_load.get(keys, 0.0) + ld
    L = longest(wf, lat)
    assert close(L, v.latency_s) and L <= req.slo.max_latency_s * (1 + 1e-9)
    # Groups are disjoint, cover every new instance, and each replica carries load / r.
    assert sorted(k for ks in group_load for k in ks) == sorted(news)
    for keys, ld in group_load.items():
        cap = capacity(req, wf, prof[(news[keys[0]].model_id, news[keys[0]].tp, news[keys[0]].pp)])
        assert ld <= req.options.utilization_cap * len(keys) * cap * (1 + 1e-9) + 1e-9
        for k in keys:
            assert close(news[k].load_output_tokens_per_s, ld / len(keys))
    for iid, ld in reuse_load.items():
        i = insts[iid]
        p = prof[(i.model_id, i.tp, i.pp)]
        assert ld + existing(req, wf, p, i.load_output_tokens_per_s) <= (
            req.options.utilization_cap * capacity(req, wf, p) * (1 + 1e-9) + 1e-9)
    # Placement order: groups by first use in topological order, each group's replicas consecutively.
    order: list[str] = []
    for s in topo(wf):
        got = by_stage.get(s.id)
        if got is not None and not got.reused and got.new_key not in order:
            order.extend(got.replica_keys or (got.new_key,))
    assert order == [n.key for n in v.new_instances]
    free = spec_free(req)
    for key in order:  # every placement re-derived from the spec's LeastLoaded, GPU for GPU
        n = news[key]
        pl = spec_place(list(req.cluster.gpus), free, n.tp * n.pp, n.memory_gb_per_gpu)
        assert pl is not None and (pl[0], tuple(pl[1])) == (n.node, n.gpu_ids)
        for g in pl[1]:
            free[g] -= units(n.memory_gb_per_gpu)
    mem = sum(n.memory_gb_per_gpu * n.tp * n.pp for n in v.new_instances)
    priced = sum((n.memory_gb_per_gpu + req.options.gpu_price_gb) * n.tp * n.pp for n in v.new_instances)
    assert close(mem, v.new_memory_gb) and close(priced * L, v.cost)
    assert v.new_gpus == sum(n.tp * n.pp for n in v.new_instances)


CANONICAL = ("exact", "milp", "exhaustive")  # the strategies that return the canonical optimum
LEVEL = {1: Infeasibility.NO_MODEL_MEETS_ACCURACY, 2: Infeasibility.NO_LATENCY, 3: Infeasibility.NO_CAPACITY,
         4: Infeasibility.NO_GPU_MEMORY}


def agree(req: SelectionRequest, strategies: tuple[str, ...] = ("exact", "exhaustive"), *,
          proven: bool = False) -> None:
    """Each strategy's answer has the brute force's (cost, L, new GPUs), or the same reason; `proven`: it
    also says it proved it (optimal, lower bound = cost)."""
    want, level, canon = brute_force_canonical(req)
    for name in strategies:
        res = select(req, name)
        assert res.optimal or not proven, name
        if want is None:
            assert res.variant is None and res.reason == LEVEL[level], (name, res.reason, level)
            continue
        assert res.variant is not None, name
        v = res.variant
        assert close(v.cost, want[0]), (name, v.cost, want)
        assert close(v.latency_s, want[1]), (name, v.latency_s, want)
        assert v.new_gpus == want[2], (name, v.new_gpus, want)
        assert close(res.lower_bound, v.cost) or not proven, (name, res.lower_bound, v.cost)
        recheck(req, v)
        if res.optimal and name in CANONICAL:  # ties beyond (cost, L, new GPUs): the canonical variant
            assert encoding(req, v) == canon, (name, encoding(req, v), canon)



@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_exact_equals_exhaustive_equals_brute_force(req: SelectionRequest) -> None:
    agree(req)


def test_a_profile_harder_to_place_is_not_dominated_by_one_of_less_memory() -> None:
    """A tp1 of 30 GB has less memory, fewer GPUs and the latency and capacity of a tp2 of 16 GB a GPU, but only one
    GPU has 30 GB free: the two stages (each too heavy to share an instance) need one of each. `milp`'s relaxation
    used to drop the tp2 as dominated and then claim NO_GPU_MEMORY, proven (its room rows hold one tp1)."""
    wf = Workflow("w", (Stage("a", input_tokens=50, output_tokens=100), Stage("b", input_tokens=50, output_tokens=100)))
    profiles = (Profile("m", 1, 1, 30.0, 0.0, 1e-5, 0.005, 200.0), Profile("m", 2, 1, 16.0, 0.0, 1e-5, 0.005, 200.0))
    gpus = (Gpu("g0", "n0", 48.0, 0.0), *(Gpu(f"g{i}", "n0", 48.0, 28.0) for i in range(1, 4)))
    req = SelectionRequest(Slo(0.1, 2.0, 1.5), (wf,), (Model("m", 0.5, 7.0, 7.0),), profiles, Cluster(gpus))
    for name in ("exact", "milp", "exhaustive"):
        v = select(req, name).variant
        assert v is not None and sorted(a.tp for a in v.assignments) == [1, 2], name
    agree(req, ("exact", "milp", "exhaustive"), proven=True)


def _priced(req: SelectionRequest, price: float) -> SelectionRequest:
    return dataclasses.replace(req, options=dataclasses.replace(req.options, gpu_price_gb=price))


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(_priced, requests(), st.sampled_from([0.5, 8.0, 48.0, 80.0, 400.0])))
def test_priced_gpus_exact_milp_and_exhaustive_equal_the_brute_force(req: SelectionRequest) -> None:
    """The priced-GPUs extension: every new GPU adds gpu_price_gb to the memory the objective charges."""
    agree(req, ("exact", "milp", "exhaustive"))


def test_a_priced_gpu_turns_the_choice_from_wide_to_narrow() -> None:
    """One stage of 100 output tokens, a 14B-like model as tp1 (38 GB, 6.0 s) or tp4 (11 GB per GPU, 1.8 s).
    Memory x latency prefers the tp4 (44 x 1.8 = 79.2 against 38 x 6.0 = 228). Priced at P GB a GPU the tp4 costs
    (44 + 4P) x 1.8 and the tp1 (38 + P) x 6.0: they cross at P = (228 - 79.2) / (7.2 - 6.0) = 124 GB, above which
    the tp1 wins. The answer reports the memory it holds either way."""
    wf = Workflow("w", (Stage("a", input_tokens=1, output_tokens=100),))  # prefill costs nothing here
    models = (Model("m", 0.5, 14.0, 14.0),)
    profiles = (Profile("m", 1, 1, 38.0, 0.0, 0.0, 0.060, 1000.0), Profile("m", 4, 1, 11.0, 0.0, 0.0, 0.018, 1000.0))
    gpus = tuple(Gpu(f"g{i}", "n0", 48.0) for i in range(4))
    base = SelectionRequest(Slo(0.1, 100.0, 0.0), (wf,), models, profiles, Cluster(gpus))
    crossing = (38 * 6.0 - 44 * 1.8) / (4 * 1.8 - 6.0)
    for price, tp in ((0.0, 4), (48.0, 4), (crossing * 0.99, 4), (crossing * 1.01, 1), (400.0, 1)):
        req = _priced(base, price)
        for name in ("exact", "milp", "exhaustive"):
            res = select(req, name)
            v = res.variant
            assert v is not None and res.optimal and v.assignments[0].tp == tp, (price, name)
            assert close(v.new_memory_gb, 38.0 if tp == 1 else 44.0)
            assert close(v.cost, (v.new_memory_gb + price * tp) * v.latency_s), (price, name, v.cost)
        agree(req, ("exact", "milp", "exhaustive"), proven=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_heuristic_answers_are_feasible_and_never_beat_exact(req: SelectionRequest) -> None:
    ex = select(req, "exact")
    h = select(req, "heuristic")
    if h.variant is not None:
        recheck(req, h.variant)
        assert ex.variant is not None
        assert h.variant.cost >= ex.variant.cost * (1 - 1e-9) - 1e-12


def _chain_request(rate: float = 0.0, allow_reuse: bool = True, instances: tuple[Instance, ...] = ()
                   ) -> SelectionRequest:
    wf = Workflow("chain", (Stage("a", input_tokens=100, output_tokens=100),
                            Stage("b", depends_on=("a",), input_tokens=100, output_tokens=100)))
    models = (Model("small", 0.3, 1.0, 1.0), Model("big", 0.45, 10.0, 10.0))
    profiles = (Profile("small", 1, 1, 10.0, 0.0, 0.0, 0.01, 1000.0),
                Profile("big", 1, 1, 30.0, 0.0, 0.0, 0.02, 1000.0))
    gpus = tuple(Gpu(f"g{i}", "n0", 48.0) for i in range(2))
    return SelectionRequest(Slo(0.25, 10.0, rate), (wf,), models, profiles, Cluster(gpus, instances),
                            SelectionOptions(allow_reuse=allow_reuse))


def test_in_variant_sharing_is_chosen_when_capacity_allows() -> None:
    res = select(_chain_request(rate=1.0), "exact")
    assert res.variant is not None
    assert len(res.variant.new_instances) == 1  # both stages on one new "small" instance
    assert res.variant.new_instances[0].model_id == "small"
    assert close(res.variant.cost, 10.0 * 2.0)  # 10 GB * (1 s + 1 s)


def test_sharing_stops_at_the_utilization_cap() -> None:
    # 6 req/s * 100 tokens = 600 tok/s per stage; two stages = 1200 > 1000: two instances needed.
    res = select(_chain_request(rate=6.0), "exact")
    assert res.variant is not None and len(res.variant.new_instances) == 2


def test_reuse_costs_nothing_and_respects_allow_reuse() -> None:
    inst = (Instance("running-small", "small", 1, 1, ("g0",), 0.0),)
    res = select(_chain_request(instances=inst), "exact")
    assert res.variant is not None and res.variant.cost == 0.0
    assert {a.instance_id for a in res.variant.assignments} == {"running-small"}
    res2 = select(_chain_request(instances=inst, allow_reuse=False), "exact")
    assert res2.variant is not None and res2.variant.cost > 0


def test_unknown_strategy_is_a_clear_error() -> None:
    from flowmaker.errors import InvalidSpec
    from flowmaker.rpc.errors import code_of
    with pytest.raises(InvalidSpec, match="unknown selection strategy") as e:
        select(_chain_request(), "nope")
    assert code_of(e.value).name == "INVALID_ARGUMENT" and e.value.field == "strategy"
    assert e.value.reason == "UNKNOWN_STRATEGY"


def test_invalid_request_names_the_field() -> None:
    from flowmaker.errors import InvalidSpec
    bad = dataclasses.replace(_chain_request(), slo=Slo(45.0, 10.0, 0.0))
    with pytest.raises(InvalidSpec) as e:
        select(bad, "exact")
    assert e.value.field == "slo.min_accuracy"


def test_infeasible_reasons_tightest_first() -> None:
    base = _chain_request()
    r = dataclasses.replace(base, slo=Slo(0.9, 10.0, 0.0))
    assert select(r, "exact").reason is Infeasibility.NO_MODEL_MEETS_ACCURACY
    r = dataclasses.replace(base, slo=Slo(0.25, 0.5, 0.0))
    assert select(r, "exact").reason is Infeasibility.NO_LATENCY
    r = dataclasses.replace(base, slo=Slo(0.25, 10.0, 50.0))
    assert select(r, "exact").reason is Infeasibility.NO_CAPACITY
    full = Cluster(tuple(Gpu(f"g{i}", "n0", 48.0, 45.0) for i in range(2)))
    r = dataclasses.replace(base, cluster=full)
    assert select(r, "exact").reason is Infeasibility.NO_GPU_MEMORY


def test_search_space_matches_the_published_count_without_reuse_or_sharing() -> None:
    """The published example: 3 workflows of 1, 2, 2 LLM stages, 11 models x 10 configs: 110 + 2*110^2
    variants without sharing; with in-variant sharing each 2-stage workflow adds 110 more."""
    from flowmaker.selection.problem import Problem
    models = tuple(Model(f"m{i}", 0.5, 1.0, 1.0) for i in range(11))
    profiles = tuple(Profile(m.id, tp, pp, 1.0, 0.0, 0.0, 0.01, 100.0) for m in models
                     for tp, pp in [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)])
    one = Workflow("w1", (Stage("a", input_tokens=1, output_tokens=1),))
    two = Workflow("w2", (Stage("a", input_tokens=1, output_tokens=1),
                          Stage("b", depends_on=("a",), input_tokens=1, output_tokens=1)))
    two_b = dataclasses.replace(two, id="w3")
    req = SelectionRequest(Slo(0.1, 1.0, 0.0), (one, two, two_b), models, profiles, Cluster())
    assert Problem(req).total_space() == 110 + 2 * (110 ** 2 + 110)
    assert 110 + 2 * 110 ** 2 == 24_310
    assert math.isfinite(float(Problem(req).total_space()))


def test_bayesopt_returns_a_feasible_variant_no_better_than_exact() -> None:
    pytest.importorskip("skopt")
    req = dataclasses.replace(_chain_request(rate=1.0), options=SelectionOptions(max_trials=25, seed=1))
    bo = select(req, "bayesopt")
    ex = select(req, "exact")
    assert bo.variant is not None and ex.variant is not None
    recheck(req, bo.variant)
    assert bo.variant.cost >= ex.variant.cost * (1 - 1e-9)
    assert bo.variants_evaluated == 25


def test_exhaustive_reports_timeout() -> None:
    req = dataclasses.replace(_chain_request(), options=SelectionOptions(time_budget_s=1e-9))
    big = dataclasses.replace(req, workflows=tuple(
        Workflow(f"w{i}", tuple(Stage(f"s{k}", input_tokens=10, output_tokens=10,
                                      depends_on=(f"s{k-1}",) if k else ()) for k in range(6)))
        for i in range(3)))
    res = select(big, "exhaustive")
    assert res.timed_out





# ---------------------------------------------------------------- harder instances: clones, tight reuse, capacity


@st.composite
def dense_requests(draw: st.DrawFn) -> SelectionRequest:
    """Small enough for the brute force, but with what makes `exact` prune: near-identical and identical
    model clones, several running instances with spare room for about one stage, loads that need more than
    one new instance, fans and chains, a utilization cap of 0.5."""
    gpus = [Gpu(f"n{n}-g{g}", f"n{n}", 48.0, draw(st.sampled_from([0.0, 0.0, 10.0, 30.0, 46.0])))
            for n in range(draw(st.integers(1, 2))) for g in range(4)]
    base = [Profile("a", 1, 1, 10.0, 0.01, 1e-4, 0.01, 300.0), Profile("a", 2, 1, 6.0, 0.01, 6e-5, 0.006, 420.0),
            Profile("b", 1, 1, 20.0, 0.02, 2e-4, 0.02, 500.0), Profile("b", 4, 1, 8.0, 0.01, 8e-5, 0.008, 900.0),
            # slow but with a large capacity: on no latency front, only on the capacity front
            Profile("a", 1, 2, 7.0, 0.05, 3e-4, 0.03, 1500.0)]
    models = [Model("a", 0.3, 3.0, 3.0), Model("b", 0.4, 8.0, 8.0)]
    profiles = list(base)
    for c in range(draw(st.integers(0, 2))):
        src = draw(st.sampled_from(base))
        f = draw(st.sampled_from([1.0, 1.0, 0.99, 1.01]))
        cid = f"{src.model_id}-clone{c}"
        if cid not in {m.id for m in models}:
            models.append(Model(cid, draw(st.sampled_from([0.3, 0.4])), 3.0, 3.0))
        profiles.append(dataclasses.replace(src, model_id=cid, fixed_s=src.fixed_s * f,
                                            decode_s_per_token=src.decode_s_per_token * f,
                                            max_output_tokens_per_s=src.max_output_tokens_per_s / f))
    profiles = list({p.key: p for p in profiles}.values())
    instances = []
    for i in range(draw(st.integers(0, 5))):
        p = draw(st.sampled_from(profiles))
        node_gpus = [g for g in gpus if g.node == "n0"][:p.tp * p.pp]
        instances.append(Instance(f"run{i}", p.model_id, p.tp, p.pp, tuple(g.id for g in node_gpus),
                                  p.max_output_tokens_per_s * draw(st.sampled_from([0.1, 0.3, 0.4, 0.45, 0.9]))))
    n = draw(st.integers(2, 3))
    fan = draw(st.booleans())
    stages = []
    for k in range(n):
        deps = (() if k == 0 else ("s0",) if fan and k < n - 1 else (f"s{k - 1}",) if not fan
                else tuple(f"s{i}" for i in range(1, n - 1)) or ("s0",))
        stages.append(Stage(f"s{k}", StageKind.LLM, deps, draw(st.sampled_from([100, 1000])),
                            draw(st.sampled_from([50, 100, 150]))))
    wf = Workflow("w", tuple(stages))
    slo = Slo(draw(st.sampled_from([0.25, 0.35])), draw(st.sampled_from([1.5, 3.0, 6.0])),
              draw(st.sampled_from([0.5, 1.0, 2.0])))
    return SelectionRequest(slo, (wf,), tuple(models), tuple(profiles), Cluster(tuple(gpus), tuple(instances)),
                            SelectionOptions(utilization_cap=draw(st.sampled_from([0.5, 1.0]))))


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(dense_requests())
def test_exact_equals_brute_force_with_clones_reuse_and_tight_capacity(req: SelectionRequest) -> None:
    agree(req, ("exact",), proven=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests()), st.integers(0, 12))
def test_a_stopped_search_keeps_a_feasible_incumbent_and_a_valid_lower_bound(req: SelectionRequest,
                                                                             limit: int) -> None:
    """The anytime contract: stopped after `limit` search nodes, exact's incumbent is feasible and costs at
    least the optimum, and its lower bound is at most the optimum."""
    from flowmaker.selection.exact import solve
    from flowmaker.selection.problem import Problem

    want, _ = brute_force(req)
    pb = Problem(req)
    s = solve(pb, max_nodes=limit)
    if want is None:
        assert s.best is None
        return
    assert s.lower_bound <= want[0] * (1 + 1e-9) + 1e-12, (s.lower_bound, want)
    if s.best_at is not None:
        res = pb.result("exact", s.best_at, 0.0, s.leaves, timed_out=s.stopped, optimal=not s.stopped,
                        lower_bound=s.lower_bound)
        assert res.variant is not None
        recheck(req, res.variant)
        assert res.variant.cost >= want[0] * (1 - 1e-9) - 1e-12
        assert res.lower_bound <= res.variant.cost
        assert res.gap is not None and res.gap >= 0.0
    if not s.stopped:
        assert s.best is not None and close(s.best[0], want[0])


def test_exact_without_time_to_find_anything_raises_deadline_exceeded() -> None:
    from flowmaker.errors import DeadlineExceeded
    req = dataclasses.replace(_chain_request(rate=1.0), options=SelectionOptions(time_budget_s=1e-9))
    with pytest.raises(DeadlineExceeded) as e:
        select(req, "exact")
    assert e.value.reason == "SELECTION_DEADLINE_EXCEEDED"


def test_exact_proves_its_answers() -> None:
    res = select(_chain_request(rate=1.0), "exact")
    assert res.optimal and res.variant is not None and not res.timed_out
    assert res.lower_bound == res.variant.cost and res.gap == 0.0
    infeasible = select(dataclasses.replace(_chain_request(), slo=Slo(0.9, 10.0, 0.0)), "exact")
    assert infeasible.optimal and infeasible.variant is None
    assert not select(_chain_request(rate=1.0), "heuristic").optimal


def test_spare_room_of_a_running_instance_for_one_stage_only_is_not_a_capacity_failure() -> None:
    """Regression: a running instance with room for one of two stages, the other on a new instance of the same
    profile (the memory classes of the bound had equal latencies but different capacity)."""
    wf = Workflow("w0", (Stage("s0", StageKind.LLM, (), 50, 100, 1), Stage("s1", StageKind.LLM, (), 50, 100, 2)))
    models = (Model("m0", 0.1, 1.0, 1.0), Model("m1", 0.1, 2.0, 2.0))
    profiles = (Profile("m0", 2, 1, 4.0, 0.0, 1e-5, 0.005, 200.0), Profile("m1", 1, 1, 4.0, 0.0, 1e-5, 0.005, 40.0))
    gpus = tuple(Gpu(f"n0-g{i}", "n0", 48.0) for i in range(4))
    running = (Instance("inst0", "m0", 2, 1, ("n0-g0", "n0-g1"), 0.0),)
    req = SelectionRequest(Slo(0.0, 2.0, 0.5), (wf,), models, profiles, Cluster(gpus, running),
                           SelectionOptions(utilization_cap=0.7))
    res = select(req, "exact")
    assert res.variant is not None and close(res.variant.cost, 8.0 * 1.001)
    recheck(req, res.variant)


def test_dominated_clone_profiles_are_not_needed_for_the_optimum() -> None:
    """An identical clone and a slower clone of the cheapest profile change nothing: same cost and latency."""
    base = _chain_request(rate=1.0)
    clone = Model("small-clone", 0.3, 1.0, 1.0)
    profs = (*base.profiles, dataclasses.replace(base.profiles[0], model_id="small-clone"),
             dataclasses.replace(base.profiles[0], model_id="small-slow", decode_s_per_token=0.011))
    req = dataclasses.replace(base, models=(*base.models, clone, Model("small-slow", 0.3, 1.0, 1.0)),
                              profiles=profs)
    a, b = select(base, "exact"), select(req, "exact")
    assert a.variant is not None and b.variant is not None
    assert close(a.variant.cost, b.variant.cost) and close(a.variant.latency_s, b.variant.latency_s)
    assert b.variant.new_instances[0].model_id == "small"  # the lower index wins a tie


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests()))
def test_exact_with_the_lp_bound_at_every_node_equals_brute_force(req: SelectionRequest) -> None:
    """The LP relaxation (HiGHS) is otherwise used only at the root and in long searches: force it everywhere."""
    from flowmaker.selection import exact

    saved = exact.LP_AFTER_NODES
    exact.LP_AFTER_NODES = 0
    try:
        res = select(req, "exact")
    finally:
        exact.LP_AFTER_NODES = saved
    want, level = brute_force(req)
    if want is None:
        assert res.variant is None and res.reason == LEVEL[level]
    else:
        assert res.variant is not None
        assert close(res.variant.cost, want[0]) and close(res.variant.latency_s, want[1]), (res.variant, want)
        recheck(req, res.variant)


def test_a_class_whose_new_option_relaxes_priced_capacity_is_not_skipped() -> None:
    """Regression (found by the dense property test): two running instances with room for one stage each and
    no faster new option at first: the all-free class fails on capacity, and the class where a new `a` tp2
    instance becomes available must still be evaluated although no stage latency improves."""
    wf = Workflow("w", tuple(Stage(f"s{k}", StageKind.LLM, (f"s{k - 1}",) if k else (), 100, 150)
                             for k in range(3)))
    models = (Model("a", 0.3, 3.0, 3.0), Model("b", 0.4, 8.0, 8.0))
    profiles = (Profile("a", 1, 1, 10.0, 0.01, 1e-4, 0.01, 300.0), Profile("a", 2, 1, 6.0, 0.01, 6e-5, 0.006, 420.0),
                Profile("b", 1, 1, 20.0, 0.02, 2e-4, 0.02, 500.0), Profile("b", 4, 1, 8.0, 0.01, 8e-5, 0.008, 900.0),
                Profile("a", 1, 2, 7.0, 0.05, 3e-4, 0.03, 1500.0))
    gpus = tuple(Gpu(f"n0-g{i}", "n0", 48.0) for i in range(4))
    running = tuple(Instance(f"run{i}", "a", 1, 1, ("n0-g0",), 30.0) for i in range(2))
    req = SelectionRequest(Slo(0.25, 3.0, 0.5), (wf,), models, profiles, Cluster(gpus, running),
                           SelectionOptions(utilization_cap=0.5))
    want, _ = brute_force(req)
    res = select(req, "exact")
    assert want is not None and res.variant is not None
    assert close(res.variant.cost, want[0]) and close(res.variant.latency_s, want[1])
    recheck(req, res.variant)


# ---------------------------------------------------------------- the MILP Pareto walk (strategy `milp`, and `exact` on hard requests)


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests()))
def test_milp_equals_brute_force(req: SelectionRequest) -> None:
    """`milp` (the Pareto walk first, branch and bound for what it leaves open) == the brute force, including
    the tie-break by latency, placement-infeasible optima of the relaxation and all-reuse optima."""
    agree(req, ("milp",), proven=True)



def _recheck_candidates(req: SelectionRequest, pb: Any, pw: Any, candidates: Any, want: Any) -> None:
    """Every incumbent a Pareto or chain walk offers is a feasible variant of its stated cost, never below the
    optimum."""
    for sc, choice, slots, places in candidates:
        v = pb.build_variant(pw, choice, slots, places)
        recheck(req, v)
        assert close(v.cost, sc[0])
        if want is not None:
            assert v.cost >= want[0] * (1 - 1e-9) - 1e-12

@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests()), st.sampled_from([None, 0.5, 1.0, 2.0]))
def test_the_walk_bounds_every_variant_and_its_points_are_feasible(req: SelectionRequest,
                                                                  inc: float | None) -> None:
    """Each workflow's walk (placement relaxed, optionally under an incumbent of `inc` x the optimum): its lower
    bound is at most the optimum, every candidate it returns is a feasible variant, and a complete walk
    without a smaller incumbent finds the optimum whenever that is not placement-bound."""
    import math as _m

    from flowmaker.selection.exact import usable_profiles
    from flowmaker.selection.milp import RelaxedModel
    from flowmaker.selection.problem import Problem

    want, _ = brute_force(req)
    pb = Problem(req)
    usable = usable_profiles(pb)
    best = None if want is None or inc is None else (want[0] * inc, want[1], 0)
    lbs = []
    for pw in pb.workflows:
        fr = RelaxedModel(pb, pw, usable).walk(_m.inf, best)
        lbs.append(fr.lower_bound)
        _recheck_candidates(req, pb, pw, fr.candidates, want)
    if want is None:
        return
    assert min(lbs) <= want[0] * (1 + 1e-9) + 1e-12, (lbs, want)


def test_milp_relaxed_optimum_that_cannot_be_placed() -> None:
    """Two stages too heavy to share an instance: two cheap 30 GB instances would be best, but one 48 GB GPU holds
    only one of them; the answer is the one 40 GB instance that carries both (the walk's point does not place,
    branch and bound settles it)."""
    wf = Workflow("w", (Stage("a", input_tokens=100, output_tokens=100),
                        Stage("b", depends_on=("a",), input_tokens=100, output_tokens=100)))
    models = (Model("small", 0.3, 1.0, 1.0), Model("big", 0.3, 10.0, 10.0))
    profiles = (Profile("small", 1, 1, 30.0, 0.0, 0.0, 0.01, 150.0),
                Profile("big", 1, 1, 40.0, 0.0, 0.0, 0.02, 1000.0))
    req = SelectionRequest(Slo(0.2, 10.0, 1.0), (wf,), models, profiles, Cluster((Gpu("g0", "n0", 48.0),), ()))
    want, _ = brute_force(req)
    for strategy in ("milp", "exact"):
        res = select(req, strategy)
        assert want is not None and res.variant is not None and res.optimal
        assert close(res.variant.cost, want[0]) and close(res.variant.latency_s, want[1])
        assert res.variant.new_instances[0].model_id == "big"


def test_milp_all_reuse_takes_the_fastest_free_variant() -> None:
    """Cost 0 ties: among all-reuse variants the least latency wins."""
    running = (Instance("slow", "big", 1, 1, ("g0",), 0.0), Instance("fast", "small", 1, 1, ("g1",), 0.0))
    req = _chain_request(rate=1.0, instances=running)
    want, _ = brute_force(req)
    res = select(req, "milp")
    assert want is not None and res.variant is not None and res.optimal
    assert res.variant.cost == 0.0 and close(res.variant.latency_s, want[1])
    assert {i for i, _ in res.variant.reuse} == {"fast"}


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests()), st.integers(0, 6))
def test_an_interrupted_walk_keeps_a_valid_lower_bound(req: SelectionRequest, solves: int) -> None:
    """The walk stopped after `solves` MILPs (as at a deadline): its bound is still at most the optimum, and
    `milp` (branch and bound for the rest) still answers the optimum."""
    import math as _m

    from flowmaker.selection import milp
    from flowmaker.selection.exact import usable_profiles
    from flowmaker.selection.problem import Problem

    saved = milp.RelaxedModel._solve

    def limited(self, objective, mem_cap, lat_cap, deadline, nodes=0, presolve=True):  # type: ignore[no-untyped-def]
        if self.solves >= solves:
            return "time", -_m.inf, []
        return saved(self, objective, mem_cap, lat_cap, deadline, nodes, presolve)

    want, level = brute_force(req)
    milp.RelaxedModel._solve = limited  # type: ignore[method-assign]
    try:
        pb = Problem(req)
        usable = usable_profiles(pb)
        lbs = [milp.RelaxedModel(pb, pw, usable).walk(_m.inf, None).lower_bound for pw in pb.workflows]
        res = select(req, "milp")
    finally:
        milp.RelaxedModel._solve = saved  # type: ignore[method-assign]
    if want is None:
        assert res.variant is None and res.reason == LEVEL[level]
        return
    assert min(lbs) <= want[0] * (1 + 1e-9) + 1e-12, (lbs, want)
    assert res.variant is not None and res.optimal
    assert close(res.variant.cost, want[0]) and close(res.variant.latency_s, want[1])
    recheck(req, res.variant)


# ---------------------------------------------------------------- chain workflows: the multiset walk (`chain.walk_chain`)


def _as_chains(req: SelectionRequest) -> SelectionRequest:
    """The same request with every workflow's stages made one path, in their listed order."""
    wfs = tuple(dataclasses.replace(wf, stages=tuple(
        dataclasses.replace(s, depends_on=(wf.stages[i - 1].id,) if i else ())
        for i, s in enumerate(wf.stages))) for wf in req.workflows)
    return dataclasses.replace(req, workflows=wfs)


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests()).map(_as_chains))
def test_chain_walk_equals_brute_force(req: SelectionRequest) -> None:
    """On chains `milp` walks instance multisets instead of MILPs: == the brute force, tie-breaks included,
    proven."""
    agree(req, ("milp", "exact"), proven=True)


def _as_fans(req: SelectionRequest) -> SelectionRequest:
    """The same request with every workflow of 3+ LLM stages made a fan (`chain.fan_group`): the other stages (its
    first LLM stage, its TOOL stages) one path in their listed order, then the rest of its LLM stages side by side,
    the last of them a join after the others when there are 4+; a workflow of fewer LLM stages made a chain."""
    wfs = []
    for wf in req.workflows:
        llm = [s for s in wf.stages if s.is_llm]
        if len(llm) < 3:
            wfs.append(_as_chains(dataclasses.replace(req, workflows=(wf,))).workflows[0])
            continue
        join = llm[-1] if len(llm) >= 4 else None
        group = llm[1:-1] if join is not None else llm[1:]
        path = [s for s in wf.stages if s not in group and s is not join]
        stages = [dataclasses.replace(s, depends_on=(path[i - 1].id,) if i else ()) for i, s in enumerate(path)]
        stages += [dataclasses.replace(s, depends_on=(path[-1].id,)) for s in group]
        if join is not None:
            stages.append(dataclasses.replace(join, depends_on=tuple(s.id for s in group)))
        wfs.append(dataclasses.replace(wf, stages=tuple(stages)))
    return dataclasses.replace(req, workflows=tuple(wfs))


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests()).map(_as_fans))
def test_fan_walk_equals_brute_force(req: SelectionRequest) -> None:
    """Fans are walked by instance multisets too (a threshold per parallel latency): == the brute force,
    tie-breaks included, proven."""
    agree(req, ("milp", "exact"), proven=True)


def test_fan_group_recognises_fans_only() -> None:
    """A head, parallel LLM stages and a TOOL join is a fan; the same stages as a chain, or with one branch two
    stages long, or with a TOOL stage among the parallel ones, are not."""
    from flowmaker.bench.selector_hard import hard_instance
    from flowmaker.domain import StageKind
    from flowmaker.selection.chain import fan_group, is_chain
    from flowmaker.selection.problem import Problem

    req = hard_instance("wide_fan", 5, "small").request
    wf = req.workflows[0]
    pw = Problem(req).workflows[0]
    par = frozenset(i for i, s in enumerate(wf.stages) if s.depends_on == (wf.stages[0].id,))
    assert len(par) >= 2 and not is_chain(pw) and fan_group(pw) == par

    def with_stages(stages: list[Any]) -> Any:
        return Problem(dataclasses.replace(req, workflows=(dataclasses.replace(wf, stages=tuple(stages)),)))

    assert fan_group(Problem(_as_chains(req)).workflows[0]) is None
    st_ = list(wf.stages)
    first = min(par)
    longer = [*st_[:-1], dataclasses.replace(st_[first], id="extra", depends_on=(st_[first].id,))]
    longer.append(dataclasses.replace(st_[-1], depends_on=(*(d for d in st_[-1].depends_on if d != st_[first].id),
                                                           "extra")))
    assert fan_group(with_stages(longer).workflows[0]) is None
    tool = list(st_)
    tool[first] = dataclasses.replace(st_[first], kind=StageKind.TOOL, latency_s=0.2)
    assert fan_group(with_stages(tool).workflows[0]) is None


def _assert_walks_agree(want: Any, found: Any, lbs: list[float], complete: bool, inc: float | None) -> None:
    """The walks' bounds hold against the brute force's optimum `want`, and a complete walk found it."""
    if want is None:
        assert found is None
        return
    assert min(lbs) <= want[0] * (1 + 1e-9) + 1e-12, (lbs, want)
    if complete and (inc is None or inc >= 1.0):
        assert found is not None, want
        assert close(found[0], want[0]) and close(found[1], want[1]) and found[2] == want[2], (found, want)


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.one_of(requests(), dense_requests()).map(_as_chains),
                 st.one_of(requests(), dense_requests()).map(_as_fans)), st.sampled_from([None, 0.5, 1.0, 2.0]))
def test_the_chain_walk_bounds_every_variant_and_proves_the_optimum(req: SelectionRequest,
                                                                    inc: float | None) -> None:
    """`walk_chain` (chains and fans) under an incumbent of `inc` x the optimum: its lower bound is at most the
    optimum, its candidates are feasible, and when it says complete (with no smaller incumbent) its best candidate is
    the brute force's answer, tie-breaks included."""
    import math as _m

    from flowmaker.selection.chain import fan_group, is_chain, walk_chain
    from flowmaker.selection.exact import usable_profiles
    from flowmaker.selection.milp import RelaxedModel
    from flowmaker.selection.problem import Problem, better

    want, _ = brute_force(req)
    pb = Problem(req)
    usable = usable_profiles(pb)
    best = None if want is None or inc is None else (want[0] * inc, want[1], 0)
    lbs = []
    found = None
    complete = True
    for pw in pb.workflows:
        assert is_chain(pw) or fan_group(pw) is not None
        fr = walk_chain(RelaxedModel(pb, pw, usable), _m.inf, best)
        lbs.append(fr.lower_bound)
        complete = complete and fr.complete
        _recheck_candidates(req, pb, pw, fr.candidates, want)
        for sc, *_ in fr.candidates:
            if better(sc[0], sc[1], sc[2], found):
                found = sc
    _assert_walks_agree(want, found, lbs, complete, inc)


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.one_of(requests(), dense_requests()).map(_as_chains),
                 st.one_of(requests(), dense_requests()).map(_as_fans)), st.sampled_from([None, 1.0, 2.0]),
       st.sampled_from([1, 2, 4]), st.booleans(), st.sampled_from([0, 3, 40_000]))
def test_the_chain_walk_stays_exact_when_its_packing_searches_give_up(req: SelectionRequest, inc: float | None,
                                                                      nodes: int, milp_settles: bool,
                                                                      bin_nodes: int) -> None:
    """With the class search of the packings cut to a few nodes, multisets go back to the heap under the bound
    their search proved, then to the bin-by-bin search (`bin_nodes` nodes: none, too few to settle anything, or
    enough) and the MILP (or, `milp_settles` False, to a MILP that settles nothing): the walk's lower bound stays
    at most the optimum, its candidates are feasible, and when it says complete its best candidate is the brute
    force's answer, tie-breaks included."""
    import math as _m

    from flowmaker.selection import chain
    from flowmaker.selection.exact import usable_profiles
    from flowmaker.selection.milp import RelaxedModel
    from flowmaker.selection.problem import Problem, better

    want, _ = brute_force(req)
    pb = Problem(req)
    usable = usable_profiles(pb)
    best = None if want is None or inc is None else (want[0] * inc, want[1], 0)
    saved, saved_milp, saved_bins = (chain.CLASS_NODES, chain.CLASS_NODES_MORE), chain._least_l_milp, chain.BIN_NODES
    chain.CLASS_NODES = chain.CLASS_NODES_MORE = nodes
    chain.BIN_NODES = bin_nodes
    if not milp_settles:
        chain._least_l_milp = lambda *a: None  # type: ignore[assignment]
    try:
        lbs, found, complete = [], None, True
        for pw in pb.workflows:
            fr = chain.walk_chain(RelaxedModel(pb, pw, usable), _m.inf, best)
            lbs.append(fr.lower_bound)
            complete = complete and fr.complete
            _recheck_candidates(req, pb, pw, fr.candidates, want)
            for sc, *_ in fr.candidates:
                if better(sc[0], sc[1], sc[2], found):
                    found = sc
    finally:
        (chain.CLASS_NODES, chain.CLASS_NODES_MORE), chain._least_l_milp = saved, saved_milp  # type: ignore[assignment]
        chain.BIN_NODES = saved_bins
    _assert_walks_agree(want, found, lbs, complete, inc)
