"""Policy registry and the baselines' documented fixed choices; the serving benchmark end to end (small)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.policies import (
    ALL_POLICIES,
    DEFAULT_UTILIZATION_CAP,
    LANGCHAIN_DEFAULT_MODEL,
    ROUTELLM_STRONG,
    ROUTELLM_STRONG_SHARE,
    PolicyContext,
    get_policy,
    langchain_model,
    plan,
    simulated_monitor,
)
from flowmaker.eval.tasks import EVAL_TASKS, get_task
from flowmaker.eval.traces import Arrival, build_workload, get_trace
from flowmaker.profiling.analytic import profiles_for
from flowmaker.sim import SimInstance, TaskDeployment, check_memory

GPU = get_gpu_type("A6000")
MODELS = default_models()
PROFILES = profiles_for(MODELS, GPU, max_gpus=8)
CLUSTER = make_cluster("A6000", nodes=1, gpus_per_node=8)


def _ctx(load: float = 0.5, kind: str = "conv", **kw: object) -> PolicyContext:
    return PolicyContext(EVAL_TASKS, kind, load, MODELS, PROFILES, CLUSTER, GPU, **kw)  # type: ignore[arg-type]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(NotFound, match="unknown policy 'nope'; known"):
        get_policy("nope")


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_every_policy_gives_a_consistent_plan(name: str) -> None:
    p = plan(name, _ctx())
    check_memory(p.instances, CLUSTER.gpus)
    ids = {i.id for i in p.instances}
    assert {d.task.name for d in p.deployments} | {u for u, _ in p.unplaced} == {t.name for t in EVAL_TASKS}
    for d in p.deployments:
        for r in d.routes:
            wf = d.task.candidate(r.workflow_id).instantiate(100, 10)
            assert {s.id for s in wf.llm_stages} == {s for s, _ in r.stage_instances}
            assert {i for _, i in r.stage_instances} <= ids


def test_flowmaker_reuses_and_noreuse_does_not() -> None:
    fm, nr = plan("flowmaker", _ctx()), plan("flowmaker-noreuse", _ctx())
    assert any(d.reused for d in fm.decisions)
    assert not any(d.reused for d in nr.decisions)
    assert sum(i.memory_gb for i in fm.instances) < sum(i.memory_gb for i in nr.instances)


def test_langchain_is_fixed_and_dedicated() -> None:
    p = plan("langchain", _ctx())
    assert len(p.instances) == len(EVAL_TASKS) and not any(d.reused for d in p.decisions)
    for d in p.deployments:
        assert d.routes[0].workflow_id == d.task.candidates[0].id
    assert langchain_model(get_task("chat"), MODELS) == LANGCHAIN_DEFAULT_MODEL
    qa = langchain_model(get_task("multihop_qa"), MODELS)  # alpha above the default model's accuracy
    assert next(m for m in MODELS if m.id == qa).accuracy >= get_task("multihop_qa").min_accuracy
    # same plan at every load: nothing is sized for load
    assert [i.profile.key for i in plan("langchain", _ctx(1.0)).instances] == [i.profile.key for i in p.instances]


def test_routellm_routes_the_configured_share_to_the_strong_model() -> None:
    for setting, share in ROUTELLM_STRONG_SHARE.items():
        p = plan(f"routellm-{setting}", _ctx(0.25))
        d = p.deployments[0]
        strong = {i.id for i in p.instances if i.profile.model_id == ROUTELLM_STRONG}
        assert d.router is not None
        picks = [d.routes[d.router(Arrival(0.0, d.task.name, f"r{k}", 10, 10), k)] for k in range(2000)]
        frac = sum(1 for r in picks if r.stage_instances[0][1] in strong) / len(picks)
        assert frac == pytest.approx(share, abs=0.04)


def test_murakkab_plans_once_whatever_the_load() -> None:
    lo, hi = plan("murakkab", _ctx(0.25)), plan("murakkab", _ctx(1.0))
    assert [i.profile.key for i in lo.instances] == [i.profile.key for i in hi.instances]
    for d in lo.deployments:
        assert d.routes[0].workflow_id == d.task.candidates[0].id


def test_serving_bench_small_matrix(tmp_path: Path) -> None:
    from flowmaker.bench.serving import run_serving_bench
    rep = run_serving_bench(tmp_path, traces_dir=tmp_path / "none", policies=["flowmaker", "langchain",
                                                                              "flowmaker-noreuse"],
                            loads=[0.25], traces=["conv"])
    data = json.loads((tmp_path / "serving.json").read_text())
    assert len(data["rows"]) == 3
    assert "synthetic" in data["setup"]["trace_sources"]["conv"]
    assert data["ratios"]["vs_langchain_cost"]["ours"]["avg"] > 1.0
    assert data["ratios"]["reuse_vs_noreuse_low_load_cost"]["ours"]["avg"] >= 1.0
    for f in rep["plots"]:
        assert Path(f).stat().st_size > 1000
    with pytest.raises(NotFound):
        run_serving_bench(tmp_path, policies=["nope"])


def test_current_load_comes_from_the_monitor_for_flowmaker_only() -> None:
    """flowmaker reads the monitor before each deployment; plannedload and murakkab only know planned loads."""
    calls: list[int] = []

    def saturated(instances: Sequence[SimInstance], deployments: Sequence[TaskDeployment]) -> dict[str, float]:
        calls.append(len(deployments))
        # every running instance reports a load above the cap: nothing can be reused
        return {i.id: 2.0 * i.profile.max_output_tokens_per_s for i in instances}

    ctx = _ctx(monitor=saturated)
    fm = plan("flowmaker", ctx)
    assert calls and calls == sorted(calls) and calls[0] >= 1  # asked once per later deployment, in order
    assert not any(d.reused for d in fm.decisions)
    n_calls = len(calls)
    for name in ("flowmaker-plannedload", "murakkab", "murakkab-maxload", "flowmaker-noreuse"):
        assert plan(name, ctx).instances  # planned without the monitor
    assert len(calls) == n_calls
    assert any(d.reused for d in plan("flowmaker-plannedload", ctx).decisions)

    def idle(instances: Sequence[SimInstance], deployments: Sequence[TaskDeployment]) -> dict[str, float]:
        return {}
    # an idle cluster: at least as much reuse as with the planned loads
    assert sum(d.reused for d in plan("flowmaker", _ctx(monitor=idle)).decisions) >= \
        sum(d.reused for d in plan("flowmaker-plannedload", ctx).decisions)


def test_simulated_monitor_measures_only_what_is_deployed() -> None:
    trace = get_trace("conv", None, 0)
    rates = [(t.name, t.nominal_rate_rps * 0.5) for t in EVAL_TASKS]
    warm = build_workload(rates, trace, seed=99)
    by_id = {m.id: m for m in MODELS}
    mon = simulated_monitor(warm, CLUSTER.gpus, by_id, GPU, 30.0)
    p = plan("flowmaker-plannedload", _ctx())
    first = p.deployments[:1]
    used = {i for r in first[0].routes for _, i in r.stage_instances}
    seen = mon(p.instances, first)
    assert set(seen) == {i.id for i in p.instances}
    assert all(seen[i] > 0 for i in used) and all(seen[i] == 0 for i in seen if i not in used)
    both = mon(p.instances, p.deployments[:2])
    assert sum(both.values()) > sum(seen.values())


def test_planned_loads_are_reported_and_capped() -> None:
    p = plan("flowmaker-plannedload", _ctx(1.0))
    cap = {i.id: i.profile.max_output_tokens_per_s for i in p.instances}
    assert {i for i, _ in p.planned_loads} == set(cap)
    for iid, load in p.planned_loads:
        assert 0 < load <= DEFAULT_UTILIZATION_CAP * cap[iid] + 1e-6


def test_plan_tokens_mean_sizes_stages_at_the_trace_mean() -> None:
    med, mean = plan("langchain", _ctx(plan_tokens="median")), plan("langchain", _ctx(plan_tokens="mean"))
    # conv: mean generated tokens 211 vs median 129, so the planned output load is higher
    assert sum(x for _, x in mean.planned_loads) > 1.5 * sum(x for _, x in med.planned_loads)


def test_serving_bench_rejects_an_unknown_planning_statistic(tmp_path: Path) -> None:
    from flowmaker.bench.serving import run_serving_bench
    with pytest.raises(InvalidSpec, match="unknown statistic"):
        run_serving_bench(tmp_path, plan_tokens="p99", plots=False)
