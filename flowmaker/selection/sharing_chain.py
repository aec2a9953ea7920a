"""GPU sharing on a chain's multiset walk (`chain.walk_chain`): multisets of new instances once placed, and the
tie-break (docs/selection-spec.md, "Extension: GPU sharing", "A chain's multisets, placed"). A fan (`fan_of`) is
walked the same way: its L sums its path stages and takes the largest parallel stage's latency, so its bounds take each
stage's bound on its own (`_agg`, `_search_order_fan`) where a chain's sum them per instance.

The walk prices each option at `Problem.bound_view`'s latency, which lets every new instance land on the least busy
GPUs that fit it and carry its full capacity u x C. A multiset of several new instances cannot all do that: the
spec places them one after another, each where the others have not gone, and on a crowded cluster the second or
third lands beside busy co-residents. There it is slower, and Feasibility 5 lets it carry only what keeps its GPUs
within the compute budget and itself within u once slowed (measured on the adversarial `chain15` and `reuse`
instances: the walk's best multisets were of this kind, every one failed Feasibility 5, and their relaxed bounds
kept the gap at 13-55%).

Placement is a function of the order in which the instances open alone (a new instance occupies u of each of its
GPUs whatever it carries), so `placed_bins` places each order by the spec's rule and states what it leaves each
instance a stage may use:

* an instance's co-residents are busy at least as much as the running instances on its GPUs plus the least busy
  share of the other new instances there (each carries a stage at least, the one of least latency alone);
* its compute share is at most what keeps each of its GPUs within u (the running instances' shares and the other
  new instances' least shares there counted) and at most u / f (Feasibility 5.1, 5.2);
* a reused instance: the same, with the new instances beside it counted;
* each stage's latency on an instance is at least its latency alone times `f (1 - rho) / (1 - rho f)` at the load
  the instance carries (at least the stage's own), and at least the walk's;
* every new instance of the multiset serves a stage.

Each of these holds in every variant whose new instances are exactly the multiset and open in that order. Then:

* `multiset_bound`: the least L over the orders of an assignment within these (a small MILP, and an LP in which a
  slowed instance's final load lies in one of LEVELS bands, its stages priced at the band's lower edge, since the
  multiplier grows steeply with the load) bounds the L_s of every such variant;
* `settle_multiset`: a depth-first search of those assignments, each complete one checked from scratch, finds the
  least cost of the multiset when it finishes (its bound follows the busy shares as stages arrive);
* `tie_break`: once the walk proved the cost, the same search over the multisets that may tie settles the answer.

Floats with margins that only lower the bounds. Work is counted (orders placed, HiGHS solves, search nodes), never
time, except the caller's deadline.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from flowmaker.selection.order_search import _MARGIN, Bins, _Co, _co_fails, search_chain, search_fan
from flowmaker.selection.problem import EPS, INF, NEW, REL_TOL, REUSE, Problem, PWorkflow
from flowmaker.sharing import busy_share, occupancy

CHEAP_ORDERS = 24  # `placed_cheap`'s most orders (measured: dag_mix 1447018 under sharing, 10,575 placements in 1.7 s with 120)
MAX_ORDERS = 120  # distinct opening orders of a multiset tried; past it the multiset keeps the walk's bound
MILP_ORDERS = 40  # up to this many orders, each one's least L is solved (`_least_l`), else bounded per stage
MILP_NODES = 10  # HiGHS nodes of such a MILP (work, not time); an unsettled one gives its dual bound
LEVELS = 6  # load bands of a slowed instance (`_assignment_lp`)
# A slowed instance's stages priced by `_convex_lp` in place of the load bands' LP (`_assignment_lp`): measured on the
# adversarial `reuse` 1 multisets (44, 45) and (44, 44), least L 33.67 and 37.50 against the bands' 31.63 and 35.94 (true
# least 34.06 and above 37.69), at the same cost (one LP an order, 1-2 ms).
CONVEX_LP = True
TANGENTS = 16  # tangent cuts of a slowed bin's convex cost in `_convex_lp`
LEVEL_MILP = False  # the bands as a MILP too (measured: 80-160 ms an order, for 1% more bound), else their LP
PLACED_WORK = 800  # work of the placed bounds per chain walk: orders placed, HiGHS solves SOLVE_WORK each
SOLVE_WORK = 8  # measured: an order's placement and cheap bounds 0.1-0.5 ms, a HiGHS solve 2-20 ms
CO_CHECK = True  # Feasibility 5.4 (running co-residents) in `placed_bins` and the searches

Option = tuple[str, int, float]  # (kind, ref, latency bound), as `milp.RelaxedModel.opts`


def fan_of(pw: PWorkflow) -> frozenset[int] | None:
    """The parallel LLM stages of a fan (`chain.fan_group`), None for a chain: a fan's L is its TOOL stages' latency
    plus its other LLM stages' summed plus the largest of its parallel stages'; a chain's, all summed."""
    from flowmaker.selection.chain import fan_group, is_chain

    return None if is_chain(pw) else fan_group(pw)


def _agg(fan: frozenset[int] | None, stages: Sequence[int], lat: Sequence[float]) -> float:
    """L of these per-stage latencies (TOOL stages apart; `fan_of`)."""
    if fan is None:
        return sum(lat)
    return (sum(v for s, v in zip(stages, lat, strict=True) if s not in fan)
            + max((v for s, v in zip(stages, lat, strict=True) if s in fan), default=0.0))


def _least_placed(bins: Sequence[_Bin], llm: Sequence[int], fan: frozenset[int] | None, tool: float) -> float:
    """L (with the TOOL stages' `tool`) of each stage at its least bound over these bins, capacity left out."""
    return tool + _agg(fan, llm, [min((b.lb.get(s, INF) for b in bins), default=INF) for s in llm])


def _holds(bins: Sequence[_Bin], total: float) -> bool:
    """Whether these bins' room together can hold the load `total` at all."""
    return sum(b.cap - b.load0 for b in bins) >= total * (1 - 1e-9)


def _orders(insts: Sequence[int]) -> list[tuple[int, ...]] | None:
    """The distinct orders of a multiset of profile indices; None when there are more than MAX_ORDERS."""
    counts: dict[int, int] = {}
    for pi in insts:
        counts[pi] = counts.get(pi, 0) + 1
    n = math.factorial(len(insts))
    for c in counts.values():
        n //= math.factorial(c)
    if n > MAX_ORDERS:
        return None
    return sorted(set(itertools.permutations(insts))) if n > 1 else [tuple(insts)]


