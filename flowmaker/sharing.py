"""GPU sharing: the one model of how instances placed on the same GPU slow each other.

Used by the selector (docs/selection-spec.md, "Extension: GPU sharing"), the simulator's planning
checks, the emulated node (engines on one emulated GPU share it) and the profiler (which calibrates
the constant below per GPU type).

The model, a processor-sharing view of a GPU's compute and memory bandwidth (as MuxServe's compute
quota and AlpaServe's/Prism's co-location models treat it):

* An instance's *busy share* is the fraction of the time it has work in flight at its planned load:
  `load / capacity`, both in the same units (output tokens/s, or busy time at a workflow's mean
  request). A share is charged in full to EACH of the instance's GPUs (its shards run in lockstep).
* A GPU's *total* is the sum of the shares of the instances on it; it may not exceed the GPU's compute
  budget (the utilization cap u): the GPU is then busy at most a fraction u of the time.
* An instance whose GPUs are shared runs slower: while it serves a call, each co-resident j is busy
  with probability about s_j, and two busy instances split the GPU. Its latency is multiplied by
  `1 + kappa * max over its GPUs g of (total_g - own share)`; kappa = 1 is full processor sharing
  (what the emulated node and the simulator do), kappa < 1 a GPU that overlaps co-residents' kernels.
  The profiler measures kappa per GPU type (`flowmaker profiles measure-interference`).

Sums of shares are exact: each share is an IEEE double, and they are added as rationals
(`fractions.Fraction`), so that equal totals compare equal whatever the order of the sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction

from flowmaker.errors import InvalidSpec

# Full processor sharing: two busy instances on one GPU each run at half speed.
DEFAULT_INTERFERENCE = 1.0
MAX_INTERFERENCE = 4.0

ZERO = Fraction(0)


def busy_share(load: float, capacity: float) -> float:
    """Fraction of the time an instance is busy carrying `load` when it sustains `capacity` (same units)."""
    if load <= 0.0:
        return 0.0
    if capacity <= 0.0:
        return math.inf
    return load / capacity


def gpu_totals(placed: Iterable[tuple[Iterable[str], float]]) -> dict[str, Fraction]:
    """Exact per-GPU sum of busy shares; `placed` yields (gpu ids, share) per instance."""
    out: dict[str, Fraction] = {}
    for gids, share in placed:
        f = Fraction(share) if math.isfinite(share) else Fraction(10**9)
        for g in gids:
            out[g] = out.get(g, ZERO) + f
    return out


def co_resident_share(gpu_ids: Iterable[str], own_share: float, totals: Mapping[str, Fraction]) -> Fraction:
    """The most busy share the instance's co-residents put on any one of its GPUs."""
    own = Fraction(own_share) if math.isfinite(own_share) else Fraction(10**9)
    worst = ZERO
    for g in gpu_ids:
        x = totals.get(g, ZERO) - own
        if x > worst:
            worst = x
    return worst


def inflation(gpu_ids: Iterable[str], own_share: float, totals: Mapping[str, Fraction],
              kappa: float = DEFAULT_INTERFERENCE) -> float:
    """Latency multiplier (>= 1) of an instance on `gpu_ids` given every GPU's total busy share."""
    return float(1 + Fraction(kappa) * co_resident_share(gpu_ids, own_share, totals))


def predicted_slowdown(co_shares: Iterable[float], kappa: float = DEFAULT_INTERFERENCE) -> float:
    """Latency multiplier of an instance alone on its GPU but for co-residents with these busy shares."""
    return float(1 + Fraction(kappa) * sum((Fraction(s) for s in co_shares), ZERO))


def fit_interference(alone_s: float, shared_s: float, co_share: float) -> float:
    """kappa from one measurement: a call took `alone_s` alone and `shared_s` beside co-residents whose busy
    share (measured) was `co_share`."""
    if alone_s <= 0 or co_share <= 0:
        raise InvalidSpec("need a positive alone latency and co-resident share", field="interference")
    return max(0.0, (shared_s / alone_s - 1.0) / co_share)


def validate_interference(kappa: float, field: str = "interference") -> float:
    if not (0.0 <= kappa <= MAX_INTERFERENCE) or not math.isfinite(kappa):
        raise InvalidSpec(f"must be within [0, {MAX_INTERFERENCE:g}], got {kappa}", field=field)
    return kappa
