"""GPU sharing: a floor under the slowed latency of every variant of a workflow, from how few new instances can run
alone (docs/selection-spec.md, "Extension: GPU sharing", "What is exact").

The walks price each new instance at `Problem.bound_view`'s latency: every one of them on the least busy GPUs, so
on a cluster with few idle GPUs a multiset of many fast instances looks as quick as one. It is not: an instance
runs unslowed only when no GPU of it has a busy co-resident (a running instance busy some of the time, or another
new instance, which is always busy some of the time). Those instances need idle GPUs of their own, and a node of I
idle GPUs holds at most floor(I / k) of them with k GPUs each. Every other new instance has a co-resident busy at
least `b_min` (the least busy share of any running instance's GPU, or of any new instance), so its stages take at
least `f (1 - rho) / (1 - rho f)` times their latency alone with `f = 1 + kappa b_min`, and it carries at most
u x C / f of load (Feasibility 5.2). Measured: chain_clones 1303009 under sharing needs four fast tp4 instances at
a latency target 4% above the fastest chain, two of them fit alone, and the walk priced 3,800 multisets in 10 s
without an answer; the branch and bound proved it infeasible after 44 s.

The same holds level by level (`levels`): a new instance whose co-residents are busy less than t runs on GPUs of
its own whose running instances are busy less than t (any other new instance is busy more), and one whose
co-residents are busy at least t is slowed by 1 + kappa t at least.

Node by node (`_node_rows`): a new instance that shares no GPU with another new one takes GPUs of its own, so the
instances of the lower classes and, when one is there, a shared instance's k GPUs fit in each node's GPUs. Measured:
chain_clones 1447011 (a latency target 4.4% above the LP floor) places one fast tp4 alone on the only node with four
idle GPUs, and a second fast tp4 slowed by 1.17 at least needs four more GPUs beside no other new instance's; there
are none, so the MILP proves in 0.12 s that no variant exists (the walk had none after 60 s).

A GPU whose running instances 5.4 protects caps the busy share of any new instance on it (`busy_caps`): the least
cap of a placement caps its instance's stages' latencies alone, and the instances on a capped GPU together offer at
most -log(1 - cap) call-seconds per second. Measured: chain_clones 1433042 and 1433018 (u = 0.5, most running
instances near or above it), whose LP floor was 0.9% and 2.7% under the target, are proven infeasible by the LP.

`alone_floor` is the least L of an assignment of the stages to reused instances and to new instances of each class
under those counts and capacities (a small MILP, HiGHS for a few nodes: its dual bound holds when unsettled). It
bounds the L_s of every variant from below; INF proves that no variant exists. Floats with margins that only lower
the bound. `walk_floor` is what the walks call: the LP, then a few MILP nodes when the LP comes close to the target.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from flowmaker.selection.problem import INF, NEW, REUSE, Problem, PWorkflow
from flowmaker.selection.sharing_chain import HighsModel
from flowmaker.sharing import busy_share, occupancy

LEVELS = 4  # classes of slowed new instances by their co-residents' least busy total (`levels`)
NODE_ROWS = True  # `_node_rows`
CLONES = True  # near-identical profiles merged in the floor's model (`merged`)
MERGE_TOL = 0.05  # (measured on 360 chain_clones under sharing, 2 s budget: 0.05 proves 1601053, 0.02 does not; no loss)
ALONE_NODES = 200  # HiGHS nodes of the floor's MILP (work, not time); unsettled, its dual bound
# The floor's MILP is asked one question, "is there any point under the target?": it stops at the first integer point
# (HiGHS' mip_max_improving_sols 1; its dual bound still holds), a model that has one is not solved again
# (`walk_floor`), and it runs HiGHS' RINS and RENS, which the packings' MILPs leave out (measured on 360 chain_clones of
# six held-out seeds under sharing, 2 s budget: 327 -> 333 proven within 1 s, none lost, chain_clones 1721036 proven
# infeasible in 0.5 s where its root alone took 0.8 s; wide fans and the other families unchanged)
FIRST_POINT = True
SUBMIPS = True
CONVEX_CUTS = 8  # tangents per slowed group in `_convex_rows`
CONVEX_MILP = True  # (measured: the MILP with them proves chain_clones 1723020 and 1787041 infeasible; its LP alone does not)
_MARGIN = 1e-9

Option = tuple[str, int, float]  # (kind, ref, latency bound), as `milp.RelaxedModel.opts`


def blocked_gpus(pb: Problem, b_new: float, c_new: float = 0.0) -> frozenset[str]:
    """The GPUs no new instance may use: one busy `b_new` (the least a new instance is) there slows a running
    co-resident past Feasibility 5.4 (`sharing_chain._co_fails`), and busy shares only grow; or its compute share
    `c_new` (the least a new replica adds) takes the GPU past its budget (5.1)."""
    from flowmaker.selection.order_search import _co_fails
    from flowmaker.selection.sharing_chain import CO_CHECK, _co

    if not CO_CHECK:
        return frozenset()
    comp0, busy0 = pb._fast_totals()
    kappa, top = float(pb.kappa), pb.u * (1 + 1e-9) * (1 + 1e-7)
    out = set()
    for g in pb.free0:
        on = pb.on_gpu.get(g, ())
        if on and comp0.get(g, 0.0) + c_new > top:
            out.add(g)
        elif on:
            bl = dict(busy0)
            bl[g] = bl.get(g, 0.0) + b_new
            if any(_co_fails(c, bl, c.b0, c.rho0, kappa, top) for c in (_co(pb, i) for i in on)):
                out.add(g)
    return frozenset(out)


def barred(pb: Problem) -> frozenset[str]:
    """GPU sharing: the GPUs no new instance of any workflow may use (`blocked_gpus` at the least busy and compute
    shares a new replica has over every workflow and profile). Once per request."""
    got = getattr(pb, "_barred", None)
    if got is not None:
        return got
    out: frozenset[str] = frozenset()
    if pb.sharing and float(pb.kappa) > 0.0 and pb.on_gpu:
        # the least latency alone per replica and the least load share per unit of capacity (occupancy and busy_share
        # grow with them: one call each at the end; a request of many workflows and profiles takes milliseconds)
        reps = pb.p_reps
        per_cap = [1.0 / (r * p.max_output_tokens_per_s) if p.max_output_tokens_per_s > 0 else INF
                   for r, p in zip(reps, pb.profiles, strict=True)]
        t_new = c_new = INF
        for pw in pb.workflows:
            for s in pw.llm:
                row = pw.lat_new[s]
                t_new = min(t_new, min((lat / r for lat, r in zip(row, reps, strict=True) if lat < INF), default=INF))
                c_new = min(c_new, pw.load[s] * min((c for lat, c in zip(row, per_cap, strict=True) if lat < INF),
                                                    default=INF))
        if t_new < INF:
            out = blocked_gpus(pb, occupancy(pb.rho * t_new) * (1 - _MARGIN), c_new * (1 - _MARGIN))
    pb._barred = out  # type: ignore[attr-defined]
    return out


def placeable_new(pb: Problem) -> list[bool]:
    """GPU sharing: per profile, whether a new instance of it may be placed in some feasible variant: some node has
    k GPUs with its memory free, none of them `barred`. A replica of k GPUs lies on k GPUs of one node, none of them
    barred, in every variant that passes Feasibility 5, so without such a node no variant has one."""
    bar = barred(pb)
    if not bar:
        return [True] * len(pb.profiles)
    kth: dict[int, int] = {}  # per k, the most free memory of a k-th GPU of a node, barred ones left out
    for ids in pb.layout.gpus_by_node:
        free = sorted((pb.free0[g] for g in ids if g not in bar), reverse=True)
        for k in range(1, len(free) + 1):
            kth[k] = max(kth.get(k, -1), free[k - 1])
    return [pb.p_need[i] <= kth.get(pb.p_k[i], -1) for i in range(len(pb.profiles))]


def calm_counts(pb: Problem, profs: Sequence[int], below: float, blocked: frozenset[str] = frozenset()
                ) -> tuple[dict[int, int], int]:
    """(per k, at most how many new replicas of k or more GPUs each, of these profiles, can run on GPUs of their own
    whose running instances are busy less than `below` in total: sum over nodes of floor(such GPUs where one fits /
    k); at most how many GPUs they take together)."""
    busy0 = pb._fast_totals()[1]
    least_need = min((pb.p_need[p] for p in profs), default=0)
    counts: dict[int, int] = {}
    for k in sorted({pb.p_k[p] for p in profs}):
        need = min(pb.p_need[p] for p in profs if pb.p_k[p] >= k)
        counts[k] = sum(sum(1 for g in gids if busy0.get(g, 0.0) < below and pb.free0[g] >= need
                            and g not in blocked) // k
                        for gids in pb.layout.gpus_by_node)
    gpus = sum(1 for gids in pb.layout.gpus_by_node for g in gids
               if busy0.get(g, 0.0) < below and pb.free0[g] >= least_need and g not in blocked)
    return counts, gpus


def least_new_busy(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]]) -> float:
    """The least busy share a new replica can have (its quickest stage alone, `occupancy` as Feasibility 5 counts
    it), a little low."""
    least = INF
    for s in pw.llm:
        for k, ref, _ in opts[s]:
            if k == NEW:
                least = min(least, occupancy(pb.rho * pw.lat_new[s][ref] / pb.p_reps[ref]))
    return least * (1 - _MARGIN)


def levels(pb: Problem, b_new: float, most: int = LEVELS, blocked: frozenset[str] = frozenset()
           ) -> list[tuple[float, float]]:
    """The classes of new instances by how busy their co-residents are at least, as (t_f, t_count) from class 1 up
    (class 0: none busy). Class i has f >= 1 + kappa t_f[i]; classes below i run on GPUs of their own whose running
    instances are busy less than t_count[i], with no other new replica beside them (a group with one is in the
    last class: that co-resident is busy at least b_new). The thresholds: the least positive running busy total and up to `most` - 1 more of them below b_new, evenly by rank,
    then b_new itself."""
    busy0 = pb._fast_totals()[1]
    runs = sorted({b for g, b in busy0.items() if 0.0 < b < b_new and g not in blocked})
    picks = [runs[round(i * (len(runs) - 1) / max(1, most - 1))] for i in range(min(most, len(runs)))] if runs else []
    out = [(b, b) for b in sorted(set(picks))]
    out.append((b_new, b_new * (1 + 2 * _MARGIN)))  # (b_new carries a margin down: counted a little generously)
    return out


def _below(lv: Sequence[tuple[float, float]], i: int) -> float:
    """The running busy total that class i's GPUs stay under (class 0: none busy at all)."""
    return lv[i][1] if i else min(lv[0][1], 1e-300)


