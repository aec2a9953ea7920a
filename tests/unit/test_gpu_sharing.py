"""The GPU-sharing extension of the selection spec (docs/selection-spec.md, "Extension: GPU sharing",
`options.gpu_sharing = INTERFERENCE`): an independent brute force written only from the spec's text.

Nothing here reads or imports flowmaker.selection's internals, flowmaker.sharing or flowmaker.sim: the
brute force enumerates every variant of every workflow (replica groups included when max_replicas > 1),
applies Feasibility 1-3 as the base contract (and the busy-time extension) states them, places new
instances replica by replica by the load-aware rule (least occupancy O_g = B0_g + u x new ones placed, then
most free memory F_g, then smaller id), then applies Feasibility 5: compute budget (U_g <= u), slowed
instances keep up (rho f <= u, rho f < 1, multiplier m = f (1 - rho) / (1 - rho f)), slowed latency
L_s <= lambda, running co-residents protected (m1 <= m0, or finite, within u and their max_slowdown).
Shares are IEEE doubles computed as written (float operations, math.exp, math.expm1); every sum,
difference, product, quotient and comparison of them (and of kappa, u, 1e-9) is exact, over
`fractions.Fraction`, exactly as the spec's "Exact arithmetic" paragraph says. `recheck` re-derives a
returned variant from scratch: placement, per-replica loads, shares, Feasibility 5, slowed stage latencies,
L_s, cost and memory.

Helpers of the base contract's independent brute force (test_selection_properties) are reused: its random
request families, `topo`, `stage_latency`, `longest`, `capacity` (the busy-time figure) and `close`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, event, given, seed, settings, target
from hypothesis import strategies as st
from test_selection_properties import LEVEL, capacity, close, dense_requests, longest, requests, stage_latency, topo
from test_selection_properties import brute_force as base_brute_force

from flowmaker.domain import (
    CapacityModel,
    Cluster,
    Gpu,
    GpuSharing,
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
from flowmaker.selection.problem import Problem
from flowmaker.selection.sharing_bound import compute_room

EXAMPLES = int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300"))
# Hypothesis (6.170) schedules its target() optimiser differently from 1,000 examples up (several passes interleaved
# with generation), and there its hill climb can spin inside the engine without running the test: with 1,200 examples
# and --hypothesis-seed=23379, test_sharing_chain's chain test was still in `optimise_targets` after 380 s, and took
# 14.6 s without the target() call. Large runs therefore generate without steering.
TARGETING = EXAMPLES < 1000
TIE = 1e-12  # the extension's tie tolerance ("equal within 1e-12 relative")
KAPPAS = (1.0, 0.5, 2.0, 0.0)  # 1 first: hypothesis draws (and shrinks towards) the first more often
ZERO = Fraction(0)
TOL = 1 + Fraction(1e-9)  # "(1 + 1e-9)", exact


# ---------------------------------------------------------------- the spec's arithmetic, from its text


def restated_load(req: SelectionRequest, wf: Workflow, p: Profile, load: float) -> float:
    """A running instance's load "as Feasibility 3 reads it": the raw load in the base contract; under
    BUSY_TIME `existing_w = load_output_tokens_per_s * cap_w(p) / max_output_tokens_per_s`."""
    if req.options.capacity_model is not CapacityModel.BUSY_TIME:
        return load
    return load * capacity(req, wf, p) / p.max_output_tokens_per_s


def stage_load(req: SelectionRequest, s: Stage) -> float:
    return req.slo.arrival_rate_rps * s.calls_per_request * s.output_tokens


@dataclass(frozen=True)
class Shares:
    """Two doubles: compute share rho and busy share b."""

    rho: float
    b: float


def running_shares(req: SelectionRequest, wf: Workflow) -> dict[str, Shares]:
    """rho0_i = load_i / C(p_i) with any profile of the request (else 0.0); b0_i = busy_share_i when > 0,
    else min(1.0, rho0_i)."""
    every = {(p.model_id, p.tp, p.pp): p for p in req.profiles}
    out: dict[str, Shares] = {}
    for i in req.cluster.instances:
        p = every.get((i.model_id, i.tp, i.pp))
        rho0 = 0.0 if p is None else restated_load(req, wf, p, i.load_output_tokens_per_s) / capacity(req, wf, p)
        out[i.id] = Shares(rho0, i.busy_share if i.busy_share > 0 else min(1.0, rho0))
    return out


def reused_shares(req: SelectionRequest, wf: Workflow, p: Profile, i: Instance, b0: float, a: float,
                  n: float) -> Shares:
    """A reused instance: rho_i = (load_i + a) / C(p_i), b_i = 1.0 - (1.0 - b0_i) * exp(-n) (b0_i when
    n = 0.0)."""
    rho = (restated_load(req, wf, p, i.load_output_tokens_per_s) + a) / capacity(req, wf, p)
    return Shares(rho, b0 if n == 0.0 else 1.0 - (1.0 - b0) * math.exp(-n))


def replica_shares(req: SelectionRequest, wf: Workflow, p: Profile, r: int, a: float, n: float) -> Shares:
    """Each replica of a new group: rho = (a / r) / C(p), b = -expm1(-(n / r))."""
    return Shares((a / r) / capacity(req, wf, p), -math.expm1(-(n / r)))


def occupancy0(req: SelectionRequest, s0: dict[str, Shares]) -> dict[str, Fraction]:
    """B0_g: the exact sum of the running instances' busy shares on g."""
    occ = {g.id: ZERO for g in req.cluster.gpus}
    for i in req.cluster.instances:
        for g in i.gpu_ids:
            occ[g] += Fraction(s0[i.id].b)
    return occ


def mu(gb: float) -> int:
    """Feasibility 4's memory unit: round(x * 1e6) in double precision (Python's round: half to even)."""
    return round(gb * 1e6)


def free_units(gpus: tuple[Gpu, ...]) -> dict[str, int]:
    return {g.id: mu(g.memory_total_gb) - mu(g.memory_used_gb) for g in gpus}


def place(gpus: tuple[Gpu, ...], free: dict[str, int], occ: dict[str, Fraction], k: int,
          mem: float) -> tuple[str, tuple[str, ...]] | None:
    """The extension's placement of one instance of k GPUs x mem GB: candidates F_g >= m (integer units); per
    node the k candidates by (least O_g, most F_g, smaller GPU id); the node whose k-th chosen GPU is first by
    (least O_g, most F_g), then smaller node id."""
    best: tuple[tuple[Fraction, int, str], str, tuple[str, ...]] | None = None
    for node in sorted({g.node for g in gpus}):
        cands = [g.id for g in gpus if g.node == node and free[g.id] >= mu(mem)]
        if len(cands) < k:
            continue
        chosen = tuple(sorted(cands, key=lambda i: (occ[i], -free[i], i))[:k])
        last = chosen[-1]
        key = (occ[last], -free[last], node)
        if best is None or key < best[0]:
            best = (key, node, chosen)
    return None if best is None else (best[1], best[2])


def slowdown(kappa: Fraction, totals: dict[str, Fraction], gpus: tuple[str, ...], b: Fraction) -> Fraction:
    """f = 1 + kappa x max over g of max(B_g - b, 0)."""
    return 1 + kappa * max(max(totals[g] - b, ZERO) for g in gpus)


