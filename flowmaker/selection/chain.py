"""The relaxed front of a CHAIN workflow without MILPs: instance multisets best first, each packed exactly.

Used by `milp.select_hybrid` in place of `RelaxedModel.walk` for a workflow whose stages form one path. The
relaxation is the walk's (placement relaxed, the dominated profiles of `milp._dominated_here` left out,
the same options per stage), but bin packing is not aggregated: in a chain the latency is the sum of the
stage latencies, so for a fixed multiset y of new instances (y[p] instances of profile p; M(y) their
memory) the least latency L(y) of any assignment that fits (each stage on a running instance with room for
it or on one of the y instances, every instance within its capacity) is found exactly by a depth-first
search (`binpack.least_l_classes`) that decides each stage's class (a running instance, or the y[p] instances
of one profile: a stage's latency depends only on that), stages heaviest first, with an exact packing oracle
for a class of several instances, bounded by the Lagrangian bound below.

Every variant V with new instances y_V costs M(y_V) * L_V >= M(y_V) * L(y_V), so

    cost >= min over y of M(y) * L(y) >= min over y of M(y) * Lfast(y)

(Lfast: every stage on its fastest option in y, capacity ignored). The multisets are visited best first by
that last bound (a heap; a multiset's extensions, keyed by their least memory times the least latency of
the workflow, are generated in canonical order), until no bound is at or below the incumbent (ties
included). A multiset is evaluated lazily: popped first, it goes back to the heap under M(y) times a
Lagrangian bound of L(y) with the last LP's prices (no LP), popped again under M(y) times its own Lagrangian
bound of L(y) (the LP dual prices of the aggregated capacities: unlike Lfast it counts capacity,
which is what separates near-identical clones; a multiset whose pricing LP is infeasible cannot hold its stages
even fractionally and is dropped), and only when it comes up again is its packing searched.
The class search prunes by capacity too (the load left must fit the room of the classes that can still
take the least of it); when it gives up, the multiset goes back once more under the bound it proved, and
its second search may use a MILP (HiGHS; an unsettled MILP still proves its dual bound). A multiset left
unsettled keeps that bound, and it stops `complete` only when the bound is at or below the incumbent. Before the
MILP, the packing may be searched bin by bin (`binpack.least_l_bins`: its bound counts the room a closed bin
wastes, which the capacity prices cannot see), as long as that has settled some packing of this walk (or for the
first one). Expansions are keyed by their least memory times the least latency of any multiset below them (each
stage on its fastest option in the multiset or on a profile the expansion may still add), and nothing keyed above
the incumbent is pushed (it would never be popped). Each visited y gives its point (M(y), L(y)) and, when the search's assignment places
(`Problem.check`), a candidate, which uses at most the instances of y, so it is at least as good as every
variant with those instances in (cost, L, new GPUs). Hence when every visited y that could tie the best cost
gave a placed candidate, the best candidate is the optimum, tie-breaks included (`complete`); otherwise, or
at the deadline, the least bound over the points and the unvisited multisets is a lower bound of every
variant of the workflow.

A FAN (`fan_group`: a path, then two or more LLM stages side by side, then a path; the hard family `wide_fan`, whose
MILP walk took 0.3-1 s a solve and left 8 of 60 fresh instances unproven at 2 s with gaps of 16-30%) is walked the
same way (under GPU sharing too, its multisets placed by `sharing_chain` as a chain's): its L is the path stages' sum
plus the largest parallel latency, so every sum
above becomes that (`agg`), and the Lagrangian bound takes the best path through the fan (for any path P and prices
mu >= 0, L >= sum over P of min_o (lat + mu load) + sum over the other stages of min_o (mu load) - the penalty).
Its least L(y) is the least over thresholds T of T + the least path sum with every parallel stage on an option no
slower than T: the chain's question, with those options counted as 0 (`least_l_fan`).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from flowmaker.selection.binpack import Bin, least_l_bins, least_l_classes, max_fill
from flowmaker.selection.clones import IMAGE_SLACK
from flowmaker.selection.patterns import enumerate_patterns, exact_cover, knapsack
from flowmaker.selection.problem import INF, NEW, REUSE, Problem, PWorkflow, better, leq
from flowmaker.selection.sharing_alone import ALONE_NODES, walk_floor
from flowmaker.selection.sharing_chain import PLACED_WORK, multiset_bound, placed_cheap, placed_value

if TYPE_CHECKING:
    from flowmaker.selection.clones import AggregatedModel, Images
    from flowmaker.selection.milp import Front, RelaxedModel

# Multisets (and expansions) the walk may hold: each is a tuple as long as the profiles. Measured under sharing on 180
# fresh chain_clones: every walk that proved its instance held at most 3,440; two that found nothing held 169,000 and
# 301,000 at 2 s (330 MB; 820 MB at 10 s), and freeing them took 0.2 s past the deadline.
CHAIN_HEAP = 100_000
CHAIN_PREPS = 10  # Lagrangian bounds (one small LP each) per multiset the walk may search
# Nodes (its packing oracle's included) of the class search (`binpack.least_l_classes`) of a multiset's first
# packing, and of its second, before the MILP. Measured on chain_clones (60 instances each of seeds 411000, 420000,
# 430000, 457000, within 1 s): 20,000 first proves 1-2 more per seed than 5,000, 50,000 no more; 60,000 second
# 2-3 fewer than 200,000. The class search settles in 0.003-0.4 s packings that HiGHS takes 0.1-2 s on.
CLASS_NODES = 20_000
CLASS_NODES_MORE = 200_000
SINGLE_BIN_NODES = 4_000  # the same when every class is one instance (the bin-by-bin search's former limit)
SHARING_CLASS_NODES = 20_000  # the same under GPU sharing (`least_l_sum`; it was SINGLE_BIN_NODES)
FLOOR_NODES = 50  # HiGHS nodes of the least-L MILP under the walk's floors (0: no floors)
# GPU sharing: the floor of `sharing_alone` under a chain walk's keys (its LP; its MILP when the LP's floor is within
# ALONE_MILP_GAP of the latency target. Once the MILP stopped at its first integer point it proves or gives up in
# 0.02-0.3 s where its root took 0.2-1.3 s, so the gap went from 0.02 to 0.1: chain_clones 1759006, whose LP floor is
# 6.3% under the target, is proven infeasible in 0.3 s; no answer after 264 s before)
ALONE = True
ALONE_MILP_GAP = 0.1
# When a walk with no incumbent finds nothing in BLIND_POPS steps (often no variant exists then): the MILP again within
# BLIND_PLAIN_GAP of the target, then the floor with a chain's final-load rows (`sharing_alone._convex_rows`;
# BLIND_CONVEX), its MILP within ALONE_MILP_GAP_BLIND. Measured on 1,140 held-out chain_clones under sharing, 2 s
# budget: with the first MILP within 0.3 and no plain MILP here, 1,055 proven within 1 s; as here, 1,059 (1861010 and
# 1879047, both feasible, spent 0.8 s and 0.4 s at the start in MILPs that proved nothing; a walk that finds a
# variant within 200 steps never reaches this point). The final-load rows: chain_clones 1721041 and 1759017 proven
# infeasible by their LP, 1723020 and 1787041 by their MILP, whose LP floors are 3.8% and 0.2% under the target; with
# that MILP within 0.3, 1787028's (5.6%) took 0.5 s and proved nothing.
ALONE_MILP_GAP_BLIND = 0.05
BLIND_PLAIN_GAP = 0.3
BLIND_POPS = 200
BLIND_CONVEX = True
UNSETTLED_PLACED = True  # GPU sharing: a multiset whose packing MILP gave up goes to `placed_value`
PLACED_FIRST = True  # GPU sharing: `placed_cheap` before a multiset's packing (`settle`)
FLOOR_PRESOLVE = False  # HiGHS presolve took 0.7-1 s on large sharing models (chain_clones 757008: 0.06 s without)
# A dive: every DIVE_EVERY pops, at most DIVES times a walk, the waiting multiset of least bound has its packing
# searched out of turn, without the HiGHS probe (`dive`). The walk orders multisets by bound, and where thousands of
# near-identical clone multisets share a bound it prices them all before it packs one, so its incumbent fell only
# once the optimum was nearly proven. Measured on chain_clones (`bench selector --section hard`, 6 seeds): the largest
# gap at 2 s fell from 12.5-19.1% to 2.3-9.8% on three seeds, the same proven answers; unbounded dives (every 50 pops,
# with the probe, 0.5-1 s on some packings) had cost other instances their bound (701000's median 7.1% -> 15.9%).
DIVE_EVERY = 50
DIVES = 20
CHEAP_FIRST = True  # a multiset's first bound uses the last LP's prices; its own LP comes when it is popped again
BIN_NODES = 80_000  # nodes of the bin-by-bin search (`binpack`) of a packing before its MILP (0: none)
BIN_TRIES = 1  # packings searched so before the first that it settles; none after, unless one was settled
MILP_GAP = 0.0  # solved to optimality: the walk's tie-break argument needs the least L of every multiset
MILP_SYMMETRY = False  # order the identical bins by load in the MILP (measured on chain_clones packings: without
# these rows HiGHS (its own symmetry detection) settled 6 of 8 packings that took 0.9-1.5 s or were left open with
# them, in 0.1-1.0 s; one infeasibility proof took 0.56 s instead of 0.45 s)
MILP_QUICK_NODES = 50  # HiGHS nodes for a packing whose first search saw no assignment (0: wait for its MILP)
# HiGHS' RINS and RENS heuristics (sub-MIPs) in a packing's MILP. Off: on chain_clones packings they took a third of
# a solve (1019020's reuse-only packing: 0.38 of 1.15 s) and the solves that settle do so without them; 26 packings
# of chain_clones seeds 1019000 and 411000 took 13.7 s instead of 19.3 s, the same 11 settled. End to end (sixteenth
# session) the same instances proven within 1 s on two fresh seeds (589/600), 597 within 2 s instead of 595.
MILP_SUBMIPS = False
HIGHS_TIME_SHARE = 0.5  # of the time left to the deadline, what a packing MILP may take (HiGHS overruns its limit)
# HiGHS' dual bound of a packing, lowered by this share before it bounds anything: against the float difference
# between HiGHS' sum of a packing's latencies and the from-scratch one (tens of terms: some 1e-15). A tenth of the
# spec's tie tolerance, so that the multiset of the best variant, settled at its cost, is seen to hold no better one
# (`sharing_chain.tie_break`); at 1e-12 the two margins met and a sum 2.5e-16 apart sent chain_clones 1543000,
# 1549017 and 1553005 to search that multiset again for their whole budget.
DB_MARGIN = 1e-13
MILP_NODES = 3_000  # branch-and-bound nodes of HiGHS for one packing; past it the multiset keeps its bound
# (measured on fresh chain_clones instances: 500 left packings of a single new instance unsettled that 3,000 settle)
# A packing the class search gave up on goes to the pattern bound first (`_least_l_patterns`; PATTERNS = False: straight
# to HiGHS): column generation for at most PAT_ITERS master LPs, knapsacks of PAT_KNAP_NODES nodes, at most PAT_MOST
# patterns within the gap, an exact cover of PAT_COVER_NODES nodes; past any of these the MILP takes over. Measured on
# the chain_clones packings HiGHS took 0.4-12.6 s on (seeds 1123000-1163000): 0.04-1 s, most under 0.3 s.
PATTERNS = True
# Under GPU sharing only once the class search gave up (PATTERNS_SHARING), not as the probe of a packing the search saw
# no assignment of: there a packing's least L is only the walk's relaxation, and the probe's HiGHS call is cheaper
# (measured with it on, 360 chain_clones under sharing: 340 -> 338 within 1 s; 1579038 0.64 -> 1.84 s). After the
# class search, packings of 20-30 rows took HiGHS 1,000-2,400 nodes (chain_clones 1721041: 0.3-0.56 s each) that the
# pattern bound settles in 15-40 ms: six held-out seeds x 60 of every family (1,800, 2 s budget, in one process)
# 1,766 -> 1,768 within 1 s (1709041, 1723018, 1747035 proven in 0.4-0.6 s; 1723012 0.96 s -> unproven), the 360
# chain_clones 340 either way; the adversarial `reuse` 1 keeps its bound (699.1: when this was first tried, at 1071000,
# it fell to 651).
PATTERNS_SHARING = True
# Over groups of clones (`clones`), packings go to HiGHS too (False: a packing the searches and the pattern route leave
# open keeps its bound: measured, chain_clones 1249013 spent 1.7 of its 2 s in two such MILPs of the walk over groups,
# neither settled, and the walk over profiles got none)
CLONE_MILPS = False
PAT_ITERS = 80
PAT_KNAP_NODES = 20_000
PAT_MOST = 4_000
PAT_COVER_NODES = 20_000
# Past PAT_MOST patterns within the whole gap, the pattern route widens its slack from PAT_SLACK0 (relative to the
# bound), times PAT_WIDEN a round, while the patterns stay within PAT_WIDEN_MOST (a cover search over more took 0.3-0.5
# s a round) and each cover search within PAT_WIDEN_NODES nodes.
PAT_SLACK0 = 1e-5
PAT_WIDEN = 2.0
PAT_WIDEN_MOST = 2_500
PAT_WIDEN_NODES = 5_000


def is_chain(pw: PWorkflow) -> bool:
    """The stages form one path (each has at most one predecessor and at most one successor, one root)."""
    n = len(pw.wf.stages)
    roots = sum(1 for v in range(n) if not pw.preds[v])
    if roots != 1 or any(len(pw.preds[v]) > 1 for v in range(n)):
        return False
    succ = [0] * n
    for v in range(n):
        for p in pw.preds[v]:
            succ[p] += 1
    return all(c <= 1 for c in succ)


def fan_group(pw: PWorkflow) -> frozenset[int] | None:
    """The parallel stages of a FAN workflow, None for any other shape: a path of stages, then two or more LLM stages
    side by side (each with the path's last stage as its only predecessor, or none when the path is empty), then a
    path whose first stage has exactly those stages as predecessors (or none). Its latency is the sum of the path
    stages' plus the largest of the parallel stages': the walk below needs only that."""
    n = len(pw.wf.stages)
    sig: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for v in range(n):
        sig.setdefault((tuple(sorted(pw.preds[v])), tuple(sorted(pw.succs[v]))), []).append(v)
    groups = [vs for vs in sig.values() if len(vs) >= 2]
    if len(groups) != 1:
        return None
    g = groups[0]
    gs = frozenset(g)
    if any(not pw.wf.stages[v].is_llm for v in g):
        return None
    pre, suc = tuple(sorted(pw.preds[g[0]])), tuple(sorted(pw.succs[g[0]]))
    if len(pre) > 1 or len(suc) > 1:
        return None
    for v in range(n):
        if v in gs:
            continue
        ps, ss = set(pw.preds[v]), set(pw.succs[v])
        if pre and v == pre[0]:
            if ss != gs or len(ps) > 1:
                return None
        elif suc and v == suc[0]:
            if ps != gs or len(ss) > 1:
                return None
        elif len(ps) > 1 or len(ss) > 1 or ps & gs or ss & gs:
            return None
    roots = sum(1 for v in range(n) if not pw.preds[v])
    sinks = sum(1 for v in range(n) if not pw.succs[v])
    if roots != (1 if pre else len(g)) or sinks != (1 if suc else len(g)):
        return None
    return gs


def _least_live(heap: list[Any], live: Callable[[Any], bool]) -> float:
    """The least key of a live entry of `heap` (a heapq list of tuples keyed by their first element; INF: none), in
    heap order from its root, without changing it: the entries above the first live one only (a walk that ran to its
    deadline held 283,000 entries, and a scan of them all ran past the deadline: chain_clones 1499007)."""
    todo = [(heap[0][0], 0)] if heap else []
    while todo:
        k, j = heapq.heappop(todo)
        if live(heap[j]):
            return float(k)
        for c in (2 * j + 1, 2 * j + 2):
            if c < len(heap):
                heapq.heappush(todo, (heap[c][0], c))
    return INF


def walk_chain(model: RelaxedModel | AggregatedModel, deadline: float, best: tuple[float, float, int] | None,
               max_points: int = 0, max_milps: int = 0, images: Images | None = None) -> Front:
    """The front of a chain workflow (module docstring); `model` is its `milp.RelaxedModel` (options,
    packing into slots and `realize`). Returns a `milp.Front` whose `complete` means proven as described.

    `model` may be a `clones.AggregatedModel` (`relaxed`): the walk over groups of clones, whose points only bound
    (no tie-break argument, `exact_ties` False), with thresholds IMAGE_SLACK above the incumbent; `images_complete`
    then says whether every multiset that could beat the incumbent was settled. `images` (from such a walk): the
    multisets whose image cannot beat the incumbent are not pushed, and the others' keys are at least their
    image's bound."""
    from flowmaker.selection.milp import CHAIN_NODES, CHAIN_POINTS, _tol
    from flowmaker.selection.milp import Front as Front_

    relaxed = getattr(model, "relaxed", False)
    slack = IMAGE_SLACK if relaxed else 1e-9  # how far above the incumbent a bound is still looked at
    fr = Front_()
    fr.exact_ties = not relaxed
    settled: dict[tuple[int, ...], float] = {}
    fr.settled = settled
    if not model.ok:
        fr.lower_bound, fr.complete = INF, True
        return fr
    pb, pw = model.pb, model.pw
    opts = model.opts
    llm = sorted(pw.llm, key=lambda s: -pw.load[s])
    tool = sum(pw.tool_lat[v] for v in range(len(pw.wf.stages)) if not pw.wf.stages[v].is_llm)
    # A fan (`fan_group`): L = the path stages' latencies summed + the largest of the parallel stages'. `agg` is
    # that of per-stage figures (positions in `llm`); a chain keeps its plain sums below, in their order.
    fan = fan_group(pw) if not is_chain(pw) else None
    gpos = [j for j, s_ in enumerate(llm) if fan is not None and s_ in fan]
    gset = frozenset(gpos)
    spos = [j for j in range(len(llm)) if j not in gset]

    def agg(v: list[float]) -> float:
        return sum(v[j] for j in spos) + max(v[j] for j in gpos)
    profs = sorted({ref for s in llm for k, ref, _ in opts[s] if k == NEW})
    pos = {pi: i for i, pi in enumerate(profs)}
    mem = [pb.p_mem[pi] for pi in profs]
    cap = [pb.p_cap[pi] for pi in profs]
    users = [sum(1 for s in llm if any(k == NEW and ref == pi for k, ref, _ in opts[s])) for pi in profs]
    reuse_lat = [min((lat for k, _, lat in opts[s] if k == REUSE), default=INF) for s in llm]
    lmin_all = tool + (agg([min(lat for _, _, lat in opts[s]) for s in llm]) if gpos
                       else sum(min(lat for _, _, lat in opts[s]) for s in llm))
    spare = {r: pb.p_cap[pb.r_prof[r]] - pb.r_load0[r] for s in llm for k, r, _ in opts[s] if k == REUSE}
    # the room of a running instance as `leq(load0 + fill + load, capacity)` admits it: what a bound may count (an
    # infeasible pricing LP drops the multiset, so its rooms must not be smaller than the checks')
    # ... cut to what subsets of the stages that may use it can fill (binpack.max_fill, an upper bound of every
    # fill that fits); a new profile's y instances likewise, each and together (memoized per count)
    elig: dict[tuple[str, int], list[float]] = {}  # the loads of the stages that may use each class
    for s in llm:
        for k, ref in {(k, ref) for k, ref, _ in opts[s]}:
            elig.setdefault((k, ref), []).append(pw.load[s])
    room_r = {r: max_fill(tuple(sorted(elig[(REUSE, r)], reverse=True)), _tol(pb.p_cap[pb.r_prof[r]]) - pb.r_load0[r])
              for r in spare}
    elig_p = {pi: tuple(sorted(elig[(NEW, pi)], reverse=True)) for pi in profs}
    one_p = {pi: max_fill(ws, _tol(pb.p_cap[pi])) for pi, ws in elig_p.items()}
    room_p: dict[tuple[int, int], float] = {}

    def room_new(pi: int, c: int) -> float:
        """The room of c new instances of profile pi that the stages can fill."""
        got = room_p.get((pi, c))
        if got is None:
            full = c * _tol(pb.p_cap[pi])
            got = room_p[(pi, c)] = min(full, c * one_p[pi], max_fill(elig_p[pi], full) if c > 1 else full)
        return got

    # Floors under every multiset's key, from the relaxation (`milp.RelaxedModel`): the least L of any variant,
    # capacity counted (its MILP for a few HiGHS nodes: the dual bound holds when unsettled), and the least new
    # memory (its LP relaxation: milliseconds). Lfast ignores capacity and a small multiset may hold no variant at
    # all (measured: chain_clones 701032, whose walk spent its 2 s pricing multisets of 90-114 GB when every variant
    # needs 114.4 GB: its bound at 2 s rose from 2,318 to 2,737, what the walk had reached after 60 s). A multiset
    # below the memory floor is not pushed. Either proven infeasible: no variant at all (measured: chain_clones 613004,
    # which no variant meets, took 11 s of walk to end unsettled; the least-L MILP proves it in 12 ms).
    # Under GPU sharing the LP relaxation has the compute-room rows (`milp.RelaxedModel`), which the MILP leaves out
    # (its nodes cost several times as much with them): the LP alone proves that the cluster's idle compute cannot hold
    # the chain (measured: chain_clones 757004 under sharing, no answer after 60 s before, proven in 0.3 s).
    l_floor = m_floor = 0.0
    if FLOOR_NODES:
        m_floor = model.least_memory_lp()
        st_f, l_db = "infeasible", INF
        if m_floor < INF:
            with model.without_share_rows():
                st_f, l_db, _ = model._solve("L", INF, _tol(pb.lam), deadline, FLOOR_NODES, FLOOR_PRESOLVE)
        if st_f == "infeasible":
            fr.lower_bound, fr.complete = INF, True
            return fr
        if math.isfinite(l_db):
            l_floor = max(0.0, l_db) * (1 - 1e-9)
    if pb.sharing and ALONE and not relaxed:
        # GPU sharing: the floor from how few new instances can run alone (`sharing_alone`): its LP, then (when that
        # comes within ALONE_MILP_GAP of the target) a few MILP nodes. INF proves that no variant exists (measured
        # on eight seeds of the hard families under sharing: 14 of the 24 instances that had no answer within 2 s,
        # now proven infeasible in 0.1-0.4 s).
        if fan is None:
            a_f = walk_floor(pb, pw, opts, tool, deadline, ALONE_MILP_GAP, ALONE_NODES)
        else:  # a fan: the DAG's floor (its paths count the TOOL stages), as the MILP walk takes it
            from flowmaker.selection.milp import ALONE_MILP_GAP_DAG
            a_f = walk_floor(pb, pw, opts, 0.0, deadline, ALONE_MILP_GAP_DAG, ALONE_NODES)
        if a_f == INF:
            fr.lower_bound, fr.complete = INF, True
            return fr
        l_floor = max(l_floor, a_f)
        rm: Any = model  # a RelaxedModel here (not `relaxed`): the MILP walk after this one solves within it too
        rm.l_floor = max(rm.l_floor, a_f)
    lmin_all = max(lmin_all, l_floor)
    total_load = sum(pw.load[s] for s in llm)
    n_llm = len(llm)
    P = len(profs)
    suffix_min_mem = [min(mem[i:], default=INF) for i in range(P)] + [INF]
    # the least memory per unit of capacity of a profile >= q: what the capacity a multiset still lacks costs at least
    suffix_min_ratio = [min((m_ / c_ for m_, c_ in zip(mem[i:], cap[i:], strict=True) if c_ > 0), default=INF)
                        for i in range(P)] + [INF]

    def fast(y: tuple[int, ...]) -> float:
        bs = []
        for j, s in enumerate(llm):
            b = reuse_lat[j]
            for k, ref, lat in opts[s]:
                if k == NEW and y[pos[ref]] and lat < b:
                    b = lat
            if b == INF:
                return INF
            bs.append(b)
        if gpos:
            return tool + agg(bs)
        t = tool
        for b in bs:  # a chain: summed in stage order, onto the TOOL stages' time
            t += b
        return t

    m_memo: dict[tuple[int, ...], float] = {}

    def m_key(m: float) -> float:
        """The memory a key or point counts for a multiset of memory m: m itself; over groups of clones (`relaxed`)
        at least the floor, which bounds every variant's memory while m only bounds its image's."""
        return max(m, m_floor) if relaxed else m

    def m_of(y: tuple[int, ...]) -> float:
        m = m_memo.get(y)
        if m is None:
            m = m_memo[y] = sum(mem[i] * c for i, c in enumerate(y))
        return m

    # Each stage's options, fastest first (a stable sort: options of equal latency keep their order), once: a
    # multiset's usable options are these filtered, in the same order.
    by_lat = [sorted(((lat, k, ref) for k, ref, lat in opts[s]), key=lambda o: o[0]) for s in llm]
    def usable(y: tuple[int, ...]) -> list[list[tuple[float, str, int]]]:
        """Each stage's options usable with y: a running instance, or a profile y has; fastest first."""
        return [[o for o in ol if o[1] == REUSE or y[pos[o[2]]]] for ol in by_lat]

    Prep = tuple[list[list[tuple[float, str, int]]], dict[tuple[str, int], float], float]
    preps: dict[tuple[int, ...], Prep | None] = {}

    def prep(y: tuple[int, ...]) -> Prep | None:
        """Per multiset (cached): each stage's options usable with y (fastest first), the Lagrangian prices,
        and the Lagrangian bound of every assignment that fits y (the root bound). None: some stage has no
        option."""
        if y in preps:
            return preps[y]
        so = usable(y)
        if not all(so):
            preps[y] = None
            return None
        # Lagrangian prices of the aggregated capacities (the LP's duals): for any prices mu >= 0,
        # L >= part + sum_j min_o (lat + mu_o * load_j) - sum_c mu_c * (room left in c).
        room = {(REUSE, r): room_r[r] for r in spare}
        room.update({(NEW, pi): room_new(pi, y[pos[pi]]) for pi in profs if y[pos[pi]]})
        mu = pricer.prices(room)
        if mu is None:  # not even a fractional assignment fits these capacities: no assignment fits y
            preps[y] = None
            return None
        known_mu.update(mu)
        pen0 = sum(mu.get(c, 0.0) * room[c] for c in room)
        if gpos:
            fastest, priced = agg([o[0][0] for o in so]), lag_fan(so, mu)
        else:
            fastest = sum(o[0][0] for o in reversed(so))
            priced = sum(min(lat + mu.get((k, ref), 0.0) * pw.load[s_] for lat, k, ref in o)
                         for s_, o in zip(reversed(llm), reversed(so), strict=True))
        got: Prep = (so, mu, max(fastest, priced - pen0) + tool)
        preps[y] = got
        return got

    def lag_fan(so: list[list[tuple[float, str, int]]], mu: dict[tuple[str, int], float]) -> float:
        """A fan's Lagrangian sum, before the capacity penalty: for every path P through it and prices mu >= 0,
        L >= sum over P's stages of min_o (lat + mu load) + sum over the others of min_o (mu load) - penalty (each
        stage's priced load counts, only P's latencies do); the largest over the paths is taken."""
        a_ = [min(lat + mu.get((k, ref), 0.0) * pw.load[llm[j]] for lat, k, ref in o) for j, o in enumerate(so)]
        b_ = [min(mu.get((k, ref), 0.0) * pw.load[llm[j]] for _, k, ref in o) for j, o in enumerate(so)]
        return sum(a_[j] for j in spos) + sum(b_[j] for j in gpos) + max(a_[j] - b_[j] for j in gpos)

    # Each class's price in the latest LP that priced it. Before (the last LP's prices only), a clone the last LP did
    # not price got 0 and the bound ignored its capacity, so thousands of near-identical multisets waited for their
    # own LP (measured: chain_clones 1093016, 9,276 LPs in 7 s; with these prices 2,175, proven in 2.9 s; at 2 s the
    # largest gaps of three seeds' chain_clones fell from 20.6%, 11.3% and 5.4% to 1.5%, 3.2% and 5.2%).
    known_mu: dict[tuple[str, int], float] = {}
    pricer = _Pricer([[(lat, k, ref) for k, ref, lat in opts[s]] for s in llm], [pw.load[s] for s in llm])

    def cheap(y: tuple[int, ...]) -> float:
        """A Lagrangian bound of the L of every assignment that fits y, with the known prices (any prices >= 0 give
        one; a class no LP priced yet gets 0): no LP, so that a multiset it lifts above the incumbent or the latency
        target costs no LP."""
        mu = known_mu
        if gpos:
            so_y = usable(y)
            if not all(so_y):
                return INF
            pen = sum(mu.get((REUSE, r), 0.0) * room_r[r] for r in spare)
            pen += sum(mu.get((NEW, pi), 0.0) * room_new(pi, y[pos[pi]]) for pi in profs if y[pos[pi]])
            return tool + max(agg([o[0][0] for o in so_y]), lag_fan(so_y, mu) - pen)
        plain = lag = 0.0
        for s_ in llm:
            ld = pw.load[s_]
            b0 = bl = INF
            for k, ref, lat in opts[s_]:
                if k == NEW and not y[pos[ref]]:
                    continue
                if lat < b0:
                    b0 = lat
                v = lat + mu.get((k, ref), 0.0) * ld
                if v < bl:
                    bl = v
            if b0 == INF:
                return INF
            plain += b0
            lag += bl
        pen = sum(mu.get((REUSE, r), 0.0) * room_r[r] for r in spare)
        pen += sum(mu.get((NEW, pi), 0.0) * room_new(pi, y[pos[pi]]) for pi in profs if y[pos[pi]])
        return tool + max(plain, lag - pen)

    def least_l(y: tuple[int, ...], cap_l: float, use_milp: bool
                ) -> tuple[float, list[tuple[str, int, int]] | None, bool]:
        """Least L <= cap_l of an assignment that fits y exactly: (L, per stage (kind, ref, bin), True). When
        the search gives up (the class search's nodes, then the MILP if `use_milp`): (a lower bound of that least
        L, the best assignment found or None, False)."""
        pr = prep(y)
        if pr is None:
            return INF, None, True
        so, mu, root = pr
        if gpos:
            return least_l_fan(y, so, mu, cap_l, use_milp)
        return least_l_sum(y, so, mu, root, cap_l, use_milp)

    def least_l_fan(y: tuple[int, ...], so: list[list[tuple[float, str, int]]], mu: dict[tuple[str, int], float],
                    cap_l: float, use_milp: bool) -> tuple[float, list[tuple[str, int, int]] | None, bool]:
        """`least_l` of a fan: L = T + the least sum of the path stages' latencies when every parallel stage runs on
        an option no slower than T, least over the thresholds T (the parallel options' latencies, in increasing
        order, while T + the path stages' fastest can still beat the best so far). Each threshold is the chain's
        question (`least_l_sum`) with the parallel stages' options of latency <= T counted as 0. Settled when every
        threshold that could beat the best is; otherwise the least of the best and the unsettled thresholds' bounds
        is a lower bound."""
        t0 = max(so[j][0][0] for j in gpos)
        path_fast = sum(so[j][0][0] for j in spos)
        ts = sorted({lat for j in gpos for lat, _, _ in so[j] if lat >= t0})
        best_l, best_a = INF, None
        open_b = INF  # least bound of the thresholds left unsettled
        seen_a: list[tuple[str, int, int]] | None = None  # an assignment that fits, from an unsettled threshold
        root_t = tool + path_fast  # every threshold's path sum is at least its fastest
        for t in ts:
            lim = min(cap_l, best_l)
            if tool + path_fast + t > lim or (best_l < INF and tool + path_fast + t >= best_l):
                break
            so_t = [[(0.0, k, ref) for lat, k, ref in so[j] if lat <= t] if j in gset else so[j]
                    for j in range(len(so))]
            got = least_l_sum(y, so_t, mu, root_t, lim - t, use_milp)
            if got[2]:
                if got[1] is not None and got[0] + t < best_l:
                    best_l, best_a = got[0] + t, got[1]
            else:
                open_b = min(open_b, got[0] + t)
                if got[1] is not None and seen_a is None:
                    seen_a = got[1]
            if time.perf_counter() > deadline:
                open_b = min(open_b, tool + path_fast + t)  # the thresholds left: at least this
                break
        if open_b == INF:
            return (best_l, best_a, True) if best_a is not None else (cap_l, None, True)
        return min(best_l, open_b), best_a if best_a is not None else seen_a, False

    def pat_classes(y: tuple[int, ...], so: list[list[tuple[float, str, int]]]) -> list[tuple[str, int, int, float]]:
        """The packing's classes for `_least_l_patterns`, with the limits the MILP's capacity rows state."""
        from flowmaker.selection.milp import _tol

        return [(k, ref, 1, _tol(pb.p_cap[pb.r_prof[ref]]) - pb.r_load0[ref]) if k == REUSE
                else (k, ref, y[pos[ref]], _tol(pb.p_cap[ref]))
                for k, ref in sorted({(k, ref) for o in so for _, k, ref in o})]

    def least_l_sum(y: tuple[int, ...], so: list[list[tuple[float, str, int]]], mu: dict[tuple[str, int], float],
                    root: float, cap_l: float, use_milp: bool
                    ) -> tuple[float, list[tuple[str, int, int]] | None, bool]:
        """`least_l` of a chain (the sum of its stages' latencies), for these options per stage."""
        classes = sorted({(k, ref) for o in so for _, k, ref in o})
        bl: list[Bin] = [(k, ref, 0, pb.r_load0[ref], pb.p_cap[pb.r_prof[ref]]) if k == REUSE
                         else (k, ref, b, 0.0, pb.p_cap[ref])
                         for k, ref in classes for b in (range(1) if k == REUSE else range(y[pos[ref]]))]
        loads = [pw.load[s] for s in llm]
        # Without two identical new instances there is no symmetry for the class search to skip: it is the bin
        # search then, and HiGHS settles such packings (most often reuse only) faster than a long search does
        # (measured on the adversarial `reuse` family: 0.8-1.0 s with the long search, 0.2-0.4 s without). Under
        # GPU sharing the least L of a packing is only the walk's relaxation (`sharing_chain` settles a multiset
        # once placed), so a long search buys little there too (adversarial `chain15` 3: 1.7 s unproven with it,
        # proven in 0.5 s without); 20,000 nodes of the compiled search settle packings that HiGHS takes 0.5-1 s over
        # (chain_clones under sharing, 2 s budget: 338 -> 340 of 360 within 1 s on six seeds, 880 -> 882 of 900 on
        # three new seeds of every family; 1597015, 1601037 and 1607024 unproven -> proven in 0.3-0.4 s).
        nodes = CLASS_NODES_MORE if use_milp else CLASS_NODES
        if pb.sharing:
            nodes = min(nodes, SHARING_CLASS_NODES)
        elif all(y[pos[ref]] <= 1 for k, ref in classes if k == NEW):
            nodes = min(nodes, SINGLE_BIN_NODES)
        got_c = least_l_classes(so, loads, bl, mu, tool, cap_l, nodes, deadline)
        work[0] += got_c[3]
        if got_c[2]:
            return got_c[0], got_c[1], True
        best_a: list[list[tuple[str, int, int]] | None] = [got_c[1]]
        best_l = [tool + _lat_of(so, got_c[1]) if got_c[1] is not None else INF]

        def keep(a: list[tuple[str, int, int]] | None) -> None:
            """A candidate assignment that fits y: kept when it is the fastest seen."""
            if a is not None and (best_a[0] is None or tool + _lat_of(so, a) < best_l[0]):
                best_a[0], best_l[0] = a, tool + _lat_of(so, a)

        bound = min(root, cap_l)
        if best_a[0] is None and not use_milp and MILP_QUICK_NODES and not diving[0]:
            # The search saw no assignment at all: most often none fits (the stages do not pack into these bins),
            # which HiGHS proves at its root while the search would spend its nodes again when the multiset comes
            # back (measured on chain_clones: 43 such packings, each infeasible at HiGHS' first node).
            if PATTERNS and not pb.sharing:
                got = _least_l_patterns([pw.load[s] for s in llm], so, pat_classes(y, so), tool, cap_l, deadline)
                if got is not None:
                    return got
            got = _least_l_milp(pb, [pw.load[s] for s in llm], so, y, profs, pos, tool, cap_l, deadline,
                                MILP_QUICK_NODES) if not relaxed or CLONE_MILPS else None
            if got is not None and got[2]:
                milps[0] += 1
                return got
            if got is not None:
                bound = max(bound, got[0])
                keep(got[1])  # HiGHS' best assignment so far, if it found one
        if best_a[0] is None:  # no assignment seen: first fit, heaviest stage first, fastest option first
            keep(_first_fit(so, [pw.load[s] for s in llm], y, pos,
                            {r: pb.p_cap[pb.r_prof[r]] - pb.r_load0[r] for r in spare}, pb.p_cap))
        if use_milp and BIN_NODES and not pb.sharing and (bins_tried[0] < BIN_TRIES or bins_won[0]):
            # The class search gave up twice: bin by bin (`binpack`), whose bound sees the room a packing
            # wastes, before the MILP, for as long as that settles some packings (measured on chain_clones: it
            # settles in 0.1 s packings that HiGHS leaves open after 1 s, and on other instances it settles
            # none of those that HiGHS settles in 5 ms; counted in work, never in time). Not under GPU sharing, where
            # a packing's least L is only the walk's relaxation, as for the class search's long limit above (measured on
            # the adversarial `chain15` 3: its one bin-by-bin search gave up after 80,000 nodes, 0.25 s; without it
            # proven in 0.90 s instead of 1.09 s; hard families under sharing, seed 941000: the same proven answers).
            bins_tried[0] += 1
            got_b = least_l_bins(so, [pw.load[s] for s in llm], bl, mu, tool, cap_l, BIN_NODES, deadline)
            work[0] += got_b[3]
            if got_b[2]:
                bins_won[0] += 1
                return got_b[0], got_b[1], True
            keep(got_b[1])
        if use_milp and PATTERNS and (PATTERNS_SHARING or not pb.sharing):  # the class search gave up: patterns first
            got = _least_l_patterns([pw.load[s] for s in llm], so, pat_classes(y, so), tool, cap_l, deadline)
            if got is not None:
                return got
        if use_milp and (not relaxed or CLONE_MILPS):  # the same question as a MILP (HiGHS)
            milps[0] += 1
            got = _least_l_milp(pb, [pw.load[s] for s in llm], so, y, profs, pos, tool, cap_l, deadline)
            if got is not None and got[2]:
                return got
            if got is not None:
                bound = max(bound, got[0])
                keep(got[1])
        return bound, best_a[0], False

    inc = best[0] if best else INF
    diving = [False]  # a dive's packing skips the HiGHS probe (0.5-1 s on some packings: a dive must stay cheap)
    lb = INF
    unsettled = INF  # least bound of the multisets whose packing was left open
    unplaced = INF  # least point value among multisets whose assignment did not place
    y0 = tuple([0] * P)
    heap: list[tuple[float, int, tuple[int, ...], int, bool]] = []
    tick = 0
    work = [0]  # search nodes of every multiset so far
    milps = [0]  # packings solved as MILPs so far
    bins_tried, bins_won = [0], [0]  # packings searched bin by bin before their MILP, and settled so

    spare_all = sum(spare.values())
    # lat_new[q][j]: stage j's fastest option on a new instance of profile q (INF: none), for Lfast by increments
    lat_new = [[INF] * n_llm for _ in range(P)]
    for j, s_ in enumerate(llm):
        for k, ref, lat in opts[s_]:
            if k == NEW and lat < lat_new[pos[ref]][j]:
                lat_new[pos[ref]][j] = lat

    # sufmin_lat[q][j]: stage j's fastest option on a new instance of any profile >= q (the expansions of (z, q)
    # add only those): with the fastest options of z, a lower bound of the latency of every multiset below it
    sufmin_lat = [[INF] * n_llm for _ in range(P + 1)]
    for q in range(P - 1, -1, -1):
        sufmin_lat[q] = [min(a, b) for a, b in zip(sufmin_lat[q + 1], lat_new[q], strict=True)]

    lat_arr = np.array(lat_new, dtype=float).reshape(P, n_llm)  # (for `expand`'s sums at once)
    suf_arr = np.array(sufmin_lat, dtype=float).reshape(P + 1, n_llm)

    def _more_mem(q: int, lack: float) -> float:
        """The least memory of a nonempty multiset of profiles >= q whose capacity covers `lack`."""
        m_ = suffix_min_mem[q]
        if lack > 0 and suffix_min_ratio[q] < INF:
            m_ = max(m_, lack * suffix_min_ratio[q])
        return m_

    # Room on the cluster (`milp.room_rows`, valid whatever the placement rule): a multiset beyond one of these rows
    # never places, nor does any multiset above it, so neither is pushed (measured: chain_clones 653027, whose walk
    # spent its whole budget on multisets of six tp8 instances where the cluster holds two).
    rooms = [([pos[pi] for pi in members if pi in pos], cap_) for members, cap_ in model.room]
    reps = [pb.p_reps[pi] for pi in profs]
    room_of: list[list[int]] = [[] for _ in range(P)]  # per profile, the rows it is a member of (ascending)
    for r_, (members, _) in enumerate(rooms):
        for q in dict.fromkeys(members):
            room_of[q].append(r_)

    caps0 = [cap_ for _, cap_ in rooms]
    reps_most = max(reps, default=0)

    def room_left(y: tuple[int, ...]) -> list[int]:
        # by y's few nonzero counts (integers: the same sums in any order), not by every row's members (measured:
        # 0.4 of 1.4 s of a chain walk under sharing, 820 expansions over rows of ~100 members each)
        left = list(caps0)
        for q, c in enumerate(y):
            if c:
                for r_ in room_of[q]:
                    left[r_] -= c * reps[q]
        return left

    def push_eval(y: tuple[int, ...]) -> None:
        nonlocal tick
        m = m_of(y)
        if sum(c * cp for c, cp in zip(y, cap, strict=True)) + spare_all < total_load * (1 - 1e-9):
            return  # cannot hold the load even aggregated
        if m < m_floor and not relaxed:
            return  # below the memory of every variant
        f = max(fast(y), l_floor)
        img_floor = images.floor(tuple(images.of(y))) if images is not None else 0.0
        if f < INF and leq(f, pb.lam) and img_floor < INF:
            tick += 1
            heapq.heappush(heap, (max(m_key(m) * f, img_floor), tick, y, 0, False))

    def push_expand(y: tuple[int, ...], i: int) -> None:
        nonlocal tick
        if i >= P or sum(y) >= n_llm:
            return
        if images is not None and not images.may_grow(tuple(images.of(y))):
            return
        key = max(m_of(y) + _more_mem(i, total_load * (1 - 1e-9) - spare_all), m_floor) * lmin_all
        if key > inc * (1 + slack):
            return  # never popped: the walk stops at the first key above the incumbent (which only falls)
        tick += 1
        heapq.heappush(heap, (key, tick, y, i, True))

    def expand(y: tuple[int, ...], i: int) -> None:
        """Push the multisets z = y + one instance of profile q >= i, and their expansions (z, q). The keys of
        `push_eval`, computed by increments (Lfast(z) = tool + sum over the stages of the least of their fastest
        option in y and on q); an expansion's key is its least memory (z's plus the least of a profile >= q)
        times the least latency of any multiset below it (each stage on its fastest option in z or on a profile
        >= q). A multiset or expansion whose key is above the incumbent is never popped, so it is not pushed."""
        nonlocal tick
        m = m_of(y)
        capsum = sum(c * cp for c, cp in zip(y, cap, strict=True)) + spare_all
        by = list(reuse_lat)
        for q, c in enumerate(y):
            if c:
                by = list(map(min, by, lat_new[q]))
        room_n = sum(y) + 1 < n_llm
        lim = inc * (1 + slack)
        # the profiles one more instance of which some room row refuses (only rows with less room left than the
        # most replicas can refuse any: the same test as each profile's rows, asked of the few tight rows)
        blocked: set[int] = set()
        if rooms:
            for r_, lv in enumerate(room_left(y)):
                if lv < reps_most:
                    blocked.update(q for q in rooms[r_][0] if lv < reps[q])
        img = images.of(y) if images is not None else None
        f_all = fs_all = None
        if not gpos and P - i > 8:
            # a chain: every profile's sums at once, column by column (the same additions in the same order as the
            # sum below, so the same doubles), for the rest of the profiles (measured: 0.3 s of a 1.4 s walk)
            f_v = np.full(P - i, tool)
            s_v = np.full(P - i, tool)
            for j, b_j in enumerate(by):
                f_v = f_v + np.minimum(lat_arr[i:, j], b_j)
                s_v = s_v + np.minimum(suf_arr[i:P, j], b_j)
            f_all, fs_all = f_v.tolist(), s_v.tolist()
        for q in range(i, P):
            if y[q] >= users[q] or q in blocked:
                continue
            mz = m + mem[q]
            if f_all is not None:
                f = f_all[q - i]
            else:
                f = tool + agg(list(map(min, lat_new[q], by))) if gpos else \
                    sum(map(min, lat_new[q], by), tool)  # = tool + each stage's least of by and q, summed in order
            f = max(f, l_floor)
            ok_eval = f < INF and leq(f, pb.lam) and m_key(mz) * f <= lim and (mz >= m_floor or relaxed) \
                and capsum + cap[q] >= total_load * (1 - 1e-9)
            ok_exp = False
            if room_n:
                fs = fs_all[q - i] if fs_all is not None else tool + agg(list(map(min, sufmin_lat[q], by))) if gpos \
                    else sum(map(min, sufmin_lat[q], by), tool)
                kx = max(mz + _more_mem(q, total_load * (1 - 1e-9) - capsum - cap[q]), m_floor) * max(fs, l_floor)
                ok_exp = kx <= lim
            img_floor = 0.0
            if images is not None and img is not None and (ok_eval or ok_exp):  # (images: what the walk over groups left open)
                g = images.gid[q]
                img[g] += 1
                t_img = tuple(img)
                img[g] -= 1
                img_floor = images.floor(t_img)
                ok_eval = ok_eval and img_floor <= lim
                ok_exp = ok_exp and images.may_grow(t_img)
            if not ok_eval and not ok_exp:
                continue
            z = (*y[:q], y[q] + 1, *y[q + 1:])
            if ok_eval:
                tick += 1
                heapq.heappush(heap, (max(m_key(mz) * f, img_floor), tick, z, 0, False))
            if ok_exp:
                tick += 1
                heapq.heappush(heap, (kx, tick, z, q, True))

    unplaceable_seen = [False]  # a multiset whose assignment did not place and that no order places was seen
    never_memo: dict[tuple[int, ...], bool] = {}  # `never_places` per multiset: asked before and after its packing

    def y_insts(y: tuple[int, ...]) -> list[int]:
        """The new instances of y, profile by profile."""
        return [pi for pi, c in zip(profs, y, strict=True) for _ in range(c)]

    def never(y: tuple[int, ...]) -> bool:
        if relaxed:
            return False  # (groups: a representative's placement says nothing of its members')
        got = never_memo.get(y)
        if got is None:
            got = never_memo[y] = never_places(pb, y_insts(y))
        return got

    def settle(key: float, y: tuple[int, ...], i: int) -> None:
        """Search the packing of y (i = 1: the class search; i = 2: again, MILP allowed) and record what it proved:
        its point and candidate, or (gave up) the bound it proved, back in the heap or kept."""
        nonlocal tick, lb, unsettled, unplaced, best, inc
        if i == 1 and unplaceable_seen[0] and any(y) and never(y):
            return  # no variant has exactly these new instances: no packing to search
        m = m_key(m_of(y))
        cap_l = min(_tol(pb.lam), inc * (1 + slack) / m if m > 0 else INF)
        if i == 1 and pb.sharing and PLACED_FIRST and not relaxed and any(y):
            # GPU sharing: the multiset once placed, cheaply (no HiGHS), before its packing is searched: beyond
            # cap_l, no variant with exactly these new instances is within the target or the incumbent
            work[0] += 1
            b_pl = placed_cheap(pb, pw, opts, y_insts(y), tool, cap_l)
            if b_pl > cap_l:
                key_y = tuple(y_insts(y))
                settled[key_y] = min(m * b_pl, settled.get(key_y, INF))  # (a lower bound of its variants' cost)
                return
        L, a, done = least_l(y, cap_l, use_milp=i > 1)
        fr.solves += 1
        if not done:
            if i == 1:
                tick += 1
                heapq.heappush(heap, (max(key, m * L), tick, y, 2, False))
            else:
                if pb.sharing and UNSETTLED_PLACED and not relaxed and any(y) and placed_work[0] > 0:
                    # GPU sharing: its packing MILP gave up too, but the packing's least L is only the multiset's
                    # relaxed value: its placed bounds and search (`placed_value`) may still settle the multiset
                    cand = first = None
                    if a is not None:
                        assign, inst = _packing(a)
                        cand = model.realize(assign, inst)
                        first = _opened(assign, inst)
                    key_y = tuple(y_insts(y))
                    val, cand = placed_value(model, key_y, tool, m * L, cand, inc, cap_l, deadline, placed_work,
                                             first=first)
                    record(y, key_y, val, cand)
                    return
                if pb.sharing and inc < INF:  # the multiset once placed
                    L = max(L, multiset_bound(pb, pw, opts, y_insts(y), tool, cap_l, deadline,
                                                             placed_work))
                lb = min(lb, m * L)  # the search gave up: the multiset keeps the bound it proved
                unsettled = min(unsettled, m * L)
            if a is not None:  # an assignment that fits y, though maybe not the least L: a candidate still
                cand = model.realize(*_packing(a))
                if cand is not None:
                    fr.candidates.append(cand)
                    if better(cand[0][0], cand[0][1], cand[0][2], best):
                        best = cand[0]
                        inc = best[0]
            return
        if a is None:
            return  # nothing fits y within cap_l: every variant with these instances costs more than inc
        val = m * L
        assign, inst = _packing(a)
        cand = model.realize(assign, inst)
        key_y = tuple(y_insts(y))
        if pb.sharing and (cand is None or cand[0][0] > val * (1 + 1e-9)):  # GPU sharing: the multiset once placed
            val, cand = placed_value(model, key_y, tool, val, cand, inc, cap_l, deadline, placed_work,
                                     first=_opened(assign, inst))
        record(y, key_y, val, cand)

    def _packing(a: list[tuple[str, int, int]]) -> tuple[dict[int, tuple[str, int]], dict[int, int]]:
        """A packing's assignment (per LLM stage its option) and its new instances (per such stage its bin)."""
        return ({llm[j]: (k, ref) for j, (k, ref, _) in enumerate(a)},
                {llm[j]: b for j, (k, _, b) in enumerate(a) if k == NEW})

    def _opened(assign: dict[int, tuple[str, int]], inst: dict[int, int]) -> list[int]:
        """The profiles of an assignment's new instances in the order they open."""
        opened: list[tuple[int, int]] = []
        for s_ in pw.llm:
            k_, ref_ = assign[s_]
            if k_ == NEW and (ref_, inst[s_]) not in opened:
                opened.append((ref_, inst[s_]))
        return [ref_ for ref_, _ in opened]

    def record(y: tuple[int, ...], key_y: tuple[int, ...], val: float, cand: Any) -> None:
        """What `settle` proved of multiset y: `val` a lower bound of its variants' costs (their least when settled),
        `cand` its best variant found (None: none)."""
        nonlocal lb, unplaced, best, inc
        settled[key_y] = min(val, settled.get(key_y, INF))
        if cand is None:
            if never(y):
                # No variant has exactly these new instances: the point bounds nothing. Once one such multiset is
                # seen, later ones are checked before their packing is searched (measured: chain_clones 991023,
                # infeasible, spent its 2 s searching the packings of 103 multisets none of which places).
                unplaceable_seen[0] = True
                return
            unplaced = min(unplaced, val)
            lb = min(lb, val)
            return
        lb = min(lb, val)
        fr.candidates.append(cand)
        sc = cand[0]
        if better(sc[0], sc[1], sc[2], best):
            best = sc
            inc = best[0]

    packed: set[tuple[int, ...]] = set()  # multisets whose packing was searched (i = 1), in turn or by a dive
    ready: list[tuple[float, int, tuple[int, ...]]] = []  # multisets with their own bound, waiting for their packing

    def dive() -> None:
        """Search now the packing of the waiting multiset of least bound (a primal step; see DIVE_EVERY). Its heap
        entry is then skipped; what it proves is recorded as in turn (`settle`): bounds and completeness hold."""
        while ready:
            key_r, _, y_r = heapq.heappop(ready)
            if y_r in packed:
                continue
            if key_r > inc * (1 + slack):
                ready.clear()  # every key left is higher, and the incumbent only falls
                return
            packed.add(y_r)
            fr.dives += 1
            diving[0] = True
            try:
                settle(key_r, y_r, 1)
            finally:
                diving[0] = False
            return

    pops = 0
    lam_cap = _tol(pb.lam) * (1 + 1e-12)  # what the packing search's root admits (`least_l`'s cap_l)
    placed_work = [PLACED_WORK]  # GPU sharing: work left to the placed bounds and settling (`sharing_chain`)
    push_eval(y0)
    push_expand(y0, 0)
    stopped = False
    while heap:
        key, _, y, i, is_exp = heap[0]
        if key > inc * (1 + slack):
            break
        if time.perf_counter() > deadline or fr.solves >= (max_points or CHAIN_POINTS) or work[0] > CHAIN_NODES \
                or len(preps) > CHAIN_PREPS * (max_points or CHAIN_POINTS) or (max_milps and milps[0] >= max_milps) \
                or (pb.sharing and fan is not None and placed_work[0] <= 0) or len(heap) > CHAIN_HEAP:
            # the final deadline, or the work this walk may do (a fan under sharing: its placed bounds' work, past
            # which its multisets keep relaxed bounds that their placements fail; the MILP walk and the branch and
            # bound have the rest), or the multisets it holds (CHAIN_HEAP)
            stopped = True
            break
        heapq.heappop(heap)
        pops += 1
        if pops == BLIND_POPS and pb.sharing and ALONE and not relaxed and fan is None and inc == INF \
                and not fr.candidates:
            # GPU sharing, nothing found yet: no incumbent came with the walk and BLIND_POPS of its steps found no
            # variant (measured on 180 chain_clones: the walks that found one did so within 13-101 steps but for
            # two, at 57 and 627). Often no variant exists then, and only a proof answers: the alone floor's MILP,
            # further from the target than at the start, with more nodes
            if (BLIND_PLAIN_GAP and walk_floor(pb, pw, opts, tool, deadline, BLIND_PLAIN_GAP, ALONE_NODES) == INF) or \
                    walk_floor(pb, pw, opts, tool, deadline, ALONE_MILP_GAP_BLIND, ALONE_NODES, convex=BLIND_CONVEX) == INF:
                fr.lower_bound, fr.complete = INF, True
                return fr
        if DIVE_EVERY and pops % DIVE_EVERY == 0 and fr.dives < DIVES:
            dive()
        if is_exp:
            expand(y, i)
            continue
        m = m_of(y)
        # A multiset is evaluated lazily, cheapest bound first: on its first pop (i = 0) it goes back to the
        # heap keyed by a Lagrangian bound with the last LP's prices (no LP; CHEAP_FIRST), on the next (i = 3)
        # keyed by its own Lagrangian bound (capacity counted, unlike the key's), then (i = 1) its packing is
        # searched (class by class); if that search gives up, it goes back keyed by the bound the search proved
        # (i = 2), and by the time it comes up again the incumbent may have fallen below it, or a MILP settles it.
        # A bound of L(y) beyond the latency target drops y there: its packing search would prune at its root (it
        # is the same Lagrangian bound), and no variant with exactly these new instances meets the target (measured:
        # chain_clones 1093016, whose optimum's L is within 0.05% of its target, priced 9,276 multisets by LP in
        # 7 s, and the packing of all but one of the 111 it searched ended at the root for that reason).
        if i == 0 and CHEAP_FIRST:
            c = cheap(y)
            if c <= lam_cap:
                tick += 1
                heapq.heappush(heap, (max(key, m * c), tick, y, 3, False))
            continue
        if i in (0, 3):
            pr = prep(y)
            if pr is not None and pr[2] <= lam_cap:
                tick += 1
                heapq.heappush(heap, (max(key, m * pr[2]), tick, y, 1, False))
                if DIVE_EVERY and fr.dives < DIVES:  # (no queue kept once the dives are spent)
                    heapq.heappush(ready, (max(key, m * pr[2]), tick, y))
            continue
        if i == 1:
            if y in packed:
                continue  # settled ahead of its turn by a dive
            packed.add(y)
        settle(key, y, i)
    inc = best[0] if best else INF
    rest = _least_live(heap, lambda e: e[4] or e[3] != 1 or e[2] not in packed)
    fr.lower_bound = max(0.0, min(lb, rest, inc, unplaced) * (1 - 1e-9))
    # Nothing left that could beat the incumbent; with none (inc infinite) that is nothing left at all, which proves
    # that no variant exists (an infinite bound is not "above" an infinite incumbent: 991023 of the hard families,
    # whose walk ended with nothing left, was reported unfinished and answered DEADLINE_EXCEEDED at any budget).
    fr.images_complete = not stopped and _beyond(unsettled, inc, slack) and (_beyond(rest, inc, slack) or not heap)
    # (Under GPU sharing a multiset whose assignment did not place keeps a proven bound in `settled`, which the
    # tie-break searches when it is within its gate (`sharing_chain.tie_break`): it does not leave the walk open.)
    fr.complete = not stopped and _beyond(unsettled, inc, 2e-9) and (_beyond(rest, inc, 1e-9) or not heap) \
        and ((pb.sharing and not relaxed) or _beyond(unplaced, inc, 2e-9))
    return fr


def _beyond(x: float, inc: float, tol: float) -> bool:
    """Whether a bound x leaves nothing to beat the incumbent inc: x above it, or x infinite (nothing there)."""
    return x == INF or x > inc * (1 + tol)


def _least_l_milp(pb: Problem, loads: list[float], so: list[list[tuple[float, str, int]]], y: tuple[int, ...],
                  profs: list[int], pos: dict[int, int], tool: float, cap_l: float,
                  deadline: float, nodes: int = 0) -> tuple[float, list[tuple[str, int, int]] | None, bool] | None:
    """`least_l` as a MILP: each stage j (load loads[j], options so[j] = (latency, kind, ref)) on one running
    instance with room or one of the y[p] instances of each new profile p (bins, identical: ordered by load to
    break their symmetry only if MILP_SYMMETRY; HiGHS detects it otherwise), every bin within its capacity, least
    total latency <= cap_l. Returns (L, assignment, True), (cap_l, None, True) when nothing fits within cap_l, (its
    proven lower bound of L, None, False) when HiGHS did not settle it, or None when it proved nothing."""
    from flowmaker.selection.milp import _CORE, MIP_TOL, _tol

    if _CORE is None:
        return None
    core = _CORE
    cols: list[tuple[int, str, int, int, float]] = []  # (stage, kind, ref, bin, latency)
    for j, opts in enumerate(so):
        for lat, k, ref in opts:
            if k == REUSE:
                cols.append((j, k, ref, 0, lat))
            else:
                cols.extend((j, k, ref, b, lat) for b in range(y[pos[ref]]))
    rows_lo: list[float] = []
    rows_hi: list[float] = []
    entries: list[list[tuple[int, float]]] = [[] for _ in cols]
    assign_row = []
    for _ in so:
        assign_row.append(len(rows_lo))
        rows_lo.append(1.0)
        rows_hi.append(1.0)
    cap_row: dict[tuple[str, int, int], int] = {}
    for key in dict.fromkeys((k, ref, b) for _, k, ref, b, _ in cols):  # in column order: deterministic
        cap_row[key] = len(rows_lo)
        rows_lo.append(-math.inf)
        # as `leq` admits it: the running load plus what is added within the capacity's tolerance
        rows_hi.append(_tol(pb.p_cap[pb.r_prof[key[1]]]) - pb.r_load0[key[1]] if key[0] == REUSE
                       else _tol(pb.p_cap[key[1]]))
    sym: dict[tuple[int, int], int] = {}  # bin b of profile p carries at least the load of bin b + 1
    for pi in profs if MILP_SYMMETRY else ():
        for b in range(y[pos[pi]] - 1):
            sym[(pi, b)] = len(rows_lo)
            rows_lo.append(0.0)
            rows_hi.append(math.inf)
    lat_row = len(rows_lo)
    rows_lo.append(-math.inf)
    rows_hi.append((cap_l - tool) * (1 + 1e-12) + 1e-12)
    for c, (j, k, ref, b, lat) in enumerate(cols):
        e = entries[c]
        e.append((assign_row[j], 1.0))
        e.append((cap_row[(k, ref, b)], loads[j]))
        e.append((lat_row, lat))
        if k == NEW:
            if (ref, b) in sym:
                e.append((sym[(ref, b)], loads[j]))
            if (ref, b - 1) in sym:
                e.append((sym[(ref, b - 1)], -loads[j]))
    from flowmaker.selection.exact import _core_lp, run_checked

    lp = _core_lp([0.0] * len(cols), [1.0] * len(cols), [c[4] for c in cols], entries, rows_lo, rows_hi)
    lp.integrality_ = [core.HighsVarType.kInteger] * len(cols)
    h = core._Highs()
    for opt, val in (("output_flag", False), ("threads", 1), ("mip_rel_gap", MILP_GAP), ("mip_abs_gap", 0.0),
                     ("mip_feasibility_tolerance", MIP_TOL), ("primal_feasibility_tolerance", MIP_TOL),
                     ("dual_feasibility_tolerance", MIP_TOL), ("mip_max_nodes", nodes or MILP_NODES),
                     ("mip_heuristic_run_rins", MILP_SUBMIPS), ("mip_heuristic_run_rens", MILP_SUBMIPS)):
        h.setOptionValue(opt, val)
    left = deadline - time.perf_counter()
    if left <= 0:
        return None
    # The final deadline only (the work limit is mip_max_nodes), at half the time left: HiGHS checks its limit only
    # now and then (its issues 885, 1278) and overran it by 0.4 s on a 0.73 s limit (chain_clones 1327009 under
    # sharing, 1,674 nodes), past the caller's budget.
    h.setOptionValue("time_limit", left * HIGHS_TIME_SHARE)
    h.passModel(lp)
    name = run_checked(h)
    if name == "Infeasible":
        return cap_l, None, True
    info = h.getInfo()
    db = getattr(info, "mip_dual_bound", None)

    def assignment() -> tuple[list[tuple[str, int, int]], float]:
        val = h.getSolution().col_value
        out: list[tuple[str, int, int]] = [(REUSE, 0, 0)] * len(so)
        lat_sum = tool
        for c, (j, k, ref, b, lat) in enumerate(cols):
            if val[c] > 0.5:
                out[j] = (k, ref, b)
                lat_sum += lat
        return out, lat_sum

    if name != "Optimal":
        # Unsettled: HiGHS' proven bound (an L above cap_l costs more than the caller needs to know), and the best
        # assignment it found, if any (a candidate for the caller; it is checked from scratch there).
        found = assignment()[0] if getattr(info, "primal_solution_status", 0) == 2 else None
        if db is not None and math.isfinite(db):
            return min(cap_l, tool + db * (1 - DB_MARGIN)), found, False
        return None
    out, L = assignment()
    # The point's value is the proven bound (at most L; equal up to HiGHS' tolerances), the assignment the best
    # found (its candidate variant is scored from scratch).
    if db is not None and math.isfinite(db):
        L = min(L, tool + db * (1 - DB_MARGIN))
    return L, out, True


def _least_l_patterns(loads: list[float], so: list[list[tuple[float, str, int]]],
                      classes: list[tuple[str, int, int, float]], tool: float, cap_l: float, deadline: float
                      ) -> tuple[float, list[tuple[str, int, int]] | None, bool] | None:
    """`least_l` by patterns (`flowmaker.selection.patterns`): the Dantzig-Wolfe bound by column generation (HiGHS
    for the master LP), then every pattern within the gap between it and an incumbent, then their least exact cover.
    `classes`: (kind, ref, bins, limit) per class of identical bins (a running instance: 1 bin), `limit` the most
    load a bin takes (`leq`'s limit of its capacity, less its running load). Returns what `_least_l_milp` returns
    when it settles the packing ((L, assignment, True), or (cap_l, None, True) when nothing fits within cap_l), else
    None (past its work limits or the deadline: the MILP takes over).

    A pattern fits a bin when its loads sum to at most the limit widened by 1e-9, so that float sums in another
    order never leave out a packing `leq` admits (the caller re-checks every assignment from scratch); bounds are
    lowered by 1e-9 (relative) before they prove anything, as HiGHS' tolerances are."""
    from flowmaker.selection.exact import _core_lp
    from flowmaker.selection.milp import _CORE, MIP_TOL

    if _CORE is None:
        return None
    core = _CORE
    n = len(so)
    classes = [c for c in classes if c[2] > 0]
    cidx = {(k, ref): i for i, (k, ref, _, _) in enumerate(classes)}
    count = [c[2] for c in classes]
    room = [c[3] + 1e-9 for c in classes]
    lat: list[dict[int, float]] = [{} for _ in classes]  # class -> stage -> latency
    for j, opts in enumerate(so):
        for lt, k, ref in opts:
            c = cidx.get((k, ref))
            if c is not None and loads[j] <= room[c] and lt < lat[c].get(j, INF):
                lat[c][j] = lt
    if any(all(j not in lat[c] for c in range(len(classes))) for j in range(n)):
        return cap_l, None, True  # a stage that fits no bin: nothing fits
    big = 2.0 * sum(max(lat[c].get(j, 0.0) for c in range(len(classes))) for j in range(n)) + 1.0
    # Master LP: rows 0..n-1 cover each stage once; rows n.. at most count[c] patterns of class c.
    lp = _core_lp([], [], [], [], [1.0] * n + [-math.inf] * len(classes), [1.0] * n + [float(x) for x in count])
    h = core._Highs()
    for opt, val in (("output_flag", False), ("threads", 1), ("primal_feasibility_tolerance", MIP_TOL),
                     ("dual_feasibility_tolerance", MIP_TOL)):
        h.setOptionValue(opt, val)
    h.passModel(lp)
    for j in range(n):  # an artificial column per stage keeps the master feasible
        h.addCol(big, 0.0, math.inf, 1, [j], [1.0])
    pats: list[tuple[int, list[int], float]] = []  # (class, stages, latency)
    seen: set[tuple[int, tuple[int, ...]]] = set()
    best_lb, best_pi, best_m = -INF, [0.0] * n, [0.0] * len(classes)
    for _ in range(PAT_ITERS):
        if time.perf_counter() > deadline:
            return None
        h.run()
        if h.modelStatusToString(h.getModelStatus()) != "Optimal":
            return None
        duals = list(h.getSolution().row_dual)
        pi, sig = duals[:n], duals[n:]
        lb = sum(pi)
        ms = [0.0] * len(classes)
        added = 0
        for c in range(len(classes)):
            js = [j for j in lat[c] if pi[j] - lat[c][j] > 0.0]
            got, chosen, ub = knapsack([pi[j] - lat[c][j] for j in js], [loads[j] for j in js], room[c],
                                       PAT_KNAP_NODES)
            ms[c] = -ub
            lb += count[c] * min(0.0, -ub)
            if got + sig[c] > 1e-9:
                st = sorted(js[i] for i in chosen)
                key = (c, tuple(st))
                if key not in seen:
                    seen.add(key)
                    cost = sum(lat[c][j] for j in st)
                    pats.append((c, st, cost))
                    h.addCol(cost, 0.0, math.inf, len(st) + 1, [*st, n + c], [1.0] * (len(st) + 1))
                    added += 1
        if lb > best_lb:
            best_lb, best_pi, best_m = lb, pi, ms
        if not added:
            break
    floor = best_lb - 1e-9 * max(1.0, abs(best_lb))
    cap = cap_l - tool
    if floor > cap * (1 + 1e-9) + 1e-9:
        return cap_l, None, True  # the bound alone: nothing fits within cap_l
    base = [-min(0.0, m) for m in best_m]

    def excess(c: int, st: list[int]) -> float:
        return max(0.0, base[c] + sum(lat[c][j] - best_pi[j] for j in st))

    # An incumbent from the generated patterns (their exact cover), so that the gap, and the patterns within it, are few.
    inc = cap * (1 + 1e-9) + 1e-9
    seeded = False  # whether inc is a cover's (then the final cover finds at least that one)
    if pats:
        got_c = exact_cover(n, [p[1] for p in pats], [p[0] for p in pats], [p[2] for p in pats],
                            [excess(p[0], p[1]) for p in pats], count, floor, inc, PAT_COVER_NODES, deadline)
        if got_c[1] is not None:
            inc, seeded = min(inc, got_c[0] * (1 + 1e-12) + 1e-12), True
    def within(lim: float, most: int) -> list[tuple[int, list[int], float]] | None:
        """Every pattern whose excess lets a cover cost at most lim; None past `most` or the deadline."""
        got: list[tuple[int, list[int], float]] = []
        for c in range(len(classes)):
            js = sorted(lat[c])
            got_p = enumerate_patterns([lat[c][j] - best_pi[j] for j in js], [loads[j] for j in js], room[c],
                                       lim - floor - base[c], most - len(got), deadline)
            if got_p is None or time.perf_counter() > deadline:
                return None
            for idx in got_p:
                st = [js[i] for i in idx]
                got.append((c, st, sum(lat[c][j] for j in st)))
        return got

    def cover(pl: list[tuple[int, list[int], float]], lim: float, nodes: int) -> tuple[float, list[int] | None, bool]:
        return exact_cover(n, [p[1] for p in pl], [p[0] for p in pl], [p[2] for p in pl],
                           [excess(p[0], p[1]) for p in pl], count, floor, lim, nodes, deadline)

    got_a = within(inc, PAT_MOST)
    if got_a is not None:
        allp = got_a
        got_e = cover(allp, inc, PAT_COVER_NODES)
        if not got_e[2]:
            return None
    else:
        # Widening, when the whole gap holds too many patterns: those within a slack s of the bound and their least
        # cover of at most floor + s; none means the least L is above floor + s (a cover's sum is at least the floor
        # plus its patterns' excess), so s doubles while the patterns stay within PAT_WIDEN_MOST. The least cover often lies
        # far closer to the bound than the incumbent (measured: a chain_clones 1231012 packing, 0.3% between bound
        # and cap, 0.02% between bound and least L: past PAT_MOST patterns within the gap, 1,269 within 0.03%).
        s_ = PAT_SLACK0 * max(1.0, abs(floor))
        while True:
            lim = floor + s_
            got_w = within(lim, PAT_WIDEN_MOST) if lim < inc else None
            if got_w is None:
                return None
            allp = got_w
            got_e = cover(allp, lim, PAT_WIDEN_NODES)
            if not got_e[2]:
                return None
            if got_e[1] is not None:
                break
            s_ *= PAT_WIDEN
    if got_e[1] is None and seeded:
        return None  # (cannot happen but by float noise, so proves nothing)
    if got_e[1] is None:
        return cap_l, None, True
    out: list[tuple[str, int, int]] = [(REUSE, 0, 0)] * n
    next_bin = [0] * len(classes)
    for q in got_e[1]:
        c, st, _ = allp[q]
        k, ref = classes[c][0], classes[c][1]
        for j in st:
            out[j] = (k, ref, next_bin[c])
        next_bin[c] += 1
    L = tool + _lat_of(so, out)  # (summed in stage order: it may differ from the cover's sum in the last bits)
    if L > cap_l * (1 + 1e-12) + 1e-12:
        return cap_l, None, True  # the least cover lies within the widened cap only
    return L, out, True


def _lat_of(so: list[list[tuple[float, str, int]]], a: list[tuple[str, int, int]]) -> float:
    """The latency of the LLM stages under assignment a (per stage (kind, ref, bin))."""
    return sum(min(lat for lat, k, ref in so[j] if (k, ref) == (kind, r)) for j, (kind, r, _) in enumerate(a))


def _first_fit(so: list[list[tuple[float, str, int]]], loads: list[float], y: tuple[int, ...], pos: dict[int, int],
               spare: dict[int, float], p_cap: tuple[float, ...]) -> list[tuple[str, int, int]] | None:
    """An assignment that fits y (each stage in order on its fastest option with room), or None: a candidate
    for a multiset whose search gave up, never a bound."""
    fill_r = {r: 0.0 for r in spare}
    fill_n: dict[int, list[float]] = {}
    out: list[tuple[str, int, int]] = []
    for opts, ld in zip(so, loads, strict=True):
        got: tuple[str, int, int] | None = None
        for _, k, ref in opts:
            if k == REUSE:
                if leq(fill_r[ref] + ld, spare[ref]):
                    fill_r[ref] += ld
                    got = (REUSE, ref, 0)
            else:
                fills = fill_n.setdefault(ref, [0.0] * y[pos[ref]])
                for b, f in enumerate(fills):
                    if leq(f + ld, p_cap[ref]):
                        fills[b] = f + ld
                        got = (NEW, ref, b)
                        break
            if got is not None:
                break
        if got is None:
            return None
        out.append(got)
    return out


ORDER_NODES = 2_000  # placements tried per multiset by `never_places`; past it the multiset counts as placeable


def never_places(pb: Problem, insts: list[int]) -> bool:
    """True when the new instances `insts` (profile indices, a multiset; a replica group places its replicas
    one after another) cannot all be placed in ANY order by the spec's rule on the request's cluster, so that
    no variant has exactly these new instances. False when some order places them, or when deciding it took
    more than ORDER_NODES placements (conservative)."""
    counts: dict[int, int] = {}
    for pi in insts:
        counts[pi] = counts.get(pi, 0) + 1
    work = [0]

    def go(free: dict[str, int], occ: dict[str, int]) -> bool | None:
        """True: some order of what is left places; False: none; None: gave up."""
        if not any(counts.values()):
            return True
        unknown = False
        for pi in sorted(counts):
            if not counts[pi]:
                continue
            work[0] += 1
            if work[0] > ORDER_NODES:
                return None
            f2, o2 = dict(free), dict(occ)
            if all(pb.place_new(f2, o2, pi) is not None for _ in range(pb.p_reps[pi])):
                counts[pi] -= 1
                r = go(f2, o2)
                counts[pi] += 1
                if r is None:
                    unknown = True
                elif r:
                    return True
        return None if unknown else False

    return go(dict(pb.free0), dict(pb.occ_units)) is False


class _Pricer:
    """`_prices` for many multisets of one walk: one LP over every option of every stage, kept by HiGHS between
    calls. A multiset only changes bounds (the options of its absent profiles fixed at 0, the room of each class),
    so each solve starts from the last basis (dual simplex) instead of building and solving an LP from scratch
    (measured on chain_clones: 0.7 ms -> ~0.2 ms a multiset). The duals may differ from a cold start's where the LP
    is degenerate; any prices >= 0 give a valid bound, and the sequence of solves is fixed by the walk's work, so
    the answers do not depend on the machine's load."""

    def __init__(self, so: list[list[tuple[float, str, int]]], loads: list[float]) -> None:
        from flowmaker.selection.exact import _core_lp, run_checked
        from flowmaker.selection.milp import _CORE

        self.run_checked = run_checked
        self.h: Any = None
        if _CORE is None:  # pragma: no cover
            return
        self.cls = sorted({(k, ref) for opts in so for _, k, ref in opts})
        n = len(so)
        crow = {c: n + i for i, c in enumerate(self.cls)}
        self.crow = crow
        cost: list[float] = []
        entries: list[list[tuple[int, float]]] = []
        self.col_cls: list[tuple[str, int]] = []
        for j, opts in enumerate(so):
            for lat, k, ref in opts:
                cost.append(lat)
                entries.append([(j, 1.0), (crow[(k, ref)], loads[j])])
                self.col_cls.append((k, ref))
        rlo = [1.0] * n + [-INF] * len(self.cls)
        rhi = [1.0] * n + [0.0] * len(self.cls)
        lp = _core_lp([0.0] * len(cost), [0.0] * len(cost), cost, entries, rlo, rhi)
        h = _CORE._Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.passModel(lp)
        self.h = h
        self.n = n
        self.cols_of = {c: [i for i, cc in enumerate(self.col_cls) if cc == c] for c in self.cls}
        self.open: set[tuple[str, int]] = set()  # classes whose columns are free now
        self.room: dict[tuple[str, int], float] = {}

    def prices(self, room: dict[tuple[str, int], float]) -> dict[tuple[str, int], float] | None:
        """The prices of `_prices(so restricted to the classes in room, loads, room)`; None when HiGHS proves
        that LP infeasible (the stages do not fit these capacities even fractionally)."""
        import numpy as np

        h = self.h
        if h is None:  # pragma: no cover
            return {}
        want = set(room)
        flip = sorted(want ^ self.open)
        if flip:
            idx = [i for c in flip for i in self.cols_of[c]]
            hi = [1.0 if c in want else 0.0 for c in flip for _ in self.cols_of[c]]
            if idx:
                h.changeColsBounds(len(idx), np.array(idx, dtype=np.int32), np.zeros(len(idx)), np.array(hi))
            self.open = want
        rows = [c for c in self.cls if self.room.get(c, 0.0) != room.get(c, 0.0)]
        if rows:
            h.changeRowsBounds(len(rows), np.array([self.crow[c] for c in rows], dtype=np.int32),
                               np.full(len(rows), -INF), np.array([room.get(c, 0.0) for c in rows]))
            self.room = dict(room)
        status = self.run_checked(h)
        if status == "Infeasible":
            return None
        if status != "Optimal":
            return {}
        dual = h.getSolution().row_dual
        return {c: max(0.0, -dual[self.crow[c]]) for c in sorted(room)}


def _prices(so: list[list[tuple[float, str, int]]], loads: list[float], room: dict[tuple[str, int], float]
            ) -> dict[tuple[str, int], float]:
    """Prices >= 0 of the room of each capacity class (a running instance; all instances of one profile):
    the duals of the LP that assigns the stages fractionally. Any prices >= 0 give a valid bound."""
    from flowmaker.selection.exact import _core_lp
    from flowmaker.selection.milp import _CORE

    if _CORE is None:  # pragma: no cover
        return {}
    cls = sorted(room)
    crow = {c: len(so) + i for i, c in enumerate(cls)}
    cost: list[float] = []
    entries: list[list[tuple[int, float]]] = []
    for j, opts in enumerate(so):
        for lat, k, ref in opts:
            cost.append(lat)
            entries.append([(j, 1.0), (crow[(k, ref)], loads[j])])
    rlo = [1.0] * len(so) + [-INF] * len(cls)
    rhi = [1.0] * len(so) + [room[c] for c in cls]
    lp = _core_lp([0.0] * len(cost), [1.0] * len(cost), cost, entries, rlo, rhi)
    h = _CORE._Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.passModel(lp)
    h.run()
    if h.modelStatusToString(h.getModelStatus()) != "Optimal":
        return {}
    dual = list(h.getSolution().row_dual)
    return {c: max(0.0, -dual[crow[c]]) for c in cls}