class _Bin:
    """One instance a stage may run on, as a placement leaves it: a new instance (position `i` in the opening order,
    profile `ref`) or a reused one (`ref` its index in `Problem.reusable`)."""

    __slots__ = ("alone", "amax", "busy0", "cap", "f", "gpus", "i", "kind", "lb", "load0", "ref", "reps", "unit")

    def __init__(self, kind: str, ref: int, i: int, cap: float, f: float, unit: float, load0: float,
                 gpus: list[tuple[str, ...]], busy0: float, reps: int) -> None:
        self.kind, self.ref, self.i = kind, ref, i
        self.cap = cap  # the most load it may carry in all (Feasibility 3, 5.1, 5.2), its running load included
        self.f = f  # its speed factor at least
        self.unit = unit  # the load at which its compute share is 1 (a group: all its replicas)
        self.load0 = load0
        self.gpus = gpus  # per replica, its GPUs
        self.busy0 = busy0  # its busy share before the stages (new: at least; reused: its running one)
        self.reps = reps
        self.lb: dict[int, float] = {}  # per LLM stage that may use it, a bound of its latency there
        self.alone: dict[int, float] = {}  # per such stage, its latency alone
        # the most its stages' latencies alone may sum to (a new instance whose busy share beyond this slows a
        # running co-resident past Feasibility 5.4, with the other new instances at their least; INF: no limit)
        self.amax = INF


def multiset_bound(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]], insts: Sequence[int],
                   tool: float, cap_l: float, deadline: float, work: list[int] | None = None) -> float:
    """A lower bound of the slowed L_s of every variant of chain `pw` whose new instances are exactly `insts`
    (profile indices), with `opts` the walk's options per LLM stage (module docstring); INF when no such variant
    fits within `cap_l`, 0.0 when nothing is proven. `tool`: the TOOL stages' latency. `work`: HiGHS solves left
    to this caller's placed bounds, counted in orders placed and HiGHS solves (SOLVE_WORK each; decremented): none
    left, nothing is proven."""
    if work is not None and work[0] <= 0:
        return 0.0
    orders = _orders(insts)
    if orders is None:
        return 0.0
    best = INF
    llm = [s for s in pw.llm if opts.get(s)]
    fan = fan_of(pw)
    total = sum(pw.load[s] for s in llm)
    state = pb.share_state(pb.free0, *pb._fast_totals())
    memo: dict[tuple[int, ...], Any] = {}
    for order in orders:
        if work is not None:
            if work[0] <= 0:
                return 0.0
            work[0] -= 1
        bins = placed_bins(pb, pw, opts, order, memo)
        if bins is None or not _holds(bins, total):
            continue  # it does not place, or its instances cannot hold the load even together
        least = _least_placed(bins, llm, fan, tool)  # each stage at its least bound, capacity left out
        got: float | None = least
        if len(orders) <= MILP_ORDERS and fan is None:  # (a fan's L the LPs below do not state)
            if least > cap_l * (1 + 1e-9):
                continue  # beyond the cap without HiGHS: no solve to count
            got = _least_l(pw, llm, bins, len(order), tool, cap_l, deadline, state, least)
            if work is not None:
                work[0] -= SOLVE_WORK
        if got is None:
            return 0.0  # out of time: nothing proven
        best = min(best, got)
        if best <= 0.0:
            break
    return best


def placed_cheap(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]], insts: Sequence[int],
                 tool: float, cap_l: float) -> float:
    """`multiset_bound` without HiGHS, against `cap_l`: over the opening orders of `insts`, the least of each stage's
    least bound once placed (`_agg`), the orders that do not place or cannot hold the load together left out; the
    first order within `cap_l` ends it (that order's value). INF: no variant has exactly these new instances; 0.0
    when there are more than CHEAP_ORDERS orders (nothing proven). For the chain walk, before a multiset's packing is
    searched (measured: chain_clones 1381006 and 1433010 under sharing, whose walks spent 1.6-26 s solving the
    packings of multisets that this proves empty in about a millisecond each)."""
    orders = _orders(insts)
    if orders is None or len(orders) > CHEAP_ORDERS:
        return 0.0
    llm = [s for s in pw.llm if opts.get(s)]
    fan = fan_of(pw)
    total = sum(pw.load[s] for s in llm)
    best = INF
    memo: dict[tuple[int, ...], Any] = {}
    for order in orders:
        bins = placed_bins(pb, pw, opts, order, memo)
        if bins is None or not _holds(bins, total):
            continue
        best = min(best, _least_placed(bins, llm, fan, tool))
        if best <= cap_l:
            break
    return best


def _co(pb: Problem, inst: Any, rb: int = -1) -> _Co:
    """Running instance `inst` as `_co_fails` sees it (once per request; `rb` as `_Co` says)."""
    cache: dict[str, _Co] | None = getattr(pb, "_cos", None)
    if cache is None:
        cache = pb._cos = {}  # type: ignore[attr-defined]
    got = cache.get(inst.id)
    if got is None:
        busy0 = pb._fast_totals()[1]
        b0, rho0 = pb.run_busy0[inst.id], pb.run_rho0[inst.id]
        f0 = 1.0 + float(pb.kappa) * max(0.0, max(busy0.get(g, 0.0) - b0 for g in inst.gpu_ids))
        most = inst.max_slowdown * (1 + EPS) * (1 + _MARGIN) if inst.max_slowdown > 0 else INF
        got = cache[inst.id] = _Co(tuple(inst.gpu_ids), b0, rho0, f0, most, -1)
    return got if rb < 0 else got._replace(rb=rb)


def _f_most(c: _Co, u: float) -> float:
    """The largest f1 that running instance `c` bears once made slower (Feasibility 5.4 at its running compute share):
    rho0 f1 <= u (1 + EPS), and m1 <= its tolerance: f (1 - rho0) / (1 - rho0 f) <= most iff
    f <= most / (1 - rho0 + most rho0). Margins up."""
    got = u * (1 + EPS) / c.rho0 if c.rho0 > 0 else INF
    if c.most < INF:
        got = min(got, c.most / (1 - c.rho0 + c.most * c.rho0))
    return got * (1 + _MARGIN)


# (the options mapping, `_least_shares` of it), one tuple so that concurrent selections read a consistent pair: the
# walks ask with one mapping many times
_LEAST: list[Any] = [None]


def _least_shares(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]]
                  ) -> dict[int, tuple[float, float]]:
    """Per profile some stage may use new, the least a new instance of it puts on its GPUs: its lightest stage's
    compute share and its quickest one's busy share (per replica, margins down)."""
    got = _LEAST[0]
    if got is not None and got[0] is opts:
        return got[1]
    mine: dict[int, list[int]] = {}
    for s in pw.llm:
        for k, ref, _ in opts.get(s, ()):
            if k == NEW and (not mine.get(ref) or mine[ref][-1] != s):
                mine.setdefault(ref, []).append(s)
    out = {}
    for pi, ss in mine.items():
        reps, unit = pb.p_reps[pi], pb.profiles[pi].max_output_tokens_per_s
        out[pi] = (busy_share(min(pw.load[s] for s in ss) / reps, unit) * (1 - _MARGIN),
                   occupancy(min(pb.rho * pw.lat_new[s][pi] for s in ss) / reps) * (1 - _MARGIN))
    _LEAST[0] = (opts, out)
    return out


