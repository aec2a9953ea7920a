"""Mean call latency of engine instances under load, in closed form: the analytic twin of `EngineModel`.

The live prediction (`flowmaker.orchestration.predict`) needs what a call takes on an instance that serves its
tasks' calls at their rates, beside co-residents that slow it while they are busy. The selector's multiplier
(`flowmaker.sharing`: latency alone x f (1 - rho) / (1 - rho f)) is a conservative, exact bound for the
feasibility check; it treats an instance as an M/M/1 queue of whole calls. The engine model (which the emulated node
and the simulator both run) is a continuous-batching engine instead, and its latency under load has another shape:

* decode: a step lasts `max(d, b / D)` (d = `decode_s_per_token`, D = the pure-decode throughput,
  b = the batch), and every call in the batch gets one token a step. Calls decode side by side, so up to d D calls
  cost nothing more; above it the engine is compute-bound and serves D tokens/s. That is a processor-sharing queue of
  tokens whose rate depends on the batch (`decode_queue`), and a call takes its tokens x the mean batch / the token
  rate. Near saturation the batch's spread sets the mean: every prompt stall lengthens the life of every call in the
  batch at once, and more calls arrive meanwhile, so the batch is a branching count (generalized Poisson while steps
  do not lengthen, a geometric tail beyond, both wider the more prompts stall and the more clustered the arrivals);
* prefill is not chunked: every admitted prompt stalls the whole batch for `p x in` (p = `prefill_s_per_token`).
  A call in the batch is stalled by every prompt admitted while it is there, a fraction `rho_p` of its life
  (`rho_p` = the prompt work offered per second), so decode runs `1 - rho_p` of the time and its own prompt takes
  `p x in / (1 - rho_p)`;
* a call joins at the next step boundary: it waits the residual of the step in progress (mean `sum(S^2) / 2` per
  second of steps S: the long steps are those with a prefill), and the prompts that became ready in that step are
  prefilled in its admission step with its own; calls that reach the instance together (parallel stages of one
  request) are prefilled together;
* `fixed_s` is spent outside the batch and never slowed;
* a task's requests arrive as Poisson, but a stage after an LLM stage gets that stage's departures, which leave a
  batching engine in clusters (a stall holds back the whole batch): `Loaded.clustering`, carried from stage to stage
  by `flowmaker.orchestration.predict`;
* co-residents: while busy (a non-empty batch: prompt stalls, a fraction rho_p of the time, and in the rest an
  M/G/inf queue of arrivals that decode for their tokens x the step, so `1 - (1 - rho_p) exp(-sum(rate x out x
  step))`), each takes a share of the GPU (processor sharing, `flowmaker.sharing`'s kappa): at each moment the
  instance runs at speed 1 / (1 + kappa n), n the busy co-residents on its most crowded GPU, and every GPU time
  above is multiplied by f = 1 / its mean speed (co-residents busy independently; `speed_factor`); never more than
  1 + kappa x their busy shares (on one GPU, the selector's f). Slowed calls stay longer, so busy shares grow:
  `placement_latencies` solves the whole placement as a fixed point.

So a call of `in` prompt and `out` output tokens takes

    fixed + R + (f p (in + in_together) + rho_p x 2R) / (1 - rho_p) + out x batch / token rate,
    rho_p = f x sum(rate p in)

Every input is a planned or metered figure the product has at run time: rates, per-stage token shapes, the
placement, the profiles and kappa. No latency (cannot keep up) when prompt stalls and decode at full batch would
fill the time: `rho_p + f x sum(rate x out) / D >= 1`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from flowmaker.domain import Profile

# The fixed points stop when no busy share moves by more than this, or after MAX_ROUNDS rounds (the last stands:
# busy shares are bounded and only grow, so they settle long before).
TOLERANCE = 1e-9
MAX_ROUNDS = 500
# Co-residents of one instance whose busy subsets `speed_factor` enumerates (2^n of them); more use the linear bound.
MAX_EXACT_CORESIDENTS = 6
# An instance whose decode steps and prompt stalls would need this much of its time cannot keep up.
SATURATED = 1.0 - 1e-6
# The most terms a batch law is summed over.
MAX_TERMS = 200_000
# Arrivals more clustered than this (or not finite: an upstream that cannot keep up) count as this clustered.
MAX_DISPERSION = 1e6


@dataclass(frozen=True, slots=True)
class Call:
    """One kind of call an instance serves: its prompt and output tokens, and the key it is reported by."""

    key: Hashable
    input_tokens: float
    output_tokens: float


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Arrivals, `rate_rps` per second, of `calls` that reach the instance together (one call, or the parallel
    stages of one request mapped to the same instance). `dispersion`: the index of dispersion of their counts
    (variance / mean over a call's life): 1 for Poisson arrivals (a task's requests), more for calls that are the
    departures of an upstream engine stage (`Loaded.clustering`)."""

    rate_rps: float
    calls: tuple[Call, ...]
    dispersion: float = 1.0


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """An instance as the model sees it: its profile, its GPUs and what arrives at it."""

    profile: Profile
    gpu_ids: tuple[str, ...]
    arrivals: tuple[Arrivals, ...]