@dataclass
class Check5:
    """Feasibility 5 of one placed variant: the first failed item (0: none) and each used instance's m."""

    failed: int = 0
    m: dict[str, Fraction] = field(default_factory=dict)
    U: dict[str, Fraction] = field(default_factory=dict)
    B: dict[str, Fraction] = field(default_factory=dict)


def feasibility5(req: SelectionRequest, s0: dict[str, Shares], used: dict[str, tuple[tuple[str, ...], Shares]]
                 ) -> Check5:
    """Items 1, 2 and 4 of Feasibility 5 (3, the latency, needs the stage mapping: the caller's). `used`: every
    instance the variant uses, by name (a running instance's id when reused, else the replica's name) ->
    (its GPUs, its variant shares)."""
    o = req.options
    capu = Fraction(o.utilization_cap) * TOL
    kappa = Fraction(o.interference)
    running = {i.id: i for i in req.cluster.instances}
    U0 = {g.id: ZERO for g in req.cluster.gpus}
    B0 = dict(U0)
    for i in req.cluster.instances:
        for g in i.gpu_ids:
            U0[g] += Fraction(s0[i.id].rho)
            B0[g] += Fraction(s0[i.id].b)
    U, B = dict(U0), dict(B0)
    for name, (gids, sh) in used.items():
        before = s0[name] if name in running else Shares(0.0, 0.0)
        for g in gids:
            U[g] += Fraction(sh.rho) - Fraction(before.rho)
            B[g] += Fraction(sh.b) - Fraction(before.b)
    out = Check5(U=U, B=B)
    T = {g for gids, _ in used.values() for g in gids}
    # 1. compute budget
    if any(U[g] > capu for g in T):
        out.failed = 1
        return out
    # 2. slowed instances keep up
    for name, (gids, sh) in used.items():
        f = slowdown(kappa, B, gids, Fraction(sh.b))
        rho = Fraction(sh.rho)
        if rho * f > capu or rho * f >= 1:
            out.failed = 2
            return out
        out.m[name] = f * (1 - rho) / (1 - rho * f)
    # 4. running co-residents (with a GPU in T, reused ones included)
    for j in req.cluster.instances:
        if not T.intersection(j.gpu_ids):
            continue
        rho0, b0 = Fraction(s0[j.id].rho), Fraction(s0[j.id].b)
        rho1, b1 = (Fraction(used[j.id][1].rho), Fraction(used[j.id][1].b)) if j.id in used else (rho0, b0)
        f0 = slowdown(kappa, B0, j.gpu_ids, b0)
        f1 = slowdown(kappa, B, j.gpu_ids, b1)
        m0 = None if rho0 * f0 >= 1 else f0 * (1 - rho0) / (1 - rho0 * f0)  # None: infinite
        m1 = None if rho1 * f1 >= 1 else f1 * (1 - rho0) / (1 - rho1 * f1)
        if m1 is not None and (m0 is None or m1 <= m0):
            continue
        if (m1 is None or rho1 * f1 > capu
                or (j.max_slowdown > 0 and m1 > Fraction(j.max_slowdown) * TOL)):
            out.failed = 4
            return out
    return out


def tie_equal(a: float, b: float) -> bool:
    return abs(a - b) <= TIE * max(abs(a), abs(b))


def better(a: tuple[float, float, int], b: tuple[float, float, int] | None) -> bool:
    """The spec's order: cost, then L_s, then new GPUs (equal within 1e-12 relative)."""
    if b is None:
        return True
    if not tie_equal(a[0], b[0]):
        return a[0] < b[0]
    if not tie_equal(a[1], b[1]):
        return a[1] < b[1]
    return a[2] < b[2]


def within_lambda(req: SelectionRequest, Ls: float) -> bool:
    lam = req.slo.max_latency_s
    return Ls <= lam + 1e-9 * max(1.0, lam)


# ---------------------------------------------------------------- the brute force


@dataclass
class Outcome:
    best: tuple[float, float, int] | None = None  # (cost, L_s, new GPUs) of the optimum
    level: int = 1  # the furthest constraint reached: 1..4 (5 when something is feasible)
    slowed: bool = False  # the optimum has a stage with multiplier > 1
    slow_max: float = 1.0  # the optimum's largest stage multiplier
    placed: int = 0  # variants that passed 1-4
    failed5: dict[int, int] = field(default_factory=dict)  # placed variants by the item of 5 they failed
    feasible: int = 0


def variants(wf: Workflow, reuse: list[Instance], opens: list[tuple[Profile, int]]
             ) -> Iterator[list[tuple[str, int]]]:
    """Every mapping of the LLM stages (topological order): ("R", running index), ("J", group index) or
    ("O", index into `opens`); groups are numbered in order of opening."""
    n_llm = sum(s.is_llm for s in wf.stages)

    def gen(j: int, ch: list[tuple[str, int]], n_open: int) -> Iterator[list[tuple[str, int]]]:
        if j == n_llm:
            yield list(ch)
            return
        for o in ([("R", r) for r in range(len(reuse))] + [("J", g) for g in range(n_open)]
                  + [("O", g) for g in range(len(opens))]):
            ch.append(o)
            yield from gen(j + 1, ch, n_open + (o[0] == "O"))
            ch.pop()

    yield from gen(0, [], 0)


