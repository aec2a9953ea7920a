"""Simulator invariants: no request lost, memory never over-committed, tokens conserved, deterministic; DAG timing."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.domain import Profile
from flowmaker.errors import InvalidSpec
from flowmaker.eval.policies import ALL_POLICIES, PolicyContext, plan
from flowmaker.eval.tasks import EVAL_TASKS, get_task
from flowmaker.eval.traces import Arrival, build_workload, get_trace
from flowmaker.profiling.analytic import profiles_for
from flowmaker.sim import Route, SimInstance, TaskDeployment, check_memory, colocation_factor, simulate

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
    # cost: every instance pays GB x its own residence (from its deploy time to the window end or its last call)
    assert r.cost_usd == pytest.approx(r.gb_seconds * GPU.price_per_gb_second)
    assert r.cost_usd == pytest.approx(sum(m.cost_usd for m in r.per_instance))
    by = {i.id: i for i in p.instances}
    for m in r.per_instance:
        assert m.residence_s >= 30.0 - by[m.id].start_s - 1e-9
        assert m.cost_usd == pytest.approx(by[m.id].memory_gb * m.residence_s * GPU.price_per_gb_second)
        assert 0.0 <= m.busy_fraction


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


def test_goodput_needs_the_latency_slo() -> None:
    slow = _prof("Qwen2.5-14B-Instruct")  # accuracy 0.413 >= chat's alpha, but ~53 ms per output token at tp=1
    _, r = _one("chat", "chat-direct", [SimInstance("s", slow, ("node0-gpu0",))], {"respond": "s"}, gen=1000)
    assert r.latencies[0][1] > get_task("chat").max_latency_s
    assert (r.completed, r.good, r.per_task[0].met_accuracy, r.per_task[0].met_latency) == (1, 0, 1, 0)
    _, ok = _one("chat", "chat-direct", [SimInstance("s", slow, ("node0-gpu0",))], {"respond": "s"}, gen=50)
    assert ok.good == 1 and ok.goodput == 1.0


def test_route_accuracy_is_its_least_accurate_stage_model() -> None:
    weak, strong = _prof("Llama-3.2-1B-Instruct"), _prof("Qwen2.5-3B-Instruct")  # 0.144 < extract's 0.15 <= 0.27
    inst = [SimInstance("w", weak, ("node0-gpu0",)), SimInstance("s", strong, ("node0-gpu1",))]
    _, mixed = _one("extract", "ex-parallel", inst, {"entities": "s", "relations": "w"})
    _, both = _one("extract", "ex-parallel", inst, {"entities": "s", "relations": "s"})
    assert (mixed.per_task[0].met_accuracy, mixed.good) == (0, 0)
    assert (both.per_task[0].met_accuracy, both.good) == (1, 1)


def test_cost_is_gb_times_residence_times_price_per_gb_second() -> None:
    p = _prof("Qwen2.5-7B-Instruct")
    inst = [SimInstance("a", p, ("node0-gpu0",))]
    t = get_task("chat")
    dep = TaskDeployment(t, (Route("chat-direct", (("respond", "a"),)),))
    arr = [Arrival(0.0, "chat", "c0", 1000, 100)]
    price = 0.49 / 3600 / 48  # A6000: $0.49 per hour for 48 GB
    assert GPU.price_per_gb_second == pytest.approx(price)
    lone = simulate(inst, [dep], arr, CLUSTER.gpus, BY_ID, GPU)  # residence = until the last completion
    lat = p.call_latency_s(*(lambda s: (s.input_tokens, s.output_tokens))(
        t.workflow_for_request("chat-direct", 1000, 100).stage("respond")))
    assert lone.residence_s == pytest.approx(lat)
    assert lone.cost_usd == pytest.approx(p.memory_gb_per_gpu * lat * price)
    held = simulate(inst, [dep], arr, CLUSTER.gpus, BY_ID, GPU, duration_s=100.0)  # or the run window, if later
    assert held.cost_usd == pytest.approx(p.memory_gb_per_gpu * 100.0 * price)
    drained = simulate(inst, [dep], arr, CLUSTER.gpus, BY_ID, GPU, duration_s=lat / 2)  # a drain past the window
    assert drained.residence_s == pytest.approx(lat)


def test_instance_metrics_report_the_load_actually_carried() -> None:
    p = _prof("Qwen2.5-7B-Instruct")
    inst = [SimInstance("a", p, ("node0-gpu0",)), SimInstance("idle", p, ("node0-gpu1",))]
    t = get_task("chat")
    dep = TaskDeployment(t, (Route("chat-direct", (("respond", "a"),)),))
    arr = [Arrival(float(i), "chat", f"c{i}", 1000, 100) for i in range(10)]
    r = simulate(inst, [dep], arr, CLUSTER.gpus, BY_ID, GPU, duration_s=20.0)
    a, idle = r.per_instance
    s = t.workflow_for_request("chat-direct", 1000, 100).stage("respond")
    assert (a.calls, a.output_tokens, a.prompt_tokens) == (10, 10 * s.output_tokens, 10 * s.input_tokens)
    assert a.output_tokens_per_s == pytest.approx(10 * s.output_tokens / 20.0)
    busy = 10 * (s.output_tokens / p.pure_decode_tokens_per_s + s.input_tokens * p.prefill_s_per_token)
    assert a.busy_equiv_tokens_per_s == pytest.approx(busy / 20.0 * p.max_output_tokens_per_s)
    assert a.utilization == pytest.approx(busy / 20.0)
    assert a.busy_equiv_tokens_per_s > a.output_tokens_per_s  # prefill counts
    assert (idle.calls, idle.busy_equiv_tokens_per_s) == (0, 0.0)


def test_stage_slowdowns_per_task_and_stage() -> None:
    """A lone call runs at its profile latency (slowdown 1); on a busy engine a short call waits for others'
    prefills, so its slowdown exceeds a long call's on the same instance."""
    p = _prof("Qwen2.5-7B-Instruct")
    inst = [SimInstance("a", p, ("node0-gpu0",))]
    _, lone = _one("chat", "chat-direct", inst, {"respond": "a"})
    assert lone.per_instance[0].stage_slowdowns == (("chat", "respond", pytest.approx(1.0, rel=1e-9)),)
    chat, code = get_task("chat"), get_task("code")
    deps = [TaskDeployment(chat, (Route("chat-direct", (("respond", "a"),)),)),
            TaskDeployment(code, (Route("code-direct", (("complete", "a"),)),))]
    arr = sorted([Arrival(0.05 * i, "chat", f"c{i}", 4000, 300) for i in range(60)]
                 + [Arrival(0.05 * i + 0.01, "code", f"k{i}", 200, 8) for i in range(60)])
    r = simulate(inst, deps, arr, CLUSTER.gpus, BY_ID, GPU, duration_s=10.0)
    sd = {(t, s): x for t, s, x in r.per_instance[0].stage_slowdowns}
    assert set(sd) == {("chat", "respond"), ("code", "complete")}
    assert sd[("code", "complete")] > sd[("chat", "respond")] > 1.0
    # the instance's own figure lies between its stages'
    assert sd[("chat", "respond")] <= r.per_instance[0].slowdown <= sd[("code", "complete")]


