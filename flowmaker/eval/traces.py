"""Azure LLM inference traces: CSV loader, deterministic synthetic generator, and load-level workloads.

Format (AzurePublicDataset, `AzureLLMInferenceTrace_{code,conv}.csv`): a header
`TIMESTAMP,ContextTokens,GeneratedTokens`, then one request per row, e.g.
`2023-11-16 18:17:03.9799600,4808,10`.

Replays. `build_request_segment_workload` is what `bench serving` runs (the declared experiment,
flowmaker/eval/data/paper-scale.toml): ONE segment of N consecutive trace requests per trace and seed, the
same at every load level, time-scaled by one factor per load so that its mean rate equals the sum of the
task rates; each request goes to a task drawn in proportion to the rates (seeded per request, not per
load), tasks are deployed at staggered times, and the N requests just before the segment give the offline
(causal) rates a baseline plans with. Burstiness and the (context, generated) token pairs are kept; only
the clock is stretched. `build_segment_workload` (a segment of fixed trace seconds at a seeded offset per
load level) is the older replay, which `bench adapt --replay segment` uses; `build_workload` (a stationary window per
task) serves unit tests and small checks. No thinning: thinning would change the burstiness of the code
trace.

Synthetic traces (machines without the files) match each trace's mean rate and
inter-arrival CV with lognormal gaps (conv: CV 1.09, median gap 0.12 s as in
the real trace; code: CV 13.2, whose median gap comes out at 0.03 s instead of
0.06 s -- a two-parameter fit cannot match mean, CV and median at once), and
draw tokens from the trace's quantile function (min, p10, p25, p50, p75, p90,
p95, p99, max; log-linear between them). Context and generated tokens are
drawn independently (the real traces show little correlation).
"""

from __future__ import annotations

import csv
import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import numpy as np

from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.eval.trace_stats import TRACE_KINDS, TRACE_STATS, TokenStats
from flowmaker.orchestration.adapt import peak_window_count

HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LOAD_LEVELS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
TRACE_FILES = {k: f"AzureLLMInferenceTrace_{k}.csv" for k in TRACE_KINDS}
TRACE_URL = "https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/AzureLLMInferenceTrace_{kind}.csv"
DEFAULT_BASE_DURATION_S = 30.0
DEFAULT_MIN_REQUESTS = 200
_EPOCH = datetime(2023, 11, 16, 18, 0, 0)  # synthetic traces start where the real ones do


class TraceRequest(NamedTuple):
    """One trace row: arrival (s since the trace's first request) and its token counts."""

    arrival_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class Trace:
    kind: str  # "code", "conv", or "custom"
    requests: tuple[TraceRequest, ...]
    source: str  # file path, or "synthetic(seed=..)"

    def __len__(self) -> int:
        return len(self.requests)


class Arrival(NamedTuple):
    """One request of a run: when it arrives, for which task, and its trace tokens."""

    time_s: float
    task: str
    req_id: str
    context_tokens: int
    generated_tokens: int


# ---- loading ---------------------------------------------------------------------------------


def _kind_of(path: Path) -> str:
    name = path.name.lower()
    for k in TRACE_KINDS:
        if f"_{k}" in name or name.startswith(k):
            return k
    return "custom"