def busy_caps(pb: Problem, blocked: frozenset[str]) -> dict[str, float]:
    """Per GPU that is not `blocked` and hosts a running instance, the most busy share a new replica on it may have
    (a little high; 1.0: none too high fails): more slows a running co-resident past Feasibility 5.4 even with every
    other busy total at its running value (`_co_fails`, monotone in the replica's share: found by bisection), and
    busy totals only grow as a variant adds instances and stages."""
    from flowmaker.selection.order_search import _co_fails
    from flowmaker.selection.sharing_chain import _co

    memo: dict[frozenset[str], dict[str, float]] | None = getattr(pb, "_busy_caps", None)
    if memo is None:
        memo = pb._busy_caps = {}  # type: ignore[attr-defined]
    got_all = memo.get(blocked)
    if got_all is not None:
        return got_all
    busy0 = pb._fast_totals()[1]
    kappa, top = float(pb.kappa), pb.u * (1 + 1e-9) * (1 + 1e-7)
    out: dict[str, float] = {}
    memo[blocked] = out
    bl = dict(busy0)  # the busy totals, one GPU's raised per try and restored after
    for g, on in pb.on_gpu.items():
        if g in blocked or g not in pb.free0 or not on:
            continue
        cos = [_co(pb, i) for i in on]

        def fails(b: float, g: str = g, cos: list = cos) -> bool:
            bl[g] = busy0.get(g, 0.0) + b
            return any(_co_fails(c, bl, c.b0, c.rho0, kappa, top) for c in cos)

        if not fails(1.0):
            bl[g] = busy0.get(g, 0.0)
            continue
        lo, hi = 0.0, 1.0  # fails(hi); lo is 0 or does not fail
        for _ in range(60):
            mid = (lo + hi) / 2
            if fails(mid):
                hi = mid
            else:
                lo = mid
        bl[g] = busy0.get(g, 0.0)
        got = hi * (1 + 1e-7) + 1e-12
        if got < 1.0:
            out[g] = got
    return out