@dataclass(frozen=True, slots=True)
class Loaded:
    """One instance under its load: the mean latency of each of its calls by key (model seconds; absent for every
    call when it cannot keep up), its busy share, its speed factor f, its prompt-stall share and mean batch, and how
    much more clustered a stream of calls leaves it than it came.

    Departures come in clusters: a prompt stall holds back every call in the batch, and while they are held more
    calls arrive and stall them again. A cluster is the calls one stall sets off, a Galton-Watson family with
    `prefill_share` children per call on average, so its size is Borel distributed, and the counts of a Poisson
    stream of such clusters have index of dispersion E[X^2] / E[X] = 1 / (1 - rho_p)^2. A stream already that many
    times as variable as Poisson leaves `clustering` times more so (both checked against EngineModel's departures:
    tests/unit/test_loaded_latency.py)."""

    latency_s: dict[Hashable, float]
    busy_share: float
    f: float
    prefill_share: float
    batch: float
    clustering: float = 1.0


def decode_queue(token_rate: float, d: float, D: float, stall: float, dispersion: float = 1.0
                 ) -> tuple[float, float]:
    """(mean batch, mean time per output token of a call) of the decode phase: a processor-sharing queue whose n calls
    each get a token per step of max(d, n / D), stalled by prompts a fraction `stall` of the time, so that it serves
    (1 - stall) n / max(d, n / D) tokens/s, offered `token_rate` tokens/s. A call takes its tokens x the mean batch /
    token_rate (Little's law, per token). Needs token_rate < (1 - stall) D, the most the engine decodes.

    The batch is a branching count, not a Poisson one. Up to n0 = floor(d D) calls steps do not lengthen, and the
    calls in the batch are those that arrived within a life of out x d plus every stall admitted meanwhile; each
    stall lengthens the life of every call in the batch, during which more calls arrive (`stall` of them per call
    on average). That is the generalized Poisson law (Consul): mean a = token_rate d / (1 - stall), variance
    a / (1 - lam)^2, lam = stall for Poisson arrivals. Arrivals whose counts are `dispersion` times as variable as
    Poisson ones (index of dispersion; clustered departures of an upstream engine) widen it to
    dispersion / (1 - stall)^2 = 1 / (1 - lam)^2. Beyond n0 the engine is compute-bound: a processor-sharing queue
    at (1 - stall) D tokens/s, loaded q = token_rate / ((1 - stall) D), whose queue the same variability lengthens
    (heavy traffic: the mean queue q / (1 - q) times c^2 = 1 / (1 - lam)^2), so the tail is geometric with
    q' / (1 - q') = c^2 q / (1 - q), and no steeper than the memory-bound law at n0 (past n0 a call's life only
    lengthens). With no stall and Poisson arrivals this is the plain symmetric queue: Poisson up to n0, geometric q
    beyond."""
    # d x D does not depend on the speed (d x f times D / f), but the product of the slowed figures can fall a
    # rounding error short of a whole number: no floor may drop a call for it.
    n0 = math.floor(d * D * (1.0 + 1e-12))
    if token_rate <= 0.0:
        return 0.0, max(d, 1.0 / D) / (1.0 - stall)
    a = token_rate * d / (1.0 - stall)
    lam = max(0.0, 1.0 - (1.0 - stall) / math.sqrt(min(max(1.0, dispersion), MAX_DISPERSION)))
    theta = a * (1.0 - lam)
    q0 = token_rate / ((1.0 - stall) * D)
    x = q0 / (1.0 - q0) / (1.0 - lam) ** 2
    q = x / (1.0 + x)
    log_theta = math.log(theta)

    def log_w(n: int) -> float:  # generalized Poisson, up to the constant factor exp(-theta)
        return 0.0 if n == 0 else log_theta + (n - 1) * math.log(theta + n * lam) - n * lam - math.lgamma(n + 1)

    # Weights relative to the largest. Its tail falls like
    # n^-1.5 (lam e^(1 - lam))^n: past the mean plus 40 standard deviations plus 50, plus 40 / -ln(lam e^(1 - lam))
    # more, a weight is below 1e-17 of the largest, and the sum is cut there (at most MAX_TERMS terms).
    sd = math.sqrt(a) / (1.0 - lam)
    tail = 40.0 / (-math.log(lam) - (1.0 - lam)) if lam > 0.0 else 0.0
    last = min(n0, math.ceil(a + 40.0 * sd + 50.0 + tail), MAX_TERMS)
    logs = [log_w(n) for n in range(last + 1)]
    top = max(logs)
    z = mean = w = 0.0
    for n, lw in enumerate(logs):
        w = math.exp(lw - top)
        z += w
        mean += n * w
    if last == n0:  # (MAX_TERMS cuts only a weight below 1e-17 of the largest)
        # Nor more steeply than the memory-bound law falls at n0 (relative to the Poisson law's a / n0 there,
        # where the plain queue goes on with ratio q): past n0 a call's life only lengthens.
        if n0 >= 1:
            q = min(max(q, q0 * math.exp(logs[n0] - logs[n0 - 1]) * n0 / a), 1.0 - 1e-12)
        # The tail from w = pi(n0): sum_{j >= 1} q^j = q / (1 - q); sum_{j >= 1} (n0 + j) q^j =
        # n0 q / (1 - q) + q / (1 - q)^2.
        z += w * q / (1.0 - q)
        mean += w * (n0 * q / (1.0 - q) + q / (1.0 - q) ** 2)
    batch = mean / z
    return batch, batch / token_rate