def placed_bins(pb: Problem, pw: PWorkflow, opts: Mapping[int, Sequence[Option]], order: Sequence[int],
                memo: dict[tuple[int, ...], Any] | None = None) -> list[_Bin] | None:
    """What one opening order of new instances leaves each instance a stage may use (module docstring): the new
    instances in that order, then the reusable running ones; None when it does not place or some instance cannot
    carry even its lightest stage. `memo`: the placements of the orders' prefixes, shared by calls for one multiset
    (its orders share prefixes)."""
    from flowmaker.selection.milp import _tol

    least = _least_shares(pb, pw, opts)
    if any(pi not in least for pi in order):
        return None  # no stage can use it: no variant has exactly these instances
    free, occ = pb.free0, pb.occ_units
    places: list[list[tuple[str, ...]]] = []  # per instance, its replicas' GPUs
    start = 0
    if memo is not None:
        for j in range(len(order) - 1, 0, -1):
            got = memo.get(tuple(order[:j]))
            if got is not None:
                free, occ, places = got
                start = j
                break
    free, occ, places = dict(free), dict(occ), list(places)
    for j in range(start, len(order)):
        pi = order[j]
        placed: list[tuple[str, ...]] = []
        for _ in range(pb.p_reps[pi]):
            pl = pb.place_new(free, occ, pi)
            if pl is None:
                return None
            placed.append(pl[1])
        places.append(placed)
        if memo is not None and j + 1 < len(order):
            memo[tuple(order[:j + 1])] = (dict(free), dict(occ), list(places))
    comp0, busy0 = pb._fast_totals()
    kappa = float(pb.kappa)
    budget = pb.u * (1 + EPS) * (1 + _MARGIN)
    llm = [s for s in pw.llm if opts.get(s)]
    # The least each new instance puts on its GPUs: its lightest stage's compute share, its quickest one's busy share.
    c_lb = [least[pi][0] for pi in order]
    b_lb = [least[pi][1] for pi in order]
    new_c: dict[str, float] = {}
    new_b: dict[str, float] = {}
    for i, placed in enumerate(places):
        for gids in placed:
            for g in gids:
                new_c[g] = new_c.get(g, 0.0) + c_lb[i]
                new_b[g] = new_b.get(g, 0.0) + b_lb[i]

    if CO_CHECK:
        # Feasibility 5.4 with the new instances' least busy shares: a running co-resident that these alone slow
        # past what it may bear fails every variant of this order (measured: chain_clones 1433010 under sharing,
        # whose multiset searches spent their 20,000 nodes on complete assignments that 5.4 refused)
        busy_lb = dict(busy0)
        for g, x in new_b.items():
            busy_lb[g] = busy_lb.get(g, 0.0) + x
        kappa_f, top = float(pb.kappa), pb.u * (1 + EPS) * (1 + _MARGIN)
        for inst in pb._on_gpus(new_b):
            c = _co(pb, inst)
            if _co_fails(c, busy_lb, c.b0, c.rho0, kappa_f, top):
                return None
        # Each new instance's most busy share: what its co-residents bear with the other new instances at their least
        b_most = [INF] * len(order)
        for i, placed in enumerate(places):
            on_g: dict[str, int] = {}
            for gids in placed:
                for g in gids:
                    on_g[g] = on_g.get(g, 0) + 1
            for inst in pb._on_gpus(on_g):
                c = _co(pb, inst)
                f_most = min(max(c.f0, _f_most(c, pb.u)), 1.0 / c.rho0 if c.rho0 > 0 else INF) * (1 + _MARGIN)
                w = (f_most - 1.0) / kappa_f if kappa_f > 0 else INF
                for g in c.gpus:
                    n_g = on_g.get(g, 0)
                    if n_g:
                        others = busy_lb.get(g, 0.0) - n_g * b_lb[i] - c.b0
                        b_most[i] = min(b_most[i], (w - others) / n_g)

    def squeeze(gids: Sequence[str], own_c: float, own_b: float) -> tuple[float, float]:
        """(the co-residents' busy total on the most crowded of these GPUs, the most compute share the instance
        may add to them within the budget), with the new instances' least shares counted less its own."""
        worst = 0.0
        room = INF
        for g in gids:
            worst = max(worst, busy0.get(g, 0.0) + new_b.get(g, 0.0) - own_b)
            room = min(room, budget - comp0.get(g, 0.0) - (new_c.get(g, 0.0) - own_c))
        return worst, room

    state = pb.share_state(pb.free0, comp0, busy0)
    bins: list[_Bin] = []
    for i, pi in enumerate(order):
        reps, unit = pb.p_reps[pi], pb.profiles[pi].max_output_tokens_per_s
        f, top = 1.0, INF
        for gids in places[i]:  # each replica: its f and its compute share within u once slowed
            worst, room = squeeze(gids, c_lb[i], b_lb[i])
            f_r = 1.0 + kappa * worst
            f, top = max(f, f_r), min(top, room, budget / f_r, 1.0 / f_r)
        if top < c_lb[i]:
            return None  # it cannot carry even its lightest stage
        b = _Bin(NEW, pi, i, min(top * unit * reps * (1 + _MARGIN), _tol(pb.p_cap[pi])), f, unit * reps, 0.0,
                 places[i], b_lb[i], reps)
        if CO_CHECK and b_most[i] < INF:
            # occupancy(rate x A / reps) <= b_most: A <= -log(1 - b_most) x reps / rate (margin up)
            b.amax = (INF if b_most[i] >= 1.0 else -math.log1p(-b_most[i]) * reps / pb.rho * (1 + 1e-6) + 1e-12) \
                if pb.rho > 0 else INF
        for s in llm:
            for k, ref, lb in opts[s]:
                if k == NEW and ref == pi and pw.lat_new[s][pi] <= b.amax:
                    b.alone[s] = pw.lat_new[s][pi]
                    b.lb[s] = max(lb, b.alone[s] * state.multiplier_lb(f, busy_share(pw.load[s] / reps, unit)))
        if not b.lb:
            return None  # no stage it may take leaves its co-residents within 5.4
        bins.append(b)
    for r in sorted({ref for s in llm for k, ref, _ in opts[s] if k == REUSE}):
        inst = pb.reusable[r]
        rho0, unit = pb.run_rho0[inst.id], pb.r_unit[r]
        worst, room = squeeze(inst.gpu_ids, 0.0, pb.run_busy0[inst.id])  # its own busy share is no co-resident's
        f = 1.0 + kappa * max(0.0, worst)
        top = min(room + rho0, budget / f, 1.0 / f)  # the GPUs' totals hold its running share already
        cap = min(top * unit * (1 + _MARGIN), _tol(pb.p_cap[pb.r_prof[r]]))
        b = _Bin(REUSE, r, -1, max(cap, pb.r_load0[r]), f, unit, pb.r_load0[r], [tuple(inst.gpu_ids)],
                 pb.run_busy0[inst.id], 1)
        for s in llm:
            for k, ref, lb in opts[s]:
                if k == REUSE and ref == r:
                    b.alone[s] = pw.lat_reuse[s][r]
                    b.lb[s] = max(lb, b.alone[s] * state.multiplier_lb(f, busy_share(b.load0 + pw.load[s], unit)))
        bins.append(b)
    return bins