def _class_caps(pb: Problem, p: int, eligible: Sequence[str], required: Sequence[str] | None,
                caps: Mapping[str, float], rooms: Mapping[str, float]) -> tuple[float, float] | None:
    """For a replica of profile `p` on `eligible` GPUs (all its k on one node) with at least one of `required` (None:
    no such condition): the most its least busy cap and its least compute room can be, over every such placement;
    None when no node has one."""
    k, need = pb.p_k[p], pb.p_need[p]
    elig = set(eligible)
    req = set(required) if required is not None else None
    best_b = best_u = -1.0
    for ids in pb.layout.gpus_by_node:
        e = [g for g in ids if g in elig and pb.free0[g] >= need]
        if len(e) < k or (req is not None and not any(g in req for g in e)):
            continue

        def most_least(figs: Mapping[str, float], e: list[str] = e) -> float:
            # the k-th largest figure here, and no more than the best required GPU's (one must be taken)
            got = sorted((figs.get(g, 1.0) for g in e), reverse=True)[k - 1]
            return got if req is None else min(got, max(figs.get(g, 1.0) for g in e if g in req))

        best_b, best_u = max(best_b, most_least(caps)), max(best_u, most_least(rooms))
    return None if best_b < 0 else (best_b, best_u)


def _node_rows(pb: Problem, mdl: HighsModel, profs: Sequence[int], y: Mapping[tuple[int, int], int],
               lv: Sequence[tuple[float, float]], blocked: frozenset[str], least_need: int, n: float) -> None:
    """The floor's classes node by node. A replica of a class below T has no other new replica beside it (the
    classes' definition: a group with a new co-resident is shared, class T or T + 1), so on each node the replicas of
    classes 0..i take GPUs of their own among those whose running instances are busy less than class i's upper
    threshold; a shared replica of k GPUs lies on k GPUs of one node that no replica of a lower class uses. A
    continuous count per (node, class, k) and a binary per (node, k), linked to the classes' group counts."""
    row, entries = mdl.row, mdl.entries
    busy0 = pb._fast_totals()[1]
    n_lv = len(lv)
    ks = sorted({pb.p_k[p] for p in profs})
    need_k = {k: min(pb.p_need[p] for p in profs if pb.p_k[p] == k) for k in ks}
    below = [_below(lv, i) for i in range(n_lv)]
    link = {(c, k): row(0.0, 0.0) for c in range(n_lv + 2) for k in ks}
    for p in profs:
        for c in range(n_lv + 2):
            entries[y[(p, c)]].append((link[(c, pb.p_k[p])], -float(pb.p_reps[p]) if c < n_lv else 1.0))
    for ids in pb.layout.gpus_by_node:
        e = [g for g in ids if g not in blocked and pb.free0[g] >= least_need]
        if not e:
            continue
        own: list[tuple[int, int]] = []  # (column, k) of this node's exclusive replicas
        nested = [row(-INF, float(sum(1 for g in e if busy0.get(g, 0.0) < below[i]))) for i in range(n_lv)]
        for c in range(n_lv):
            for k in ks:
                most = sum(1 for g in e if busy0.get(g, 0.0) < below[c] and pb.free0[g] >= need_k[k]) // k
                if most <= 0:
                    continue
                w = mdl.col(0.0, [(link[(c, k)], 1.0)], 0.0, float(most), False)
                for i in range(c, n_lv):
                    entries[w].append((nested[i], float(k)))
                own.append((w, k))
        for k in ks:
            fit = sum(1 for g in e if pb.free0[g] >= need_k[k])
            if fit < k:
                continue
            # some shared replica of k GPUs here (binary): its k GPUs and the exclusive ones' fit in e
            sh = mdl.col(0.0, [], 0.0, 1.0, True)
            r_ = row(-INF, float(len(e)))
            entries[sh].append((r_, float(k)))
            for w, kw in own:
                entries[w].append((r_, float(kw)))
            for c in (n_lv, n_lv + 1):  # at most n shared groups of k GPUs per node that holds one
                entries[sh].append((link[(c, k)], -n))
    for c in (n_lv, n_lv + 1):  # the shared classes' links are "at most": groups <= n x (nodes that hold one)
        for k in ks:
            mdl.rlo[link[(c, k)]] = -INF
            mdl.rhi[link[(c, k)]] = 0.0