def instance_latencies(load: InstanceLoad, f: float) -> Loaded:
    """The instance at speed 1/f under its arrivals (see the module docstring). Arrivals at rate 0 add no load; their
    calls still get a latency (what one would take)."""
    p = load.profile
    pf, d, D = p.prefill_s_per_token * f, p.decode_s_per_token * f, p.pure_decode_tokens_per_s / f
    prompt = [pf * sum(c.input_tokens for c in a.calls) for a in load.arrivals]  # each arrival's stall
    rho_p = sum(a.rate_rps * x for a, x in zip(load.arrivals, prompt, strict=True))
    tokens = sum(a.rate_rps * sum(c.output_tokens for c in a.calls) for a in load.arrivals)
    if rho_p + tokens / D >= SATURATED:
        return Loaded({}, 1.0, f, rho_p, math.inf, math.inf)
    # Independent streams superpose: the dispersion of their tokens is the token-weighted mean of theirs.
    disp = sum(a.rate_rps * sum(c.output_tokens for c in a.calls) * a.dispersion for a in load.arrivals) / tokens \
        if tokens > 0 else 1.0
    batch, per_token = decode_queue(tokens, d, D, rho_p, disp)
    step = max(d, batch / D)
    # The instance is busy (a non-empty batch) while it prefills, a fraction rho_p of the time, or decodes. Cut the
    # prompt stalls out of the timeline: what is left is idle time and decode time, where arrivals are Poisson at
    # their rates (those that come during a stall are admitted with it and decode beside the call that set it off),
    # and each arrival's calls decode side by side for its longest call's tokens x `step`: an M/G/inf queue of
    # arrivals, empty a fraction exp(-sum(rate x that)) of that time. Not 1 - exp(-rate x latency): calls that wait
    # for each other's prompts overlap, and fixed_s is spent outside the batch (that over-counted a 7B tp4's busy
    # share, 0.46 against 0.37 measured, and the 14B beside it was predicted at 14.6 s against 10.2 s measured;
    # against EngineModel's busy seconds within 0.015 from busy 0.05 to 0.999, and within 0.023 on random instances,
    # where that had up to 0.14: tests/unit/test_loaded_latency.py).
    busy = -math.expm1(math.log1p(-rho_p) - sum(
        a.rate_rps * max((c.output_tokens for c in a.calls), default=0.0) * step for a in load.arrivals))
    # Admission steps (an arrival's prompts, then a decode step) and decode steps in the rest of the busy time:
    # the sum of squared step lengths per second, over 2, is the mean residual a ready call waits.
    adm = [(a.rate_rps, x + step) for a, x in zip(load.arrivals, prompt, strict=True)]
    resid = (sum(r * s * s for r, s in adm) + max(0.0, busy - sum(r * s for r, s in adm)) * step) / 2.0
    lat: dict[Hashable, float] = {}
    for a, x in zip(load.arrivals, prompt, strict=True):
        for c in a.calls:
            # Its prompt, with those that arrived with it and those that became ready in the same step (rho_p x
            # that step's length-biased mean 2R), stalled by the prompts admitted meanwhile; then its tokens.
            lat[c.key] = p.fixed_s + resid + (x + rho_p * 2.0 * resid) / (1.0 - rho_p) \
                + c.output_tokens * per_token
    return Loaded(lat, busy, f, rho_p, batch, 1.0 / (1.0 - rho_p) ** 2)


