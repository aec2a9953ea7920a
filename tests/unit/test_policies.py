"""Policy registry and the baselines' documented fixed choices; the serving benchmark end to end (small)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.experiment import load_experiment
from flowmaker.eval.policies import (
    ALL_POLICIES,
    LANGCHAIN_DEFAULT_MODEL,
    ROUTELLM_STRONG,
    ROUTELLM_STRONG_SHARE,
    ROUTELLM_WEAK,
    MeasuredLoad,
    PolicyContext,
    get_policy,
    langchain_model,
    lone_latency_s,
    plan,
    simulated_monitor,
)
from flowmaker.eval.slo import with_rule_slos
from flowmaker.eval.tasks import EVAL_TASKS
from flowmaker.eval.traces import Arrival, build_segment_workload, get_trace
from flowmaker.profiling.analytic import profiles_for
from flowmaker.sim import SimInstance, TaskDeployment, check_memory

GPU = get_gpu_type("A6000")
MODELS = default_models()
PROFILES = profiles_for(MODELS, GPU, max_gpus=8)
CLUSTER = make_cluster("A6000", nodes=1, gpus_per_node=8)


BY_ID = {m.id: m for m in MODELS}
TASKS = with_rule_slos(EVAL_TASKS, "conv", PROFILES, BY_ID, GPU)


def _wl(load: float = 0.5, seed: int = 0):  # type: ignore[no-untyped-def]
    return build_segment_workload([(t.name, t.nominal_rate_rps * load) for t in TASKS], get_trace("conv", None),
                                  load, seed=seed, segment_s=300.0)


def _ctx(load: float = 0.5, kind: str = "conv", **kw: object) -> PolicyContext:
    return PolicyContext(TASKS, kind, load, MODELS, PROFILES, CLUSTER, GPU, **kw)  # type: ignore[arg-type]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(NotFound, match="unknown policy 'nope'; known"):
        get_policy("nope")


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_every_policy_gives_a_consistent_plan(name: str) -> None:
    wl = _wl()
    p = plan(name, _ctx(workload=wl))
    check_memory(p.instances, CLUSTER.gpus)
    ids = {i.id for i in p.instances}
    assert {d.task.name for d in p.deployments} | {u for u, _ in p.unplaced} == {t.name for t in TASKS}
    for d in p.deployments:
        for r in d.routes:
            wf = d.task.candidate(r.workflow_id).instantiate(100, 10)
            assert {s.id for s in wf.llm_stages} == {s for s, _ in r.stage_instances}
            assert {i for _, i in r.stage_instances} <= ids
            if name != "flowmaker" and not name.startswith("flowmaker-"):
                assert r.workflow_id == d.task.fixed_workflow  # the baselines serve the fixed workflow
    # an instance exists from the deploy of the task that created it (RouteLLM: the first deploy)
    first = min(d for _, d in wl.deploy_s)
    for i in p.instances:
        assert i.start_s == pytest.approx(wl.deploy_time(i.deployed_by) if i.deployed_by in dict(wl.deploy_s)
                                          else first)


def test_flowmaker_reuses_and_noreuse_does_not() -> None:
    fm, nr = plan("flowmaker", _ctx()), plan("flowmaker-noreuse", _ctx())
    assert any(d.reused for d in fm.decisions)
    assert not any(d.reused for d in nr.decisions)


def test_langchain_one_instance_per_stage_first_fit_by_hand() -> None:
    """2 empty A6000s (48 GB), smallest-model rule: chat's 2 stages -> 2 x Qwen2.5-3B (9.4 GB) both on gpu0; code's
    2 stages -> 2 x Qwen2.5-7B (19.1 GB): the first still fits on gpu0 (18.8 + 19.1 <= 48), the second goes to
    gpu1; math's Qwen2.5-14B (38 GB) stages: gpu0 has 9.2 GB left, gpu1 28.9 -> its first stage fails, the task
    fails and nothing of it stays placed."""
    two = make_cluster("A6000", nodes=1, gpus_per_node=2)
    tasks = tuple(t for t in TASKS if t.name in ("chat", "code", "math"))
    p = plan("langchain", PolicyContext(tasks, "conv", 0.5, MODELS, PROFILES, two, GPU))
    got = [(i.deployed_by, i.profile.model_id, i.gpu_ids) for i in p.instances]
    assert got == [("chat", "Qwen2.5-3B-Instruct", ("node0-gpu0",)), ("chat", "Qwen2.5-3B-Instruct", ("node0-gpu0",)),
                   ("code", "Qwen2.5-7B-Instruct", ("node0-gpu0",)), ("code", "Qwen2.5-7B-Instruct", ("node0-gpu1",))]
    assert [u for u, _ in p.unplaced] == ["math"] and "NO_GPU_MEMORY" in p.unplaced[0][1]
    assert [(t, s) for t, s, _ in p.placement_failures] == [("math", "program")]
    assert not any(d.reused for d in p.decisions)
    # the whole evaluation: one instance per LLM stage of the fixed workflows (15), nothing sized for load
    full = plan("langchain", _ctx())
    assert len(full.instances) + sum(1 for _ in full.placement_failures) >= 15
    assert [i.profile.key for i in plan("langchain", _ctx(1.0)).instances] == [i.profile.key for i in full.instances]


def test_langchain_model_rules() -> None:
    for t in TASKS:
        m = next(x for x in MODELS if x.id == langchain_model(t, MODELS))
        assert m.accuracy >= t.min_accuracy
        assert all(x.params_b >= m.params_b for x in MODELS if x.accuracy >= t.min_accuracy)
        assert langchain_model(t, MODELS, "strong") == LANGCHAIN_DEFAULT_MODEL
    with pytest.raises(InvalidSpec, match="rule"):
        langchain_model(TASKS[0], MODELS, "magic")
    # the strong rule: 15 x 38 GB on 8 x 48 GB cannot all be placed; failures are reported, not hidden
    p = plan("langchain", _ctx(langchain_model="strong"))
    assert p.placement_failures and len(p.instances) <= 8


def test_routellm_shares_pools_and_tp_rule() -> None:
    wl = _wl()
    for setting, share in ROUTELLM_STRONG_SHARE.items():
        p = plan(f"routellm-{setting}", _ctx(workload=wl))
        models = {i.profile.model_id for i in p.instances}
        assert models == ({ROUTELLM_STRONG} if share == 1.0 else {ROUTELLM_STRONG, ROUTELLM_WEAK})
        d = p.deployments[0]
        assert d.router is not None
        strong = {k for k, r in enumerate(d.routes)
                  if next(i for i in p.instances if i.id == r.stage_instances[0][1]).profile.model_id
                  == ROUTELLM_STRONG}
        picks = [d.router(Arrival(0.0, d.task.name, f"r{k}", 10, 10), k, lambda iid: 0.0) for k in range(2000)]
        frac = sum(1 for r in picks if r in strong) / len(picks)
        assert frac == pytest.approx(share, abs=0.04)
        # tp: every task's lone request meets its latency SLO at the sizing request, or no tp does
        for mid in models:
            prof = next(i.profile for i in p.instances if i.profile.model_id == mid)
            ok = all(lone_latency_s(t.fixed_nominal("conv", "mean"), prof) <= t.max_latency_s for t in TASKS)
            smaller = [q for q in PROFILES if q.model_id == mid and q.pp == 1 and q.tp < prof.tp]
            assert ok or not any(all(lone_latency_s(t.fixed_nominal("conv", "mean"), q) <= t.max_latency_s
                                     for t in TASKS) for q in PROFILES if q.model_id == mid and q.pp == 1)
            for q in smaller:  # the smallest tp that works
                assert not all(lone_latency_s(t.fixed_nominal("conv", "mean"), q) <= t.max_latency_s for t in TASKS)


def test_routellm_dispatches_to_the_least_loaded_replica() -> None:
    p = plan("routellm-max-quality", _ctx(1.0, workload=_wl(1.0)))
    d = p.deployments[0]
    assert d.router is not None and len(d.routes) >= 2
    ids = [r.stage_instances[0][1] for r in d.routes]
    load = {iid: 10.0 for iid in ids}
    load[ids[-1]] = 1.0
    assert d.router(Arrival(0.0, d.task.name, "x", 10, 10), 0, lambda iid: load[iid]) == len(ids) - 1
    load[ids[0]] = 0.5
    assert d.router(Arrival(0.0, d.task.name, "y", 10, 10), 1, lambda iid: load[iid]) == 0


def test_rates_each_policy_plans_with() -> None:
    """FlowMaker: its burst rate, the trace minute before its deploy, its declared rate, tried in that order (the
    first that fits); Murakkab: the segment mean; -maxload: the peak minute."""
    wl = _wl()
    ctx = _ctx(workload=wl)
    by = {t.name: t for t in TASKS}
    fm = dict(plan("flowmaker-plannedload", _ctx(workload=wl)).planned_rates)
    mk = dict(plan("murakkab", _ctx(workload=wl)).planned_rates)
    mx = dict(plan("murakkab-maxload", _ctx(workload=wl)).planned_rates)
    for name in by:
        d = wl.deploy_time(name)
        tries = ctx.planning_rates(by[name])
        measured, declared = wl.rate_in(name, d - wl.window_s, d), by[name].nominal_rate_rps * ctx.load
        assert tries[0] == pytest.approx(max(wl.burst_rate(name, by[name].max_latency_s, d), measured, declared))
        assert tries[-1] == pytest.approx(declared) and list(tries) == sorted(tries, reverse=True)
        assert any(fm[name] == pytest.approx(r) for r in tries)
        assert mk[name] == pytest.approx(wl.mean_rate(name))
        assert mx[name] == pytest.approx(wl.peak_rate(name)) and mx[name] >= mk[name]
    # Murakkab plans offline: the same rates whatever happens before a deploy; no workload -> load x nominal
    nominal = dict(plan("murakkab", _ctx(0.25)).planned_rates)
    assert nominal == pytest.approx({t.name: 0.25 * t.nominal_rate_rps for t in TASKS})


def test_serving_bench_small_matrix_records_the_setup(tmp_path: Path) -> None:
    from flowmaker.bench.serving import run_serving_bench
    rep = run_serving_bench(tmp_path, traces_dir=tmp_path / "none", policies=["flowmaker", "langchain",
                                                                              "flowmaker-noreuse", "murakkab"],
                            loads=[0.25], traces=["conv"], segment_requests=120)
    data = json.loads((tmp_path / "serving.json").read_text())
    assert len(data["rows"]) == 4
    setup = data["setup"]
    assert "synthetic" in setup["trace_sources"]["conv"]
    assert {t["task"]: t["fixed_workflow"] for t in setup["tasks"]} == {t.name: t.fixed_workflow for t in TASKS}
    assert all(2 <= t["slo_k"] <= 5 for t in setup["tasks"])
    exp = load_experiment()
    assert setup["experiment"]["sha256"] == exp.sha256 and len(exp.sha256) == 64
    assert {t["task"]: t["accuracy_slo"] for t in setup["tasks"]} == dict(exp.accuracy)
    seg = setup["segments"][0]
    assert seg["segment_requests"] == 120 and seg["offset_s"] >= 0 and len(seg["deploy_s"]) == len(TASKS)
    assert seg["scored_requests"] == data["rows"][0]["requests"] <= 120
    assert setup["seed"] == 0 and setup["colocation"] == "dynamic"
    for row in data["rows"]:
        assert 0.0 <= row["goodput"] <= 1.0 and 0.0 <= row["accuracy_hit_rate"] <= 1.0
        assert row["cost_usd"] == pytest.approx(sum(i["cost_usd"] for i in row["instance_list"]))
    for name in ("vs_langchain_goodput", "vs_langchain_cost", "reuse_vs_noreuse_low_load_cost",
                 "vs_murakkab_low_load_cost", "noreuse_vs_murakkab_low_load_cost", "langchain_placement_failures"):
        assert name in data["ratios"], name
    for f in rep["plots"]:
        assert Path(f).stat().st_size > 1000
    with pytest.raises(NotFound):
        run_serving_bench(tmp_path, policies=["nope"])


def test_current_load_comes_from_the_monitor_for_flowmaker_only() -> None:
    """flowmaker reads the monitor before each deployment, at its deploy time; plannedload and murakkab do not."""
    calls: list[tuple[int, float]] = []
    wl = _wl()

    def saturated(instances: Sequence[SimInstance], deployments: Sequence[TaskDeployment],
                  at: float) -> dict[str, MeasuredLoad]:
        calls.append((len(deployments), at))
        # every running instance reports a load above the cap: nothing can be reused
        return {i.id: MeasuredLoad(2.0 * i.profile.max_output_tokens_per_s, 1.0) for i in instances}

    ctx = _ctx(monitor=saturated, workload=wl)
    fm = plan("flowmaker", ctx)
    assert calls and [c[0] for c in calls] == sorted(c[0] for c in calls)
    # asked just before each deploy after the first (a task with no feasible variant deploys nothing)
    assert [at for _, at in calls] == pytest.approx([at for _, at in wl.deploy_s[1:]])
    assert not any(d.reused for d in fm.decisions)
    n_calls = len(calls)
    for name in ("flowmaker-plannedload", "murakkab", "murakkab-maxload", "flowmaker-noreuse"):
        assert plan(name, ctx).instances  # planned without the monitor
    assert len(calls) == n_calls
    assert any(d.reused for d in plan("flowmaker-plannedload", ctx).decisions)


def test_simulated_monitor_sees_only_the_past_and_what_is_deployed() -> None:
    wl = _wl()
    mon = simulated_monitor(wl, CLUSTER.gpus, BY_ID, GPU)
    p = plan("flowmaker-plannedload", _ctx(workload=wl))
    first = p.deployments[:1]
    used = {i for r in first[0].routes for _, i in r.stage_instances}
    at = wl.deploy_s[1][1]
    seen = mon(p.instances, first, at)
    assert set(seen) == {i.id for i in p.instances}
    assert all(seen[i].load > 0 for i in used) and all(seen[i].load == 0 for i in seen if i not in used)
    # the busy share (from the call-seconds offered) is a fraction, non-zero exactly where calls were served
    assert all(0 < seen[i].busy_share < 1 for i in used) and all(seen[i].busy_share == 0 for i in seen if i not in used)
    # by hand: the busy-time equivalent of the first task's calls submitted in the window before `at`
    assert mon(p.instances, first, wl.deploy_s[0][1]) == {i.id: (0.0, 0.0) for i in p.instances}  # nothing before


def test_planned_loads_are_reported_and_capped() -> None:
    p = plan("flowmaker-plannedload", _ctx(1.0))
    cap = {i.id: i.profile.max_output_tokens_per_s for i in p.instances}
    assert {i for i, _ in p.planned_loads} == set(cap)
    for iid, load in p.planned_loads:
        # within the cap, or within capacity where a task would otherwise get no plan at all (the fallback)
        assert 0 < load <= cap[iid] + 1e-6


def test_a_burst_that_fits_nowhere_falls_back_to_the_declared_rate() -> None:
    from flowmaker.eval.policies import _select_in_sequence

    ctx = _ctx(0.25)
    huge = _select_in_sequence(ctx, strategy="exact", allow_reuse=True, rate=lambda t: 1e6, fixed_workflow=False,
                               measured=False)
    assert len(huge.unplaced) == len(TASKS) and not huge.deployments
    fb = _select_in_sequence(ctx, strategy="exact", allow_reuse=True, rate=lambda t: (1e6, ctx.nominal_rate(t)),
                             fixed_workflow=False, measured=False, fallback=True)
    assert not fb.unplaced and len(fb.deployments) == len(TASKS)
    assert dict(fb.planned_rates) == pytest.approx({t.name: ctx.nominal_rate(t) for t in TASKS})


def test_plan_rates_step_down_from_the_burst_to_the_declared_rate() -> None:
    from flowmaker.eval.policies import BURST_STEPS, plan_rates
    r = plan_rates(16.0, 1.0, 0.5)
    assert r[0] == 16.0 and r[-2:] == (1.0, 0.5) and len(r) == BURST_STEPS + 2
    assert list(r) == sorted(set(r), reverse=True)
    assert r[1] == pytest.approx(16.0 * (1 / 16) ** (1 / BURST_STEPS))  # geometric steps
    # never below what the task declared; equal rates are tried once
    assert plan_rates(0.0, 0.0, 2.0) == (2.0,)
    assert plan_rates(3.0, 0.1, 2.0) == pytest.approx((3.0, *(3.0 * (2 / 3) ** (k / BURST_STEPS)
                                                              for k in range(1, BURST_STEPS)), 2.0))


def test_burst_rate_is_the_share_of_the_densest_window_seen_before_the_deploy() -> None:
    wl = _wl()
    name = TASKS[0].name
    at = wl.deploy_time(name)
    share = dict(wl.shares)[name]
    seen = sorted([*wl.history_s, *(a.time_s for a in wl.all_arrivals if a.time_s < at)])
    w = TASKS[0].max_latency_s
    # brute force over windows starting at each arrival
    best = max(sum(1 for x in seen if t <= x < t + w) for t in seen) if seen else 0
    assert wl.burst_rate(name, w, at) == pytest.approx(share * best / w)
    assert best >= 1 and wl.burst_rate(name, w, at) > 0
    # a later deploy has seen at least as much
    assert wl.burst_rate(name, w, at + 60.0) >= wl.burst_rate(name, w, at)
    assert wl.burst_rate("nobody", w, at) == 0.0


def test_serving_bench_rejects_unknown_options(tmp_path: Path) -> None:
    from flowmaker.bench.serving import run_serving_bench
    with pytest.raises(InvalidSpec, match="unknown statistic"):
        run_serving_bench(tmp_path, plan_tokens="p99", plots=False)
    with pytest.raises(InvalidSpec, match="colocation"):
        run_serving_bench(tmp_path, colocation="magic", plots=False)
    with pytest.raises(InvalidSpec, match="LangChain"):
        run_serving_bench(tmp_path, langchain_rule="magic", plots=False)


def test_cli_serving_options_reach_the_bench(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flowmaker.cli.main import app
    r = CliRunner().invoke(app, ["bench", "serving", "--out", str(tmp_path), "--traces", str(tmp_path / "none"),
                                 "--loads", "0.25", "--trace-kinds", "conv", "--policies", "flowmaker,langchain",
                                 "--segment-requests", "100", "--colocation", "worst-case", "--plan-tokens", "mean",
                                 "--langchain-model", "strong", "--seed", "3", "--variant", "product-targets",
                                 "--variant", "published-latency-scale", "--colocation-kappa", "1.5"],
                                env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    setup = json.loads((tmp_path / "serving.json").read_text())["setup"]
    assert (setup["colocation"], setup["plan_tokens"], setup["segment_requests"], setup["langchain_rule"],
            setup["seed"], setup["loads"], setup["policies"]) == ("worst-case", "mean", 100, "strong", 3, [0.25],
                                                                  ["flowmaker", "langchain"])
    assert setup["colocation_kappa"] == 1.5
    assert setup["experiment"]["name"] == "paper-scale+product-targets+generated-x4"
    assert setup["experiment"]["settings"]["generated_token_scale"] == 4.0
    assert setup["experiment"]["settings"]["accuracy"] == {t.name: t.min_accuracy for t in EVAL_TASKS}
    assert "flowmaker-request-segment" in setup["seeds"]["segment_start"]


@pytest.mark.parametrize(("args", "field"), [(["--colocation-kappa", "5"], "colocation_kappa"),
                                              (["--variant", "magic"], "variant"),
                                              (["--colocation", "magic"], "colocation")])
def test_cli_bad_bench_options_are_a_clear_error_not_a_traceback(tmp_path: Path, args: list[str], field: str) -> None:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "flowmaker.cli.main", "bench", "serving", "--out", str(tmp_path),
                        *args], capture_output=True, text=True, timeout=120)
    # docs/cli.md, "Exit codes": an option value FlowMaker rejects is a failure (1) with the one error line
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith("error: INVALID_ARGUMENT") and f" {field}: " in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


@pytest.mark.parametrize("cap", [1, 2])
def test_max_instance_gpus_limits_every_selector_based_policy(cap: int) -> None:
    """The sensitivity knob: FlowMaker's policies and Murakkab choose only configurations of at most `cap` GPUs,
    and without it the same load picks wider ones (so the knob changes something)."""
    for pol in ("flowmaker", "flowmaker-noreuse", "murakkab"):
        limited = plan(pol, _ctx(load=1.0, max_instance_gpus=cap))
        assert limited.instances, pol
        assert all(i.profile.gpus <= cap for i in limited.instances), pol
    free = plan("flowmaker", _ctx(load=1.0))
    assert any(i.profile.gpus > 2 for i in free.instances)


def test_max_instance_gpus_must_not_be_negative(tmp_path: Path) -> None:
    from flowmaker.bench.serving import run_serving_bench

    with pytest.raises(InvalidSpec, match="max_instance_gpus"):
        run_serving_bench(tmp_path, max_instance_gpus=-1, plots=False, quiet=True)


def test_a_task_no_shared_plan_serves_is_deployed_best_effort_not_refused() -> None:
    """At four times the load the sharing contract finds no plan for some tasks (their co-residents would
    miss their SLOs); the fallback deploys them where the sharing-blind contract places them, and says so."""
    from flowmaker.eval.policies import _select_in_sequence

    ctx = _ctx(4.0)
    kw = dict(strategy="exact", allow_reuse=True, rate=ctx.nominal_rate, fixed_workflow=False, measured=False,
              fallback=True)
    strict = _select_in_sequence(ctx, **kw)  # type: ignore[arg-type]
    fb = _select_in_sequence(ctx, best_effort=True, **kw)  # type: ignore[arg-type]
    assert strict.unplaced and not strict.best_effort
    assert len(fb.unplaced) < len(strict.unplaced) and len(fb.deployments) + len(fb.unplaced) == len(TASKS)
    assert all(why.startswith("NO_CAPACITY") for _, why in fb.unplaced)  # what no contract serves stays refused
    assert fb.best_effort and set(fb.best_effort) <= {u for u, _ in strict.unplaced}
    check_memory(fb.instances, CLUSTER.gpus)


def test_a_task_no_plan_carries_whole_is_planned_for_the_largest_part_that_keeps_every_slo() -> None:
    """`overload_steps`: where no plan keeps every SLO at the task's rate, the task gets the plan for the largest part of
    it that does (to within 1/64 of the rate, by bisection), before any sharing-blind plan; no rate above it has
    one, and the plan is recorded as best effort at the rate it was made for."""
    from dataclasses import replace

    from flowmaker.domain import Cluster, GpuSharing, SelectionOptions, SelectionRequest
    from flowmaker.eval.policies import PARTIAL_HALVINGS, _select_in_sequence, largest_rate_plan
    from flowmaker.selection import select

    ctx = _ctx(4.0)
    kw = dict(strategy="exact", allow_reuse=True, rate=ctx.nominal_rate, fixed_workflow=False, measured=False,
              fallback=True, best_effort=True)
    blind = _select_in_sequence(ctx, **kw)  # type: ignore[arg-type]
    part = _select_in_sequence(ctx, overload_steps=True, **kw)  # type: ignore[arg-type]
    assert part.best_effort and len(part.deployments) >= len(blind.deployments)
    planned = dict(part.planned_rates)
    cut = [t for t in part.best_effort if planned[t] < ctx.nominal_rate(next(x for x in TASKS if x.name == t))]
    assert cut, (part.best_effort, planned)  # some task was planned for part of its rate
    check_memory(part.instances, CLUSTER.gpus)

    # The helper alone: the first task at 4x on the empty cluster, whose whole rate no plan keeps.
    task = TASKS[0]
    req = SelectionRequest(slo=replace(task.slo(), arrival_rate_rps=ctx.nominal_rate(task) * 40),
                           workflows=task.nominal_workflows(ctx.trace_kind, ctx.plan_tokens), models=ctx.models,
                           profiles=ctx.profiles, cluster=Cluster(CLUSTER.gpus, ()),
                           options=SelectionOptions(utilization_cap=ctx.utilization_cap,
                                                    capacity_model=ctx.capacity_model,
                                                    gpu_sharing=GpuSharing.INTERFERENCE))
    assert select(req, "exact").variant is None
    got = largest_rate_plan(req, lambda q: select(q, "exact"))
    assert got is not None
    r_req, r_res = got
    assert r_res.variant is not None and 0 < r_req.slo.arrival_rate_rps < req.slo.arrival_rate_rps
    step = req.slo.arrival_rate_rps / 2 ** PARTIAL_HALVINGS
    above = replace(req, slo=replace(req.slo, arrival_rate_rps=(r_req.slo.arrival_rate_rps + step) * (1 + 1e-9)))
    assert select(above, "exact").variant is None  # within one step of the largest rate that fits
    # An SLO no rate meets: nothing at any rate.
    never = replace(req, slo=replace(req.slo, max_latency_s=1e-6))
    assert largest_rate_plan(never, lambda q: select(q, "exact")) is None


def test_a_plan_on_most_of_the_cluster_is_replanned_scaled_out_and_its_replicas_are_routed() -> None:
    """FlowMaker's policies: a task whose plan spans more than half the cluster's GPUs (at 4x, chat on two
    Qwen2.5-3B tp4 instances: all 8) is re-planned with GPUs priced and replicas allowed, and gets the plan on fewer
    GPUs; a stage scaled out to replicas appears in the task's route once per replica."""
    from flowmaker.eval.policies import SCALE_OUT_SHARE, Plan, _select_in_sequence

    ctx = _ctx(4.0)
    kw = dict(strategy="exact", allow_reuse=True, rate=ctx.nominal_rate, fixed_workflow=False, measured=False,
              fallback=True, best_effort=True)
    plain = _select_in_sequence(ctx, **kw)  # type: ignore[arg-type]
    flow = _select_in_sequence(ctx, overload_steps=True, **kw)  # type: ignore[arg-type]
    first = ctx.tasks[0].name

    def gpus_of(p: Plan) -> int:
        return sum(len(i.gpu_ids) for i in p.instances if i.deployed_by == first)

    wide = len(CLUSTER.gpus) * SCALE_OUT_SHARE
    assert gpus_of(plain) > wide
    assert 0 < gpus_of(flow) <= wide
    route = next(d for d in flow.deployments if d.task.name == first).routes[0]
    stages = [s for s, _ in route.stage_instances]
    assert len(stages) > len(set(stages))  # a stage on several replicas
    assert {i for _, i in route.stage_instances} <= {i.id for i in flow.instances}
    check_memory(flow.instances, CLUSTER.gpus)