def merged(pb: Problem, pw: PWorkflow, llm: Sequence[int], opts: Mapping[int, Sequence[Option]],
           profs: Sequence[int]) -> tuple[list[int], dict[int, float], dict[int, float],
                                          dict[int, dict[int, tuple[float, float]]]]:
    """The floor's profiles with near-identical ones merged (CLONES; grouped as `clones.clone_groups` groups them,
    the same replicas, GPUs and stages, memory, capacity and every latency within MERGE_TOL of each other, first fit).
    A group is one profile at least as good as each member: its representative (the least memory) keeps its GPUs,
    replicas and memory per GPU, and it gets the most tokens per second and capacity, and per stage the least latency
    bound and latency alone. Every row of the floor's model is monotone in these figures, and its counts and loads add
    over a group's members, so every variant still maps to a solution: the floor stays a lower bound, with a column per
    (stage, group, class) instead of per profile. Any grouping of the same GPUs and replicas would be sound; wider ones
    bound less. Measured (chain_clones under sharing, 34-42 models of which 23-31 clones): the MILP that proves
    1601053 infeasible took 2.7 s on every profile, 1.3 s merged at 0.02 and 0.33 s at 0.05; 1567055 1.0 s -> 0.1 s.
    Returns (representatives, per representative its tokens per second and capacity, per LLM stage {representative:
    (latency bound, latency alone)})."""
    from flowmaker.selection.clones import _near, profile_buckets
    from flowmaker.selection.milp import _tol

    lat, buckets = profile_buckets(pb, llm, opts)

    def near(a: float, b: float) -> bool:
        return _near(a, b, MERGE_TOL)

    groups: list[list[int]] = []
    for ps in buckets.values():
        ps.sort(key=lambda p: (pb.p_need[p], p))
        mine: list[list[int]] = []
        for p in ps:  # (first fit: a clone of another model between two in memory order does not split them)
            for cur in mine if CLONES else ():
                if all(near(pb.p_need[p], pb.p_need[q]) and near(pb.p_cap[p], pb.p_cap[q])
                       and all(near(lat[p][s], lat[q][s]) and near(pw.lat_new[s][p], pw.lat_new[s][q])
                               for s in lat[p]) for q in cur):
                    cur.append(p)
                    break
            else:
                mine.append([p])
        groups += mine
    tok: dict[int, float] = {}
    cap_of: dict[int, float] = {}
    new_opts: dict[int, dict[int, tuple[float, float]]] = {s: {} for s in llm}
    for g in groups:
        r = g[0]
        tok[r] = max(pb.profiles[p].max_output_tokens_per_s for p in g)
        cap_of[r] = max(_tol(pb.p_cap[p]) for p in g)
        for s in lat[r]:
            new_opts[s][r] = (min(lat[p][s] for p in g), min(pw.lat_new[s][p] for p in g))
    return sorted(tok), tok, cap_of, new_opts


