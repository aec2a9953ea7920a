"""A chain packing's least latency by patterns: the knapsacks of its bound, the patterns within its gap, an exact cover.

`chain.walk_chain` asks, for a multiset of new instances, the least total latency of an assignment of the chain's
LLM stages to bins (running instances with room, the multiset's identical new instances of each profile) that keeps
every bin within its capacity: a generalized assignment problem whose weights (the stages' loads) do not depend on
the bin. With near-identical clones thousands of packings lie within a fraction of a percent of each other, and a
search that relaxes capacity (the class search, HiGHS on the assignment MILP) needs thousands of nodes to tell them
apart (measured on the chain_clones packings left open at 2 s: HiGHS 0.4-12 s each).

A *pattern* of a class is a set of stages that fits ONE of its bins. For stage prices pi (any reals) the Lagrangian
bound over patterns is

    L - tool >= LB(pi) = sum_j pi_j + sum_c count_c x min(0, m_c),   m_c = min over patterns p of c of e'(p),
    e'(p) = sum_{j in p} (lat_jc - pi_j),

since every packing uses at most count_c patterns of class c and covers each stage once. m_c is a knapsack (here
`knapsack`, exact, or its fractional bound when it runs out of nodes: a lower m_c keeps LB valid). Column generation
(`chain._least_l_patterns`, HiGHS for the master LP) makes it tight: it is the Dantzig-Wolfe bound, 0.001-0.6% under
the least L on those packings where the LP bound is 0.1-1.5% under. For a packing of total latency z,

    z - tool >= LB(pi) + sum over its patterns of e(p),   e(p) = e'(p) - min(0, m_c) >= 0,

so a packing with z - tool <= U uses only patterns with e(p) <= U - LB: with a good incumbent U they are few
(`enumerate_patterns`), and the least cover of the stages by them (`exact_cover`, depth first, bounded by the same
inequality) is the least L exactly. Every function counts work in nodes; the clock is looked at only for the
caller's final deadline. Pure Python, compiled by `make native` like `binpack`.
"""

from __future__ import annotations

import time

_CHECK = 256  # nodes between two looks at the clock (the caller's final deadline only)


def knapsack(vals: list[float], ws: list[float], room: float, nodes: int) -> tuple[float, list[int], float]:
    """The most sum of vals[i] (each > 0) over the subsets whose ws sum to at most `room`: (best found, its
    indices, an upper bound of the most). The bound is the best found when the search finished within `nodes`,
    else the root's fractional (Dantzig) bound."""
    n = len(vals)
    order = sorted(range(n), key=lambda i: (-(vals[i] / ws[i]) if ws[i] > 0.0 else -1e300, i))
    v = [vals[i] for i in order]
    w = [ws[i] for i in order]
    best = 0.0
    best_set: list[int] = []
    cur: list[int] = []
    left = [nodes]

    def frac(i: int, cap: float, val: float) -> float:
        for k in range(i, n):
            if w[k] <= cap:
                cap -= w[k]
                val += v[k]
            else:
                return val + v[k] * cap / w[k]
        return val

    def rec(i: int, cap: float, val: float) -> None:
        nonlocal best, best_set
        left[0] -= 1
        if val > best:
            best = val
            best_set = list(cur)
        if i == n or left[0] < 0 or frac(i, cap, val) <= best:
            return
        if w[i] <= cap:
            cur.append(order[i])
            rec(i + 1, cap - w[i], val + v[i])
            cur.pop()
        rec(i + 1, cap, val)

    rec(0, room, 0.0)
    ub = best if left[0] >= 0 else frac(0, room, 0.0)
    return best, best_set, ub


