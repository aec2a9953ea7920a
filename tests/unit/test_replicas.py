"""The extensions of the selection spec (docs/selection-spec.md): replicas per new instance
(`options.max_replicas`) and busy-time capacity (`options.capacity_model`).

`exact`, `exhaustive` and `milp` against the independent brute force of test_selection_properties (written
from the spec's text, extensions included; it shares no code with flowmaker.selection) on its random
requests with R = 1..3 and both capacity models, re-checking every returned variant: replica keys,
per-replica load, placement replica by replica; and a few worked cases.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_selection_properties import agree, close, dense_requests, requests

from flowmaker.domain import (
    CapacityModel,
    Cluster,
    Gpu,
    Model,
    Profile,
    SelectionOptions,
    SelectionRequest,
    Slo,
    Stage,
    StageKind,
    Workflow,
)
from flowmaker.errors import InvalidSpec
from flowmaker.selection import select


def with_replicas(req: SelectionRequest, reps: int) -> SelectionRequest:
    return dataclasses.replace(req, options=dataclasses.replace(req.options, max_replicas=reps))


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.integers(2, 3))
def test_exact_and_exhaustive_equal_the_brute_force_of_the_extension(req: SelectionRequest, reps: int) -> None:
    agree(with_replicas(req, reps), ("exact", "exhaustive", "milp"))


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(dense_requests(), st.integers(2, 3))
def test_exact_equals_the_brute_force_with_clones_reuse_and_tight_capacity(req: SelectionRequest,
                                                                            reps: int) -> None:
    agree(with_replicas(req, reps), ("exact", "milp"))


def busy(req: SelectionRequest, reps: int, decode_factor: float) -> SelectionRequest:
    """`req` under BUSY_TIME with `reps` replicas; profiles get a pure-decode throughput of
    decode_factor x max_output_tokens_per_s (0: unknown), so capacities move both ways."""
    profiles = tuple(dataclasses.replace(p, decode_tokens_per_s=decode_factor * p.max_output_tokens_per_s)
                     for p in req.profiles)
    return dataclasses.replace(req, profiles=profiles, options=dataclasses.replace(
        req.options, max_replicas=reps, capacity_model=CapacityModel.BUSY_TIME))


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests(), dense_requests()), st.integers(1, 2), st.sampled_from([0.0, 1.0, 1.5, 3.0]))
def test_busy_time_capacity_exact_and_exhaustive_equal_the_brute_force(req: SelectionRequest, reps: int,
                                                                       decode_factor: float) -> None:
    agree(busy(req, reps, decode_factor), ("exact", "exhaustive", "milp"))


def test_busy_time_counts_the_prompts() -> None:
    """Long prompts fill an instance before its reference output-token figure: one stage of 2,000 prompt
    tokens and 100 output tokens at 2 req/s is 200 output tokens/s, which fits the reference 300 tok/s but
    takes 2 x (2000 x 2e-4 + 100 / 600) = 1.13 busy seconds per second: one instance is not enough."""
    gpus = tuple(Gpu(f"n0-g{g}", "n0", 80.0, 0.0) for g in range(2))
    wf = Workflow("w", (Stage("s", StageKind.LLM, (), 2000, 100),))
    req = SelectionRequest(Slo(0.1, 10.0, 2.0), (wf,), (Model("m", 0.5, 7.0, 7.0),),
                           (Profile("m", 1, 1, 50.0, 0.05, 2e-4, 0.01, 300.0, decode_tokens_per_s=600.0),),
                           Cluster(gpus, ()), SelectionOptions(max_replicas=2))
    base = select(req, "exact").variant
    assert base is not None and len(base.new_instances) == 1
    res = select(dataclasses.replace(req, options=dataclasses.replace(
        req.options, capacity_model=CapacityModel.BUSY_TIME)), "exact")
    assert res.variant is not None and res.optimal and len(res.variant.new_instances) == 2
    assert res.variant.assignments[0].replica_keys == ("new-0", "new-1")


def _hot_stage(rate: float, reps: int, free_gpus: int = 4) -> SelectionRequest:
    """One LLM stage at `rate`; one profile that carries 100 output tokens/s per instance and fills more
    than half a GPU (one replica per GPU)."""
    gpus = tuple(Gpu(f"n0-g{g}", "n0", 80.0, 0.0 if g < free_gpus else 80.0) for g in range(4))
    wf = Workflow("w", (Stage("s", StageKind.LLM, (), 200, 100),))
    return SelectionRequest(Slo(0.1, 10.0, rate), (wf,), (Model("m", 0.5, 7.0, 7.0),),
                            (Profile("m", 1, 1, 50.0, 0.05, 1e-4, 0.01, 100.0),), Cluster(gpus, ()),
                            SelectionOptions(max_replicas=reps))


def test_a_stage_beyond_one_instance_scales_out_to_the_fewest_replicas() -> None:
    # 2.5 req/s x 100 tokens = 250 tok/s: one instance carries 100, so three replicas, each at a third.
    base = select(_hot_stage(2.5, 1), "exact")
    assert base.variant is None and base.reason is not None and base.reason.name == "NO_CAPACITY"
    res = select(_hot_stage(2.5, 4), "exact")
    v = res.variant
    assert v is not None and res.optimal
    assert [n.key for n in v.new_instances] == ["new-0", "new-1", "new-2"]
    assert v.assignments[0].replica_keys == ("new-0", "new-1", "new-2")
    assert len({n.gpu_ids for n in v.new_instances}) == 3  # three GPUs, one replica each
    assert all(close(n.load_output_tokens_per_s, 250.0 / 3) for n in v.new_instances)
    assert v.new_gpus == 3 and close(v.new_memory_gb, 150.0)


def test_replicas_that_do_not_fit_are_no_gpu_memory_and_one_replica_is_the_base_answer() -> None:
    res = select(_hot_stage(2.5, 4, free_gpus=2), "exact")
    assert res.variant is None and res.reason is not None and res.reason.name == "NO_GPU_MEMORY"
    one = select(_hot_stage(0.5, 4), "exact").variant
    assert one is not None and one.new_instances[0].key == "new-0" and one.assignments[0].replica_keys == ()
    assert one == select(_hot_stage(0.5, 1), "exact").variant


def test_max_replicas_out_of_range_names_the_field() -> None:
    with pytest.raises(InvalidSpec) as e:
        select(_hot_stage(1.0, 17), "exact")
    assert e.value.field == "options.max_replicas"