_DIGEST = """
import hashlib, sys
from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.eval.policies import PolicyContext, plan
from flowmaker.eval.tasks import EVAL_TASKS
from flowmaker.eval.traces import build_workload, get_trace
from flowmaker.profiling.analytic import profiles_for
from flowmaker.sim import simulate
g, ms = get_gpu_type("A6000"), default_models()
ps, cl = profiles_for(ms, g, max_gpus=8), make_cluster("A6000", nodes=1, gpus_per_node=8)
wl = build_workload([(t.name, t.nominal_rate_rps * 0.5) for t in EVAL_TASKS], get_trace("conv", None, 3), seed=3)
out = []
for pol in ("flowmaker", "routellm-balanced"):
    p = plan(pol, PolicyContext(EVAL_TASKS, "conv", 0.5, tuple(ms), ps, cl, g, seed=3))
    r = simulate(p.instances, p.deployments, wl, cl.gpus, {m.id: m for m in ms}, g, duration_s=30.0,
                 keep_latencies=True)
    out.append(repr((r.latencies, r.cost_usd, r.per_instance)))
print(hashlib.sha256("".join(out).encode()).hexdigest())
"""


def test_deterministic_across_processes_whatever_the_hash_seed() -> None:
    # Same seed, two interpreters with different string hashing: set/dict order must not leak into results.
    import os
    import subprocess
    import sys
    digests = set()
    for hs in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hs)
        out = subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, timeout=120,
                             check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1 and len(digests.pop()) == 64


def test_worst_case_colocation_slows_instances_sharing_a_gpu() -> None:
    p = _prof("Qwen2.5-7B-Instruct")  # 19 GB per GPU: two fit on one A6000
    shared = [SimInstance("a", p, ("node0-gpu0",)), SimInstance("b", p, ("node0-gpu0",)),
              SimInstance("c", p, ("node0-gpu1",))]
    assert colocation_factor(shared) == {"a": 2, "b": 2, "c": 1}
    wf, alone = _one("chat", "chat-direct", shared, {"respond": "a"})
    slowed = simulate(shared, [TaskDeployment(get_task("chat"), (Route("chat-direct", (("respond", "a"),)),))],
                      [Arrival(0.0, "chat", "chat-0", 1000, 100)], CLUSTER.gpus, BY_ID, GPU, keep_latencies=True,
                      colocation="worst-case")
    s = wf.stage("respond")
    engine_s = p.prefill_s_per_token * s.input_tokens + p.decode_s_per_token * s.output_tokens
    assert alone.latencies[0][1] == pytest.approx(p.fixed_s + engine_s)
    assert slowed.latencies[0][1] == pytest.approx(p.fixed_s + 2 * engine_s)  # fixed_s is not GPU time
    with pytest.raises(InvalidSpec, match="colocation"):
        simulate(shared, [], [], CLUSTER.gpus, BY_ID, GPU, colocation="magic")


