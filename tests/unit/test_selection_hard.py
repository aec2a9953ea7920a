"""The hard families (flowmaker/bench/selector_hard.py) at small sizes against the spec's brute force.

Every answer of `exact` and `milp` must equal the independent brute force of tests/unit/test_selection_properties.py
(cost, L, new GPUs, the canonical variant among ties, every placement re-derived GPU for GPU) and be proven.
The seeds are fixed for CI; `FLOWMAKER_HARD_SEED=random` draws fresh ones (printed on failure), any other
number starts there; `FLOWMAKER_HARD_EXAMPLES` sets how many instances per family.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from test_selection_properties import agree

from flowmaker.bench.selector_hard import HARD_FAMILIES, NON_DYADIC_GB, hard_instance
from flowmaker.domain import CapacityModel, SelectionRequest
from flowmaker.selection.problem import Problem

_SEED_ENV = os.environ.get("FLOWMAKER_HARD_SEED", "24000")
SEED0 = random.SystemRandom().randrange(10**9) if _SEED_ENV == "random" else int(_SEED_ENV)
EXAMPLES = int(os.environ.get("FLOWMAKER_HARD_EXAMPLES", "12"))
MAX_SPACE = 20_000  # what the brute force enumerates in well under a second


def _variant(req: SelectionRequest, k: int) -> SelectionRequest:
    """Every third instance under BUSY_TIME, every third with up to 2 replicas (when still enumerable)."""
    if k % 3 == 1:
        return dataclasses.replace(req, options=dataclasses.replace(req.options,
                                                                    capacity_model=CapacityModel.BUSY_TIME))
    if k % 3 == 2:
        rep = dataclasses.replace(req, options=dataclasses.replace(req.options, max_replicas=2))
        if Problem(rep).total_space() <= MAX_SPACE:
            return rep
    return req


@pytest.mark.parametrize("family", HARD_FAMILIES)
def test_exact_and_milp_equal_the_brute_force_on_small_hard_instances(family: str) -> None:
    for k in range(EXAMPLES):
        seed = SEED0 + k
        req = _variant(hard_instance(family, seed, "small").request, k)
        assert Problem(req).total_space() <= MAX_SPACE, (family, seed)
        try:
            agree(req, ("exact", "milp"), proven=True)
        except AssertionError as e:
            raise AssertionError(f"{family} seed {seed} (FLOWMAKER_HARD_SEED={SEED0}, instance {k}): {e}") from e


def test_hard_instances_are_seeded_and_have_the_stated_shapes() -> None:
    for fam in HARD_FAMILIES:
        a, b = hard_instance(fam, 7), hard_instance(fam, 7)
        assert a == b and hard_instance(fam, 8) != a
        a.request.validate()
        hard_instance(fam, 7, "small").request.validate()
    chain = hard_instance("chain_clones", 3)
    assert 15 <= chain.recipe["llm_stages"] <= 20 and 20 <= chain.recipe["clones"] <= 40
    fan = hard_instance("wide_fan", 3).request.workflows[0]
    assert 8 <= len(fan.stages[-1].depends_on) <= 12  # head -> 8..12 parallel -> join
    frag = hard_instance("fragmented", 3)
    assert frag.recipe["nodes"] == 8 and frag.recipe["gpus"] == 64 and frag.recipe["running"] >= 40
    free = [g.memory_total_gb - g.memory_used_gb for g in frag.request.cluster.gpus]
    assert len(set(free)) > 8  # fragmented: free memory differs from GPU to GPU
    mix = hard_instance("dag_mix", 3)
    assert 2 <= mix.recipe["workflows"] <= 4
    ties = hard_instance("memory_ties", 3).request
    by_node: dict[str, list[float]] = {}
    for g in ties.cluster.gpus:
        by_node.setdefault(g.node, []).append(g.memory_total_gb - g.memory_used_gb)
    assert len({tuple(v) for v in by_node.values()}) == 1 and len(by_node) >= 2  # exact ties between nodes
    assert all(p.memory_gb_per_gpu in NON_DYADIC_GB for p in ties.profiles)
