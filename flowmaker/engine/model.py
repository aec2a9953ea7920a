"""Deterministic performance model of one LLM engine instance with iteration-level continuous batching.

The same code drives the emulated engine (real time, `flowmaker.engine.server`) and the
trace-driven simulator (virtual time). It never reads a clock: time only moves when the
caller passes it in.

Timing model (all numbers from a `flowmaker.domain.Profile`):

* `fixed_s` is a per-request delay that does NOT occupy the engine (HTTP, tokenisation,
  scheduling overhead): a request submitted at `now` becomes *ready* at `now + fixed_s`.
  Keeping it out of the batch means one request's overhead never stalls the others.
* The engine runs steps (iterations). At every step boundary it admits ready requests in
  strict FIFO order while the batch has room (`max_batch`) and the KV budget allows
  (`kv_capacity_tokens`; a request reserves `in + out` tokens for its whole life, so
  nothing is ever preempted). The head of the queue blocks the ones behind it.
* A step in which `b` requests decode lasts `max(decode_s_per_token, b / D)` with `D` the
  profile's PURE-decode throughput (`Profile.pure_decode_tokens_per_s`), plus
  `prefill_s_per_token * in` for every request admitted at its start (prefill is not
  chunked: it stalls the whole batch, as in engines without chunked prefill). Each running
  request emits one token at the end of each step; a new request's first token comes at the
  end of its admission step (prefill + first decode).

  The `max(...)` is the roofline: decoding is memory-bound (a step costs one per-token
  latency) until the batch reaches `decode_s_per_token * D`, then compute-bound. Prefill is
  paid once, as stalls: `max_output_tokens_per_s` (which already includes the prefill of the
  reference request, 1024 in / 256 out) is NOT used to cap decode, so at the reference shape
  a saturated instance delivers `max_output_tokens_per_s`, with short prompts up to `D`.
  Per-call latency stays at the profile's value while the load stays under capacity, which
  is the assumption the selector makes (spec/selection.md, constraints 2 and 3); beyond it,
  every running request slows down together. Hence:
  - a lone request takes exactly `fixed_s + prefill_s_per_token*in + decode_s_per_token*out`;
  - with enough concurrent requests that only decode, the output rate is `D`; with requests
    of the reference shape, `max_output_tokens_per_s`.
* Speed (`set_speed`): the GPU time of every step (prefill and decode) is divided by a factor
  in (0, 1] (1 = alone on its GPUs). A simulator that co-locates instances changes it at event
  boundaries; the step in progress is stretched from that moment on, not retroactively.
  `fixed_s` is not GPU time and is never slowed.
* `out_tokens >= 1` (as in vLLM, `max_tokens` must be at least 1).

Interface for a discrete-event simulator: `submit()` requests, ask `next_event_time()` (void
after any `submit()`; ask again), `advance(t)` to it, collect the returned completions.
Steps with an unchanged batch are processed in bulk, so the cost is O(admissions + completions),
not O(tokens). For streaming, `next_step_time()` gives the next token boundary and
`emitted(req_id)` how many tokens a running request has produced so far.

A decision at a step boundary `t` is only taken once time has moved strictly past `t`
(`advance(to)` with `to > t`), so a request submitted at exactly `t` with `fixed_s == 0`
can still join that step, whatever order the caller uses.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from flowmaker.domain import Profile


class Completion(NamedTuple):
    """A finished request: when its last token and its first token came out."""

    req_id: str
    finish_time: float
    first_token_time: float


@dataclass(slots=True)
class _Req:
    req_id: str
    in_tokens: int
    out_tokens: int
    submit_time: float
    ready_time: float
    emitted: int = 0
    first_token_time: float = math.nan

    @property
    def remaining(self) -> int:
        return self.out_tokens - self.emitted

    @property
    def kv_tokens(self) -> int:
        return self.in_tokens + self.out_tokens


@dataclass(slots=True)
class _Run:
    """`k` consecutive steps with the same batch: step j (1-based) ends at first_end + (j-1)*dur."""

    first_end: float
    dur: float
    k: int

    @property
    def end(self) -> float:
        return self.first_end + (self.k - 1) * self.dur


@dataclass(frozen=True, slots=True)
class _Plan:
    admit: int  # how many waiting requests (from the head) join at the start
    run: _Run


class EngineModel:
    """One engine instance. See the module docstring for the timing model."""

    def __init__(self, profile: Profile, max_batch: int = 256, kv_capacity_tokens: int | None = None) -> None:
        profile.validate()
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        if kv_capacity_tokens is not None and kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens: must be >= 1 or None, got {kv_capacity_tokens}")
        self.profile = profile
        self.max_batch = max_batch
        self.kv_capacity_tokens = kv_capacity_tokens
        self._waiting: deque[_Req] = deque()
        self._running: dict[str, _Req] = {}
        self._ids: set[str] = set()  # every id submitted and not yet completed
        self._run: _Run | None = None  # steps decided and in progress
        self._t = 0.0  # last processed step boundary (or when the engine went idle)
        self._clock = 0.0  # latest time seen by submit/advance; time never goes back
        self._kv_in_use = 0
        self._speed = 1.0  # GPU share: every step's GPU time is divided by it (set_speed)
        self.busy_s = 0.0  # engine seconds with a non-empty batch (steps processed), at whatever speed
        # counters (monotone)
        self.submitted = 0
        self.completed = 0
        self.tokens_submitted = 0  # output tokens asked for
        self.tokens_emitted = 0  # output tokens produced
        self.prompt_tokens_processed = 0  # prompt tokens prefilled (at admission)
        self.steps = 0
        self.cancelled = 0  # requests dropped before completion (client gone)

    # ---- observation -------------------------------------------------------------------

    @property
    def now(self) -> float:
        """The latest time passed to `submit` or `advance`."""
        return self._clock

    @property
    def waiting(self) -> int:
        """Requests queued (including those still in their `fixed_s` delay)."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests in the batch."""
        return len(self._running)

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + len(self._running)

    @property
    def kv_tokens_in_use(self) -> int:
        return self._kv_in_use

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV budget reserved (of `max_batch` slots when no KV budget is set)."""
        if self.kv_capacity_tokens:
            return self._kv_in_use / self.kv_capacity_tokens
        return len(self._running) / self.max_batch

    @property
    def outstanding_output_tokens(self) -> int:
        """Output tokens still to produce by the requests queued or running."""
        return sum(r.out_tokens for r in self._waiting) + sum(r.remaining for r in self._running.values())

    @property
    def outstanding_prompt_tokens(self) -> int:
        """Prompt tokens still to prefill (queued requests)."""
        return sum(r.in_tokens for r in self._waiting)

    def emitted(self, req_id: str) -> int:
        """Output tokens a request has produced so far (0 while queued)."""
        r = self._running.get(req_id)
        return r.emitted if r is not None else 0

    @property
    def speed(self) -> float:
        return self._speed

    def step_duration(self, batch: int) -> float:
        """Length of a decode step with `batch` requests at full speed (prefill of new requests not included)."""
        p = self.profile
        return max(p.decode_s_per_token, batch / p.pure_decode_tokens_per_s)

    def set_speed(self, speed: float, now: float) -> list[Completion]:
        """From `now` on, run at `speed` (0 < speed <= 1) of the profile's GPU speed.

        Steps ending at or before `now` are processed first (their completions are returned); the step
        in progress keeps what it has done and its remaining GPU time is stretched (or shrunk) by
        old/new speed, as are the steps after it."""
        if not (0.0 < speed <= 1.0) or not math.isfinite(speed):
            raise ValueError(f"speed: must be in (0, 1], got {speed}")
        done = self.advance(now)
        if speed == self._speed:
            return done
        ratio = self._speed / speed
        self._speed = speed
        run = self._run
        if run is not None:
            run.first_end = now + (run.first_end - now) * ratio
            run.dur *= ratio
            if self._waiting:  # the queue head may now join at a different boundary
                head = self._waiting[0]
                if self._fits(head, len(self._running), self._kv_in_use):
                    run.k = min(run.k, self._steps_until(run.first_end, run.dur, head.ready_time))
        return done

    # ---- input -------------------------------------------------------------------------

    def submit(self, req_id: str, in_tokens: int, out_tokens: int, now: float) -> None:
        """Queue a request arriving at `now` (>= every time passed before)."""
        if req_id in self._ids:
            raise ValueError(f"req_id: {req_id!r} is already in flight")
        if in_tokens < 0:
            raise ValueError(f"in_tokens: must be >= 0, got {in_tokens}")
        if out_tokens < 1:
            raise ValueError(f"out_tokens: must be >= 1, got {out_tokens}")
        if self.kv_capacity_tokens is not None and in_tokens + out_tokens > self.kv_capacity_tokens:
            raise ValueError(f"in_tokens: prompt+output {in_tokens + out_tokens} tokens exceed the KV capacity "
                             f"{self.kv_capacity_tokens}")
        if now < self._clock:
            raise ValueError(f"now: {now} is before the model's time {self._clock}")
        self._clock = now
        req = _Req(req_id, in_tokens, out_tokens, now, now + self.profile.fixed_s)
        was_empty = not self._waiting
        self._waiting.append(req)
        self._ids.add(req_id)
        self.submitted += 1
        self.tokens_submitted += out_tokens
        # A run was planned to last until a completion or the queue head's admission; a new
        # head may need an earlier boundary. (A new tail never does: FIFO admission.)
        if was_empty and self._run is not None and self._fits(req, len(self._running), self._kv_in_use):
            j = self._steps_until(self._run.first_end, self._run.dur, req.ready_time)
            self._run.k = min(self._run.k, j)

    def cancel(self, req_id: str, now: float) -> bool:
        """Drop a request (its client went away) at `now`: from the queue, or from the batch, whose KV it
        frees. A batch change restarts the step in progress at `now` with the new batch (the conservative
        choice: the partial step's progress is not credited). False when it is not in flight."""
        if req_id not in self._ids:
            return False
        self.advance(max(now, self._clock))
        for r in self._waiting:
            if r.req_id == req_id:
                self._waiting.remove(r)
                break
        else:
            r2 = self._running.pop(req_id, None)
            if r2 is None:  # completed by the advance above
                return False
            self._kv_in_use -= r2.kv_tokens
            self._run = None
            self._t = max(self._t, self._clock)
        self._ids.discard(req_id)
        self.cancelled += 1
        return True

    # ---- time --------------------------------------------------------------------------

    def advance(self, to_time: float) -> list[Completion]:
        """Process every step that ends at or before `to_time`; return the completed requests."""
        if to_time < self._clock:
            raise ValueError(f"to_time: {to_time} is before the model's time {self._clock}")
        self._clock = to_time
        done: list[Completion] = []
        while True:
            if self._run is None:
                start = self._next_start()
                if start is None or start >= to_time:
                    break  # idle, or the decision at `start` waits until time moves past it
                self._commit(start, self._plan(start))
            run = self._run
            assert run is not None
            if run.first_end > to_time:
                break
            n = min(run.k, 1 + int((to_time - run.first_end) // run.dur))
            while n > 1 and run.first_end + (n - 1) * run.dur > to_time:  # float guard
                n -= 1
            boundary = run.first_end + (n - 1) * run.dur
            self.busy_s += boundary - self._t
            self._emit(n, run.first_end, run.dur)
            self._t = boundary
            if n == run.k:
                self._run = None
                done.extend(self._finish(boundary))
            else:
                run.first_end = boundary + run.dur
                run.k -= n
        return done

    def next_event_time(self) -> float | None:
        """When the batch next changes (a completion or an admission) if nothing more is submitted;
        None when no request is in flight. Always > the last processed boundary, so advancing to it
        makes progress."""
        if self._run is not None:
            return self._run.end
        start = self._next_start()
        if start is None:
            return None
        return self._plan(start).run.end

    def next_step_time(self) -> float | None:
        """When the next token(s) come out (end of the current or next step); None when idle."""
        if self._run is not None:
            return self._run.first_end
        start = self._next_start()
        if start is None:
            return None
        return self._plan(start).run.first_end

    # ---- internals ---------------------------------------------------------------------

    def _fits(self, req: _Req, batch: int, kv: int) -> bool:
        if batch >= self.max_batch:
            return False
        return self.kv_capacity_tokens is None or kv + req.kv_tokens <= self.kv_capacity_tokens

    @staticmethod
    def _steps_until(first_end: float, dur: float, t: float) -> int:
        """Smallest j >= 1 with first_end + (j-1)*dur >= t: the boundary at which a request ready at t can join."""
        if t <= first_end:
            return 1
        j = 1 + math.ceil((t - first_end) / dur)
        while j > 1 and first_end + (j - 2) * dur >= t:
            j -= 1
        while first_end + (j - 1) * dur < t:
            j += 1
        return j

    def _next_start(self) -> float | None:
        if self._running:
            return self._t
        if self._waiting:
            return max(self._t, self._waiting[0].ready_time)
        return None

    def _plan(self, start: float) -> _Plan:
        """What the engine does at boundary `start`: who joins, and how many identical steps follow."""
        batch, kv, admit, prefill = len(self._running), self._kv_in_use, 0, 0.0
        for req in self._waiting:
            if req.ready_time > start or not self._fits(req, batch, kv):
                break
            admit += 1
            batch += 1
            kv += req.kv_tokens
            prefill += self.profile.prefill_s_per_token * req.in_tokens / self._speed
        assert batch > 0
        dur = self.step_duration(batch) / self._speed
        first_end = start + prefill + dur
        k = min([r.remaining for r in self._running.values()]
                + [self._waiting[i].out_tokens for i in range(admit)])
        if admit < len(self._waiting):
            head = self._waiting[admit]
            if self._fits(head, batch, kv):  # else blocked until a completion frees room
                k = min(k, self._steps_until(first_end, dur, head.ready_time))
        return _Plan(admit, _Run(first_end, dur, k))

    def _commit(self, start: float, plan: _Plan) -> None:
        for _ in range(plan.admit):
            req = self._waiting.popleft()
            self._running[req.req_id] = req
            self._kv_in_use += req.kv_tokens
            self.prompt_tokens_processed += req.in_tokens
        self._t = start
        self._run = plan.run

    def _emit(self, n: int, first_end: float, dur: float) -> None:
        for r in self._running.values():
            if r.emitted == 0:
                r.first_token_time = first_end
            r.emitted += n
        self.tokens_emitted += n * len(self._running)
        self.steps += n

    def _finish(self, t: float) -> list[Completion]:
        out: list[Completion] = []
        for rid in [rid for rid, r in self._running.items() if r.remaining == 0]:
            r = self._running.pop(rid)
            self._kv_in_use -= r.kv_tokens
            self._ids.discard(rid)
            self.completed += 1
            out.append(Completion(rid, t, r.first_token_time))
        return out