def brute_force(req: SelectionRequest, prune: bool = True,
                visit: Callable[[dict[str, tuple[tuple[str, ...], Shares]], dict[str, Shares]], None] | None = None
                ) -> Outcome:
    """The optimum of the GPU-sharing extension by enumeration; `prune` skips placing a variant whose
    unslowed cost M x L already loses to the incumbent (every m >= 1, so M x L_s >= M x L). `visit` sees each
    placed variant that passes Feasibility 5.1-5.4: the GPUs and shares of every instance it uses (new
    replicas "new/...", reused ones by id), and the running instances' shares before it."""
    o = req.options
    R = max(o.max_replicas, 1)
    prof = {(p.model_id, p.tp, p.pp): p for p in req.profiles if p.model_id in {m.id for m in req.models}}
    acc = {m.id: m.accuracy for m in req.models}
    reuse = [i for i in req.cluster.instances if (i.model_id, i.tp, i.pp) in prof] if o.allow_reuse else []
    opens = [(p, r) for p in prof.values() for r in range(1, R + 1)]
    out = Outcome()
    u = Fraction(o.utilization_cap)
    rate = req.slo.arrival_rate_rps
    for wf in req.workflows:
        llm = [s for s in topo(wf) if s.is_llm]
        s0 = running_shares(req, wf)
        occ0 = occupancy0(req, s0)
        for ch in variants(wf, reuse, opens):
            groups: list[tuple[Profile, int]] = []
            where: list[tuple[str, int]] = []
            for kind, ref in ch:
                if kind == "O":
                    groups.append(opens[ref])
                    where.append(("N", len(groups) - 1))
                else:
                    where.append(("R" if kind == "R" else "N", ref))

            def prof_of(k: str, r: int, groups: list[tuple[Profile, int]] = groups) -> Profile:
                if k == "R":
                    i = reuse[r]
                    return prof[(i.model_id, i.tp, i.pp)]
                return groups[r][0]

            # 1. accuracy
            if any(acc[prof_of(k, r).model_id] < req.slo.min_accuracy for k, r in where):
                continue
            out.level = max(out.level, 2)
            # 2. latency (unslowed); a and n per target, from 0.0 in topological order
            lat = {s.id: s.latency_s for s in wf.stages if not s.is_llm}
            loads: dict[tuple[str, int], float] = {}
            busy: dict[tuple[str, int], float] = {}
            for s, (k, r) in zip(llm, where, strict=True):
                lat[s.id] = stage_latency(s, prof_of(k, r))
                loads[(k, r)] = loads.get((k, r), 0.0) + stage_load(req, s)
                busy[(k, r)] = busy.get((k, r), 0.0) + rate * lat[s.id]
            L = longest(wf, lat)
            if L > req.slo.max_latency_s * (1 + 1e-9):
                continue
            out.level = max(out.level, 3)
            # 3. capacity
            ok = True
            for (k, r), ld in loads.items():
                p = prof_of(k, r)
                if k == "R":
                    tot = ld + restated_load(req, wf, p, reuse[r].load_output_tokens_per_s)
                    cap = capacity(req, wf, p)
                else:
                    tot, cap = ld, groups[r][1] * capacity(req, wf, p)
                if tot > o.utilization_cap * cap * (1 + 1e-9) + 1e-9:
                    ok = False
            if not ok:
                continue
            out.level = max(out.level, 4)
            M = sum(n * p.tp * p.pp * (p.memory_gb_per_gpu + o.gpu_price_gb) for p, n in groups)
            if prune and out.best is not None and M * L > out.best[0] * (1 + 1e-9) + 1e-12:
                continue
            # 4. placement, replica by replica, in order of the groups' first stages
            free = free_units(req.cluster.gpus)
            occ = dict(occ0)
            used: dict[str, tuple[tuple[str, ...], Shares]] = {}
            for gi, (p, n) in enumerate(groups):
                sh = replica_shares(req, wf, p, n, loads[("N", gi)], busy[("N", gi)])
                for rep in range(n):
                    pl = place(req.cluster.gpus, free, occ, p.tp * p.pp, p.memory_gb_per_gpu)
                    if pl is None:
                        ok = False
                        break
                    for g in pl[1]:
                        free[g] -= mu(p.memory_gb_per_gpu)
                        occ[g] += u
                    used[f"new/{gi}/{rep}"] = (pl[1], sh)
                if not ok:
                    break
            if not ok:
                continue
            out.placed += 1
            # 5. Feasibility 5
            for (k, r), ld in loads.items():
                if k == "R":
                    i = reuse[r]
                    used[i.id] = (i.gpu_ids, reused_shares(req, wf, prof_of(k, r), i, s0[i.id].b, ld, busy[(k, r)]))
            c5 = feasibility5(req, s0, used)
            if visit is not None and not c5.failed:
                visit(used, s0)
            slat = {s.id: s.latency_s for s in wf.stages if not s.is_llm}
            mult: dict[str, float] = {}
            if not c5.failed:
                for s, (k, r) in zip(llm, where, strict=True):
                    if k == "R":
                        m = float(c5.m[reuse[r].id])
                    else:
                        m = max(float(c5.m[f"new/{r}/{rep}"]) for rep in range(groups[r][1]))
                    mult[s.id] = m
                    slat[s.id] = stage_latency(s, prof_of(k, r)) * m
                Ls = longest(wf, slat)
                if not within_lambda(req, Ls):
                    c5.failed = 3
            if c5.failed:
                out.failed5[c5.failed] = out.failed5.get(c5.failed, 0) + 1
                continue
            out.feasible += 1
            out.level = 5
            key = (M * Ls, Ls, sum(n * p.tp * p.pp for p, n in groups))
            if better(key, out.best):
                out.best = key
                out.slow_max = max(mult.values(), default=1.0)
                out.slowed = out.slow_max > 1.0
    return out


# ---------------------------------------------------------------- re-deriving a returned variant


def recheck(req: SelectionRequest, v: Variant) -> dict[str, float]:
    """Re-derive a returned variant from the spec: placement of every new replica (node and GPU ids, in
    order), per-replica and reuse loads, shares, Feasibility 5 (budget, keep-up, co-residents), every
    assignment's slowed latency_s, L_s, cost, new memory and new GPUs. Returns each stage's multiplier."""
    o = req.options
    wf = next(w for w in req.workflows if w.id == v.workflow_id)
    prof = {(p.model_id, p.tp, p.pp): p for p in req.profiles}
    acc = {m.id: m.accuracy for m in req.models}
    insts = {i.id: i for i in req.cluster.instances}
    news = {n.key: n for n in v.new_instances}
    assert len(news) == len(v.new_instances)
    by_stage = {a.stage_id: a for a in v.assignments}
    llm = [s for s in topo(wf) if s.is_llm]
    assert sorted(by_stage) == sorted(s.id for s in llm)
    s0 = running_shares(req, wf)
    rate = req.slo.arrival_rate_rps
    # targets, their loads a and call-seconds n (double sums from 0.0 in topological order)
    loads: dict[str | tuple[str, ...], float] = {}
    busy: dict[str | tuple[str, ...], float] = {}
    order: list[str] = []
    for s in llm:
        a = by_stage[s.id]
        assert a.model_id in acc and acc[a.model_id] >= req.slo.min_accuracy
        p = prof[(a.model_id, a.tp, a.pp)]
        target: str | tuple[str, ...]
        if a.reused:
            assert o.allow_reuse and not a.replica_keys and not a.new_key
            i = insts[a.instance_id]
            assert (i.model_id, i.tp, i.pp) == (a.model_id, a.tp, a.pp)
            assert a.gpu_ids == i.gpu_ids
            target = i.id
        else:
            keys = a.replica_keys or (a.new_key,)
            assert keys[0] == a.new_key and len(keys) <= max(o.max_replicas, 1)
            assert len(a.replica_keys) != 1  # empty when r = 1
            assert all((news[k].model_id, news[k].tp, news[k].pp) == (a.model_id, a.tp, a.pp) for k in keys)
            assert a.gpu_ids == news[a.new_key].gpu_ids
            target = keys
            if keys[0] not in order:
                order.extend(keys)
        loads[target] = loads.get(target, 0.0) + stage_load(req, s)
        busy[target] = busy.get(target, 0.0) + rate * stage_latency(s, p)
    groups = {t: ld for t, ld in loads.items() if isinstance(t, tuple)}
    reuse_load = {t: ld for t, ld in loads.items() if isinstance(t, str)}
    # groups are disjoint, cover every new instance, keys new-0, new-1, ... in placement order
    assert sorted(k for ks in groups for k in ks) == sorted(news)
    assert order == [n.key for n in v.new_instances] == [f"new-{j}" for j in range(len(news))]
    assert dict(v.reuse) == reuse_load
    # capacity (Feasibility 3) and per-replica loads
    for keys, ld in groups.items():
        cap = capacity(req, wf, prof[(news[keys[0]].model_id, news[keys[0]].tp, news[keys[0]].pp)])
        assert ld <= o.utilization_cap * len(keys) * cap * (1 + 1e-9) + 1e-9
        for k in keys:
            assert close(news[k].load_output_tokens_per_s, ld / len(keys)), (news[k], ld, len(keys))
    for iid, ld in reuse_load.items():
        i = insts[iid]
        p = prof[(i.model_id, i.tp, i.pp)]
        assert ld + restated_load(req, wf, p, i.load_output_tokens_per_s) <= (
            o.utilization_cap * capacity(req, wf, p) * (1 + 1e-9) + 1e-9)
    # placement by the load-aware rule, replica after replica
    u = Fraction(o.utilization_cap)
    free = free_units(req.cluster.gpus)
    occ = occupancy0(req, s0)
    group_of = {k: ks for ks in groups for k in ks}
    used: dict[str, tuple[tuple[str, ...], Shares]] = {}
    for key in order:
        n = news[key]
        p = prof[(n.model_id, n.tp, n.pp)]
        assert n.memory_gb_per_gpu == p.memory_gb_per_gpu
        pl = place(req.cluster.gpus, free, occ, n.tp * n.pp, n.memory_gb_per_gpu)
        assert pl is not None and (pl[0], pl[1]) == (n.node, n.gpu_ids), (key, pl, n)
        for g in pl[1]:
            free[g] -= mu(n.memory_gb_per_gpu)
            occ[g] += u
        ks = group_of[key]
        used[key] = (pl[1], replica_shares(req, wf, p, len(ks), groups[ks], busy[ks]))
    for iid, ld in reuse_load.items():
        i = insts[iid]
        used[iid] = (i.gpu_ids, reused_shares(req, wf, prof[(i.model_id, i.tp, i.pp)], i, s0[iid].b, ld, busy[iid]))
    c5 = feasibility5(req, s0, used)
    assert not c5.failed, (c5.failed, {g: float(x) for g, x in c5.U.items()}, {g: float(x) for g, x in c5.B.items()})
    lat = {s.id: s.latency_s for s in wf.stages if not s.is_llm}
    mult: dict[str, float] = {}
    for s in llm:
        a = by_stage[s.id]
        if a.reused:
            m = float(c5.m[a.instance_id])
        else:
            m = max(float(c5.m[k]) for k in (a.replica_keys or (a.new_key,)))
        mult[s.id] = m
        lat[s.id] = stage_latency(s, prof[(a.model_id, a.tp, a.pp)]) * m
        assert close(a.latency_s, lat[s.id]), (s.id, a.latency_s, lat[s.id], m)
    Ls = longest(wf, lat)
    assert close(Ls, v.latency_s) and within_lambda(req, Ls), (Ls, v.latency_s, req.slo.max_latency_s)
    mem = sum(n.memory_gb_per_gpu * n.tp * n.pp for n in v.new_instances)
    priced = sum((n.memory_gb_per_gpu + req.options.gpu_price_gb) * n.tp * n.pp for n in v.new_instances)
    assert close(mem, v.new_memory_gb) and close(priced * Ls, v.cost), (mem, priced, Ls, v.cost)
    assert v.new_gpus == sum(n.tp * n.pp for n in v.new_instances)
    assert close(v.accuracy, min(acc[a.model_id] for a in v.assignments))
    return mult