class HighsModel:
    """A HiGHS model built a row and a column at a time: the first `ns` rows (one per LLM stage) are equalities to
    1 (each stage on exactly one bin)."""

    def __init__(self, ns: int) -> None:
        self.rlo: list[float] = [1.0] * ns
        self.rhi: list[float] = [1.0] * ns
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.cost: list[float] = []
        self.integ: list[bool] = []
        self.entries: list[list[tuple[int, float]]] = []

    def row(self, lo: float, hi: float) -> int:
        self.rlo.append(lo)
        self.rhi.append(hi)
        return len(self.rlo) - 1

    def col(self, cost: float, e: list[tuple[int, float]], lo: float = 0.0, hi: float = 1.0,
            is_int: bool = True) -> int:
        self.lo.append(lo)
        self.hi.append(hi)
        self.cost.append(cost)
        self.integ.append(is_int)
        self.entries.append(e)
        return len(self.cost) - 1

    def highs(self, integer: bool) -> Any:
        """The model passed to a HiGHS instance (a MILP when `integer`), exact to MIP_TOL, within MILP_NODES, without
        HiGHS' RINS and RENS sub-MIPs, as the packings' MILPs (`chain.MILP_SUBMIPS`): they only look for better
        solutions, and the callers take the dual bound (measured: a 26-row order MILP of chain_clones 1549035, 10
        nodes, 0.30 s with them, 0.09 s without, the same dual bound)."""
        from flowmaker.selection.chain import MILP_SUBMIPS
        from flowmaker.selection.exact import _core_lp
        from flowmaker.selection.milp import _CORE, MIP_TOL

        lp = _core_lp(self.lo, self.hi, self.cost, self.entries, self.rlo, self.rhi)
        if integer:
            lp.integrality_ = [_CORE.HighsVarType.kInteger if i else _CORE.HighsVarType.kContinuous
                               for i in self.integ]
        h: Any = _CORE._Highs()
        for opt, val in (("output_flag", False), ("threads", 1), ("mip_rel_gap", 0.0), ("mip_abs_gap", 0.0),
                         ("mip_feasibility_tolerance", MIP_TOL), ("primal_feasibility_tolerance", MIP_TOL),
                         ("dual_feasibility_tolerance", MIP_TOL), ("mip_max_nodes", MILP_NODES),
                         ("mip_heuristic_run_rins", MILP_SUBMIPS), ("mip_heuristic_run_rens", MILP_SUBMIPS)):
            h.setOptionValue(opt, val)
        h.passModel(lp)
        return h


def _assignment_lp(pw: PWorkflow, llm: list[int], bins: list[_Bin], n_new: int, lat_cap: float, integer: bool,
                   state: Any = None) -> tuple[Any, list[int]]:
    """The least sum of stage latencies, each stage on one bin with a finite latency, every bin within its
    capacity, each of the first `n_new` bins used, the sum at most `lat_cap`: HiGHS' model of it (a MILP when
    `integer`), and each bin's capacity row. With `state` (a MILP), a slowed bin (f > 1) carries its final load in
    one of LEVELS equal bands (a binary each), and a stage there costs its latency alone times the multiplier at the
    band's lower edge (or its own bound, when higher): the multiplier grows steeply with the load once slowed, which
    the stages' own bounds do not see."""
    mdl = HighsModel(len(llm))
    row, col = mdl.row, mdl.col
    lat_row = row(-math.inf, lat_cap)
    cap_rows: list[int] = []
    for bi, b in enumerate(bins):
        room = b.cap - b.load0
        must = row(1.0, math.inf) if bi < n_new else None
        bands = LEVELS if state is not None and b.f > 1 + 1e-9 and room > 0 else 1
        one = row(-math.inf, 1.0) if bands > 1 else None
        busy_r = row(-math.inf, b.amax) if b.amax < sum(b.alone.values()) else None  # (Feasibility 5.4)
        for k in range(bands):
            lo_ld, hi_ld = room * k / bands, room * (k + 1) / bands
            cap_r = row(-math.inf, 0.0 if bands > 1 else room)
            if k == 0:
                cap_rows.append(cap_r)
            if one is not None:
                col(0.0, [(one, 1.0), (cap_r, -hi_ld)])
            for j, s in enumerate(llm):
                lb = b.lb.get(s, INF)
                if lb == INF:
                    continue
                ld = pw.load[s]
                if bands > 1:
                    if ld > hi_ld:
                        continue
                    lb = max(lb, b.alone[s] * state.multiplier_lb(b.f, (b.load0 + max(lo_ld, ld)) / b.unit))
                    if lb == INF:
                        continue
                e = [(j, 1.0), (cap_r, ld), (lat_row, lb)]
                if must is not None:
                    e.append((must, 1.0))
                if busy_r is not None:
                    e.append((busy_r, b.alone[s]))
                col(lb, e)
    return mdl.highs(integer), cap_rows


def _least_l(pw: PWorkflow, llm: list[int], bins: list[_Bin], n_new: int, tool: float, cap_l: float,
             deadline: float, state: Any, least: float) -> float | None:
    """Least L (tool + the stages' latency bounds) of an assignment to these bins (`_assignment_lp`, as a MILP;
    again, when some instance is slowed, with its stages priced by the multiplier at its final load: `_convex_lp`, or
    the load bands of `_assignment_lp`), at least `least` (`_least_placed`, within cap_l): INF when none is within
    cap_l; HiGHS' dual bound when unsettled; None when the deadline passed."""
    from flowmaker.selection.exact import run_checked
    from flowmaker.selection.milp import _CORE

    if _CORE is None:
        return least
    for bands in (state, None) if any(b.f > 1 + 1e-9 for b in bins) else (None,):
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        integer = bands is None or LEVEL_MILP
        if bands is not None and CONVEX_LP:
            h = _convex_lp(pw, llm, bins, n_new, (cap_l - tool) * (1 + 1e-9) + 1e-12, integer)[0]
        else:
            h, _ = _assignment_lp(pw, llm, bins, n_new, (cap_l - tool) * (1 + 1e-9) + 1e-12, integer, state=bands)
        h.setOptionValue("time_limit", left)
        name = run_checked(h)
        if name == "Infeasible":
            return INF
        info = h.getInfo()
        db = getattr(info, "mip_dual_bound", None) if integer else None
        if name == "Optimal":
            v = min(info.objective_function_value, db if db is not None and math.isfinite(db) else INF)
        elif db is not None and math.isfinite(db):
            v = db
        elif name == "Time limit reached":
            return None
        else:
            continue
        least = max(least, tool + v - 1e-9 * max(1.0, abs(v)))
    return least


