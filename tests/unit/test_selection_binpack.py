"""`binpack.least_l_bins` and `binpack.least_l_classes` (issue 24) against a brute force of every assignment, on
small packings with clones; the packing oracle (`_pack_exact`, bin completion) and `max_fill` against brute
forces of every packing and every subset, on tight fills."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from flowmaker.selection.binpack import _pack_exact, least_l_bins, least_l_classes, max_fill
from flowmaker.selection.chain import _prices
from flowmaker.selection.problem import INF, NEW, REUSE, leq, leq_limit


def _instance(seed: int) -> tuple[list[list[tuple[float, str, int]]], list[float], list[tuple[str, int, int, float,
                                                                                                float]]]:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    loads = sorted((rng.uniform(1.0, 10.0) for _ in range(n)), reverse=True)
    if rng.random() < 0.3:  # equal loads (ties)
        loads = [round(x) for x in loads]
    n_prof = rng.randint(1, 3)
    rates = [rng.uniform(0.5, 2.0) for _ in range(n_prof)]
    if n_prof > 1 and rng.random() < 0.5:  # a near-identical clone
        rates[1] = rates[0] * rng.uniform(0.995, 1.005)
    caps = [rng.uniform(5.0, 20.0) for _ in range(n_prof)]
    bins: list[tuple[str, int, int, float, float]] = []
    for p in range(n_prof):
        bins.extend((NEW, 100 + p, b, 0.0, caps[p]) for b in range(rng.randint(0, 3)))
    n_run = rng.randint(0, 2)
    run_rate = [rng.uniform(0.5, 2.0) for _ in range(n_run)]
    for r in range(n_run):
        cp = rng.uniform(5.0, 20.0)
        bins.append((REUSE, r, 0, rng.uniform(0.0, cp), cp))
    have = {(k, ref) for k, ref, *_ in bins}
    so: list[list[tuple[float, str, int]]] = []
    for j in range(n):
        opts = [(loads[j] * rates[p] * rng.uniform(0.98, 1.02), NEW, 100 + p) for p in range(n_prof)
                if rng.random() < 0.85]
        opts += [(loads[j] * run_rate[r], REUSE, r) for r in range(n_run) if rng.random() < 0.7]
        so.append(sorted(o for o in opts if (o[1], o[2]) in have))
    return so, loads, bins


def _brute(so: list[list[tuple[float, str, int]]], loads: list[float], bins: list[tuple[str, int, int, float, float]],
           tool: float) -> float:
    best = INF
    per_stage = []
    for opts in so:
        ch: list[tuple[float, int]] = []
        for lat, k, ref in opts:
            ch.extend((lat, i) for i, b in enumerate(bins) if (b[0], b[1]) == (k, ref))
        per_stage.append(ch)
    for combo in itertools.product(*per_stage):
        fill = [0.0] * len(bins)
        ok = True
        for (_, i), ld in zip(combo, loads, strict=True):
            if not leq(bins[i][3] + fill[i] + ld, bins[i][4]):
                ok = False
                break
            fill[i] += ld
        if ok:
            best = min(best, tool + sum(lat for lat, _ in combo))
    return best


@pytest.mark.parametrize("search", [least_l_bins, least_l_classes], ids=["bins", "classes"])
@pytest.mark.parametrize("seed", range(1000))
def test_least_l_matches_brute_force(seed: int, search: Any) -> None:
    so, loads, bins = _instance(seed)
    tool = 0.5 if seed % 2 else 0.0
    room: dict[tuple[str, int], float] = {}
    for k, ref, _, base, cp in bins:
        room[(k, ref)] = room.get((k, ref), 0.0) + cp - base
    rng = random.Random(seed)
    mu = _prices(so, loads, room) if rng.random() < 0.7 else {c: rng.uniform(0.0, 0.3) for c in room}
    want = _brute(so, loads, bins, tool)
    for cap_l in (INF, want * 1.01 if want < INF else 50.0, want if want < INF else 50.0, want * 0.99):
        L, a, done, _ = search(so, loads, bins, mu, tool, cap_l, 10**7)
        assert done
        if want < INF and want <= cap_l:
            assert a is not None
            assert L == pytest.approx(want, rel=1e-9, abs=1e-12)
            # the assignment fits and has that latency
            fill: dict[tuple[str, int, int], float] = {}
            tot = tool
            for j, (k, ref, b) in enumerate(a):
                lat = min(la for la, kk, rr in so[j] if (kk, rr) == (k, ref))
                tot += lat
                fill[(k, ref, b)] = fill.get((k, ref, b), 0.0) + loads[j]
            assert tot == pytest.approx(L, rel=1e-9, abs=1e-12)
            for (k, ref, b), f in fill.items():
                base, cp = next((bb[3], bb[4]) for bb in bins if bb[:3] == (k, ref, b))
                assert leq(base + f, cp)
        else:
            assert a is None and L == cap_l
    # a search stopped early never claims more than the optimum
    L, a, done, _ = search(so, loads, bins, mu, tool, INF, 3)
    if not done:
        assert L <= want


@pytest.mark.parametrize("seed", range(60))
def test_least_l_classes_matches_least_l_bins_on_larger_packings(seed: int) -> None:
    """Packings too large for the brute force (8-12 stages, several identical bins per profile, so that the class
    search's packing oracle has to repack): the class search and the bin-by-bin search, both exact, agree."""
    rng = random.Random(10_000 + seed)
    n = rng.randint(8, 12)
    loads = sorted((rng.uniform(1.0, 10.0) for _ in range(n)), reverse=True)
    rates = [rng.uniform(0.5, 2.0) for _ in range(2)]
    rates[1] = rates[0] * rng.uniform(0.99, 1.01)  # a clone
    bins: list[tuple[str, int, int, float, float]] = []
    for p in range(2):
        cap = rng.uniform(10.0, 20.0)
        bins.extend((NEW, 100 + p, b, 0.0, cap) for b in range(rng.randint(1, 4)))
    cp = rng.uniform(5.0, 15.0)
    bins.append((REUSE, 0, 0, rng.uniform(0.0, cp), cp))
    so = [sorted([(loads[j] * rates[p] * rng.uniform(0.98, 1.02), NEW, 100 + p) for p in range(2)]
                 + [(loads[j] * 2.5, REUSE, 0)]) for j in range(n)]
    room: dict[tuple[str, int], float] = {}
    for k, ref, _, base, c in bins:
        room[(k, ref)] = room.get((k, ref), 0.0) + c - base
    mu = _prices(so, loads, room)
    want, a_bins, done_bins, _ = least_l_bins(so, loads, bins, mu, 0.0, INF, 10**8)
    got, a, done, _ = least_l_classes(so, loads, bins, mu, 0.0, INF, 10**8)
    assert done and done_bins
    assert (a is None) == (a_bins is None)
    if a is not None:
        assert got == pytest.approx(want, rel=1e-9)
        fill: dict[tuple[str, int, int], float] = {}
        for j, (k, ref, b) in enumerate(a):
            fill[(k, ref, b)] = fill.get((k, ref, b), 0.0) + loads[j]
        for (k, ref, b), f in fill.items():
            base, c = next((bb[3], bb[4]) for bb in bins if bb[:3] == (k, ref, b))
            assert leq(base + f, c)


def _tight(rng: random.Random, most: int = 14) -> tuple[list[float], int, float, float]:
    """Loads heaviest first (integers sometimes: equal loads; at most `most` of them for one bin, fewer for more
    bins, so that a brute force can list every assignment), bins, a base and a capacity around the fill that the
    loads need: mostly 85-105% full, where packings that do not exist are hard to refute."""
    nb = rng.randint(1, 4)
    n = rng.randint(0, most if nb == 1 else {2: 14, 3: 9, 4: 7}[nb])
    ws = sorted((float(rng.randint(1, 12)) if rng.random() < 0.4 else rng.uniform(1.0, 12.0) for _ in range(n)),
                reverse=True)
    base = rng.choice([0.0, rng.uniform(0.0, 3.0)])
    cap = base + max([*ws, 1.0]) + (sum(ws) / nb) * rng.uniform(0.0, 0.25) if rng.random() < 0.3 \
        else base + sum(ws) / nb / rng.uniform(0.85, 1.05)
    return ws, nb, base, cap


def _fits(ws: list[float], base: float, cap: float, where: tuple[int, ...] | list[int], nb: int) -> bool:
    """Each bin's loads added heaviest first, as the oracle adds them."""
    fill = [0.0] * nb
    for i in sorted(range(len(ws)), key=lambda i: -ws[i]):
        if not base + fill[where[i]] + ws[i] <= leq_limit(cap):
            return False
        fill[where[i]] += ws[i]
    return True


@pytest.mark.parametrize("seed", range(400))
def test_pack_exact_matches_brute_force(seed: int) -> None:
    rng = random.Random(50_000 + seed)
    ws, nb, base, cap = _tight(rng)
    want = any(_fits(ws, base, cap, w, nb) for w in itertools.product(range(nb), repeat=len(ws)))
    nodes = [0]

    def step() -> bool:
        nodes[0] += 1
        return True

    got = _pack_exact(ws, nb, base, cap, step)
    assert (got is not None) == want
    if got is not None:
        assert len(got) == len(ws) and all(0 <= b < nb for b in got) and _fits(ws, base, cap, got, nb)


@pytest.mark.parametrize("seed", range(300))
def test_max_fill_bounds_every_subset_and_is_reached(seed: int) -> None:
    rng = random.Random(60_000 + seed)
    ws, _, base, cap = _tight(rng, most=16)
    limit = cap - base
    subset_sums = [sum(c) for r in range(len(ws) + 1) for c in itertools.combinations(ws, r)]
    got = max_fill(tuple(ws), limit)
    best = max(x for x in subset_sums if x <= limit * (1 + 1e-9) + 1e-9)
    assert got >= best  # an upper bound of every subset that fits
    assert got <= limit and got == pytest.approx(best, rel=1e-8, abs=1e-8)  # and no more than the best one
