"""Measuring GPU interference: kappa of `flowmaker.sharing`, one constant per GPU type.

In the sharing model an instance beside co-residents of busy share `s` runs at speed 1/f, `f = 1 + kappa * s`
(kappa = 1: full processor sharing; < 1: the GPU overlaps co-residents' kernels), and a light one (compute
share ~0) is slowed by f. `measure_interference` measures it with two engine instances A and B placed on the same GPU(s):

1. lone latencies: a few sequential calls of each engine alone (A's short probe shape, B's long load shape),
   to size the request rates;
2. A alone: A's probe calls arrive open loop (Poisson, `a_share / A's lone latency` per engine second: a light
   load) for `alone_window_s` engine seconds (at least `min_alone_probes` of them); their mean latency is
   `alone_s`;
3. for each target busy share p of B (2-3 levels): B is loaded open loop (Poisson at `-ln(1-p) / B's lone
   latency`: the sharing model's `occupancy` inverted, so that an engine whose calls batch freely is busy about
   a fraction p of the time, more with A's probes slowing it); after a warm-up of one B call, A's probes run
   again for `window_s` (at least `min_window_b_calls` lone B calls long, so that B comes and goes many times
   in a window), with the same arrival times as alone (one seed: common random numbers); their mean
   latency is `shared_s`, and B's busy share over the window is read (below) as the point's `co_share`;
4. kappa: least squares through the origin of `f - 1` against `co_share` over the levels, clamped to
   [0, MAX_INTERFERENCE] (`fit_kappa`; each level's own estimate is `sharing.fit_interference`), where f is the
   speed factor the slowdown `m = shared_s / alone_s` implies: the sharing model's `m = f (1 - rho) / (1 - rho f)`
   inverted for A's compute share rho, which the driver takes as 0 (light probes: on the emulator rho is
   ~0.001, on a real GPU a few %), so that f = m.

Why this design. Poisson probes see time averages (PASTA), so A's calls find B busy with the probability B's
busy fraction over the window has, whatever A's own load does to B; short probes beside long B calls
(B's state rarely changes during one probe) are the regime the model's "each co-resident is busy with
probability s_j while it serves a call" describes. On the emulated engine (processor sharing between busy
engines, `flowmaker.engine.gpu_share`) this comes out at about 1 (tests/integration/test_interference_measure.py).

A's latency: the engine's own timing, the mean of its `vllm:e2e_request_latency_seconds` histogram over exactly
the phase's calls (vLLM and the emulator export it; it leaves out HTTP and client noise), else at the client
(wall seconds x time scale).

B's busy share (`share_source`), best first:

* `engine_busy_time`: the engine's busy-time counter `flowmaker_engine_busy_seconds_total` (model seconds with
  a non-empty batch: the emulated engine) over the window, divided by the window's engine seconds;
* `sampled_running`: its `vllm:num_requests_running` gauge read at each of A's arrivals (vLLM, and the
  emulator too): the fraction of probes that found B running something;
* `estimated`: the sharing model's own estimate, `sharing.occupancy(N) = 1 - exp(-N)`, with N the calls B had
  in flight on average (Little: its calls sent per second in the window x their mean latency at the client, so
  that how A slows B counts; its lone latency when none of them finished) (an engine with neither, e.g.
  trtllm-serve, whose /metrics is JSON).

Any OpenAI-compatible engine works (trtllm-serve, vLLM, the emulator): the calls go through
`measure.EngineClient`, the same client the measured sweep uses (`ignore_eos`, token counts from `usage`,
the per-instance key). Placing A and B on the same GPU is the caller's job (`launch_emulated_pair` does it
for two emulated engines: `--gpu-ids` and `--gpu-share-dir`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from flowmaker.domain import Profile
from flowmaker.errors import FailedPrecondition, InvalidSpec, Unavailable
from flowmaker.profiling.measure import EngineClient, EngineHandle, ProcessHandle, metric_value
from flowmaker.sharing import MAX_INTERFERENCE, fit_interference, occupancy, validate_interference
from flowmaker.state.interference import InterferenceRecord

__all__ = [
    "BUSY_COUNTER", "EMULATED_PLAN", "EMULATED_PROFILE", "RUNNING_GAUGE", "SHARE_SOURCES", "InterferencePlan",
    "InterferencePoint", "InterferenceResult", "RemoteEngine", "connect_engine", "fit_kappa", "launch_emulated_pair",
    "measure_interference",
]

BUSY_COUNTER = "flowmaker_engine_busy_seconds_total"  # the emulated engine's busy time (model seconds)
RUNNING_GAUGE = "vllm:num_requests_running"
SHARE_ENGINE, SHARE_SAMPLED, SHARE_ESTIMATED = "engine_busy_time", "sampled_running", "estimated"
SHARE_SOURCES = (SHARE_ENGINE, SHARE_SAMPLED, SHARE_ESTIMATED)  # best first
MIN_CO_SHARE = 0.01  # a level where B was busier than this is a point of the fit
MAX_IDLE_B_SHARE = 0.05  # B busier than this while A runs alone: someone else is loading B
MAX_B_ERROR_FRACTION = 0.05  # B's load calls that may fail before the measurement is void

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class InterferencePlan:
    """What `measure_interference` sends. Defaults suit a real engine (a 7-8B model: a probe ~0.2-0.3 s, a
    load call ~1 s): about 2 minutes in all; `EMULATED_PLAN` is the emulated engine's."""

    a_input_tokens: int = 8  # A's probe calls: short
    a_output_tokens: int = 32
    b_input_tokens: int = 8  # B's load calls: several probes long
    b_output_tokens: int = 128
    a_share: float = 0.3  # A's offered busy share (a light load): its Poisson rate is a_share / A's lone latency
    b_shares: tuple[float, ...] = (0.15, 0.3, 0.45)  # target busy shares of B, one level each
    window_s: float = 30.0  # engine seconds of A's probes per level, at least...
    min_window_b_calls: float = 30.0  # ... this many lone B calls long
    alone_window_s: float = 15.0  # engine seconds of A's probes with B idle, at least...
    min_alone_probes: int = 15  # ... this many probes' worth
    lone_repeats: int = 3  # sequential calls of each engine alone (their median sizes the rates)
    seed: int = 0
    request_timeout_s: float = 600.0

    def validate(self) -> InterferencePlan:
        for name in ("a_input_tokens", "b_input_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidSpec(f"must be an integer >= 0, got {v!r}", field=f"plan.{name}")
        for name in ("a_output_tokens", "b_output_tokens", "lone_repeats", "min_alone_probes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidSpec(f"must be an integer >= 1, got {v!r}", field=f"plan.{name}")
        if not (0.0 < self.a_share <= 1.0):
            raise InvalidSpec(f"must be within (0, 1], got {self.a_share}", field="plan.a_share")
        if not 1 <= len(self.b_shares) <= 10:
            raise InvalidSpec(f"needs 1 to 10 levels (2-3 are enough), got {len(self.b_shares)}",
                              field="plan.b_shares")
        for i, p in enumerate(self.b_shares):
            if isinstance(p, bool) or not isinstance(p, int | float) or not (0.0 < p <= 0.9):
                raise InvalidSpec(f"must be within (0, 0.9], got {p!r}", field=f"plan.b_shares[{i}]")
        for name in ("window_s", "alone_window_s", "request_timeout_s", "min_window_b_calls"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise InvalidSpec(f"must be > 0, got {v!r}", field=f"plan.{name}")
        return self


@dataclass(frozen=True, slots=True)
class InterferencePoint:
    """One load level of B: A's mean latency alone and beside B, and B's busy share during the window."""

    co_share: float  # B's busy share over the window (0..1)
    alone_s: float  # A's mean call latency with B idle (engine seconds)
    shared_s: float  # A's mean call latency beside B at this level
    target_share: float = 0.0  # the level's target busy share of B
    b_rate_per_s: float = 0.0  # B's offered calls per engine second
    share_source: str = ""  # engine_busy_time, sampled_running or estimated
    a_calls: int = 0  # A's probes at this level
    b_calls: int = 0  # B's calls sent during the window
    rho: float = 0.0  # A's compute share (load / capacity) during the probes; 0: a light probe

    @property
    def slowdown(self) -> float:
        return self.shared_s / self.alone_s

    @property
    def speed_factor(self) -> float:
        """f of the sharing model: the slowdown m = f (1 - rho) / (1 - rho f) inverted (f = m when rho = 0)."""
        m = self.slowdown
        return m / (1.0 - self.rho + self.rho * m) if self.rho > 0 else m

    @property
    def kappa(self) -> float:
        """This level's own estimate (`sharing.fit_interference`, >= 0)."""
        return fit_interference(self.alone_s, self.shared_s, self.co_share, self.rho)

    def to_json(self) -> dict[str, Any]:
        return {"target_share": self.target_share, "b_rate_per_s": round(self.b_rate_per_s, 6),
                "co_share": round(self.co_share, 6), "share_source": self.share_source,
                "alone_s": round(self.alone_s, 6), "shared_s": round(self.shared_s, 6),
                "slowdown": round(self.slowdown, 6), "rho": self.rho, "kappa": round(self.kappa, 6),
                "a_calls": self.a_calls, "b_calls": self.b_calls}


def _check_point(p: InterferencePoint, where: str) -> None:
    for name, lo, hi in (("alone_s", 0.0, math.inf), ("shared_s", 0.0, math.inf), ("co_share", 0.0, 1.0)):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo < v <= hi:
            bound = "> 0" if hi == math.inf else f"within ({lo:g}, {hi:g}]"
            raise InvalidSpec(f"must be a finite number {bound}, got {v!r}", field=f"{where}.{name}")
    if isinstance(p.rho, bool) or not isinstance(p.rho, int | float) or not 0.0 <= p.rho < 1.0:
        raise InvalidSpec(f"must be within [0, 1), got {p.rho!r}", field=f"{where}.rho")


def fit_kappa(points: Sequence[InterferencePoint]) -> float:
    """kappa by least squares through the origin of (f - 1) against co_share (f = the slowdown when rho = 0),
    clamped to [0, MAX_INTERFERENCE]: sum(x * y) / sum(x^2), i.e. the levels' own `sharing.fit_interference`
    estimates weighted by co_share^2. InvalidSpec naming the field (`points`, `points[i].co_share`, ...) on bad
    input."""
    if not points:
        raise InvalidSpec("need at least one measured point", field="points")
    sxy = sxx = 0.0
    for i, p in enumerate(points):
        _check_point(p, f"points[{i}]")
        x = float(p.co_share)
        sxy += x * (p.speed_factor - 1.0)
        sxx += x * x
    return validate_interference(min(max(sxy / sxx, 0.0), MAX_INTERFERENCE), field="kappa")


@dataclass(frozen=True, slots=True)
class InterferenceResult:
    gpu_type: str
    kappa: float
    points: tuple[InterferencePoint, ...]
    alone_s: float  # A's mean latency alone (engine seconds)
    a_lone_s: float  # A's probe alone, sequential (engine seconds)
    b_lone_s: float  # B's load call alone, sequential
    b_idle_share: float | None  # B's busy share while A ran alone (None: unknown)
    latency_source: str  # "engine" (A's e2e histogram) or "client"
    share_source: str
    time_scale: float
    engine_a: str
    engine_b: str
    wall_s: float
    plan: InterferencePlan = field(default_factory=InterferencePlan)
    window_s: float = 0.0  # engine seconds of probes per level, as run
    alone_window_s: float = 0.0  # ... alone

    def details(self) -> dict[str, Any]:
        return {"engine_a": self.engine_a, "engine_b": self.engine_b, "time_scale": self.time_scale,
                "latency_source": self.latency_source, "share_source": self.share_source,
                "alone_s": round(self.alone_s, 6), "a_lone_s": round(self.a_lone_s, 6),
                "b_lone_s": round(self.b_lone_s, 6), "b_idle_share": self.b_idle_share,
                "wall_s": round(self.wall_s, 2),
                "plan": {"a_tokens": [self.plan.a_input_tokens, self.plan.a_output_tokens],
                         "b_tokens": [self.plan.b_input_tokens, self.plan.b_output_tokens],
                         "a_share": self.plan.a_share, "window_s": round(self.window_s, 3),
                         "alone_window_s": round(self.alone_window_s, 3), "seed": self.plan.seed}}

    def record(self, measured_at: float | None = None) -> InterferenceRecord:
        """What the profiler stores under `keys.interference(gpu_type)` (source MEASURED)."""
        return InterferenceRecord.measured(self.gpu_type, self.kappa, tuple(p.to_json() for p in self.points),
                                           self.details(), measured_at)


# ---- engines ---------------------------------------------------------------------------------------


@dataclass
class RemoteEngine:
    """An engine someone else started (its URL): an `EngineHandle` whose close() leaves it running."""

    base_url: str
    model_name: str
    time_scale: float = 1.0
    emulated: bool = False
    api_key: str = ""
    gpu_indices: tuple[int, ...] = ()
    reported_memory_gb_per_gpu: float | None = None

    async def close(self) -> None:
        return None


async def connect_engine(url: str, *, model: str = "", api_key: str = "", time_scale: float = 1.0,
                         emulated: bool = False, timeout_s: float = 10.0, field_name: str = "engine") -> RemoteEngine:
    """A running OpenAI-compatible engine at `url`; its model is `model` or the first that /v1/models lists."""
    if not url.startswith(("http://", "https://")):
        raise InvalidSpec(f"must be an http(s) URL, got {url!r}", field=field_name)
    if not time_scale > 0:
        raise InvalidSpec(f"must be > 0, got {time_scale}", field="time_scale")
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http, \
                http.get(base + "/v1/models", headers=headers) as r:
            body = await r.json(content_type=None) if r.status == 200 else None
            status = r.status
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise Unavailable(f"engine at {base}: GET /v1/models failed: {e!r}", field=field_name) from None
    if body is None:
        raise Unavailable(f"engine at {base}: GET /v1/models answered {status}", field=field_name)
    names = [m.get("id") for m in (body.get("data") or []) if isinstance(m, dict)] if isinstance(body, dict) else []
    if not model:
        if not names or not isinstance(names[0], str):
            raise FailedPrecondition(f"engine at {base} lists no model; name one", field=field_name)
        model = names[0]
    return RemoteEngine(base, model, time_scale, emulated, api_key)


# A probe profile for emulated engines: all GPU time (no fixed delay: `fixed_s` is never slowed by sharing),
# decoding memory-bound far beyond the levels' batches, 40 ms per token (few timer wake-ups per call).
EMULATED_PROFILE = Profile("interference-probe", 1, 1, 1.0, fixed_s=0.0, prefill_s_per_token=1e-5,
                           decode_s_per_token=0.04, max_output_tokens_per_s=10_000.0, decode_tokens_per_s=10_000.0)
# ... and its plan: probes of 0.32 s, load calls of 1.28 s (engine seconds); 40 s windows hold ~60 probes.
EMULATED_PLAN = InterferencePlan(a_input_tokens=8, a_output_tokens=8, b_input_tokens=8, b_output_tokens=32,
                                 a_share=0.5, window_s=40.0, alone_window_s=10.0, lone_repeats=2)


async def launch_emulated_pair(share_dir: str, *, time_scale: float = 10.0, profile: Profile = EMULATED_PROFILE,
                               gpu_ids: Sequence[str] = ("gpu0",), python: str = sys.executable,
                               start_timeout_s: float = 60.0) -> tuple[ProcessHandle, ProcessHandle]:
    """Start two emulated engines on the same emulated GPU(s) (`--gpu-ids`, one `--gpu-share-dir`) through the
    deployer's emulated backend; both are stopped if either fails to start. Close both handles when done."""
    from services.deployer.backends import EngineProcess, EngineSpec, get_backend

    backend = get_backend("emulated", python=python)
    extra = ("--time-scale", repr(float(time_scale)), "--gpu-ids", ",".join(gpu_ids), "--gpu-share-dir", share_dir)
    procs = [EngineProcess(backend, EngineSpec(instance_id=f"interference-{n}", model_id=profile.model_id,
                                               hf_id=profile.model_id, tp=1, pp=1, gpu_indices=(0,),
                                               host="127.0.0.1", port=0, profile=profile, extra_args=extra))
             for n in ("a", "b")]
    try:
        for p in procs:
            await p.start()
        await asyncio.gather(*(p.wait_healthy(start_timeout_s) for p in procs))
    except BaseException:
        for p in procs:
            with contextlib.suppress(Exception):
                await p.stop(grace_s=2.0)
        raise
    a, b = (ProcessHandle(p, backend.served_model_name(p.spec), time_scale, (), profile.memory_gb_per_gpu,
                          base_url=p.base_url, emulated=True) for p in procs)
    return a, b


# ---- the measurement -------------------------------------------------------------------------------


@dataclass
class _Phase:
    calls: int
    mean_s: float  # A's mean latency, engine seconds
    engine_timed: bool
    co_share: float | None  # B's busy share over the window (engine counter or samples); None: estimate it
    b_calls: int  # B's calls sent during the window
    b_in_flight: float | None  # B's mean calls in flight during the window (Little), None when none finished


class _OpenLoop:
    """B's load: calls of one shape at Poisson times (rate per wall second) until stopped."""

    def __init__(self, client: EngineClient, rate_wall: float, in_tokens: int, out_tokens: int,
                 rng: random.Random) -> None:
        self.client, self.rate, self.shape, self.rng = client, rate_wall, (in_tokens, out_tokens), rng
        self.sent = self.failed = 0
        self.last_error = ""
        self.done: list[tuple[float, float]] = []  # (start, wall seconds) of each finished call, loop time
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._runner = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t = loop.time()
        while True:
            t += self.rng.expovariate(self.rate)
            await asyncio.sleep(max(0.0, t - loop.time()))
            self.sent += 1
            task = asyncio.create_task(self._one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self) -> None:
        t = asyncio.get_running_loop().time()
        try:
            wall, _, _ = await self.client.complete(*self.shape)
            self.done.append((t, wall))
        except Unavailable as e:
            self.failed += 1
            self.last_error = str(e)

    async def stop(self) -> None:
        """Stop sending and drop the calls in flight (the engine drops a call whose client went away)."""
        tasks = [t for t in (self._runner, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _lone_latency(client: EngineClient, in_tokens: int, out_tokens: int, repeats: int, scale: float) -> float:
    """Median engine seconds of `repeats` sequential calls (the engine's timing when it has one)."""
    runs = []
    for _ in range(repeats):
        before = await client.e2e_seconds()
        wall, _, _ = await client.complete(in_tokens, out_tokens)
        after = await client.e2e_seconds() if before is not None else None
        if before is not None and after is not None and after[1] - before[1] == 1:
            runs.append(after[0] - before[0])
        else:
            runs.append(wall * scale)
    return statistics.median(runs)


async def _b_state(client: EngineClient) -> tuple[float | None, float | None]:
    """(busy-time counter, running gauge) of B's /metrics; None where it has neither."""
    text = await client.metrics_text()
    if text is None:
        return None, None
    return metric_value(text, BUSY_COUNTER), metric_value(text, RUNNING_GAUGE)


async def _probe(a: EngineClient, b: EngineClient, plan: InterferencePlan, rate_wall: float, window_wall: float,
                 scale: float, share_source: str, b_load: _OpenLoop | None) -> _Phase:
    """A's probes at Poisson times (the plan's seed: the same times every phase) for `window_wall` wall seconds,
    and B's busy share over that window."""
    loop = asyncio.get_running_loop()
    rng = random.Random(plan.seed)
    shape = (plan.a_input_tokens, plan.a_output_tokens)
    a_before = await a.e2e_seconds()
    samples: list[asyncio.Task[tuple[float | None, float | None]]] = []
    calls: list[asyncio.Task[tuple[float, int, int]]] = []
    b_sent0 = b_load.sent if b_load is not None else 0
    busy0, _ = await _b_state(b) if share_source == SHARE_ENGINE else (None, None)
    t0 = loop.time()
    end = t0 + window_wall
    t = t0
    while True:
        t += rng.expovariate(rate_wall)
        if t > end:
            await asyncio.sleep(max(0.0, end - loop.time()))
            break
        await asyncio.sleep(max(0.0, t - loop.time()))
        calls.append(asyncio.create_task(a.complete(*shape)))
        if share_source == SHARE_SAMPLED:
            samples.append(asyncio.create_task(_b_state(b)))
    busy1, _ = await _b_state(b) if share_source == SHARE_ENGINE else (None, None)
    t1 = loop.time()
    b_calls = (b_load.sent if b_load is not None else 0) - b_sent0
    try:
        done = await asyncio.gather(*calls)
        seen = await asyncio.gather(*samples)
    except BaseException:
        for task in (*calls, *samples):
            task.cancel()
        await asyncio.gather(*calls, *samples, return_exceptions=True)
        raise
    if not done:
        raise InvalidSpec(f"no probe of A fell in the {window_wall * scale:g} s window; lengthen it",
                          field="plan.window_s")
    a_after = await a.e2e_seconds() if a_before is not None else None
    if a_before is not None and a_after is not None and round(a_after[1] - a_before[1]) == len(done):
        mean, engine_timed = (a_after[0] - a_before[0]) / len(done), True
    else:  # no histogram, or someone else's calls on A too: time at the client
        mean, engine_timed = statistics.fmean(w for w, _, _ in done) * scale, False
    co: float | None = None
    if share_source == SHARE_ENGINE and busy0 is not None and busy1 is not None and t1 > t0:
        co = (busy1 - busy0) / ((t1 - t0) * scale)
    elif share_source == SHARE_SAMPLED:
        running = [r for _, r in seen if r is not None]
        co = sum(1 for r in running if r > 0) / len(running) if running else None
    lats = [w for start, w in (b_load.done if b_load is not None else []) if t0 <= start <= t1]
    in_flight = b_calls / (t1 - t0) * statistics.fmean(lats) if lats and t1 > t0 else None
    return _Phase(len(done), mean, engine_timed, co, b_calls, in_flight)


async def measure_interference(a: EngineHandle, b: EngineHandle, gpu_type: str, plan: InterferencePlan | None = None,
                               *, share_source: str = "", on_progress: Progress | None = None) -> InterferenceResult:
    """Measure kappa of `gpu_type` with engines `a` and `b` on the same GPU(s) (module docstring). Neither
    engine may serve anyone else meanwhile. `share_source` forces how B's busy share is read (one of
    SHARE_SOURCES; default the best B's /metrics allows)."""
    t_start = time.monotonic()
    plan = (plan or InterferencePlan()).validate()
    if not gpu_type:
        raise InvalidSpec("must not be empty", field="gpu_type")
    if share_source and share_source not in SHARE_SOURCES:
        raise InvalidSpec(f"must be one of {list(SHARE_SOURCES)}, got {share_source!r}", field="share_source")
    scale = a.time_scale
    if not scale > 0 or b.time_scale != scale:
        raise InvalidSpec(f"engines A and B must run at one time scale > 0, got {a.time_scale} and {b.time_scale}",
                          field="time_scale")

    def say(msg: str) -> None:
        if on_progress is not None:
            on_progress(msg)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        ca, cb = EngineClient(http, a, plan.request_timeout_s), EngineClient(http, b, plan.request_timeout_s)
        await ca.rtt(3)
        await cb.rtt(3)
        busy, running = await _b_state(cb)
        best = SHARE_ENGINE if busy is not None else SHARE_SAMPLED if running is not None else SHARE_ESTIMATED
        if share_source and SHARE_SOURCES.index(share_source) < SHARE_SOURCES.index(best):
            raise FailedPrecondition(f"engine B at {b.base_url} cannot give its busy share as {share_source} "
                                     f"(its /metrics allows {best})", field="share_source")
        share_source = share_source or best
        say(f"B's busy share from: {share_source}")
        a_lone = await _lone_latency(ca, plan.a_input_tokens, plan.a_output_tokens, plan.lone_repeats, scale)
        b_lone = await _lone_latency(cb, plan.b_input_tokens, plan.b_output_tokens, plan.lone_repeats, scale)
        say(f"lone calls: A {a_lone * 1e3:.1f} ms, B {b_lone * 1e3:.1f} ms (engine time)")
        a_rate_wall = plan.a_share / a_lone * scale
        alone_window = max(plan.alone_window_s, plan.min_alone_probes * a_lone / plan.a_share)
        window = max(plan.window_s, plan.min_window_b_calls * b_lone)
        say(f"windows: {alone_window:.1f} s alone, {window:.1f} s per level (engine time)")
        alone = await _probe(ca, cb, plan, a_rate_wall, alone_window / scale, scale, share_source, None)
        say(f"A alone: {alone.calls} probes, mean {alone.mean_s * 1e3:.1f} ms")
        if alone.co_share is not None and alone.co_share > MAX_IDLE_B_SHARE:
            raise FailedPrecondition(f"engine B at {b.base_url} was busy {alone.co_share:.0%} of the time while "
                                     "only A was probed: it serves someone else; measure on idle engines",
                                     field="engine_b")
        points = []
        timed = {alone.engine_timed}
        for i, target in enumerate(plan.b_shares):
            b_rate = -math.log(1.0 - target) / b_lone  # per engine second
            load = _OpenLoop(cb, b_rate * scale, plan.b_input_tokens, plan.b_output_tokens,
                             random.Random(plan.seed * 1000 + i + 1))
            load.start()
            try:
                await asyncio.sleep(b_lone / scale)  # warm-up: B's first calls in flight
                ph = await _probe(ca, cb, plan, a_rate_wall, window / scale, scale, share_source, load)
            finally:
                await load.stop()
            if load.failed > MAX_B_ERROR_FRACTION * max(load.sent, 1):
                raise Unavailable(f"engine B at {b.base_url}: {load.failed} of {load.sent} load calls failed; "
                                  f"last: {load.last_error}", field="engine_b")
            timed.add(ph.engine_timed)
            co = ph.co_share
            source = share_source
            if co is None:
                n = ph.b_in_flight if ph.b_in_flight is not None else ph.b_calls * b_lone / window
                co, source = occupancy(n), SHARE_ESTIMATED
            co = min(co, 1.0)
            say(f"level {i + 1}/{len(plan.b_shares)}: B at {b_rate:.3g} calls/s (target share {target:g}): "
                f"busy share {co:.3f}; A {ph.calls} probes, mean {ph.mean_s * 1e3:.1f} ms, "
                f"slowdown {ph.mean_s / alone.mean_s:.3f}")
            if co >= MIN_CO_SHARE:
                points.append(InterferencePoint(co, alone.mean_s, ph.mean_s, target, b_rate, source, ph.calls,
                                                ph.b_calls))
        if not points:
            raise FailedPrecondition(f"B was never busier than {MIN_CO_SHARE:g} of the time: no point to fit "
                                     "(is it serving the load?)", field="engine_b")
        if len(timed) > 1:  # one phase timed at the engine, another at the client: not comparable
            raise FailedPrecondition("engine A's latency histogram did not count exactly the probes in every phase "
                                     "(does someone else call it?)", field="engine_a")
        kappa = fit_kappa(points)
    return InterferenceResult(gpu_type, kappa, tuple(points), alone.mean_s, a_lone, b_lone, alone.co_share,
                              "engine" if alone.engine_timed else "client", points[0].share_source, scale, a.base_url,
                              b.base_url, time.monotonic() - t_start, plan, window, alone_window)

