"""`milp`: the selection problem as a sequence of mixed-integer programs (HiGHS), and the bound `exact` takes from it.

The cost M * L is a product of the new memory M and the workflow latency L, so an optimum lies on the
(M, L) Pareto front of each workflow. With only the placement rule relaxed, one model describes the variants:

    x[u, o] in {0, 1}   stage u runs on option o (a running instance r, or a new instance of profile p)
    y[p] in Z+          new instances of profile p;  M = sum_p memory_p * y[p]
    t[v] >= t[pred] + sum_o latency[v, o] * x[v, o]   (longest path; L >= t[v], L <= lambda)
    sum_o x[u, o] = 1;  x[u, p] <= y[p];  M >= memory_p * x[u, p];  load placed on r <= its spare;
    load on p <= capacity_p * y[p];  sum over stages on p of f_k(load / capacity_p) <= y[p] (k = 1..CUT_K)
    room: sum of y[p] (replicas) over profiles of >= k GPUs and >= t per GPU <= what the nodes can hold

where f_k are Fekete and Schepers' dual feasible functions (`_dff`: what one instance carries weighs at most
1, so stages of different sizes too heavy to share count together) and the room rows (`room_rows`) count, per
(k GPUs, t per GPU) of a profile, how many such instances the free memory of the nodes can physically hold
under any placement rule: a point whose instances never fit is not a point of the relaxation.

Profiles that another one dominates in this workflow (no more memory or GPUs, at least the capacity, no
slower on any stage, no harder to place) are left out. The walk (`RelaxedModel.walk`) first solves for the least L (Lmin) and
the least M (Mmin), then keeps memory intervals [a, b] not yet proven, least bound a * (least L there)
first, starting from [Mmin, incumbent / Lmin]. For an interval it solves min L subject to M <= m (m the
midpoint, or b for an interval just above a proven part) and L <= incumbent / a:

- infeasible: no variant of memory in [a, m] beats the incumbent;
- a point (M', L'): every variant of memory in [M', m] costs at least M' * L'; [a, M') stays open with
  L >= L', and (m, b] stays open.

It ends when no open interval's bound is below the incumbent (ties included, so the least latency at the
optimal cost is on the walk), or at the deadline; the least bound over the points and the open intervals is a
lower bound of every variant of the workflow. Aggregating the capacity of the instances of one profile
relaxes bin packing, so each point's stages are packed into its instances exactly (depth first); when they do
not fit, a cut (all of these stages on p => at least as many instances as they need) is added and the interval
solved again. A packed point is numbered in the spec's order (slots by first stage) and checked exactly
(`Problem.check`: capacity and the LeastLoaded placement); then it is an incumbent.

Before the walks, `exact` improves the first branch and bound's incumbent by local moves (`local.improve`,
bounded by counts of work): a better incumbent is a better anytime answer and prunes the walks.

A chain workflow (one path of stages), and under the base contract a fan (a path, parallel stages, a path), is
walked instead by `chain.walk_chain` (instance multisets best first, each packed exactly), unless an all-reuse variant (cost 0) is already known; it settles the new-GPU
tie-break itself, so no `fewest_gpus` MILP follows.

HiGHS solves each MILP to a zero gap with feasibility tolerances of 1e-9, and every bound taken from it is
lowered by a relative 1e-9; the variants returned are always recomputed from the chosen assignment.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from flowmaker.domain import SelectionRequest, SelectionResult
from flowmaker.selection.problem import (
    EPS,
    INF,
    NEW,
    REL_TOL,
    REUSE,
    Choice,
    Problem,
    PWorkflow,
    better,
    leq,
)
from flowmaker.selection.registry import register
from flowmaker.selection.sharing_bound import compute_room, compute_share

COMPUTE_ROWS = True  # GPU sharing: the relaxed model's compute-room rows (`sharing_bound.compute_room`)
MIP_TOL = 1e-9  # feasibility tolerances handed to HiGHS
# The Pareto walk's MILPs without HiGHS' presolve and its RINS/RENS sub-MIPs: on these models of a few hundred rows
# they cost more than they save (measured: a fragmented DAG's L-MILP under sharing took 0.28 s with both, 0.08 s
# without, the same optimum; 600 held-out fragmented instances under sharing, 2 s budget: 592 -> 596 proven within
# 1 s; wide fans, chain_clones and dag_mix unchanged)
WALK_PRESOLVE = False
WALK_SUBMIPS = False
CUT_K = 3  # bin-packing cuts: the dual feasible functions u^(k), k = 1..CUT_K (4 measured no better)
MEM_ROWS = True


def _tol(x: float) -> float:
    """The largest value `leq(value, x)` admits (the spec's checks tolerate float noise; so must the bound)."""
    return x + EPS * max(1.0, abs(x))


def _highs_mod() -> Any:
    try:
        from highspy import _core
    except ImportError:  # pragma: no cover
        return None
    return _core


_CORE = _highs_mod()


@dataclass
class Front:
    """What one workflow's Pareto walk established."""

    lower_bound: float = INF  # least cost of any variant of the workflow (placement relaxed)
    complete: bool = False  # the walk finished: lower_bound is the relaxed optimum
    candidates: list[tuple[tuple[float, float, int], list[Choice], list[int], list[tuple[str, tuple[str, ...]]]]] = \
        field(default_factory=list)  # feasible variants found: (score, choice, slot profiles, placements)
    solves: int = 0
    dives: int = 0  # `chain.walk_chain`: packings searched out of turn (`chain.DIVE_EVERY`)
    exact_ties: bool = False  # complete also settles the new-GPU tie-break (`chain.walk_chain`)
    # `chain.walk_chain`: each multiset of new instances (profile indices, sorted) whose packing it settled, with
    # the least relaxed cost of a variant with exactly those new instances (under GPU sharing, at least: once placed,
    # or its least cost when `sharing_chain` settled it). When complete, every other multiset's
    # variants cost more (relaxed) than the incumbent: GPU sharing's tie-break search looks only among these.
    settled: dict[tuple[int, ...], float] | None = None
    # `chain.walk_chain` over groups of clones (`clones.AggregatedModel`): every multiset of groups whose bound is at
    # most the incumbent (1 + clones.IMAGE_SLACK) was settled (in `settled`)
    images_complete: bool = False


class RelaxedModel:
    """The MILP of one workflow with placement relaxed (see the module docstring)."""

    def __init__(self, pb: Problem, pw: PWorkflow, usable: list[bool], check_cap: bool = True,
                 placed: bool | None = None) -> None:
        """`placed`: the multiset walk's placed bounds will bound this model's multisets (GPU sharing; None: on a
        chain), which keeps only dominance by a profile placed alike (`_dominated_here`)."""
        self.pb, self.pw = pb, pw
        self.ok = True
        self.share_rows: list[tuple[int, float]] = []  # GPU sharing: (row, its upper bound) of the compute-room rows
        self.l_floor = 0.0  # a proven lower bound of every variant's L (GPU sharing: `sharing_alone`), L's own bound
        core = _CORE
        lam = pb.lam
        llm = pw.llm
        # Options per LLM stage.
        opts: dict[int, list[tuple[str, int, float]]] = {}
        bv = pb.bound_view(pw)  # GPU sharing: lower bounds of the slowed latencies (the points stay bounds)
        for s in llm:
            ld = pw.load[s]
            o: list[tuple[str, int, float]] = []
            for r, pi in enumerate(pb.r_prof):
                if pb.p_ok[pi] and (not check_cap or leq(pb.r_load0[r] + ld, pb.p_cap[pi])) \
                        and leq(bv.lat_reuse[s][r], lam):
                    o.append((REUSE, r, bv.lat_reuse[s][r]))
            for pi in range(len(pb.profiles)):
                if usable[pi] and (not check_cap or leq(ld, pb.p_cap[pi])) and leq(bv.lat_new[s][pi], lam):
                    o.append((NEW, pi, bv.lat_new[s][pi]))
            if not o:
                self.ok = False
            opts[s] = o
        if self.ok:
            # (GPU sharing: dominance on the latencies the model uses, `bv`'s, so that a dominated option's
            # dominator is an option of the same stage.)
            drop = _dominated_here(pb, bv, sorted({ref for s in llm for k, ref, _ in opts[s] if k == NEW}), placed)
            for s in llm:
                opts[s] = [o for o in opts[s] if not (o[0] == NEW and o[1] in drop)]
        self.opts = opts
        if not self.ok:
            return
        cols_lo: list[float] = []
        cols_hi: list[float] = []
        integ: list[Any] = []
        entries: list[list[tuple[int, float]]] = []
        rlo: list[float] = []
        rhi: list[float] = []
        big = math.inf

        def row(lo: float, hi: float) -> int:
            rlo.append(lo)
            rhi.append(hi)
            return len(rlo) - 1

        def col(lo: float, hi: float, is_int: bool) -> int:
            cols_lo.append(lo)
            cols_hi.append(hi)
            integ.append(core.HighsVarType.kInteger if is_int else core.HighsVarType.kContinuous)
            entries.append([])
            return len(cols_lo) - 1

        profs = sorted({pi for s in llm for k, pi, _ in opts[s] if k == NEW})
        reus = sorted({r for s in llm for k, r, _ in opts[s] if k == REUSE})
        n = len(pw.wf.stages)
        self.y = {pi: col(0.0, float(len(llm)), True) for pi in profs}
        self.L = col(0.0, _tol(lam), False)
        t = [col(0.0, big, False) for _ in range(n)]
        self.mem_row = row(-big, big)
        for pi in profs:
            entries[self.y[pi]].append((self.mem_row, pb.p_mem[pi]))
        cap_row = {pi: row(-big, 0.0) for pi in profs}
        for pi in profs:
            entries[self.y[pi]].append((cap_row[pi], -(_tol(pb.p_cap[pi]) if check_cap else 0.0)))
        heavy_row: dict[tuple[int, int], int] = {}
        mem_u: dict[int, int] = {}
        if MEM_ROWS:  # M >= the memory of the new instance each stage runs on
            for s in llm:
                mem_u[s] = row(0.0, big)
                for pi in profs:
                    entries[self.y[pi]].append((mem_u[s], pb.p_mem[pi]))
        spare_row = {r: row(-big, _tol(pb.p_cap[pb.r_prof[r]]) - pb.r_load0[r] if check_cap else big) for r in reus}
        # GPU sharing: the cluster's compute room (`compute_room`). Each stage adds its load / capacity to every
        # GPU of its instance (Feasibility 5.1 keeps each GPU the variant touches within u), so the variant's added
        # compute, summed over GPUs, is at most the room the touchable GPUs have left.
        j_rows: list[int] = []
        k_rows: dict[int, int] = {}
        if pb.sharing and check_cap and COMPUTE_ROWS:
            room_j, room_k = compute_room(pb, profs, reus)
            j_rows = [row(-big, v) for v in room_j]
            k_rows = {k: row(-big, v) for k, v in room_k.items()}
        self.share_rows = [(r_, rhi[r_]) for r_ in (*j_rows, *k_rows.values())]
        # Room on the cluster: new instances that no placement can hold at once are ruled out (`room_rows`).
        self.room = room_rows(pb, profs, len(llm))
        for members, cap in self.room:
            r_ = row(-big, float(cap))
            for pi in members:
                entries[self.y[pi]].append((r_, float(pb.p_reps[pi])))
        # Path rows: per stage v and each predecessor (or none): t_v - t_p - lat_v >= 0; L - t_v >= 0.
        path_rows: list[list[int]] = []
        for v in range(n):
            rows_v = []
            preds = pw.preds[v]
            base = pw.tool_lat[v] if not pw.wf.stages[v].is_llm else 0.0
            for p in preds or (None,):
                r_ = row(base, big)
                entries[t[v]].append((r_, 1.0))
                if p is not None:
                    entries[t[p]].append((r_, -1.0))
                rows_v.append(r_)
            path_rows.append(rows_v)
            top = row(0.0, big)
            entries[self.L].append((top, 1.0))
            entries[t[v]].append((top, -1.0))
        self.x: dict[int, list[int]] = {}
        for s in llm:
            a = row(1.0, 1.0)
            ld = pw.load[s]
            xs = []
            for k, ref, lat in opts[s]:
                c = col(0.0, 1.0, True)
                e = entries[c]
                e.append((a, 1.0))
                for r_ in path_rows[s]:
                    e.append((r_, -lat))
                if j_rows:
                    kk, share = compute_share(pb, k, ref, ld)
                    for j, r_ in enumerate(j_rows[:kk]):
                        e.append((r_, (kk - j) * share))
                    if k == NEW:
                        e.append((k_rows[kk], share))
                if k == REUSE:
                    e.append((spare_row[ref], ld))
                else:
                    e.append((cap_row[ref], ld))
                    link = row(-big, 0.0)
                    e.append((link, 1.0))
                    entries[self.y[ref]].append((link, -1.0))
                    # Bin packing: sum of f_k(load / capacity) over the stages on p <= y[p] for the dual feasible
                    # functions f_k (Fekete-Schepers), k = 1..CUT_K: weights that any one instance's stages keep
                    # within 1, so that heavy stages of different sizes count together.
                    for kk in range(1, CUT_K + 1):
                        w = _dff(ld, _tol(pb.p_cap[ref]), kk) if check_cap else 0.0
                        if w > 0.0:
                            key = (ref, kk)
                            if key not in heavy_row:
                                heavy_row[key] = row(-big, 0.0)
                                entries[self.y[ref]].append((heavy_row[key], -1.0))
                            e.append((heavy_row[key], w))
                    if MEM_ROWS:
                        e.append((mem_u[s], -pb.p_mem[ref]))
                xs.append(c)
            self.x[s] = xs
        from flowmaker.selection.exact import _core_lp

        lp = _core_lp(cols_lo, cols_hi, [0.0] * len(cols_lo), entries, rlo, rhi)
        lp.integrality_ = integ
        h = core._Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", 0.0)
        h.setOptionValue("mip_feasibility_tolerance", MIP_TOL)
        h.setOptionValue("primal_feasibility_tolerance", MIP_TOL)
        h.setOptionValue("dual_feasibility_tolerance", MIP_TOL)
        h.setOptionValue("mip_heuristic_run_rins", WALK_SUBMIPS)
        h.setOptionValue("mip_heuristic_run_rens", WALK_SUBMIPS)
        h.passModel(lp)
        self.h = h
        self.ncol = len(cols_lo)
        self.solves = 0
        self.points: list[tuple[float, float, list[float]]] = []  # (M, L, solution) of the points found

    # ---- solving

    def _solve(self, objective: str, mem_cap: float, lat_cap: float, deadline: float,
               nodes: int = 0, presolve: bool = True) -> tuple[str, float, list[float]]:
        """min M, L or new GPUs (G) subject to M <= mem_cap, L <= lat_cap, within `nodes` HiGHS nodes (0: no
        limit). Returns (status, dual bound, solution)."""
        h = self.h
        cost = [0.0] * self.ncol
        if objective == "L":
            cost[self.L] = 1.0
        elif objective == "G":
            for pi, c in self.y.items():
                cost[c] = float(self.pb.p_gpus[pi])  # of the whole group (replicas)
        else:
            for pi, c in self.y.items():
                cost[c] = self.pb.p_mem[pi]
        h.changeColsCost(self.ncol, list(range(self.ncol)), cost)
        h.changeRowBounds(self.mem_row, -math.inf, mem_cap)
        h.changeColBounds(self.L, min(self.l_floor, lat_cap), lat_cap)
        left = deadline - time.perf_counter()
        if left <= 0:
            return "time", -INF, []
        # A start: a known point within the caps.
        for pm, pl, ps in self.points:
            if pm <= mem_cap and pl <= lat_cap:
                h.setSolution(_core_solution(ps))
                break
        # Half the time left, as the packings' MILPs (`chain.HIGHS_TIME_SHARE`): HiGHS checks its limit only now and
        # then, and in its root overran a 0.55 s limit by 0.4 s (wide_fan 1567045 under sharing answered at 2.15 s
        # on a 2 s budget).
        from flowmaker.selection.chain import HIGHS_TIME_SHARE

        h.setOptionValue("time_limit", max(left * HIGHS_TIME_SHARE, 1e-3))
        h.setOptionValue("mip_max_nodes", nodes or HIGHS_NO_LIMIT)
        h.setOptionValue("presolve", "choose" if presolve and WALK_PRESOLVE else "off")
        from flowmaker.selection.exact import run_checked

        try:
            name = run_checked(h)
        finally:
            h.setOptionValue("presolve", "choose")  # (`least_memory_lp` runs this model without setting it)
        self.solves += 1
        info = h.getInfo()
        if name == "Infeasible":
            return "infeasible", INF, []
        if name != "Optimal":
            db = getattr(info, "mip_dual_bound", -INF)
            return "time", db if db is not None and math.isfinite(db) else -INF, []
        sol = list(h.getSolution().col_value)
        db = getattr(info, "mip_dual_bound", info.objective_function_value)
        return "optimal", min(db, info.objective_function_value), sol

    def assignment(self, sol: list[float]) -> dict[int, tuple[str, int]]:
        out = {}
        for s in self.pw.llm:
            best = max(range(len(self.x[s])), key=lambda i: sol[self.x[s][i]])
            k, ref, _ = self.opts[s][best]
            out[s] = (k, ref)
        return out

    def packing(self, assign: dict[int, tuple[str, int]], ys: dict[int, int]
                ) -> tuple[dict[int, int], tuple[int, list[int]] | None]:
        """Stages of each profile packed into its ys[profile] instances (exactly: depth first); the stage ->
        instance map, and (profile, its stages) for a profile whose stages do not fit that many instances."""
        pw = self.pw
        inst: dict[int, int] = {}
        for pi in sorted({ref for k, ref in assign.values() if k == NEW}):
            st = sorted((s for s, (k, ref) in assign.items() if k == NEW and ref == pi), key=lambda s: -pw.load[s])
            try:
                got = _pack([pw.load[s] for s in st], self.pb.p_cap[pi], max(1, ys.get(pi, 0)))
            except _GiveUp:
                got = _pack_ffd([pw.load[s] for s in st], self.pb.p_cap[pi])
                if len(set(got)) > ys.get(pi, 0):
                    return inst, (pi, [])  # undecided: no cut, this point only bounds
            if got is None:
                return inst, (pi, st)
            for s, b in zip(st, got, strict=True):
                inst[s] = b
        return inst, None

    def cut(self, pi: int, stages: list[int], nbins: int) -> None:
        """Valid for every variant: y[pi] >= nbins - (stages of `stages` not on pi). When all of `stages` run on
        profile pi it needs nbins instances, and each stage left out lowers that need by at most one (it could
        have had an instance of its own), so any part T of them on pi needs at least nbins - |stages - T|."""
        idx = [self.y[pi]]
        val = [1.0]
        for s in stages:
            o = next(i for i, (k, ref, _) in enumerate(self.opts[s]) if k == NEW and ref == pi)
            idx.append(self.x[s][o])
            val.append(-1.0)
        self.h.addRow(float(nbins - len(stages)), math.inf, len(idx), idx, val)

    def realize(self, assign: dict[int, tuple[str, int]], inst: dict[int, int]
                ) -> tuple[tuple[float, float, int], list[Choice], list[int], list[tuple[str, tuple[str, ...]]]] | None:
        """A variant from an assignment and its packing: slots numbered in the order of their first stage;
        None when it does not place."""
        pb, pw = self.pb, self.pw
        choice: list[Choice] = []
        slot_of: dict[tuple[int, int], int] = {}
        slots: list[int] = []
        for s in pw.llm:
            k, ref = assign[s]
            if k == REUSE:
                choice.append((REUSE, ref))
                continue
            key = (ref, inst[s])
            if key not in slot_of:
                slot_of[key] = len(slots)
                slots.append(ref)
            choice.append((NEW, slot_of[key]))
        code, places = pb.check(pw, choice, slots)
        if code != 5:
            return None
        return pb.score(pw, choice, slots, places), choice, slots, places

    @contextmanager
    def without_share_rows(self) -> Iterator[None]:
        """The model without its compute-room rows (GPU sharing) for a while: they make each HiGHS node several times
        dearer (measured: a 50-node least-L MILP of chain_clones 757014, 0.06 s without them, 1.3 s with), so the
        MILPs that the LP relaxation's rows do not need leave them out."""
        if not self.share_rows:
            yield
            return
        for r_, _ in self.share_rows:
            self.h.changeRowBounds(r_, -math.inf, math.inf)
        try:
            yield
        finally:
            for r_, hi in self.share_rows:
                self.h.changeRowBounds(r_, -math.inf, hi)

    def least_memory_lp(self) -> float:
        """A lower bound of the new memory M of every variant (placement relaxed): min M over the LP relaxation (no
        integrality), within the L cap of the request. 0 when it proves nothing; INF when the LP is infeasible."""
        if not self.ok:
            return INF
        h = self.h
        cost = [0.0] * self.ncol
        for pi, c in self.y.items():
            cost[c] = self.pb.p_mem[pi]
        h.changeColsCost(self.ncol, list(range(self.ncol)), cost)
        h.changeRowBounds(self.mem_row, -math.inf, math.inf)
        h.changeColBounds(self.L, min(self.l_floor, _tol(self.pb.lam)), _tol(self.pb.lam))
        from flowmaker.selection.exact import run_checked

        h.setOptionValue("solve_relaxation", True)
        try:
            name = run_checked(h)
        finally:
            h.setOptionValue("solve_relaxation", False)
        if name == "Infeasible":
            return INF
        if name != "Optimal":
            return 0.0
        # (the LP's tolerances admit points a little outside its region: the floor is kept a little below)
        return max(0.0, h.getInfo().objective_function_value) * (1 - 1e-6)

    def walk(self, deadline: float, best: tuple[float, float, int] | None, max_solves: int = 0) -> Front:
        """The Pareto walk, from the top (module docstring). `best`: the incumbent (cost, L, GPUs) across
        workflows. Lmin (least L) and Mmin (least M) first; then, with b = incumbent / Lmin, repeatedly the
        least L subject to M <= b and L <= incumbent / Mmin: its point (M', L') costs what every variant with
        M in [M', b] costs at least, and b drops below M'. An infeasible solve proves that no variant of
        memory <= b beats the incumbent."""
        fr = Front()
        fr.solves = 0
        if not self.ok:
            fr.lower_bound, fr.complete = INF, True
            return fr
        lam_cap = _tol(self.pb.lam)
        st, Lmin, _ = self._solve("L", INF, lam_cap, deadline)
        if st != "optimal":
            fr.lower_bound, fr.complete = (INF, True) if st == "infeasible" else (0.0, False)
            fr.solves = self.solves
            return fr
        Lmin = max(Lmin, 0.0) * (1 - 1e-9)
        st, Mmin, _ = self._solve("M", INF, lam_cap, deadline)
        if st != "optimal":
            fr.lower_bound = max(Mmin, 0.0) * Lmin if st == "time" else 0.0
            fr.solves = self.solves
            return fr
        Mmin = max(Mmin, 0.0) * (1 - 1e-9)
        lb = INF  # least cost of the points found (each proves an interval [M', m])
        inc0 = best[0] * (1 + 1e-9) if best else INF
        # Memory intervals [a, b] not yet proven, keyed by their bound a * (least L there).
        heap: list[tuple[float, float, float, float, bool]] = [
            (Mmin * Lmin, Mmin, inc0 / Lmin if Lmin > 0 else INF, Lmin, False)]
        while heap:
            if self.solves >= (max_solves or WALK_SOLVES):  # work done, not time: open intervals keep their bounds
                break
            key, a, b, lo_l, whole = heapq.heappop(heap)
            inc = best[0] * (1 + 1e-9) if best else INF
            if key > inc:  # (equal: a variant of equal cost may still be faster)
                heap.clear()
                break
            if inc < INF and Lmin > 0:
                b = min(b, inc / Lmin)
            if b < a:
                continue
            # Bisect an interval, except one just above a proven part (bisecting those never ends).
            m = b if whole or b == INF or b - a <= 1e-9 * max(1.0, b) else (a + b) / 2
            lat_cap = min(lam_cap, inc / a) if a > 0 else lam_cap
            stL, Lv, sol = self._solve("L", m, lat_cap, deadline)
            if stL == "infeasible":
                # No variant of memory in [a, m] is as fast as lat_cap: each costs more than the incumbent.
                if m < b:
                    heapq.heappush(heap, (m * lo_l, m, b, lo_l, True))
                continue
            if stL != "optimal":
                heapq.heappush(heap, (key, a, b, lo_l, whole))
                break
            assign = self.assignment(sol)
            ys = {pi: round(sol[c]) for pi, c in self.y.items()}
            M_pt = sum(self.pb.p_mem[pi] * n for pi, n in ys.items())
            inst, bad = self.packing(assign, ys)
            if bad is not None and bad[1]:
                # The aggregated capacity let these stages share fewer instances than they need.
                pi, st_ = bad
                need = ys.get(pi, 0) + 1
                while _pack([self.pw.load[x] for x in st_], self.pb.p_cap[pi], need) is None:
                    need += 1
                self.cut(pi, st_, need)
                heapq.heappush(heap, (key, a, b, lo_l, whole))  # the same interval again
                continue
            lb = min(lb, M_pt * Lv)  # every variant of memory in [M_pt, m] is at least as slow
            self.points.append((M_pt * (1 + 1e-9), Lv * (1 + 1e-9), sol))
            if bad is None:
                cand = self.realize(assign, inst)
                if cand is not None:
                    fr.candidates.append(cand)
                    if better(*cand[0], best):
                        best = cand[0]
            below = M_pt * (1 - 1e-9) - 1e-12
            if below >= a:
                heapq.heappush(heap, (a * max(lo_l, Lv), a, below, max(lo_l, Lv), False))
            if m < b:
                heapq.heappush(heap, (m * lo_l, m, b, lo_l, True))
        inc = best[0] if best else INF
        rest = heap[0][0] if heap else INF  # (a heapq list: its root is its least)
        fr.lower_bound = max(0.0, min(lb, rest, inc) * (1 - 1e-9))
        fr.complete = rest > inc or not heap
        fr.solves = self.solves
        return fr

    def fewest_gpus(self, mem: float, lat: float, deadline: float
                    ) -> tuple[tuple[float, float, int], list[Choice], list[int], list[tuple[str, tuple[str, ...]]]] | None:
        """The variant of fewest new GPUs among those with M <= mem and L <= lat (up to 1e-9), if it places."""
        st, _, sol = self._solve("G", mem * (1 + 1e-9) + 1e-12, lat * (1 + 1e-9), deadline)
        if st != "optimal":
            return None
        assign = self.assignment(sol)
        inst, bad = self.packing(assign, {pi: round(sol[c]) for pi, c in self.y.items()})
        return None if bad is not None else self.realize(assign, inst)


def _dff(x: float, cap: float, k: int) -> float:
    """Fekete-Schepers' dual feasible function u^(k) scaled to [0, 1]: floor((k + 1) x / cap) / k, or x / cap where
    (k + 1) x / cap is an integer. Loads that fit one instance together weigh at most 1. Near an integer the
    linear value (the smaller one) is taken, so float noise never makes a weight too large."""
    q = (k + 1) * x / cap
    if abs(q - round(q)) <= 1e-7 * max(1.0, q):
        return x / cap * (1 - 1e-9)
    return math.floor(q) / k


def _node_room(free: list[int], k: int, t: int) -> int:
    """How many instances of k GPUs taking t units on each fit on one node with these free memories, at most:
    the largest m with m * k <= sum over its GPUs of min(free // t, m) (an instance uses a GPU once)."""
    if len(free) < k:
        return 0
    c = [f // t for f in free]
    lo, hi = 0, sum(c) // k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * k <= sum(min(x, mid) for x in c):
            lo = mid
        else:
            hi = mid - 1
    return lo


def room_rows(pb: Problem, profs: list[int], most: int) -> list[tuple[list[int], int]]:
    """Physical room for new instances, valid whatever the placement rule (both contracts): for every (k GPUs,
    t units per GPU) of a profile in `profs`, the instances (replicas) of profiles with at least k GPUs and at
    least t units per GPU number at most the sum over nodes of `_node_room` (each such instance takes, on k of
    its GPUs, at least t units on one node). Rows (profiles, room) that can bind when each profile has up to
    `most` instances; a multiset of new instances beyond one of them never places."""
    by_node = [[pb.free0[g] for g in ids] for ids in pb.layout.gpus_by_node]
    out: dict[tuple[int, ...], int] = {}
    for k, t in sorted({(pb.p_k[pi], pb.p_need[pi]) for pi in profs}):
        if t <= 0:
            continue
        members = tuple(pi for pi in profs if pb.p_k[pi] >= k and pb.p_need[pi] >= t)
        cap = sum(_node_room(free, k, t) for free in by_node)
        if cap < most * sum(pb.p_reps[pi] for pi in members) and cap < out.get(members, cap + 1):
            out[members] = cap
    return [(list(m), c) for m, c in out.items()]


def _dominated_here(pb: Problem, pw: PWorkflow, profs: list[int], placed: bool | None = None) -> set[int]:
    """Profiles that another one dominates in this workflow with placement relaxed: no more memory, at least
    the capacity, no more GPUs, no slower on any LLM stage (ties: the lower index stays), and no harder to place (no
    more GPUs an instance, no more memory on each, no more replicas). Any instance of a dominated
    profile can be swapped for one of the other without raising M or L or breaking capacity. Under GPU sharing, on a
    chain or a fan (whose walk bounds its multisets once placed), only a profile placed alike (GPUs, memory per GPU, replicas)
    and no slower alone dominates: the swap then leaves the placement as it was and no instance busier or slower."""
    from flowmaker.selection.chain import is_chain

    out: set[int] = set()
    lat = {pi: [pw.lat_new[s][pi] for s in pw.llm] for pi in profs}
    # GPU sharing: the multiset walk's placed bounds (a chain's, or a fan's that the caller walks so) must cover the
    # dropped
    placed = pb.sharing and (is_chain(pw) if placed is None else placed)
    alone_pw = pb.workflows[pw.index]  # (`pw` is the bound view; latencies alone here)
    alone = {pi: [alone_pw.lat_new[s][pi] for s in pw.llm] for pi in profs}
    for p in profs:
        for q in profs:
            if q == p or q in out:
                continue
            if placed and ((pb.p_k[q], pb.p_need[q], pb.p_reps[q]) != (pb.p_k[p], pb.p_need[p], pb.p_reps[p])
                           or any(a > b for a, b in zip(alone[q], alone[p], strict=True))):
                # placed elsewhere, or slower alone somewhere (so less busy), p's variants may be the cheaper ones:
                # the placed bounds (`sharing_chain`) of q's multisets would not hold for them
                continue
            if not (pb.p_k[q] <= pb.p_k[p] and pb.p_need[q] <= pb.p_need[p] and pb.p_reps[q] <= pb.p_reps[p]):
                # q would be harder to place: more GPUs, or more memory on each, than p. The relaxation's room rows
                # (`room_rows`, per GPUs and memory per GPU) may then hold p's instances and not q's, so the swap
                # could leave it (measured: a tp1 of 30 GB dominated a tp2 of 16 GB a GPU by total memory, and
                # `milp` claimed NO_GPU_MEMORY, proven, where a variant on both existed).
                continue
            if pb.p_mem[q] <= pb.p_mem[p] and pb.p_cap[q] >= pb.p_cap[p] and pb.p_gpus[q] <= pb.p_gpus[p] and all(
                    a <= b for a, b in zip(lat[q], lat[p], strict=True)):
                strict = (pb.p_mem[q] < pb.p_mem[p] or pb.p_cap[q] > pb.p_cap[p] or pb.p_gpus[q] < pb.p_gpus[p]
                          or any(a < b for a, b in zip(lat[q], lat[p], strict=True)))
                if strict or q < p:
                    out.add(p)
                    break
    return out



# ---------------------------------------------------------------- the strategy: MILP front, then branch and bound

# Phases switch by work done, never by the clock (issue 24: the same answer at any machine load); the clock
# only enforces the caller's final deadline. `exact`: the branch and bound alone for FIRST_NODES search nodes
# (most requests end there; fewer for a small budget, scaled by a fixed reference rate, not a measured one),
# then local moves around its incumbent (LOCAL; `local.LOCAL_CHECKS`), then the Pareto walks, each for at most
# WALK_SOLVES MILPs (chains: the multiset walk for CHAIN_POINTS_FIRST multisets, then the MILP walk), then the
# branch and bound again until the final deadline. Measured on fresh chain_clones instances (issue 24): the
# MILP walk of a long chain with many clones takes 0.3-2 s a solve, while its multiset walk settles or bounds
# far more in the same time, so a chain's multiset walk is no longer cut short at 60 multisets or 4 MILPs.
FIRST_NODES = 5_000
REF_NODES_PER_S = 20_000  # this machine's rate, measured once; only scales FIRST_NODES down for small budgets
FIRST_SHARE = 0.08
WALK_SOLVES = 400
CHAIN_POINTS_FIRST = 5_000  # a chain's multiset walk visits this many multisets before its MILP walk,
CHAIN_MILPS_FIRST = 0  # or solves this many of their packings as MILPs (0: no limit)
CHAIN_POINTS = 5_000
HIGHS_NO_LIMIT = 2_147_483_647  # HiGHS's default mip_max_nodes (kHighsIInf)
CHAIN_FIRST_NODES = 800  # the first branch and bound's nodes when every workflow is a chain
CHAIN_NODES = 3_000_000  # depth-first nodes of a chain walk's packings, all multisets together
SHARING_FIRST_NODES = 150  # the first branch and bound's nodes under GPU sharing
# ... and its nodes plus prefix checks (children placed and checked): on fresh chain_clones under sharing the median
# first search made 55 checks and 90% under 700, but some made 3,000-11,000 in 0.13-1.45 s (150 nodes, each with
# hundreds of children that fail the check) and found nothing (seed 769000: 5 of 100); capped, the walk starts sooner.
SHARING_FIRST_WORK = 2_000
# GPU sharing, a chain walk with no incumbent yet: the multisets it visits (measured: on the adversarial `reuse` 2002
# the walk keeps finding multisets that do not place, and the branch and bound after it proves that none does)
SHARING_POINTS_BLIND = 600
# The walk over groups of clones (`clones`) before a chain's multiset walk, base contract, for at most this many of its
# packings.
CLONES = True
CLONE_POINTS = 2_000
LOCAL = True  # local moves around the first incumbent before the walks (`flowmaker.selection.local`)
# GPU sharing: the floor of `sharing_alone` under the MILP walk of a workflow that is not a chain (measured on the hard
# families' wide fans: two proven infeasible at once, one of them had no answer within 2 s)
ALONE_WALK = True
# ... its MILP when the LP's floor is within this of the target (fans' MILPs are small: 0.00-0.19 s on the hard
# families; wide_fan 1307009's LP is 4% under the target, its MILP above it at the root)
ALONE_MILP_GAP_DAG = 0.1
# GPU sharing, every workflow a chain whose walk completed: `sharing_chain.tie_break` over the multisets the walks
# settled is exact whatever the walks' bound (every multiset that may hold a variant as cheap as the best is among
# them), so it is tried when the best is within this of that bound. The bound's own margins (1e-9 a step, several
# steps) put it a few 1e-9 below a proven cost: chain_clones 1071005 sat at a gap of 2.05e-9 against a 2e-9 gate, and
# the branch and bound after it ran to the deadline. A wider gap means multisets whose search was left open (their
# value a bound below the best), which tie_break searches again (bounded by its node counts): measured on chain_clones
# under sharing, fifteen seeds x 60, 834 -> 837 proven within 1 s and 848 -> 852 within 2 s with 1e-2 instead of
# 1e-6 (walks complete at gaps of 1.6e-4 to 0.27% proven in 0.7-1.6 s; 1.0 gave the same counts). One anytime answer
# left unproven came back 0.03% dearer (the time its branch and bound had went to the tie-break).
SHARING_TIE_GAP = 1e-2
# ... and when `tie_break`'s enumeration of the ties ran out of its nodes (not past TIE_FOUND ties), the canonical pass
# over the same multisets has this work limit instead of CANON_NODES: it searches the same assignments and rarely gets
# further (measured on chain_clones under sharing, seven seeds x 20: all 9 such passes ran out of 2,500 nodes, in
# 0.3-0.9 s each; after more than TIE_FOUND ties 26 of 27 settled, within 16-1,080 nodes). Out of nodes, the answer
# is the same variant (the tie-break's), marked not canonical.
CANON_NODES_UNORDERED = 250
# GPU sharing: a fan takes the multiset walk (its multisets placed and settled by `sharing_chain`, as a chain's) only
# once the first branch and bound found a variant. Without one, the walk settles multisets whose every assignment
# fails Feasibility 5 only at its leaves (running co-residents slowed past what they tolerate), where the MILP walk
# and the branch and bound prove such instances infeasible (measured on wide_fan under sharing, eight seeds x 20:
# 154/160 within 1 s with this rule, 152 without; the MILP walk alone 146).
FANS_NEED_INCUMBENT = True
# ... but when the MILP walk then finds no variant either (none of its points places), a branch and bound of
# FAN_FIRST_WORK nodes plus prefix checks (it proves the infeasible ones), then the multiset walk (of at most
# SHARING_POINTS_BLIND multisets without an incumbent, as a chain's) follow it. Measured on wide_fan under sharing,
# twelve seeds x 60: 712/720 within 1 s, 707 with the branch and bound alone after the MILP walk (it found 1549038's
# optimum after 8 s, the multiset walk in 0.6 s); without the short branch and bound, 1553045 (infeasible) took 1.0 s
# instead of 0.3 s.
FANS_BLIND_AFTER_WALK = True
FAN_FIRST_WORK = 3_000

Best = tuple[tuple[float, float, int], tuple[PWorkflow, list[Choice], list[int], list[tuple[str, tuple[str, ...]]]]]


def first_nodes(budget_s: float) -> int:
    """Search nodes of `exact`'s first branch and bound for a request with this time budget."""
    return max(200, min(FIRST_NODES, int(REF_NODES_PER_S * FIRST_SHARE * budget_s)))


def select_hybrid(req: SelectionRequest, strategy: str, first: int | None) -> SelectionResult:
    """Branch and bound for `first` search nodes (None: until the deadline, no MILP); if that does not settle
    it, the Pareto walks of every workflow (incumbents and a lower bound, or the proof), then branch and bound
    again from the best variant known, until the deadline."""
    from flowmaker.selection import exact as ex
    from flowmaker.selection.chain import fan_group, is_chain, walk_chain
    from flowmaker.selection.clones import AggregatedModel, clone_groups
    from flowmaker.selection.local import improve
    from flowmaker.selection.sharing_chain import _left_out, tie_break

    started = time.perf_counter()
    budget = req.options.time_budget_s or ex.DEFAULT_BUDGET_S
    pb = Problem(req)
    deadline = started + ex.SEARCH_SHARE * budget
    grace = started + ex.GRACE_SHARE * budget
    if first is None or _CORE is None:
        return ex.finish(pb, strategy, ex.solve(pb, deadline=deadline, grace=grace), started, budget)
    search = None
    if first > 0 and all(is_chain(pw) for pw in pb.workflows):
        # Chains: the first branch and bound rarely settles them (3 of 40 fresh chain_clones instances, measured)
        # and the multiset walk does: it only needs an incumbent, so it stops sooner (by structure, not load).
        first = min(first, CHAIN_FIRST_NODES)
    if first > 0 and pb.sharing:
        # GPU sharing: a node costs 20-30 times as much (exact shares on every prefix; measured 1-1.5 ms), the walks, whose
        # bounds hold under sharing, prove most instances: the first branch and bound only seeds an incumbent.
        first = min(first, SHARING_FIRST_NODES)
    if first > 0:
        # `grace=started`: a search stopped for its node count leaves its frontier as is (the walk follows).
        search = ex.solve(pb, deadline=deadline, grace=started, max_nodes=first,
                          max_work=SHARING_FIRST_WORK if pb.sharing else None)
        if not search.stopped:
            return ex.finish(pb, strategy, search, started, budget)
    best: Best | None = None
    if search is not None and search.best is not None and search.best_at is not None:
        best = (search.best, search.best_at)
    usable = ex.usable_profiles(pb)
    if best is not None and LOCAL:
        # A better incumbent first (local moves; bounded work): it shrinks the gap of an unsettled answer and
        # lets the walks and the branch and bound below prune earlier.
        best = improve(pb, best, usable, deadline)
    d2 = deadline  # the walks stop by work done (WALK_SOLVES, CHAIN_POINTS), or at the final deadline
    lb = INF
    complete = True
    evaluated = search.leaves if search is not None else 0  # variants looked at: leaves and front points
    models: dict[int, RelaxedModel] = {}
    exact_ties: dict[int, bool] = {}
    settled: dict[int, dict[tuple[int, ...], float]] = {}  # chain workflows' settled multisets (`Front.settled`)
    for pw in pb.workflows:
        # A fan (head, parallel stages, join) is walked by multisets too (under GPU sharing with an incumbent:
        # FANS_NEED_INCUMBENT).
        chain = is_chain(pw) or (fan_group(pw) is not None and (
            not pb.sharing or best is not None or not FANS_NEED_INCUMBENT))
        m = RelaxedModel(pb, pw, usable, placed=chain)
        models[pw.index] = m
        walked = False  # the MILP walk ran on this workflow already
        floor = 0.0  # a lower bound of the workflow's variants from the walk over groups of clones
        images = None
        if chain and CLONES and not pb.sharing and m.ok:
            groups = clone_groups(m)
            if groups is not None:
                # Clones: the same walk over groups of them first (`clones`), for candidates, a floor and the images
                # that the walk over profiles then keeps to.
                am = AggregatedModel(m, groups)
                fa = walk_chain(am, d2, best[0] if best else None, CLONE_POINTS)
                best = _take(best, pw, fa.candidates)
                evaluated += len(fa.candidates)
                floor = fa.lower_bound
                if fa.images_complete and fa.settled is not None:
                    profs = sorted({ref for s in pw.llm for k, ref, _ in m.opts[s] if k == NEW})
                    images = am.images(fa.settled, best[0][0] if best else INF, profs)
        if chain:
            # Chains: the multiset walk for a bounded amount of work, then (unless it settled the workflow) the
            # MILP walk from the best variant known. Both bounds hold for every variant: the larger one is kept.
            points = CHAIN_POINTS_FIRST if best is not None or not pb.sharing else SHARING_POINTS_BLIND
            fr = walk_chain(m, d2, best[0] if best else None, points, CHAIN_MILPS_FIRST, images)
            fr.lower_bound = max(fr.lower_bound, floor)
        elif pb.sharing and m.ok and ALONE_WALK and _alone(pb, pw, m, d2) == INF:
            fr = Front()  # GPU sharing: too few new instances can run alone for any variant (`sharing_alone`)
            fr.lower_bound, fr.complete = INF, True
        else:
            fr = m.walk(d2, best[0] if best else None)
            if FANS_BLIND_AFTER_WALK and pb.sharing and best is None and not fr.candidates and m.ok \
                    and fr.lower_bound < INF and fan_group(pw) is not None:
                # GPU sharing, a fan with no variant known: the MILP walk found none (its points do not place), so a
                # short branch and bound, then the multiset walk follow it (FANS_BLIND_AFTER_WALK); both walks'
                # bounds hold, the larger is kept
                lb_walk = fr.lower_bound
                if FAN_FIRST_WORK:
                    s_f = ex.solve(pb, deadline=deadline, grace=started, max_nodes=HIGHS_NO_LIMIT,
                                   max_work=FAN_FIRST_WORK)
                    if not s_f.stopped:  # (a search over every workflow: it settled the request)
                        return ex.finish(pb, strategy, s_f, started, budget)
                    if s_f.best is not None and s_f.best_at is not None:
                        best = (s_f.best, s_f.best_at)
                m = RelaxedModel(pb, pw, usable, placed=True)
                models[pw.index] = m
                fr = walk_chain(m, d2, best[0] if best else None, CHAIN_POINTS_FIRST if best else SHARING_POINTS_BLIND,
                                CHAIN_MILPS_FIRST)
                fr.lower_bound = max(fr.lower_bound, lb_walk)
                chain, walked = True, True
        best = _take(best, pw, fr.candidates)
        gate = SHARING_TIE_GAP if pb.sharing and chain else 2e-9  # (sharing: `tie_break` settles the rest)
        settled_by_walk = fr.complete and (fr.lower_bound == INF  # (proven: no variant)
                                           or (best is not None and best[0][0] <= fr.lower_bound * (1 + gate)))
        if chain and not settled_by_walk and not walked:
            fr2 = m.walk(d2, best[0] if best else None)
            fr2.candidates = fr.candidates + fr2.candidates
            fr2.lower_bound = max(fr2.lower_bound, fr.lower_bound)
            fr = fr2
        exact_ties[pw.index] = fr.exact_ties
        if fr.settled is not None and fr.complete:
            settled[pw.index] = fr.settled
        lb = min(lb, fr.lower_bound)
        complete = complete and fr.complete
        evaluated += len(fr.candidates)
        best = _take(best, pw, fr.candidates)
    # Under GPU sharing the walk's points are bounds (latency alone, placement relaxed) and its tie-break
    # argument does not hold: the branch and bound below proves the optimum from the best point instead.
    if complete and best is not None and not pb.sharing and best[0][0] <= lb * (1 + 2e-9) + 1e-300:
        # Proven (placement relaxed, so a fortiori). Tie-break: fewest new GPUs at this cost and latency.
        pw = best[1][0]
        if exact_ties.get(pw.index):
            return _canonical_result(pb, strategy, best, started, evaluated, grace)
        alt = models[pw.index].fewest_gpus(sum(pb.p_mem[p] for p in best[1][2]), best[0][1], grace)
        if alt is not None and better(*alt[0], best[0]):
            best = (alt[0], (pw, alt[1], alt[2], alt[3]))
        if alt is not None:
            return _canonical_result(pb, strategy, best, started, evaluated, grace)
    if complete and best is not None and pb.sharing and len(settled) == len(pb.workflows) \
            and best[0][0] <= lb * (1 + SHARING_TIE_GAP) + 1e-300:
        # GPU sharing, every workflow a chain whose walk settled it: the variants that may tie or beat the best are
        # looked for among the multisets each walk settled within the best's cost only (`sharing_chain.tie_break`),
        # which finds a cheaper one too, so this holds at any gap; the canonical pass when the ties are many.
        hi = best[0][0] * (1 + REL_TOL) + 1e-300
        multisets = {i: [y for y, v in fr_set.items() if v <= hi] for i, fr_set in settled.items()}
        won = tie_break(pb, models, multisets, best, grace, settled)
        if won is not None and won[1]:
            return pb.result(strategy, won[0][1], started, evaluated, optimal=True)
        if won is not None:
            # Ties abound: the canonical pass decides, among the same multisets when the walks left out no
            # profile that may tie (a tie has cost <= hi, so its multiset is one of them; measured: chain_clones
            # 1307004 under sharing, five instances of one profile, 0.9 s for the pass over every multiset).
            left = any(_left_out(pb, m_) for m_ in models.values())
            return _canonical_result(pb, strategy, won[0], started, evaluated, grace, None if left else multisets,
                                     ex.CANON_NODES if won[2] or left else CANON_NODES_UNORDERED)
    if complete and best is not None and pb.sharing and best[0][0] <= lb * (1 + 2e-9) + 1e-300:
        # GPU sharing: the walk's bound still holds (latencies are lower bounds of the slowed ones, placement
        # relaxed) and its candidates carry their true costs (`RelaxedModel.realize` checks Feasibility 5), so the
        # cost is proven. Its tie-break argument does not hold: a variant of equal cost with a shorter L or fewer
        # new GPUs is looked for by the branch and bound among the variants of L <= the best's (any better one
        # has a cost no lower, so an L no longer), which also settles the canonical order (`finish`).
        # A variant that ties or beats the best has relaxed cost <= its cost: on a chain, whose walk settled every
        # multiset of new instances up to the best's cost, only the multisets settled that cheap are left.
        hi = best[0][0] * (1 + REL_TOL) + 1e-300
        multisets = {i: [y for y, v in fr_set.items() if v <= hi] for i, fr_set in settled.items()}
        s4 = ex.make_search(pb, deadline=deadline, grace=grace, lat_cap=best[0][1], multisets=multisets)
        s4.best, s4.best_at = best
        s4.run()
        if s4.stopped:
            s4.frontier = lb  # every variant costs at least the walk's bound (those of longer L included)
        return ex.finish(pb, strategy, s4, started, budget)
    if complete and best is None and lb == INF:
        # Nothing is feasible even with placement relaxed, so nothing is: the branch and bound names the tightest
        # reason within the grace period (not the deadline: the proof is done, only the reason may stay open).
        return ex.proven_infeasible(pb, strategy, started, budget, evaluated)
    s3 = ex.make_search(pb, deadline=deadline, grace=grace)
    if best is not None:
        s3.best, s3.best_at = best
    s3.run()
    if not s3.stopped or lb == INF:
        return ex.finish(pb, strategy, s3, started, budget)
    s3.frontier = max(s3.frontier, lb)  # both are lower bounds of every variant not yet improved on
    return ex.finish(pb, strategy, s3, started, budget)


def _alone(pb: Problem, pw: PWorkflow, m: RelaxedModel, deadline: float) -> float:
    """GPU sharing, a workflow the MILP walk takes: `sharing_alone`'s floor (its LP; a few MILP nodes when that comes
    within ALONE_MILP_GAP_DAG of the target), kept as the relaxed model's least L; INF: no variant exists."""
    from flowmaker.selection.sharing_alone import ALONE_NODES, walk_floor

    a_f = walk_floor(pb, pw, m.opts, 0.0, deadline, ALONE_MILP_GAP_DAG, ALONE_NODES)
    if a_f < INF:
        m.l_floor = max(m.l_floor, a_f)
    return a_f


def _take(best: Best | None, pw: PWorkflow, cands: list[tuple[tuple[float, float, int], list[Choice], list[int],
                                                          list[tuple[str, tuple[str, ...]]]]]) -> Best | None:
    """The better of `best` and a walk's candidates (score, choice, slots, placements) by (cost, L, new GPUs); of
    equals, the one seen first."""
    for sc, choice, slots, places in cands:
        if best is None or better(*sc, best[0]):
            best = (sc, (pw, choice, slots, places))
    return best


def _canonical_result(pb: Problem, strategy: str, best: Best, started: float, evaluated: int,
                      deadline: float, multisets: dict[int, list[tuple[int, ...]]] | None = None,
                      max_nodes: int | None = None) -> SelectionResult:
    """The answer for a proven optimum: the canonical variant among its ties when the canonical pass settles it
    (`multisets`: per workflow, the only multisets of new instances a tie can have; `max_nodes`: its work limit,
    `exact.CANON_NODES` unless given)."""
    from flowmaker.selection import exact as ex

    at, canon = ex.canonical(pb, best[0], best[1], deadline, multisets, max_nodes or ex.CANON_NODES)
    res = pb.result(strategy, at, started, evaluated, optimal=True)
    return res if canon else replace(res, reason_detail=ex.NOT_CANONICAL)


@register("milp")
def select_milp(req: SelectionRequest) -> SelectionResult:
    """The Pareto walk first (no branch-and-bound head start), branch and bound for what it leaves open."""
    return select_hybrid(req, "milp", 0)


__all__ = ["RelaxedModel", "select_hybrid", "select_milp"]


class _GiveUp(Exception):
    """Packing took too long to decide."""


def _pack(loads: list[float], cap: float, nbins: int) -> list[int] | None:
    """Bin of each load (loads in decreasing order) in at most nbins bins of capacity cap; None: impossible."""
    n = len(loads)
    fill = [0.0] * nbins
    out = [0] * n
    steps = [0]

    def go(i: int, used: int) -> bool:
        steps[0] += 1
        if i == n:
            return True
        if steps[0] > 200_000:
            raise _GiveUp
        seen: set[float] = set()
        for b in range(min(used + 1, nbins)):
            if fill[b] in seen or not leq(fill[b] + loads[i], cap):
                continue
            seen.add(fill[b])
            fill[b] += loads[i]
            out[i] = b
            if go(i + 1, max(used, b + 1)):
                return True
            fill[b] -= loads[i]
        return False

    return out if go(0, 0) else None


def _pack_ffd(loads: list[float], cap: float) -> list[int]:
    """First fit (loads in decreasing order): a packing, not always one of fewest bins."""
    fill: list[float] = []
    out = []
    for x in loads:
        for b in range(len(fill)):
            if leq(fill[b] + x, cap):
                fill[b] += x
                out.append(b)
                break
        else:
            fill.append(x)
            out.append(len(fill) - 1)
    return out


def _core_solution(col_value: list[float]) -> Any:
    sol = _CORE.HighsSolution()
    sol.col_value = [float(round(v)) if abs(v - round(v)) < 1e-6 else v for v in col_value]
    sol.value_valid = True
    return sol
