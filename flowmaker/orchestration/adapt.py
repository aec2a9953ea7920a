"""Following the load: per-task observed arrival rate and latency, and when a task must be re-selected. Pure.

A task is selected once for its declared rate. The orchestrator meters what it really gets (`ArrivalMeter`:
arrivals and latencies over a sliding window, per task) and `drifted()` says which ACTIVE tasks left their
plan for longer than the hold-down time:
- the observed rate is above `band` x the planned rate (scale up: a bigger configuration, another model or
  workflow, or instances of its own instead of shared ones), or below planned / `band` (scale back in);
- or the observed p95 latency breaks the latency SLO (ask for `band` x more than it gets now);
- or the task's predicted latency, re-derived on the current placement whenever that changes
  (flowmaker.orchestration.predict: later co-residents slow it), exceeds its latency SLO (re-select at the rate
  it needs now).

Bursts are metered, not only the mean: requests that arrive within one latency SLO must be served within about
one SLO, so a task needs capacity for its densest SLO-long window, as the evaluation's policies plan it
(flowmaker.eval.policies `plan_rates`). The meter measures that window's rate over its window (`TaskLoad.burst_rps`,
exact: `peak_window_count`), and the follower plans for `demand()` = the mean rate, or the burst rate when higher,
at most `burst_cap` x the mean (a few requests in one short window are not a regime). Both the scale-out and
scale-in bands compare that demand with the planned rate, so a plan sized for bursts is not scaled back in by its
own mean; scaling in waits `scale_in_factor` x the hold-down and never plans below the highest demand seen while
it waited (the last burst's need) nor below the declared rate.
The re-selection itself (make-before-break) is the orchestrator's `reselect_for_load`. Rates and latencies
are in MODEL time (the unit of the SLO and the profiles): wall values are scaled by `time_scale`, the model
seconds per wall second of the engines (1 on real GPUs).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from flowmaker.orchestration.task import TaskRecord, TaskState


@dataclass(frozen=True, slots=True)
class LoadPolicy:
    band: float = 2.0  # re-select when observed > band x planned or < planned / band
    hold_down_s: float = 30.0  # ... for this long (wall), and at most once per this long
    # Scaling in keeps headroom (a burst after a lull must not find the capacity gone): the rate planned for is
    # `scale_in_headroom` x what is observed, never below the rate the task declared (`floor_at_declared`: what
    # scaling in gives back is what a burst's scale-out added); and it waits longer than scaling out,
    # `scale_in_factor` x the hold-down (hysteresis: a quiet minute does not undo a burst's scale-out).
    scale_in_factor: float = 2.0
    scale_in_headroom: float = 1.5
    floor_at_declared: bool = True
    min_rate_rps: float = 0.01  # the smallest rate a task is planned for (model req/s)
    # The burst-aware rate planned for is at most this many times the mean rate (`demand`).
    burst_cap: float = 3.0
    min_samples: int = 10  # latency quantiles need this many requests in the window
    latency_quantile: float = 0.95
    # A prediction past the SLO is acted on once: again only when it is re-derived after that re-selection (the
    # placement moved), or after this many hold-downs (the rest of the cluster may have made room meanwhile).
    # The selector's feasibility model is more conservative than the prediction's, so a re-selection that keeps
    # the variant would otherwise repeat every hold-down with the same answer.
    prediction_retry_factor: float = 10.0


@dataclass(frozen=True, slots=True)
class TaskLoad:
    rate_rps: float  # model-time requests/s over the window
    latency_q_s: float  # the policy's latency quantile, model seconds (0 without enough samples)
    samples: int
    # Model-time requests/s in the densest window one latency SLO long within the window (0: not metered).
    burst_rps: float = 0.0


def peak_window_count(times: Sequence[float], w: float) -> int:
    """The most of `times` inside any window [t, t + w) (exact: a densest window starts at one of them)."""
    ts = sorted(times)
    best, hi = 0, 0
    for lo, t in enumerate(ts):
        hi = max(hi, lo)
        while hi < len(ts) and ts[hi] < t + w:
            hi += 1
        best = max(best, hi - lo)
    return best


def demand(ld: TaskLoad, p: LoadPolicy) -> float:
    """The rate a task needs capacity for: its mean rate, or its densest SLO-long window's when higher, at most
    `p.burst_cap` x the mean."""
    return max(ld.rate_rps, min(ld.burst_rps, p.burst_cap * ld.rate_rps))


@dataclass
class ArrivalMeter:
    """Arrivals, completed-request latencies and requests still waiting, per task, over the last `window_s` wall
    seconds.

    A request still waiting counts in the latency quantiles with its age so far (a lower bound of its latency)
    once that age exceeds the median of the completed ones: a hung instance completes nothing, and a window of
    completed requests alone would go on saying all is well. Younger waiting requests are left out, since
    counting them would pull the quantiles down."""

    window_s: float = 30.0
    _arrivals: dict[str, deque[float]] = field(default_factory=dict)
    _latencies: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _first: dict[str, float] = field(default_factory=dict)
    _waiting: dict[str, dict[int, float]] = field(default_factory=dict)  # task -> token -> arrival time
    _burst_w: dict[str, float] = field(default_factory=dict)  # task -> its burst window (wall s)
    _next: int = 0

    def arrived(self, task_id: str, now: float, burst_window_s: float = 0.0) -> int:
        """Record an arrival; the token returned ends its wait (`finished` or `abandoned`). `burst_window_s`
        (wall seconds; the task's latency SLO / time_scale) is the window its burst rate is metered over (0: none)."""
        self._first.setdefault(task_id, now)
        if burst_window_s > 0:
            self._burst_w[task_id] = burst_window_s
        q = self._arrivals.setdefault(task_id, deque())
        q.append(now)
        self._trim(q, now)
        self._next += 1
        self._waiting.setdefault(task_id, {})[self._next] = now
        return self._next

    def finished(self, task_id: str, now: float, latency_s: float, token: int = 0) -> None:
        """A request completed; `token` (from `arrived`) names it, 0 = the oldest still waiting."""
        w = self._waiting.get(task_id)
        if token == 0 and w:
            token = min(w, key=w.__getitem__)
        self.abandoned(task_id, token)
        q = self._latencies.setdefault(task_id, deque())
        q.append((now, latency_s))
        while q and q[0][0] < now - self.window_s:
            q.popleft()

    def abandoned(self, task_id: str, token: int) -> None:
        """The request ended without a latency to count (it failed, or was refused)."""
        w = self._waiting.get(task_id)
        if w is not None:
            w.pop(token, None)

    def waiting_ages(self, task_id: str, now: float) -> list[float]:
        """Wall seconds each request of the task still waiting has waited so far."""
        return [now - t for t in self._waiting.get(task_id, {}).values()]

    def _trim(self, q: deque[float], now: float) -> None:
        while q and q[0] < now - self.window_s:
            q.popleft()

    def tasks(self) -> list[str]:
        """The tasks metered (seen at least once, not forgotten)."""
        return list(self._first)

    def forget(self, task_id: str) -> None:
        for d in (self._arrivals, self._latencies, self._first, self._waiting, self._burst_w):
            d.pop(task_id, None)  # type: ignore[attr-defined]

    def overdue(self, task_id: str, now: float, completed: list[float]) -> list[float]:
        """The ages of the task's waiting requests that count beside the `completed` latencies: those older than
        the completed ones' median (see the class docstring)."""
        done = sorted(completed)
        floor = done[(len(done) - 1) // 2] if done else 0.0
        return [a for a in self.waiting_ages(task_id, now) if a > floor]

    def latencies(self, task_id: str, now: float) -> list[float]:
        """Wall latencies of the window, sorted: the completed requests, plus the overdue waiting ones."""
        done = [x for t, x in self._latencies.get(task_id, ()) if t >= now - self.window_s]
        return sorted(done + self.overdue(task_id, now, done))

    def load(self, task_id: str, now: float, time_scale: float = 1.0, quantile: float = 0.95) -> TaskLoad | None:
        """None until the task has been watched for a third of the window (a rate over a few seconds is noise)."""
        first = self._first.get(task_id)
        if first is None or now - first < self.window_s / 3:
            return None
        q = self._arrivals.get(task_id, deque())
        self._trim(q, now)
        span = min(self.window_s, now - first)
        lat = self.latencies(task_id, now)
        lq = lat[min(len(lat) - 1, max(0, math.ceil(quantile * len(lat)) - 1))] * time_scale if lat else 0.0
        w = self._burst_w.get(task_id, 0.0)
        burst = peak_window_count(q, w) / w / time_scale if w > 0 else 0.0
        return TaskLoad(len(q) / span / time_scale, lq, len(lat), burst)


def combined(loads: list[TaskLoad]) -> TaskLoad | None:
    """The load of a task served by several orchestrator replicas, each metering its own requests: rates and
    samples add up; the latency quantile is the worst replica's (a bound, not the exact quantile of the union); the
    burst rates add up too (a bound: the replicas' densest windows need not coincide)."""
    if not loads:
        return None
    return TaskLoad(sum(x.rate_rps for x in loads), max(x.latency_q_s for x in loads), sum(x.samples for x in loads),
                    sum(x.burst_rps for x in loads))


def drifted(tasks: dict[str, TaskRecord], loads: dict[str, TaskLoad], since: dict[str, float], now: float,
            p: LoadPolicy, *, peaks: dict[str, float] | None = None) -> list[tuple[str, float, str]]:
    """(task id, rate to plan for, why) for each ACTIVE task whose load has left its plan for `hold_down_s`.
    `since` (task id -> when the drift was first seen) is the caller's memory across calls, and `peaks` (task
    id -> the highest `demand` seen since then: what scaling in may not plan below; None: not kept); updated."""
    peaks = {} if peaks is None else peaks
    out = []
    for tid, t in sorted(tasks.items()):
        ld = loads.get(tid)
        last = t.last_reselection.at if t.last_reselection else 0.0
        # The prediction counts when it is newer than the last re-selection, or that one is long past.
        mispredicted = t.predicted_latency_s > t.slo.max_latency_s * (1 + 1e-9) and (
            t.last_reselection is None or t.predicted_at > last
            or now - last >= p.hold_down_s * p.prediction_retry_factor)
        if t.state is not TaskState.ACTIVE or t.healing is not None or t.next_variant is not None or (
                ld is None and not mispredicted):
            since.pop(tid, None)
            peaks.pop(tid, None)
            continue
        planned = max(t.plan_rate_rps, p.min_rate_rps)
        need = demand(ld, p) if ld is not None else 0.0
        burst = f" (bursts need {need:.3g})" if ld is not None and need > ld.rate_rps else ""
        target, why, hold = 0.0, "", p.hold_down_s
        # The rate first: planning for what arrives is the fix for most latency trouble too.
        if ld is not None and need > planned * p.band:
            target, why = need, f"observed {ld.rate_rps:.3g} req/s{burst} > {p.band:g} x planned {planned:.3g}"
        elif ld is not None and need < planned / p.band and planned > (floor := max(
                p.min_rate_rps, t.slo.arrival_rate_rps if p.floor_at_declared else 0.0)):
            # Hysteresis: never below the highest demand seen while the drift lasted (the last burst's need).
            peak = peaks[tid] = max(peaks.get(tid, 0.0), need)
            target = max(need * p.scale_in_headroom, peak, floor)
            why = f"observed {ld.rate_rps:.3g} req/s{burst} < planned {planned:.3g} / {p.band:g}"
            hold = p.hold_down_s * p.scale_in_factor
        elif ld is not None and ld.samples >= p.min_samples and ld.latency_q_s > t.slo.max_latency_s:
            # The rate is as planned, yet too slow (the plan's capacity model was optimistic, or the
            # instances are shared with tasks above their plans): ask for `band` x more capacity.
            target = max(need, planned) * p.band
            why = (f"p{round(p.latency_quantile * 100)} latency {ld.latency_q_s:.3g}s breaks the SLO "
                   f"{t.slo.max_latency_s:g}s at {ld.rate_rps:.3g} req/s")
        elif mispredicted:
            # Co-residents deployed since its selection slow it past its SLO on paper: a variant that fits the
            # placement as it is now, at the rate it needs.
            target = max(need, planned)
            why = (f"predicted latency {t.predicted_latency_s:.3g}s on the current placement exceeds the SLO "
                   f"{t.slo.max_latency_s:g}s")
        if not why:
            since.pop(tid, None)
            peaks.pop(tid, None)
            continue
        first = since.setdefault(tid, now)
        if now - first >= hold and now - last >= p.hold_down_s:
            out.append((tid, target, f"{why} for {now - first:.0f}s"))
            since.pop(tid, None)
            peaks.pop(tid, None)
    return out
