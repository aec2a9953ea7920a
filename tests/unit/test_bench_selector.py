"""Smoke test of `flowmaker bench selector` on a tiny configuration: it runs, writes its files, exact never loses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowmaker.bench.selector import (
    ADVERSARIAL_KINDS,
    BenchConfig,
    adversarial_request,
    run_selector_bench,
    synth_models,
)


def test_tiny_selector_bench_writes_json_and_plots(tmp_path: Path) -> None:
    cfg = BenchConfig(repeats=1, exhaustive_budget_s=1.0, bayesopt_budget_s=1.0, bayesopt_trials=11,
                      bayesopt_states=(), depth_max=2, depth_budget_s=2.0, catalog_sizes=(11,),
                      depth_exact_max=3, adversarial_per_kind=1, adversarial_budget_s=0.5)
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
    assert [r["stages"] for r in res["depth"]] == [1, 2, 3]
    assert set(res["depth"][2]) == {"stages", "search_space", "exact"}  # deeper chains: exact alone
    adv = saved["adversarial"]
    assert [r["kind"] for r in adv["rows"]] == list(ADVERSARIAL_KINDS)
    assert adv["summary"]["instances"] == len(ADVERSARIAL_KINDS)
    for r in adv["rows"]:
        assert r["answer"] in ("feasible", "NO_GPU_MEMORY", "NO_CAPACITY", "DEADLINE_EXCEEDED")
        if r["answer"] == "feasible":
            assert r["lower_bound"] <= r["cost"] * (1 + 1e-9)
            if r["optimal"]:
                assert r["gap"] == 0.0 and r["lower_bound"] == r["cost"]
            else:
                assert r["gap"] is not None and 0.0 <= float(r["gap"])


def test_adversarial_instances_are_seeded_and_hard_in_the_stated_ways() -> None:
    from flowmaker.selection import select

    for kind in ADVERSARIAL_KINDS:
        a, b = adversarial_request(kind, 3), adversarial_request(kind, 3)
        assert a == b  # seeded
        assert adversarial_request(kind, 4) != a
        stages = a.workflows[0].stages
        assert 8 <= len(stages) <= 15 and (kind != "chain15" or len(stages) == 15)
        nodes = {g.node for g in a.cluster.gpus}
        assert len(nodes) == 4 and len(a.cluster.gpus) == 32
        assert {g.memory_total_gb for g in a.cluster.gpus} == {48.0, 80.0}  # mixed GPUs
        assert len(a.cluster.instances) >= 30
    fan = adversarial_request("fan", 0).workflows[0]
    assert len(fan.stages[-1].depends_on) == len(fan.stages) - 2  # head -> parallel -> join
    clones = adversarial_request("clones", 0)
    assert sum("clone" in m.id for m in clones.models) == 6
    # Unplaceable: every node has a GPU with 2 GB free and only 8-GPU configurations meet the SLO.
    res = select(adversarial_request("unplaceable", 0), "exact")
    assert res.variant is None and res.optimal


def test_synthetic_catalog_is_deterministic_and_leaderboard_like() -> None:
    a, b = synth_models(40, seed=3), synth_models(40, seed=3)
    assert a == b
    assert len({m.id for m in a}) == 40
    assert all(0.05 <= m.accuracy <= 0.5 for m in a)


def test_hard_section_reports_shares_gaps_and_a_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowmaker.bench import selector as bench_selector
    from flowmaker.bench.selector_hard_run import WARM_BUDGET_S

    budgets: list[float] = []  # every selection's budget, in call order
    real = bench_selector._select

    def spy(req, strategy):  # type: ignore[no-untyped-def]
        budgets.append(req.options.time_budget_s)
        return real(req, strategy)

    monkeypatch.setattr(bench_selector, "_select", spy)
    cfg = BenchConfig(sections=("hard",), hard_count=1, hard_budget_s=1.0, seed=24)
    res = run_selector_bench(tmp_path, cfg)
    # one untimed selection loads the strategies' modules before the first timed instance
    assert budgets[0] == WARM_BUDGET_S and budgets.count(1.0) == len(res["hard"]["rows"]) == len(budgets) - 1
    saved = json.loads((tmp_path / "selector.json").read_text())
    from flowmaker.bench.selector_hard import HARD_FAMILIES
    from flowmaker.bench.selector_hard_run import answers_digest

    hard = saved["hard"]
    assert [r["family"] for r in hard["rows"]] == list(HARD_FAMILIES)
    assert set(hard["summary"]) == {*HARD_FAMILIES, "all"}
    sm = hard["summary"]["all"]
    assert sm["instances"] == len(HARD_FAMILIES)
    assert sm["proven_within_1s"] <= sm["proven_within_2s"] <= sm["proven"] <= sm["instances"]
    assert sm["proven"] + sm["unproven"] == sm["instances"]
    for r in hard["rows"]:
        assert r["recipe"]["family"] == r["family"] and r["seed"] == 24
        if r["answer"] == "feasible":
            assert r["lower_bound"] <= r["cost"] * (1 + 1e-9)
            assert r["gap"] == 0.0 if r["optimal"] else 0.0 <= r["gap"] <= 1.0
    assert hard["answers_digest"] == answers_digest(res["hard"]["rows"])


def test_hard_families_can_be_chosen_and_unknown_names_are_refused(tmp_path: Path) -> None:
    from flowmaker.errors import InvalidSpec

    res = run_selector_bench(tmp_path, BenchConfig(sections=("hard",), hard_count=1, hard_budget_s=1.0, seed=24,
                                                   hard_families=("memory_ties",)))
    assert [r["family"] for r in res["hard"]["rows"]] == ["memory_ties"]
    assert set(res["hard"]["summary"]) == {"memory_ties", "all"}
    with pytest.raises(InvalidSpec) as e:
        run_selector_bench(tmp_path, BenchConfig(sections=("hard",), hard_families=("chain_clone",)))
    assert e.value.field == "family" and "chain_clones" in e.value.message  # the known names, to correct it
    with pytest.raises(InvalidSpec) as e:
        run_selector_bench(tmp_path, BenchConfig(sections=("hardd",)))
    assert e.value.field == "section"