def _flat(model: str = "Qwen2.5-7B-Instruct") -> Profile:
    """A profile with round numbers: no fixed or prefill cost, 20 ms per token, 1000 tok/s."""
    return dataclasses.replace(_prof(model), fixed_s=0.0, prefill_s_per_token=0.0, decode_s_per_token=0.02,
                               max_output_tokens_per_s=1000.0, decode_tokens_per_s=1000.0)


def _chat_runs(inst: list[SimInstance], reqs: list[tuple[float, str]], colocation: str = "dynamic",  # type: ignore[no-untyped-def]
               kappa: float = 1.0):
    t = get_task("chat")
    routes = tuple(Route("chat-direct", (("respond", i.id),)) for i in inst)
    names = [i.id for i in inst]
    dep = TaskDeployment(t, routes, lambda a, k, load: names.index(a.req_id.split("-")[0]))
    arr = [Arrival(at, "chat", f"{iid}-{k}", 100, 100) for k, (at, iid) in enumerate(reqs)]
    r = simulate(inst, [dep], arr, CLUSTER.gpus, BY_ID, GPU, keep_latencies=True, colocation=colocation,
                 colocation_kappa=kappa)
    return {rid.split("-")[0]: lat for rid, lat, _ in r.latencies}, r


def test_dynamic_colocation_hand_computed() -> None:
    """Two instances on one GPU, 100 output tokens each at 20 ms/token alone.
    Both busy from 0: each runs at half speed -> 4.0 s. Staggered (b at 1.0): a alone for 50 tokens (1.0 s), then
    both at half speed: a's last 50 take 2.0 s (a ends at 3.0); b did 50 by then, its last 50 alone take 1.0 s
    (ends at 4.0, latency 3.0). An instance on another GPU is never slowed."""
    p = _flat()
    inst = [SimInstance("a", p, ("node0-gpu0",)), SimInstance("b", p, ("node0-gpu0",)),
            SimInstance("c", p, ("node0-gpu1",))]
    lat, r = _chat_runs(inst, [(0.0, "a"), (0.0, "b"), (0.0, "c")])
    assert lat == pytest.approx({"a": 4.0, "b": 4.0, "c": 2.0}, abs=1e-9)
    assert r.speed_changes >= 2
    lat, _ = _chat_runs(inst, [(0.0, "a"), (1.0, "b")])
    assert lat == pytest.approx({"a": 3.0, "b": 3.0}, abs=1e-9)
    # the bounds: ignore = alone; worst-case = always halved
    lat, _ = _chat_runs(inst, [(0.0, "a"), (1.0, "b")], "ignore")
    assert lat == pytest.approx({"a": 2.0, "b": 2.0}, abs=1e-9)
    lat, _ = _chat_runs(inst, [(0.0, "a"), (1.0, "b")], "worst-case")
    assert lat == pytest.approx({"a": 4.0, "b": 4.0}, abs=1e-9)