def _mult(f: float, unit: float, load: float) -> float:
    """The multiplier `f (1 - rho) / (1 - rho f)` at compute share rho = load / unit (no margin); INF once rho f >= 1."""
    x = load / unit
    d = 1.0 - f * x
    if d <= 0.0:
        return INF
    return max(1.0, f * (1.0 - x) / d)


def _ratio(pw: PWorkflow, b: _Bin) -> float:
    """The least latency alone per unit of load of a stage that may use bin b (0.0 when some load is 0): every stage
    on b has latency alone >= this x its load, so a bin's stages together are alone at least this x its added load."""
    r = INF
    for s, a in b.alone.items():
        ld = pw.load[s]
        if ld <= 0.0:
            return 0.0
        r = min(r, a / ld)
    return 0.0 if r == INF else r


def _excess(pw: PWorkflow, b: _Bin, s: int, r: float) -> float:
    """What stage s's latency on bin b has beyond `r` x its load, at the least multiplier it runs at there (its own
    load on the bin's running load; 1 when b is not slowed); INF when the stage does not fit the bin."""
    ld = b.load0 + pw.load[s]
    if ld > b.cap:
        return INF
    m = _mult(b.f, b.unit, ld) if b.f > 1.0 else 1.0
    if m == INF:
        return INF
    e = b.alone[s] - r * pw.load[s]
    return e * m if e > 0.0 else 0.0


def _convex_lp(pw: PWorkflow, llm: list[int], bins: list[_Bin], n_new: int, lat_cap: float, integer: bool
               ) -> tuple[Any, list[int], list[int | None]]:
    """The least L (the stages' part) of an assignment to these bins when a bin's stages cost at least what they
    cost at the multiplier m(F) of its final load F: a stage's latency alone is r x its load + its excess (`_ratio`),
    so the stages of a bin take at least r (F - load0) m(F) (a convex function of F, taken under its tangents at
    TANGENTS + 1 loads) plus their `_excess` (each at the multiplier of its own load). The bands of `_assignment_lp`
    price a stage at the lower edge of its band; this prices the load at its final value, which is what grows the
    multiplier. Every bin within its capacity, each of the first `n_new` bins used, the sum at most `lat_cap`: HiGHS'
    model of it (a MILP when `integer`), each bin's load row (F_b - its stages' loads = its running load) and each
    bin's row "used" (the first `n_new`; None for the others)."""
    mdl = HighsModel(len(llm))
    row = mdl.row
    lat_row = row(-math.inf, lat_cap)
    load_rows: list[int] = []
    must_rows: list[int | None] = []
    for bi, b in enumerate(bins):
        r = _ratio(pw, b)
        lr = row(b.load0, b.load0)
        load_rows.append(lr)
        must = row(1.0, math.inf) if bi < n_new else None
        must_rows.append(must)
        busy_r = row(-math.inf, b.amax) if b.amax < sum(b.alone.values()) else None  # (Feasibility 5.4)
        for j, s in enumerate(llm):
            if s not in b.lb or b.lb[s] == INF:
                continue
            e = _excess(pw, b, s, r)
            if e == INF:
                continue
            ent = [(j, 1.0), (lr, -pw.load[s]), (lat_row, e)]
            if must is not None:
                ent.append((must, 1.0))
            if busy_r is not None:
                ent.append((busy_r, b.alone[s]))
            mdl.col(e, ent)
        # z_b >= r (F - load0) m(F), under its tangents; F_b in [load0, cap]
        cuts: list[tuple[float, float]] = []  # (slope, value at F = 0) of each tangent
        if b.f <= 1.0 or r <= 0.0:
            cuts.append((r, -r * b.load0))
        else:
            top = min(b.cap, b.unit / b.f * (1.0 - 1e-6))
            for k in range(TANGENTS + 1):
                fk = b.load0 + (top - b.load0) * k / TANGENTS
                x = fk / b.unit
                d = 1.0 - b.f * x
                m = b.f * (1.0 - x) / d
                dm = b.f * (b.f - 1.0) / b.unit / (d * d)
                hk = r * (fk - b.load0) * m
                dh = r * m + r * (fk - b.load0) * dm
                cuts.append((dh, hk - dh * fk))
        cut_rows = [row(c0, math.inf) for _, c0 in cuts]
        mdl.col(0.0, [(lr, 1.0)] + [(cr, -sl) for cr, (sl, _) in zip(cut_rows, cuts, strict=True)],
              lo=b.load0, hi=max(b.load0, b.cap), is_int=False)
        mdl.col(1.0, [(lat_row, 1.0)] + [(cr, 1.0) for cr in cut_rows], hi=math.inf, is_int=False)
    return mdl.highs(integer), load_rows, must_rows


def _prices(pw: PWorkflow, llm: list[int], bins: list[_Bin], n_new: int) -> list[float]:
    """Prices of the bins' capacities for a Lagrangian bound (any prices >= 0 give one): those of the LP
    relaxation's optimum, 0 when HiGHS is missing or the LP has none."""
    from flowmaker.selection.milp import _CORE

    if _CORE is None:
        return [0.0] * len(bins)
    h, rows = _assignment_lp(pw, llm, bins, n_new, math.inf, integer=False)
    h.run()
    if h.modelStatusToString(h.getModelStatus()) != "Optimal":
        return [0.0] * len(bins)
    dual = h.getSolution().row_dual
    return [abs(dual[r]) for r in rows]


# ---------------------------------------------------------------- every variant of a multiset, by enumeration

SETTLE_NODES = 20_000  # depth-first nodes to settle one multiset exactly (`settle_multiset`)
NODE_WORK = 100  # of those nodes, a unit of the walk's PLACED_WORK
TIE_KEEP_NODES = 50_000  # depth-first nodes of `tie_break` looking for every variant that may tie, all multisets
TIE_FOUND = 64  # variants that may tie that it scores before it looks for better ones only
TIE_NODES = 200_000  # depth-first nodes of `tie_break` looking for better ones only

Candidate = tuple[tuple[float, float, int], list[Any], list[int], list[tuple[str, tuple[str, ...]]]]


