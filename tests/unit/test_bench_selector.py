"""Smoke test of `flowmaker bench selector` on a tiny configuration: it runs, writes its files, exact never loses."""

from __future__ import annotations

import json
from pathlib import Path

from flowmaker.bench.selector import BenchConfig, run_selector_bench, synth_models


def test_tiny_selector_bench_writes_json_and_plots(tmp_path: Path) -> None:
    cfg = BenchConfig(repeats=1, exhaustive_budget_s=1.0, bayesopt_budget_s=1.0, bayesopt_trials=11,
                      bayesopt_states=(), depth_max=2, depth_budget_s=2.0, catalog_sizes=(11,))
    res = run_selector_bench(tmp_path, cfg)
    def no_nan(c: str) -> None:
        raise AssertionError(f"non-strict JSON constant {c}")

    saved = json.loads((tmp_path / "selector.json").read_text(), parse_constant=no_nan)
    assert saved["paper"]["summary"]["exact"]["runs"] == 21  # 7 tasks x 3 cluster states
    exact_rows = [r for r in res["paper"]["rows"] if r["strategy"] == "exact"]
    assert all(r["gap"] in (None, 0.0) or abs(r["gap"]) < 1e-9 for r in exact_rows)
    assert res["paper"]["summary"]["exact"]["missed_optimum"] == 0
    for p in res["plots"]:
        assert Path(p).stat().st_size > 1000
    assert [r["stages"] for r in res["depth"]] == [1, 2]


def test_synthetic_catalog_is_deterministic_and_leaderboard_like() -> None:
    a, b = synth_models(40, seed=3), synth_models(40, seed=3)
    assert a == b
    assert len({m.id for m in a}) == 40
    assert all(0.05 <= m.accuracy <= 0.5 for m in a)
