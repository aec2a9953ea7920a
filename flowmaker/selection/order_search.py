"""The depth-first searches of one opening order under GPU sharing (`sharing_chain._enumerate`): every assignment of
a chain's or a fan's LLM stages to the instances a placement leaves (`sharing_chain.placed_bins`), cut by the bounds
`sharing_chain._search_order` and `_search_order_fan` set up, each complete one checked from scratch (`_leaf`).

A module of its own so that it can run compiled (`flowmaker.native`, mypyc): the tie-break and the settling of a
multiset spend most of their time here, in plain float and integer arithmetic on lists (measured: 45% of the time of
31 chain_clones instances proven in 0.6-2 s under sharing). The arithmetic is the same in the compiled and the plain
module (C doubles, the same operations in the same order), so the answers are too. Nothing here imports
`sharing_chain`: the bins (`sharing_chain._Bin`) come in as plain objects and the tables as lists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from flowmaker.selection.problem import INF, NEW
from flowmaker.sharing import add_offered, occupancy

_MARGIN = 1e-7  # (`sharing_chain`'s margins: checks pass clearly or keep the variant for the exact check)


class _Co(NamedTuple):
    """A running instance as Feasibility 5.4 sees it (`_co_fails`); `rb` its reused bin in a search, else -1."""

    gpus: tuple[str, ...]
    b0: float
    rho0: float
    f0: float
    most: float  # its tolerance max_slowdown x (1 + EPS), margin added; INF when it has none
    rb: int


def _co_fails(c: _Co, busy: Mapping[str, float], b1: float, rho1: float, kappa: float, top: float) -> bool:
    """Whether running instance `c` fails Feasibility 5.4 in every variant whose GPUs' busy totals are at least
    `busy` (its own busy share `b1` among them, its compute share at least `rho1`; `top` = u (1 + EPS), margin
    added): the busy shares only grow as stages are added, so its co-residents' total on its most crowded GPU, f1 and
    x1 = rho1 f1 only grow. It must be clearly made slower (f1 above f0, so m1 > m0 whatever its own load) before the
    budget and its tolerance apply; m1 infinite fails whatever m0. Margins only keep a variant (the exact check
    decides)."""
    worst = 0.0
    for g in c.gpus:
        x = busy.get(g, 0.0) - b1
        if x > worst:
            worst = x
    f1 = 1.0 + kappa * worst
    x1 = rho1 * f1
    if x1 > 1.0 + _MARGIN:
        return True
    if not f1 > c.f0 * (1 + _MARGIN):
        return False
    if x1 > top:
        return True
    return c.most < INF and x1 < 1.0 - _MARGIN and f1 * (1 - c.rho0) / (1 - x1) > c.most


def _co_ok(cos: Sequence[_Co], units: Sequence[float], tot: Mapping[str, float], own: Sequence[float],
           fill: Sequence[float], kappa: float, top: float) -> bool:
    """The searches' Feasibility 5.4 check of the running instances `cos` beside a bin that just took a stage (the busy
    totals `tot` so far; a reused one at its bin's busy share and load, `units` the bins' loads at compute share 1):
    False when one fails every completion."""
    for c in cos:
        if c.rb >= 0:
            b1, rho1 = own[c.rb], fill[c.rb] / units[c.rb]
        else:
            b1, rho1 = c.b0, c.rho0
        if _co_fails(c, tot, b1, rho1, kappa, top):
            return False
    return True


def _busy_of(new: bool, busy0: float, reps: int, alone: float, rate: float) -> float:
    """A bin's busy share at least, its stages' latencies alone summing to `alone` (new: from nothing; reused: on its
    running share `busy0`)."""
    x = rate * alone
    got = occupancy(x / reps) if new else add_offered(busy0, x)
    return max(busy0, got * (1 - _MARGIN))


def _leaf(model: Any, assign: dict[int, tuple[str, int]], inst: dict[int, int], cap: list[float],
          out: list[Any], strict: bool | None, most: int, floor: float, deadline: float) -> bool:
    """A complete assignment of the searches: checked from scratch, kept when within the cap (which then tightens, as
    `sharing_chain._enumerate` says); False when the search ends here (out of time, past `most`, or at `floor`)."""
    if time.perf_counter() > deadline:
        return False  # (a leaf is checked from scratch: up to 5 ms under sharing, so the clock is read here too)
    got = model.realize(assign, inst)
    if got is not None and got[0][1] <= cap[0]:
        out.append(got)
        if strict is None:
            return len(out) <= most
        cap[0] = got[0][1] * (1 - 1e-12) if strict else got[0][1]
        if got[0][1] <= floor * (1 + 1e-12):
            return False  # no variant is shorter (but for the spec's 1e-12 of a tie): a least one
    return True


def _opening_cut(k_new: int, opened: int, left: int, first: list[float], first_left: list[float]) -> bool:
    """Whether the searches' opening rule cuts a partial assignment: fewer stages `left` than new instances still to
    open, or some instance i - 1 that can no longer open before instance i (another order's search has it)."""
    if k_new - opened > left:
        return True
    for i in range(1, k_new):
        if min(first[i - 1], first_left[i - 1]) > first[i]:
            return True
    return False


def _room_cut(cap: list[float], fill: list[float], min_ld: list[float], load_left: float) -> bool:
    """Whether the load of the stages left cannot fit the room the bins have left (a bin's room counts only when
    some stage left that may use it fits)."""
    room = 0.0
    for bi in range(len(cap)):
        r = cap[bi] - fill[bi]
        if r >= min_ld[bi]:
            room += r
    return load_left > room * (1 + 1e-9) + 1e-9


def _worst(tot: Mapping[str, float], gpus: Sequence[str], own: float) -> float:
    """The largest busy total of `gpus` less `own` (0.0 when there are none), as `max(..., default=0.0)`."""
    worst = 0.0
    seen = False
    for g in gpus:
        x = tot[g] - own
        if not seen or x > worst:
            worst, seen = x, True
    return worst


class Bins:
    """The bins of one opening order as the searches read them: per bin its figures (`sharing_chain._Bin`'s) in
    lists, so that the compiled search reads them without attribute lookups."""

    def __init__(self, bins: Sequence[Any]) -> None:
        self.new: list[bool] = [b.kind == NEW for b in bins]
        self.kind: list[str] = [b.kind for b in bins]
        self.ref: list[int] = [b.ref for b in bins]
        self.i: list[int] = [b.i for b in bins]
        self.cap: list[float] = [b.cap for b in bins]
        self.f: list[float] = [b.f for b in bins]
        self.unit: list[float] = [b.unit for b in bins]
        self.load0: list[float] = [b.load0 for b in bins]
        self.busy0: list[float] = [b.busy0 for b in bins]
        self.reps: list[int] = [b.reps for b in bins]
        self.amax: list[float] = [b.amax for b in bins]
        self.gpus: list[list[str]] = [[g for gids in b.gpus for g in gids] for b in bins]  # (each replica's, in turn)
        self.lb: list[dict[int, float]] = [b.lb for b in bins]
        self.alone: list[dict[int, float]] = [b.alone for b in bins]


def search_chain(model: Any, llm: list[int], loads: list[float], topo: Mapping[int, int], mult_lb: Callable[[float, float], float],
                 bins: Bins, k_new: int, cap: list[float], out: list[Any], strict: bool | None, most: int,
                 budget: list[int], deadline: float, floor: float, kappa: float, rate: float, top: float,
                 by_stage: list[list[tuple[float, int]]], ld_suf: list[float], min_ld: list[list[float]],
                 first_left: list[list[float]], tot: dict[str, float], own: list[float], gpus_of: list[list[str]],
                 near: list[list[int]], co: list[list[_Co]], rem: list[float], mu: list[float], rem_mu: list[float],
                 pen: float, tool: float) -> bool:
    """`sharing_chain._search_order`'s depth-first search of a chain (its docstring and `_enumerate`'s), from its
    tables: `loads` per position in `llm`, `mult_lb` the state's `multiplier_lb`, `rem` and `rem_mu` the stages
    j.. at their least bounds and at their Lagrangian bounds with prices `mu` (`pen` their room's price)."""
    n = len(llm)
    first = [INF] * k_new  # per new bin, its earliest stage so far
    nb = len(bins.cap)
    fill = list(bins.load0)
    used = [0] * nb
    alone = [0.0] * nb
    lbs = [0.0] * nb
    contrib = [0.0] * nb
    bcap, bamax, bnew, bf, bunit = bins.cap, bins.amax, bins.new, bins.f, bins.unit
    assign: dict[int, tuple[str, int]] = {}
    inst: dict[int, int] = {}
    opened = [0]
    pen_l = [pen]

    def contrib_of(bi: int) -> float:
        if not alone[bi]:
            return 0.0
        f = max(bf[bi], 1.0 + kappa * _worst(tot, gpus_of[bi], own[bi]))
        return max(lbs[bi], alone[bi] * mult_lb(f, fill[bi] / bunit[bi]))

    def rest_ok(j: int, part: float) -> bool:
        """Whether the stages j.. may still complete within the cap, each at its least bound on a bin that has room
        for it now (a bin's room only shrinks); a stage that no bin has room for: no completion."""
        lim = cap[0]
        t = part
        for jj in range(j, n):
            ld = loads[jj]
            found = False
            for lb, bi in by_stage[jj]:
                if fill[bi] + ld <= bcap[bi]:
                    t += lb
                    found = True
                    break
            if not found or t > lim:
                return False
        return True

    def go(j: int, part: float) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or (budget[0] & 255 == 0 and time.perf_counter() > deadline):
            return False
        if _opening_cut(k_new, opened[0], n - j, first, first_left[j]):
            return True
        if j == n:
            return _leaf(model, assign, inst, cap, out, strict, most, floor, deadline)
        if _room_cut(bcap, fill, min_ld[j], ld_suf[j]):
            return True
        if part + rem_mu[j] - pen_l[0] > cap[0] * (1 + 1e-9):
            return True
        s, ld = llm[j], loads[j]
        for lb, bi in by_stage[j]:
            if part + lb + rem[j + 1] > cap[0]:
                break  # fastest first
            a_s = bins.alone[bi][s]
            if fill[bi] + ld > bcap[bi] or alone[bi] + a_s > bamax[bi]:
                continue
            f0, a0, l0, o0 = fill[bi], alone[bi], lbs[bi], own[bi]
            saved_c = [contrib[bk] for bk in near[bi]]
            saved_t = [tot[g] for g in gpus_of[bi]]
            fill[bi], alone[bi], lbs[bi] = f0 + ld, a0 + a_s, l0 + lb
            own[bi] = _busy_of(bnew[bi], bins.busy0[bi], bins.reps[bi], alone[bi], rate)
            d = own[bi] - o0
            if d:
                for g in bins.gpus[bi]:
                    tot[g] += d
            p2 = part
            for bk in near[bi]:
                c = contrib_of(bk)
                p2 += c - contrib[bk]
                contrib[bk] = c
            if p2 + rem[j + 1] <= cap[0] and (not co[bi] or _co_ok(co[bi], bunit, tot, own, fill, kappa, top)) \
                    and rest_ok(j + 1, p2):
                used[bi] += 1
                pen_l[0] -= mu[bi] * ld
                opened[0] += bnew[bi] and used[bi] == 1
                assign[s] = (bins.kind[bi], bins.ref[bi])
                first_b = INF
                if bnew[bi]:
                    inst[s] = bins.i[bi]
                    first_b = first[bi]
                    first[bi] = min(first_b, topo[s])
                else:
                    inst.pop(s, None)
                ok = go(j + 1, p2)
                if bnew[bi]:
                    first[bi] = first_b
                opened[0] -= bnew[bi] and used[bi] == 1
                pen_l[0] += mu[bi] * ld
                used[bi] -= 1
            else:
                ok = True
            fill[bi], alone[bi], lbs[bi], own[bi] = f0, a0, l0, o0
            for bk, c in zip(near[bi], saved_c, strict=True):
                contrib[bk] = c
            for g, t in zip(gpus_of[bi], saved_t, strict=True):
                tot[g] = t
            if not ok:
                return False
        return True

    return go(0, tool)


def search_fan(model: Any, llm: list[int], loads: list[float], topo: Mapping[int, int],
               mult_lb: Callable[[float, float], float], bins: Bins, k_new: int, cap: list[float], out: list[Any],
               strict: bool | None, most: int, budget: list[int], deadline: float, floor: float, kappa: float,
               rate: float, top: float, by_stage: list[list[tuple[float, int]]], ld_suf: list[float],
               min_ld: list[list[float]], first_left: list[list[float]], tot: dict[str, float], own: list[float],
               gpus_of: list[list[str]], near: list[list[int]], co: list[list[_Co]], par: list[bool],
               rem_p: list[float], rem_g: list[float], tool: float) -> bool:
    """`sharing_chain._search_order_fan`'s depth-first search (its docstring), from its tables: `par` whether each
    position in `llm` is a parallel stage, `rem_p` and `rem_g` the path stages j.. at their least bounds summed and
    the parallel ones' largest."""
    n = len(llm)
    first = [INF] * k_new
    nb = len(bins.cap)
    fill = list(bins.load0)
    used = [0] * nb
    alone = [0.0] * nb
    cur = [0.0] * n  # each placed stage's bound now
    on: list[list[int]] = [[] for _ in range(nb)]  # the placed stages (positions in llm) on each bin
    bcap, bamax, bnew, bf, bunit = bins.cap, bins.amax, bins.new, bins.f, bins.unit
    assign: dict[int, tuple[str, int]] = {}
    inst: dict[int, int] = {}
    opened = [0]

    def mult(bi: int) -> float:
        return float(mult_lb(max(bf[bi], 1.0 + kappa * _worst(tot, gpus_of[bi], own[bi])), fill[bi] / bunit[bi]))

    def placed_l(k: int, j: int) -> tuple[float, float]:
        """(tool + the path stages ..k-1's bounds now + the path stages j.. at their least, the largest parallel
        bound over the stages ..k-1 now and the stages j.. at their least)."""
        p_, g_ = tool + rem_p[j], rem_g[j]
        for jj in range(k):
            if par[jj]:
                g_ = max(g_, cur[jj])
            else:
                p_ += cur[jj]
        return p_, g_

    def go(j: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or (budget[0] & 255 == 0 and time.perf_counter() > deadline):
            return False
        if _opening_cut(k_new, opened[0], n - j, first, first_left[j]):
            return True
        if j == n:
            return _leaf(model, assign, inst, cap, out, strict, most, floor, deadline)
        if _room_cut(bcap, fill, min_ld[j], ld_suf[j]):
            return True
        s, ld = llm[j], loads[j]
        p0, g0 = placed_l(j, j + 1)  # (stage j at none: its bound is added below)
        for lb, bi in by_stage[j]:
            if (p0 + max(g0, lb) if par[j] else p0 + lb + g0) > cap[0]:
                break  # fastest first
            a_s = bins.alone[bi][s]
            if fill[bi] + ld > bcap[bi] or alone[bi] + a_s > bamax[bi]:
                continue
            f0, a0, o0 = fill[bi], alone[bi], own[bi]
            saved_t = [tot[g] for g in gpus_of[bi]]
            saved_c = [(jj, cur[jj]) for bk in near[bi] for jj in on[bk]]
            fill[bi], alone[bi] = f0 + ld, a0 + a_s
            own[bi] = _busy_of(bnew[bi], bins.busy0[bi], bins.reps[bi], alone[bi], rate)
            d = own[bi] - o0
            if d:
                for g in bins.gpus[bi]:
                    tot[g] += d
            on[bi].append(j)
            for bk in near[bi]:
                m = mult(bk)
                lb_k, alone_k = bins.lb[bk], bins.alone[bk]
                for jj in on[bk]:
                    cur[jj] = max(lb_k[llm[jj]], alone_k[llm[jj]] * m)
            p2, g2 = placed_l(j + 1, j + 1)
            if p2 + g2 <= cap[0] and (not co[bi] or _co_ok(co[bi], bunit, tot, own, fill, kappa, top)):
                used[bi] += 1
                opened[0] += bnew[bi] and used[bi] == 1
                assign[s] = (bins.kind[bi], bins.ref[bi])
                first_b = INF
                if bnew[bi]:
                    inst[s] = bins.i[bi]
                    first_b = first[bi]
                    first[bi] = min(first_b, topo[s])
                else:
                    inst.pop(s, None)
                ok = go(j + 1)
                if bnew[bi]:
                    first[bi] = first_b
                opened[0] -= bnew[bi] and used[bi] == 1
                used[bi] -= 1
            else:
                ok = True
            on[bi].pop()
            fill[bi], alone[bi], own[bi] = f0, a0, o0
            for g, t in zip(gpus_of[bi], saved_t, strict=True):
                tot[g] = t
            for jj, c in saved_c:
                cur[jj] = c
            if not ok:
                return False
        return True

    return go(0)
