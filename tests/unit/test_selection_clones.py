"""The walk over groups of clones (flowmaker/selection/clones.py) against the spec's brute force.

Groups merged far more loosely than the product does (CLONE_TOL 0.3-1, so that profiles up to twice apart share one
optimistic representative) must still leave `exact` and `milp` with the brute force's answers, proven; the walk over
groups alone must bound the optimum from below, return only checked variants, and, when complete, keep an image that
can reach the optimum. Seeds as in test_selection_hard (`FLOWMAKER_HARD_SEED`).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from test_selection_hard import EXAMPLES, SEED0, agree_small
from test_selection_properties import brute_force

from flowmaker.bench.selector_hard import hard_instance
from flowmaker.selection import clones
from flowmaker.selection import exact as ex
from flowmaker.selection.chain import fan_group, is_chain, walk_chain
from flowmaker.selection.clones import AggregatedModel, Images, clone_groups
from flowmaker.selection.milp import RelaxedModel
from flowmaker.selection.problem import INF, NEW, Problem

WITH_GROUPS = max(3, EXAMPLES // 2)  # instances with a group of clones each test checks
DRAWS = 40 * EXAMPLES  # instances drawn at most to find them


def _models(req: Any) -> list[tuple[Problem, RelaxedModel]]:
    pb = Problem(req)
    usable = ex.usable_profiles(pb)
    out = []
    for pw in pb.workflows:
        if is_chain(pw) or fan_group(pw) is not None:
            m = RelaxedModel(pb, pw, usable)
            if m.ok:
                out.append((pb, m))
    return out


@pytest.mark.parametrize("tol", [0.3, 0.6, 1.0])
@pytest.mark.parametrize("family", ["chain_clones", "wide_fan"])
def test_loosely_merged_clones_leave_the_brute_forces_answers(family: str, tol: float,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every answer equals the brute force's (cost, L, new GPUs, canonical variant, placements), proven; the walk over
    groups ran, and the walk over profiles kept to its images on some instances."""
    import flowmaker.selection.chain as chain
    import flowmaker.selection.milp as milp

    seen = {"groups": 0, "images": 0}
    walk = chain.walk_chain

    def counted(model: Any, *a: Any) -> Any:
        if getattr(model, "relaxed", False):
            seen["groups"] += 1
        if len(a) > 4 and a[4] is not None:
            seen["images"] += 1
        return walk(model, *a)

    monkeypatch.setattr(clones, "CLONE_TOL", tol)
    monkeypatch.setattr(chain, "walk_chain", counted)
    monkeypatch.setattr(milp, "first_nodes", lambda budget: 0)  # the walks, no branch-and-bound head start
    # Most small instances keep no two clones (the relaxation drops dominated profiles: 7-14% have a group), so
    # instances are drawn until WITH_GROUPS of them had one.
    k = 0
    while seen["groups"] < 2 * WITH_GROUPS and k < DRAWS:  # (exact and milp: two walks over groups an instance)
        agree_small(family, 700, f", tol {tol}", k)
        k += 1
    assert seen["groups"] >= 2 * WITH_GROUPS and seen["images"] > 0, (seen, k, SEED0)