def test_a_plan_still_wide_once_scaled_out_is_made_for_the_part_of_the_rate_half_the_cluster_carries() -> None:
    """FlowMaker's policies: at twice the load math's plan for part of its rate, even scaled out, spans 6 of the 8
    GPUs; it is made instead for the largest part that a plan on at most half the cluster carries, so that no task's
    own instances span more than half. The helper alone: the first lower rate tried whose plan is that narrow wins,
    else the bisection's rate, within one step of the largest; nothing when no plan is narrow enough."""
    from dataclasses import replace

    from flowmaker.domain import Cluster, GpuSharing, SelectionOptions, SelectionRequest
    from flowmaker.eval.policies import PARTIAL_HALVINGS, SCALE_OUT_SHARE, _select_in_sequence, narrow_plan
    from flowmaker.selection import select

    ctx = _ctx(2.0)
    kw = dict(strategy="exact", allow_reuse=True, rate=ctx.nominal_rate, fixed_workflow=False, measured=False,
              fallback=True, best_effort=True)
    flow = _select_in_sequence(ctx, overload_steps=True, **kw)  # type: ignore[arg-type]
    wide = len(CLUSTER.gpus) * SCALE_OUT_SHARE
    spans: dict[str, int] = {}
    for inst in flow.instances:
        spans[inst.deployed_by] = spans.get(inst.deployed_by, 0) + len(inst.gpu_ids)
    assert "math" in spans and max(spans.values()) <= wide, spans
    assert dict(flow.planned_rates)["math"] < ctx.nominal_rate(next(t for t in TASKS if t.name == "math"))
    assert "math" in flow.best_effort
    check_memory(flow.instances, CLUSTER.gpus)

    first = ctx.tasks[0]

    req = SelectionRequest(slo=replace(first.slo(), arrival_rate_rps=_ctx(4.0).nominal_rate(first)),
                           workflows=first.nominal_workflows(ctx.trace_kind, ctx.plan_tokens), models=ctx.models,
                           profiles=ctx.profiles, cluster=Cluster(CLUSTER.gpus, ()),
                           options=SelectionOptions(utilization_cap=ctx.utilization_cap,
                                                    capacity_model=ctx.capacity_model,
                                                    gpu_sharing=GpuSharing.INTERFERENCE))

    def sel(q: SelectionRequest):  # type: ignore[no-untyped-def]
        return select(q, "exact")

    full = sel(req)
    assert full.variant is not None and full.variant.new_gpus > 2
    got = narrow_plan(req, [], sel, 2)
    assert got is not None
    n_req, n_res = got
    assert n_res.variant is not None and n_res.variant.new_gpus <= 2
    step = req.slo.arrival_rate_rps / 2 ** PARTIAL_HALVINGS
    above = sel(replace(req, slo=replace(req.slo, arrival_rate_rps=(n_req.slo.arrival_rate_rps + step) * (1 + 1e-9))))
    assert above.variant is None or above.variant.new_gpus > 2  # within one step of the largest narrow rate
    lower = n_req.slo.arrival_rate_rps * 0.75
    got2 = narrow_plan(req, [lower], sel, 2)
    assert got2 is not None and got2[0].slo.arrival_rate_rps == lower  # a lower rate tried first wins
    assert narrow_plan(req, [], sel, 0) is None


