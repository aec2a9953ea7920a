"""`flowmaker bench adapt`: invariants on a tiny configuration (synthetic tokens, a step change in the rate).

Not the winner: only that nothing is lost, GPU memory is never over-committed at any time (make-before-break
included), the adaptive policy re-selects on a step change and deploy-once never does, and that with an
infinite band the adaptive run is exactly the deploy-once run.
"""

from __future__ import annotations

import json
import math
from functools import cache
from typing import Any

import pytest
from typer.testing import CliRunner

from flowmaker.bench.adapt import AdaptConfig, run_cell
from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.errors import InvalidSpec
from flowmaker.eval.slo import with_rule_slos
from flowmaker.eval.tasks import EVAL_TASKS
from flowmaker.eval.traces import Trace, TraceRequest, synthesize
from flowmaker.profiling.analytic import profiles_for

MODELS = default_models()
GPU = get_gpu_type("A6000")
PROFILES = profiles_for(MODELS, GPU, max_gpus=8)
CLUSTER = make_cluster("A6000", nodes=1, gpus_per_node=8)
BY_ID = {m.id: m for m in MODELS}
TASKS = tuple(with_rule_slos([t for t in EVAL_TASKS if t.name in ("chat", "summarize")], "conv", PROFILES, BY_ID,
                             GPU))


def step_trace(low: float = 0.5, high: float = 12.0, step_s: float = 200.0, end_s: float = 420.0) -> Trace:
    """Evenly spaced arrivals at `low` req/s, then `high` from `step_s` on; tokens of the synthetic conv trace."""
    syn = synthesize("conv", 4000, seed=0)
    times, t = [], 0.0
    while t < end_s:
        times.append(t)
        t += 1.0 / (low if t < step_s else high)
    return Trace("conv", tuple(TraceRequest(x, q.context_tokens, q.generated_tokens)
                               for x, q in zip(times, syn.requests, strict=False)), "step")


@cache
def cell(band: float = 2.0, load: float = 1.0) -> tuple[Any, dict[str, dict[str, Any]]]:
    cfg = AdaptConfig(segment_s=419.0, band=band)
    wl, rows = run_cell(TASKS, "conv", step_trace(), load, MODELS, PROFILES, CLUSTER.gpus, GPU, cfg)
    return wl, {r["policy"]: r for r in rows}


@pytest.mark.parametrize("load", [1.0, 3.0])
def test_no_request_lost_and_memory_never_overcommitted(load: float) -> None:
    wl, rows = cell(2.0, load)
    for pol, r in rows.items():
        assert r["requests"] == len(wl.arrivals) > 500, pol
        assert r["completed"] + r["rejected"] == r["requests"] and r["lost"] == 0, pol
        assert r["rejected"] == 0, pol
        assert r["gpu_overcommitted"] == [], pol
        # independently: per GPU, instances from deploy until really released (after their drain) never exceed it
        total = {g.id: g.memory_total_gb for g in CLUSTER.gpus}
        for gid in total:
            ev = []
            for i in r["instance_list"]:
                if gid in i["gpus"]:
                    per_gpu = i["gb"] / len(i["gpus"])
                    ev += [(i["start_s"], 1, per_gpu), (i["start_s"] + i["residence_s"], 0, -per_gpu)]
            cur = 0.0
            for _, _, d in sorted(ev):
                cur += d
                assert cur <= total[gid] + 1e-6, (pol, gid)
        # the goodput per minute adds up to the run's
        s = r["series"]
        assert sum(s["scored"]) == r["requests"] and sum(s["good"]) == r["good"]
        assert math.isclose(sum(s["arrivals_rps"]) * s["bin_s"], len(wl.all_arrivals))