def enumerate_patterns(rc: list[float], ws: list[float], room: float, slack: float, most: int, deadline: float
                       ) -> list[list[int]] | None:
    """Every nonempty subset of the items whose ws sum to at most `room` and whose rc (reduced costs, any sign)
    sum to at most `slack`, as sorted index lists; None when there are more than `most`, or past the deadline."""
    n = len(rc)
    order = sorted(range(n), key=lambda i: (rc[i], i))
    r = [rc[i] for i in order]
    w = [ws[i] for i in order]
    out: list[list[int]] = []
    cur: list[int] = []
    over = [False]
    visits = [0]

    # the items of negative rc, best ratio first: sorted once, `least_rest` takes those from k on in this order
    neg = sorted((r[q] / w[q] if w[q] > 0.0 else -1e300, q) for q in range(n) if r[q] < 0.0)

    def least_rest(k: int, cap: float) -> float:
        """A lower bound of what the items k.. can add within cap: their negative rc, fractionally, best ratio
        first (a knapsack's fractional bound)."""
        t = 0.0
        for _, q in neg:
            if q < k:
                continue
            if w[q] <= cap:
                cap -= w[q]
                t += r[q]
            else:
                t += r[q] * cap / w[q]
                break
        return t

    def rec(k: int, cap: float, tot: float) -> None:
        if over[0]:
            return
        visits[0] += 1
        if visits[0] % _CHECK == 0 and time.perf_counter() > deadline:
            over[0] = True
            return
        if cur and tot <= slack:
            if len(out) >= most:
                over[0] = True
                return
            out.append(sorted(order[q] for q in cur))
        for q in range(k, n):
            if w[q] > cap:
                continue
            if tot + r[q] + least_rest(q + 1, cap - w[q]) > slack:
                if r[q] >= 0.0:
                    break  # items are in increasing rc: none after q does better
                continue
            cur.append(q)
            rec(q + 1, cap - w[q], tot + r[q])
            cur.pop()

    rec(0, room, 0.0)
    return None if over[0] else out


def exact_cover(n: int, items: list[list[int]], cls: list[int], cost: list[float], excess: list[float],
                count: list[int], floor: float, cap: float, nodes: int, deadline: float
                ) -> tuple[float, list[int] | None, bool]:
    """The least sum of cost over the sets of patterns that cover items 0..n-1 exactly once with at most count[c]
    patterns of each class c, among those of sum at most `cap`: (its sum, its patterns, True); (cap, None, True)
    when none is that cheap; not finished within `nodes` or by the deadline: (the least found or cap, its patterns
    or None, False). `floor + sum of excess over a cover's patterns` must be a lower bound of the cover's cost (the
    bound it prunes with; excess >= 0)."""
    by_item: list[list[int]] = [[] for _ in range(n)]
    for q in range(len(items)):
        for k in items[q]:
            by_item[k].append(q)
    for k in range(n):
        by_item[k].sort(key=lambda q: (excess[q], q))
    covered = [False] * n
    used = [0] * len(count)
    best = cap
    best_set: list[int] | None = None
    chosen: list[int] = []
    left = [nodes]
    stop = [False]

    def viable(q: int) -> bool:
        if used[cls[q]] >= count[cls[q]]:
            return False
        for x in items[q]:
            if covered[x]:
                return False
        return True

    def rec(esum: float, tot: float) -> None:
        nonlocal best, best_set
        left[0] -= 1
        if left[0] < 0 or (left[0] % _CHECK == 0 and time.perf_counter() > deadline):
            stop[0] = True
            return
        lim = best - floor
        pick = -1
        pick_n = 0
        rest = 0.0  # the uncovered items' least share of a pattern's excess: a bound of what they still add
        for k in range(n):
            if covered[k]:
                continue
            cnt = 0
            share = 1e300
            for q in by_item[k]:
                if esum + excess[q] > lim:
                    break
                if viable(q):
                    cnt += 1
                    s = excess[q] / len(items[q])
                    if s < share:
                        share = s
            if cnt == 0:
                return
            rest += share
            if pick < 0 or cnt < pick_n:
                pick, pick_n = k, cnt
        if pick < 0:
            if tot <= best and (best_set is None or tot < best):
                best = tot
                best_set = list(chosen)
            return
        if esum + rest > lim:
            return
        for q in by_item[pick]:
            if esum + excess[q] > best - floor:
                break
            if not viable(q):
                continue
            for x in items[q]:
                covered[x] = True
            used[cls[q]] += 1
            chosen.append(q)
            rec(esum + excess[q], tot + cost[q])
            chosen.pop()
            used[cls[q]] -= 1
            for x in items[q]:
                covered[x] = False
            if stop[0]:
                return

    rec(0.0, 0.0)
    return best, best_set, not stop[0]