def test_a_sharing_blind_plan_over_most_of_the_cluster_is_narrowed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlowMaker's policies: a task served best effort (no plan keeps every SLO, not even for part of its rate: here
    that step is made to find nothing) whose sharing-blind plan spans more than half the cluster (multihop_qa at twice
    the load: all 8 GPUs) gets the sharing-blind plan for the largest part of its rate within half instead."""
    import flowmaker.eval.policies as pol

    real = pol.largest_rate_plan

    def only_narrowing(req, choose):  # type: ignore[no-untyped-def]
        return real(req, choose) if choose.__name__ == "narrowed" else None

    monkeypatch.setattr(pol, "largest_rate_plan", only_narrowing)
    ctx = _ctx(2.0)
    kw = dict(strategy="exact", allow_reuse=True, rate=ctx.nominal_rate, fixed_workflow=False, measured=False,
              fallback=True, best_effort=True)
    flow = pol._select_in_sequence(ctx, overload_steps=True, **kw)  # type: ignore[arg-type]
    spans: dict[str, int] = {}
    for inst in flow.instances:
        spans[inst.deployed_by] = spans.get(inst.deployed_by, 0) + len(inst.gpu_ids)
    assert "multihop_qa" in flow.best_effort and 0 < spans.get("multihop_qa", 0) <= len(CLUSTER.gpus) * 0.5, spans
    qa = next(t for t in TASKS if t.name == "multihop_qa")
    assert dict(flow.planned_rates)["multihop_qa"] < ctx.nominal_rate(qa)
    check_memory(flow.instances, CLUSTER.gpus)


def test_colocation_kappa_reaches_the_simulator_the_monitor_and_the_planners(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_serving_bench(colocation_kappa=K)`: every simulation (the scored one and the load monitor's) runs with
    K, and the selector-based policies plan with interference K. A kappa below 1 (engines overlapping) voids the
    capacity bound, which assumes a GPU's speeds sum to at most 1; with 'ignore' a kappa is refused."""
    import flowmaker.bench.serving as sv
    import flowmaker.eval.policies as pol

    sims: list[float] = []
    plans: list[float] = []
    real_sim, real_plan = sv.simulate, sv.plan

    def sim(*a, **kw):  # type: ignore[no-untyped-def]
        sims.append(kw.get("colocation_kappa", 1.0))
        return real_sim(*a, **kw)

    def pol_sim(*a, **kw):  # type: ignore[no-untyped-def]
        sims.append(kw.get("colocation_kappa", 1.0))
        return real_sim(*a, **kw)

    def plan_(name, ctx):  # type: ignore[no-untyped-def]
        plans.append(ctx.interference)
        return real_plan(name, ctx)

    monkeypatch.setattr(sv, "simulate", sim)
    monkeypatch.setattr(pol, "simulate", pol_sim)
    monkeypatch.setattr(sv, "plan", plan_)
    rep = sv.run_serving_bench(tmp_path, traces_dir=tmp_path / "none", policies=["flowmaker", "langchain"],
                               loads=[0.5], traces=["conv"], segment_requests=60, plots=False, quiet=True,
                               colocation_kappa=2.5)
    assert sims and set(sims) == {2.5} and plans and set(plans) == {2.5}
    assert rep["setup"]["colocation_kappa"] == 2.5 and rep["setup"]["segments"][0]["goodput_upper_bound"]
    rep = sv.run_serving_bench(tmp_path, traces_dir=tmp_path / "none", policies=["langchain"], loads=[0.5],
                               traces=["conv"], segment_requests=60, plots=False, quiet=True, colocation_kappa=0.5)
    assert rep["setup"]["segments"][0]["goodput_upper_bound"] is None
    with pytest.raises(InvalidSpec) as e:
        sv.run_serving_bench(tmp_path, colocation="ignore", colocation_kappa=2.0, plots=False, quiet=True)
    assert e.value.field == "colocation_kappa"
