"""`exact` (default): depth-first branch-and-bound that returns a minimum-cost variant, anytime.

Two phases when the first does not settle it (`flowmaker/selection/milp.py`, `select_hybrid`): the
branch and bound below runs alone for a number of search nodes (`milp.FIRST_NODES`; phases switch by work
done, never by the clock, so the machine's load does not change the path), which answers most requests.
If it has not finished by then, its incumbent is improved by local moves (`flowmaker/selection/local.py`), and
the (memory, latency) Pareto front of every workflow is walked with
mixed-integer programs over instance counts and stage assignments with placement relaxed (HiGHS; see the
milp module; a chain's or a fan's front is walked over instance multisets instead, see the chain module). Its points become incumbents once their instances are packed and placed exactly as the
spec places them, and the walk proves a lower bound of every variant; when the best placed variant costs
that bound, it is the optimum (ties: the least latency is on the walked front, the fewest new GPUs is one
more MILP). Otherwise the branch and bound runs again from the best variant known, until the deadline,
and an interrupted run reports the larger of its frontier bound and the walk's. A proven optimum is then
replaced by the canonical variant among those that tie it (`canonical`: the spec's order beyond cost, L
and new GPUs).

Search: LLM stages are decided in the spec's topological order, so new
instances are placed exactly when the spec places them (in order of their
first stage) and capacity, placement and partial latency are checked
incrementally. Each stage reuses a running instance, joins a new instance
opened earlier in this variant, or opens a new one.

Before searching (per workflow): a profile that cannot be placed on the cluster
even alone (no node has tp*pp GPUs with enough free memory) is dropped, and so
is a profile dominated by another with the same GPU count and memory per GPU,
at least its capacity and no slower latency coefficients (near-identical model
clones): any variant using the dominated one maps to one at least as good.

Bound (admissible: it relaxes placement and part of capacity). With M the new
memory so far, every undecided stage may use a "free" option (a running
instance or a new instance of this variant that still has room for it) or a new
instance. A completion whose largest new instance has memory mu adds at least
max(mu, dm(mu)) memory, where dm(mu) is what covers the load the free spare
cannot absorb with profiles of memory <= mu (fractional: least memory per
capacity; integral: the cheapest multiset of the fewest instances that can),
and every stage runs at best at its fastest free option or new option of
memory <= mu, so

    cost >= min over mu in {0} + thresholds of (M + max(mu, dm(mu))) * L(mu)

where the thresholds are the memories at which some stage gets faster or the
load gets cheaper to cover, and L(mu) is the longest path with those stage
latencies, raised by a Lagrangian relaxation that prices the free options'
spare capacity (instances of one profile that fit the same remaining stages
form one group), so that undecided stages cannot all count on the same headroom.
At the roots and for the frontier of an interrupted search that relaxation is
solved exactly as a linear program (HiGHS); at inner nodes it costs more than it
prunes. This couples the memory of a completion with the latency of ALL its
stages at once (a stage cannot be both fast and free, and neither can the
workflow). Every child inherits its parent's bound. When the incumbent costs
nothing (all reuse), only all-free completions can tie it and the bound becomes
their latency; otherwise completions that could tie the incumbent's cost are
bounded by the least latency of the classes that can reach that cost.

Symmetry: two running instances (or two new instances of this variant) of the
same profile whose spare capacity admits the same remaining stages are
interchangeable when each can take either all remaining load or at most one
stage; only the first is branched on.

Anytime: the search stops at `options.time_budget_s` (default 60 s; the
selector service also passes the caller's gRPC deadline). It then returns the
best variant found with `optimal=False` and a proven `lower_bound` on the
optimum (the least bound over the unexplored subtrees, or the Pareto walk's
bound when that is larger), or raises
DeadlineExceeded when it found no feasible variant yet.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from flowmaker.domain import SelectionRequest, SelectionResult
from flowmaker.errors import DeadlineExceeded
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
    leq_limit,
)
from flowmaker.selection.registry import register
from flowmaker.selection.sharing_bound import completion_bound

DEFAULT_BUDGET_S = 60.0
# Share of the budget for the search; up to GRACE_SHARE the unexplored subtrees' bounds are tightened.
SEARCH_SHARE = 0.88
GRACE_SHARE = 0.96
LAG_PASSES = 2  # coordinate-ascent passes of the Lagrangian prices
# The LP relaxation (HiGHS) strengthens the bound at the root and once a search has taken this many nodes.
LP_AFTER_NODES = 1 << 62  # measured: at inner nodes the LP costs more than it prunes (tests force it)


@dataclass(slots=True)
class _Static:
    """Per-workflow tables for the bound, independent of the search state."""

    new_opts: list[list[int]]  # [stage] profile indices usable alone, best-first
    reuse_opts: list[list[int]]  # [stage] reusable instance indices usable alone, fastest first
    front: list[list[tuple[float, float]]]  # [stage] (memory, latency) Pareto front, memory ascending
    mus: list[float]  # every front memory, ascending: the thresholds mu of the bound
    f_at: list[list[float]]  # [stage][threshold] fastest new option with memory <= mus[i] (INF: none)
    changes: list[list[int]]  # [threshold] stages whose front has a point at mus[i]
    und: list[list[tuple[int, tuple[int, ...], tuple[int, ...], bool]]]  # [decision j] undecided stages
    done: list[list[int]]  # [decision j] stages decided before decision j (topo prefix)
    umap: list[dict[int, int]]  # [decision j] stage -> position in und[j]
    w_rem: list[float]  # [decision j] load of decisions j.. (output tokens/s)
    two_min: list[float]  # [decision j] sum of the two smallest loads of decisions j.. (INF: one left)
    loads_sorted: list[list[float]]  # [decision j] loads of decisions j.., ascending
    heavy: list[bool]  # [stage] its load exceeds half of every option's capacity: it never shares a new instance
    heavy_mem: list[float]  # [stage] least memory of a new instance that can carry it alone
    ratio: list[float]  # [decision j] least memory per unit of capacity among their new-instance options
    after: list[list[int]]  # [decision j] TOOL stages that follow decision j in topo order (before j+1)
    before: list[int]  # TOOL stages before the first decision
    feasible: bool  # every LLM stage has at least one usable option
    any_heavy: bool
    cov: list[list[tuple[float, float]]]  # [decision j] (memory, capacity) Pareto front of new options of j..
    cov_at: list[list[int]]  # [decision j][threshold i] how many of cov[j] have memory <= mus[i]
    cov_ratio: list[list[float]]  # [decision j][n] least memory per capacity among cov[j][:n + 1]


def _dominated(pb: Problem, by_earlier: bool = False) -> list[bool]:
    """Profiles another usable profile dominates: same GPU count and memory per GPU (so the same
    placement), capacity at least as high, latency coefficients no higher (ties: the lower index wins).
    `by_earlier`: only a dominating profile earlier in the request counts."""
    profs = pb.profiles
    n = len(profs)
    out = [False] * n
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i in range(n):
        if pb.p_ok[i]:
            groups.setdefault((pb.p_k[i], pb.p_need[i], pb.p_reps[i]), []).append(i)
    for ids in groups.values():
        for q in ids:
            pq = profs[q]
            for p in ids:
                if p == q or (by_earlier and p > q):
                    continue
                pp = profs[p]
                le = (pb.p_cap[p] >= pb.p_cap[q] and pp.fixed_s <= pq.fixed_s
                      and pp.prefill_s_per_token <= pq.prefill_s_per_token
                      and pp.decode_s_per_token <= pq.decode_s_per_token)
                if not le:
                    continue
                strict = (pb.p_cap[p] > pb.p_cap[q] or pp.fixed_s < pq.fixed_s
                          or pp.prefill_s_per_token < pq.prefill_s_per_token
                          or pp.decode_s_per_token < pq.decode_s_per_token)
                if strict or p < q:
                    out[q] = True
                    break
    return out


def _placeable(pb: Problem) -> list[bool]:
    """Profiles that fit on the cluster at least alone: some node has tp*pp GPUs with enough free memory (under GPU
    sharing, none of them barred to every new instance)."""
    kth: dict[int, int] = {}
    for ids in pb.layout.gpus_by_node:
        free = sorted((pb.free0[g] for g in ids), reverse=True)
        for k in range(1, len(free) + 1):
            kth[k] = max(kth.get(k, -1), free[k - 1])
    out = [pb.p_need[i] <= kth.get(pb.p_k[i], -1) for i in range(len(pb.profiles))]
    if pb.sharing:  # GPU sharing: on GPUs that no running co-resident or compute budget bars (`placeable_new`)
        from flowmaker.selection.sharing_alone import placeable_new

        out = [o and q for o, q in zip(out, placeable_new(pb), strict=True)]
    for i, reps in enumerate(pb.p_reps):  # a replica group must fit replica after replica
        if reps > 1 and out[i]:
            if pb.sharing:  # the load-aware rule may choose other GPUs for the earlier replicas
                free_s, occ = dict(pb.free0), dict(pb.occ_units)
                out[i] = all(pb.place_new(free_s, occ, i) is not None for _ in range(reps))
            else:
                out[i] = _place_group(pb.layout, dict(pb.free0), pb.p_k[i], pb.p_need[i],
                                      reps) is not None
    return out


def _static(pb: Problem, pw: PWorkflow, check_cap: bool, usable: list[bool]) -> _Static:
    n = len(pw.wf.stages)
    new_opts: list[list[int]] = [[] for _ in range(n)]
    reuse_opts: list[list[int]] = [[] for _ in range(n)]
    front: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    feasible = True
    for s in pw.llm:
        ld = pw.load[s]
        cand = [pi for pi in range(len(pb.profiles))
                if usable[pi] and (not check_cap or leq(ld, pb.p_cap[pi])) and leq(pw.lat_new[s][pi], pb.lam)]
        # Try cheap-and-fast options first: good incumbents early make the bound bite.
        cand.sort(key=lambda pi: (pb.p_mem[pi] * pw.lat_new[s][pi], pw.lat_new[s][pi], pi))
        new_opts[s] = cand
        ro = [r for r, pi in enumerate(pb.r_prof)
              if pb.p_ok[pi] and (not check_cap or leq(pb.r_load0[r] + ld, pb.p_cap[pi]))
              and leq(pw.lat_reuse[s][r], pb.lam)]
        ro.sort(key=lambda r: (pw.lat_reuse[s][r], r))
        reuse_opts[s] = ro
        if not cand and not ro:
            feasible = False
        pts = sorted((pb.p_mem[pi], pw.lat_new[s][pi]) for pi in cand)
        fr: list[tuple[float, float]] = []
        for m, lat in pts:
            if not fr or lat < fr[-1][1]:
                if fr and fr[-1][0] == m:
                    fr[-1] = (m, lat)
                else:
                    fr.append((m, lat))
        front[s] = fr
    # Thresholds: where some stage gets faster (latency fronts) or the load gets cheaper to cover (the
    # (memory, capacity) fronts of the new options of decisions j.., for every j). A completion whose largest new instance has memory m*
    # lies in the class of the largest threshold <= m*, and every threshold in between changes nothing.
    nd = len(pw.llm)
    cov: list[list[tuple[float, float]]] = []  # [decision j] (memory, capacity) front of the options of j..
    for j in range(nd + 1):
        ps = sorted({(pb.p_mem[pi], pb.p_cap[pi]) for s in pw.llm[j:] for pi in new_opts[s]},
                    key=lambda x: (x[0], -x[1]))
        fr2: list[tuple[float, float]] = []
        for m, cp in ps:
            if not fr2 or cp > fr2[-1][1]:
                fr2.append((m, cp))
        cov.append(fr2)
    mus = sorted({m for s in pw.llm for m, _ in front[s]} | {m for fr2 in cov for m, _ in fr2})
    mu_idx = {m: i for i, m in enumerate(mus)}
    f_at: list[list[float]] = [[] for _ in range(n)]
    changes: list[list[int]] = [[] for _ in mus]
    for s in pw.llm:
        row = [INF] * len(mus)
        for m, lat in front[s]:
            changes[mu_idx[m]].append(s)
            row[mu_idx[m]] = lat
        for i in range(1, len(row)):
            if row[i - 1] < row[i]:
                row[i] = row[i - 1]
        f_at[s] = row
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
    pos = {s: i for i, s in enumerate(pw.topo)}
    und: list[list[tuple[int, tuple[int, ...], tuple[int, ...], bool]]] = []
    done: list[list[int]] = []
    umap: list[dict[int, int]] = []
    for j in range(nd):
        p0 = pos[pw.llm[j]]
        rest = pw.topo[p0:]
        um = {s: u for u, s in enumerate(rest)}
        und.append([(s, tuple(p for p in pw.preds[s] if pos[p] < p0), tuple(um[p] for p in pw.preds[s] if pos[p] >= p0),
                     pw.wf.stages[s].is_llm) for s in rest])
        done.append(list(pw.topo[:p0]))
        umap.append(um)
    w_rem = [0.0] * (nd + 1)
    ratio = [INF] * (nd + 1)
    for j in range(nd - 1, -1, -1):
        s = pw.llm[j]
        w_rem[j] = w_rem[j + 1] + pw.load[s]
        ratio[j] = min([ratio[j + 1]] + [pb.p_mem[pi] / pb.p_cap[pi] for pi in new_opts[s]])
    loads_sorted = [sorted(pw.load[s] for s in pw.llm[j:]) for j in range(nd + 1)]
    two_min = [ls[0] + ls[1] if len(ls) >= 2 else INF for ls in loads_sorted]
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
    cov_at = [[bisect.bisect_right([m for m, _ in fr], mu) for mu in mus] for fr in cov]
    cov_ratio = [list(itertools.accumulate((m / cp for m, cp in fr), min)) for fr in cov]
    return _Static(any_heavy=any(heavy), cov=cov, cov_at=cov_at, cov_ratio=cov_ratio, new_opts=new_opts, reuse_opts=reuse_opts, front=front, mus=mus, f_at=f_at, changes=changes,
                   und=und, done=done, umap=umap, w_rem=w_rem, two_min=two_min, loads_sorted=loads_sorted,
                   heavy=heavy, heavy_mem=heavy_mem, ratio=ratio, after=after, before=before, feasible=feasible)


class _Search:
    """One branch-and-bound run over all workflows, sharing the incumbent.

    `deadline` (perf_counter time) stops the search; subtrees left unexplored then contribute
    their bound to `frontier`, so min(best cost, frontier) is a proven lower bound of the optimum."""

    def __init__(self, pb: Problem, *, check_cap: bool = True, check_place: bool = True,
                 stop_first: bool = False, deadline: float = INF, grace: float = INF,
                 max_nodes: int | None = None, canonical: tuple[float, float, int] | None = None,
                 lat_cap: float | None = None, multisets: dict[int, list[tuple[int, ...]]] | None = None,
                 max_work: int | None = None) -> None:
        self.pb = pb
        # Per workflow index, the only multisets of new instances (profile indices, sorted) to look among (GPU
        # sharing's tie-break search, from the chain walk: `milp.Front.settled`); a workflow not named: any.
        self.multisets = multisets or {}
        # Only variants of latency <= lat_cap (up to REL_TOL) are looked for: `milp.select_hybrid` under GPU
        # sharing, once the cost is proven and only the tie-break (a shorter L or fewer new GPUs) is left.
        self.lat_cap = lat_cap
        self.check_cap = check_cap
        self.check_place = check_place
        self.stop_first = stop_first
        self.deadline = deadline
        self.grace = grace
        self.max_nodes = max_nodes  # a deterministic deadline (tests): stop after this many nodes
        # The same in nodes plus GPU-sharing prefix checks (each a child placed and checked: a node with hundreds of
        # children that fail the check costs hundreds of times a node's work). None: no such limit.
        self.max_work = max_work
        self.checks = 0
        # The canonical pass: `canonical` is the proven optimum's (cost, L, new GPUs); the search visits the
        # variants in the spec's canonical order and stops at the first that ties it (`_canonical`).
        self.canonical = canonical
        self.canon_wf = -1  # the known optimum's workflow and encoding (canonical pass; see `canonical`)
        self.canon_enc: tuple[tuple[int, int], ...] | None = None
        self.best: tuple[float, float, int] | None = None
        self.best_at: tuple[PWorkflow, list[Choice], list[int], list[tuple[str, tuple[str, ...]]]] | None = None
        self.nodes = 0
        self.leaves = 0
        self.lp_solves = 0
        self.done = False  # stop_first found its variant
        self.stopped = False  # the deadline passed: only bounds are computed from now on
        self.frontier = INF  # least bound of the subtrees left unexplored

    def over_work(self) -> bool:
        """Whether the node limit (`max_nodes`) or the work limit (`max_work`) is spent."""
        return (self.max_nodes is not None and self.nodes > self.max_nodes) or (
            self.max_work is not None and self.nodes + self.checks > self.max_work)

    @property
    def lower_bound(self) -> float:
        """Proven lower bound of the optimal cost (INF: no feasible variant exists)."""
        return min(self.best[0] if self.best else INF, self.frontier)

    def run(self) -> None:
        pb = self.pb
        usable = list(pb.p_ok)
        # The canonical pass keeps a dominated profile unless a profile earlier in the request dominates it
        # (a tie with the dominated one would come first in the canonical order).
        dom = _dominated(pb, by_earlier=self.canonical is not None)
        place = _placeable(pb) if self.check_place else [True] * len(pb.profiles)
        usable = [u and not d and pl for u, d, pl in zip(usable, dom, place, strict=True)]
        if self.canonical is not None:
            self.best = self.canonical  # the bounds prune by it; `leaf` keeps the first variant that ties it
        searches = []
        for pw in pb.workflows:
            if self.canon_enc is not None and pw.index > self.canon_wf:
                continue  # after the known optimum's workflow: later in the canonical order
            if self.multisets.get(pw.index, True) == []:
                continue  # no multiset of new instances can tie the incumbent there
            # GPU sharing: the bounds (and the options they rule out) take the slowed latencies' lower bounds.
            st = _static(pb, pb.bound_view(pw) if self.check_place else pw, self.check_cap, usable)
            if not st.feasible:
                continue
            root_lb, go = self._workflow(st, pw)
            searches.append((root_lb, pw.index, go))
        # Workflows with the smallest root bound first (the canonical pass: in the request's order).
        searches.sort(key=lambda x: (x[1],) if self.canonical is not None else (x[0], x[1]))
        for root_lb, _, go in searches:
            if self.done:
                break
            if self.stopped or time.perf_counter() > self.deadline or self.over_work():
                self.stopped = True
                self.frontier = min(self.frontier, root_lb)
                continue
            go()

    def _workflow(self, st: _Static, pw: PWorkflow) -> tuple[float, Callable[[], None]]:
        """Set up the search of one workflow: returns (root bound, function that searches it)."""
        pb = self.pb
        n = len(pw.wf.stages)
        fin = [0.0] * n
        for s in st.before:
            fin[s] = max((fin[p] for p in pw.preds[s]), default=0.0) + pw.tool_lat[s]
        if any(not leq(fin[s], pb.lam) for s in st.before):
            return INF, lambda: None
        llm = pw.llm
        nd = len(llm)
        preds = pw.preds
        # GPU sharing: latencies for bounds and pruning are `Problem.bound_view`'s lower bounds of the slowed ones
        # (`leaf` and `sharing_prefix_ok` evaluate the true ones from `pw`); the base contract's otherwise.
        bview = pb.bound_view(pw) if self.check_place else pw
        lat_new = bview.lat_new
        lat_reuse = bview.lat_reuse
        load = pw.load
        tool_lat = pw.tool_lat
        lam = pb.lam
        # The canonical pass looks only for variants that tie the optimum (cost c*, latency L*, G* new GPUs): their
        # latency is at most L* and their new memory is c* / L*, so every partial latency above L*, memory above
        # c* / L* or new GPUs above G* is pruned (each only grows down the tree).
        mem_cap, gpu_cap = INF, 1 << 62
        if self.canonical is not None:
            c_t, l_t, g_t = self.canonical
            lam = min(lam, l_t * (1 + REL_TOL) + 1e-300)
            mem_cap = (c_t / l_t if l_t > 0 else 0.0) * (1 + 1e-9) + 1e-12
            gpu_cap = g_t
        if self.lat_cap is not None:
            lam = min(lam, self.lat_cap * (1 + REL_TOL) + 1e-300)
        p_cap, p_mem, p_k, p_reps, p_need, p_gpus = pb.p_cap, pb.p_mem, pb.p_k, pb.p_reps, pb.p_need, pb.p_gpus
        cap_lim = [leq_limit(c) for c in p_cap]  # `leq(x, p_cap[pi])` is `x <= cap_lim[pi]`, bit for bit
        r_prof, r_load0 = pb.r_prof, pb.r_load0
        layout = pb.layout
        free = dict(pb.free0)
        occ = dict(pb.occ_units)  # GPU sharing: the occupancy that load-aware placement reads
        sharing = pb.sharing
        choice: list[Choice] = []
        slots: list[int] = []
        slot_load: list[float] = []
        places: list[tuple[str, tuple[str, ...]]] = []
        r_add = [0.0] * len(pb.reusable)
        assigned = [False] * n
        for s in st.before:
            assigned[s] = True
        check_cap, check_place = self.check_cap, self.check_place
        mem_now = [0.0]
        gpus_now = [0]
        depth = [0]
        mus, f_at, changes = st.mus, st.f_at, st.changes
        n_mu = len(mus)
        reuse_opts = st.reuse_opts
        # Running instances some stage could reuse: their spare capacity counts in the capacity bound.
        reuse_any = sorted({r for s in llm for r in reuse_opts[s]})
        perf = time.perf_counter
        zero_free = all(m > 0.0 for m in p_mem)  # every new instance costs: cost 0 means no new instance
        search = self

        cover_memo: dict[tuple[int, int, int], tuple[list[float], list[float]]] = {}

        def cover(j: int, n: int, need: float) -> float:
            """Least memory of new instances (of the n smallest profiles of the capacity front of stages
            j..) whose capacity adds up to `need`: exact over the fewest instances that can, else that
            many times the least memory; INF when none can."""
            fr = st.cov[j][:n]
            if not fr:
                return INF
            need -= EPS * max(1.0, need)
            c = math.ceil(need / fr[-1][1])
            if c <= 1:
                return 0.0
            alt = (c + 1) * fr[0][0]  # any larger multiset
            if math.comb(len(fr) + c - 1, c) > 400:
                return c * fr[0][0]
            tab = cover_memo.get((j, n, c))
            if tab is None:
                pts = sorted((sum(x[1] for x in ms), sum(x[0] for x in ms))
                             for ms in itertools.combinations_with_replacement(fr, c))
                caps = [cp for cp, _ in pts]
                suf = [m for _, m in pts]
                for i in range(len(suf) - 2, -1, -1):
                    if suf[i + 1] < suf[i]:
                        suf[i] = suf[i + 1]
                tab = (caps, suf)
                cover_memo[(j, n, c)] = tab
            i = bisect.bisect_left(tab[0], need)
            exact_c = tab[1][i] if i < len(tab[1]) else INF
            return exact_c if exact_c < alt else alt

        def bound(full: bool) -> tuple[float, float]:
            """Lower bounds (cost, latency) of any completion; cost INF when none can be feasible.
            Unless `full`, the cost bound stops early once it shows the node cannot be pruned
            (it stays a valid lower bound, only a weaker one)."""
            j = depth[0]
            U = st.und[j]
            nu = len(U)
            Lfix = 0.0
            for s in st.done[j]:
                if fin[s] > Lfix:
                    Lfix = fin[s]
            h0 = [0.0] * nu
            zl = [0.0] * nu
            fl = [0.0] * nu
            n_inf = 0
            last = n_mu - 1
            for u in range(nu):
                s, ap, _, isl = U[u]
                h = 0.0
                for p in ap:
                    if fin[p] > h:
                        h = fin[p]
                h0[u] = h
                if not isl:
                    zl[u] = fl[u] = tool_lat[s]
                    continue
                ld = load[s]
                z = INF
                for r in reuse_opts[s]:  # fastest first: the first with room is the fastest free one
                    if not check_cap or r_load0[r] + r_add[r] + ld <= cap_lim[r_prof[r]]:
                        z = lat_reuse[s][r]
                        break
                for k, pi in enumerate(slots):
                    lv = lat_new[s][pi]
                    if lv < z and (not check_cap or slot_load[k] + ld <= cap_lim[pi]):
                        z = lv
                zl[u] = z
                f = f_at[s][last] if n_mu else INF
                fl[u] = z if z < f else f
                if z == INF:
                    n_inf += 1

            def lp(lat: list[float]) -> float:
                val = [0.0] * nu
                L = Lfix
                for u in range(nu):
                    h = h0[u]
                    for q in U[u][2]:
                        if val[q] > h:
                            h = val[q]
                    v = h + lat[u]
                    val[u] = v
                    if v > L:
                        L = v
                return L

            Lb = lp(fl)
            if not leq(Lb, lam):
                return INF, Lb
            M = mem_now[0]
            cut = -INF
            tie_cap = -INF  # classes costing up to this can tie the incumbent: their latency matters
            # Classes already above the incumbent without the priced capacity need no pricing (a partial bound:
            # it only decides pruning, which such a class cannot change; `full` bounds price every class).
            skip = INF
            if not full:
                best = search.best
                if best is None:
                    cut = INF
                else:
                    tie_cap = best[0] * (1 + REL_TOL)
                    skip = tie_cap + 1e-300
                    # Below the cut a completion could still beat the incumbent (at equal cost only
                    # with a strictly shorter latency).
                    cut = best[0] * (1 + REL_TOL) if Lb < best[1] * (1 - REL_TOL) else best[0] * (1 - REL_TOL)
            # Capacity: load still to place beyond the spare capacity of instances already in play
            # needs new instances, at best at the least memory per unit of capacity (fractional relaxation).
            # Free instances in play (running ones, new ones of this variant) with room for at least one
            # remaining stage: (profile, spare, how many remaining loads fit alone, what the spare can absorb:
            # all of it, or only the largest load that fits when two of them cannot).
            free_sp: list[tuple[int, float, int, float, int]] = []  # ..., the running instance (-1: a new one)
            if check_cap:
                ls = st.loads_sorted[j]
                two = st.two_min[j]
                lmin_t = ls[0] * (1 - EPS) - EPS if ls else INF
                for r in reuse_any:
                    pi = r_prof[r]
                    sp = p_cap[pi] - r_load0[r] - r_add[r]
                    if sp >= lmin_t:
                        nf = bisect.bisect_right(ls, sp * (1 + EPS) + EPS)
                        if nf:
                            free_sp.append((pi, sp, nf, sp if two <= sp * (1 + EPS) + EPS else ls[nf - 1], r))
                for k, pi in enumerate(slots):
                    sp = p_cap[pi] - slot_load[k]
                    if sp >= lmin_t:
                        nf = bisect.bisect_right(ls, sp * (1 + EPS) + EPS)
                        if nf:
                            free_sp.append((pi, sp, nf, sp if two <= sp * (1 + EPS) + EPS else ls[nf - 1], -1))
            # A completion whose largest new instance has memory mu uses only profiles of memory <= mu,
            # so the memory that covers the load is taken over those (in the mu loop), at least dm over all.
            dm = 0.0
            need = 0.0
            if check_cap:
                need = st.w_rem[j]
                if need > 0.0:
                    # What spare capacity can absorb: nothing below the least remaining load, at most the
                    # largest load that fits when two of them cannot.
                    for x in free_sp:
                        need -= x[3]
                    if need > EPS * max(1.0, st.w_rem[j]):
                        if st.ratio[j] == INF:
                            return INF, Lb
                        dm = need * st.ratio[j]
                        c = cover(j, len(st.cov[j]), need)
                        if c > dm:
                            dm = c
                    else:
                        need = 0.0
                    # Integrality: stages too heavy to share any new instance with another heavy
                    # stage, and that fit no spare capacity in play, each need an instance of their own.
                    if st.any_heavy:
                        big = 0.0
                        for jj in range(j, nd):
                            s = llm[jj]
                            if not st.heavy[s]:
                                continue
                            ld = load[s]
                            if any(leq(ld, x[1]) for x in free_sp):
                                continue
                            big += st.heavy_mem[s]
                        if big > dm:
                            dm = big
            # Free options have limited spare capacity: a Lagrangian relaxation prices it, so that
            # undecided stages do not all count on the same headroom. Instances of one profile form one
            # group (their spare adds up). Only groups whose demand exceeds their spare get a price.
            cons: list[int] = []
            gcap: dict[int, float] = {}
            gmem: dict[int, list[int]] = {}  # GPU sharing: per group, its running instances (-1: a new one)

            def glat(s: int, g: int) -> float:
                """Stage s's latency on free group g: its profile's; under GPU sharing the least bound among
                its members (a running instance's bound depends on its own GPUs' co-residents, not only on
                its profile, and a new one's on the least busy GPUs)."""
                if not sharing:
                    return lat_new[s][g >> 10]
                return min(lat_reuse[s][r] if r >= 0 else lat_new[s][g >> 10] for r in gmem[g])
            min_u: list[float] = []  # [u] fastest free option of an unpriced group
            con_lat: list[list[tuple[int, float]]] = []  # [u] (priced group, latency) usable by stage u
            if len(free_sp) > 1:
                # A group: the instances of one profile whose spare fits the same remaining stages
                # (key = profile * 1024 + how many of the remaining loads fit), so that a stage only
                # counts on the spare of instances it fits in.
                gmax: dict[int, float] = {}
                for pi, sp, nf, us, r in free_sp:
                    key = pi * 1024 + nf
                    gcap[key] = gcap.get(key, 0.0) + us
                    if key not in gmax or sp < gmax[key]:
                        gmax[key] = sp
                    if sharing:
                        gmem.setdefault(key, []).append(r)
                demand: dict[int, float] = dict.fromkeys(gcap, 0.0)
                usel: list[list[int]] = []
                for u in range(nu):
                    s, _, _, isl = U[u]
                    if not isl:
                        usel.append([])
                        continue
                    ld = load[s]
                    o = [pi for pi, mx in gmax.items() if ld <= mx * (1 + EPS) + EPS]
                    usel.append(o)
                    for pi in o:
                        demand[pi] += ld
                cons = [pi for pi, d in demand.items() if d > gcap[pi] * (1 + EPS) + EPS]
                if cons:
                    cset = set(cons)
                    for u in range(nu):
                        s = U[u][0]
                        mn = INF
                        cl: list[tuple[int, float]] = []
                        for g in usel[u]:
                            lv = glat(s, g)
                            if g in cset:
                                cl.append((g, lv))
                            elif lv < mn:
                                mn = lv
                        min_u.append(mn)
                        con_lat.append(cl)

            def lag_lp(i: int) -> float:
                """Longest-path bound with the priced free options, when the new options are those of
                memory <= mus[i] (i < 0: none); -INF when no price helps, INF when infeasible."""
                price: dict[int, float] = dict.fromkeys(cons, 0.0)
                alt = [0.0] * nu  # best option of stage u that no price touches
                cls: list[list[tuple[int, float]]] = []  # priced groups faster than that, per stage
                for u in range(nu):
                    if con_lat[u]:
                        f = f_at[U[u][0]][i] if i >= 0 else INF
                        a = f if f < min_u[u] else min_u[u]
                        alt[u] = a
                        cls.append([x for x in con_lat[u] if x[1] < a])
                    else:
                        cls.append([])
                for _ in range(LAG_PASSES):  # coordinate ascent over the priced groups
                    for g in cons:
                        bps: list[tuple[float, float]] = []
                        tot = 0.0
                        cap_g = gcap[g]
                        for u in range(nu):
                            cl = cls[u]
                            if not cl:
                                continue
                            ld = load[U[u][0]]
                            a = alt[u]
                            b = INF
                            for h, lv in cl:
                                if h == g:
                                    b = lv
                                else:
                                    v = lv + price[h] * ld
                                    if v < a:
                                        a = v
                            if b < a and ld > 0.0:
                                bps.append(((a - b) / ld, ld))
                                tot += ld
                        pr = 0.0
                        if tot > cap_g:
                            bps.sort(reverse=True)
                            acc = 0.0
                            for x, ld in bps:
                                acc += ld
                                if acc > cap_g:
                                    pr = x
                                    break
                            if pr == INF:
                                return INF  # stages with no other option overload the group
                        price[g] = pr
                if not any(price.values()):
                    return -INF
                lat2 = [0.0] * nu
                for u in range(nu):
                    s, _, _, isl = U[u]
                    if not isl:
                        lat2[u] = tool_lat[s]
                        continue
                    f = f_at[s][i] if i >= 0 else INF
                    v = f if f < min_u[u] else min_u[u]
                    ld = load[s]
                    for h, lv in cls[u]:
                        w = lv + price[h] * ld
                        if w < v:
                            v = w
                    lat2[u] = v
                return lp(lat2) - sum(pr * gcap[g] for g, pr in price.items())

            use_lp = bool(cons) and _HIGHS is not None and (full or search.nodes >= LP_AFTER_NODES)

            def lp_lp(i: int) -> float:
                """The same relaxation solved exactly as a linear program (HiGHS): fractional assignment of
                the undecided stages to the free groups (their spare) and to the new options of memory
                <= mus[i] (i < 0: none), longest path by potentials. INF: infeasible."""
                search.lp_solves += 1
                return _lp_longest_path(U, h0, Lfix, [(load[U[u][0]], {g: glat(U[u][0], g) for g in gmax},
                                                      (f_at[U[u][0]][i] if i >= 0 else INF)) if U[u][3]
                                                     else None for u in range(nu)],
                                        tool_lat, gcap, gmax)

            if not full and zero_free and M == 0.0 and search.best is not None and search.best[0] == 0.0:
                # Only completions without new instances can tie a free incumbent: bound their latency.
                if n_inf or need > 0.0:
                    return INF, Lb
                L0 = lp(zl)
                if cons:
                    L0 = max(L0, lag_lp(-1))
                    if use_lp and L0 < search.best[1] * (1 - REL_TOL) and leq(L0, lam):
                        L0 = max(L0, lp_lp(-1))
                return (0.0, L0) if leq(L0, lam) else (INF, L0)
            # The memory/latency coupling over all undecided stages at once, mu ascending.
            best_t = INF
            prev_done = n_inf == 0 and need == 0.0  # the mu = 0 class is evaluated
            Lt = INF  # least latency of the classes that can tie the incumbent
            if n_inf == 0 and need == 0.0:
                L0 = lp(zl)
                if cons and (M + dm) * L0 <= skip:
                    L0 = max(L0, lag_lp(-1))
                    if use_lp and leq(L0, lam) and (M + dm) * L0 < (best_t if full else cut):
                        L0 = max(L0, lp_lp(-1))
                if leq(L0, lam):
                    best_t = (M + dm) * L0
                    if best_t <= tie_cap:
                        Lt = L0
            if best_t < cut:
                nxt = (M + max(mus[0], dm)) * Lb if n_mu else INF
                return (best_t if best_t < nxt else nxt), Lb
            lat = zl
            um = st.umap[j]
            for i in range(n_mu):
                mu = mus[i]
                mm = M + (mu if mu > dm else dm)
                if mm * Lb >= best_t and mm * Lb > tie_cap:
                    break
                changed = False
                touched = False  # a new option for an undecided stage: the priced capacity may relax
                for s in changes[i]:
                    u = um.get(s, -1)
                    if u < 0:
                        continue
                    touched = True
                    f = f_at[s][i]
                    if f < lat[u]:
                        if lat[u] == INF:
                            n_inf -= 1
                        if not changed:
                            lat = list(lat) if lat is zl else lat
                            changed = True
                        lat[u] = f
                if n_inf or (not changed and not (touched and cons) and prev_done and need == 0.0):
                    continue  # no option for some stage / the same class as the previous one
                prev_done = True
                if need > 0.0:
                    # Only profiles of memory <= mu cover the load in this class.
                    nc = st.cov_at[j][i]
                    if nc == 0:
                        continue
                    d2 = max(need * st.cov_ratio[j][nc - 1], cover(j, nc, need))
                    if d2 > mu and d2 > dm:
                        mm = M + d2
                        if mm * Lb >= best_t and mm * Lb > tie_cap:
                            continue
                L = lp(lat)
                if mm * L < best_t and cons and mm * L <= skip:
                    L = max(L, lag_lp(i))
                    if use_lp and leq(L, lam) and mm * L < (best_t if full else min(best_t, cut)):
                        L = max(L, lp_lp(i))
                if leq(L, lam):
                    t = mm * L
                    if t <= tie_cap and L < Lt:
                        Lt = L
                    if t < best_t:
                        best_t = t
                        if best_t < cut:
                            nxt = (M + max(mus[i + 1], dm)) * Lb if i + 1 < n_mu else INF
                            return (best_t if best_t < nxt else nxt), Lb
            if full or best_t > tie_cap:
                return best_t, Lb
            # Completions that could tie the incumbent's cost: their latency is at least Lt.
            return best_t, (Lt if Lt > Lb else Lb)

        canon = search.canonical is not None

        def prune(lb: float, Lb: float) -> bool:
            best = search.best
            if lb == INF:
                return True
            if best is None:
                return False
            bc, bl, bg = best
            if canon:  # only completions that tie the optimum are looked for
                return lb > bc * (1 + REL_TOL) + 1e-300 or Lb > bl * (1 + REL_TOL) + 1e-300
            if lb > bc * (1 + REL_TOL) + 1e-300:
                return True
            if lb < bc * (1 - REL_TOL) or Lb < bl * (1 - REL_TOL):
                return False
            # A completion of equal cost is only worth finding for a strictly shorter latency, or at an equal
            # latency with fewer new GPUs (the spec's third key; the new GPUs so far only grow down the tree).
            return Lb > bl * (1 + REL_TOL) + 1e-300 or gpus_now[0] >= bg

        def leaf() -> None:
            search.leaves += 1
            if allowed is not None and tuple(sorted(slots)) not in allowed:
                return
            L = max(fin)
            M = mem_now[0]
            if sharing and check_place:
                # GPU sharing: the complete variant's budget and slowed latency (every bound above used the
                # latency alone, a lower bound of this one). Floats first: a variant clearly costlier than the
                # incumbent is left without the exact arithmetic (the float multipliers are within 1e-12 of it).
                inc = search.best
                fast = pb.sharing_factors_fast(pw, choice, slots, places)
                if fast is False:
                    return
                if isinstance(fast, list):
                    Lf = pb.longest_path(pw, pb.stage_latencies(pw, choice, slots, fast)) * (1 - 1e-9)
                    if not leq(Lf, lam) or (inc is not None and M * Lf > inc[0] * (1 + REL_TOL) + 1e-300):
                        return
                factors = pb.sharing_factors(pw, choice, slots, places)
                if factors is None:
                    return
                L = pb.longest_path(pw, pb.stage_latencies(pw, choice, slots, factors))
                if not leq(L, lam):
                    return
            if canon:
                if _ties(M * L, L, gpus_now[0], search.best):
                    search.best_at = (pw, list(choice), list(slots), list(places))
                    search.done = True
                return
            if better(M * L, L, gpus_now[0], search.best):
                search.best = (M * L, L, gpus_now[0])
                search.best_at = (pw, list(choice), list(slots), list(places))
                if search.stop_first:
                    search.done = True

        def set_fin(s: int, f: float) -> bool:
            """Stage s finishes at f (its predecessors' latest finish + its latency), if within lambda."""
            if not leq(f, lam):
                return False
            fin[s] = f
            assigned[s] = True
            return True

        def tools_after(j: int) -> bool:
            ok = True
            for s in st.after[j]:
                fin[s] = max((fin[p] for p in preds[s]), default=0.0) + tool_lat[s]
                assigned[s] = True
                if not leq(fin[s], lam):
                    ok = False
            return ok

        def undo_tools(j: int) -> None:
            for s in st.after[j]:
                assigned[s] = False

        topo = pw.topo
        llm_pos = {s2: i for i, s2 in enumerate(llm)}
        # The multisets of new instances this search may end with (None: any), as profile counts; a prefix's
        # new instances must stay within one of them.
        allowed = set(self.multisets[pw.index]) if pw.index in self.multisets else None
        allowed_counts = [collections.Counter(y) for y in allowed] if allowed is not None else []
        opened: collections.Counter[int] = collections.Counter()
        # GPU sharing: each stage's options by their `bound_view` latency and by memory (`completion_ok`).
        new_by_lat = [sorted(st.new_opts[s2], key=lat_new[s2].__getitem__) if lat_new[s2] else []
                      for s2 in range(n)]
        new_by_mem = [sorted(st.new_opts[s2], key=lambda pi: p_mem[pi]) for s2 in range(n)]

        def sharing_prefix_ok() -> bool:
            """GPU sharing: shares only grow as stages are added, so a prefix over a budget fails every completion,
            and its slowed latency is a lower bound of every completion's (a bound on latency and cost). Floats
            first (`Problem.sharing_factors_fast`): a prefix that passes every check clearly is kept without the
            exact arithmetic, which decides every prefix that fails or is close."""
            best = search.best
            search.checks += 1
            fast = pb.sharing_factors_fast(pw, choice, slots, places)
            if fast is False:
                return False
            if isinstance(fast, list):
                Lf = slowed_path(fast)  # within 1e-12 of the exact slowed latency
                lo = Lf * (1 - 1e-9)
                if not leq(lo, lam) or (best is not None and mem_now[0] * lo > best[0] * (1 + REL_TOL) + 1e-300):
                    return False
                Lf *= 1 + 1e-9
                if leq(Lf, lam) and (best is None or mem_now[0] * Lf <= best[0] * (1 + REL_TOL)):
                    return completion_ok(fast)
            factors = pb.sharing_factors(pw, choice, slots, places)
            if factors is None:
                return False
            Lp = slowed_path(factors)
            if not leq(Lp, lam):
                return False
            if best is not None and mem_now[0] * Lp > best[0] * (1 + REL_TOL) + 1e-300:
                return False
            return completion_ok(factors)

        def completion_ok(factors: list[float]) -> bool:
            """GPU sharing: every completion's slowed latency is at least `sharing_bound.completion_bound`'s (what
            the prefix put on the GPUs slows and rules out the options of the stages left), and its new memory at
            least the prefix's plus what a stage no instance in play can take needs."""
            L_lb, extra = completion_bound(pb, pw, choice, slots, places, free, factors, r_add, slot_load,
                                           reuse_opts, new_by_lat, new_by_mem)
            if not leq(L_lb, lam):
                return False
            return not prune((mem_now[0] + extra) * L_lb, L_lb)  # ties included: only a better one is looked for

        def slowed_path(factors: list[float]) -> float:
            """The longest path over the assigned stages with these multipliers on the prefix's LLM stages."""
            slowed = {s2: f for s2, f in zip(llm, factors, strict=False)}
            fin2: dict[int, float] = {}
            Lp = 0.0
            for s2 in topo:
                if not assigned[s2]:
                    continue
                if s2 in slowed:
                    kind, ref = choice[llm_pos[s2]]
                    base = pw.lat_reuse[s2][ref] if kind == REUSE else pw.lat_new[s2][slots[ref]]
                else:
                    base = tool_lat[s2]
                f2 = max((fin2.get(p, 0.0) for p in preds[s2]), default=0.0) + base * slowed.get(s2, 1.0)
                fin2[s2] = f2
                if f2 > Lp:
                    Lp = f2
            return Lp

        def descend(j: int, lb: float) -> None:
            # Called with stage llm[j] and its following TOOL stages already set.
            if sharing and check_place and j + 1 < nd and not sharing_prefix_ok():
                return
            if not tools_after(j):
                undo_tools(j)
                return
            rec(j + 1, lb)
            undo_tools(j)

        def sym_key(pi: int, used: float, j: int) -> tuple[int, int] | None:
            """Interchangeability class of an instance of profile pi carrying `used` load, for the
            stages j..: (pi, -1) when it can take all their load, (pi, how many fit) when it can take
            at most one of them, None otherwise."""
            if sharing:  # instances of one profile on different GPUs are slowed differently
                return None
            cap = p_cap[pi]
            if not check_cap or leq(used + st.w_rem[j], cap):
                return (pi, -1)
            if not leq(used + st.two_min[j], cap):
                c = 0
                for x in st.loads_sorted[j]:
                    if not leq(used + x, cap):
                        break
                    c += 1
                return (pi, c)
            return None

        def halted(lb: float) -> bool:
            """Past the grace period: the rest of this node is left unexplored under its bound `lb`."""
            if search.stopped and perf() > search.grace:
                if lb < search.frontier:
                    search.frontier = lb
                return True
            return False

        # The canonical pass visits children in the spec's canonical order: running instances by position,
        # then open new instances by slot, then new profiles by position (and replica count).
        canon_reuse = [sorted(x) for x in reuse_opts]
        canon_new = [sorted(x) for x in st.new_opts]
        # Only variants before the known optimum in the canonical order are looked for: in its workflow, a
        # child after its choice at a stage whose prefix equals its prefix ends the node (eqd: how many leading
        # stages of the current choice equal its).
        restrict = canon and search.canon_enc is not None and pw.index == search.canon_wf
        enc = search.canon_enc or ()
        eqd = [0]

        def rec(j: int, parent_lb: float) -> None:
            if search.done:
                return
            search.nodes += 1
            if j == nd:
                leaf()
                return
            if not search.stopped and (perf() > search.deadline or search.over_work()):
                search.stopped = True
            depth[0] = j
            if search.stopped:
                # Out of time: this subtree stays unexplored; its bound goes to the frontier.
                lb = parent_lb if perf() > search.grace else max(parent_lb, bound(True)[0])
                if lb < search.frontier:
                    search.frontier = lb
                return
            lb, Lb = bound(False)
            if lb < parent_lb:
                lb = parent_lb  # every completion here is one of the parent's
            if prune(lb, Lb):
                return
            s = llm[j]
            ld = load[s]
            # when its predecessors finish: decided before it, so the same for every child below
            h_s = max((fin[p] for p in preds[s]), default=0.0)
            # 1. reuse a running instance
            seen: set[tuple[int, int]] = set()
            peq = restrict and eqd[0] == j  # the canonical pass: the prefix equals the known optimum's
            for r in (canon_reuse[s] if canon else reuse_opts[s]):
                if peq and (0, r) > enc[j]:
                    return  # every later child comes after the known optimum in the canonical order
                pi = r_prof[r]
                used = r_load0[r] + r_add[r]
                if check_cap and not used + ld <= cap_lim[pi]:
                    continue
                key = sym_key(pi, used, j)
                if key is not None:
                    if key in seen:
                        continue
                    seen.add(key)
                if not set_fin(s, h_s + lat_reuse[s][r]):
                    continue
                r_add[r] += ld
                choice.append((REUSE, r))
                if peq and (0, r) == enc[j]:
                    eqd[0] = j + 1
                descend(j, lb)
                eqd[0] = j
                choice.pop()
                r_add[r] -= ld
                assigned[s] = False
                if search.done or halted(lb):
                    return
            # 2. join a new instance opened earlier in this variant
            seen.clear()
            for k in range(len(slots)):
                if peq and (1, k) > enc[j]:
                    return
                pi = slots[k]
                if check_cap and not slot_load[k] + ld <= cap_lim[pi]:
                    continue
                key = sym_key(pi, slot_load[k], j)
                if key is not None:
                    if key in seen:
                        continue
                    seen.add(key)
                if not set_fin(s, h_s + lat_new[s][pi]):
                    continue
                slot_load[k] += ld
                choice.append((NEW, k))
                if peq and (1, k) == enc[j]:
                    eqd[0] = j + 1
                descend(j, lb)
                eqd[0] = j
                choice.pop()
                slot_load[k] -= ld
                assigned[s] = False
                if search.done or halted(lb):
                    return
            # 3. open a new instance; placement depends only on k = tp*pp for this state
            place_cache: dict[int, tuple[int, str, tuple[str, ...]] | None] = {}
            for pi in (canon_new[s] if canon else st.new_opts[s]):
                if peq and (2, pi) > enc[j]:
                    return
                m = p_mem[pi]
                if mem_now[0] + m > mem_cap or gpus_now[0] + p_gpus[pi] > gpu_cap:
                    continue  # the canonical pass: more memory or GPUs than the optimum it must tie
                if allowed is not None and not any(c[pi] > opened[pi] and all(c[q] >= n2 for q, n2 in opened.items())
                                                   for c in allowed_counts):
                    continue  # no allowed multiset has room for one more of pi beside those opened
                if search.best is not None:
                    # Cheap pre-check before placing: (M + m) * (latency so far) already too much?
                    f = h_s + lat_new[s][pi]
                    if (mem_now[0] + m) * f > search.best[0] * (1 + REL_TOL) + 1e-300:
                        continue
                if not set_fin(s, h_s + lat_new[s][pi]):
                    continue
                mpg = p_need[pi]  # in the spec's unit: exact
                k = p_k[pi]
                reps = p_reps[pi]
                # Free memory (integers in the spec's unit, so no drift) is restored from this snapshot.
                snap = list(free.items()) if check_place else []
                group: list[tuple[str, tuple[str, ...]]] = []
                node: str = ""
                gids: tuple[str, ...] = ()
                if check_place and sharing:  # load-aware: replica by replica, on (free memory, occupancy)
                    placed_s: list[tuple[str, tuple[str, ...]]] = []
                    for _ in range(reps):
                        pl2 = pb.place_new(free, occ, pi)
                        if pl2 is None:
                            break
                        placed_s.append(pl2)
                    if len(placed_s) < reps:
                        _unplace(placed_s, free, occ, snap, pb.u_units)
                        assigned[s] = False
                        continue
                    group = placed_s
                elif check_place and reps > 1:  # a replica group: placed replica by replica, not cached
                    placed = _place_group(layout, free, k, mpg, reps)
                    if placed is None:
                        _restore(free, snap)
                        assigned[s] = False
                        continue
                    group = placed
                    node, gids = "", ()
                elif check_place:
                    if k not in place_cache:
                        place_cache[k] = _best_node(layout, free, k)
                    pl = place_cache[k]
                    if pl is None or pl[0] < mpg:
                        assigned[s] = False
                        continue
                    node, gids = pl[1], pl[2]
                    for g in gids:
                        free[g] -= mpg
                else:
                    node, gids = "", ()
                slots.append(pi)
                slot_load.append(ld)
                opened[pi] += 1
                if group:
                    places.extend(group)
                else:
                    places.extend((node, gids) for _ in range(reps))
                mem_now[0] += m
                gpus_now[0] += k * reps
                choice.append((NEW, len(slots) - 1))
                if peq and (2, pi) == enc[j]:
                    eqd[0] = j + 1
                descend(j, lb)
                eqd[0] = j
                choice.pop()
                gpus_now[0] -= k * reps
                mem_now[0] -= m
                del places[len(places) - reps:]
                slot_load.pop()
                slots.pop()
                opened[pi] -= 1
                if check_place and sharing:
                    _unplace(group, free, occ, snap, pb.u_units)
                elif check_place:
                    _restore(free, snap)
                assigned[s] = False
                if search.done or halted(lb):
                    return

        if nd == 0:
            return INF, lambda: None
        depth[0] = 0
        root_lb = bound(True)[0]

        def go() -> None:
            if root_lb < INF:
                rec(0, root_lb)

        return root_lb, go


def _highs() -> Any:
    """HiGHS' solver class without its start-up banner on stdout (None when highspy is missing)."""
    try:
        from highspy import _core
    except ImportError:  # pragma: no cover - highspy is a dependency; the bound only gets weaker
        return None
    return getattr(_core, "_Highs", None)


_HIGHS = _highs()


def _lp_longest_path(U: list[tuple[int, tuple[int, ...], tuple[int, ...], bool]], h0: list[float], Lfix: float,
                     stage: list[tuple[float, dict[int, float], float] | None], tool_lat: tuple[float, ...],
                     gcap: dict[int, float], gmin: dict[int, float]) -> float:
    """min L over fractional assignments: each undecided LLM stage u (load, latency per free group, latency of its
    fastest new option or INF) splits over the free groups it fits (group g = profile g >> 10, spare
    gcap[g]) and its new option; t_u >= t_pred + latency, t_u >= h0[u], L >= t_u, L >= Lfix.
    A lower bound of the longest path of every completion in the class; INF when infeasible."""
    nu = len(U)
    cols_lo: list[float] = []
    cols_hi: list[float] = []
    cost: list[float] = []
    entries: list[list[tuple[int, float]]] = []
    rlo: list[float] = []
    rhi: list[float] = []

    def row(lo: float, hi: float) -> int:
        rlo.append(lo)
        rhi.append(hi)
        return len(rlo) - 1

    def col(lo: float, hi: float, c: float, e: list[tuple[int, float]]) -> int:
        cols_lo.append(lo)
        cols_hi.append(hi)
        cost.append(c)
        entries.append(e)
        return len(cost) - 1

    big = 1e30
    grow = {g: row(-big, cap * (1 + 1e-7) + 1e-7) for g, cap in gcap.items()}
    # Rows: per stage u, "assign" (LLM), "own" t_u - lat >= h0[u], one per undecided pred, "top" L - t_u >= 0.
    t_col: list[int] = []
    own = [row(h0[u], big) for u in range(nu)]
    pred_rows: list[list[tuple[int, int]]] = []
    for u in range(nu):
        pr = []
        for q in U[u][2]:
            r = row(0.0, big)
            pr.append((q, r))
        pred_rows.append(pr)
    top = [row(0.0, big) for _ in range(nu)]
    for u in range(nu):
        e = [(own[u], 1.0), (top[u], -1.0)] + [(r, 1.0) for _, r in pred_rows[u]]
        # t_u appears as -1 in the pred rows of its successors: filled below
        t_col.append(col(0.0, big, 0.0, e))
    for u in range(nu):
        for q, r in pred_rows[u]:
            entries[t_col[q]].append((r, -1.0))
    for u in range(nu):
        info = stage[u]
        lat_rows = [own[u]] + [r for _, r in pred_rows[u]]
        if info is None:  # a TOOL stage: its latency is a constant on the right-hand side
            tl = tool_lat[U[u][0]]
            for r in lat_rows:
                rlo[r] += tl
            continue
        ld, lat_new, f = info
        a = row(1.0, 1.0)
        opts: list[tuple[float, int]] = []
        for g, m in gmin.items():
            if ld <= m * (1 + 1e-9) + 1e-9:
                opts.append((lat_new[g], g))
        if f < INF:
            opts.append((f, -1))
        if not opts:
            return INF
        for lv, g in opts:
            e = [(a, 1.0)] + [(r, -lv) for r in lat_rows]
            if g >= 0:
                e.append((grow[g], ld))
            col(0.0, 1.0, 0.0, e)
    col(Lfix, big, 1.0, [(top[u], 1.0) for u in range(nu)])
    assert _HIGHS is not None
    h = _HIGHS()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    lp = _core_lp(cols_lo, cols_hi, cost, entries, rlo, rhi)
    h.passModel(lp)
    name = run_checked(h)
    if name == "Infeasible":
        return INF
    if name != "Optimal":
        return -INF  # no proof: the bound stays what it was
    v = h.getInfo().objective_function_value
    return v - 1e-6 * max(1.0, abs(v))  # solver tolerances: keep the bound safe


def run_checked(h: Any) -> str:
    """`h.run()` for a HiGHS model, and the name of its status. HiGHS' presolve has declared feasible models
    infeasible (its issues 1164, 1517, 2388, 3090; here, with 1.16.0, `milp`'s relaxation of a two-stage request under
    GPU sharing: the least L with M <= 10 "infeasible" although the least M is 10, so the walk's bound passed the
    optimum and `milp` claimed a variant 0.02% above it). An infeasibility is a proof in every caller, so one found
    with presolve on is asked again with it off, and that answer stands."""
    h.run()
    name = str(h.modelStatusToString(h.getModelStatus()))
    if name == "Infeasible" and h.getOptionValue("presolve")[1] != "off":
        was = h.getOptionValue("presolve")[1]
        h.setOptionValue("presolve", "off")
        try:
            h.run()
        finally:
            h.setOptionValue("presolve", was)
        name = str(h.modelStatusToString(h.getModelStatus()))
    return name


def _core_lp(cols_lo: list[float], cols_hi: list[float], cost: list[float], entries: list[list[tuple[int, float]]],
             rlo: list[float], rhi: list[float]) -> Any:
    from highspy import _core

    lp = _core.HighsLp()
    lp.num_col_ = len(cost)
    lp.num_row_ = len(rlo)
    lp.col_cost_ = cost
    lp.col_lower_ = cols_lo
    lp.col_upper_ = cols_hi
    lp.row_lower_ = rlo
    lp.row_upper_ = rhi
    start = [0]
    index: list[int] = []
    value: list[float] = []
    for e in entries:
        for r, v in e:
            index.append(r)
            value.append(v)
        start.append(len(index))
    lp.a_matrix_.format_ = _core.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start
    lp.a_matrix_.index_ = index
    lp.a_matrix_.value_ = value
    lp.a_matrix_.num_col_ = len(cost)
    lp.a_matrix_.num_row_ = len(rlo)
    return lp


def _place_group(layout, free: dict[str, int], k: int, mpg: int, reps: int
                 ) -> list[tuple[str, tuple[str, ...]]] | None:
    """Place `reps` replicas of k GPUs x `mpg` units one after another (LeastLoaded each), taking their
    memory from `free`; None (and `free` as it was) when one does not fit."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for _ in range(reps):
        pl = _best_node(layout, free, k)
        if pl is None or pl[0] < mpg:
            for _, gids in out:
                for g in gids:
                    free[g] += mpg
            return None
        for g in pl[2]:
            free[g] -= mpg
        out.append((pl[1], pl[2]))
    return out


def _restore(free: dict[str, int], snap: list[tuple[str, int]]) -> None:
    """Free memory exactly as it was before a placement (no float drift from adding back)."""
    for g, v in snap:
        free[g] = v


def _unplace(placed: list[tuple[str, tuple[str, ...]]], free: dict[str, int], occ: dict[str, int],
             snap: list[tuple[str, int]], u: int) -> None:
    """Undo `Problem.place_new` for these replicas (GPU sharing): free memory from the snapshot, occupancy
    (`Problem.occ_units`, exact integers) by subtraction."""
    _restore(free, snap)
    for _, gids in placed:
        for g in gids:
            occ[g] -= u


def _best_node(layout, free: dict[str, int], k: int) -> tuple[int, str, tuple[str, ...]] | None:
    """The LeastLoaded choice for k GPUs in the current state, whatever the memory asked:
    the node whose k-th freest GPU has the most free memory (a node fits iff that one fits)."""
    best: tuple[int, str, tuple[str, ...]] | None = None
    for node, ids in zip(layout.nodes, layout.gpus_by_node, strict=True):
        if len(ids) < k:
            continue
        chosen = sorted(ids, key=lambda g: -free[g])[:k]
        kth = free[chosen[-1]]
        if best is None or kth > best[0]:
            best = (kth, node, tuple(chosen))
    return best


def _ties(cost: float, lat: float, gpus: int, key: tuple[float, float, int] | None) -> bool:
    """The spec's tie with the optimum `key`: cost and L equal within 1e-12 relative, the same new GPUs."""
    if key is None:
        return False
    c, L, g = key
    return gpus == g and abs(cost - c) <= REL_TOL * abs(c) and abs(lat - L) <= REL_TOL * abs(L)


BestAt = tuple[PWorkflow, list[Choice], list[int], list[tuple[str, tuple[str, ...]]]]


CANON_NODES = 2_500  # search nodes of the canonical pass (work, not time: the same answer at any load)
# Under GPU sharing a node checks exact shares on its prefix (20-30 times the work of a base node): 1,000 of them.
# Measured on 900 hard instances under sharing (three seeds): every canonical pass that settled did so within 836
# nodes but two (1,164 and 2,246, both chain_clones); five fans spent 0.41-1.35 s on 2,500 nodes without settling.
CANON_NODES_SHARING = 1_000
NOT_CANONICAL = ("proven optimal; the tie-break beyond (cost, L, new GPUs) was not settled within the canonical "
                 "search's work limit, so this may not be the canonical variant among equally good ones")


def canonical(pb: Problem, key: tuple[float, float, int], at: BestAt, deadline: float,
              multisets: dict[int, list[tuple[int, ...]]] | None = None, max_nodes: int = CANON_NODES
              ) -> tuple[BestAt, bool]:
    """The canonical variant among those that tie the proven optimum `key` (docs/selection-spec.md, "Cost"):
    the first of them in the canonical order, found by a branch and bound that visits children in that order
    and prunes every subtree that cannot tie; and True. (`at`, False) when `max_nodes` nodes or the deadline
    pass first. `multisets` (as `_Search`'s): per workflow, the only multisets of new instances a tie can have.
    Under GPU sharing at most CANON_NODES_SHARING nodes (each checks exact shares)."""
    if pb.sharing:
        max_nodes = min(max_nodes, CANON_NODES_SHARING)
    s = _Search(pb, canonical=key, deadline=deadline, grace=0.0, max_nodes=max_nodes, multisets=multisets)
    s.canon_wf, s.canon_enc = at[0].index, _encoding(at[1], at[2])
    s.run()
    if s.done and s.best_at is not None:
        return s.best_at, True
    if not s.stopped:  # searched everything before `at` in the canonical order: `at` is the canonical one
        return at, True
    return at, False


def _encoding(choice: list[Choice], slots: list[int]) -> tuple[tuple[int, int], ...]:
    """A choice in the canonical order's terms (docs/selection-spec.md, "Cost"), with the search's indices, whose
    order is the request's: (0, reused instance), (1, slot joined), (2, profile of a slot it opens)."""
    out: list[tuple[int, int]] = []
    opened = 0
    for kind, ref in choice:
        if kind == REUSE:
            out.append((0, ref))
        elif ref == opened:
            out.append((2, slots[ref]))
            opened += 1
        else:
            out.append((1, ref))
    return tuple(out)


def solve(pb: Problem, *, deadline: float = INF, grace: float = INF, max_nodes: int | None = None,
          check_cap: bool = True, check_place: bool = True, stop_first: bool = False,
          max_work: int | None = None) -> _Search:
    s = _Search(pb, deadline=deadline, grace=grace, max_nodes=max_nodes, check_cap=check_cap,
                check_place=check_place, stop_first=stop_first, max_work=max_work)
    s.run()
    return s


def tightest_reason(pb: Problem, deadline: float = INF) -> int | None:
    """Which constraint rules everything out (1 accuracy .. 4 placement), by relaxing from the end;
    None when the deadline passed before it was known."""
    s = solve(pb, check_place=False, stop_first=True, deadline=deadline)
    if s.best is not None:
        return 4
    if s.stopped:
        return None
    s = solve(pb, check_place=False, check_cap=False, stop_first=True, deadline=deadline)
    if s.best is not None:
        return 3
    if s.stopped:
        return None
    # Every stage can use any profile or running instance, so some variant meets
    # accuracy iff one usable model does.
    return 2 if any(pb.p_ok) else 1


def usable_profiles(pb: Problem) -> list[bool]:
    """Profiles the search uses: accuracy met, not dominated, placeable at least alone."""
    dom = _dominated(pb)
    place = _placeable(pb)
    return [u and not d and pl for u, d, pl in zip(pb.p_ok, dom, place, strict=True)]


def make_search(pb: Problem, **kw: Any) -> _Search:
    return _Search(pb, **kw)


def proven_infeasible(pb: Problem, strategy: str, started: float, budget: float, evaluated: int) -> SelectionResult:
    """The answer once no variant is proven to exist: the tightest reason, as far as the grace period allows."""
    level = tightest_reason(pb, deadline=started + GRACE_SHARE * budget)
    if level is None:
        # Infeasibility is proven; only which constraint is the tightest stayed open.
        res = infeasible_result(pb, strategy, 4, started, evaluated, timed_out=True, optimal=True)
        return replace(res, reason_detail=res.reason_detail + " (the time budget ran out before the "
                       "tightest reason was established: it may be an earlier constraint)")
    return infeasible_result(pb, strategy, level, started, evaluated, optimal=True)


def finish(pb: Problem, strategy: str, search: _Search, started: float, budget: float) -> SelectionResult:
    """The answer of a branch-and-bound run under the anytime contract."""
    if search.best_at is None:
        if search.stopped:
            raise DeadlineExceeded(f"{strategy}: no feasible variant found within the time budget of {budget:g} s "
                                   f"({search.nodes:,} search nodes; proven lower bound of the cost "
                                   f"{search.lower_bound:.6g})", reason="SELECTION_DEADLINE_EXCEEDED")
        return proven_infeasible(pb, strategy, started, budget, search.leaves)
    at, canon = search.best_at, True
    if not search.stopped and search.best is not None:
        at, canon = canonical(pb, search.best, at, started + GRACE_SHARE * budget)
    res = pb.result(strategy, at, started, search.leaves, timed_out=search.stopped,
                    optimal=not search.stopped, lower_bound=search.lower_bound)
    return res if canon else replace(res, reason_detail=NOT_CANONICAL)


@register("exact")
def select_exact(req: SelectionRequest) -> SelectionResult:
    from flowmaker.selection.milp import first_nodes, select_hybrid

    return select_hybrid(req, "exact", first_nodes(req.options.time_budget_s or DEFAULT_BUDGET_S))


__all__ = ["NOT_CANONICAL", "canonical", "finish", "make_search", "proven_infeasible", "select_exact", "solve", "tightest_reason", "usable_profiles"]