def test_adaptive_reselects_on_a_step_and_deploy_once_never_does() -> None:
    _, rows = cell()
    once, ad = rows["deploy-once"], rows["adaptive"]
    assert not [e for e in once["events"] if e["kind"] == "reselect"]
    assert once["reselections"] == 0
    switches = [e for e in ad["events"] if e["kind"] == "reselect" and e["outcome"] == "SWITCH"]
    assert ad["reselections"] == len(switches) >= 1
    step_replay_s = 200.0 * cell()[0].scale
    for e in switches:  # after the step, for a rate above band x planned (the drift rule), then ready later
        assert e["t"] > step_replay_s and e["rate"] > 2.0 * e["planned_before"]
        assert e["ready_s"] > e["t"]
    # make-before-break: every retired instance was retired at a switch's ready time and is charged until drained
    ready = {e["ready_s"] for e in switches}
    retired = [i for i in ad["instance_list"] if math.isfinite(i["retired_s"])]
    for i in retired:
        assert i["retired_s"] in ready
        assert i["start_s"] + i["residence_s"] >= i["retired_s"]
    # new instances are charged from the re-selection
    for e in switches:
        new = [i for i in ad["instance_list"] if i["start_s"] == e["t"] and i["deployed_by"] == e["task"]]
        assert len(new) == len(e["new_instances"])


def test_infinite_band_is_deploy_once() -> None:
    _, rows = cell(band=1e9)
    once, ad = rows["deploy-once"], rows["adaptive"]
    # No switch and nothing kept: only the latency rule may still ask (and find no room at band x the rate).
    assert ad["reselections"] == ad["reselections_kept"] == 0
    for k in ("goodput", "good", "cost_usd", "gb_seconds", "instances_ever", "mean_latency_s"):
        assert ad[k] == once[k], k


def test_config_is_validated() -> None:
    with pytest.raises(InvalidSpec):
        AdaptConfig(band=1.0).validate()
    with pytest.raises(InvalidSpec):
        AdaptConfig(colocation="worst-case").validate()
    with pytest.raises(InvalidSpec):
        AdaptConfig(period_trace_s=0).validate()


def test_cli_writes_json_and_plots_on_the_synthetic_trace(tmp_path: Any) -> None:
    from flowmaker.cli.main import app

    res = CliRunner().invoke(app, ["bench", "adapt", "--out", str(tmp_path), "--traces", str(tmp_path / "none"),
                                   "--loads", "0.25", "--trace-kinds", "code", "--segment-s", "300"])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "adapt.json").read_text())
    assert "synthetic" in rep["setup"]["trace_sources"]["code"]
    assert rep["setup"]["config"]["band"] == 2.0 and rep["setup"]["segments"][0]["offset_s"] >= 0
    assert {r["policy"] for r in rep["rows"]} == {"deploy-once", "adaptive"}
    assert (tmp_path / "adapt_code_25.png").stat().st_size > 10_000


def test_on_the_declared_experiment_the_clock_follows_its_monitor_window() -> None:
    """`bench adapt --replay experiment`: the experiment's request segment, and the controller's period and
    window equal to the experiment's monitor window (hold-down and ready in the defaults' proportions)."""
    from dataclasses import replace

    from flowmaker.bench.adapt import experiment_clock
    from flowmaker.eval.experiment import load_experiment

    exp = replace(load_experiment(), segment_requests=120)
    tasks = exp.tasks_for("conv", PROFILES, BY_ID, GPU)[:2]
    wl, rows = run_cell(tasks, "conv", synthesize("conv", 2000, seed=0), 0.5, MODELS, PROFILES, CLUSTER.gpus, GPU,
                        AdaptConfig(), experiment=exp)
    assert wl.segment_requests == 120 and len(wl.all_arrivals) == 120
    c = experiment_clock(AdaptConfig(), wl, exp)
    w = exp.monitor_window_fraction * wl.segment_s
    assert (c.period_trace_s, c.window_trace_s) == (w, w)
    assert c.hold_down_trace_s == pytest.approx(w / 2) and c.ready_trace_s == pytest.approx(w / 4)
    by = {r["policy"]: r for r in rows}
    assert by["adaptive"]["lost"] == by["deploy-once"]["lost"] == 0
    assert by["deploy-once"]["reselections"] == 0
