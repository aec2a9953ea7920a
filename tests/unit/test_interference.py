"""Fitting kappa (flowmaker.sharing's interference constant) from measured points, and its record in the store."""

from __future__ import annotations

import math
import random

import pytest
from typer.testing import CliRunner

from flowmaker.errors import InvalidSpec
from flowmaker.profiling.interference import InterferencePlan, InterferencePoint, fit_kappa
from flowmaker.sharing import DEFAULT_INTERFERENCE, MAX_INTERFERENCE, fit_interference, predicted_slowdown
from flowmaker.state import keys
from flowmaker.state.interference import SOURCE_DEFAULT, SOURCE_MEASURED, InterferenceRecord, InterferenceStore
from flowmaker.state.memory import MemoryStore


def _points(kappa: float, shares: tuple[float, ...], alone: float = 0.32, noise: float = 0.0,
            seed: int = 0) -> list[InterferencePoint]:
    rng = random.Random(seed)
    return [InterferencePoint(s, alone, alone * (1 + kappa * s) * (1 + noise * rng.gauss(0, 1))) for s in shares]


@pytest.mark.parametrize("kappa", [0.0, 0.35, 1.0, 1.7, 3.2])
def test_exact_points_give_kappa_back(kappa: float) -> None:
    assert fit_kappa(_points(kappa, (0.15, 0.3, 0.45))) == pytest.approx(kappa, abs=1e-12)


def test_two_levels_are_enough_and_one_point_is_fit_interference() -> None:
    assert fit_kappa(_points(0.8, (0.2, 0.5))) == pytest.approx(0.8)
    (p,) = _points(0.6, (0.25,))
    assert fit_kappa([p]) == pytest.approx(fit_interference(p.alone_s, p.shared_s, p.co_share))
    assert p.kappa == pytest.approx(0.6) and p.slowdown == pytest.approx(1.15)


def test_least_squares_through_the_origin() -> None:
    """sum(x*y) / sum(x^2) on the slowdowns, i.e. the levels' own estimates weighted by share^2."""
    pts = [InterferencePoint(0.1, 1.0, 1.2), InterferencePoint(0.3, 1.0, 1.24), InterferencePoint(0.5, 1.0, 1.55)]
    x, y = [0.1, 0.3, 0.5], [0.2, 0.24, 0.55]
    want = sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x)
    assert fit_kappa(pts) == pytest.approx(want)
    assert fit_kappa(pts) == pytest.approx(sum(p.co_share ** 2 * p.kappa for p in pts) / sum(a * a for a in x))


@pytest.mark.parametrize("rho", [0.05, 0.3])
def test_a_probe_with_a_compute_share_is_inverted_through_the_model(rho: float) -> None:
    """The sharing model's slowdown m = f (1 - rho) / (1 - rho f), f = 1 + kappa s: the fit recovers kappa."""
    pts = [InterferencePoint(s, 0.5, 0.5 * predicted_slowdown([s], rho=rho, kappa=0.7), rho=rho)
           for s in (0.15, 0.3, 0.45)]
    assert fit_kappa(pts) == pytest.approx(0.7)
    assert all(p.kappa == pytest.approx(0.7) for p in pts)
    assert fit_kappa([InterferencePoint(p.co_share, p.alone_s, p.shared_s) for p in pts]) > 0.71  # rho ignored: too high


def test_noisy_points_stay_close() -> None:
    for seed in range(20):
        assert fit_kappa(_points(1.0, (0.15, 0.3, 0.45), noise=0.02, seed=seed)) == pytest.approx(1.0, abs=0.2)


def test_clamped_to_the_valid_range() -> None:
    faster = [InterferencePoint(0.3, 1.0, 0.9), InterferencePoint(0.5, 1.0, 0.95)]  # noise: "faster" beside B
    assert fit_kappa(faster) == 0.0
    assert fit_kappa(_points(9.0, (0.2, 0.4))) == MAX_INTERFERENCE


