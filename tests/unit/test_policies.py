"""Policy registry and the baselines' documented fixed choices; the serving benchmark end to end (small)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.errors import NotFound
from flowmaker.eval.policies import (
    ALL_POLICIES,
    LANGCHAIN_DEFAULT_MODEL,
    ROUTELLM_STRONG,
    ROUTELLM_STRONG_SHARE,
    PolicyContext,
    get_policy,
    langchain_model,
    plan,
)
from flowmaker.eval.tasks import EVAL_TASKS, get_task
from flowmaker.eval.traces import Arrival
from flowmaker.profiling.analytic import profiles_for
from flowmaker.sim import check_memory

GPU = get_gpu_type("A6000")
MODELS = default_models()
PROFILES = profiles_for(MODELS, GPU, max_gpus=8)
CLUSTER = make_cluster("A6000", nodes=1, gpus_per_node=8)


def _ctx(load: float = 0.5, kind: str = "conv") -> PolicyContext:
    return PolicyContext(EVAL_TASKS, kind, load, MODELS, PROFILES, CLUSTER, GPU)


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
