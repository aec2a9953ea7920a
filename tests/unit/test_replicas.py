"""The replicas extension of the selection spec (docs/selection-spec.md, `options.max_replicas`).

`exact` and `exhaustive` against an independent brute force written from the extension's text (it shares
no code with flowmaker.selection), on the random requests of test_selection_properties with R = 2..3, and
a re-check of every returned variant: replica keys, per-replica load, placement replica by replica.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_selection_properties import LEVEL, close, dense_requests, longest, requests, spec_place, stage_latency, topo

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
    Variant,
    Workflow,
)
from flowmaker.errors import InvalidSpec
from flowmaker.selection import select

REL = 1e-9


def with_replicas(req: SelectionRequest, reps: int) -> SelectionRequest:
    return dataclasses.replace(req, options=dataclasses.replace(req.options, max_replicas=reps))


def capacity(req: SelectionRequest, wf: Workflow, p: Profile) -> float:
    """Output tokens/s one instance of p carries for wf: the base contract's figure, or under BUSY_TIME the
    spec's out_w / (in_w * prefill_s_per_token + out_w / D(p)) at the workflow's mean request."""
    if req.options.capacity_model is not CapacityModel.BUSY_TIME:
        return p.max_output_tokens_per_s
    calls = [s for s in wf.stages if s.is_llm]
    n = sum(s.calls_per_request for s in calls)
    in_w = sum(s.calls_per_request * s.input_tokens for s in calls) / n
    out_w = sum(s.calls_per_request * s.output_tokens for s in calls) / n
    d = p.decode_tokens_per_s if p.decode_tokens_per_s > 0 else p.max_output_tokens_per_s
    return out_w / (in_w * p.prefill_s_per_token + out_w / d)


def existing(req: SelectionRequest, wf: Workflow, p: Profile, load: float) -> float:
    """A running instance's load in wf's units: its busy fraction kept (unchanged in the base contract)."""
    return load * capacity(req, wf, p) / p.max_output_tokens_per_s


def brute_force(req: SelectionRequest) -> tuple[tuple[float, float, int] | None, int]:
    """((cost, L, new GPUs) of the optimum or None, tightest failed constraint 1..4 / 5 feasible)."""
    R = req.options.max_replicas
    prof = {(p.model_id, p.tp, p.pp): p for p in req.profiles if p.model_id in {m.id for m in req.models}}
    acc = {m.id: m.accuracy for m in req.models}
    reuse = [i for i in req.cluster.instances if (i.model_id, i.tp, i.pp) in prof] if req.options.allow_reuse else []
    groups_of = [(p, r) for p in prof.values() for r in range(1, R + 1)]
    best: tuple[float, float, int] | None = None
    level = 1
    for wf in req.workflows:
        llm = [s for s in topo(wf) if s.is_llm]

        def gen(j: int, ch: list, n_open: int, llm: list[Stage] = llm):
            if j == len(llm):
                yield list(ch)
                return
            for o in ([("R", r) for r in range(len(reuse))] + [("J", g) for g in range(n_open)]
                      + [("O", g) for g in groups_of]):
                ch.append(o)
                yield from gen(j + 1, ch, n_open + (o[0] == "O"))
                ch.pop()

        for ch in gen(0, [], 0):
            groups: list[tuple[Profile, int]] = []
            where: list[tuple[str, int]] = []
            for kind, ref in ch:
                if kind == "O":
                    groups.append(ref)
                    where.append(("N", len(groups) - 1))
                elif kind == "J":
                    where.append(("N", ref))
                else:
                    where.append(("R", ref))
            models = [reuse[r].model_id if k == "R" else groups[r][0].model_id for k, r in where]
            if any(acc[m] < req.slo.min_accuracy for m in models):
                continue
            level = max(level, 2)
            lat = {s.id: s.latency_s for s in wf.stages if not s.is_llm}
            loads: dict[tuple[str, int], float] = {}
            for s, (k, r) in zip(llm, where, strict=True):
                p = prof[(reuse[r].model_id, reuse[r].tp, reuse[r].pp)] if k == "R" else groups[r][0]
                lat[s.id] = stage_latency(s, p)  # a call runs on one replica
                loads[(k, r)] = loads.get((k, r), 0.0) + req.slo.arrival_rate_rps * s.calls_per_request * \
                    s.output_tokens
            L = longest(wf, lat)
            if L > req.slo.max_latency_s * (1 + 1e-9):
                continue
            level = max(level, 3)
            ok = True
            for (k, r), ld in loads.items():
                if k == "R":
                    i = reuse[r]
                    p = prof[(i.model_id, i.tp, i.pp)]
                    tot, cap = ld + existing(req, wf, p, i.load_output_tokens_per_s), capacity(req, wf, p)
                else:
                    p, n = groups[r]
                    tot, cap = ld, n * capacity(req, wf, p)  # r replicas carry r times one
                if tot > req.options.utilization_cap * cap * (1 + 1e-9) + 1e-9:
                    ok = False
            if not ok:
                continue
            level = max(level, 4)
            free = {g.id: g.memory_total_gb - g.memory_used_gb for g in req.cluster.gpus}
            for p, n in groups:
                for _ in range(n):  # replica after replica, in the group's place in the order
                    pl = spec_place(list(req.cluster.gpus), free, p.tp * p.pp, p.memory_gb_per_gpu)
                    if pl is None:
                        ok = False
                        break
                    for g in pl[1]:
                        free[g] -= p.memory_gb_per_gpu
                if not ok:
                    break
            if not ok:
                continue
            level = 5
            cost = sum(n * p.memory_gb_per_gpu * p.tp * p.pp for p, n in groups) * L
            gpus = sum(n * p.tp * p.pp for p, n in groups)
            key = (cost, L, gpus)
            if (best is None or cost < best[0] - REL * max(1, cost)
                    or (close(cost, best[0]) and (L < best[1] - REL * max(1, L)
                                                  or (close(L, best[1]) and gpus < best[2])))):
                best = key
    return best, level


def recheck(req: SelectionRequest, v: Variant) -> None:
    """Independent check of a returned variant under the extension."""
    wf = next(w for w in req.workflows if w.id == v.workflow_id)
    prof = {(p.model_id, p.tp, p.pp): p for p in req.profiles}
    insts = {i.id: i for i in req.cluster.instances}
    news = {n.key: n for n in v.new_instances}
    assert len(news) == len(v.new_instances)
    by_stage = {a.stage_id: a for a in v.assignments}
    lat = {s.id: s.latency_s for s in wf.stages if not s.is_llm}
    group_load: dict[tuple[str, ...], float] = {}
    reuse_load: dict[str, float] = {}
    for s in wf.stages:
        if not s.is_llm:
            continue
        a = by_stage[s.id]
        lat[s.id] = stage_latency(s, prof[(a.model_id, a.tp, a.pp)])
        ld = req.slo.arrival_rate_rps * s.calls_per_request * s.output_tokens
        if a.reused:
            assert not a.replica_keys
            reuse_load[a.instance_id] = reuse_load.get(a.instance_id, 0.0) + ld
            continue
        keys = a.replica_keys or (a.new_key,)
        assert keys[0] == a.new_key and len(keys) <= req.options.max_replicas
        assert all((news[k].model_id, news[k].tp, news[k].pp) == (a.model_id, a.tp, a.pp) for k in keys)
        group_load[keys] = group_load.get(keys, 0.0) + ld
    L = longest(wf, lat)
    assert close(L, v.latency_s) and L <= req.slo.max_latency_s * (1 + 1e-9)
    # Groups are disjoint, cover every new instance, and each replica carries load / r.
    assert sorted(k for ks in group_load for k in ks) == sorted(news)
    for keys, ld in group_load.items():
        cap = capacity(req, wf, prof[(news[keys[0]].model_id, news[keys[0]].tp, news[keys[0]].pp)])
        assert ld <= req.options.utilization_cap * len(keys) * cap * (1 + 1e-9) + 1e-9
        for k in keys:
            assert close(news[k].load_output_tokens_per_s, ld / len(keys))
    for iid, ld in reuse_load.items():
        i = insts[iid]
        p = prof[(i.model_id, i.tp, i.pp)]
        assert ld + existing(req, wf, p, i.load_output_tokens_per_s) <= (
            req.options.utilization_cap * capacity(req, wf, p) * (1 + 1e-9) + 1e-9)
    # Placement order: groups by first use in topological order, each group's replicas consecutively.
    order: list[str] = []
    for s in topo(wf):
        a = by_stage.get(s.id)
        if a is not None and not a.reused and a.new_key not in order:
            order.extend(a.replica_keys or (a.new_key,))
    assert order == [n.key for n in v.new_instances]
    free = {g.id: g.memory_total_gb - g.memory_used_gb for g in req.cluster.gpus}
    for key in order:
        n = news[key]
        pl = spec_place(list(req.cluster.gpus), free, n.tp * n.pp, n.memory_gb_per_gpu)
        assert pl is not None and (pl[0], tuple(pl[1])) == (n.node, n.gpu_ids)
        for g in pl[1]:
            free[g] -= n.memory_gb_per_gpu
    mem = sum(n.memory_gb_per_gpu * n.tp * n.pp for n in v.new_instances)
    assert close(mem, v.new_memory_gb) and close(mem * L, v.cost)
    assert v.new_gpus == sum(n.tp * n.pp for n in v.new_instances)


def _agree(req: SelectionRequest, strategies: tuple[str, ...] = ("exact", "exhaustive")) -> None:
    want, level = brute_force(req)
    for name in strategies:
        res = select(req, name)
        if want is None:
            assert res.variant is None and res.reason == LEVEL[level], (name, res.reason, level)
            continue
        assert res.variant is not None, name
        v = res.variant
        assert close(v.cost, want[0]), (name, v.cost, want)
        assert close(v.latency_s, want[1]), (name, v.latency_s, want)
        assert v.new_gpus == want[2], (name, v.new_gpus, want)
        recheck(req, v)


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.integers(2, 3))
def test_exact_and_exhaustive_equal_the_brute_force_of_the_extension(req: SelectionRequest, reps: int) -> None:
    _agree(with_replicas(req, reps), ("exact", "exhaustive", "milp"))


@settings(max_examples=int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(dense_requests(), st.integers(2, 3))
def test_exact_equals_the_brute_force_with_clones_reuse_and_tight_capacity(req: SelectionRequest,
                                                                            reps: int) -> None:
    _agree(with_replicas(req, reps), ("exact", "milp"))


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
    _agree(busy(req, reps, decode_factor), ("exact", "exhaustive", "milp"))


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
    assert base.variant is None and base.reason.name == "NO_CAPACITY"
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
    assert res.variant is None and res.reason.name == "NO_GPU_MEMORY"
    one = select(_hot_stage(0.5, 4), "exact").variant
    assert one is not None and one.new_instances[0].key == "new-0" and one.assignments[0].replica_keys == ()
    assert one == select(_hot_stage(0.5, 1), "exact").variant


def test_max_replicas_out_of_range_names_the_field() -> None:
    with pytest.raises(InvalidSpec) as e:
        select(_hot_stage(1.0, 17), "exact")
    assert e.value.field == "options.max_replicas"
