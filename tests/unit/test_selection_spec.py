"""The spec's rules that issue 24 made checkable (docs/selection-spec.md): memory counted in integer units of
1e-6 GB, the canonical order among tied optima, the input limits, and how the counts are made."""

from __future__ import annotations

import math

import pytest
from test_selection_properties import encoding

from flowmaker.domain import (
    Cluster,
    Gpu,
    Model,
    Profile,
    SelectionOptions,
    SelectionRequest,
    Slo,
    Stage,
    Workflow,
)
from flowmaker.errors import InvalidSpec
from flowmaker.selection import select
from flowmaker.selection.placement import NodeGpus, gb_units, place_least_loaded

MODELS = (Model("a", 0.5, 7.0, 7.0), Model("b", 0.5, 7.0, 7.0))


def _req(gpus: tuple[Gpu, ...], profiles: tuple[Profile, ...], stages: int = 1, rate: float = 0.0,
         strategy_budget: float = 0.0) -> SelectionRequest:
    wf = Workflow("w", tuple(Stage(f"s{i}", depends_on=(f"s{i - 1}",) if i else (), input_tokens=100,
                                   output_tokens=50) for i in range(stages)))
    return SelectionRequest(Slo(0.1, 100.0, rate), (wf,), MODELS, profiles, Cluster(gpus),
                            SelectionOptions(time_budget_s=strategy_budget))


def test_free_memory_ties_are_exact_in_units() -> None:
    """42.2 - 14.2 is 28.000000000000004 in doubles, 48 - 20 is 28.0: in the spec's units both are 28 GB, a tie
    that the smaller node id wins (in floats n1 would win)."""
    assert 42.2 - 14.2 > 48.0 - 20.0 and gb_units(42.2) - gb_units(14.2) == gb_units(48.0) - gb_units(20.0)
    gpus = (Gpu("n0-g0", "n0", 48.0, 20.0), Gpu("n1-g0", "n1", 42.2, 14.2))
    free = {g.id: g.memory_total_gb - g.memory_used_gb for g in gpus}
    assert place_least_loaded(NodeGpus.of(gpus), free, 1, 7.1) == ("n0", ("n0-g0",))
    prof = (Profile("a", 1, 1, 7.1, 0.01, 1e-4, 0.01, 400.0),)
    for strategy in ("exact", "milp", "exhaustive"):
        v = select(_req(gpus, prof), strategy).variant
        assert v is not None and v.new_instances[0].gpu_ids == ("n0-g0",), strategy
    # A fit is exact too: 28 GB free holds exactly 28 GB per GPU (in floats 28.000000000000004 - 28 > 0 only
    # by luck of rounding, and 0.1 + 0.2 > 0.3 would refuse 0.3 GB on a GPU with 0.1 + 0.2 used of 0.6).
    tight = (Gpu("n0-g0", "n0", 0.6, 0.1 + 0.2),)
    assert place_least_loaded(NodeGpus.of(tight), {"n0-g0": 0.6 - (0.1 + 0.2)}, 1, 0.3) is not None


def test_ties_beyond_cost_latency_and_gpus_go_to_the_canonical_variant() -> None:
    """Profiles of a and b are identical but for b's higher capacity, which this request does not need: every
    variant with a ties with its twin on b. The canonical order takes the earlier profile, a, although b
    dominates it (the search's dominance rule would keep only b)."""
    gpus = tuple(Gpu(f"n0-g{i}", "n0", 48.0, 0.0) for i in range(2))
    profs = (Profile("a", 1, 1, 10.0, 0.01, 1e-4, 0.01, 400.0), Profile("b", 1, 1, 10.0, 0.01, 1e-4, 0.01, 800.0))
    req = _req(gpus, profs, stages=2, rate=1.0)
    for strategy in ("exact", "milp", "exhaustive"):
        res = select(req, strategy)
        assert res.optimal and res.variant is not None
        # Both stages share one new instance of profile 0 (a): (2, 0, 1) opens it, (1, 0) joins it.
        assert encoding(req, res.variant) == (0, ((2, 0, 1), (1, 0))), strategy


@pytest.mark.parametrize("field,bad", [("memory_total_gb", math.inf), ("memory_total_gb", math.nan)])
def test_gpu_memory_must_be_finite(field: str, bad: float) -> None:
    req = _req((Gpu("g0", "n0", 48.0, 0.0), Gpu("g1", "n0", bad, 0.0)),
               (Profile("a", 1, 1, 10.0, 0.01, 1e-4, 0.01, 400.0),))
    with pytest.raises(InvalidSpec) as e:
        select(req, "exact")
    assert e.value.field == f"cluster.gpus[1].{field}"


