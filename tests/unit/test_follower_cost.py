"""The load follower keeps a task's current variant only when it costs no more than a fresh one, both reckoned in
the selector's objective: under priced GPUs (docs/selection-spec.md) the kept instances' GPUs are priced too."""

from __future__ import annotations

import pytest

from flowmaker.domain import Cluster, Gpu, Model, Profile, SelectionOptions, SelectionRequest, Slo, Stage, Workflow
from flowmaker.selection import select
from flowmaker.state.records import InstanceRecord
from services.orchestrator.follower import kept_cost


def _rec(tp: int, mem: float) -> InstanceRecord:
    return InstanceRecord(f"i-tp{tp}", "m", tp, 1, "n0", tuple(f"g{i}" for i in range(tp)), mem)


@pytest.mark.parametrize("price", [0.0, 48.0])
def test_the_kept_variant_is_reckoned_as_the_selector_reckons_a_new_one(price: float) -> None:
    """The same tp2 instance, once running and kept, once selected new on an empty cluster: the same cost."""
    prof = Profile("m", 2, 1, 9.0, 0.01, 1e-4, 0.01, 400.0)
    req = SelectionRequest(Slo(0.1, 100.0, 1.0), (Workflow("w", (Stage("a", input_tokens=100, output_tokens=50),)),),
                           (Model("m", 0.5, 7.0, 7.0),), (prof,), Cluster(tuple(Gpu(f"g{i}", "n0", 48.0)
                                                                                 for i in range(2))),
                           SelectionOptions(gpu_price_gb=price))
    v = select(req, "exact").variant
    assert v is not None and v.new_gpus == 2
    assert kept_cost([_rec(2, 9.0)], v.latency_s, price) == pytest.approx(v.cost, rel=1e-12)


def test_a_priced_gpu_raises_a_wide_kept_instance_above_a_narrow_fresh_one() -> None:
    """Kept: a tp4 of 11 GB a GPU at 1.8 s; fresh: a tp1 of 38 GB at 6.0 s. Memory only, keeping is cheaper (79.2
    against 228); at 48 GB a GPU still (424.8 against 516); at 200 GB it is dearer (1519.2 against 1428)."""
    wide = [_rec(4, 11.0)]
    assert kept_cost(wide, 1.8, 0.0) == pytest.approx(79.2)
    assert kept_cost(wide, 1.8, 48.0) == pytest.approx((44.0 + 192.0) * 1.8)
    assert kept_cost(wide, 1.8, 48.0) < (38.0 + 48.0) * 6.0
    assert kept_cost(wide, 1.8, 200.0) == pytest.approx(1519.2) and kept_cost(wide, 1.8, 200.0) > (38.0 + 200.0) * 6.0
    assert kept_cost([], 1.8, 48.0) == 0.0  # nothing exclusive: keeping costs nothing