def _enumerate(model: Any, insts: Sequence[int], cap_l: float, deadline: float, budget: list[int],
               strict: bool | None, most: int = 0, floor_l: float = 0.0, first: Sequence[int] | None = None
               ) -> tuple[list[Candidate], bool]:
    """Feasible variants of chain or fan `model.pw` (`model`: its `milp.RelaxedModel`) whose new instances are exactly
    `insts` and whose L_s is at most `cap_l`, scored from scratch (`RelaxedModel.realize`): all of them (`strict`
    None; not complete once more than `most` are found), or each below the one found before it (so the last is a
    least one; `strict`: each shorter than the one before by more than the spec's 1e-12, so that no variant that
    ties one found is looked at). Per opening order, the stages are decided
    heaviest first (capacity cuts early) within `placed_bins`' capacities; a complete assignment counts for the
    order in which its instances' first stages come (so each variant counts once), and a partial one is cut when
    the load left exceeds the room left, or when its latency bound (each instance's stages at its bound so far:
    their latencies alone times its multiplier at its load so far, which only grows, or their own bounds; each
    later stage at its least bound, or a Lagrangian bound with the LP's prices of the room left) passes the cap.
    (found, complete): not complete when `budget[0]` depth-first nodes (decremented) or the deadline ran out
    first. `floor_l` (`strict` False): a lower bound of the L_s of every variant with these instances; a variant found
    at or below it (within the spec's 1e-12 of a tie) is a least one, and the search ends there (complete). `first`:
    an opening order to search first (the walk's assignment's: where a variant that cheap is likeliest)."""
    pb, pw = model.pb, model.pw
    opts = model.opts
    topo = {s: j for j, s in enumerate(pw.llm)}
    llm = sorted((s for s in pw.llm if opts.get(s)), key=lambda s: (-pw.load[s], topo[s]))
    tool = sum(pw.tool_lat[v] for v in range(len(pw.wf.stages)) if not pw.wf.stages[v].is_llm)
    state = pb.share_state(pb.free0, *pb._fast_totals())
    out: list[Candidate] = []
    orders = _orders(insts)
    if orders is None:
        return out, False
    fan = fan_of(pw)
    if first is not None and tuple(first) in orders:
        orders = [tuple(first)] + [o for o in orders if o != tuple(first)]
    cap = [min(pb.lam * (1 + 1e-9) + 1e-12, cap_l)]
    floor = floor_l if strict is False else -INF
    for order in orders:
        bins = placed_bins(pb, pw, opts, order)
        if bins is None:
            continue
        if fan is not None:
            more = _search_order_fan(model, llm, topo, tool, state, bins, len(order), cap, out, strict, most, budget,
                                     deadline, floor, fan)
        else:
            more = _search_order(model, llm, topo, tool, state, bins, len(order), cap, out, strict, most, budget,
                                 deadline, floor)
        if not more:
            return out, bool(out) and out[-1][0][1] <= floor * (1 + 1e-12)
    return out, True


class _Tables(NamedTuple):
    """What both depth-first searches of one opening order precompute (`_order_tables`)."""

    by_stage: list[list[tuple[float, int]]]
    ld_suf: list[float]
    min_ld: list[list[float]]
    first_left: list[list[float]]
    tot: dict[str, float]
    own: list[float]
    gpus_of: list[list[str]]
    near: list[list[int]]
    co: list[list[_Co]]


def _order_tables(pb: Problem, pw: PWorkflow, llm: list[int], topo: Mapping[int, int], bins: list[_Bin],
                  k_new: int) -> _Tables:
    """For one opening order (`bins` its `placed_bins`, the first `k_new` of them new), in place: the opening rule
    (new instance i opens at its first stage, after the i instances before it opened at earlier stages, so no stage
    before the i-th LLM stage in topological order runs on it). And the tables of the searches: per stage, its bins by
    bound (fastest first); the load of the stages j..; per bin, the least load of a stage j.. that may use it (room
    below it is wasted); per new bin, the earliest (topological) stage j.. that may use it (its first stage can be no
    earlier, which cuts assignments whose instances cannot open in this order); the busy shares now (each GPU's total,
    each bin's own: a bin's f is 1 + kappa x its co-residents' total on its most crowded GPU, so a stage that makes an
    instance busier raises the bound of the instances beside it too); each bin's GPUs, and the bins sharing one."""
    n = len(llm)
    for bi in range(1, k_new):
        b = bins[bi]
        for s in [s for s in b.lb if topo[s] < bi]:
            del b.lb[s], b.alone[s]
    by_stage = [sorted(((b.lb[s], bi) for bi, b in enumerate(bins) if s in b.lb)) for s in llm]
    ld_suf = [0.0] * (n + 1)
    for j in range(n - 1, -1, -1):
        ld_suf[j] = ld_suf[j + 1] + pw.load[llm[j]]
    min_ld = [[INF] * len(bins) for _ in range(n + 1)]
    for j in range(n - 1, -1, -1):
        min_ld[j] = list(min_ld[j + 1])
        for _, bi in by_stage[j]:
            min_ld[j][bi] = min(min_ld[j][bi], pw.load[llm[j]])
    first_left = [[INF] * k_new for _ in range(n + 1)]
    for j in range(n - 1, -1, -1):
        first_left[j] = list(first_left[j + 1])
        for _, bi in by_stage[j]:
            if bi < k_new:
                first_left[j][bi] = min(first_left[j][bi], topo[llm[j]])
    tot = dict(pb._fast_totals()[1])
    for b in bins:
        if b.kind == NEW:
            for gids in b.gpus:
                for g in gids:
                    tot[g] = tot.get(g, 0.0) + b.busy0
    gpus_of = [sorted({g for gids in b.gpus for g in gids}) for b in bins]
    near = [[bj for bj in range(len(bins)) if set(gpus_of[bi]) & set(gpus_of[bj])] for bi in range(len(bins))]
    # per bin, the running instances on its GPUs (Feasibility 5.4: a stage there makes them busier), each with its
    # reused bin if it has one
    co: list[list[_Co]] = [[] for _ in bins]
    if CO_CHECK:
        rbin = {pb.reusable[b.ref].id: bi for bi, b in enumerate(bins) if b.kind == REUSE}
        recs: dict[str, _Co] = {}
        for bi in range(len(bins)):
            for inst in pb._on_gpus(gpus_of[bi]):
                if inst.id not in recs:
                    recs[inst.id] = _co(pb, inst, rbin.get(inst.id, -1))
                co[bi].append(recs[inst.id])
    return _Tables(by_stage, ld_suf, min_ld, first_left, tot, [b.busy0 for b in bins], gpus_of, near, co)


