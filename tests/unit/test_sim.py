"""Simulator invariants: no request lost, memory never over-committed, tokens conserved, deterministic; DAG timing."""

from __future__ import annotations

import dataclasses

import pytest

from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.domain import Profile
from flowmaker.errors import InvalidSpec
from flowmaker.eval.policies import ALL_POLICIES, PolicyContext, plan
from flowmaker.eval.tasks import EVAL_TASKS, get_task
from flowmaker.eval.traces import Arrival, build_workload, get_trace
from flowmaker.profiling.analytic import profiles_for
from flowmaker.sim import Route, SimInstance, TaskDeployment, check_memory, simulate

GPU = get_gpu_type("A6000")
MODELS = default_models()
BY_ID = {m.id: m for m in MODELS}
PROFILES = profiles_for(MODELS, GPU, max_gpus=8)
CLUSTER = make_cluster("A6000", nodes=1, gpus_per_node=8)


def _prof(model: str, tp: int = 1) -> Profile:
    return next(p for p in PROFILES if p.model_id == model and p.tp == tp and p.pp == 1)


def _run(policy: str, kind: str, load: float, seed: int = 0):  # type: ignore[no-untyped-def]
    tr = get_trace(kind, None, seed)
    wl = build_workload([(t.name, t.nominal_rate_rps * load) for t in EVAL_TASKS], tr, seed=seed)
    ctx = PolicyContext(EVAL_TASKS, kind, load, MODELS, PROFILES, CLUSTER, GPU, seed=seed)
    p = plan(policy, ctx)
    return wl, p, simulate(p.instances, p.deployments, wl, CLUSTER.gpus, BY_ID, GPU, unplaced=dict(p.unplaced),
                           duration_s=30.0, keep_latencies=True)


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("kind,load", [("code", 1.0), ("conv", 0.5)])
def test_invariants_for_every_policy(policy: str, kind: str, load: float) -> None:
    wl, p, r = _run(policy, kind, load)
    # no request lost: each arrival completed, or rejected because its task has no deployment
    assert r.requests == len(wl) == r.completed + r.rejected
    assert len({rid for rid, _, _ in r.latencies}) == r.completed
    placed = {d.task.name for d in p.deployments}
    assert r.rejected == sum(1 for a in wl if a.task not in placed)
    # memory never over-committed
    for _gid, used, total in r.peak_gpu_memory_gb:
        assert used <= total + 1e-9
    # conservation of tokens: what the LLM calls asked for is what the engines produced/prefilled
    assert r.tokens_emitted == r.tokens_asked > 0
    assert r.prompt_tokens_processed == r.prompt_tokens_asked
    assert 0.0 <= r.goodput <= 1.0
    assert r.cost_usd == pytest.approx(r.gb_reserved * r.residence_s * GPU.price_per_gb_second)


def test_deterministic_under_a_seed() -> None:
    a = _run("flowmaker", "code", 0.75, seed=7)[2]
    b = _run("flowmaker", "code", 0.75, seed=7)[2]
    assert a == b
    c = _run("flowmaker", "code", 0.75, seed=8)[2]
    assert c.latencies != a.latencies


def _one(task: str, wf: str, inst: list[SimInstance], stage_map: dict[str, str], ctx: int = 1000, gen: int = 100,
         at: float = 0.0):  # type: ignore[no-untyped-def]
    t = get_task(task)
    arr = [Arrival(at, task, f"{task}-0", ctx, gen)]
    dep = TaskDeployment(t, (Route(wf, tuple(stage_map.items())),))
    return t.workflow_for_request(wf, ctx, gen), simulate(inst, [dep], arr, CLUSTER.gpus, BY_ID, GPU,
                                                          keep_latencies=True)


def test_lone_request_takes_the_profile_latency() -> None:
    p = _prof("Qwen2.5-7B-Instruct")
    inst = [SimInstance("a", p, ("node0-gpu0",))]
    wf, r = _one("chat", "chat-direct", inst, {"respond": "a"})
    s = wf.stage("respond")
    assert r.latencies[0][1] == pytest.approx(p.call_latency_s(s.input_tokens, s.output_tokens), rel=1e-9)