def agree(req: SelectionRequest, strategies: tuple[str, ...]) -> Outcome:
    """Each strategy's answer has the brute force's (cost, L_s, new GPUs), or the same reason; every returned
    variant re-checks."""
    want = brute_force(req)
    event(f"feasible: {want.best is not None}")
    if TARGETING:
        target(want.slow_max, label="the optimum's largest stage multiplier")
    event(f"optimum slowed (m > 1 on a stage): {want.slowed}")
    for item, what in ((1, "over the compute budget"), (2, "a slowed instance cannot keep up"),
                       (3, "too slow once slowed"), (4, "harms a running co-resident")):
        event(f"some placed variant {what}: {want.failed5.get(item, 0) > 0}")
    for name in strategies:
        res = select(req, name)
        if want.best is None:
            assert res.variant is None and res.reason == LEVEL[want.level], (name, res.reason, want.level)
            continue
        assert res.variant is not None, (name, res.reason, want.best)
        v = res.variant
        got = (v.cost, v.latency_s, v.new_gpus)
        assert close(v.cost, want.best[0]), (name, got, want.best)
        assert close(v.latency_s, want.best[1]), (name, got, want.best)
        assert v.new_gpus == want.best[2], (name, got, want.best)
        recheck(req, v)
    return want


# ---------------------------------------------------------------- request families


def sharing(req: SelectionRequest, kappa: float, reps: int, busy: bool, decode_factor: float = 0.0
            ) -> SelectionRequest:
    """`req` under INTERFERENCE with kappa and R = reps; under BUSY_TIME profiles get a pure-decode throughput
    of decode_factor x max_output_tokens_per_s (0: unknown), as test_replicas.busy() does."""
    opts = dataclasses.replace(req.options, gpu_sharing=GpuSharing.INTERFERENCE, interference=kappa,
                               max_replicas=reps)
    profiles = req.profiles
    if busy:
        opts = dataclasses.replace(opts, capacity_model=CapacityModel.BUSY_TIME)
        profiles = tuple(dataclasses.replace(p, decode_tokens_per_s=decode_factor * p.max_output_tokens_per_s)
                         for p in profiles)
    return dataclasses.replace(req, profiles=profiles, options=opts)


