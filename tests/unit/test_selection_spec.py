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


def test_the_walks_packing_cuts_keep_the_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads 55, 30, 30, 30, 30, 25 tok/s on instances of 100 tok/s (10 GB; 200 tok/s take 35 GB): the aggregated
    capacity admits two instances of 100, no packing does, and no stage is heavy enough for the walk's
    per-instance rows to see it. The walk must cut (y >= need - stages left out), keep a valid bound and still
    reach the brute force's optimum (three instances of 100)."""
    from test_selection_properties import agree

    import flowmaker.selection.milp as milp

    cuts: list[int] = []
    orig = milp.RelaxedModel.cut

    def counted(self: milp.RelaxedModel, pi: int, stages: list[int], nbins: int) -> None:
        cuts.append(nbins)
        orig(self, pi, stages, nbins)

    monkeypatch.setattr(milp.RelaxedModel, "cut", counted)
    stages = tuple(Stage(f"s{i}", depends_on=("s0",) if i else (), input_tokens=100, output_tokens=out)
                   for i, out in enumerate((55, 30, 30, 30, 30, 25)))
    gpus = tuple(Gpu(f"n0-g{i}", "n0", 48.0, 0.0) for i in range(4))
    profs = (Profile("a", 1, 1, 10.0, 0.01, 1e-4, 0.01, 100.0), Profile("b", 1, 1, 35.0, 0.01, 1e-4, 0.009, 200.0))
    req = SelectionRequest(Slo(0.1, 100.0, 1.0), (Workflow("w", stages),), MODELS, profs, Cluster(gpus))
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
