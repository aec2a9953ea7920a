"""The least latency of a chain for a fixed multiset of new instances, by bin completion (issue 24).

`chain.walk_chain` needs, for a multiset y of new instances, the least total latency L(y) of an assignment of the
chain's LLM stages (items: load, options) to bins (the running instances with room, and the y instances) with every
bin within its capacity. With near-identical clones this is a bin-packing problem in disguise: the latencies are
nearly proportional to the load, so the least L fills the fast bins as full as the loads allow, and a bound that
prices capacity (the LP's duals) cannot see the room a packing must waste. The stage-by-stage search of
`chain.walk_chain` and a MILP then need thousands of nodes to close a gap of a fraction of a percent.

Here the search decides bin by bin (bin completion): bins in order of their capacity price, most contested first;
for each bin, depth first over the subsets of the remaining stages it may take (heaviest first, the empty set
included), then the next bin. Bins of one new profile are identical: the first (heaviest) stage of each is later
in the order than the first stage of the bin before (an empty bin is followed only by empty bins of its profile),
which breaks their symmetry without losing any packing (any packing sorts its identical bins so). The bound at every node is a Lagrangian relaxation with the capacity prices mu
(any mu >= 0 is valid):

    L >= partial + sum over undecided stages of min over the bins still open (lat + mu * load)
                 - sum over the open bins of mu * (their room left)

where the stages already skipped by the current bin may use only the bins after it. Once a bin is closed its
unused room is no longer priced, so the waste of a packing raises the bound at once, which is what the
stage-by-stage bound misses. It also prunes when the load left exceeds the room of the bins left. Capacity is
checked as `problem.leq(base + fill + load, capacity)`, as the spec's checks do. A state (next bin, the stages left)
reached again at no lower latency so far is not searched again. The search is exact when it
finishes within its node limit (the least L <= cap_l, or None when nothing fits within cap_l).

`least_l_classes` answers the same question by classes instead (the walk's first tool): a stage's latency depends
only on the class of its bin (a running instance, or the identical instances of one profile), so it decides each
stage's class, heaviest stage first, fastest class first, under the same Lagrangian bound, and an exact packing
oracle (memoized per class and set of stages) says whether a class of several bins still holds its stages. The
bins of one class are never branched on, which is the symmetry the clones create (measured on the packings that
chain_clones left open: 0.003-0.4 s where HiGHS takes 0.1-2 s, same least L). Its bound prices only room the
stages can use: a class's room is cut at the root to what subsets of the stages that may use it can fill
(`max_fill`), and at every node the room left beyond the load of the stages left that may use it (or below the
least of them) is taken out of the penalty. The oracle packs by bin completion (`_pack_exact`). On chain_clones
seed 613000 these took the class search from 48 to 55 of 60 instances proven within 1 s.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from functools import lru_cache

from flowmaker.selection.problem import INF, NEW, leq_limit

_CHECK = 4096  # search nodes between two looks at the clock (the caller's final deadline only)
Bin = tuple[str, int, int, float, float]  # (kind, ref, bin index within the profile, base load, capacity)
FILL_ITEMS = 26  # max_fill's limit: meet in the middle over 2^13 sums a side; more loads than this are not tightened


@lru_cache(maxsize=4096)
def max_fill(ws: tuple[float, ...], limit: float) -> float:
    """An upper bound of the load any subset of ws can put within `limit`: the largest subset sum <= limit (meet
    in the middle), raised by a rounding slack (sums added in another order may differ in the last bits); `limit`
    itself for more than FILL_ITEMS loads. A bin's room that no subset of its possible stages fills is room a
    bound must not price: a running instance with 195 units of room and stages of 61, 90, 98, 108, 124, 189, ...
    takes at most 189 (chain_clones 613010: that 6-unit waste is most of the gap between the LP's bound and the
    least L)."""
    if len(ws) > FILL_ITEMS or limit <= 0:
        return limit
    lim = limit * (1 + 1e-9) + 1e-9

    def sums(part: tuple[float, ...]) -> list[float]:
        out = [0.0]
        for w in part:
            out += [a + w for a in out if a + w <= lim]
        return out

    h = len(ws) // 2
    a_s = sums(ws[:h])
    b_s = sorted(sums(ws[h:]))
    best = 0.0
    for a in a_s:
        i = bisect_right(b_s, lim - a)
        if i:
            best = max(best, a + b_s[i - 1])
    return min(limit, best + 1e-9 * max(1.0, best))


def least_l_bins(so: Sequence[Sequence[tuple[float, str, int]]], loads: Sequence[float], bins: Sequence[Bin],
                 mu: dict[tuple[str, int], float], tool: float, cap_l: float, node_limit: int,
                 deadline: float = INF) -> tuple[float, list[tuple[str, int, int]] | None, bool, int]:
    """(least L <= cap_l, the assignment per stage (kind, ref, bin), True, nodes) when the search finishes:
    (cap_l, None, True, nodes) when nothing fits within cap_l. When it gives up after node_limit nodes (or at
    the caller's final deadline): (a lower bound of the least L, the best assignment found or None, False,
    nodes)."""
    n = len(so)
    lat_of: list[dict[tuple[str, int], float]] = []
    for opts in so:
        d: dict[tuple[str, int], float] = {}
        for lat, k, ref in opts:
            if (k, ref) not in d or lat < d[(k, ref)]:
                d[(k, ref)] = lat
        lat_of.append(d)
    # bins in order: most contested class first (highest price), a class's bins together
    order = sorted(range(len(bins)), key=lambda b: (-mu.get((bins[b][0], bins[b][1]), 0.0), bins[b][0], bins[b][1],
                                                    bins[b][2]))
    bl = [bins[b] for b in order]
    nb = len(bl)
    keys = [(k, ref) for k, ref, _, _, _ in bl]
    rooms = [max(0.0, cp - base) for _, _, _, base, cp in bl]
    same_prev = [i > 0 and bl[i][0] == NEW and keys[i] == keys[i - 1] for i in range(nb)]
    # mc[i][j]: min over the classes of bins >= i that stage j may use of lat + mu * load (Lagrangian), and of lat
    mcl = [[INF] * n for _ in range(nb + 1)]
    mc0 = [[INF] * n for _ in range(nb + 1)]
    for i in range(nb - 1, -1, -1):
        key = keys[i]
        m_c = mu.get(key, 0.0)
        for j in range(n):
            a, b = mcl[i + 1][j], mc0[i + 1][j]
            lt = lat_of[j].get(key)
            if lt is not None:
                a = min(a, lt + m_c * loads[j])
                b = min(b, lt)
            mcl[i][j], mc0[i][j] = a, b
    pen_suf = [0.0] * (nb + 1)  # priced room of bins > i (all unused when bin i is being filled)
    room_suf = [0.0] * (nb + 1)
    for i in range(nb - 1, -1, -1):
        pen_suf[i] = pen_suf[i + 1] + mu.get(keys[i], 0.0) * rooms[i]
        room_suf[i] = room_suf[i + 1] + rooms[i]

    best_l = [cap_l]
    best_a: list[list[tuple[str, int, int]] | None] = [None]
    cur: list[tuple[str, int, int]] = [("", 0, 0)] * n
    nodes = [0]
    limit = node_limit

    def prune(bound: float) -> bool:
        if best_a[0] is None:
            return bound > best_l[0] * (1 + 1e-12)
        return bound >= best_l[0] * (1 - 1e-12)

    seen: dict[tuple[int, int, int], float] = {}

    def open_bin(i: int, remaining: list[int], part: float, prev_first: int) -> bool:
        """Fill bin i (and the rest) with the stages `remaining`; False when the node limit is hit."""
        if not remaining:
            if part < best_l[0] or (best_a[0] is None and part <= best_l[0] * (1 + 1e-12)):
                best_l[0] = part
                best_a[0] = list(cur)
            return True
        if i == nb:
            return True
        # The same stages left for the same bins (and the same symmetry limit) after a cheaper or equal start:
        # that subtree was searched in full already (a search cut short returns False at once).
        state = (i, sum(1 << j for j in remaining), prev_first if same_prev[i] else -1)
        old = seen.get(state)
        if old is not None and part >= old:
            return True
        seen[state] = part
        load_left = sum(loads[j] for j in remaining)
        if load_left > room_suf[i] * (1 + 1e-9) + 1e-9:
            return True
        k, ref, bidx, base, cp = bl[i]
        top = leq_limit(cp)
        key = keys[i]
        m_c = mu.get(key, 0.0)
        und_l = sum(mcl[i][j] for j in remaining)
        und_0 = sum(mc0[i][j] for j in remaining)
        if und_l == INF or und_0 == INF:
            return True
        lim = prev_first if same_prev[i] else -1  # identical bins: every stage of this bin comes after lim
        r = len(remaining)
        nxt_l, nxt_0 = mcl[i + 1], mc0[i + 1]
        cur_l, cur_0 = mcl[i], mc0[i]
        lat_j = lat_of
        chosen: list[int] = []
        skipped: list[int] = []

        def sub(p: int, fill: float, first: int, s_l: float, s_0: float, u_l: float, u_0: float,
                k_l: float, k_0: float) -> bool:
            # s: latency of the stages chosen for bin i; u: undecided (may use bins >= i); k: skipped (bins > i)
            nodes[0] += 1
            if nodes[0] > limit or (not nodes[0] % _CHECK and time.perf_counter() > deadline):
                return False
            # The room bin i still prices is at most what the stages not yet considered for it can fill: the
            # others are in it or skipped (a tighter capacity row, so still a Lagrangian bound).
            room_i = cp - base - fill
            if m_c > 0.0:
                can = 0.0
                for q in range(p, r):
                    jq = remaining[q]
                    if jq > lim and key in lat_j[jq] and base + fill + loads[jq] <= top:
                        can += loads[jq]
                        if can >= room_i:
                            break
                room_i = min(room_i, can)
            b_l = part + s_l + u_l + k_l - m_c * room_i - pen_suf[i + 1]
            b_0 = part + s_0 + u_0 + k_0
            if prune(max(b_l, b_0)):
                return True
            if p == r:
                for j in chosen:
                    cur[j] = (k, ref, bidx)
                rest = skipped[:]
                return open_bin(i + 1, rest, part + s_0, first)
            j = remaining[p]
            lat = lat_j[j].get(key)
            # include j (first: fuller bins first)
            if lat is not None and j > lim and base + fill + loads[j] <= top:
                chosen.append(j)
                ok = sub(p + 1, fill + loads[j], min(first, j), s_l + lat, s_0 + lat, u_l - cur_l[j],
                         u_0 - cur_0[j], k_l, k_0)
                chosen.pop()
                if not ok:
                    return False
            # skip j: it goes to a later bin
            if nxt_l[j] == INF:
                return True
            skipped.append(j)
            ok = sub(p + 1, fill, first, s_l, s_0, u_l - cur_l[j], u_0 - cur_0[j],
                     k_l + nxt_l[j], k_0 + nxt_0[j])
            skipped.pop()
            return ok

        return sub(0, 0.0, n, 0.0, 0.0, und_l, und_0, 0.0, 0.0)

    done = open_bin(0, list(range(n)), tool, n)
    if done:
        if best_a[0] is None:
            return cap_l, None, True, nodes[0]
        return best_l[0], best_a[0], True, nodes[0]
    return -INF, best_a[0], False, nodes[0]


def least_l_classes(so: Sequence[Sequence[tuple[float, str, int]]], loads: Sequence[float], bins: Sequence[Bin],
                    mu: dict[tuple[str, int], float], tool: float, cap_l: float, node_limit: int,
                    deadline: float = INF) -> tuple[float, list[tuple[str, int, int]] | None, bool, int]:
    """`least_l_bins`' question, searched class by class: a stage's latency depends only on its bin's class (a
    running instance, or all new instances of one profile), so the search decides each stage's class (stages
    heaviest first, classes fastest first) and asks an exact packing oracle whether the stages of a class of
    several identical bins still fit them. Branching on the bins of one class instead would search the same
    latency once per bin; here each class assignment is searched once. The bound is the Lagrangian one with the
    capacity prices mu, as in `least_l_bins`, and so are the returns; it also gives up at the final deadline
    (the caller's budget; its work is limited by node_limit)."""
    n = len(so)
    keys: list[tuple[str, int]] = []
    base: list[float] = []
    cap: list[float] = []
    count: list[int] = []
    for k, ref, _, b0, cp in bins:
        if (k, ref) in keys:
            count[keys.index((k, ref))] += 1
            continue
        keys.append((k, ref))
        base.append(b0)
        cap.append(cp)
        count.append(1)
    ci = {c: i for i, c in enumerate(keys)}
    nc = len(keys)
    room_tot = [count[c] * (cap[c] * (1 + 1e-9) + 1e-9 - base[c]) for c in range(nc)]
    top = [leq_limit(cp) for cp in cap]
    opts: list[list[tuple[float, int]]] = []
    for opt in so:
        best: dict[int, float] = {}
        for lat, k, ref in opt:
            c = ci.get((k, ref))
            if c is not None and (c not in best or lat < best[c]):
                best[c] = lat
        opts.append(sorted(((lat, c) for c, lat in best.items()), key=lambda o: (o[0], o[1])))
    elig_of: list[list[float]] = [[] for _ in range(nc)]  # the loads of the stages that may use each class
    for j in range(n):
        for _, c in opts[j]:
            elig_of[c].append(loads[j])
    for c in range(nc):  # a class's room, as far as subsets of the stages that may use it can fill it
        elig = tuple(sorted(elig_of[c], reverse=True))
        one = max_fill(elig, cap[c] * (1 + 1e-9) + 1e-9 - base[c])
        room_tot[c] = min(room_tot[c], count[c] * one, max_fill(elig, room_tot[c]) if count[c] > 1 else one)
    mu_c = [mu.get(keys[c], 0.0) for c in range(nc)]
    rem = [0.0] * (n + 1)
    rem_mu = [0.0] * (n + 1)
    for j in range(n - 1, -1, -1):
        if not opts[j]:
            return cap_l, None, True, 0
        rem[j] = rem[j + 1] + opts[j][0][0]
        rem_mu[j] = rem_mu[j + 1] + min(lat + mu_c[c] * loads[j] for lat, c in opts[j])
    ld_suf = [0.0] * (n + 1)
    for j in range(n - 1, -1, -1):
        ld_suf[j] = ld_suf[j + 1] + loads[j]
    # min_ld[j][c]: the least load of the stages j.. that may use class c (room below it is wasted)
    min_ld = [[INF] * nc for _ in range(n + 1)]
    for j in range(n - 1, -1, -1):
        row = min_ld[j] = list(min_ld[j + 1])
        for _, c in opts[j]:
            row[c] = min(row[c], loads[j])
    # elig_suf[j][c]: the load of the stages j.. that may use class c (room beyond it is unused)
    elig_suf = [[0.0] * nc for _ in range(n + 1)]
    for j in range(n - 1, -1, -1):
        row_e = elig_suf[j] = list(elig_suf[j + 1])
        for _, c in opts[j]:
            row_e[c] += loads[j]
    # per class: the stages on it (in order), the load on it, and (several bins) a packing of them
    members: list[list[int]] = [[] for _ in range(nc)]
    load_c = [0.0] * nc
    packs: list[list[float]] = [[0.0] * count[c] for c in range(nc)]
    memo: dict[tuple[int, int], list[int] | None] = {}
    nodes = [0]

    next_check = [_CHECK]

    def step() -> bool:
        """Count one node (of the search or its oracle); False at the node limit or the deadline."""
        nodes[0] += 1
        if nodes[0] > node_limit:
            return False
        if nodes[0] >= next_check[0]:
            next_check[0] = nodes[0] + _CHECK
            if time.perf_counter() > deadline:
                return False
        return True

    def packing(c: int, items: list[int]) -> list[int] | None:
        mask = 0
        for j in items:
            mask |= 1 << j
        key = (c, mask)
        got = memo.get(key, _MISS)
        if got is _MISS:
            got = memo[key] = _pack_exact([loads[j] for j in items], count[c], base[c], cap[c], step)
        return got  # type: ignore[return-value]

    best_l = [cap_l]
    best_a: list[list[int] | None] = [None]
    cur = [0] * n
    pen = [sum(mu_c[c] * room_tot[c] for c in range(nc))]

    def go(j: int, part: float) -> bool:
        if not step():
            return False
        if j == n:
            if part < best_l[0] or (best_a[0] is None and part <= best_l[0] * (1 + 1e-12)):
                best_l[0] = part
                best_a[0] = list(cur)
            return True
        # The room left that the stages left cannot use (less than the least of them that may use it, or more
        # than all of them together) is priced out of the penalty: the bound rises by it (mu >= 0, still valid).
        # The load left must fit the room they can use (a relaxation of the packing: it prunes only infeasible
        # nodes).
        row = min_ld[j]
        erow = elig_suf[j]
        room = 0.0
        unused = 0.0
        for c in range(nc):
            r = room_tot[c] - load_c[c]
            if r >= row[c] * (1 - 1e-9):
                if r > erow[c]:
                    unused += mu_c[c] * (r - erow[c])
                    r = erow[c]
                room += r
            elif r > 0.0:
                unused += mu_c[c] * r
        nb = max(rem[j], rem_mu[j] - pen[0] + unused) + part
        if nb > best_l[0] * (1 + 1e-12) or (best_a[0] is not None and nb >= best_l[0] * (1 - 1e-12)):
            return True
        if ld_suf[j] > room * (1 + 1e-9) + 1e-9:
            return True
        w = loads[j]
        for lat, c in opts[j]:
            if part + lat + rem[j + 1] > best_l[0] * (1 + 1e-12):
                break
            if best_a[0] is not None and part + lat + rem[j + 1] >= best_l[0] * (1 - 1e-12):
                break
            if count[c] == 1:
                if not base[c] + load_c[c] + w <= top[c]:
                    continue
            elif load_c[c] + w > room_tot[c]:
                continue
            ms = members[c]
            ms.append(j)
            old_pk = packs[c]
            if count[c] > 1:
                # first fit into the packing kept for this class, else the exact oracle (a new packing)
                b_ff = -1
                bc, tc = base[c], top[c]
                for b in range(count[c]):
                    if bc + old_pk[b] + w <= tc:
                        b_ff = b
                        break
                if b_ff >= 0:
                    new_pk = list(old_pk)
                    new_pk[b_ff] += w
                else:
                    try:
                        got = packing(c, ms)
                    except _Stop:
                        ms.pop()
                        return False
                    if got is None:
                        ms.pop()
                        continue
                    new_pk = [0.0] * count[c]
                    for jj, b in zip(ms, got, strict=True):
                        new_pk[b] += loads[jj]
                packs[c] = new_pk
            old_load, old_pen = load_c[c], pen[0]
            load_c[c] += w
            pen[0] -= mu_c[c] * w
            cur[j] = c
            ok = go(j + 1, part + lat)
            load_c[c], pen[0] = old_load, old_pen  # restored, not subtracted back: no float drift
            packs[c] = old_pk
            ms.pop()
            if not ok:
                return False
        return True

    done = go(0, tool)

    def out(a: list[int]) -> list[tuple[str, int, int]]:
        """Per stage (kind, ref, bin): each class's stages packed into its bins."""
        res: list[tuple[str, int, int]] = [("", 0, 0)] * n
        for c in range(nc):
            items = [j for j in range(n) if a[j] == c]
            got = _pack_exact([loads[j] for j in items], count[c], base[c], cap[c], lambda: True)
            assert got is not None  # the search checked it
            for j, b in zip(items, got, strict=True):
                res[j] = (keys[c][0], keys[c][1], b)
        return res

    if done:
        if best_a[0] is None:
            return cap_l, None, True, nodes[0]
        return best_l[0], out(best_a[0]), True, nodes[0]
    return -INF, out(best_a[0]) if best_a[0] is not None else None, False, nodes[0]


_MISS = object()  # not in a memo yet (None is a memoized "does not fit")


class _Stop(Exception):
    """The search's node limit or the caller's deadline was reached inside the packing oracle."""


def _pack_exact(ws: list[float], nbins: int, base: float, cap: float, step: Callable[[], bool]) -> list[int] | None:
    """The bin of each load of ws in nbins identical bins, each holding `base` already, within `cap` as
    `problem.leq` admits, or None when they do not fit: exact, by bin completion (Korf): bins are filled one at a
    time, each with the heaviest load left plus a subset of the others, heaviest first, whose sum leaves no more
    than the other bins can hold; a set of loads that failed for k bins is not tried again. Loads are added to a
    bin heaviest first, as `base + fill + load <= limit`. Each node calls step(), which counts it; raises _Stop
    when step() returns False. (Item by item, a packing at 98% fill that does not exist took 1.2 million nodes
    to refute on chain_clones 613044; bin by bin, 1,800.)"""
    n = len(ws)
    order = sorted(range(n), key=lambda i: -ws[i])
    w = [ws[i] for i in order]
    top = leq_limit(cap)
    room = top - base + 1e-9 * max(1.0, abs(top), abs(base))  # what one bin takes, rounded up: pruning only
    bin_of = [0] * n  # per position in w
    failed: set[tuple[int, int]] = set()

    def fill_bins(mask: int, k: int, b: int) -> bool:
        """Whether the loads in `mask` (bits over w) fit in k bins, numbered from b."""
        if mask == 0:
            return True
        if k == 0 or (mask, k) in failed:
            return False
        if not step():
            raise _Stop
        items = [i for i in range(n) if mask >> i & 1]
        total = 0.0
        for i in items:
            total += w[i]
        # this bin takes at least what the other k - 1 cannot (lowered by a rounding slack: sums in another order)
        lo = total - (k - 1) * room - 1e-9 * max(1.0, total)
        if total > k * room or not base + 0.0 + w[items[0]] <= top:
            failed.add((mask, k))
            return False
        rest = items[1:]
        m = len(rest)
        suf = [0.0] * (m + 1)
        for q in range(m - 1, -1, -1):
            suf[q] = suf[q + 1] + w[rest[q]]
        bin_of[items[0]] = b

        def sub(p: int, fill: float, used: int) -> bool:
            if fill >= lo and fill_bins(mask & ~used, k - 1, b + 1):
                return True
            if fill + suf[p] < lo:
                return False
            prev = -1.0
            for q in range(p, m):
                i = rest[q]
                wi = w[i]
                if wi == prev or not base + fill + wi <= top:
                    continue  # an equal load was just tried in this place, or it does not fit
                if not step():
                    raise _Stop
                prev = wi
                bin_of[i] = b
                if sub(q + 1, fill + wi, used | (1 << i)):
                    return True
            return False

        if sub(0, w[items[0]], 1 << items[0]):
            return True
        failed.add((mask, k))
        return False

    if not fill_bins((1 << n) - 1, nbins, 0):
        return None
    where = [0] * n
    for p, i in enumerate(order):
        where[i] = bin_of[p]
    return where