@st.composite
def shared_requests(draw: st.DrawFn) -> SelectionRequest:
    """Clusters where running instances with non-zero loads sit on most GPUs (several per GPU, some near their
    capacity, some of a model outside `models` or without a profile, some with a measured busy share or a
    max_slowdown), memory that lets new instances land next to them (idle GPUs often have too little), and
    multi-stage workflows with rates that give new instances shares large enough for the budget to bind."""
    # GPU ids either follow node ids and list order, or run against both (ties: smaller GPU id, smaller node id)
    plain = draw(st.booleans())
    nodes = {f"n{n}": [f"n{n}-g{g}" if plain else f"{'yx'[n]}{9 - g}"
                       for g in range(draw(st.sampled_from([1, 2, 2, 3])))]
             for n in range(draw(st.integers(1, 2)))}
    caps = st.sampled_from([150.0, 300.0, 600.0])
    pool = [Profile("a", 1, 1, 12.0, 0.01, 1e-4, 0.01, draw(caps)),
            Profile("a", 2, 1, 8.0, 0.01, 6e-5, 0.006, draw(caps)),
            Profile("b", 1, 1, 20.0, 0.02, 2e-4, 0.02, draw(caps)),
            Profile("b", 2, 1, 10.0, 0.01, 1e-4, 0.012, draw(caps))]
    profiles = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique_by=lambda p: (p.model_id, p.tp)))
    # a running model that is not among `models`: it has shares but is never reused
    profiles = [*profiles, Profile("x", 1, 1, 15.0, 0.0, 1e-4, 0.01, 200.0)]
    models = [Model("a", draw(st.sampled_from([0.3, 0.4])), 3.0, 3.0), Model("b", 0.4, 8.0, 8.0)]
    all_gpus = [(n, g) for n, gs in nodes.items() for g in gs]
    used = {g: draw(st.sampled_from([0.0, 0.0, 10.0, 30.0])) for _, g in all_gpus}
    instances = []
    # most GPUs get a loaded co-resident with a profile, then one or two more instances on GPUs already hosting
    # one (any load, possibly no profile)
    hosts = [(ng, True) for ng in all_gpus if draw(st.integers(0, 7)) > 0]
    hosts += [(draw(st.sampled_from([h for h, _ in hosts] or all_gpus)), False) for _ in range(draw(st.integers(1, 2)))]
    for i, ((node, first), background) in enumerate(hosts):
        p = draw(st.sampled_from(profiles if background else [*profiles, None]))
        k = 1 if p is None else p.tp * p.pp
        if len(nodes[node]) < k:
            continue
        gids = (first, *[g for g in draw(st.permutations(nodes[node])) if g != first][:k - 1])
        cap = 100.0 if p is None else p.max_output_tokens_per_s
        model, tp = ("z", 1) if p is None else (p.model_id, p.tp)  # "z": no profile
        frac = draw(st.sampled_from([0.1, 0.05, 0.2, 0.25, 0.4, 0.5, 0.9] if background
                                    else [0.1, 0.0, 0.25, 0.5, 0.97]))
        instances.append(Instance(f"run{i}", model, tp, 1, gids, cap * frac,
                                  max_slowdown=draw(st.sampled_from([0.0, 0.0, 0.0, 3.0, 1.5, 1.0])),
                                  busy_share=draw(st.sampled_from([0.0, 0.0, 0.0, 0.05, 0.3, 0.6, 0.95]))))
        for g in gids:
            used[g] += 10.0 if p is None else p.memory_gb_per_gpu
    busy = {g for i in instances for g in i.gpu_ids}
    room = {g: draw(st.sampled_from([25.0, 45.0, 70.0] if g in busy else [5.0, 15.0, 25.0, 60.0]))
            for _, g in all_gpus}
    gpus = tuple(Gpu(g, n, used[g] + room[g], used[g]) for n, g in all_gpus)
    workflows = []
    for w in range(draw(st.integers(1, 2))):
        stages: list[Stage] = []
        n = draw(st.integers(2, 3))
        fan = draw(st.booleans())
        for k in range(n):
            deps = () if k == 0 else ("s0",) if fan else (f"s{k - 1}",)
            if k == 1 and draw(st.integers(0, 3)) == 0:
                stages.append(Stage(f"s{k}", StageKind.TOOL, deps, latency_s=draw(st.sampled_from([0.1, 0.5]))))
            else:
                stages.append(Stage(f"s{k}", StageKind.LLM, deps, draw(st.sampled_from([100, 500, 1000])),
                                    draw(st.sampled_from([50, 100, 150])), draw(st.sampled_from([1, 1, 2]))))
        workflows.append(Workflow(f"w{w}", tuple(stages)))
    slo = Slo(draw(st.sampled_from([0.0, 0.0, 0.35])), draw(st.sampled_from([3.0, 5.0, 8.0, 15.0])),
              draw(st.sampled_from([0.25, 0.5, 0.1, 1.0, 2.0, 0.0])))
    opts = SelectionOptions(utilization_cap=draw(st.sampled_from([1.0, 1.0, 0.8, 0.6])),
                            allow_reuse=draw(st.booleans()),
                            gpu_price_gb=draw(st.sampled_from([0.0, 0.0, 0.0, 24.0, 48.0])))
    return SelectionRequest(slo, tuple(workflows), tuple(models), tuple(profiles),
                            Cluster(gpus, tuple(instances)), opts)


def under_sharing(base: st.SearchStrategy[SelectionRequest]) -> st.SearchStrategy[SelectionRequest]:
    return st.builds(sharing, base, st.sampled_from(KAPPAS), st.integers(1, 2), st.booleans(),
                     st.sampled_from([0.0, 1.0, 1.5, 3.0]))


# ---------------------------------------------------------------- properties


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(under_sharing(requests()))
def test_exact_exhaustive_and_milp_equal_the_brute_force_under_sharing(req: SelectionRequest) -> None:
    agree(req, ("exact", "exhaustive", "milp"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(under_sharing(shared_requests()))
def test_exact_exhaustive_and_milp_equal_the_brute_force_with_busy_co_residents(req: SelectionRequest) -> None:
    agree(req, ("exact", "exhaustive", "milp"))


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(under_sharing(dense_requests()))
def test_exact_and_milp_equal_the_brute_force_on_dense_requests_under_sharing(req: SelectionRequest) -> None:
    agree(req, ("exact", "milp"))


def test_a_relaxation_highs_presolve_calls_infeasible_is_solved_again_without_it() -> None:
    """Found by the property test above: two parallel stages, an m0 instance (10 GB, capacity 1000) that holds both
    (L 3.0005, cost 30.005) or two m2 instances (20 GB, L 1.5005, cost 30.01). HiGHS 1.16.0's presolve called the
    relaxation's least L with M <= 10 infeasible although its least M is 10, so `milp`'s walk bound passed the optimum
    and it claimed 30.01, proven. Every infeasibility now holds only once HiGHS repeats it without presolve
    (`exact.run_checked`)."""
    import time

    from flowmaker.selection import exact as ex
    from flowmaker.selection.milp import RelaxedModel, _tol

    wf = Workflow("w0", (Stage("s0", input_tokens=50, output_tokens=100, calls_per_request=2),
                         Stage("s1", input_tokens=50, output_tokens=300)))
    models = tuple(Model(f"m{i}", 0.1, float(i + 1), float(i + 1)) for i in range(3))
    profiles = (Profile("m0", 1, 1, 10.0, 0.0, 1e-5, 0.01, 1000.0), Profile("m1", 1, 1, 4.0, 0.0, 1e-5, 0.005, 40.0),
                Profile("m2", 1, 1, 10.0, 0.0, 1e-5, 0.005, 200.0))
    gpus = tuple(Gpu(f"n{i}-g0", f"n{i}", 48.0, 0.0) for i in range(3))
    req = SelectionRequest(Slo(0.0, 5.0, 0.5), (wf,), models, profiles, Cluster(gpus),
                           SelectionOptions(allow_reuse=False))
    req = sharing(req, 1.0, 2, False)
    pb = Problem(req)
    m = RelaxedModel(pb, pb.workflows[0], ex.usable_profiles(pb))
    assert m._solve("M", math.inf, _tol(pb.lam), time.perf_counter() + 10)[:2] == ("optimal", 10.0)
    st_, L, _ = m._solve("L", 10.0, _tol(pb.lam), time.perf_counter() + 10)
    assert st_ == "optimal" and close(L, 3.0005), (st_, L)
    want = brute_force(req).best
    assert want is not None and close(want[0], 30.005)
    for name in ("exact", "exhaustive", "milp"):
        v = select(req, name).variant
        assert v is not None and (v.cost, v.latency_s, v.new_gpus) == pytest.approx(want, rel=1e-9), name
        recheck(req, v)


def priced(req: SelectionRequest, price: float) -> SelectionRequest:
    return dataclasses.replace(req, options=dataclasses.replace(req.options, gpu_price_gb=price))


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(priced, under_sharing(st.one_of(requests(), shared_requests(), dense_requests())),
                 st.sampled_from([4.0, 24.0, 48.0, 300.0])))
def test_priced_gpus_under_sharing_equal_the_brute_force(req: SelectionRequest) -> None:
    """The priced-GPUs extension under sharing: M charges every new GPU its memory plus gpu_price_gb."""
    agree(req, ("exact", "milp"))


@settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests(), shared_requests()), st.sampled_from(KAPPAS))
def test_ignore_is_the_base_contract(req: SelectionRequest, kappa: float) -> None:
    """(d) With IGNORE (whatever kappa, busy shares and max_slowdown say) every answer is the base contract's
    brute force's."""
    req = dataclasses.replace(req, options=dataclasses.replace(req.options, gpu_sharing=GpuSharing.IGNORE,
                                                               interference=kappa))
    want, level = base_brute_force(req)
    for name in ("exact", "milp"):
        res = select(req, name)
        if want is None:
            assert res.variant is None and res.reason == LEVEL[level]
        else:
            assert res.variant is not None
            assert close(res.variant.cost, want[0]) and close(res.variant.latency_s, want[1])
            assert res.variant.new_gpus == want[2]