def test_colocation_kappa_hand_computed() -> None:
    """kappa: each busy co-resident slows an instance by kappa (1 / (1 + kappa (k - 1)) with k busy). The same two
    instances on one GPU, 100 tokens at 20 ms each alone (2.0 s). kappa 2, both busy from 0: each at 1/3 speed ->
    6.0 s. Staggered (b at 1.0): a alone 50 tokens (1.0 s), then both at 1/3: a's last 50 take 3.0 s (a ends at 4.0),
    b did 50 by then, its last 50 alone take 1.0 s (ends at 5.0, latency 4.0). kappa 0.5: both busy -> 1/1.5 speed,
    3.0 s. kappa 0 is "ignore". Worst-case: slowed by 1 + kappa all the time. The instance alone on its GPU never
    changes."""
    p = _flat()
    inst = [SimInstance("a", p, ("node0-gpu0",)), SimInstance("b", p, ("node0-gpu0",)),
            SimInstance("c", p, ("node0-gpu1",))]
    lat, _ = _chat_runs(inst, [(0.0, "a"), (0.0, "b"), (0.0, "c")], kappa=2.0)
    assert lat == pytest.approx({"a": 6.0, "b": 6.0, "c": 2.0}, abs=1e-9)
    lat, _ = _chat_runs(inst, [(0.0, "a"), (1.0, "b")], kappa=2.0)
    assert lat == pytest.approx({"a": 4.0, "b": 4.0}, abs=1e-9)
    lat, _ = _chat_runs(inst, [(0.0, "a"), (0.0, "b")], kappa=0.5)
    assert lat == pytest.approx({"a": 3.0, "b": 3.0}, abs=1e-9)
    assert _chat_runs(inst, [(0.0, "a"), (1.0, "b")], kappa=0.0)[0] == \
        _chat_runs(inst, [(0.0, "a"), (1.0, "b")], "ignore")[0]
    lat, _ = _chat_runs(inst, [(0.0, "a"), (1.0, "b")], "worst-case", kappa=3.0)
    assert lat == pytest.approx({"a": 8.0, "b": 8.0}, abs=1e-9)
    for bad in (-0.1, 4.5, math.nan):
        with pytest.raises(InvalidSpec) as e:
            _chat_runs(inst, [(0.0, "a")], kappa=bad)
        assert e.value.field == "colocation_kappa"


def test_dynamic_colocation_lies_between_the_bounds_on_a_real_plan() -> None:
    wl, p, _ = _run("flowmaker-noreuse", "conv", 0.5)
    res = {m: simulate(p.instances, p.deployments, wl, CLUSTER.gpus, BY_ID, GPU, duration_s=30.0, colocation=m)
           for m in ("ignore", "dynamic", "worst-case")}
    assert res["ignore"].mean_latency_s <= res["dynamic"].mean_latency_s + 1e-9
    assert res["dynamic"].mean_latency_s <= res["worst-case"].mean_latency_s + 1e-9
    assert res["dynamic"].tokens_emitted == res["ignore"].tokens_emitted


def test_each_instance_pays_for_its_own_residence() -> None:
    p = _flat()
    inst = [SimInstance("a", p, ("node0-gpu0",)), SimInstance("late", p, ("node0-gpu1",), start_s=10.0)]
    t = get_task("chat")
    dep = TaskDeployment(t, (Route("chat-direct", (("respond", "a"),)),))
    r = simulate(inst, [dep], [Arrival(0.0, "chat", "c0", 100, 100)], CLUSTER.gpus, BY_ID, GPU, duration_s=30.0)
    a, late = r.per_instance
    assert (a.residence_s, late.residence_s) == (30.0, 20.0)
    price = GPU.price_per_gb_second
    assert r.cost_usd == pytest.approx(p.memory_gb_per_gpu * (30.0 + 20.0) * price)
    # a drain past the window extends only the instance that drains
    r2 = simulate(inst, [dep], [Arrival(0.0, "chat", "c0", 100, 100)], CLUSTER.gpus, BY_ID, GPU, duration_s=1.0)
    a2, late2 = r2.per_instance
    assert a2.residence_s == pytest.approx(2.0) and late2.residence_s == 0.0


def test_monitor_window_counts_only_calls_from_measure_from() -> None:
    p = _flat()
    inst = [SimInstance("a", p, ("node0-gpu0",))]
    t = get_task("chat")
    dep = TaskDeployment(t, (Route("chat-direct", (("respond", "a"),)),))
    arr = [Arrival(float(i), "chat", f"c{i}", 100, 100) for i in range(10)]
    r = simulate(inst, [dep], arr, CLUSTER.gpus, BY_ID, GPU, duration_s=10.0, measure_from_s=5.0)
    (m,) = r.per_instance
    s = t.workflow_for_request("chat-direct", 100, 100).stage("respond")
    assert m.calls == 5 and m.output_tokens == 5 * s.output_tokens
    assert m.output_tokens_per_s == pytest.approx(5 * s.output_tokens / 5.0)


def test_measured_load_counts_only_while_the_instance_existed() -> None:
    """An instance deployed at 6 s in a [0, 10) window carries its calls over 4 s, not 10 s."""
    p = _flat()
    inst = [SimInstance("late", p, ("node0-gpu0",), start_s=6.0)]
    t = get_task("chat")
    dep = TaskDeployment(t, (Route("chat-direct", (("respond", "late"),)),))
    arr = [Arrival(6.0 + i, "chat", f"c{i}", 100, 100) for i in range(4)]
    (m,) = simulate(inst, [dep], arr, CLUSTER.gpus, BY_ID, GPU, duration_s=10.0).per_instance
    s = t.workflow_for_request("chat-direct", 100, 100).stage("respond")
    assert m.output_tokens_per_s == pytest.approx(4 * s.output_tokens / 4.0)
    assert 0.0 < m.busy_fraction <= 1.0