def _search_order(model: Any, llm: list[int], topo: Mapping[int, int], tool: float, state: Any, bins: list[_Bin],
                  k_new: int, cap: list[float], out: list[Candidate], strict: bool | None, most: int,
                  budget: list[int], deadline: float, floor: float = -INF) -> bool:
    """`_enumerate`'s search for one opening order (`bins` its `placed_bins`, the first `k_new` of them new): the
    variants it finds go to `out`; False when it ran out of work or time, or found one of L_s at most `floor`. Its
    tables and bounds here, its depth-first search in `order_search.search_chain`."""
    pw, pb = model.pw, model.pb
    n = len(llm)
    tb = _order_tables(pb, pw, llm, topo, bins, k_new)
    by_stage = tb.by_stage
    rem = [0.0] * (n + 1)
    for j in range(n - 1, -1, -1):
        rem[j] = rem[j + 1] + (by_stage[j][0][0] if by_stage[j] else INF)
    if tool + rem[0] > cap[0]:
        return True
    # A Lagrangian bound of the stages left: with prices mu >= 0 of the bins' room, their latency is at least
    # sum of min over bins (bound + mu x load) - sum of mu x room left (the LP's prices).
    mu = _prices(pw, llm, bins, k_new)
    rem_mu = [0.0] * (n + 1)
    for j in range(n - 1, -1, -1):
        ld = pw.load[llm[j]]
        rem_mu[j] = rem_mu[j + 1] + min(lb + mu[bi] * ld for lb, bi in by_stage[j])
    pen = sum(p_ * (b.cap - b.load0) for p_, b in zip(mu, bins, strict=True))
    if tool + rem_mu[0] - pen > cap[0] * (1 + 1e-9):
        return True
    return search_chain(model, llm, [pw.load[s] for s in llm], topo, state.multiplier_lb, Bins(bins), k_new, cap, out,
                        strict, most, budget, deadline, floor, float(pb.kappa), pb.rho,
                        pb.u * (1 + EPS) * (1 + _MARGIN), by_stage, tb.ld_suf, tb.min_ld, tb.first_left, tb.tot,
                        tb.own, tb.gpus_of, tb.near, tb.co, rem, mu, rem_mu, pen, tool)


def _search_order_fan(model: Any, llm: list[int], topo: Mapping[int, int], tool: float, state: Any,
                      bins: list[_Bin], k_new: int, cap: list[float], out: list[Candidate], strict: bool | None,
                      most: int, budget: list[int], deadline: float, floor: float, fan: frozenset[int]) -> bool:
    """`_search_order` for a fan (`fan_of`): the same depth-first search, opening rule and leaves, with each stage's
    latency bounded on its own (its bound there, or its latency alone times its instance's multiplier at the load and
    busy shares so far, which only grow) and L the TOOL stages' latency + the other stages' bounds summed + the
    largest parallel stage's; a stage not yet placed counts at its least bound over the bins. Its search:
    `order_search.search_fan`."""
    pw, pb = model.pw, model.pb
    n = len(llm)
    tb = _order_tables(pb, pw, llm, topo, bins, k_new)
    by_stage = tb.by_stage
    par = [s in fan for s in llm]
    least = [by_stage[j][0][0] if by_stage[j] else INF for j in range(n)]
    if any(v == INF for v in least):
        return True
    rem_p = [0.0] * (n + 1)  # the path stages j.. at their least bounds, summed
    rem_g = [0.0] * (n + 1)  # the parallel stages j.. at their least bounds, the largest
    for j in range(n - 1, -1, -1):
        rem_p[j] = rem_p[j + 1] + (0.0 if par[j] else least[j])
        rem_g[j] = max(rem_g[j + 1], least[j] if par[j] else 0.0)
    if tool + rem_p[0] + rem_g[0] > cap[0]:
        return True
    return search_fan(model, llm, [pw.load[s] for s in llm], topo, state.multiplier_lb, Bins(bins), k_new, cap, out,
                      strict, most, budget, deadline, floor, float(pb.kappa), pb.rho,
                      pb.u * (1 + EPS) * (1 + _MARGIN), by_stage, tb.ld_suf, tb.min_ld, tb.first_left, tb.tot,
                      tb.own, tb.gpus_of, tb.near, tb.co, par, rem_p, rem_g, tool)


def settle_multiset(model: Any, insts: Sequence[int], cap_cost: float, deadline: float,
                    work: list[int] | None = None, floor: float = 0.0, first: Sequence[int] | None = None
                    ) -> tuple[Candidate | None, bool]:
    """A least-cost feasible variant of chain or fan `model.pw` with exactly the new instances `insts` among those of cost
    at most `cap_cost` (None: there is none), and whether that is settled: within SETTLE_NODES depth-first nodes,
    and within the caller's `work` (NODE_WORK nodes a unit; decremented). `floor`: a lower bound of the cost of every
    such variant (one found that cheap is a least one); `first`: an opening order to search first."""
    m = sum(model.pb.p_mem[pi] for pi in insts)
    nodes = SETTLE_NODES if work is None else min(SETTLE_NODES, max(0, work[0]) * NODE_WORK)
    budget = [nodes]
    got, done = _enumerate(model, insts, cap_cost / m if m > 0 else INF, deadline, budget, strict=False,
                           floor_l=floor / m if m > 0 else 0.0, first=first)
    if work is not None:
        work[0] -= (nodes - max(0, budget[0])) // NODE_WORK
    return (got[-1] if got else None), done


Best = tuple[tuple[float, float, int], tuple[PWorkflow, list[Any], list[int], list[Any]]]