def with_clone(req: SelectionRequest) -> SelectionRequest:
    """`req` with a model "c" identical to "a" (same accuracy and sizes, the same profiles under its id): variants
    that differ only in the model tie in (cost, L_s, new GPUs), which the tie-break and the canonical order settle."""
    a = next((m for m in req.models if m.id == "a"), None)
    if a is None:
        return req
    clones = tuple(dataclasses.replace(p, model_id="c") for p in req.profiles if p.model_id == "a")
    return dataclasses.replace(req, models=(*req.models, dataclasses.replace(a, id="c")),
                               profiles=(*req.profiles, *clones))


ROOM_ROWS_SEED = 4  # a hypothesis seed whose draw has a variant on a compute-room row's bound (0.9999999 of it)
WALK_PROOF_SEED = 0  # a hypothesis seed whose draw reaches the walk's proof under sharing
_SHARING_PROOFS = [0]  # how often the walk proved a sharing optimum's cost (the restricted branch and bound ran)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(under_sharing(st.one_of(shared_requests(), shared_requests().map(with_clone), requests().map(with_clone),
                               dense_requests())))
def _the_walks_proof_under_sharing_equals_the_brute_force(req: SelectionRequest) -> None:
    """`milp` (the walk first) and `exact`: when the walk's bound meets the best realized variant's true cost, the
    cost is proven and a branch and bound restricted to L <= its L settles the tie-break; the answer is the brute
    force's (cost, L_s, new GPUs), on requests with model clones (exact ties) among others."""
    from flowmaker.selection import exact as ex

    real = ex.make_search

    def spy(pb: object, **kw: object) -> object:
        if kw.get("lat_cap") is not None:
            _SHARING_PROOFS[0] += 1
            event("the walk proved the cost under sharing")
        return real(pb, **kw)  # type: ignore[arg-type]

    ex.make_search = spy  # type: ignore[assignment]
    try:
        agree(req, ("milp", "exact"))
    finally:
        ex.make_search = real  # type: ignore[assignment]


def test_the_walks_proof_under_sharing_equals_the_brute_force_ties_included() -> None:
    """The property above, and it reaches the new proof path (not only the branch and bound's own proofs)."""
    _SHARING_PROOFS[0] = 0
    _the_walks_proof_under_sharing_equals_the_brute_force()  # a fresh draw each run: it looks for counterexamples
    if _SHARING_PROOFS[0] == 0:
        # This draw never reached the path (some seeds do not, since the chains' own settling often proves first):
        # a fixed draw that does, so the coverage check does not depend on luck.
        seed(WALK_PROOF_SEED)(_the_walks_proof_under_sharing_equals_the_brute_force)()
    assert _SHARING_PROOFS[0] > 0


def _outcomes(family: st.SearchStrategy[SelectionRequest], examples: int) -> list[Outcome]:
    seen: list[Outcome] = []

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(under_sharing(family))
    def collect(req: SelectionRequest) -> None:
        seen.append(brute_force(req, prune=False))

    collect()
    return seen