def alone_floor(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]], tool: float,
                lat_cap: float, deadline: float = INF, nodes: int = ALONE_NODES, presolve: bool = True,
                found: list[bool] | None = None, convex: bool = False) -> float:
    """A lower bound of the slowed L_s of every variant of `pw` (module docstring), `opts` the walk's options per
    LLM stage, `tool` a chain's TOOL stages' latency (a DAG's longest path counts them itself); INF when no variant
    meets `lat_cap`; `found` gets True when the MILP finds an integer point under it. 0.0 when it proves nothing
    (no HiGHS, no interference, or every new instance may run alone)."""
    from flowmaker.selection.chain import HIGHS_TIME_SHARE, is_chain
    from flowmaker.selection.exact import run_checked
    from flowmaker.selection.milp import _CORE, _tol

    if _CORE is None or not pb.sharing or float(pb.kappa) <= 0.0:
        return 0.0
    llm = [s for s in pw.llm if opts.get(s)]
    if len(llm) != len(pw.llm):
        return INF  # a stage with no option: nothing meets the target
    profs = sorted({ref for s in llm for k, ref, _ in opts[s] if k == NEW})
    if not profs:
        return 0.0
    # near-identical profiles as one (`merged`): per group its representative's index, its figures the best of its
    # members'; per stage and group the least latency bound and latency alone
    profs, tok, cap_of, new_opts = merged(pb, pw, llm, opts, profs)
    b_new = least_new_busy(pb, pw, opts)
    if not b_new < INF:
        return 0.0
    c_new = min(busy_share(pw.load[s] / pb.p_reps[ref], pb.profiles[ref].max_output_tokens_per_s)
                for s in llm for k, ref, _ in opts[s] if k == NEW) * (1 - _MARGIN)
    blocked = blocked_gpus(pb, b_new, c_new)
    lv = levels(pb, b_new, blocked=blocked)
    kappa = float(pb.kappa)
    fs = [1.0] + [1.0 + kappa * t_f * (1 - _MARGIN) for t_f, _ in lv]  # per class, the least f
    # Class T (co-residents busy at least b_new) split in two: T on GPUs whose running co-residents cap no new busy
    # share (`busy_caps`), T + 1 with such a GPU, its busy share (so its stages' latencies alone) capped
    fs.append(fs[-1])
    state = pb.share_state(pb.free0, *pb._fast_totals())
    budget = pb.u * (1 + 1e-9) * (1 + 1e-7)
    comp0, busy0 = pb._fast_totals()
    caps = busy_caps(pb, blocked)
    rooms = {g: max(0.0, budget - comp0.get(g, 0.0)) * (1 + 1e-7) + 1e-12 for g in pb.free0}
    unb = [g for g in pb.free0 if g not in blocked]
    n_lv = len(lv)

    def where(c: int) -> tuple[list[str], list[str] | None]:
        """Class c's replicas' GPUs, and those one of them has (None: any)."""
        if c < n_lv:  # co-residents running only, busy less than the class's upper threshold, at least its lower
            below = _below(lv, c)
            return [g for g in unb if busy0.get(g, 0.0) < below], ([g for g in unb if pb.on_gpu.get(g)] if c else None)
        if c == n_lv:
            return [g for g in unb if g not in caps], None
        return unb, list(caps)

    mdl = HighsModel(0)  # (no stage rows of its own: `one` below)
    row, entries = mdl.row, mdl.entries

    def col(a: float, b: float, is_int: bool) -> int:
        return mdl.col(0.0, [], a, b, is_int)

    n = float(len(llm))
    ncls = len(fs)
    c_caps = {(p, c): _class_caps(pb, p, *where(c), caps, rooms) for p in profs for c in range(ncls)}
    y = {(p, c): col(0.0, n if c_caps[(p, c)] is not None else 0.0, True)  # new groups of p in class c
         for p in profs for c in range(ncls)}
    cap_row = {(p, c): row(-INF, 0.0) for p in profs for c in range(ncls)}
    busy_row: dict[tuple[int, int], int] = {}  # (p, c): its groups' stages' latencies alone, at most what caps them
    # Class T + 1 together: every new replica x on a capped GPU g has b_x <= cap_g, so n_x (its offered call-seconds,
    # b_x = 1 - exp(-n_x)) <= N_g = -log(1 - cap_g), and on [0, N_g] 1 - exp(-n) >= n cap_g / N_g (a chord under a
    # concave curve): the replicas on g, whose busy shares add up to at most cap_g, offer at most N_g together. A
    # replica of k GPUs on a node with e GPUs it may use, e_c of them capped, holds at least m = max(1, k - (e - e_c))
    # capped GPUs there. So the class's replicas of k GPUs offer at most the sum over nodes of their capped N_g over
    # m, and all of them, each counted its least m times, at most the N_g summed. (Per k, not per profile: clones
    # share their GPUs' figures; the least memory of the k-GPU profiles gives the most GPUs, so the largest figures.)
    least_need = min(pb.p_need[p] for p in profs)
    n_cap = {g: -math.log1p(-v) * (1 + 1e-7) + 1e-12 for g, v in caps.items()}
    offered_row = row(-INF, sum(v for g, v in n_cap.items() if pb.free0[g] >= least_need)) if pb.rho > 0 else -1
    p_offered: dict[int, tuple[int, int]] = {}  # p: (its k's row, the least capped GPUs of one replica)
    for k in sorted({pb.p_k[p] for p in profs}) if offered_row >= 0 else ():
        need = min(pb.p_need[q] for q in profs if pb.p_k[q] == k)
        most, least_m = 0.0, len(pb.free0) + 1
        for ids in pb.layout.gpus_by_node:
            e = [g for g in ids if g not in blocked and pb.free0[g] >= need]
            ec = [g for g in e if g in n_cap]
            if len(e) >= k and ec:
                m_v = max(1, k - (len(e) - len(ec)))
                most += sum(n_cap[g] for g in ec) / m_v
                least_m = min(least_m, m_v)
        if most > 0:
            k_row = row(-INF, most * (1 + 1e-9))
            p_offered.update((p, (k_row, least_m)) for p in profs if pb.p_k[p] == k)
    for p in profs:
        unit = tok[p] * pb.p_reps[p]
        for c, f_c in enumerate(fs):
            most_load = min(cap_of[p], unit * budget / f_c)  # (5.2)
            cc = c_caps[(p, c)]
            if cc is not None:
                most_load = min(most_load, unit * cc[1])  # (5.1: each replica's share within its GPUs' room)
                if cc[0] < 1.0 and pb.rho > 0:
                    busy_row[(p, c)] = r_ = row(-INF, 0.0)
                    entries[y[(p, c)]].append((r_, -(-math.log1p(-cc[0]) * pb.p_reps[p] / pb.rho * (1 + 1e-7))))
            entries[y[(p, c)]].append((cap_row[(p, c)], -most_load))
    for i in range(len(lv)):  # classes 0..i: GPUs of their own, running busy below class i's, one node each
        counts, gpus = calm_counts(pb, profs, _below(lv, i), blocked)
        for k, most in counts.items():
            r_ = row(-INF, float(most))
            for p in profs:
                if pb.p_k[p] >= k:
                    for c in range(i + 1):
                        entries[y[(p, c)]].append((r_, float(pb.p_reps[p])))
        r_g = row(-INF, float(gpus))
        for p in profs:
            for c in range(i + 1):
                entries[y[(p, c)]].append((r_g, float(pb.p_reps[p] * pb.p_k[p])))
    if NODE_ROWS:
        _node_rows(pb, mdl, profs, y, lv, blocked, least_need, n)
    # Every new replica lies on GPUs no running co-resident forbids (`blocked_gpus`): their compute budgets (5.1)
    # hold its shares, and their free memory its memory
    open_g = [g for g in pb.free0 if g not in blocked and pb.free0[g] >= least_need]
    room_row = row(-INF, sum(max(0.0, budget - comp0.get(g, 0.0)) for g in open_g) * (1 + 1e-7) + 1e-9)
    mem_row = row(-INF, sum(pb.free0[g] for g in open_g) / 1e6 * (1 + 1e-9) + 1e-9)  # (in GB: rows of like scale)
    for p in profs:
        for c in range(ncls):
            entries[y[(p, c)]].append((mem_row, pb.p_reps[p] * pb.p_k[p] * pb.p_need[p] / 1e6))
    reus = sorted({ref for s in llm for k, ref, _ in opts[s] if k == REUSE})
    spare = {r: row(-INF, _tol(pb.p_cap[pb.r_prof[r]]) - pb.r_load0[r]) for r in reus}
    nv = len(pw.wf.stages)
    chain = is_chain(pw)  # one path: its latencies summed
    lat_rows: dict[int, list[tuple[int, float]]] = {}  # per LLM stage, (row, sign) its latency enters
    if chain:
        L = col(0.0, max(0.0, lat_cap - tool), False)
        lat_row = row(0.0, 0.0)  # L = the stages' latencies summed (a chain), its TOOL stages' apart
        entries[L].append((lat_row, -1.0))
        lat_rows = {s: [(lat_row, 1.0)] for s in llm}
    else:  # t_v - t_p - latency of v >= 0 for each predecessor p (or none), L - t_v >= 0: L is the longest path
        L = col(0.0, max(0.0, lat_cap), False)
        tool = 0.0
        t = [col(0.0, INF, False) for _ in range(nv)]
        for v in range(nv):
            base = pw.tool_lat[v] if not pw.wf.stages[v].is_llm else 0.0
            mine = []
            for p_ in pw.preds[v] or (None,):
                r_ = row(base, INF)
                entries[t[v]].append((r_, 1.0))
                if p_ is not None:
                    entries[t[p_]].append((r_, -1.0))
                mine.append((r_, -1.0))
            lat_rows[v] = mine
            top = row(0.0, INF)
            entries[L].append((top, 1.0))
            entries[t[v]].append((top, -1.0))

    def option(lat: float, rows: list[tuple[int, float]], in_lat: bool = True) -> int:
        c = col(0.0, 1.0, True)
        entries[c] += rows + ([(r_, sign * lat) for r_, sign in lat_rows[s]] if in_lat else [])
        return c

    conv = _convex_rows(pb, pw, mdl, llm, profs, new_opts, tok, fs, c_caps, y, budget, lat_row) \
        if convex and chain else {}
    for s in llm:
        one = row(1.0, 1.0)
        ld = pw.load[s]
        for kind, ref, lat in opts[s]:
            if kind == REUSE:
                option(lat, [(one, 1.0), (spare[ref], ld)])
        for ref, (lat, alone) in new_opts[s].items():
            rho = busy_share(ld / pb.p_reps[ref], tok[ref])
            for c, f_c in enumerate(fs):  # at least the multiplier of its class's least f at its own share
                m = state.multiplier_lb(f_c, rho) if c else 1.0
                if m < INF and c_caps[(ref, c)] is not None:
                    link = row(-INF, 0.0)
                    busy = [(busy_row[(ref, c)], alone)] if (ref, c) in busy_row else []
                    if c == n_lv + 1 and ref in p_offered:
                        n_x = pb.rho * alone / pb.p_reps[ref] * (1 - _MARGIN)
                        busy += [(offered_row, n_x * p_offered[ref][1]), (p_offered[ref][0], n_x)]
                    own = max(lat, alone * m * (1 - _MARGIN)) if c else lat
                    cv = conv.get((ref, c))
                    if cv is not None:  # its latency in the group's W instead (`_convex_rows`)
                        r_pc, row_a, serve, cuts = cv
                        busy += [(row_a, -own), (serve, -1.0)]
                        if lat <= alone * m * (1 - _MARGIN):  # r x its load at the instance's final load, the rest
                            part = max(0.0, alone - r_pc * ld) * m * (1 - _MARGIN)
                            busy += [(r_, g1 * ld - part) for r_, g1 in cuts]
                        else:
                            busy += [(r_, -own) for r_, _ in cuts]
                    option(own, [(one, 1.0), (cap_row[(ref, c)], ld), (link, 1.0),
                                 (room_row, pb.p_reps[ref] * pb.p_k[ref] * rho * (1 - _MARGIN)), *busy],
                           in_lat=cv is None)
                    entries[y[(ref, c)]].append((link, -1.0))
    mdl.cost[L] = 1.0
    h = mdl.highs(integer=nodes > 0)
    if nodes > 0:
        if FIRST_POINT:
            h.setOptionValue("mip_max_improving_sols", 1)
        if SUBMIPS:
            h.setOptionValue("mip_heuristic_run_rins", True)
            h.setOptionValue("mip_heuristic_run_rens", True)
    h.setOptionValue("mip_max_nodes", max(1, nodes))
    h.setOptionValue("presolve", "choose" if presolve else "off")
    left = deadline - time.perf_counter()
    if left <= 0:
        return 0.0
    h.setOptionValue("time_limit", min(left * HIGHS_TIME_SHARE, 1e9))  # (HiGHS may overrun its limit)
    name = run_checked(h)
    if name == "Infeasible":
        return INF
    info = h.getInfo()
    if found is not None and nodes > 0 and info.primal_solution_status >= 2:  # (2: HiGHS' kSolutionStatusFeasible)
        found.append(True)
    if nodes <= 0:  # the LP alone: its optimum, or nothing proven
        db = info.objective_function_value if name == "Optimal" else None
    else:
        db = getattr(info, "mip_dual_bound", None)
        if name == "Optimal":
            db = min(db if db is not None and math.isfinite(db) else INF, info.objective_function_value)
    if db is None or not math.isfinite(db):
        return 0.0
    return max(0.0, tool + db) * (1 - 1e-7)