@pytest.mark.parametrize(("points", "field"), [
    ([], "points"),
    ([InterferencePoint(0.0, 1.0, 1.0)], "points[0].co_share"),
    ([InterferencePoint(0.2, 1.0, 1.2), InterferencePoint(-0.1, 1.0, 1.2)], "points[1].co_share"),
    ([InterferencePoint(1.5, 1.0, 2.0)], "points[0].co_share"),
    ([InterferencePoint(math.nan, 1.0, 1.2)], "points[0].co_share"),
    ([InterferencePoint(0.2, 0.0, 1.2)], "points[0].alone_s"),
    ([InterferencePoint(0.2, -1.0, 1.2)], "points[0].alone_s"),
    ([InterferencePoint(0.2, 1.0, math.inf)], "points[0].shared_s"),
    ([InterferencePoint(0.2, 1.0, 0.0)], "points[0].shared_s"),
    ([InterferencePoint(0.2, 1.0, 1.2, rho=1.0)], "points[0].rho"),
    ([InterferencePoint(0.2, 1.0, 1.2, rho=-0.1)], "points[0].rho"),
])
def test_bad_points_name_the_field(points: list[InterferencePoint], field: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        fit_kappa(points)
    assert e.value.field == field


@pytest.mark.parametrize(("kw", "field"), [
    ({"b_shares": ()}, "plan.b_shares"),
    ({"b_shares": (0.2, 0.95)}, "plan.b_shares[1]"),
    ({"b_shares": (0.0,)}, "plan.b_shares[0]"),
    ({"a_share": 0.0}, "plan.a_share"),
    ({"window_s": 0.0}, "plan.window_s"),
    ({"alone_window_s": math.inf}, "plan.alone_window_s"),
    ({"a_output_tokens": 0}, "plan.a_output_tokens"),
    ({"b_input_tokens": -1}, "plan.b_input_tokens"),
    ({"min_window_b_calls": 0.0}, "plan.min_window_b_calls"),
    ({"min_alone_probes": 0}, "plan.min_alone_probes"),
])
def test_bad_plan_names_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        InterferencePlan(**kw).validate()  # type: ignore[arg-type]
    assert e.value.field == field


# ---- the record and the store ----


async def test_store_defaults_then_returns_what_was_put() -> None:
    store = InterferenceStore(MemoryStore())
    d = await store.get("A6000")
    assert (d.gpu_type, d.kappa, d.source, d.points) == ("A6000", DEFAULT_INTERFERENCE, SOURCE_DEFAULT, ())
    rec = InterferenceRecord.measured("A6000", 0.83, tuple(p.to_json() for p in _points(0.83, (0.2, 0.4))),
                                      {"time_scale": 1.0}, measured_at=1.7e9)
    await store.put(rec)
    got = await store.get("A6000")
    assert got == rec and got.source == SOURCE_MEASURED and await store.kappa("A6000") == 0.83
    assert (await store.get("H100")).source == SOURCE_DEFAULT  # per GPU type
    assert set(await store.all()) == {"A6000"}
    assert await store.delete("A6000") and (await store.get("A6000")).source == SOURCE_DEFAULT


async def test_key_layout_and_json() -> None:
    mem = MemoryStore()
    await InterferenceStore(mem).put(InterferenceRecord.measured("RTX A6000/PCIe", 1.0, measured_at=5.0))
    kv = await mem.get(keys.interference("RTX A6000/PCIe"))
    assert kv is not None and kv.key == "/flowmaker/v1/interference/RTX%20A6000%2FPCIe"
    assert keys.parse_interference(kv.key) == "RTX A6000/PCIe"
    assert kv.value == {"gpu_type": "RTX A6000/PCIe", "kappa": 1.0, "source": "MEASURED", "measured_at": 5.0,
                        "points": [], "details": {}}


async def test_unreadable_record_reads_as_default() -> None:
    mem = MemoryStore()
    await mem.put(keys.interference("A6000"), {"gpu_type": "A6000", "kappa": 99.0, "source": "MEASURED"})
    await mem.put(keys.interference("L4"), "not a record")
    store = InterferenceStore(mem)
    assert (await store.get("A6000")).source == SOURCE_DEFAULT
    assert (await store.get("L4")).kappa == DEFAULT_INTERFERENCE


@pytest.mark.parametrize(("rec", "field"), [
    (InterferenceRecord("A6000", kappa=-0.1, source=SOURCE_MEASURED), "kappa"),
    (InterferenceRecord("A6000", kappa=MAX_INTERFERENCE + 1), "kappa"),
    (InterferenceRecord("A6000", source="GUESSED"), "source"),
    (InterferenceRecord("", kappa=1.0), "gpu_type"),
    (InterferenceRecord("A6000", measured_at=-1.0), "measured_at"),
])
async def test_put_refuses_a_bad_record_naming_the_field(rec: InterferenceRecord, field: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        await InterferenceStore(MemoryStore()).put(rec)
    assert e.value.field == field


# ---- the command's arguments (no engine is started) ----


@pytest.mark.parametrize(("args", "field"), [
    (["--gpu-type", "A6000"], "engine_a"),
    (["--gpu-type", "A6000", "--engine-a", "http://127.0.0.1:1"], "engine_b"),
    (["--gpu-type", "A6000", "--emulated", "--engine-a", "http://127.0.0.1:1"], "engine_a"),
    (["--gpu-type", "A6000", "--emulated", "--shares", "0.2,x"], "shares"),
    (["--gpu-type", "A6000", "--emulated", "--shares", "0.2,0.99", "--no-store"], "plan.b_shares[1]"),
])
def test_command_refuses_bad_arguments_naming_the_field(args: list[str], field: str) -> None:
    from flowmaker.cli.main import app

    res = CliRunner().invoke(app, ["profiles", "measure-interference", *args])
    assert res.exit_code == 1, res.output
    assert res.output.startswith("error: INVALID_ARGUMENT") and f" {field}: " in res.output, res.output