def test_the_relaxations_compute_rows_hold_for_every_variant_that_passes_feasibility_5() -> None:
    """`sharing_bound.compute_room`'s rows, which the relaxed model (`milp.RelaxedModel`) adds under sharing, hold
    for every placed variant the brute force finds within Feasibility 5: per j, the instances' (k - j)^+ x added
    compute share (new replicas: their share; reused instances: what the variant adds) summed, and per k, the
    new k-GPU replicas' shares summed, are within the rows' bounds. Checked in exact arithmetic against the
    brute force's own shares; and the rows are near binding on some of these variants (the test can fail)."""
    tight = [0.0]
    rows_seen = [0]

    @settings(max_examples=max(EXAMPLES // 2, 20), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.builds(sharing, shared_requests(), st.sampled_from(KAPPAS), st.integers(1, 2), st.just(False)))
    def check(req: SelectionRequest) -> None:
        pb = Problem(req)
        models = {m.id for m in req.models}
        profs = [i for i, p in enumerate(pb.profiles) if p.model_id in models]
        by_j, per_k = compute_room(pb, profs, range(len(pb.reusable)))

        def visit(used: dict[str, tuple[tuple[str, ...], Shares]], s0: dict[str, Shares]) -> None:
            added = [(len(gids), Fraction(sh.rho) - (ZERO if key.startswith("new/") else Fraction(s0[key].rho)),
                      key.startswith("new/")) for key, (gids, sh) in used.items()]
            for j, rhs in enumerate(by_j):
                lhs = sum((max(0, k - j) * a for k, a, _ in added), ZERO)
                assert lhs <= Fraction(rhs), (j, float(lhs), rhs, added)
                tight[0] = max(tight[0], float(lhs) / rhs)
            for k, rhs in per_k.items():
                lhs = sum((a for kk, a, new in added if new and kk == k), ZERO)
                assert lhs <= Fraction(rhs), (k, float(lhs), rhs, added)
                tight[0] = max(tight[0], float(lhs) / rhs)
            rows_seen[0] += 1

        brute_force(req, prune=False, visit=visit)

    check()  # a fresh draw each run: it looks for counterexamples
    assert rows_seen[0] > 0
    if tight[0] <= 0.8:
        # This draw never came near a row's bound (most draws do, 0.74-0.9 over 150 examples): a fixed draw that does, so
        # that the check cannot pass only because nothing binds.
        seed(ROOM_ROWS_SEED)(check)()
        assert tight[0] > 0.8, tight[0]


def test_the_sharing_families_exercise_slowdown_and_feasibility_5() -> None:
    """Sanity (non-asserting): how often the generated families exercise the extension. Printed with -s."""
    for name, family in (("shared_requests", shared_requests()), ("dense_requests", dense_requests()),
                         ("requests", requests())):
        seen = _outcomes(family, max(EXAMPLES // 3, 10))
        n = max(len(seen), 1)
        frac = {
            "feasible": sum(o.best is not None for o in seen) / n,
            "optimum slowed (m > 1 on a stage)": sum(o.slowed for o in seen) / n,
            "some placed variant over the compute budget (5.1)": sum(1 in o.failed5 for o in seen) / n,
            "some placed variant cannot keep up slowed (5.2)": sum(2 in o.failed5 for o in seen) / n,
            "some placed variant too slow once slowed (5.3)": sum(3 in o.failed5 for o in seen) / n,
            "some placed variant harms a co-resident (5.4)": sum(4 in o.failed5 for o in seen) / n,
            "infeasible only because of Feasibility 5": sum(o.best is None and o.placed > 0 for o in seen) / n,
        }
        print(f"\n{name} under INTERFERENCE, {len(seen)} examples:")
        for k, f in frac.items():
            print(f"  {k}: {f:.0%}")


# ---------------------------------------------------------------- worked cases


def _one_stage(gpus: tuple[Gpu, ...], running: tuple[Instance, ...], rate: float, lam: float = 10.0,
               u: float = 1.0, kappa: float = 1.0, decode: float = 0.01) -> SelectionRequest:
    """One LLM stage (100 prompt, 100 output tokens) of model m: profile m 1x1, 20 GB, `decode` s per output
    token (latency 100 x decode: 1.0 s by default), capacity 1000 tok/s. Running instances are of model r
    (profile r 1x1, 10 GB, capacity 100 tok/s), which is not among `models` (never reused)."""
    wf = Workflow("w", (Stage("s", StageKind.LLM, (), 100, 100),))
    profiles = (Profile("m", 1, 1, 20.0, 0.0, 0.0, decode, 1000.0), Profile("r", 1, 1, 10.0, 0.0, 0.0, 0.01, 100.0))
    return SelectionRequest(Slo(0.1, lam, rate), (wf,), (Model("m", 0.5, 7.0, 7.0),), profiles,
                            Cluster(gpus, running),
                            SelectionOptions(utilization_cap=u, gpu_sharing=GpuSharing.INTERFERENCE,
                                             interference=kappa))


def _opts(req: SelectionRequest, **kw: object) -> SelectionRequest:
    return dataclasses.replace(req, options=dataclasses.replace(req.options, **kw))  # type: ignore[arg-type]


def test_a_new_instance_goes_to_the_idle_gpu_even_with_less_free_memory() -> None:
    """(a) g0: 70 GB free, a running r instance at 50 of 100 tok/s: rho0 = b0 = 0.5, O = 0.5. g1: 50 GB free,
    nothing: O = 0. The new 20 GB instance goes to g1 (least O first); under IGNORE to g0 (most free
    memory). Alone on g1, f = 1 and m = 1 x (1 - 0.1) / (1 - 0.1) = 1: latency 1.0 s, cost 20 GB x 1 s."""
    gpus = (Gpu("g0", "n0", 80.0, 10.0), Gpu("g1", "n0", 80.0, 30.0))
    running = (Instance("busy", "r", 1, 1, ("g0",), 50.0),)
    req = _one_stage(gpus, running, rate=1.0)
    res = select(req, "exact")
    assert res.variant is not None and res.variant.new_instances[0].gpu_ids == ("g1",)
    assert res.variant.latency_s == 1.0 and res.variant.cost == 20.0
    assert recheck(req, res.variant) == {"s": 1.0}
    assert brute_force(req).best == (20.0, 1.0, 1)
    ignore = select(_opts(req, gpu_sharing=GpuSharing.IGNORE), "exact")
    assert ignore.variant is not None and ignore.variant.new_instances[0].gpu_ids == ("g0",)


def test_a_stage_next_to_a_busy_instance_is_slowed_by_its_busy_share() -> None:
    """(b) One GPU, a running r instance at 40 of 100 tok/s: rho0 = b0 = 0.4 (no measured busy share).

    At rate 0 the new instance has rho = 0 and b = -expm1(-0.0) = 0: f = 1 + 1 x (0.4 - 0) = 1.4 and
    m = 1.4 x (1 - 0) / (1 - 0) = 1.4: latency 1.0 x 1.4 = 1.4 s, cost 20 GB x 1.4 s = 28. kappa 0.5: 1.2 s,
    cost 24. A target of 1.3 s is met unslowed (1.0 s) but missed once slowed: NO_GPU_MEMORY.

    At 1 req/s its own shares are rho = 100 / 1000 = 0.1 and b = 1 - e^-1 = 0.632 (n = 1 x 1.0 call-s/s);
    B = 0.4 + 0.632 but its own b does not count: f = 1.4 again, and its queueing at speed 1/1.4 gives
    m = 1.4 x 0.9 / (1 - 0.14) = 1.465...: cost 29.3. The co-resident then has f1 = 1 + 0.632, and
    m1 = 1.632 x 0.6 / (1 - 0.4 x 1.632) = 2.82 > m0 = 1 (finite, 0.4 x 1.632 <= u): feasible unless its
    max_slowdown is below 2.82 (2.0: NO_GPU_MEMORY; 3.0: feasible)."""
    gpus = (Gpu("g0", "n0", 80.0, 10.0),)
    running = (Instance("co", "r", 1, 1, ("g0",), 40.0),)
    req = _one_stage(gpus, running, rate=0.0)
    v = select(req, "exact").variant
    assert v is not None and v.new_instances[0].gpu_ids == ("g0",)
    assert v.assignments[0].latency_s == 1.4 and v.latency_s == 1.4 and close(v.cost, 28.0)
    assert recheck(req, v) == {"s": 1.4}
    assert brute_force(req).best == (28.0, 1.4, 1)
    hv = select(_opts(req, interference=0.5), "exact").variant
    assert hv is not None and hv.latency_s == 1.2 and close(hv.cost, 24.0)
    tight = dataclasses.replace(req, slo=dataclasses.replace(req.slo, max_latency_s=1.3))
    assert select(tight, "exact").reason is Infeasibility.NO_GPU_MEMORY
    assert brute_force(tight).best is None and brute_force(tight).failed5 == {3: 1}
    pv = select(_opts(tight, gpu_sharing=GpuSharing.IGNORE), "exact").variant
    assert pv is not None and pv.latency_s == 1.0 and pv.cost == 20.0

    loaded = _one_stage(gpus, running, rate=1.0)
    m = 1.4 * 0.9 / (1 - 0.14)
    lv = select(loaded, "exact").variant
    assert lv is not None and close(lv.latency_s, m) and close(lv.cost, 20.0 * m)
    assert close(recheck(loaded, lv)["s"], m)
    b = -math.expm1(-1.0)
    m1 = (1 + b) * 0.6 / (1 - 0.4 * (1 + b))
    assert 2.8 < m1 < 2.83
    for tolerated, feasible in ((2.0, False), (3.0, True)):
        protected = _one_stage(gpus, (dataclasses.replace(running[0], max_slowdown=tolerated),), rate=1.0)
        res = select(protected, "exact")
        assert (res.variant is not None) is feasible, (tolerated, res.reason)
        assert (brute_force(protected).best is not None) is feasible
        if not feasible:
            assert res.reason is Infeasibility.NO_GPU_MEMORY and brute_force(protected).failed5 == {4: 1}


def test_a_variant_that_overloads_a_shared_gpu_is_no_gpu_memory() -> None:
    """(c) g0 holds a running r instance at 80 of 100 tok/s (rho0 = 0.8) that measured itself busy 10% of the
    time (b0 = 0.1); g1 has 5 GB free, too little for the 20 GB instance, so it can only go next to it. The
    stage is 0.1 s long (decode 0.001 s/token).

    At 3 req/s the new instance's compute share is 300 / 1000 = 0.3: U = 0.8 + 0.3 = 1.1 > u = 1, over the
    compute budget, and nothing else fits: NO_GPU_MEMORY (IGNORE: feasible, on g0).
    At 2 req/s: 0.2, and U = Fraction(0.8) + Fraction(0.2) = 1 + 5.55e-17, within u x (1 + 1e-9). Its busy
    share is 1 - e^-0.2 = 0.181, f = 1 + (0.1 + 0.181 - 0.181) = 1.1 and m = 1.1 x 0.8 / (1 - 0.22) =
    1.1282: L_s = 0.11282 s, cost 2.2564. The co-resident's f1 = 1.181, rho0 f1 = 0.945 < 1: finite, so it
    is allowed (no max_slowdown). With u = 0.9 the same 0.2 (U = 1.0) is over the budget again."""
    gpus = (Gpu("g0", "n0", 80.0, 10.0), Gpu("g1", "n0", 80.0, 75.0))
    running = (Instance("hot", "r", 1, 1, ("g0",), 80.0, busy_share=0.1),)
    over = _one_stage(gpus, running, rate=3.0, decode=0.001)
    res = select(over, "exact")
    assert res.variant is None and res.reason is Infeasibility.NO_GPU_MEMORY
    assert brute_force(over).best is None and brute_force(over).failed5 == {1: 1}
    plain = select(_opts(over, gpu_sharing=GpuSharing.IGNORE), "exact")
    assert plain.variant is not None and plain.variant.new_instances[0].gpu_ids == ("g0",)

    edge = _one_stage(gpus, running, rate=2.0, decode=0.001)
    assert Fraction(0.8) + Fraction(0.2) > 1
    ev = select(edge, "exact").variant
    m = 1.1 * 0.8 / (1 - 0.22)
    assert ev is not None and close(ev.latency_s, 0.1 * m) and close(ev.cost, 2.0 * m)
    assert close(recheck(edge, ev)["s"], m)
    capped = _opts(edge, utilization_cap=0.9)
    assert select(capped, "exact").reason is Infeasibility.NO_GPU_MEMORY
    assert brute_force(capped).failed5 == {1: 1}

    # the co-resident at 90 of 100 tok/s (rho0 = 0.9, b0 = 0.1 still) and a 0.2 s stage at 1 req/s: U = 0.9
    # + 0.1 is within the budget, but the new busy share 1 - e^-0.2 = 0.181 makes the co-resident's
    # f1 = 1.181 and rho0 f1 = 1.063 >= 1: m1 is infinite (m0 = 1): NO_GPU_MEMORY
    hotter = _one_stage(gpus, (dataclasses.replace(running[0], load_output_tokens_per_s=90.0),), rate=1.0,
                        decode=0.002)
    assert select(hotter, "exact").reason is Infeasibility.NO_GPU_MEMORY
    assert brute_force(hotter).failed5 == {4: 1}

    # reusing a running instance counts too: an m instance at 500 of 1000 tok/s next to `hot` would be at
    # (500 + 50) / 1000 = 0.55, U = 0.8 + 0.55 > 1, and with 10 GB and 5 GB free nothing new fits either
    running2 = (*running, Instance("m-run", "m", 1, 1, ("g0",), 500.0))
    gpus2 = (Gpu("g0", "n0", 80.0, 70.0), Gpu("g1", "n0", 80.0, 75.0))
    reuse = _one_stage(gpus2, running2, rate=0.5)
    assert select(reuse, "exact").reason is Infeasibility.NO_GPU_MEMORY
    assert brute_force(reuse).level == 4 and brute_force(reuse).failed5 == {1: 1}


def test_a_replica_group_takes_the_slowest_replica() -> None:
    """u = 0.35: one m instance carries 350 tok/s, so 4 req/s (400 tok/s) needs two replicas (200 each:
    rho = 0.2; n = 4 x 1.0 s over 2 replicas: b = 1 - e^-2 = 0.865). g0 is idle with 25 GB free; g1 holds
    a running r instance at 10 of 100 tok/s (rho0 = b0 = 0.1, O = 0.1) with 60 GB free. new-0 goes to g0
    (O 0 < 0.1); then g0 has O = u and only 5 GB, so new-1 goes to g1: U = 0.1 + 0.2 <= 0.35,
    f = 1 + 0.1 = 1.1, rho f = 0.22 <= 0.35, m = 1.1 x 0.8 / 0.78 = 1.128; new-0 alone has m = 1. A call may
    land on either: the stage takes 1.0 x 1.128 s; cost 40 GB x 1.128 s = 45.1. The co-resident: f1 = 1.865,
    0.1 x 1.865 <= 0.35, finite: allowed. With R = 1: NO_CAPACITY."""
    gpus = (Gpu("g0", "n0", 80.0, 55.0), Gpu("g1", "n0", 80.0, 20.0))
    running = (Instance("co", "r", 1, 1, ("g1",), 10.0),)
    base = _one_stage(gpus, running, rate=4.0, u=0.35)
    req = _opts(base, max_replicas=2)
    v = select(req, "exact").variant
    assert v is not None
    assert [(n.key, n.gpu_ids) for n in v.new_instances] == [("new-0", ("g0",)), ("new-1", ("g1",))]
    assert v.assignments[0].replica_keys == ("new-0", "new-1")
    m = 1.1 * 0.8 / (1 - 0.22)
    assert close(v.latency_s, m) and close(v.cost, 40.0 * m)
    assert close(recheck(req, v)["s"], m)
    want = brute_force(req).best
    assert want is not None and close(want[0], 40.0 * m) and want[2] == 2
    assert select(base, "exact").reason is Infeasibility.NO_CAPACITY


def test_busy_time_shares_are_the_restated_load_over_the_restated_capacity() -> None:
    """Under BUSY_TIME a running instance's compute share is `existing_w / cap_w` with `existing_w = load x
    cap_w / C` (the spec's formulas, in their order): one more rounding than `load / C`. Two co-residents each
    at a tenth of their reference capacity (15 of 150 and 30 of 300 tok/s) tie exactly under OUTPUT_TOKENS
    (0.1 each: the new instance goes to g0, which has more free memory); under BUSY_TIME the literal shares
    differ by an ulp (1.4e-17) and the less occupied GPU, g1, wins although it has less free memory."""
    wf = Workflow("w", (Stage("s", StageKind.LLM, (), 500, 100),))
    profiles = (Profile("r1", 1, 1, 10.0, 0.0, 1e-4, 0.01, 150.0, decode_tokens_per_s=225.0),
                Profile("r2", 1, 1, 10.0, 0.0, 1e-4, 0.01, 300.0),
                Profile("m", 1, 1, 20.0, 0.0, 0.0, 0.01, 1000.0))
    running = (Instance("i1", "r1", 1, 1, ("g0",), 15.0), Instance("i2", "r2", 1, 1, ("g1",), 30.0))
    gpus = (Gpu("g0", "n0", 80.0, 10.0), Gpu("g1", "n0", 80.0, 20.0))
    tokens = SelectionRequest(Slo(0.1, 10.0, 0.5), (wf,), (Model("m", 0.5, 1.0, 1.0),), profiles,
                              Cluster(gpus, running), SelectionOptions(gpu_sharing=GpuSharing.INTERFERENCE))
    busy = _opts(tokens, capacity_model=CapacityModel.BUSY_TIME)
    s_tok, s_busy = running_shares(tokens, wf), running_shares(busy, wf)
    assert s_tok["i1"].rho == s_tok["i2"].rho == 0.1
    assert s_busy["i1"].rho > s_busy["i2"].rho and close(s_busy["i1"].rho, 0.1) and close(s_busy["i2"].rho, 0.1)
    for req, gpu in ((tokens, "g0"), (busy, "g1")):
        v = select(req, "exact").variant
        assert v is not None and v.new_instances[0].gpu_ids == (gpu,), (req.options.capacity_model, v)
        recheck(req, v)
