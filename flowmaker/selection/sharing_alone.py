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

`alone_floor` is the least L of an assignment of the stages to reused instances and to new instances of each class
under those counts and capacities (a small MILP, HiGHS for a few nodes: its dual bound holds when unsettled). It
bounds the L_s of every variant from below; INF proves that no variant exists. Floats with margins that only lower
the bound. `walk_floor` is what the walks call: the LP, then a few MILP nodes when the LP comes close to the target.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

from flowmaker.selection.problem import INF, NEW, REUSE, Problem, PWorkflow
from flowmaker.selection.sharing_chain import HighsModel
from flowmaker.sharing import busy_share, occupancy

LEVELS = 4  # classes of slowed new instances by their co-residents' least busy total (`levels`)
ALONE_NODES = 200  # HiGHS nodes of the floor's MILP (work, not time); unsettled, its dual bound
_MARGIN = 1e-9

Option = tuple[str, int, float]  # (kind, ref, latency bound), as `milp.RelaxedModel.opts`


def blocked_gpus(pb: Problem, b_new: float, c_new: float = 0.0) -> frozenset[str]:
    """The GPUs no new instance may use: one busy `b_new` (the least a new instance is) there slows a running
    co-resident past Feasibility 5.4 (`sharing_chain._co_fails`), and busy shares only grow; or its compute share
    `c_new` (the least a new replica adds) takes the GPU past its budget (5.1)."""
    from flowmaker.selection.sharing_chain import CO_CHECK, _co, _co_fails

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
    instances are busy less than t_count[i] (any other new replica is busy at least b_new >= t_count[i]). The
    thresholds: the least positive running busy total and up to `most` - 1 more of them below b_new, evenly by rank,
    then b_new itself."""
    busy0 = pb._fast_totals()[1]
    runs = sorted({b for g, b in busy0.items() if 0.0 < b < b_new and g not in blocked})
    picks = [runs[round(i * (len(runs) - 1) / max(1, most - 1))] for i in range(min(most, len(runs)))] if runs else []
    out = [(b, b) for b in sorted(set(picks))]
    out.append((b_new, b_new * (1 + 2 * _MARGIN)))  # (b_new carries a margin down: counted a little generously)
    return out


def alone_floor(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]], tool: float,
                lat_cap: float, deadline: float = INF, nodes: int = ALONE_NODES, presolve: bool = True) -> float:
    """A lower bound of the slowed L_s of every variant of `pw` (module docstring), `opts` the walk's options per
    LLM stage, `tool` a chain's TOOL stages' latency (a DAG's longest path counts them itself); INF when no variant
    meets `lat_cap`. 0.0 when it proves nothing
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
    b_new = least_new_busy(pb, pw, opts)
    if not b_new < INF:
        return 0.0
    c_new = min(busy_share(pw.load[s] / pb.p_reps[ref], pb.profiles[ref].max_output_tokens_per_s)
                for s in llm for k, ref, _ in opts[s] if k == NEW) * (1 - _MARGIN)
    blocked = blocked_gpus(pb, b_new, c_new)
    lv = levels(pb, b_new, blocked=blocked)
    kappa = float(pb.kappa)
    fs = [1.0] + [1.0 + kappa * t_f * (1 - _MARGIN) for t_f, _ in lv]  # per class, the least f
    state = pb.share_state(pb.free0, *pb._fast_totals())
    budget = pb.u * (1 + 1e-9) * (1 + 1e-7)
    mdl = HighsModel(0)  # (no stage rows of its own: `one` below)
    row, entries = mdl.row, mdl.entries

    def col(a: float, b: float, is_int: bool) -> int:
        return mdl.col(0.0, [], a, b, is_int)

    n = float(len(llm))
    ncls = len(fs)
    y = {(p, c): col(0.0, n, True) for p in profs for c in range(ncls)}  # new groups of p in class c
    cap_row = {(p, c): row(-INF, 0.0) for p in profs for c in range(ncls)}
    for p in profs:
        for c, f_c in enumerate(fs):
            most_load = pb.profiles[p].max_output_tokens_per_s * pb.p_reps[p] * budget / f_c  # (5.2)
            entries[y[(p, c)]].append((cap_row[(p, c)], -min(_tol(pb.p_cap[p]), most_load)))
    for i, (_, t_count) in enumerate(lv):  # classes 0..i: GPUs of their own, running busy < t_count, one node each
        counts, gpus = calm_counts(pb, profs, t_count if i else min(t_count, 1e-300), blocked)
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
    # Every new replica lies on GPUs no running co-resident forbids (`blocked_gpus`): their compute budgets (5.1)
    # hold its shares, and their free memory its memory
    comp0 = pb._fast_totals()[0]
    least_need = min(pb.p_need[p] for p in profs)
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

    def option(lat: float, rows: list[tuple[int, float]]) -> int:
        c = col(0.0, 1.0, True)
        entries[c] += rows + [(r_, sign * lat) for r_, sign in lat_rows[s]]
        return c

    for s in llm:
        one = row(1.0, 1.0)
        ld = pw.load[s]
        for kind, ref, lat in opts[s]:
            if kind == REUSE:
                option(lat, [(one, 1.0), (spare[ref], ld)])
                continue
            rho = busy_share(ld / pb.p_reps[ref], pb.profiles[ref].max_output_tokens_per_s)
            for c, f_c in enumerate(fs):  # at least the multiplier of its class's least f at its own share
                m = state.multiplier_lb(f_c, rho) if c else 1.0
                if m < INF:
                    link = row(-INF, 0.0)
                    option(max(lat, pw.lat_new[s][ref] * m * (1 - _MARGIN)) if c else lat,
                           [(one, 1.0), (cap_row[(ref, c)], ld), (link, 1.0),
                            (room_row, pb.p_reps[ref] * pb.p_k[ref] * rho * (1 - _MARGIN))])
                    entries[y[(ref, c)]].append((link, -1.0))
    mdl.cost[L] = 1.0
    h = mdl.highs(integer=nodes > 0)
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
    if nodes <= 0:  # the LP alone: its optimum, or nothing proven
        db = info.objective_function_value if name == "Optimal" else None
    else:
        db = getattr(info, "mip_dual_bound", None)
        if name == "Optimal":
            db = min(db if db is not None and math.isfinite(db) else INF, info.objective_function_value)
    if db is None or not math.isfinite(db):
        return 0.0
    return max(0.0, tool + db) * (1 - 1e-7)


def walk_floor(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]], tool: float, deadline: float,
               milp_gap: float, milp_nodes: int) -> float:
    """The walks' use of `alone_floor` against the request's latency target: its LP, then (when the LP's floor is
    within `milp_gap` of the target) its MILP for `milp_nodes` nodes, the larger kept; INF: no variant exists."""
    from flowmaker.selection.milp import _tol

    cap = _tol(pb.lam)
    got = alone_floor(pb, pw, opts, tool, cap, deadline, nodes=0, presolve=False)
    if got < INF and got >= cap * (1 - milp_gap):
        got = max(got, alone_floor(pb, pw, opts, tool, cap, deadline, nodes=milp_nodes, presolve=False))
    return got
