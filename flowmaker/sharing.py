"""GPU sharing: the one model of how instances placed on the same GPU slow each other.

Used by the selector (docs/selection-spec.md, "Extension: GPU sharing"), the evaluation's policies, the
emulated node (engines on one emulated GPU share it) and the profiler (which calibrates kappa per GPU type).

Two figures describe an instance at its planned load:

* its *compute share* `rho = load / capacity` (capacity in busy time at the workflow's mean request, or in
  output tokens): the fraction of the GPU's compute it needs when it batches at full efficiency. The
  compute shares on one GPU add up to at most its compute budget u (MuxServe's compute quota).
* its *busy share* `s`: the fraction of the time it has at least one call in flight, when its kernels
  compete for the GPU whatever its batch size. With `N` call-seconds of work offered per second (arrival
  rate x latency alone, summed over its stages), calls overlap as in an infinite-server queue, so
  `s = 1 - exp(-N)` (calibrated against the simulator: within 0.05 of the measured busy fraction up to
  N = 2.5; see docs/evaluation.md). Measured busy shares of running instances replace the estimate.

While it serves a call, each co-resident j is busy with probability s_j and a busy co-resident takes a
share of the GPU (processor sharing, as the simulator's `dynamic` co-location and the emulated node do), so
the instance runs at speed 1/f with `f = 1 + kappa x (co-residents' busy shares on its most crowded GPU)`.
At speed 1/f its own compute share becomes `rho x f`, and its queueing grows with it: relative to its
latency alone at the same load, latency is multiplied by

    m = f x (1 - rho) / (1 - rho x f)           (M/M/1-like queueing at reduced speed; needs rho x f < 1)

kappa = 1 is full processor sharing; a GPU that overlaps co-residents' kernels has kappa < 1. The profiler
measures it per GPU type (`flowmaker profiles measure-interference`).

Exactness: shares are IEEE doubles (one division, one `expm1`/`exp` each); every sum, difference, product
and quotient of shares is taken exactly as rationals (`fractions.Fraction`), so that equal figures compare
equal whatever the order of a sum. Only the final multiplier is turned back into a double.
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
ONE = Fraction(1)
# Stands for an infinite share in exact sums (a load on an instance of no capacity).
HUGE = Fraction(10**9)


def busy_share(load: float, capacity: float) -> float:
    """Compute share: fraction of its capacity an instance needs to carry `load` (same units)."""
    if load <= 0.0:
        return 0.0
    if capacity <= 0.0:
        return math.inf
    return load / capacity


def occupancy(offered: float) -> float:
    """Busy share of an instance offered `offered` call-seconds per second: 1 - exp(-N)."""
    return -math.expm1(-offered) if offered > 0 else 0.0


def add_offered(busy0: float, offered: float) -> float:
    """Busy share once `offered` call-seconds/s join an instance busy `busy0` of the time: it is idle only when
    both the old and the new calls leave it idle, 1 - (1 - busy0) x exp(-N)."""
    if offered <= 0:
        return busy0
    return 1.0 - (1.0 - busy0) * math.exp(-offered)


def frac(x: float) -> Fraction:
    return Fraction(x) if math.isfinite(x) else HUGE


def gpu_totals(placed: Iterable[tuple[Iterable[str], float]]) -> dict[str, Fraction]:
    """Exact per-GPU sum of shares; `placed` yields (gpu ids, share) per instance."""
    out: dict[str, Fraction] = {}
    for gids, share in placed:
        f = frac(share)
        for g in gids:
            out[g] = out.get(g, ZERO) + f
    return out


def speed_factor(gpu_ids: Iterable[str], own_busy: Fraction, totals: Mapping[str, Fraction],
                 kappa: Fraction) -> Fraction:
    """f = 1 + kappa x the most busy share its co-residents put on any one of its GPUs."""
    worst = ZERO
    for g in gpu_ids:
        x = totals.get(g, ZERO) - own_busy
        if x > worst:
            worst = x
    return 1 + kappa * worst


def multiplier(f: Fraction, rho: Fraction) -> Fraction | None:
    """Latency multiplier at speed 1/f of an instance with compute share rho; None when rho x f >= 1 (it can no
    longer keep up)."""
    if rho * f >= 1:
        return None
    return f * (1 - rho) / (1 - rho * f)


def placed_multipliers(placed: Mapping[str, tuple[tuple[str, ...], float, float]], kappa: Fraction
                       ) -> dict[str, Fraction | None]:
    """Each instance's latency multiplier on a whole placement: `placed` maps an instance id to (its GPU ids, its
    compute share rho, its busy share b). Its co-residents' busy shares are the exact per-GPU sums less its own
    (`gpu_totals`, `speed_factor`), m = `multiplier(f, rho)`; None when it can no longer keep up. The selector's
    Feasibility 5.2 on a placement where every instance is already placed."""
    totals = gpu_totals((gids, b) for gids, _, b in placed.values())
    return {iid: multiplier(speed_factor(gids, frac(b), totals, kappa), frac(rho))
            for iid, (gids, rho, b) in placed.items()}


def predicted_slowdown(co_busy: Iterable[float], rho: float = 0.0, kappa: float = DEFAULT_INTERFERENCE) -> float:
    """Latency multiplier of an instance (compute share rho) beside co-residents with these busy shares on its GPU;
    inf when it cannot keep up."""
    f = 1 + Fraction(kappa) * sum((frac(s) for s in co_busy), ZERO)
    m = multiplier(f, frac(rho))
    return math.inf if m is None else float(m)


def fit_interference(alone_s: float, shared_s: float, co_share: float, rho: float = 0.0) -> float:
    """kappa from one measurement: a call took `alone_s` alone and `shared_s` beside co-residents whose busy share
    (measured) was `co_share`, the measured instance having compute share `rho` (0: a light probe)."""
    if alone_s <= 0 or co_share <= 0:
        raise InvalidSpec("need a positive alone latency and co-resident share", field="interference")
    m = shared_s / alone_s
    # invert m = f (1 - rho) / (1 - rho f) for f
    f = m / (1 - rho + rho * m) if rho > 0 else m
    return max(0.0, (f - 1.0) / co_share)


def validate_interference(kappa: float, field: str = "interference") -> float:
    if not (0.0 <= kappa <= MAX_INTERFERENCE) or not math.isfinite(kappa):
        raise InvalidSpec(f"must be within [0, {MAX_INTERFERENCE:g}], got {kappa}", field=field)
    return kappa
