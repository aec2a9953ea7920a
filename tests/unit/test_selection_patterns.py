"""The pattern route to a chain packing's least latency (`chain._least_l_patterns`, `flowmaker.selection.patterns`):
against a brute force of every assignment on small packings with clones, against the exact bin-by-bin search on
larger ones, and its three parts (knapsack, patterns within a gap, exact cover) against brute forces of their own."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from test_selection_binpack import _brute, _instance

from flowmaker.selection.binpack import least_l_bins
from flowmaker.selection.chain import _least_l_patterns, _prices
from flowmaker.selection.patterns import enumerate_patterns, exact_cover, knapsack
from flowmaker.selection.problem import INF, NEW, REUSE, leq, leq_limit

FAR = 1e18  # a deadline that never comes: every call here is bounded by work


def _classes(bins: list[tuple[str, int, int, float, float]]) -> list[tuple[str, int, int, float]]:
    """The bins as `_least_l_patterns` takes them: identical new bins of a profile form one class."""
    out: dict[tuple[str, int], tuple[str, int, int, float]] = {}
    for k, ref, _, base, cp in bins:
        n = out[(k, ref)][2] + 1 if (k, ref) in out else 1
        out[(k, ref)] = (k, ref, n, leq_limit(cp) - base)
    return list(out.values())


def _check_assignment(so: list[list[tuple[float, str, int]]], loads: list[float],
                      bins: list[tuple[str, int, int, float, float]], a: list[tuple[str, int, int]], tool: float,
                      L: float) -> None:
    fill: dict[tuple[str, int, int], float] = {}
    tot = tool
    for j, (k, ref, b) in enumerate(a):
        tot += min(la for la, kk, rr in so[j] if (kk, rr) == (k, ref))
        fill[(k, ref, b)] = fill.get((k, ref, b), 0.0) + loads[j]
    assert tot == pytest.approx(L, rel=1e-9, abs=1e-12)
    for (k, ref, b), f in fill.items():
        base, cp = next((bb[3], bb[4]) for bb in bins if bb[:3] == (k, ref, b))
        assert leq(base + f, cp)


@pytest.mark.parametrize("seed", range(400))
def test_least_l_by_patterns_matches_brute_force(seed: int) -> None:
    so, loads, bins = _instance(seed)
    tool = 0.5 if seed % 2 else 0.0
    want = _brute(so, loads, bins, tool)
    for cap_l in (INF, want * 1.01 if want < INF else 50.0, want if want < INF else 50.0, want * 0.99):
        got = _least_l_patterns(loads, so, _classes(bins), tool, cap_l, FAR)
        assert got is not None  # small packings stay within every work limit
        L, a, done = got
        assert done
        if want < INF and want <= cap_l:
            assert a is not None
            assert L == pytest.approx(want, rel=1e-9, abs=1e-12)
            _check_assignment(so, loads, bins, a, tool, L)
        else:
            assert a is None and L == cap_l


def _larger(seed: int) -> tuple[list[list[tuple[float, str, int]]], list[float], list[tuple[str, int, int, float,
                                                                                                  float]]]:
    """12-18 stages, three near-identical clones with several identical bins each and two running instances: the
    shape of the chain_clones packings the class search gives up on."""
    rng = random.Random(20_000 + seed)
    n = rng.randint(12, 18)
    loads = sorted((rng.uniform(1.0, 10.0) for _ in range(n)), reverse=True)
    base_rate = rng.uniform(0.5, 2.0)
    rates = [base_rate * rng.uniform(0.99, 1.01) for _ in range(3)]
    bins: list[tuple[str, int, int, float, float]] = []
    for p in range(3):
        cap = rng.uniform(10.0, 25.0)
        bins.extend((NEW, 100 + p, b, 0.0, cap) for b in range(rng.randint(1, 3)))
    run_rate = []
    for r in range(2):
        cp = rng.uniform(5.0, 20.0)
        bins.append((REUSE, r, 0, rng.uniform(0.0, cp), cp))
        run_rate.append(rng.uniform(1.0, 3.0))
    so = [sorted([(loads[j] * rates[p] * rng.uniform(0.995, 1.005), NEW, 100 + p) for p in range(3)]
                 + [(loads[j] * run_rate[r], REUSE, r) for r in range(2)]) for j in range(n)]
    return so, loads, bins


@pytest.mark.parametrize("seed", range(40))
def test_least_l_by_patterns_matches_the_bin_search_on_larger_packings(seed: int) -> None:
    """Packings too large for the brute force: where the pattern route settles one, it agrees with the exact
    bin-by-bin search; at the least L as the cap and just under it."""
    so, loads, bins = _larger(seed)
    room: dict[tuple[str, int], float] = {}
    for k, ref, _, base, c in bins:
        room[(k, ref)] = room.get((k, ref), 0.0) + c - base
    want, _, done_bins, _ = least_l_bins(so, loads, bins, _prices(so, loads, room), 0.0, INF, 10**8)
    assert done_bins
    for cap_l in ((want, want * (1 - 1e-6)) if want < INF else (100.0,)):
        got = _least_l_patterns(loads, so, _classes(bins), 0.0, cap_l, FAR)
        if got is None:
            continue  # past its work limits: the MILP's question then, never a claim
        L, a, done = got
        assert done
        if want <= cap_l:
            assert a is not None and L == pytest.approx(want, rel=1e-9)
            _check_assignment(so, loads, bins, a, 0.0, L)
        else:
            assert a is None and L == cap_l


@pytest.mark.parametrize("seed", range(200))
def test_knapsack_is_the_most_any_subset_takes(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(0, 10)
    vals = [rng.uniform(0.1, 5.0) for _ in range(n)]
    ws = [rng.choice([rng.uniform(0.5, 5.0), 2.0]) for _ in range(n)]
    room = rng.uniform(0.0, 15.0)
    best = max((sum(vals[i] for i in s) for r in range(n + 1) for s in itertools.combinations(range(n), r)
                if sum(ws[i] for i in s) <= room), default=0.0)
    got, chosen, ub = knapsack(vals, ws, room, 10**6)
    assert got == pytest.approx(best, rel=1e-12, abs=1e-12) and ub == got
    assert sum(ws[i] for i in chosen) <= room and sum(vals[i] for i in chosen) == pytest.approx(got)
    _, _, ub_cut = knapsack(vals, ws, room, 2)  # out of nodes: a bound still
    assert ub_cut >= best - 1e-12


@pytest.mark.parametrize("seed", range(200))
def test_patterns_within_a_gap_are_every_subset_within_it(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    rc = [rng.uniform(-3.0, 3.0) for _ in range(n)]
    ws = [rng.uniform(0.5, 5.0) for _ in range(n)]
    room, slack = rng.uniform(1.0, 12.0), rng.uniform(-4.0, 2.0)
    want = sorted(list(s) for r in range(1, n + 1) for s in itertools.combinations(range(n), r)
                  if sum(ws[i] for i in s) <= room and sum(rc[i] for i in s) <= slack)
    got = enumerate_patterns(rc, ws, room, slack, 10**6, FAR)
    assert got is not None and sorted(got) == want
    if len(want) > 1:
        assert enumerate_patterns(rc, ws, room, slack, len(want) - 1, FAR) is None  # over its limit: no answer


@pytest.mark.parametrize("seed", range(200))
def test_exact_cover_is_the_least_cover(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    n_cls = rng.randint(1, 3)
    count = [rng.randint(1, 3) for _ in range(n_cls)]
    items, cls, cost = [], [], []
    for _ in range(rng.randint(1, 14)):
        items.append(sorted(rng.sample(range(n), rng.randint(1, n))))
        cls.append(rng.randrange(n_cls))
        cost.append(rng.uniform(0.5, 5.0) * len(items[-1]))
    best = INF
    for r in range(1, len(items) + 1):
        for s in itertools.combinations(range(len(items)), r):
            covered = sorted(x for q in s for x in items[q])
            if covered == list(range(n)) and all(sum(cls[q] == c for q in s) <= count[c] for c in range(n_cls)):
                best = min(best, sum(cost[q] for q in s))
    excess = [0.0] * len(items)  # floor 0 and no excess: a valid, weak bound
    # (the cap at the least sum, widened by its float noise: the cover sums in its own order)
    for cap in (INF, best * (1 + 1e-12), best * 0.999 if best < INF else 1.0):
        got, chosen, done = exact_cover(n, items, cls, cost, excess, count, 0.0, cap, 10**6, FAR)
        assert done
        if best < INF and best <= cap:
            assert chosen is not None and got == pytest.approx(best)
            assert sorted(x for q in chosen for x in items[q]) == list(range(n))
        else:
            assert chosen is None and got == cap


def test_a_packing_past_its_deadline_is_left_to_the_milp() -> None:
    so, loads, bins = _larger(0)
    assert _least_l_patterns(loads, so, _classes(bins), 0.0, INF, time.perf_counter() - 1.0) is None


@pytest.mark.parametrize("most", [1, 4, 30])
def test_least_l_by_widening_slacks_matches_brute_force(most: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the whole gap holding more than PAT_MOST patterns (cut to 1-30), the route widens its slack from the bound
    (`chain.PAT_SLACK0`, doubling): whatever it settles is the brute force's least L (or nothing within the cap), and
    it settles many."""
    import flowmaker.selection.chain as chain

    monkeypatch.setattr(chain, "PAT_MOST", most)
    monkeypatch.setattr(chain, "PAT_SLACK0", 1e-4)
    settled = 0
    for seed in range(150):
        so, loads, bins = _instance(1000 + seed)
        tool = 0.5 if seed % 2 else 0.0
        want = _brute(so, loads, bins, tool)
        for cap_l in (INF, want * 1.01 if want < INF else 50.0, want if want < INF else 50.0):
            got = _least_l_patterns(loads, so, _classes(bins), tool, cap_l, FAR)
            if got is None:
                continue  # past its work limits: never a claim
            settled += 1
            L, a, done = got
            assert done
            if want < INF and want <= cap_l:
                assert a is not None, (seed, cap_l)
                assert L == pytest.approx(want, rel=1e-9, abs=1e-12)
                _check_assignment(so, loads, bins, a, tool, L)
            else:
                assert a is None and L == cap_l
    assert settled >= 150
