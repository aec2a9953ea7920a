"""Mean call latency of engine instances under load, in closed form: the analytic twin of `EngineModel`.

The live prediction (`flowmaker.orchestration.predict`) needs what a call takes on an instance that serves Poisson
arrivals at its tasks' rates, beside co-residents that slow it while they are busy. The selector's multiplier
(`flowmaker.sharing`: latency alone x f (1 - rho) / (1 - rho f)) is a conservative, exact bound for the
feasibility check; it treats an instance as an M/M/1 queue of whole calls. The engine model (which the emulated node
and the simulator both run) is a continuous-batching engine instead, and its latency under load has another shape:

* decode is memory-bound: a step lasts `max(d, b / D)` (d = `decode_s_per_token`, D = the pure-decode throughput,
  b = the batch). Calls decode side by side, so up to b = d D extra calls cost nothing; above it every step
  lengthens. The batch is the number of calls in their decode phase, by Little's law `sum(rate x time in batch)`,
  and with Poisson arrivals it is Poisson distributed around that mean (an M/G/inf queue); a call emits one token a
  step, so over its life its mean step is `1 / E[1 / max(d, (1 + B) / D)]`, B ~ Poisson(batch), itself included;
* prefill is not chunked: every admitted prompt stalls the whole batch for `p x in` (p = `prefill_s_per_token`).
  A call in the batch is stalled by every prompt admitted while it is there, a fraction `rho_p` of its life
  (`rho_p` = the prompt work offered per second), so its time in the batch is its own work over `1 - rho_p`;
* a call joins at the next step boundary: it waits the residual of the step in progress (mean `sum(S^2) / 2` per
  second of steps S: the long steps are those with a prefill), and the prompts that became ready in that step are
  prefilled in its admission step with its own; calls that reach the instance together (parallel stages of one
  request) are prefilled together;
* `fixed_s` is spent outside the batch and never slowed;
* co-residents: while busy (a call in flight, `1 - exp(-N)` with N = calls in flight, M/G/inf), each takes a share of
  the GPU (processor sharing, `flowmaker.sharing`'s kappa), so the instance runs at speed 1/f, f = 1 + kappa x the
  co-residents' busy shares on its most crowded GPU, and every GPU time above is multiplied by f. Slowed calls stay
  longer, so busy shares grow: `placement_latencies` solves the whole placement as a fixed point.

So a call of `in` prompt and `out` output tokens takes

    fixed + R + (f p (in + in_together) + rho_p x 2R + out x step) / (1 - rho_p),   rho_p = f x sum(rate p in)

Every input is a planned or metered figure the product has at run time: rates, per-stage token shapes, the
placement, the profiles and kappa. `None` (cannot keep up) when the prompt stalls or the decode steps alone would
fill the time (the fixed point diverges).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from flowmaker.domain import Profile

# The fixed point stops when no busy share moves by more than this, or after MAX_ROUNDS rounds (a placement that
# does not settle by then is treated as overloaded).
TOLERANCE = 1e-9
MAX_ROUNDS = 500
# An instance whose decode steps and prompt stalls would need this much of its time cannot keep up.
SATURATED = 1.0 - 1e-6


@dataclass(frozen=True, slots=True)
class Call:
    """One kind of call an instance serves: its prompt and output tokens, and the key it is reported by."""

    key: Hashable
    input_tokens: float
    output_tokens: float


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Poisson arrivals, `rate_rps` per second, of `calls` that reach the instance together (one call, or the
    parallel stages of one request mapped to the same instance)."""

    rate_rps: float
    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """An instance as the model sees it: its profile, its GPUs and what arrives at it."""

    profile: Profile
    gpu_ids: tuple[str, ...]
    arrivals: tuple[Arrivals, ...]


@dataclass(frozen=True, slots=True)
class Loaded:
    """One instance under its load: the mean latency of each of its calls by key (model seconds; absent for every
    call when it cannot keep up), its busy share, its speed factor f, its prompt-stall share and mean batch."""

    latency_s: dict[Hashable, float]
    busy_share: float
    f: float
    prefill_share: float
    batch: float


def _mean_step(d: float, D: float, batch: float) -> float:
    """1 / E[1 / max(d, (1 + B) / D)], B ~ Poisson(batch): the mean step of a call in the batch (itself included),
    weighted as its tokens are: one per step."""
    if batch <= 0.0:
        return max(d, 1.0 / D)
    inv, pk, k = 0.0, math.exp(-batch), 0
    top = int(batch + 12.0 * math.sqrt(batch) + 30.0)  # the Poisson tail beyond is below 1e-12
    while k <= top:
        inv += pk / max(d, (1 + k) / D)
        k += 1
        pk *= batch / k
    return 1.0 / inv