def _convex_rows(pb: Problem, pw: PWorkflow, mdl: HighsModel, llm: Sequence[int], profs: Sequence[int],
                 new_opts: Mapping[int, Mapping[int, tuple[float, float]]], tok: Mapping[int, float],
                 fs: Sequence[float], c_caps: Mapping[tuple[int, int], Any], y: Mapping[tuple[int, int], int],
                 budget: float, lat_row: int) -> dict[tuple[int, int], tuple[float, int, int, list[tuple[int, float]]]]:
    """A chain's slowed instances, by their final load (docs/selection-spec.md, "Extension: GPU sharing"): on an
    instance of class c (f >= f_c) carrying X per replica of capacity U = replicas x C, each stage s takes its latency
    alone t_s times m(rho) = f (1 - rho) / (1 - rho f) at rho >= X / U, and t_s = r l_s + (t_s - r l_s) with r the least
    t / l of a stage that may use the profile (l its load). So the stages together take at least
    r U g(X / U) + sum (t_s - r l_s) m(rho_s), g(rho) = rho m(rho) convex, rho_s a stage's own share. Over the y
    instances of (p, c) carrying X in all, Jensen and g's tangents at rho_k give the linear rows
    W >= r (g'(rho_k) X - U rho_k^2 m'(rho_k) y) + sum (t_s - r l_s) m(rho_s), beside W >= the stages' own bounds
    summed (row A) and y <= the stages (every instance serves one, `serve`); W enters the chain's latency sum in place
    of its stages: the floor sees that stages sharing a slowed instance slow each other, which a stage's own share
    does not. Per (p, c): (r, row A, serve, [(row, the coefficient of a stage's load in it)]); a stage whose walk
    latency is above its own bound enters each row with that latency and stays out of X."""
    row, entries = mdl.row, mdl.entries
    got: dict[tuple[int, int], tuple[float, int, int, list[tuple[int, float]]]] = {}
    for p in profs:
        ratios = [new_opts[s][p][1] / pw.load[s] for s in llm if p in new_opts[s] and pw.load[s] > 0]
        if not ratios:
            continue
        r_p = min(ratios) * (1 - 1e-7)
        unit = tok[p] * pb.p_reps[p]
        for c, f_c in enumerate(fs):
            if c == 0 or f_c <= 1.0 or c_caps[(p, c)] is None:
                continue
            top = min(budget, 1.0) / f_c  # the share at which rho f reaches the cap (or 1)
            w = mdl.col(0.0, [], 0.0, INF, False)
            entries[w].append((lat_row, 1.0))
            row_a = row(0.0, INF)  # W >= its stages' own bounds summed
            entries[w].append((row_a, 1.0))
            serve = row(-INF, 0.0)  # every instance serves a stage: y <= its stages
            entries[y[(p, c)]].append((serve, 1.0))
            cuts = []
            for k in range(1, CONVEX_CUTS + 1):
                rk = top * k / (CONVEX_CUTS + 1)
                mk = f_c * (1 - rk) / (1 - rk * f_c)
                dm = f_c * (f_c - 1) / (1 - f_c * rk) ** 2
                r_ = row(0.0, INF)  # W - r g'(rho_k) X + r U rho_k^2 m'(rho_k) y >= 0
                entries[w].append((r_, 1.0))
                entries[y[(p, c)]].append((r_, r_p * unit * rk * rk * dm * (1 + 1e-7)))
                cuts.append((r_, -r_p * (mk + rk * dm) * (1 - 1e-7)))
            got[(p, c)] = (r_p, row_a, serve, cuts)
    return got