def load_trace(path: str | Path, kind: str | None = None) -> Trace:
    """Read an Azure LLM inference trace CSV. Raises NotFound (no file) or InvalidSpec naming line and column.

    Rows are sorted by timestamp (stable) in case a file was concatenated out of order.
    """
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"trace file {str(p)!r} does not exist (run `flowmaker traces download` or "
                       f"`flowmaker traces synth`)", field="path")
    rows: list[tuple[datetime, int, int]] = []
    with p.open(newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise InvalidSpec(f"{p}: empty file; expected the header {','.join(HEADER)}", field="path") from None
        cols = [h.strip() for h in header]
        missing = [h for h in HEADER if h not in cols]
        if missing:
            raise InvalidSpec(f"{p}: header {cols} lacks column(s) {missing}; expected {','.join(HEADER)}",
                              field="path")
        it, ic, ig = (cols.index(h) for h in HEADER)
        for lineno, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < len(cols):
                raise InvalidSpec(f"{p}:{lineno}: expected {len(cols)} columns, got {len(row)}", field="path")
            try:
                ts = datetime.fromisoformat(row[it].strip())
            except ValueError:
                raise InvalidSpec(f"{p}:{lineno}: TIMESTAMP {row[it]!r} is not a date-time "
                                  f"(e.g. 2023-11-16 18:17:03.9799600)", field="TIMESTAMP") from None
            vals = []
            for idx, name in ((ic, "ContextTokens"), (ig, "GeneratedTokens")):
                try:
                    v = int(row[idx].strip())
                except ValueError:
                    raise InvalidSpec(f"{p}:{lineno}: {name} {row[idx]!r} is not an integer",
                                      field=name) from None
                if v < 0:
                    raise InvalidSpec(f"{p}:{lineno}: {name} must be >= 0, got {v}", field=name)
                vals.append(v)
            rows.append((ts, vals[0], vals[1]))
    if not rows:
        raise InvalidSpec(f"{p}: no requests after the header", field="path")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    reqs = tuple(TraceRequest((ts - t0).total_seconds(), c, g) for ts, c, g in rows)
    return Trace(kind or _kind_of(p), reqs, str(p))


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write a trace in the Azure CSV format (timestamps from 2023-11-16 18:00:00)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for r in trace.requests:
            ts = _EPOCH + timedelta(seconds=r.arrival_s)
            w.writerow([ts.strftime("%Y-%m-%d %H:%M:%S.%f") + "0", r.context_tokens, r.generated_tokens])
    return p


def find_trace(kind: str, traces_dir: str | Path | None) -> Path | None:
    """The CSV of `kind` inside `traces_dir`, or None when there is none."""
    if traces_dir is None:
        return None
    p = Path(traces_dir) / TRACE_FILES[_check_kind(kind)]
    return p if p.is_file() else None


def get_trace(kind: str, traces_dir: str | Path | None = None, seed: int = 0) -> Trace:
    """The real trace from `traces_dir` when its file is there, else a synthetic one of the same kind."""
    p = find_trace(kind, traces_dir)
    return load_trace(p, kind) if p is not None else synthesize(kind, seed=seed)


def _check_kind(kind: str) -> str:
    if kind not in TRACE_STATS:
        raise InvalidSpec(f"unknown trace kind {kind!r}; known: {list(TRACE_KINDS)}", field="kind")
    return kind


# ---- statistics ------------------------------------------------------------------------------


def quantile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default); NaN for no values."""
    return float(np.quantile(sorted_vals, q)) if len(sorted_vals) else math.nan


def _token_stats(vals: Iterable[int]) -> TokenStats:
    v = sorted(vals)
    n = len(v)
    mean = sum(v) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / n)
    q = [quantile(v, x) for x in (0.10, 0.25, 0.5, 0.75, 0.90, 0.95, 0.99)]
    return TokenStats(v[0], q[0], q[1], q[2], mean, q[3], q[4], q[5], q[6], v[-1], std)


def trace_stats(trace: Trace) -> dict[str, object]:
    """Rate, burstiness and token distributions of a trace (same fields as trace_summary_stats.csv)."""
    reqs = trace.requests
    n = len(reqs)
    dur = reqs[-1].arrival_s - reqs[0].arrival_s if n else 0.0
    gaps = sorted(reqs[i + 1].arrival_s - reqs[i].arrival_s for i in range(n - 1))
    gmean = sum(gaps) / len(gaps) if gaps else math.nan
    gstd = math.sqrt(sum((g - gmean) ** 2 for g in gaps) / len(gaps)) if gaps else math.nan
    return {
        "kind": trace.kind, "source": trace.source, "n_requests": n, "duration_s": dur,
        "mean_rate_rps": (n / dur) if dur > 0 else math.nan,
        "interarrival_mean_s": gmean, "interarrival_median_s": quantile(gaps, 0.5),
        "interarrival_cv": (gstd / gmean) if gaps and gmean > 0 else math.nan,
        "context": _asdict(_token_stats(r.context_tokens for r in reqs)),
        "generated": _asdict(_token_stats(r.generated_tokens for r in reqs)),
    }


def _asdict(ts: TokenStats) -> dict[str, float]:
    return {f: float(getattr(ts, f)) for f in TokenStats.__dataclass_fields__}


# ---- synthesis -------------------------------------------------------------------------------

_QS = (0.0, 0.10, 0.25, 0.5, 0.75, 0.90, 0.95, 0.99, 1.0)


def _quantile_points(ts: TokenStats) -> tuple[tuple[float, float], ...]:
    vals = (ts.minimum, ts.p10, ts.p25, ts.median, ts.p75, ts.p90, ts.p95, ts.p99, ts.maximum)
    return tuple(zip(_QS, (math.log(max(v, 1.0)) for v in vals), strict=True))


def _draw_tokens(rng: random.Random, pts: tuple[tuple[float, float], ...]) -> int:
    u = rng.random()
    for (q0, v0), (q1, v1) in itertools.pairwise(pts):
        if u <= q1:
            f = (u - q0) / (q1 - q0) if q1 > q0 else 0.0
            return max(1, round(math.exp(v0 + f * (v1 - v0))))
    return max(1, round(math.exp(pts[-1][1])))


def synthesize(kind: str, n_requests: int | None = None, seed: int = 0) -> Trace:
    """A synthetic trace with the rate, burstiness and token distributions of the real `kind` trace.

    Deterministic: the same (kind, n_requests, seed) gives the same trace on every machine.
    """
    st = TRACE_STATS[_check_kind(kind)]
    n = st.n_requests if n_requests is None else n_requests
    if n < 1:
        raise InvalidSpec(f"must be >= 1, got {n}", field="n_requests")
    rng = random.Random(f"flowmaker-trace/{kind}/{seed}")
    # Lognormal gaps with the trace's mean and CV: sigma^2 = ln(1 + CV^2), mu = ln(mean) - sigma^2 / 2.
    s2 = math.log(1.0 + st.interarrival_cv ** 2)
    mu, sigma = math.log(st.interarrival_mean_s) - s2 / 2, math.sqrt(s2)
    ctx_pts, gen_pts = _quantile_points(st.context), _quantile_points(st.generated)
    t = 0.0
    reqs = []
    for i in range(n):
        if i:
            t += rng.lognormvariate(mu, sigma)
        reqs.append(TraceRequest(t, _draw_tokens(rng, ctx_pts), _draw_tokens(rng, gen_pts)))
    return Trace(kind, tuple(reqs), f"synthetic(kind={kind}, seed={seed})")


# ---- workloads -------------------------------------------------------------------------------


def scaled_window(trace: Trace, n: int, rate_rps: float, offset: int) -> list[TraceRequest]:
    """`n` consecutive requests from `offset` (wrapping around), time-scaled to a mean rate of `rate_rps`.

    The window's own mean gap is measured over n+1 requests (the next arrival
    closes the last gap) and every gap is multiplied by (1/rate) / that mean.
    """
    if n <= 0:
        return []
    if not rate_rps > 0:
        raise InvalidSpec(f"must be > 0, got {rate_rps}", field="rate_rps")
    reqs = trace.requests
    m = len(reqs)
    span = (reqs[-1].arrival_s - reqs[0].arrival_s) if m > 1 else 0.0
    wrap_gap = span / (m - 1) if m > 1 else 1.0  # gap inserted when the window wraps around
    times: list[float] = []
    picked: list[TraceRequest] = []
    base = 0.0
    for j in range(n + 1):
        k, lap = (offset + j) % m, (offset + j) // m
        t = reqs[k].arrival_s + lap * (span + wrap_gap)
        if j == 0:
            base = t
        times.append(t - base)
        if j < n:
            picked.append(reqs[k])
    total = times[-1]
    target = n / rate_rps
    if total > 0:
        scale = target / total
        out_t = [x * scale for x in times[:n]]
    else:  # every request at the same instant: spread them evenly instead
        out_t = [j / rate_rps for j in range(n)]
    return [TraceRequest(t, q.context_tokens, q.generated_tokens) for t, q in zip(out_t, picked, strict=True)]


def run_duration_s(total_rate_rps: float, base_duration_s: float = DEFAULT_BASE_DURATION_S,
                   min_requests: int = DEFAULT_MIN_REQUESTS) -> float:
    """How long a run lasts: `base_duration_s`, stretched so that it has at least `min_requests` requests."""
    if not total_rate_rps > 0:
        raise InvalidSpec(f"must be > 0, got {total_rate_rps}", field="rate")
    return max(base_duration_s, min_requests / total_rate_rps)


def build_workload(task_rates: Sequence[tuple[str, float]], trace: Trace, seed: int = 0,
                   base_duration_s: float = DEFAULT_BASE_DURATION_S,
                   min_requests: int = DEFAULT_MIN_REQUESTS) -> list[Arrival]:
    """Arrivals of every task (name, rate req/s) over one run, sorted by time; see the module doc.

    Each task gets its own window of the trace, at an offset drawn from `seed` and the task's name.
    """
    if not trace.requests:
        raise InvalidSpec("trace has no requests", field="trace")
    for name, r in task_rates:
        if not r >= 0:
            raise InvalidSpec(f"task {name!r}: rate must be >= 0, got {r}", field="rate")
    total = sum(r for _, r in task_rates)
    dur = run_duration_s(total, base_duration_s, min_requests)
    out: list[Arrival] = []
    for name, rate in task_rates:
        n = round(rate * dur)
        if n == 0:
            continue
        rng = random.Random(f"flowmaker-workload/{trace.kind}/{name}/{seed}")
        offset = rng.randrange(len(trace.requests))
        for i, q in enumerate(scaled_window(trace, n, rate, offset)):
            out.append(Arrival(q.arrival_s, name, f"{name}-{i:05d}", q.context_tokens, q.generated_tokens))
    out.sort(key=lambda a: (a.time_s, a.task, a.req_id))
    return out


# ---- contiguous segments (the published replay: a real stretch of the trace, load swings kept) ----------------

DEFAULT_SEGMENT_S = 600.0  # trace seconds replayed per load level (>= 10 minutes of the trace's own clock)
MONITOR_WINDOW_TRACE_S = 60.0  # "current load" window and Murakkab's peak window, in the trace's own clock
DEPLOY_SPAN_FRACTION = 0.5  # tasks are deployed one after another over the first half of the segment


@dataclass(frozen=True, slots=True)
class SegmentWorkload:
    """One load level's replay: a contiguous trace segment, one time-scale factor, staggered task deploys.

    `arrivals` are the requests scored (each task's from its deploy time on); `all_arrivals` also has the
    requests that came for a task before its deploy (what a front end sees, e.g. for a current-rate
    measurement). Times are replay seconds; `scale` = replay seconds per trace second."""

    kind: str
    source: str
    load: float
    offset_s: float  # where the segment starts in the trace (trace seconds)
    segment_s: float  # its length (trace seconds)
    scale: float
    duration_s: float  # replay seconds = segment_s * scale
    deploy_s: tuple[tuple[str, float], ...]  # (task, deploy time in replay seconds), in deploy order
    window_s: float  # the monitor window in replay seconds (MONITOR_WINDOW_TRACE_S * scale)
    arrivals: tuple[Arrival, ...]
    all_arrivals: tuple[Arrival, ...]
    segment_requests: int
    segment_rate_rps: float  # the trace's own mean rate over the segment
    # What an offline planner knew (`build_request_segment_workload`): each task's mean and peak-window rate
    # over the stretch of the trace just before the segment, time-scaled the same way (replay req/s).
    offline_rates: tuple[tuple[str, float], ...] = ()
    offline_peak_rates: tuple[tuple[str, float], ...] = ()
    # The preceding stretch's arrival times (all tasks, replay seconds, negative: before the segment starts) and
    # each task's share of the requests: the history a burst-aware planner reads (`burst_rate`).
    history_s: tuple[float, ...] = ()
    shares: tuple[tuple[str, float], ...] = ()

    def deploy_time(self, task: str) -> float:
        return dict(self.deploy_s)[task]

    def offline_rate(self, task: str) -> float:
        """The task's rate over the preceding stretch (causal offline planning); the segment mean without one."""
        return dict(self.offline_rates)[task] if self.offline_rates else self.mean_rate(task)

    def offline_peak_rate(self, task: str) -> float:
        """The task's peak monitor-window rate over the preceding stretch; the segment's peak without one."""
        return dict(self.offline_peak_rates)[task] if self.offline_peak_rates else self.peak_rate(task)

    def burst_rate(self, task: str, window_s: float, at: float) -> float:
        """The task's share of the highest arrival rate over any window of `window_s` in the history known at
        `at`: the preceding stretch and every request that arrived before `at` (all tasks: instances are
        shared, so the whole stream's bursts matter). 0 without a history or a share."""
        share = dict(self.shares).get(task, 0.0)
        if share <= 0 or window_s <= 0:
            return 0.0
        times = list(self.history_s) + [a.time_s for a in self.all_arrivals if a.time_s < at]
        return share * peak_window_count(times, window_s) / window_s

    def rate_in(self, task: str, t0: float, t1: float) -> float:
        """Requests/s of `task` arriving in [t0, t1) (before its deploy too)."""
        if t1 <= t0:
            return 0.0
        return sum(1 for a in self.all_arrivals if a.task == task and t0 <= a.time_s < t1) / (t1 - t0)

    def mean_rate(self, task: str) -> float:
        """Mean rate of `task` over the whole segment."""
        return self.rate_in(task, 0.0, self.duration_s)

    def peak_rate(self, task: str, step_s: float | None = None) -> float:
        """Highest rate of `task` over any window of `window_s` (trace minute) in the segment, on a grid."""
        w = self.window_s
        step = step_s or w / 6
        times = sorted(a.time_s for a in self.all_arrivals if a.task == task)
        best, t0, lo, hi = 0.0, 0.0, 0, 0
        while t0 + w <= self.duration_s + 1e-9:
            while lo < len(times) and times[lo] < t0:
                lo += 1
            while hi < len(times) and times[hi] < t0 + w:
                hi += 1
            best = max(best, (hi - lo) / w)
            t0 += step
        return best


def segment_offset(trace: Trace, segment_s: float, seed: int, load: float) -> float:
    """A seeded start (trace seconds) for the segment of one load level; the segment fits in the trace."""
    span = trace.requests[-1].arrival_s - trace.requests[0].arrival_s if trace.requests else 0.0
    if segment_s <= 0:
        raise InvalidSpec(f"must be > 0, got {segment_s}", field="segment_s")
    room = span - segment_s
    if room < 0:
        raise InvalidSpec(f"the trace spans {span:.0f} s, shorter than the segment ({segment_s:.0f} s)",
                          field="segment_s")
    rng = random.Random(f"flowmaker-segment/{trace.kind}/{load:g}/{seed}")
    return rng.uniform(0.0, room)


def _check_rates(task_rates: Sequence[tuple[str, float]]) -> float:
    total = sum(r for _, r in task_rates)
    if not total > 0 or any(not r >= 0 for _, r in task_rates):
        raise InvalidSpec(f"task rates must be >= 0 with a positive sum, got {list(task_rates)}", field="rate")
    return total


def _replay(seg: Sequence[TraceRequest], t0: float, scale: float, task_rates: Sequence[tuple[str, float]],
            assign_key: str, window_trace_s: float, span_trace_s: float, deploy_order: Sequence[str] | None
            ) -> tuple[tuple[tuple[str, float], ...], tuple[Arrival, ...], tuple[Arrival, ...]]:
    """The replay of trace requests `seg` from trace time `t0` at `scale` replay s per trace s: request i goes to a
    task drawn in proportion to the rates (`random.Random(f"{assign_key}/{i}")`); task k of n (in `deploy_order`)
    is deployed at W + k (span - W) / (n - 1) trace seconds. Returns (deploy times, scored arrivals -- those at or
    after their task's deploy --, every arrival), times in replay seconds."""
    total = sum(r for _, r in task_rates)
    names = [n for n, _ in task_rates]
    cum, acc = [], 0.0
    for _, rate in task_rates:
        acc += rate / total
        cum.append(acc)
    order = list(deploy_order) if deploy_order is not None else names
    n = len(order)
    w, span = window_trace_s, max(window_trace_s, span_trace_s)
    deploy = tuple((name, (w + (k * (span - w) / (n - 1) if n > 1 else 0.0)) * scale) for k, name in enumerate(order))
    dep = dict(deploy)
    everything: list[Arrival] = []
    for i, r in enumerate(seg):
        u = random.Random(f"{assign_key}/{i}").random()
        name = names[next((k for k, c in enumerate(cum) if u < c), len(names) - 1)]
        everything.append(Arrival((r.arrival_s - t0) * scale, name, f"{name}-{i:06d}", r.context_tokens,
                                  r.generated_tokens))
    everything.sort(key=lambda a: (a.time_s, a.task, a.req_id))
    scored = tuple(a for a in everything if a.time_s >= dep.get(a.task, 0.0))
    return deploy, scored, tuple(everything)


def build_segment_workload(task_rates: Sequence[tuple[str, float]], trace: Trace, load: float, seed: int = 0,
                           segment_s: float = DEFAULT_SEGMENT_S,
                           deploy_order: Sequence[str] | None = None) -> SegmentWorkload:
    """Replay a contiguous `segment_s` of `trace` at `load`; see `SegmentWorkload`.

    `task_rates`: (task, rate at this load). The segment (seeded offset per load level) is time-scaled by
    ONE factor so that its mean rate equals the sum of the task rates: minute-to-minute swings are kept.
    Each request goes to one task, drawn (seeded, per request) in proportion to the task rates, so every
    task sees the same swings. Task k (in `deploy_order`) is deployed at W + k * (span - W) / (n - 1)
    trace seconds, W = MONITOR_WINDOW_TRACE_S, span = DEPLOY_SPAN_FRACTION * segment_s: the first deploy
    has one monitor window of history; its requests before that are not served (and not scored).
    """
    if not trace.requests:
        raise InvalidSpec("trace has no requests", field="trace")
    total = _check_rates(task_rates)
    off = segment_offset(trace, segment_s, seed, load)
    t0 = trace.requests[0].arrival_s + off
    seg = [r for r in trace.requests if t0 <= r.arrival_s < t0 + segment_s]
    if not seg:
        raise InvalidSpec(f"no request in the trace segment [{off:.0f}, {off + segment_s:.0f}) s", field="trace")
    seg_rate = len(seg) / segment_s
    scale = seg_rate / total  # replay s per trace s: the scaled mean rate is `total`
    w = MONITOR_WINDOW_TRACE_S
    deploy, scored, everything = _replay(seg, t0, scale, task_rates, f"flowmaker-assign/{trace.kind}/{load:g}/{seed}",
                                         w, DEPLOY_SPAN_FRACTION * segment_s, deploy_order)
    return SegmentWorkload(trace.kind, trace.source, load, off, segment_s, scale, segment_s * scale, deploy,
                           w * scale, scored, everything, len(seg), seg_rate,
                           shares=tuple((n, r / total) for n, r in task_rates))


def _peak_count_rate(times: Sequence[float], t0: float, t1: float, w: float) -> float:
    """Highest count / w over windows [a, a + w) inside [t0, t1], on a grid of w / 6."""
    best, a, lo, hi = 0.0, t0, 0, 0
    ts = sorted(times)
    while a + w <= t1 + 1e-9:
        while lo < len(ts) and ts[lo] < a:
            lo += 1
        while hi < len(ts) and ts[hi] < a + w:
            hi += 1
        best = max(best, (hi - lo) / w)
        a += w / 6
    return best


def request_segment_start(trace: Trace, n_requests: int, seed: int) -> int:
    """Index of the first request of the `n_requests`-request segment: seeded by trace kind and seed only (the
    same segment for every load level), with a stretch of as many requests before it (offline planning)."""
    if n_requests < 1:
        raise InvalidSpec(f"must be >= 1, got {n_requests}", field="segment_requests")
    if len(trace.requests) < 2 * n_requests + 1:
        raise InvalidSpec(f"the trace has {len(trace.requests)} requests; a segment of {n_requests} needs "
                          f"{2 * n_requests + 1} (a preceding stretch and the next arrival)", field="segment_requests")
    rng = random.Random(f"flowmaker-request-segment/{trace.kind}/{seed}")
    return rng.randint(n_requests, len(trace.requests) - n_requests - 1)


def build_request_segment_workload(task_rates: Sequence[tuple[str, float]], trace: Trace, load: float, seed: int,
                                   n_requests: int, deploy_span_fraction: float = DEPLOY_SPAN_FRACTION,
                                   window_fraction: float = 0.1,
                                   deploy_order: Sequence[str] | None = None) -> SegmentWorkload:
    """Replay ONE segment of `n_requests` consecutive trace requests per trace and seed, at one time scale
    per load level (the declared experiment's replay; see docs/evaluation.md).

    The segment (`request_segment_start`) is the same at every load; its trace seconds run from its first
    request to the request after its last, and one factor scales them so that its mean rate equals the sum
    of `task_rates`. Request i goes to a task drawn (seeded by trace, seed and i, not by load) in
    proportion to the rates, so every load level serves the same requests in the same order. The monitor
    window is `window_fraction` of the segment; task k (of n, in `deploy_order`) is deployed at
    W + k (span - W) / (n - 1), span = max(W, `deploy_span_fraction` x segment), in trace time. Offline
    rates: the `n_requests` before the segment, time-scaled the same way, split by the task shares.
    """
    total = _check_rates(task_rates)
    reqs = trace.requests
    i0 = request_segment_start(trace, n_requests, seed)
    t0 = reqs[i0].arrival_s
    seg_s = reqs[i0 + n_requests].arrival_s - t0
    pre_t0 = reqs[i0 - n_requests].arrival_s
    if not seg_s > 0 or not t0 > pre_t0:
        raise InvalidSpec(f"the segment at request {i0} spans no time", field="trace")
    seg_rate = n_requests / seg_s
    scale = seg_rate / total
    share = {n: r / total for n, r in task_rates}
    w = window_fraction * seg_s
    deploy, scored, everything = _replay(reqs[i0:i0 + n_requests], t0, scale, task_rates,
                                         f"flowmaker-assign/{trace.kind}/{seed}", w, deploy_span_fraction * seg_s,
                                         deploy_order)
    pre_total = n_requests / ((t0 - pre_t0) * scale)
    pre_peak = _peak_count_rate([q.arrival_s for q in reqs[i0 - n_requests:i0]], pre_t0, t0, w) / scale
    return SegmentWorkload(trace.kind, trace.source, load, t0 - reqs[0].arrival_s, seg_s, scale, seg_s * scale,
                           deploy, w * scale, scored, everything, n_requests, seg_rate,
                           offline_rates=tuple((nm, pre_total * x) for nm, x in share.items()),
                           offline_peak_rates=tuple((nm, pre_peak * x) for nm, x in share.items()),
                           history_s=tuple((q.arrival_s - t0) * scale for q in reqs[i0 - n_requests:i0]),
                           shares=tuple(share.items()))