def tie_break(pb: Problem, models: Mapping[int, Any], multisets: Mapping[int, Sequence[tuple[int, ...]]],
              best: Best, deadline: float, values: Mapping[int, Mapping[tuple[int, ...], float]] | None = None
              ) -> tuple[Best, bool, bool] | None:
    """Once the chain walks proved the cost of `best` (every workflow a chain, `multisets` the multisets of new
    instances each walk settled within that cost): the spec's answer. First every variant that may tie it
    (`_enumerate` up to that cost), when they are at most TIE_FOUND: then the spec's order picks among them,
    exactly as "Ties, exactly" states it, canonical order included, and the second value is True. Otherwise (ties
    abound when instances alone on their GPUs run unslowed, whatever they carry) only a variant better by (cost,
    L_s, new GPUs) is looked for, with each multiset's latency cap at what a better one needs (a shorter L_s at this
    cost, fewer new GPUs at this cost and L_s, or a lower cost), so that no tie is visited, and the second value is
    False: the canonical order among the ties is then `exact.canonical`'s. None when that search runs out of its
    TIE_NODES depth-first nodes or the deadline passes. The third value says whether the ties were left unordered
    because there were more than TIE_FOUND of them (False: the enumeration ran out of its nodes or the deadline
    first, which the canonical pass then rarely gets past either). `values`: per workflow, each multiset's value in
    the walk (`milp.Front.settled`: a proven lower bound of the cost of its variants); a multiset that can hold a
    better variant only by a lower cost or a shorter L_s, whose value v is no more than the tie tolerance below the
    best's cost, and v / its memory (a bound of its variants' L_s) no more than the tolerance below the best's L_s,
    holds none (`problem.better`'s comparisons, on bounds) and is not searched (measured: the best's own multiset,
    settled at its cost, took the whole budget to search again on chain_clones 761003; on 1301005 and 1327011 its
    value is the cost less the walk point's 1e-12 margin, which half the tolerance did not admit)."""
    from flowmaker.selection.exact import _encoding
    from flowmaker.selection.problem import better

    budget = [TIE_KEEP_NODES]
    entries: list[Best] = [best]
    complete = True
    many = False
    for idx, ys in multisets.items():
        model = models[idx]
        for insts in ys:
            m = sum(pb.p_mem[pi] for pi in insts)
            # all reuse costs 0: only its L_s can tie or beat the best's
            cap = best[0][0] * (1 + 1e-9) / m if m > 0 else best[0][1] * (1 + 1e-9)
            got, done = _enumerate(model, insts, cap, deadline, budget, None, TIE_FOUND)
            entries.extend((sc, (model.pw, choice, slots, places)) for sc, choice, slots, places in got)
            complete = complete and done
            if not done:
                many = len(got) > TIE_FOUND
                break
    if complete:
        c = min(sc[0] for sc, _ in entries)
        left = [e for e in entries if e[0][0] <= c * (1 + 1e-12)]
        lat = min(sc[1] for sc, _ in left)
        left = [e for e in left if e[0][1] <= lat * (1 + 1e-12)]
        gpus = min(sc[2] for sc, _ in left)
        left = [e for e in left if e[0][2] == gpus]
        won = min(left, key=lambda e: (e[1][0].index, _encoding(e[1][1], e[1][2])))
        # The walks leave out profiles that another dominates; a tie on one that comes earlier in the request would
        # come first in the canonical order: then the canonical pass (which keeps those) decides.
        return won, not any(_left_out(pb, m) for m in models.values()), False
    if time.perf_counter() > deadline:
        return None
    budget = [TIE_NODES]
    for idx, ys in multisets.items():
        model = models[idx]
        for insts in ys:
            c, lat, gpus = best[0]
            m = sum(pb.p_mem[pi] for pi in insts)
            g = sum(pb.p_gpus[pi] for pi in insts)
            if m <= 0:  # all reuse, cost 0: better when the best costs more, or when shorter
                cap = INF if c > 0 else lat * (1 - 1e-12)
            elif m * lat > c * (1 + 1e-12) or g < gpus:  # a tie of cost may be better: shorter, or fewer GPUs
                cap = c * (1 + 1e-12) / m
            else:  # only a lower cost, or this cost with a shorter L_s
                v = values.get(idx, {}).get(insts, 0.0) if values is not None else 0.0
                if v >= c - REL_TOL * c and v / m >= lat - REL_TOL * lat:
                    continue  # its variants cost at least v, so L_s at least v / m: none is better (docstring)
                cap = max(c * (1 - 1e-12) / m, lat * (1 - 1e-12))
            got, done = _enumerate(model, insts, cap, deadline, budget, strict=True)
            if not done:
                return None
            for sc, choice, slots, places in got:
                if better(*sc, best[0]):
                    best = (sc, (model.pw, choice, slots, places))
    return best, False, many


def _left_out(pb: Problem, model: Any) -> bool:
    """Whether the walk of `model` left out a profile q that the canonical pass keeps (not dominated by an earlier
    one; accuracy met; placeable; some stage could run on it within lambda and its capacity) and that may tie: not
    when a walked profile p places the same (GPUs, memory per GPU, replicas), has no more memory, at least its
    capacity and is faster alone on every stage by more than 1e-9 relative, since then every variant on q has a
    variant on p placed alike, no busier, no more loaded, strictly shorter and no costlier. Not on a fan, where a
    parallel stage off the longest path may run faster and leave L_s as it was (measured: wide_fan 1373016 under
    sharing, a tp1 and its clone on such a stage, equal memory, tied)."""
    from flowmaker.selection.exact import _dominated, _placeable
    from flowmaker.selection.problem import leq

    pw = model.pw
    walked = sorted({ref for o in model.opts.values() for k, ref, _ in o if k == NEW})
    bv = pb.bound_view(pw)
    dom, place = _dominated(pb, by_earlier=True), _placeable(pb)

    fan = fan_of(pw) is not None  # a fan: a parallel stage off the longest path may be faster and leave L as it was

    def beaten(q: int) -> bool:
        return not fan and any(
            pb.p_k[p] == pb.p_k[q] and pb.p_need[p] == pb.p_need[q] and pb.p_reps[p] == pb.p_reps[q]
            and pb.p_mem[p] <= pb.p_mem[q] and pb.p_cap[p] >= pb.p_cap[q]
            and all(pw.lat_new[s][q] > pw.lat_new[s][p] * (1 + 1e-9) for s in pw.llm) for p in walked)

    return any(pb.p_ok[q] and not dom[q] and place[q] and q not in walked
               and any(leq(bv.lat_new[s][q], pb.lam) and leq(pw.load[s], pb.p_cap[q]) for s in pw.llm)
               and not beaten(q) for q in range(len(pb.profiles)))


def placed_value(model: Any, insts: Sequence[int], tool: float, val: float, cand: Candidate | None, inc: float,
                 cap_l: float, deadline: float, work: list[int] | None = None, first: Sequence[int] | None = None
                 ) -> tuple[float, Candidate | None]:
    """For the chain walk (`chain.walk_chain`), a multiset `insts` whose least relaxed cost `val` its variant `cand`
    (None: it did not place) does not reach: (a lower bound of the cost of every variant with exactly these new
    instances, the best candidate known for them). First `multiset_bound`; when that leaves the multiset at or below
    the incumbent `inc`, `settle_multiset` finds its least cost exactly (INF: none at or below `inc`), searching first
    the opening order `first` (the walk's assignment's) and stopping at a variant as cheap as the bound."""
    from flowmaker.selection.problem import better

    pb = model.pb
    m = sum(pb.p_mem[pi] for pi in insts)
    val = max(val, m * multiset_bound(pb, model.pw, model.opts, insts, tool, cap_l, deadline, work))
    if val == INF or val > inc * (1 + 1e-9):
        # (with no incumbent yet, cap_l is the latency target: INF proves that no variant has these instances,
        # which is how a walk proves an instance infeasible, and the search below may find the first variant)
        return val, cand
    got, done = settle_multiset(model, insts, inc * (1 + 1e-9), deadline, work, floor=val, first=first)
    if got is not None and (cand is None or better(*got[0], cand[0])):
        cand = got
    if done:  # its least cost; found within 1e-12 of the bound (the search may stop there): the bound, which holds
        val = INF if got is None else got[0][0] if got[0][0] > val * (1 + 1e-12) else min(val, got[0][0])
    return val, cand