@pytest.mark.parametrize("tol", [0.4, 1.0])
@pytest.mark.parametrize("family", ["chain_clones", "wide_fan"])
def test_the_walk_over_groups_bounds_the_optimum_and_finds_only_variants(family: str, tol: float,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, from no incumbent: its lower bound is at most the brute force's least cost, each candidate is a variant
    that `Problem.check` places, costing at least that, and a complete walk keeps an image whose bound is at most it."""
    monkeypatch.setattr(clones, "CLONE_TOL", tol)
    ran = 0
    for k in range(DRAWS):
        if ran >= WITH_GROUPS:
            break
        seed = SEED0 + 800 + k
        req = hard_instance(family, seed, "small").request
        want, _ = brute_force(req)
        for pb, m in _models(req):
            groups = clone_groups(m)
            if groups is None:
                continue
            am = AggregatedModel(m, groups)
            fr = walk_chain(am, INF, None)
            ran += 1
            opt = want[0] if want is not None else INF
            assert fr.lower_bound <= opt * (1 + 1e-9), (seed, fr.lower_bound, opt)
            for sc, choice, slots, _places in fr.candidates:
                assert pb.check(m.pw, choice, slots)[0] == 5, seed
                assert sc[0] >= opt * (1 - 1e-9), (seed, sc, opt)
            if fr.images_complete and want is not None and len(pb.workflows) == 1:
                inc = min((c[0][0] for c in fr.candidates), default=INF)
                profs = sorted({ref for s in m.pw.llm for kk, ref, _ in m.opts[s] if kk == NEW})
                img = am.images(fr.settled or {}, inc, profs)
                assert min(img.keep.values(), default=INF) <= opt * (1 + 1e-9), (seed, opt)
    assert ran >= WITH_GROUPS, (ran, SEED0)


def test_clone_groups_partition_the_profiles_within_the_tolerance() -> None:
    """Each group's members are within CLONE_TOL of each other in memory, capacity and every latency, on the same
    stages, GPUs and replicas; the groups partition the options' profiles; a representative is at least as good as
    each member."""
    n = 0
    for k in range(DRAWS):
        if n >= WITH_GROUPS:
            break
        for pb, m in _models(hard_instance("chain_clones", SEED0 + 900 + k, "small").request):
            groups = clone_groups(m)
            if groups is None:
                continue
            n += 1
            profs = sorted({ref for s in m.pw.llm for kk, ref, _ in m.opts[s] if kk == NEW})
            assert sorted(p for g in groups for p in g) == profs
            am = AggregatedModel(m, groups)
            for g in groups:
                for p, q in itertools.combinations(g, 2):
                    assert (pb.p_reps[p], pb.p_k[p], pb.p_gpus[p]) == (pb.p_reps[q], pb.p_k[q], pb.p_gpus[q])
                    for a, b in ((pb.p_mem[p], pb.p_mem[q]), (pb.p_cap[p], pb.p_cap[q])):
                        assert abs(a - b) <= clones.CLONE_TOL * max(a, b)
                r = g[0]
                assert am.pb.p_mem[r] == min(pb.p_mem[p] for p in g)
                assert am.pb.p_cap[r] == max(pb.p_cap[p] for p in g)
                for s in m.pw.llm:
                    lats = [v for kk, ref, v in m.opts[s] if kk == NEW and ref in g]
                    got = [v for kk, ref, v in am.opts[s] if kk == NEW and ref == r]
                    assert got == ([min(lats)] if lats else [])
    assert n >= WITH_GROUPS, (n, SEED0)


def test_images_grow_only_below_a_kept_image() -> None:
    """`Images.may_grow` is true exactly for the images at or below some kept one (a brute force over small counts);
    past BELOW_MOST it lets everything grow."""
    rng = random.Random(SEED0)
    for _ in range(50):
        n = rng.randint(1, 4)
        keep = {tuple(rng.randint(0, 3) for _ in range(n)): rng.random() for _ in range(rng.randint(0, 4))}
        gid = [rng.randrange(n) for _ in range(rng.randint(n, 2 * n))]
        gid[:n] = range(n)
        im = Images(gid, keep)
        for t in itertools.product(range(5), repeat=n):
            want = any(all(a <= b for a, b in zip(t, y, strict=True)) for y in keep)
            assert im.may_grow(t) == want, (t, keep)
            assert im.floor(t) == keep.get(t, INF)
        y = tuple(rng.randint(0, 2) for _ in gid)
        cnt = [0] * n
        for q, c in enumerate(y):
            cnt[gid[q]] += c
        assert im.of(y) == cnt
    big = Images([0, 1, 2], {(60, 60, 60): 1.0})
    assert big.below is None and big.may_grow((61, 0, 0))
