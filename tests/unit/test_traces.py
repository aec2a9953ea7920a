"""Trace loader errors, deterministic synthesis matching the real statistics, and load-level workloads."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.tasks import EVAL_TASKS
from flowmaker.eval.trace_stats import TRACE_STATS
from flowmaker.eval.traces import (
    LOAD_LEVELS,
    Arrival,
    build_workload,
    get_trace,
    load_trace,
    scaled_window,
    synthesize,
    trace_stats,
    write_trace,
)

REAL = Path(__file__).resolve().parents[3] / "shared" / "reference" / "traces"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "t.csv"
    p.write_text(text)
    return p


def test_loads_a_small_file_relative_times_sorted(tmp_path: Path) -> None:
    p = _write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                         "2023-11-16 18:17:04.5000000,10,2\n2023-11-16 18:17:03.9799600,4808,10\n\n")
    tr = load_trace(p)
    assert len(tr) == 2
    assert tr.requests[0].context_tokens == 4808 and tr.requests[0].arrival_s == 0.0
    assert tr.requests[1].arrival_s == pytest.approx(0.52004, abs=1e-6)


@pytest.mark.parametrize("text, match", [
    ("", "empty file"),
    ("TIMESTAMP,Context,GeneratedTokens\n", "lacks column"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", ":2: TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04,1,x\n", ":2: GeneratedTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04,1,2\n2023-11-16 18:17:05,-1,2\n",
     ":3: ContextTokens must be >= 0"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04,1\n", "expected 3 columns"),
])
def test_malformed_files_name_line_and_column(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(InvalidSpec, match=match):
        load_trace(_write(tmp_path, text))


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="traces download"):
        load_trace(tmp_path / "nope.csv")


@pytest.mark.parametrize("kind", ["code", "conv"])
def test_synthetic_is_deterministic_and_matches_the_trace(kind: str) -> None:
    a, b = synthesize(kind, 4000, seed=3), synthesize(kind, 4000, seed=3)
    assert a == b
    assert synthesize(kind, 4000, seed=4) != a
    st, ref = trace_stats(a), TRACE_STATS[kind]
    assert st["mean_rate_rps"] == pytest.approx(ref.mean_rate_rps, rel=0.35)
    ctx, gen = st["context"], st["generated"]
    assert isinstance(ctx, dict) and isinstance(gen, dict)
    assert ctx["median"] == pytest.approx(ref.context.median, rel=0.1)
    assert gen["median"] == pytest.approx(ref.generated.median, rel=0.1)
    assert ref.context.minimum <= ctx["minimum"] and ctx["maximum"] <= ref.context.maximum
    cv = st["interarrival_cv"]
    assert isinstance(cv, float)
    # bursty code trace vs near-Poisson conversation trace
    assert (cv > 3.0) if kind == "code" else (0.8 < cv < 1.4)


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    tr = synthesize("conv", 50, seed=1)
    back = load_trace(write_trace(tr, tmp_path / "AzureLLMInferenceTrace_conv.csv"))
    assert back.kind == "conv"
    assert [(r.context_tokens, r.generated_tokens) for r in back.requests] == \
        [(r.context_tokens, r.generated_tokens) for r in tr.requests]
    assert back.requests[-1].arrival_s == pytest.approx(tr.requests[-1].arrival_s, abs=1e-5)


def test_scaled_window_hits_the_target_rate_and_wraps() -> None:
    tr = synthesize("code", 100, seed=0)
    w = scaled_window(tr, 250, 2.0, offset=90)  # wraps around the 100-request trace
    assert len(w) == 250
    assert all(x.arrival_s <= y.arrival_s for x, y in itertools.pairwise(w))
    assert w[-1].arrival_s < 250 / 2.0
    assert w[0].context_tokens == tr.requests[90].context_tokens


def test_workload_sizes_per_load_level() -> None:
    tr = get_trace("conv", None)
    sizes = []
    for load in LOAD_LEVELS:
        wl = build_workload([(t.name, t.nominal_rate_rps * load) for t in EVAL_TASKS], tr, seed=0)
        assert {a.task for a in wl} == {t.name for t in EVAL_TASKS}
        assert len({a.req_id for a in wl}) == len(wl)
        sizes.append(len(wl))
    assert sizes == sorted(sizes) and 150 <= sizes[0] and sizes[-1] <= 600
    assert build_workload([("chat", 0.5)], tr, seed=1) == build_workload([("chat", 0.5)], tr, seed=1)


@pytest.mark.skipif(not (REAL / "AzureLLMInferenceTrace_code.csv").is_file(), reason="reference traces absent")
def test_real_code_trace_stats_match_the_summary() -> None:
    st = trace_stats(load_trace(REAL / "AzureLLMInferenceTrace_code.csv"))
    assert st["n_requests"] == 8819
    assert st["interarrival_cv"] == pytest.approx(13.15, abs=0.01)


def test_cli_synth_and_stats(tmp_path: Path) -> None:
    from flowmaker.cli.main import app
    runner = CliRunner()
    out = tmp_path / "c.csv"
    r = runner.invoke(app, ["traces", "synth", "--kind", "code", "--out", str(out), "--requests", "30"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["traces", "stats", str(out), "--json"])
    assert r.exit_code == 0 and '"n_requests": 30' in r.output
    r = runner.invoke(app, ["traces", "stats", str(tmp_path / "missing.csv")])
    assert r.exit_code == 1


def test_segment_is_contiguous_one_scale_staggered_and_deterministic() -> None:
    from flowmaker.eval.traces import MONITOR_WINDOW_TRACE_S, build_segment_workload
    tr = get_trace("conv", None)
    rates = [(t.name, t.nominal_rate_rps * 0.5) for t in EVAL_TASKS]
    w = build_segment_workload(rates, tr, 0.5, seed=0, segment_s=600.0)
    # one contiguous stretch of the trace, one time-scale factor: replayed gaps = scale x trace gaps
    seg = [r for r in tr.requests if w.offset_s <= r.arrival_s - tr.requests[0].arrival_s < w.offset_s + 600.0]
    assert len(seg) == w.segment_requests == len(w.all_arrivals)
    times = sorted(a.time_s for a in w.all_arrivals)
    src = [(r.arrival_s - seg[0].arrival_s) * w.scale for r in seg]
    assert times == pytest.approx([x + times[0] for x in src], abs=1e-6)
    assert w.scale == pytest.approx(len(seg) / 600.0 / sum(r for _, r in rates))  # mean rate = the target
    assert w.duration_s == pytest.approx(600.0 * w.scale)
    # staggered deploys, the first after one monitor window; nothing scored before a task's deploy
    deps = [d for _, d in w.deploy_s]
    assert deps == sorted(deps) and len(set(deps)) == len(deps)
    assert deps[0] == pytest.approx(MONITOR_WINDOW_TRACE_S * w.scale)
    assert all(a.time_s >= w.deploy_time(a.task) for a in w.arrivals)
    assert len(w.arrivals) < len(w.all_arrivals)
    # every task gets its share; the peak minute is at least the mean
    for t in EVAL_TASKS:
        assert w.peak_rate(t.name) >= w.mean_rate(t.name) > 0
    assert build_segment_workload(rates, tr, 0.5, seed=0) == w
    assert build_segment_workload(rates, tr, 0.5, seed=1).offset_s != w.offset_s
    with pytest.raises(InvalidSpec, match="segment"):
        build_segment_workload(rates, synthesize("conv", 50, seed=0), 0.5, segment_s=600.0)


def test_segment_rate_window_counts_by_hand() -> None:
    from flowmaker.eval.traces import SegmentWorkload
    arr = tuple(Arrival(float(t), "a", f"a{t}", 1, 1) for t in (0, 1, 2, 3, 10, 11))
    w = SegmentWorkload("conv", "x", 1.0, 0.0, 12.0, 1.0, 12.0, (("a", 0.0),), 4.0, arr, arr, 6, 0.5)
    assert w.rate_in("a", 0.0, 4.0) == pytest.approx(1.0)
    assert w.rate_in("a", 4.0, 8.0) == 0.0
    assert w.mean_rate("a") == pytest.approx(0.5)
    assert w.peak_rate("a", step_s=1.0) == pytest.approx(1.0)
