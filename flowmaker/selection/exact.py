"""`exact` (default): depth-first branch-and-bound that always returns a minimum-cost variant.

Search: LLM stages are decided in the spec's topological order, so new
instances are placed exactly when the spec places them (in order of their
first stage) and capacity, placement and partial latency are checked
incrementally. Each stage reuses a running instance, joins a new instance
opened earlier in this variant, or opens a new one.

Bound (admissible, because it relaxes only capacity and placement): with M the
new memory so far and, for every undecided stage s, h(s)/t(s) the least time
before/after it (decided stages exact, undecided at their fastest option):

    cost >= max( M * Lb,  max_s  min_{option o of s} (M + mem(o)) * max(Lb, h(s) + lat(o) + t(s)) )

where Lb is the longest-path lower bound and mem(o) is 0 for reuse/joining and
the instance's memory for a new one. Coupling a stage's latency with the memory
it costs is what keeps deep chains fast: a stage cannot be both fast and free.
Only the (memory, latency) Pareto front of each stage's new-instance options
can attain the inner minimum, so it is precomputed per stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flowmaker.domain import SelectionRequest, SelectionResult
from flowmaker.selection.placement import EPS_GB
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
    infeasible_result,
    leq,
)
from flowmaker.selection.registry import register


@dataclass(slots=True)
class _Static:
    """Per-workflow tables for the bound, independent of the search state."""

    new_opts: list[list[int]]  # [stage] profile indices usable alone, best-first
    reuse_opts: list[list[int]]  # [stage] reusable instance indices usable alone
    lat_lb: list[float]  # [stage] fastest usable option (TOOL: its latency)
    tail: list[float]  # [stage] least time after the stage ends
    front: list[list[tuple[float, float]]]  # [stage] (memory, latency) Pareto front, memory ascending
    reuse_min: list[float]  # [stage] fastest reuse option
    w_rem: list[float]  # [decision j] load of decisions j.. (output tokens/s)
    heavy: list[bool]  # [stage] its load exceeds half of every option's capacity: it never shares a new instance
    heavy_mem: list[float]  # [stage] least memory of a new instance that can carry it alone
    ratio: list[float]  # [decision j] least memory per unit of capacity among their new-instance options
    after: list[list[int]]  # [decision j] TOOL stages that follow decision j in topo order (before j+1)
    before: list[int]  # TOOL stages before the first decision
    feasible: bool  # every LLM stage has at least one usable option


def _static(pb: Problem, pw: PWorkflow, check_cap: bool) -> _Static:
    n = len(pw.wf.stages)
    new_opts: list[list[int]] = [[] for _ in range(n)]
    reuse_opts: list[list[int]] = [[] for _ in range(n)]
    lat_lb = list(pw.tool_lat)
    front: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    reuse_min = [INF] * n
    feasible = True
    for s in pw.llm:
        ld = pw.load[s]
        cand = [pi for pi in range(len(pb.profiles))
                if pb.p_ok[pi] and (not check_cap or leq(ld, pb.p_cap[pi])) and leq(pw.lat_new[s][pi], pb.lam)]
        # Try cheap-and-fast options first: good incumbents early make the bound bite.
        cand.sort(key=lambda pi: (pb.p_mem[pi] * pw.lat_new[s][pi], pw.lat_new[s][pi], pi))
        new_opts[s] = cand
        ro = [r for r, pi in enumerate(pb.r_prof)
              if pb.p_ok[pi] and (not check_cap or leq(pb.r_load0[r] + ld, pb.p_cap[pi]))
              and leq(pw.lat_reuse[s][r], pb.lam)]
        ro.sort(key=lambda r: (pw.lat_reuse[s][r], r))
        reuse_opts[s] = ro
        reuse_min[s] = pw.lat_reuse[s][ro[0]] if ro else INF
        lat_lb[s] = min([reuse_min[s]] + [pw.lat_new[s][pi] for pi in cand])
        if lat_lb[s] == INF:
            feasible = False
        pts = sorted((pb.p_mem[pi], pw.lat_new[s][pi]) for pi in cand)
        fr: list[tuple[float, float]] = []
        for m, lat in pts:
            if not fr or lat < fr[-1][1]:
                fr.append((m, lat))
        front[s] = fr
    tail = [0.0] * n
    for s in reversed(pw.topo):
        tail[s] = max((lat_lb[c] + tail[c] for c in pw.succs[s]), default=0.0)
    after: list[list[int]] = [[] for _ in pw.llm]
    before: list[int] = []
    j = -1
    for s in pw.topo:
        if pw.wf.stages[s].is_llm:
            j += 1
        elif j < 0:
            before.append(s)
        else:
            after[j].append(s)
    nd = len(pw.llm)
    w_rem = [0.0] * (nd + 1)
    ratio = [INF] * (nd + 1)
    for j in range(nd - 1, -1, -1):
        s = pw.llm[j]
        w_rem[j] = w_rem[j + 1] + pw.load[s]
        ratio[j] = min([ratio[j + 1]] + [pb.p_mem[pi] / pb.p_cap[pi] for pi in new_opts[s]])
    heavy = [False] * n
    heavy_mem = [0.0] * n
    if check_cap:
        for s in pw.llm:
            ld = pw.load[s]
            if new_opts[s] and ld > 0:
                cap_max = max(pb.p_cap[pi] for pi in new_opts[s])
                heavy[s] = ld * 2 > cap_max * (1 + 1e-9)
                heavy_mem[s] = min(pb.p_mem[pi] for pi in new_opts[s])
        if any(heavy):
            # Two heavy stages share an instance only if their loads fit together; require that no pair can.
            hl = sorted(pw.load[s] for s in pw.llm if heavy[s])
            caps = [pb.p_cap[pi] for s in pw.llm for pi in new_opts[s]]
            if len(hl) >= 2 and leq(hl[0] + hl[1], max(caps)):
                heavy = [False] * n
    return _Static(new_opts=new_opts, reuse_opts=reuse_opts, lat_lb=lat_lb, tail=tail, front=front,
                   reuse_min=reuse_min, w_rem=w_rem, heavy=heavy, heavy_mem=heavy_mem, ratio=ratio,
                   after=after, before=before, feasible=feasible)


class _Search:
    """One branch-and-bound run over all workflows, sharing the incumbent."""

    def __init__(self, pb: Problem, *, check_cap: bool = True, check_place: bool = True,
                 stop_first: bool = False, use_bound: bool = True) -> None:
        self.pb = pb
        self.check_cap = check_cap
        self.check_place = check_place
        self.stop_first = stop_first
        self.use_bound = use_bound
        self.best: tuple[float, float, int] | None = None
        self.best_at: tuple[PWorkflow, list[Choice], list[int], list[tuple[str, tuple[str, ...]]]] | None = None
        self.nodes = 0
        self.leaves = 0
        self.done = False

    def run(self) -> None:
        pb = self.pb
        statics = [(_static(pb, pw, self.check_cap), pw) for pw in pb.workflows]
        runnable = [(st, pw) for st, pw in statics if st.feasible]
        # Workflows with the smallest root bound first.
        runnable.sort(key=lambda x: (self._root_bound(x[0], x[1]), x[1].index))
        for st, pw in runnable:
            if self.done:
                break
            self._workflow(st, pw)

    @staticmethod
    def _root_bound(st: _Static, pw: PWorkflow) -> float:
        """The bound at the root (nothing decided, no memory yet): orders workflows best-first."""
        start = [0.0] * len(pw.wf.stages)
        for s in pw.topo:
            start[s] = max((start[p] + st.lat_lb[p] for p in pw.preds[s]), default=0.0)
        Lb = max(start[s] + st.lat_lb[s] for s in pw.topo)
        lb = 0.0
        for s in pw.llm:
            b = 0.0 if st.reuse_min[s] < INF else INF
            for m, lat in st.front[s]:
                b = min(b, m * max(Lb, start[s] + lat + st.tail[s]))
            lb = max(lb, b)
        return lb

    def _workflow(self, st: _Static, pw: PWorkflow) -> None:
        pb = self.pb
        n = len(pw.wf.stages)
        fin = [0.0] * n
        for s in st.before:
            fin[s] = max((fin[p] for p in pw.preds[s]), default=0.0) + pw.tool_lat[s]
        if any(not leq(fin[s], pb.lam) for s in st.before):
            return
        llm = pw.llm
        nd = len(llm)
        preds = pw.preds
        lat_new = pw.lat_new
        lat_reuse = pw.lat_reuse
        load = pw.load
        lam = pb.lam
        p_cap, p_mem, p_k = pb.p_cap, pb.p_mem, pb.p_k
        r_prof, r_load0 = pb.r_prof, pb.r_load0
        profiles = pb.profiles
        layout = pb.layout
        free = dict(pb.free0)
        choice: list[Choice] = []
        slots: list[int] = []
        slot_load: list[float] = []
        places: list[tuple[str, tuple[str, ...]]] = []
        r_add = [0.0] * len(pb.reusable)
        assigned = [False] * n
        for s in st.before:
            assigned[s] = True
        topo = pw.topo
        lat_lb, tail, front = st.lat_lb, st.tail, st.front
        check_cap, check_place, use_bound = self.check_cap, self.check_place, self.use_bound
        mem_now = [0.0]
        gpus_now = [0]
        depth = [0]
        # Running instances some stage could reuse: their spare capacity counts in the capacity bound.
        reuse_any = sorted({r for s in llm for r in st.reuse_opts[s]})

        def bound() -> tuple[float, float]:
            """Lower bounds (cost, latency) of any completion; cost INF when none can be feasible."""
            start: dict[int, float] = {}
            Lb = 0.0
            for s in topo:
                if assigned[s]:
                    if fin[s] > Lb:
                        Lb = fin[s]
                    continue
                h = 0.0
                for p in preds[s]:
                    v = fin[p] if assigned[p] else start[p] + lat_lb[p]
                    if v > h:
                        h = v
                start[s] = h
                e = h + lat_lb[s] + tail[s]
                if e > Lb:
                    Lb = e
            if not leq(Lb, lam):
                return INF, Lb
            M = mem_now[0]
            lb = M * Lb
            if not use_bound:
                return lb, Lb
            # Capacity: load still to place beyond the spare capacity of instances already in play
            # needs new instances, at best at the least memory per unit of capacity (fractional relaxation).
            dm = 0.0
            if check_cap:
                j0 = depth[0]
                need = st.w_rem[j0]
                if need > 0.0:
                    for k, pi in enumerate(slots):
                        need -= max(0.0, p_cap[pi] - slot_load[k])
                    for r in reuse_any:
                        need -= max(0.0, p_cap[r_prof[r]] - r_load0[r] - r_add[r])
                    if need > EPS * max(1.0, st.w_rem[j0]):
                        if st.ratio[j0] == INF:
                            return INF, Lb
                        dm = need * st.ratio[j0]
                    # Integrality: stages too heavy to share any new instance with another heavy
                    # stage, and that fit no spare capacity in play, each need an instance of their own.
                    big = 0.0
                    for jj in range(j0, nd):
                        s = llm[jj]
                        if not st.heavy[s]:
                            continue
                        ld = load[s]
                        if any(leq(slot_load[k] + ld, p_cap[pi]) for k, pi in enumerate(slots)):
                            continue
                        if any(leq(r_load0[r] + r_add[r] + ld, p_cap[r_prof[r]]) for r in st.reuse_opts[s]):
                            continue
                        big += st.heavy_mem[s]
                    if big > dm:
                        dm = big
                    lb = (M + dm) * Lb
            for s in llm:
                if assigned[s]:
                    continue
                h, t = start[s], tail[s]
                lz = st.reuse_min[s]
                for k, pi in enumerate(slots):
                    lv = lat_new[s][pi]
                    if lv < lz and (not check_cap or leq(slot_load[k] + load[s], p_cap[pi])):
                        lz = lv
                b = INF
                if lz < INF and leq(h + lz + t, lam):
                    b = (M + dm) * max(Lb, h + lz + t)
                for m, lv in front[s]:
                    e = h + lv + t
                    if not leq(e, lam):
                        continue
                    if e <= Lb:  # later points only add memory
                        v = (M + max(m, dm)) * Lb
                        if v < b:
                            b = v
                        break
                    v = (M + max(m, dm)) * e
                    if v < b:
                        b = v
                if b == INF:
                    return INF, Lb
                if b > lb:
                    lb = b
            return lb, Lb

        def prune(lb: float, Lb: float) -> bool:
            best = self.best
            if lb == INF:
                return True
            if best is None or not use_bound:
                return False
            bc, bl, _ = best
            if lb > bc * (1 + REL_TOL) + 1e-300:
                return True
            # A completion of equal cost is only worth finding for a strictly shorter latency.
            return lb >= bc * (1 - REL_TOL) and Lb >= bl * (1 - REL_TOL)

        def leaf() -> None:
            self.leaves += 1
            L = max(fin)
            M = mem_now[0]
            if better(M * L, L, gpus_now[0], self.best):
                self.best = (M * L, L, gpus_now[0])
                self.best_at = (pw, list(choice), list(slots), list(places))
                if self.stop_first:
                    self.done = True

        def set_fin(s: int, lat: float) -> bool:
            f = max((fin[p] for p in preds[s]), default=0.0) + lat
            if not leq(f, lam):
                return False
            fin[s] = f
            assigned[s] = True
            return True

        def tools_after(j: int) -> bool:
            ok = True
            for s in st.after[j]:
                fin[s] = max((fin[p] for p in preds[s]), default=0.0) + pw.tool_lat[s]
                assigned[s] = True
                if not leq(fin[s], lam):
                    ok = False
            return ok

        def undo_tools(j: int) -> None:
            for s in st.after[j]:
                assigned[s] = False

        def descend(j: int) -> None:
            # Called with stage llm[j] and its following TOOL stages already set.
            if not tools_after(j):
                undo_tools(j)
                return
            rec(j + 1)
            undo_tools(j)

        def rec(j: int) -> None:
            if self.done:
                return
            self.nodes += 1
            if j == nd:
                leaf()
                return
            depth[0] = j
            if prune(*bound()):
                return
            s = llm[j]
            ld = load[s]
            # 1. reuse a running instance
            for r in st.reuse_opts[s]:
                pi = r_prof[r]
                if check_cap and not leq(r_load0[r] + r_add[r] + ld, p_cap[pi]):
                    continue
                if not set_fin(s, lat_reuse[s][r]):
                    continue
                r_add[r] += ld
                choice.append((REUSE, r))
                descend(j)
                choice.pop()
                r_add[r] -= ld
                assigned[s] = False
                if self.done:
                    return
            # 2. join a new instance opened earlier in this variant
            for k in range(len(slots)):
                pi = slots[k]
                if check_cap and not leq(slot_load[k] + ld, p_cap[pi]):
                    continue
                if not set_fin(s, lat_new[s][pi]):
                    continue
                slot_load[k] += ld
                choice.append((NEW, k))
                descend(j)
                choice.pop()
                slot_load[k] -= ld
                assigned[s] = False
                if self.done:
                    return
            # 3. open a new instance; placement depends only on k = tp*pp for this state
            place_cache: dict[int, tuple[float, str, tuple[str, ...]] | None] = {}
            for pi in st.new_opts[s]:
                m = p_mem[pi]
                if use_bound and self.best is not None:
                    # Cheap pre-check before placing: (M + m) * (latency so far) already too much?
                    f = max((fin[p] for p in preds[s]), default=0.0) + lat_new[s][pi] + tail[s]
                    if (mem_now[0] + m) * f > self.best[0] * (1 + REL_TOL) + 1e-300:
                        continue
                if not set_fin(s, lat_new[s][pi]):
                    continue
                mpg = profiles[pi].memory_gb_per_gpu
                k = p_k[pi]
                if check_place:
                    if k not in place_cache:
                        place_cache[k] = _best_node(layout, free, k)
                    pl = place_cache[k]
                    if pl is None or pl[0] < mpg - EPS_GB:
                        assigned[s] = False
                        continue
                    node, gids = pl[1], pl[2]
                    for g in gids:
                        free[g] -= mpg
                else:
                    node, gids = "", ()
                slots.append(pi)
                slot_load.append(ld)
                places.append((node, gids))
                mem_now[0] += m
                gpus_now[0] += k
                choice.append((NEW, len(slots) - 1))
                descend(j)
                choice.pop()
                gpus_now[0] -= k
                mem_now[0] -= m
                places.pop()
                slot_load.pop()
                slots.pop()
                if check_place:
                    for g in gids:
                        free[g] += mpg
                assigned[s] = False
                if self.done:
                    return

        rec(0)


def _best_node(layout, free: dict[str, float], k: int) -> tuple[float, str, tuple[str, ...]] | None:
    """The LeastLoaded choice for k GPUs in the current state, whatever the memory asked:
    the node whose k-th freest GPU has the most free memory (a node fits iff that one fits)."""
    best: tuple[float, str, tuple[str, ...]] | None = None
    for node, ids in zip(layout.nodes, layout.gpus_by_node, strict=True):
        if len(ids) < k:
            continue
        chosen = sorted(ids, key=lambda g: -free[g])[:k]
        kth = free[chosen[-1]]
        if best is None or kth > best[0]:
            best = (kth, node, tuple(chosen))
    return best


def solve(pb: Problem, **kw: bool) -> _Search:
    s = _Search(pb, **kw)
    s.run()
    return s


def tightest_reason(pb: Problem) -> int:
    """Which constraint rules everything out (1 accuracy .. 4 placement), by relaxing from the end."""
    if solve(pb, check_place=False, stop_first=True, use_bound=False).best is not None:
        return 4
    if solve(pb, check_place=False, check_cap=False, stop_first=True, use_bound=False).best is not None:
        return 3
    # Every stage can use any profile or running instance, so some variant meets
    # accuracy iff one usable model does.
    return 2 if any(pb.p_ok) else 1


@register("exact")
def select_exact(req: SelectionRequest) -> SelectionResult:
    started = time.perf_counter()
    pb = Problem(req)
    search = solve(pb)
    if search.best_at is None:
        return infeasible_result(pb, "exact", tightest_reason(pb), started, search.leaves)
    return pb.result("exact", search.best_at, started, search.leaves)


__all__ = ["select_exact", "solve", "tightest_reason"]
