"""Fitting measured profiles: synthetic sweeps from a known profile are recovered."""

from __future__ import annotations

import numpy as np
import pytest

from flowmaker.domain import Profile, ProfileSource
from flowmaker.errors import InvalidSpec
from flowmaker.profiling.analytic import capacity_from_decode
from flowmaker.profiling.fit import LatencySample, ThroughputSample, fit_latency, fit_profile, fit_saturation

# The throughput sweep (short prompts) plateaus at the pure-decode rate; the capacity at the reference request
# follows from it and the prefill cost (1150 tok/s decode, 4 x 0.11 ms of prefill per output token: ~771 tok/s).
TRUE = Profile(model_id="Llama-3.1-8B-Instruct", tp=2, pp=1, memory_gb_per_gpu=12.2, fixed_s=0.027,
               prefill_s_per_token=1.1e-4, decode_s_per_token=0.0175,
               max_output_tokens_per_s=capacity_from_decode(1150.0, 1.1e-4), gpu_type="A6000",
               decode_tokens_per_s=1150.0)


def _sweep(p: Profile, noise: float, seed: int) -> list[LatencySample | ThroughputSample]:
    rng = np.random.default_rng(seed)
    out: list[LatencySample | ThroughputSample] = []
    for i in (16, 128, 512, 1024, 2048, 4096):
        for o in (1, 16, 64, 256, 512):
            lat = p.call_latency_s(i, o) * (1 + noise * rng.standard_normal())
            out.append(LatencySample(i, o, lat))
    for frac in (0.1, 0.25, 0.5, 0.75, 0.9, 1.2, 1.5, 2.0, 3.0):
        offered = frac * p.pure_decode_tokens_per_s
        achieved = min(offered, p.pure_decode_tokens_per_s) * (1 + noise * rng.standard_normal())
        out.append(ThroughputSample(offered, achieved))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_sweep_recovers_profile_within_5_percent(seed: int) -> None:
    got = fit_profile(_sweep(TRUE, noise=0.02, seed=seed), TRUE.model_id, 2, 1, 12.2, "A6000")
    assert got.source is ProfileSource.MEASURED
    assert (got.model_id, got.tp, got.pp, got.gpu_type, got.memory_gb_per_gpu) == (TRUE.model_id, 2, 1, "A6000", 12.2)
    for f in ("fixed_s", "prefill_s_per_token", "decode_s_per_token", "max_output_tokens_per_s",
              "decode_tokens_per_s"):
        assert getattr(got, f) == pytest.approx(getattr(TRUE, f), rel=0.05), f


def test_exact_samples_recover_exactly() -> None:
    got = fit_profile(_sweep(TRUE, noise=0.0, seed=0), TRUE.model_id, 2, 1, 12.2, "A6000")
    assert got.fixed_s == pytest.approx(TRUE.fixed_s, rel=1e-9)
    assert got.decode_s_per_token == pytest.approx(TRUE.decode_s_per_token, rel=1e-9)
    assert got.max_output_tokens_per_s == pytest.approx(TRUE.max_output_tokens_per_s, rel=1e-9)
    assert got.decode_tokens_per_s == pytest.approx(TRUE.decode_tokens_per_s, rel=1e-9)


def test_coefficients_never_negative() -> None:
    # Latency that does not depend on the prompt, with noise pulling the prefill slope below 0:
    # the constrained fit pins prefill at 0 and still fits the rest.
    samples = [LatencySample(i, o, 0.05 + 0.01 * o - 1e-7 * i) for i in (10, 1000, 4000) for o in (1, 50, 100)]
    fixed, prefill, decode = fit_latency(samples)
    assert prefill == 0.0 and fixed > 0
    assert decode == pytest.approx(0.01, rel=0.01)


def test_unsaturated_sweep_returns_the_highest_achieved_rate() -> None:
    samples = [ThroughputSample(100, 100), ThroughputSample(200, 199), ThroughputSample(400, 398)]
    assert fit_saturation(samples) == 398


@pytest.mark.parametrize(("samples", "field"), [
    ([LatencySample(10, 10, 0.1), LatencySample(20, 20, 0.2)], "samples"),  # too few
    ([LatencySample(10, o, 0.1 + o) for o in (1, 2, 3)], "samples.input_tokens"),  # input never varies
    ([LatencySample(i, 5, 0.1 + i) for i in (1, 2, 3)], "samples.output_tokens"),
    ([LatencySample(n, n, 0.1 + n) for n in (1, 2, 3)], "samples"),  # collinear
    ([LatencySample(1, 1, -1.0), LatencySample(2, 1, 1), LatencySample(1, 2, 1)], "samples[0].latency_s"),
])
def test_bad_latency_samples_name_the_field(samples: list[LatencySample], field: str) -> None:
    with pytest.raises(InvalidSpec) as ei:
        fit_latency(samples)
    assert ei.value.field == field


def test_fit_profile_needs_throughput_samples() -> None:
    lat = [s for s in _sweep(TRUE, 0.0, 0) if isinstance(s, LatencySample)]
    with pytest.raises(InvalidSpec) as ei:
        fit_profile(lat, "m", 1, 1, 10.0, "A6000")
    assert ei.value.field == "samples" and "throughput" in str(ei.value)
    with pytest.raises(InvalidSpec) as ei2:
        fit_profile(_sweep(TRUE, 0.0, 0), "m", 1, 1, 0.0, "A6000")
    assert ei2.value.field == "memory_gb_per_gpu"