def instance_latencies(load: InstanceLoad, f: float) -> Loaded:
    """The instance at speed 1/f under its arrivals (see the module docstring). Arrivals at rate 0 add no load; their
    calls still get a latency (what one would take)."""
    p = load.profile
    pf, d, D = p.prefill_s_per_token * f, p.decode_s_per_token * f, p.pure_decode_tokens_per_s / f
    prompt = [pf * sum(c.input_tokens for c in a.calls) for a in load.arrivals]  # each arrival's stall
    rho_p = sum(a.rate_rps * x for a, x in zip(load.arrivals, prompt, strict=True))
    decode = sum(a.rate_rps * sum(c.output_tokens for c in a.calls) for a in load.arrivals) / D
    if rho_p + decode >= SATURATED:
        return Loaded({}, 1.0, f, rho_p, math.inf)
    batch = busy = 0.0
    for _ in range(MAX_ROUNDS):
        step = _mean_step(d, D, batch)
        # Admission steps (an arrival's prompts, then a decode step) and decode steps in the rest of the busy time:
        # the sum of squared step lengths per second, over 2, is the mean residual a ready call waits.
        adm = [(a.rate_rps, x + step) for a, x in zip(load.arrivals, prompt, strict=True)]
        sq = sum(r * s * s for r, s in adm) + max(0.0, busy - sum(r * s for r, s in adm)) * step
        resid = sq / 2.0
        lat: dict[Hashable, float] = {}
        new_batch = in_flight = 0.0
        for a, x in zip(load.arrivals, prompt, strict=True):
            for c in a.calls:
                # Prompts that became ready in the same step (rho_p x its length-biased mean 2R) join its admission.
                t_b = (x + rho_p * 2.0 * resid + c.output_tokens * step) / (1.0 - rho_p)
                lat[c.key] = p.fixed_s + resid + t_b
                new_batch += a.rate_rps * t_b
                in_flight += a.rate_rps * lat[c.key]
        new_busy = -math.expm1(-in_flight)
        if abs(new_batch - batch) <= TOLERANCE * max(1.0, batch) and abs(new_busy - busy) <= TOLERANCE:
            return Loaded(lat, new_busy, f, rho_p, new_batch)
        batch, busy = new_batch, new_busy
    return Loaded({}, 1.0, f, rho_p, math.inf)


def speed_factor(gpu_ids: Sequence[str], own: str, busy: Mapping[str, float], on_gpu: Mapping[str, Sequence[str]],
                 kappa: float) -> float:
    """f = 1 + kappa x the most busy share its co-residents put on any one of its GPUs (`flowmaker.sharing`'s)."""
    worst = 0.0
    for g in gpu_ids:
        worst = max(worst, sum(busy.get(j, 0.0) for j in on_gpu.get(g, ()) if j != own))
    return 1.0 + kappa * worst


def placement_latencies(instances: Mapping[str, InstanceLoad], kappa: float, *,
                        fixed_busy: Mapping[str, tuple[tuple[str, ...], float]] | None = None) -> dict[str, Loaded]:
    """Every instance of a placement under its load, co-residents' busy shares solved together: start from every
    instance alone, slow each by its co-residents' busy shares, recompute them, until none moves by more than
    TOLERANCE. Busy shares only grow from round to round (a slower co-resident is busy longer), so this converges to
    the least fixed point, or an instance stops keeping up (busy all the time from then on). `fixed_busy`: other
    instances on the GPUs (id -> GPU ids, busy share) whose busy share is given, not solved."""
    fixed = dict(fixed_busy or {})
    on_gpu: dict[str, list[str]] = {}
    for iid, gids in [(i, x.gpu_ids) for i, x in instances.items()] + [(i, g) for i, (g, _) in fixed.items()]:
        for g in gids:
            on_gpu.setdefault(g, []).append(iid)
    busy = {iid: b for iid, (_, b) in fixed.items()}
    out: dict[str, Loaded] = {}
    for _ in range(MAX_ROUNDS):
        out = {iid: instance_latencies(x, speed_factor(x.gpu_ids, iid, busy, on_gpu, kappa))
               for iid, x in sorted(instances.items())}
        moved = any(abs(r.busy_share - busy.get(iid, 0.0)) > TOLERANCE for iid, r in out.items())
        busy.update((iid, r.busy_share) for iid, r in out.items())
        if not moved:
            break
    return out