def speed_factor(gpu_ids: Sequence[str], own: str, busy: Mapping[str, float], on_gpu: Mapping[str, Sequence[str]],
                 kappa: float) -> float:
    """The instance's mean slowdown: 1 / its mean speed, where at each moment it runs at speed 1 / (1 + kappa n), n
    the most co-residents busy on any one of its GPUs (the emulated GPUs' and the simulator's processor sharing),
    co-residents busy independently with their busy shares. Exact over the subsets of busy co-residents for up to
    MAX_EXACT_CORESIDENTS of them; beyond, 1 + kappa x all its co-residents' busy shares, which is never less
    (Jensen: 1 / E[1 / (1 + kappa n)] <= 1 + kappa E[n], and n is at most the busy ones). The linear form on the
    busiest GPU alone (`flowmaker.sharing`'s, the selector's) over-predicted a stage beside two part-time
    co-residents by 1.9x (live-sharing at the 0.85 cap: math's solve, 27.2 s predicted, 12.4 s measured)."""
    co = sorted({j for g in gpu_ids for j in on_gpu.get(g, ()) if j != own and busy.get(j, 0.0) > 0.0})
    if not co or kappa == 0.0:
        return 1.0
    if len(co) > MAX_EXACT_CORESIDENTS:
        return 1.0 + kappa * sum(min(1.0, busy[j]) for j in co)
    on = [[i for i, j in enumerate(co) if j in on_gpu.get(g, ())] for g in gpu_ids]
    b = [min(1.0, busy[j]) for j in co]
    speed = 0.0
    for mask in range(1 << len(co)):
        pr = 1.0
        for i, x in enumerate(b):
            pr *= x if mask >> i & 1 else 1.0 - x
        if pr > 0.0:
            n = max(sum(mask >> i & 1 for i in ids) for ids in on)
            speed += pr / (1.0 + kappa * n)
    return 1.0 / speed


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