def test_search_space_counts_accuracy_infeasible_and_unplaceable_profiles() -> None:
    """search_space_size does not depend on alpha or free memory; a complete exhaustive run reports it as
    variants evaluated (accuracy failures counted without being built)."""
    gpus = (Gpu("g0", "n0", 48.0, 0.0),)
    profs = (Profile("a", 1, 1, 10.0, 0.01, 1e-4, 0.01, 400.0), Profile("b", 1, 1, 60.0, 0.01, 1e-4, 0.01, 400.0))
    loose = _req(gpus, profs, stages=2)
    strict = SelectionRequest(Slo(0.9, 100.0, 0.0), loose.workflows, (Model("a", 0.95, 7.0, 7.0),
                                                                      Model("b", 0.5, 7.0, 7.0)), profs,
                              loose.cluster)
    # 2 stages, P = 2 profiles, no running instance: the first opens one of 2, the second joins it or opens one
    # of 2: 2 * (1 + 2) = 6 variants
    for req in (loose, strict):
        for strategy in ("exact", "exhaustive"):
            assert select(req, strategy).search_space_size == 6
        assert select(req, "exhaustive").variants_evaluated == 6


def _count_cuts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the bin counts of every packing cut the walk adds."""
    import flowmaker.selection.milp as milp

    cuts: list[int] = []
    orig = milp.RelaxedModel.cut

    def counted(self: milp.RelaxedModel, pi: int, stages: list[int], nbins: int) -> None:
        cuts.append(nbins)
        orig(self, pi, stages, nbins)

    monkeypatch.setattr(milp.RelaxedModel, "cut", counted)
    return cuts


def _packing_request() -> SelectionRequest:
    """Loads 55, 30, 30, 30, 30, 25 tok/s on instances of 100 tok/s (10 GB) or 200 tok/s (35 GB)."""
    stages = tuple(Stage(f"s{i}", depends_on=("s0",) if i else (), input_tokens=100, output_tokens=out)
                   for i, out in enumerate((55, 30, 30, 30, 30, 25)))
    gpus = tuple(Gpu(f"n0-g{i}", "n0", 48.0, 0.0) for i in range(4))
    profs = (Profile("a", 1, 1, 10.0, 0.01, 1e-4, 0.01, 100.0), Profile("b", 1, 1, 35.0, 0.01, 1e-4, 0.009, 200.0))
    return SelectionRequest(Slo(0.1, 100.0, 1.0), (Workflow("w", stages),), MODELS, profs, Cluster(gpus))


def test_the_walks_packing_cuts_keep_the_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads 55, 30, 30, 30, 30, 25 tok/s on instances of 100 tok/s (10 GB; 200 tok/s take 35 GB): the aggregated
    capacity admits two instances of 100, no packing does. With the walk's dual-feasible rows off (CUT_K = 0; they
    see this packing, `test_the_walks_dual_feasible_rows_see_the_packing`) the walk must cut (y >= need - stages
    left out), keep a valid bound and still reach the brute force's optimum (three instances of 100)."""
    from test_selection_properties import agree

    import flowmaker.selection.milp as milp

    monkeypatch.setattr(milp, "CUT_K", 0)
    cuts = _count_cuts(monkeypatch)
    req = _packing_request()
    agree(req, ("milp", "exact"), proven=True)
    # The walk alone (no branch and bound after it): its bound holds and its best point is the optimum.
    from test_selection_properties import brute_force

    from flowmaker.selection.exact import usable_profiles
    from flowmaker.selection.problem import Problem

    want, _ = brute_force(req)
    assert want is not None
    pb = Problem(req)
    fr = milp.RelaxedModel(pb, pb.workflows[0], usable_profiles(pb)).walk(math.inf, None)
    assert cuts  # the walk did cut
    assert fr.complete and fr.lower_bound <= want[0] * (1 + 1e-9)
    assert min(c[0][0] for c in fr.candidates) <= want[0] * (1 + 1e-9)