def test_dag_parallel_branches_tools_and_repeated_calls() -> None:
    p = _prof("Qwen2.5-3B-Instruct")
    inst = [SimInstance("a", p, ("node0-gpu0",)), SimInstance("b", p, ("node0-gpu1",))]
    # two parallel branches on two instances, then a TOOL: latency = slower branch + tool
    wf, r = _one("extract", "ex-parallel", inst, {"entities": "a", "relations": "b"})
    lat = max(p.call_latency_s(s.input_tokens, s.output_tokens) for s in wf.llm_stages) + wf.stage("merge").latency_s
    assert r.latencies[0][1] == pytest.approx(lat, rel=1e-9)
    # 3 sequential calls of one stage, then a TOOL
    wf, r = _one("code", "code-sample-rank", inst, {"sample": "a"})
    s = wf.stage("sample")
    assert r.latencies[0][1] == pytest.approx(3 * p.call_latency_s(s.input_tokens, s.output_tokens)
                                              + wf.stage("rank").latency_s, rel=1e-9)
    assert r.tokens_emitted == 3 * s.output_tokens


def test_goodput_needs_the_accuracy_slo() -> None:
    weak = _prof("Llama-3.2-1B-Instruct")  # accuracy 0.144 < chat's alpha
    _, r = _one("chat", "chat-direct", [SimInstance("w", weak, ("node0-gpu0",))], {"respond": "w"})
    assert r.completed == 1 and r.good == 0 and r.per_task[0].met_latency == 1


def test_unplaced_tasks_are_rejected_not_lost() -> None:
    t = get_task("chat")
    arr = [Arrival(0.1 * i, "chat", f"c{i}", 100, 10) for i in range(5)]
    r = simulate([], [], arr, CLUSTER.gpus, BY_ID, GPU, unplaced={"chat": "NO_GPU_MEMORY"})
    assert (r.requests, r.completed, r.rejected, r.goodput) == (5, 0, 5, 0.0)
    assert r.unplaced == (("chat", "NO_GPU_MEMORY"),)
    assert t.name == r.per_task[0].task


def test_over_committed_memory_is_rejected() -> None:
    big = _prof("Qwen2.5-14B-Instruct")  # 38 GB per GPU
    with pytest.raises(InvalidSpec, match="over-committed"):
        check_memory([SimInstance("a", big, ("node0-gpu0",)), SimInstance("b", big, ("node0-gpu0",))], CLUSTER.gpus)
    with pytest.raises(InvalidSpec, match="unknown GPU"):
        check_memory([SimInstance("a", big, ("nope",))], CLUSTER.gpus)
    with pytest.raises(InvalidSpec, match="distinct GPUs"):
        check_memory([SimInstance("a", dataclasses.replace(big, tp=2), ("node0-gpu0",))], CLUSTER.gpus)


def test_route_to_unknown_instance_is_a_clear_error() -> None:
    t = get_task("chat")
    dep = TaskDeployment(t, (Route("chat-direct", (("respond", "ghost"),)),))
    with pytest.raises(InvalidSpec, match="unknown instance 'ghost'"):
        simulate([], [dep], [], CLUSTER.gpus, BY_ID, GPU)


def test_overload_slows_requests_down() -> None:
    p = _prof("Qwen2.5-7B-Instruct")
    t = get_task("chat")
    inst = [SimInstance("a", p, ("node0-gpu0",))]
    dep = TaskDeployment(t, (Route("chat-direct", (("respond", "a"),)),))
    light = [Arrival(5.0 * i, "chat", f"c{i}", 500, 100) for i in range(10)]
    heavy = [Arrival(0.01 * i, "chat", f"c{i}", 500, 100) for i in range(200)]
    rl = simulate(inst, [dep], light, CLUSTER.gpus, BY_ID, GPU)
    rh = simulate(inst, [dep], heavy, CLUSTER.gpus, BY_ID, GPU)
    assert rh.p99_latency_s > 3 * rl.p99_latency_s
    assert rh.completed == 200
