"""Fit a measured Profile from a sweep: least squares for the latency terms, saturation for throughput.

Pure numpy; the profiler service runs the sweep against a real engine and hands the
measurements here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from flowmaker.domain import Profile, ProfileSource
from flowmaker.errors import InvalidSpec
from flowmaker.profiling.analytic import capacity_from_decode

__all__ = ["SATURATION_RATIO", "LatencySample", "ThroughputSample", "fit_latency", "fit_profile",
           "fit_saturation"]

# A throughput point counts as saturated when the instance delivered less than this fraction
# of the output tokens/s offered to it (it could not keep up).
SATURATION_RATIO = 0.95


@dataclass(frozen=True, slots=True)
class LatencySample:
    """One request served alone: end-to-end latency of `input_tokens` in, `output_tokens` out."""

    input_tokens: int
    output_tokens: int
    latency_s: float


@dataclass(frozen=True, slots=True)
class ThroughputSample:
    """One load level: output tokens/s offered (arrival rate x output tokens) and achieved."""

    offered_output_tokens_per_s: float
    achieved_output_tokens_per_s: float


def _check_finite(v: float, field: str, *, positive: bool) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or (v <= 0 if positive else v < 0):
        raise InvalidSpec(f"must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}", field=field)


def fit_latency(samples: Iterable[LatencySample]) -> tuple[float, float, float]:
    """(fixed_s, prefill_s_per_token, decode_s_per_token) minimising squared relative error, all >= 0.

    latency = fixed + prefill*input + decode*output. Each sample is weighted by 1/latency: timing
    noise grows with the latency, and unweighted least squares would let a few multi-second
    samples swamp the tens-of-milliseconds fixed_s. Non-negativity by exhaustive active set:
    with three unknowns, try every subset of free coefficients (others pinned to 0) and keep the
    feasible least-squares fit of least residual - exact NNLS without scipy.
    """
    rows = list(samples)
    for i, s in enumerate(rows):
        for f in ("input_tokens", "output_tokens"):
            v = getattr(s, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidSpec(f"must be an integer >= 0, got {v!r}", field=f"samples[{i}].{f}")
        _check_finite(s.latency_s, f"samples[{i}].latency_s", positive=True)
    if len(rows) < 3:
        raise InvalidSpec(f"need at least 3 single-request latency samples to fit 3 terms, got {len(rows)}",
                          field="samples")
    x = np.array([[1.0, s.input_tokens, s.output_tokens] for s in rows])
    y = np.array([s.latency_s for s in rows])
    if len({s.input_tokens for s in rows}) < 2:
        raise InvalidSpec("input_tokens never varies: cannot separate fixed_s from prefill_s_per_token",
                          field="samples.input_tokens")
    if len({s.output_tokens for s in rows}) < 2:
        raise InvalidSpec("output_tokens never varies: cannot separate fixed_s from decode_s_per_token",
                          field="samples.output_tokens")
    if np.linalg.matrix_rank(x) < 3:
        raise InvalidSpec("input_tokens and output_tokens vary together: vary them independently to separate "
                          "prefill from decode", field="samples")
    # Scale columns so token counts (~1e3) and the intercept (1) condition the solve alike.
    scale = np.maximum(np.abs(x).max(axis=0), 1.0)
    w = 1.0 / y
    xs = x / scale * w[:, None]
    y = y * w  # = 1: minimise sum(((prediction - latency) / latency)^2)
    best: tuple[float, np.ndarray] | None = None
    for k in (3, 2, 1, 0):
        for cols in itertools.combinations(range(3), k):
            coef = np.zeros(3)
            if cols:
                sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
                if np.any(sol < 0):
                    continue
                coef[list(cols)] = sol
            resid = float(np.sum((xs @ coef - y) ** 2))
            if best is None or resid < best[0] - 1e-18:
                best = (resid, coef)
        if best is not None and k == 3:
            break  # the unconstrained fit is feasible: it is the optimum
    assert best is not None  # the empty subset is always feasible
    c = best[1] / scale
    return float(c[0]), float(c[1]), float(c[2])


def fit_saturation(samples: Iterable[ThroughputSample]) -> float:
    """Sustainable output tokens/s: the median achieved rate over the saturated load levels.

    A level is saturated when achieved < SATURATION_RATIO x offered. With no saturated level the
    instance kept up with everything offered, so the highest achieved rate is returned - a lower
    bound (the sweep should offer more load).
    """
    rows = list(samples)
    for i, s in enumerate(rows):
        _check_finite(s.offered_output_tokens_per_s, f"samples[{i}].offered_output_tokens_per_s", positive=True)
        _check_finite(s.achieved_output_tokens_per_s, f"samples[{i}].achieved_output_tokens_per_s", positive=False)
    if not rows:
        raise InvalidSpec("need at least one throughput sample (offered vs achieved output tokens/s)",
                          field="samples")
    sat = [s.achieved_output_tokens_per_s for s in rows
           if s.achieved_output_tokens_per_s < SATURATION_RATIO * s.offered_output_tokens_per_s]
    value = float(np.median(sat)) if sat else max(s.achieved_output_tokens_per_s for s in rows)
    if not value > 0:
        raise InvalidSpec("every achieved throughput is 0: the instance served nothing", field="samples")
    return value


def fit_profile(samples: Iterable[LatencySample | ThroughputSample], model_id: str, tp: int, pp: int,
                memory_gb_per_gpu: float, gpu_type: str) -> Profile:
    """A MEASURED Profile from a sweep: single-request latency samples and throughput samples, mixed."""
    rows = list(samples)
    lat = [s for s in rows if isinstance(s, LatencySample)]
    thr = [s for s in rows if isinstance(s, ThroughputSample)]
    other = [i for i, s in enumerate(rows) if not isinstance(s, LatencySample | ThroughputSample)]
    if other:
        raise InvalidSpec(f"sample is neither a LatencySample nor a ThroughputSample: {rows[other[0]]!r}",
                          field=f"samples[{other[0]}]")
    if not model_id:
        raise InvalidSpec("must not be empty", field="model_id")
    _check_finite(memory_gb_per_gpu, "memory_gb_per_gpu", positive=True)
    fixed, prefill, decode = fit_latency(lat)
    # The throughput sweep uses short prompts, so its plateau is the pure-decode throughput; the capacity at
    # the reference request follows by the analytic profiles' rule (it pays for the reference prefill).
    decode_tput = fit_saturation(thr)
    max_tput = capacity_from_decode(decode_tput, prefill, pp)
    return Profile(model_id=model_id, tp=tp, pp=pp, memory_gb_per_gpu=float(memory_gb_per_gpu), fixed_s=fixed,
                   prefill_s_per_token=prefill, decode_s_per_token=decode, max_output_tokens_per_s=max_tput,
                   gpu_type=gpu_type, source=ProfileSource.MEASURED, decode_tokens_per_s=decode_tput).validate()