def test_the_walks_dual_feasible_rows_see_the_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The instance of `test_the_walks_packing_cuts_keep_the_optimum` with the dual-feasible rows on (u^(3): the
    55 tok/s stage weighs 2/3, each 30 one 1/3, the 25 one 1/4 > 2 in all): the walk needs no cut, and its bound
    and best point are the brute force's optimum. Each weight keeps what one instance can carry within 1."""
    from test_selection_properties import brute_force

    import flowmaker.selection.milp as milp
    from flowmaker.selection.exact import usable_profiles
    from flowmaker.selection.problem import Problem

    for k in range(1, 6):  # a bin's loads (x_i <= cap in total) never weigh more than 1
        for loads in ((55, 45), (30, 30, 30, 10), (25, 25, 25, 25), (34, 33, 33), (50, 50), (99.9,)):
            assert sum(milp._dff(x, 100.0, k) for x in loads) <= 1.0 + 1e-12, (k, loads)
    cuts = _count_cuts(monkeypatch)
    req = _packing_request()
    want, _ = brute_force(req)
    assert want is not None
    pb = Problem(req)
    fr = milp.RelaxedModel(pb, pb.workflows[0], usable_profiles(pb)).walk(math.inf, None)
    assert not cuts
    assert fr.complete and fr.lower_bound <= want[0] * (1 + 1e-9)
    assert min(c[0][0] for c in fr.candidates) <= want[0] * (1 + 1e-9)


def test_the_walk_never_opens_more_instances_than_the_cluster_holds() -> None:
    """One node of 4 GPUs with 30 GB free each: two 2-GPU instances of 20 GB per GPU fit, a third does not
    (placement relaxed, the walk's aggregated capacity would take three). Three heavy stages each want their
    own fast instance; the walk's room row (at most 2) keeps its bound valid and it reaches the optimum."""
    from test_selection_properties import agree, brute_force

    import flowmaker.selection.milp as milp
    from flowmaker.selection.exact import usable_profiles
    from flowmaker.selection.problem import Problem

    stages = tuple(Stage(f"s{i}", depends_on=("s0",) if i else (), input_tokens=100, output_tokens=80)
                   for i in range(3))
    gpus = tuple(Gpu(f"n0-g{i}", "n0", 48.0, 18.0) for i in range(4))
    profs = (Profile("a", 2, 1, 20.0, 0.01, 1e-4, 0.005, 100.0), Profile("b", 1, 1, 10.0, 0.05, 1e-3, 0.05, 100.0))
    req = SelectionRequest(Slo(0.1, 100.0, 1.0), (Workflow("w", stages),), MODELS, profs, Cluster(gpus))
    pb = Problem(req)
    m = milp.RelaxedModel(pb, pb.workflows[0], usable_profiles(pb))
    a = pb.prof_by_key[("a", 2, 1)]
    assert any(a in members and cap == 2 for members, cap in m.room)
    want, _ = brute_force(req)
    assert want is not None
    fr = m.walk(math.inf, None)
    assert fr.complete and fr.lower_bound <= want[0] * (1 + 1e-9)
    assert min(c[0][0] for c in fr.candidates) <= want[0] * (1 + 1e-9)  # its best point places
    agree(req, ("milp", "exact"), proven=True)


def test_equal_cost_and_latency_with_fewer_new_gpus_is_not_pruned() -> None:
    """Two profiles of one model with the same memory (tp2 x 10 GB, tp1 x 20 GB) and the same speed: every
    variant ties on cost and L, and the spec's third key wants the one-GPU instance. The branch and bound meets
    the tp2 one first; its pruning must still look at equal-cost, equal-latency completions with fewer new GPUs
    (found by the property test: `exact` answered 2 GPUs, proven)."""
    from test_selection_properties import agree

    stages = tuple(Stage(f"s{i}", input_tokens=50, output_tokens=10) for i in range(2))
    profs = (Profile("a", 2, 1, 10.0, 0.0, 0.0005, 0.03, 40.0), Profile("a", 1, 1, 20.0, 0.0, 0.0005, 0.03, 40.0))
    gpus = (Gpu("n0-g0", "n0", 48.0, 0.0), *(Gpu(f"n1-g{i}", "n1", 48.0, 0.0) for i in range(4)))
    req = SelectionRequest(Slo(0.0, 0.5, 0.0), (Workflow("w", stages),), MODELS, profs, Cluster(gpus),
                           SelectionOptions(allow_reuse=False))
    res = select(req, "exact")
    assert res.optimal and res.variant is not None and res.variant.new_gpus == 1
    agree(req, ("exact", "milp", "exhaustive"), proven=True)