def walk_floor(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]], tool: float, deadline: float,
               milp_gap: float, milp_nodes: int, convex: bool = False) -> float:
    """The walks' use of `alone_floor` against the request's latency target: its LP, then (when the LP's floor is
    within `milp_gap` of the target) its MILP for `milp_nodes` nodes, the larger kept; INF: no variant exists.
    `convex`: with a chain's rows of `_convex_rows`."""
    from flowmaker.selection.milp import _tol

    cap = _tol(pb.lam)
    # (pw kept beside its id in the memos, so that the id is not reused by another workflow's view)
    opts_key = tuple((s, tuple(opts[s])) for s in sorted(opts))
    lp_key = (id(pw), tool, cap, convex, opts_key)
    memo = pb.alone_lps.get(lp_key)
    if memo is None:  # (a walk with nothing after BLIND_POPS steps asks again for the same model's LP)
        got = alone_floor(pb, pw, opts, tool, cap, deadline, nodes=0, presolve=False, convex=convex)
        if got > 0.0:  # (0.0: nothing proven, or the deadline passed)
            pb.alone_lps[lp_key] = (got, pw)
    else:
        got = memo[0]
    if got < INF and got >= cap * (1 - milp_gap):
        key = (id(pw), tool, cap, convex and CONVEX_MILP, opts_key)
        if key in pb.alone_points:
            return got  # its MILP has an integer point already: no more nodes can prove it empty
        found: list[bool] = []
        got = max(got, alone_floor(pb, pw, opts, tool, cap, deadline, nodes=milp_nodes, presolve=False, found=found,
                                   convex=convex and CONVEX_MILP))
        if found:
            pb.alone_points[key] = pw
    return got
