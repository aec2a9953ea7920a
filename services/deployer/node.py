"""The node agent: registers this node and its GPUs in etcd under a lease, and owns its instances' lifecycle.

Every state change is an etcd transaction guarded by the mod_revisions it read:
- Deploy reserves GPU memory (placement: LeaseLoaded on this node, `flowmaker.selection.placement`)
  and records the instance in ONE txn that re-checks every GPU key it chose, then starts the engine;
  on any failure the memory is given back and the instance marked FAILED with the reason;
- an engine exiting on its own -> FAILED, memory given back (crash watcher of the backend);
- Release drops a task's reference (`keys.reuse`) and, when none is left, DRAINING -> stop the
  engine -> give the memory back and delete the instance;
- every `load_scrape_interval_s` each READY engine's /metrics is scraped and its output-token rate
  (model seconds, EWMA-smoothed, plus the recent peak: `LoadMeter`), its saturation (`SaturationMeter`) and
  its busy share (`BusyMeter`) written into its record by a CAS that only touches the observed fields of a
  record still READY (docs/state.md "Load").
The node key is bound to the lease, so when this agent dies its node (and with it its GPUs and
instances, for every reader using `read_cluster`) drops out of the live cluster after the TTL. Engines get
PR_SET_PDEATHSIG=SIGKILL, so they never outlive this agent; a restarted agent stops whatever a previous
life left and marks it FAILED, for the orchestrator's reconciler to restart in place.

Every `resync_interval_s` the agent also reconciles its own records with its processes (`resync`): a
STARTING/READY/LOST record with no engine of ours -> FAILED (memory given back); an engine whose record is
gone, FAILED or LOST -> stopped; GPU accounting that drifted from the instances holding memory -> rewritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from flowmaker.cancel import wait_for
from flowmaker.domain import Profile, ProfileSource
from flowmaker.engine.gpu_share import make_share_dir
from flowmaker.errors import (
    AlreadyExists,
    Conflict,
    FailedPrecondition,
    FlowMakerError,
    InvalidSpec,
    NoCapacity,
    NotFound,
    Unavailable,
)
from flowmaker.launcher import procs
from flowmaker.orchestration.cluster import profile_from_record
from flowmaker.profiling.measure import metric_value
from flowmaker.selection.placement import NodeGpus, place_least_loaded
from flowmaker.state import keys
from flowmaker.state.records import (
    MEMORY_DIGITS,
    GpuRecord,
    InstanceRecord,
    InstanceState,
    NodeRecord,
    new_instance_id,
    reuse_load,
    reuse_value,
)
from flowmaker.state.store import Compare, KeyValue, LeaseKeeper, Put, StateStore
from services.deployer.backends import EngineBackend, EngineProcess, EngineSpec, get_backend
from services.deployer.backends.base import engine_base_env, engine_log_path
from services.deployer.settings import DeployerSettings, GpuInfo, gpu_id, gpu_inventory

log = logging.getLogger(__name__)

# Waiting for a previous agent's node key (same node name) to expire, as a multiple of the TTL.
_STALE_NODE_WAIT_TTLS = 1.5


# An observed-load change smaller than this (output tokens/s) is never worth a write: noise.
_MIN_REPORT_CHANGE_TOK_S = 1.0


class LoadMeter:
    """Turns successive readings of an engine's generation-token counter into an output-token rate.

    The rate is in MODEL seconds, the unit of `Profile.max_output_tokens_per_s`: tokens per wall second
    divided by `time_scale`, the engine's model seconds per wall second (the emulated engine's
    `--time-scale`; 1 for real engines, whose model clock is the wall clock). Each reading after the
    first gives one interval rate; the smoothed rate is an EWMA whose weight follows the interval's
    length, alpha = 1 - 2^(-dt / half_life), so a missed scrape (a longer interval) counts for as much
    wall time as it covers and a step in traffic shows half after `half_life_s` whatever the cadence.
    `peak` is the highest interval rate over the last `peak_window_s`. Pure: time is passed in."""

    def __init__(self, time_scale: float = 1.0, half_life_s: float = 5.0, peak_window_s: float = 60.0) -> None:
        if not time_scale > 0:
            raise InvalidSpec(f"must be > 0, got {time_scale}", field="time_scale")
        self.time_scale = time_scale
        self.half_life_s = half_life_s
        self.peak_window_s = peak_window_s
        self.rate: float | None = None  # the EWMA; None until two readings
        self._last: tuple[float, float] | None = None  # (wall time, counter)
        self._rates: deque[tuple[float, float]] = deque()  # (wall time, interval rate) within the window
        # What was last written to the record: (value, wall time); None = nothing yet.
        self.reported: tuple[float, float] | None = None

    def add(self, t: float, tokens_total: float) -> float | None:
        """Record a counter reading at wall time `t`; return the smoothed rate (None: not yet known)."""
        last, self._last = self._last, (t, tokens_total)
        if last is None or t <= last[0]:
            return self.rate
        dt = t - last[0]
        if tokens_total < last[1]:  # the counter went back: a restarted engine; start over from here
            return self.rate
        r = (tokens_total - last[1]) / dt / self.time_scale
        alpha = 1.0 - math.pow(2.0, -dt / self.half_life_s)
        self.rate = r if self.rate is None else self.rate + alpha * (r - self.rate)
        self._rates.append((t, r))
        while self._rates and self._rates[0][0] < t - self.peak_window_s:
            self._rates.popleft()
        return self.rate

    @property
    def peak(self) -> float:
        return max((r for _, r in self._rates), default=0.0)

    def should_report(self, now: float, min_change: float, max_interval_s: float) -> bool:
        """Whether the record needs rewriting: the rate moved by more than `min_change` (a fraction, and
        at least 1 tok/s) since the last write, or a non-zero value is about to go stale (last written
        `max_interval_s` ago). A zero needs no refresh: stale or fresh, max(planned, 0) is the plan. Writes
        are kept rare on purpose: each one moves the instance's etag, which aborts a selection commit
        reusing this instance that read it before."""
        if self.rate is None:
            return False
        if self.reported is None:
            return True
        value, at = self.reported
        if abs(self.rate - value) > max(_MIN_REPORT_CHANGE_TOK_S, min_change * max(value, self.rate)):
            return True
        return value > 0 and now - at >= max_interval_s


class SaturationMeter:
    """Whether an instance is full, from successive /metrics readings, whatever its throughput says.

    Throughput alone can never show overload (it cannot exceed capacity): a continuous-batching engine past
    its capacity queues requests (vLLM's `num_requests_waiting`) and stretches every step, so latency grows
    instead. Two signals, each over the interval between two scrapes:
    - queue: EWMA of the waiting requests (weight by interval length, half-life `half_life_s`);
    - slowdown: the mean end-to-end latency of the requests that finished in the interval (the engine's own
      histogram, model seconds) over what a lone request of their mean size takes on this profile
      (fixed + prefill x mean prompt + decode x mean output).
    Saturated when queue >= `max_queue` or slowdown >= `max_slowdown`. Pure: time and readings passed in."""

    def __init__(self, profile: Profile, *, max_queue: float, max_slowdown: float, half_life_s: float = 5.0) -> None:
        self.profile = profile
        self.max_queue = max_queue
        self.max_slowdown = max_slowdown
        self.half_life_s = half_life_s
        self.queue = 0.0
        self.latency_s = 0.0
        self.slowdown = 0.0
        self._last: tuple[float, dict[str, float]] | None = None
        self.reported: bool | None = None  # `saturated` as last written

    def add(self, t: float, m: dict[str, float]) -> bool:
        last, self._last = self._last, (t, m)
        waiting = m.get("waiting", 0.0)
        if last is None or t <= last[0]:
            return self.saturated  # one reading is no interval: a burst just admitted is not a queue yet
        alpha = 1.0 - math.pow(2.0, -(t - last[0]) / self.half_life_s)
        self.queue += alpha * (waiting - self.queue)
        prev = last[1]
        n = m.get("e2e_latency_count", 0.0) - prev.get("e2e_latency_count", 0.0)
        if n > 0:
            lat = (m.get("e2e_latency_sum_s", 0.0) - prev.get("e2e_latency_sum_s", 0.0)) / n
            gen = max(0.0, m.get("generation_tokens_total", 0.0) - prev.get("generation_tokens_total", 0.0)) / n
            prompt = max(0.0, m.get("prompt_tokens_total", 0.0) - prev.get("prompt_tokens_total", 0.0)) / n
            p = self.profile
            lone = p.fixed_s + p.prefill_s_per_token * prompt + p.decode_s_per_token * max(1.0, gen)
            self.latency_s = max(0.0, lat)
            self.slowdown = self.latency_s / lone if lone > 0 else 0.0
        elif m.get("running", 0.0) + waiting == 0:
            self.slowdown = 0.0  # idle: nothing is slowed down
        return self.saturated

    @property
    def saturated(self) -> bool:
        return self.queue >= self.max_queue or self.slowdown >= self.max_slowdown


# The emulated engine's busy-time counter (model seconds with a non-empty batch, at whatever speed its GPU share
# lets it run): the sample name in its /metrics, and the key `_scrape` adds it under.
BUSY_SECONDS_SAMPLE = "flowmaker_engine_busy_seconds_total"
BUSY_SECONDS_KEY = "busy_seconds_total"
# A busy-share change smaller than this (absolute) is not worth a write on its own.
_MIN_REPORT_CHANGE_BUSY = 0.1


class BusyMeter:
    """An engine's busy share (`flowmaker.sharing`): the fraction of the time it has a call in flight, from
    successive /metrics readings.

    Best source first:
    - the emulated engine's busy-time counter (`BUSY_SECONDS_SAMPLE`, model seconds with a non-empty batch): each
      interval's share is its increase over the interval's MODEL seconds (wall seconds x `time_scale`), clamped
      to [0, 1]; a counter that went back (a restarted engine) starts over;
    - else the running-requests gauge (vLLM's `vllm:num_requests_running`): each scrape is one sample, 1 when
      it found calls running, else 0, so the share is the fraction of scrapes that found it busy;
    - else unknown: `share` stays None (recorded as 0, which readers take as unknown).
    Either is smoothed like the load (`LoadMeter`): an EWMA whose weight follows the interval's length,
    alpha = 1 - 2^(-dt / half_life). Pure: time is passed in."""

    def __init__(self, time_scale: float = 1.0, half_life_s: float = 5.0) -> None:
        if not time_scale > 0:
            raise InvalidSpec(f"must be > 0, got {time_scale}", field="time_scale")
        self.time_scale = time_scale
        self.half_life_s = half_life_s
        self.share: float | None = None
        self._counter: tuple[float, float] | None = None  # (wall time, busy seconds) of the last counter reading
        self._sampled_at: float | None = None  # wall time of the last gauge sample
        self.reported: tuple[float, float] | None = None  # (value, wall time) last written; None = nothing yet

    def add(self, t: float, busy_seconds_total: float | None, running: float | None) -> float | None:
        """Record the readings of one scrape at wall time `t`; return the smoothed share (None: unknown)."""
        if busy_seconds_total is not None:
            last, self._counter = self._counter, (t, busy_seconds_total)
            if last is None or t <= last[0] or busy_seconds_total < last[1]:
                return self.share
            dt = t - last[0]
            x = min(1.0, max(0.0, (busy_seconds_total - last[1]) / (dt * self.time_scale)))
        elif running is not None:
            last_t, self._sampled_at = self._sampled_at, t
            x = 1.0 if running > 0 else 0.0
            if last_t is None or self.share is None:
                self.share = x
                return self.share
            if t <= last_t:
                return self.share
            dt = t - last_t
        else:
            return self.share
        alpha = 1.0 - math.pow(2.0, -dt / self.half_life_s)
        self.share = x if self.share is None else self.share + alpha * (x - self.share)
        return self.share

    def should_report(self, now: float, min_change: float, max_interval_s: float) -> bool:
        """Whether the record needs rewriting for the share alone: it moved by more than `min_change` (absolute)
        since the last write, or a non-zero value is about to go stale (readers judge it by the observed-load
        timestamp it is written with)."""
        if self.share is None:
            return False
        if self.reported is None:
            return True
        value, at = self.reported
        return abs(self.share - value) > min_change or (value > 0 and now - at >= max_interval_s)


def _back_from_lost(r: InstanceRecord, endpoint: str) -> InstanceRecord | None:
    return replace(r, state=InstanceState.READY, reason="", failure_reason="", endpoint=endpoint,
                   unresponsive_since=0.0) if r.state is InstanceState.LOST else None


class LivenessMeter:
    """Whether a READY engine is alive, from two signals. Pure: time (monotonic seconds) is passed in.

    - Its probe: GET /health with a timeout. `failures` probes in a row that got no 200 in time make it hung
      (a SIGSTOPped or wedged process still accepts connections, so only a timeout shows it).
    - Its progress: requests in flight (the `running` gauge) while its token counter stands still for
      `stall_s` make it hung too, even when /health answers (an API server whose inference loop is stuck).
    `unresponsive_since` is when the current run of failed probes began (None: it answers)."""

    def __init__(self, failures: int = 3, stall_s: float = 60.0) -> None:
        self.failures = failures
        self.stall_s = stall_s
        self.failed = 0  # probes in a row without a 200
        self.unresponsive_since: float | None = None
        self.last_error = ""
        self._tokens: float | None = None
        self._progress_at: float | None = None  # last time it had nothing to do or produced a token
        self._running = 0.0
        self.reported: float | None = None  # the unresponsive_since (wall) last written to the record

    def probed(self, t: float, ok: bool, error: str = "") -> None:
        if ok:
            self.failed, self.unresponsive_since, self.last_error = 0, None, ""
            return
        self.failed += 1
        self.last_error = error
        if self.unresponsive_since is None:
            self.unresponsive_since = t

    def progress(self, t: float, running: float | None, tokens_total: float | None) -> None:
        """One /metrics reading: requests running and the generated-token counter (None: not exported)."""
        if running is None or tokens_total is None:
            return
        moved = self._tokens is None or tokens_total != self._tokens
        self._tokens, self._running = tokens_total, running
        if moved or running <= 0 or self._progress_at is None:
            self._progress_at = t

    def verdict(self, t: float, timeout_s: float) -> str | None:
        """Why the engine counts as hung, or None."""
        if self.failed >= self.failures:
            return (f"GET /health got no answer within {timeout_s:g}s {self.failed} times in a row "
                    f"({self.last_error or 'timeout'})")
        if (self.stall_s > 0 and self._running > 0 and self._progress_at is not None
                and t - self._progress_at >= self.stall_s):
            return (f"{self._running:g} request(s) in flight and no token produced for "
                    f"{t - self._progress_at:.0f}s")
        return None


async def _scrape(proc: EngineProcess, timeout_s: float) -> dict[str, float]:
    """One GET of the engine's /metrics: what its backend's parser makes of it (`EngineProcess.scrape_metrics`),
    plus the busy-time counter under `BUSY_SECONDS_KEY` when the engine exports it (the emulated engine; the
    backends' parsers do not map it)."""
    ctype, body = await proc.fetch_metrics(timeout_s)
    parsed = proc.backend.parse_metrics(ctype, body)
    if BUSY_SECONDS_KEY not in parsed and BUSY_SECONDS_SAMPLE in body:
        busy = metric_value(body, BUSY_SECONDS_SAMPLE)
        if busy is not None:
            parsed[BUSY_SECONDS_KEY] = busy
    return parsed


@dataclass(frozen=True, slots=True)
class DeployParams:
    """What a Deploy asks for (field names are the DeployRequest's)."""

    model_id: str
    tp: int = 1
    pp: int = 1
    gpu_ids: tuple[str, ...] = ()
    memory_gb_per_gpu: float = 0.0  # 0 = the profile's
    task_id: str = ""
    engine: str = ""  # "" = the node's default backend
    request_id: str = ""  # idempotency key; becomes the instance id
    no_wait: bool = False

    def validate(self) -> DeployParams:
        if not self.model_id.strip():
            raise InvalidSpec("must not be empty", field="model_id")
        if self.tp < 1:
            raise InvalidSpec(f"must be >= 1, got {self.tp}", field="tp")
        if self.pp < 1:
            raise InvalidSpec(f"must be >= 1, got {self.pp}", field="pp")
        if self.gpu_ids and len(self.gpu_ids) != self.tp * self.pp:
            raise InvalidSpec(f"needs tp*pp = {self.tp * self.pp} GPU ids, got {len(self.gpu_ids)}", field="gpu_ids")
        if len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise InvalidSpec(f"GPU ids must be distinct, got {list(self.gpu_ids)}", field="gpu_ids")
        if not self.memory_gb_per_gpu >= 0:
            raise InvalidSpec(f"must be >= 0, got {self.memory_gb_per_gpu}", field="memory_gb_per_gpu")
        return self


class NodeAgent:
    """One per deployer process. `start()` is the server's on_ready hook, `shutdown()` its on_shutdown."""

    def __init__(self, store: StateStore, settings: DeployerSettings, *, endpoint: str = "",
                 inventory: list[GpuInfo] | None = None) -> None:
        self.store = store
        self.settings = settings
        self.node = settings.node
        self.endpoint = endpoint  # this deployer's gRPC address, published in the node record
        self.inventory = inventory if inventory is not None else gpu_inventory(settings)
        if not self.inventory:
            raise InvalidSpec("the node has no GPU", field="gpu_count")
        n = len(self.inventory)
        self.gpus: dict[str, GpuInfo] = {gpu_id(self.node, g.index, n): g for g in self.inventory}
        self.gpu_type = self.inventory[0].gpu_type
        self.keeper: LeaseKeeper | None = None
        self.procs: dict[str, EngineProcess] = {}
        self._starting: dict[str, asyncio.Task[InstanceRecord]] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._meters: dict[str, tuple[EngineProcess, LoadMeter]] = {}  # by instance id, for the READY engines
        self._saturation: dict[str, SaturationMeter] = {}
        self._busy: dict[str, BusyMeter] = {}
        self._liveness: dict[str, tuple[EngineProcess, LivenessMeter]] = {}  # READY engines, by instance id
        self._share_dir = ""  # the emulated engines' GPU-sharing directory (`_gpu_share_dir`), made on first use

    # ---- registration -------------------------------------------------------------------

    async def start(self) -> None:
        """Claim the node key (under a fresh lease), reconcile leftovers, publish the GPUs."""
        self._prepare_log_dir()
        await self._check_engine_user()
        await self._claim_node()
        await self._reconcile()
        if self.settings.load_scrape_interval_s > 0:
            self._spawn(self._load_loop())
        if self.settings.resync_interval_s > 0:
            self._spawn(self._resync_loop())
        if self.settings.liveness_interval_s > 0:
            self._spawn(self._liveness_loop())
        log.info("node %s registered: %d x %s, backend %s", self.node, len(self.gpus), self.gpu_type,
                 self.settings.backend)

    async def _check_engine_user(self) -> None:
        """With `engine_user`, the emulated engine's Python must be runnable by that user (a venv under a 0700
        home is not): found out here, at start, rather than as a failed start of every engine."""
        ids = self.settings.engine_ids
        if ids is None or self.settings.backend != "emulated":
            return
        backend = get_backend("emulated")
        argv = [getattr(backend, "python", sys.executable), "-m", "flowmaker.engine.server", "--help"]
        try:
            p = await asyncio.create_subprocess_exec(
                *argv, env=engine_base_env(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, user=ids[0], group=ids[1], extra_groups=[], cwd="/")
            _, errb = await wait_for(p.communicate(), 60)
            why = "" if p.returncode == 0 else errb.decode(errors="replace").strip()[-500:]
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
        except TimeoutError:
            p.kill()
            why = "no answer within 60 s"
        if why:
            raise InvalidSpec(f"engine_user {self.settings.engine_user!r} (uid {ids[0]}) cannot run the engine "
                              f"{' '.join(argv[:3])}: {why}", field="engine_user")

    def _prepare_log_dir(self) -> None:
        """Create the engine log directory up front. Without it every engine's output reader would
        die on open(), the engine's `LISTENING <port>` line would never be read, and each Deploy would
        hang until engine_start_timeout_s; a directory that cannot be made is a clear error at start."""
        d = self.settings.engine_log_dir
        if not d:
            return
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise InvalidSpec(f"cannot create the engine log directory {d!r}: {e.strerror or e}",
                              field="engine_log_dir") from None
        if not os.access(d, os.W_OK | os.X_OK):
            raise InvalidSpec(f"the engine log directory {d!r} is not writable", field="engine_log_dir")

    def _node_record(self) -> NodeRecord:
        return NodeRecord(self.node, self.gpu_type, len(self.gpus), self.endpoint, self.settings.backend, time.time())

    async def _claim_node(self) -> None:
        keeper = LeaseKeeper(self.store, self.settings.lease_ttl_s, on_lost=self._on_lease_lost)
        await keeper.start()
        deadline = time.monotonic() + _STALE_NODE_WAIT_TTLS * self.settings.lease_ttl_s + 2
        try:
            while True:
                try:
                    await self.store.create(keys.node(self.node), self._node_record().to_json(), lease=keeper.id)
                    break
                except AlreadyExists:
                    # Another live agent with this node name, or our own previous life whose lease
                    # has not run out yet: wait for it to expire before taking over its GPUs.
                    if time.monotonic() > deadline:
                        raise AlreadyExists(f"node {self.node!r} is registered by another live deployer",
                                            field="node") from None
                    await asyncio.sleep(0.5)
        except BaseException:
            # Any failure (etcd unreachable too, which _reclaim retries): a keeper left running would
            # refresh a lease no key uses, one more per retry.
            with contextlib.suppress(FlowMakerError):
                await keeper.stop(revoke=True)
            raise
        self.keeper = keeper

    async def _on_lease_lost(self) -> None:
        """The lease expired (etcd unreachable for a TTL): our node key is gone. Instances and GPU
        accounting are not lease-bound, so re-claiming the node key is all it takes."""
        if self._closing:
            return
        self._spawn(self._reclaim())

    async def _reclaim(self) -> None:
        delay = 0.5
        while not self._closing:
            try:
                await self._claim_node()
                log.warning("node %s re-registered after losing its lease", self.node)
                with contextlib.suppress(FlowMakerError):
                    await self.resync()  # instances the reconciler marked LOST meanwhile
                return
            except FlowMakerError as e:
                log.warning("node %s: re-registration failed (%s); retrying in %.1fs", self.node, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _reconcile(self) -> None:
        """Instances of this node that no engine of ours backs (a previous life of this agent) have
        their leftover engine killed, then are marked FAILED (DRAINING ones, whose release had dropped
        every reference, are deleted); PENDING ones (reserved, not started) keep their memory. Then every
        GPU's memory_used is recomputed from the instances holding memory, in one guarded txn."""
        for _ in range(self.settings.commit_retries):
            gpus_l = await self.store.get_prefix(keys.gpus_of_node(self.node))
            inst_l = await self.store.get_prefix(keys.INSTANCES)
            compares, puts, deletes = [], [], []
            held: list[InstanceRecord] = []
            mine = [(kv, InstanceRecord.from_json(kv.value)) for kv in inst_l.items]
            mine = [(kv, rec) for kv, rec in mine if rec.node == self.node]
            orphans = [rec for _, rec in mine if rec.state in (InstanceState.STARTING, InstanceState.READY,
                                                               InstanceState.DRAINING, InstanceState.LOST)
                       and rec.id not in self.procs]
            await asyncio.gather(*(self._kill_leftover(rec) for rec in orphans))
            orphan_ids = {rec.id for rec in orphans}
            for kv, rec in mine:
                if rec.state is InstanceState.DRAINING and rec.id in orphan_ids:
                    # Its release had dropped every reference already: finish it (memory is recomputed below).
                    compares.append(Compare.unchanged(kv.key, kv.mod_revision))
                    deletes.append(kv.key)
                    continue
                if rec.id in orphan_ids:
                    rec = replace(rec, state=InstanceState.FAILED, memory_reserved=False, endpoint="",
                                  reason="the deployer restarted; its engine is gone", failure_reason="NODE_RESTARTED")
                    compares.append(Compare.unchanged(kv.key, kv.mod_revision))
                    puts.append(Put(kv.key, rec.to_json()))
                if rec.memory_reserved:
                    held.append(rec)
            existing = {kv.key: kv for kv in gpus_l.items}
            for gid, info in self.gpus.items():
                key = keys.gpu(self.node, gid)
                used = sum(r.memory_gb_per_gpu for r in held if gid in r.gpu_ids)
                rec_g = GpuRecord(gid, self.node, info.gpu_type, info.memory_total_gb, 0.0, info.index).with_used(used)
                compares.append(Compare.unchanged(key, existing[key].mod_revision if key in existing else 0))
                puts.append(Put(key, rec_g.to_json()))
            for key, kv in existing.items():
                if keys.parse_gpu(key)[1] not in self.gpus:  # the node lost a GPU since last time
                    compares.append(Compare.unchanged(key, kv.mod_revision))
                    deletes.append(key)
            if (await self.store.txn(compares, puts, deletes)).succeeded:
                return
        raise Conflict(f"node {self.node}: could not publish its GPUs (state kept changing)")

    async def _kill_leftover(self, rec: InstanceRecord) -> None:
        """The engine a previous life of this agent started may still run: engines live in their own
        session (so a stop reaches their workers), so they outlive a SIGKILLed deployer. Kill it when the
        recorded pid is still that very process (pid + start time + boot id), never a reused pid."""
        if not rec.engine_pid:
            return
        killed = await asyncio.to_thread(procs.kill_group_if_same, rec.engine_pid, rec.engine_identity,
                                         self.settings.engine_stop_grace_s)
        if killed:
            log.warning("instance %s: killed engine pid %d left running by a previous deployer", rec.id,
                        rec.engine_pid)

    async def shutdown(self) -> None:
        """Stop every engine (instances -> FAILED, memory given back), then revoke the lease."""
        self._closing = True
        ids = set(self.procs) | set(self._starting)
        starting = list(self._starting.values())
        for t in starting:
            t.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        for iid in list(self.procs):
            await self.procs.pop(iid).stop(grace_s=self.settings.engine_stop_grace_s)
        for iid in sorted(ids):
            try:
                await self._fail(iid, "the deployer shut down", "NODE_SHUTDOWN")
            except FlowMakerError as e:  # etcd gone: the record stays; a restart reconciles it
                log.warning("instance %s: could not record the shutdown: %s", iid, e)
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._share_dir:  # its engines are stopped: their busy marks mean nothing any more
            shutil.rmtree(self._share_dir, ignore_errors=True)
            self._share_dir = ""
        if self.keeper is not None:
            await self.keeper.stop(revoke=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    # ---- deploy -------------------------------------------------------------------------

    async def deploy(self, p: DeployParams) -> InstanceRecord:
        p.validate()
        for gid in p.gpu_ids:
            if gid not in self.gpus:
                raise InvalidSpec(f"GPU {gid!r} is not on node {self.node} (its GPUs: {', '.join(self.gpus)})",
                                  field="gpu_ids")
        engine = p.engine or self.settings.backend
        try:
            backend = get_backend(engine)
        except NotFound as e:
            raise InvalidSpec(e.message, field="engine") from None
        iid = p.request_id or new_instance_id(p.model_id)
        async with self._locks[iid]:
            kv = await self.store.get(keys.instance(iid))
            existing = InstanceRecord.from_json(kv.value) if kv else None
            if existing is not None:
                self._check_same(existing, p, engine)
                if p.task_id and existing.state is not InstanceState.DRAINING:
                    await self._add_reference(iid, p.task_id)
                if existing.state in (InstanceState.READY, InstanceState.STARTING):
                    task = self._starting.get(iid)
                    proc = self.procs.get(iid)
                    if task is None and (proc is None or not proc.is_alive):
                        # No start of ours is running and no engine of ours backs it: its start died (etcd
                        # went away after the engine came up, a previous life of this agent). Returning it
                        # would call a dead record success; fail it (memory given back) and start afresh.
                        await self._kill_leftover(existing)
                        await self._fail_locked(iid, "no engine of this node backs it (its start was cut "
                                                "short); starting it again", "NODE_RESTARTED")
                        kv = await self.store.get(keys.instance(iid))
                        existing = InstanceRecord.from_json(kv.value) if kv else None
                    elif task is None or p.no_wait:
                        return existing  # idempotent retry
                    else:
                        starting = task
                elif existing.state is InstanceState.DRAINING:
                    raise FailedPrecondition(f"instance {iid} is being released", field="request_id")
            if existing is None or existing.state in (InstanceState.PENDING, InstanceState.FAILED):
                profile = await self.profile_for(p.model_id, p.tp, p.pp)
                mem = round(p.memory_gb_per_gpu or profile.memory_gb_per_gpu, MEMORY_DIGITS)
                if existing is not None and existing.state is InstanceState.PENDING:
                    rec = await self._adopt_pending(kv, existing, engine)  # type: ignore[arg-type]
                else:
                    rec = await self._reserve(iid, p, engine, mem, kv)
                starting = asyncio.create_task(self._start_engine(rec, backend, profile))
                self._starting[iid] = starting
                starting.add_done_callback(lambda _t, i=iid: self._starting.pop(i, None))  # type: ignore[misc]
                if p.no_wait:
                    return rec
        # Shielded: a client giving up (deadline, disconnect) must not abort a half-started engine;
        # the start completes (READY or FAILED) and a retry with the same request_id finds it.
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            cur = asyncio.current_task()
            if cur is not None and cur.cancelling():
                raise  # this RPC itself was cancelled
            raise FailedPrecondition(f"instance {iid} was released (or the deployer stopped) while starting",
                                     reason="RELEASED_WHILE_STARTING") from None

    async def _add_reference(self, iid: str, task_id: str) -> None:
        with contextlib.suppress(AlreadyExists):
            await self.store.create(keys.reuse(iid, task_id), reuse_value(iid, task_id))

    def _check_same(self, rec: InstanceRecord, p: DeployParams, engine: str) -> None:
        if rec.node != self.node:
            raise FailedPrecondition(f"instance {rec.id} lives on node {rec.node}, not {self.node}",
                                     field="request_id")
        same = (rec.model_id, rec.tp, rec.pp) == (p.model_id, p.tp, p.pp) and (
            not p.gpu_ids or tuple(p.gpu_ids) == tuple(rec.gpu_ids))
        if not same:
            raise AlreadyExists(f"request_id {rec.id!r} is already used by a different instance "
                                f"({rec.model_id} tp={rec.tp} pp={rec.pp} on {list(rec.gpu_ids)})", field="request_id")

    async def profile_for(self, model_id: str, tp: int, pp: int) -> Profile:
        """The measured profile from etcd, else the analytic one stored there, else the roofline."""
        for source in (ProfileSource.MEASURED, ProfileSource.ANALYTIC):
            kv = await self.store.get(keys.profile(self.gpu_type, model_id, tp, pp, source.value))
            stored = profile_from_record(kv) if kv is not None else None
            if stored is not None:
                return stored
        from flowmaker.catalog import get_gpu_type, get_model
        from flowmaker.profiling.analytic import analytic_profile

        try:
            model = get_model(model_id)
        except NotFound:
            raise NotFound(f"no profile and no catalog entry for model {model_id!r}", field="model_id") from None
        return analytic_profile(model, get_gpu_type(self.gpu_type), tp, pp)

    async def _reserve(self, iid: str, p: DeployParams, engine: str, mem: float, prev: KeyValue | None) -> InstanceRecord:
        """Place and reserve in one txn that re-checks every GPU key chosen; retried on a lost race."""
        k = p.tp * p.pp
        for _ in range(self.settings.commit_retries):
            listing = await self.store.get_prefix(keys.gpus_of_node(self.node))
            gpus = {GpuRecord.from_json(kv.value).id: (kv, GpuRecord.from_json(kv.value)) for kv in listing.items}
            free = {gid: g.memory_free_gb for gid, (_, g) in gpus.items()}
            if p.gpu_ids:
                short = [gid for gid in p.gpu_ids if gid not in gpus or free[gid] < mem - 1e-9]
                if short:
                    raise NoCapacity(
                        f"GPU(s) {', '.join(short)} lack {mem:g} GB free "
                        f"({', '.join(f'{g}: {free.get(g, 0):g} GB' for g in short)})",
                        field="gpu_ids", metadata={"node": self.node, "memory_gb_per_gpu": f"{mem:g}"})
                chosen = tuple(p.gpu_ids)
            else:
                placed = place_least_loaded(NodeGpus.of(g.to_domain() for _, g in gpus.values()), free, k, mem)
                if placed is None:
                    best = sorted(free.values(), reverse=True)[:k]
                    raise NoCapacity(
                        f"node {self.node} has no {k} GPU(s) with {mem:g} GB free each "
                        f"(most free: {', '.join(f'{f:g}' for f in best)} GB)",
                        metadata={"node": self.node, "gpus_needed": str(k), "memory_gb_per_gpu": f"{mem:g}"})
                chosen = placed[1]
            rec = InstanceRecord(iid, p.model_id, p.tp, p.pp, self.node, chosen, mem, InstanceState.STARTING,
                                 engine=engine, created_at=time.time())
            ikey = keys.instance(iid)
            compares = [Compare.unchanged(ikey, prev.mod_revision if prev else 0)]
            puts = [Put(ikey, rec.to_json())]
            for gid in chosen:
                gkv, g = gpus[gid]
                compares.append(Compare.unchanged(gkv.key, gkv.mod_revision))
                puts.append(Put(gkv.key, g.with_used(mem).to_json()))
            if p.task_id:
                rkey = keys.reuse(iid, p.task_id)
                if await self.store.get(rkey) is None:
                    compares.append(Compare.absent(rkey))
                    puts.append(Put(rkey, reuse_value(iid, p.task_id)))
            res = await self.store.txn(compares, puts)
            if res.succeeded:
                log.info("reserved %s: %s tp=%d pp=%d on %s (%g GB each)", iid, p.model_id, p.tp, p.pp,
                         ",".join(chosen), mem)
                return rec
            if ikey in res.failed:
                raise Conflict(f"instance {iid} was changed concurrently; retry", field="request_id")
        raise Conflict(f"could not reserve GPU memory for {iid}: state kept changing; retry")

    async def _adopt_pending(self, kv: KeyValue, rec: InstanceRecord, engine: str) -> InstanceRecord:
        """An instance reserved by someone else (a selection commit): memory already counted; start it."""
        bad = [g for g in rec.gpu_ids if g not in self.gpus]
        if bad:
            raise FailedPrecondition(f"instance {rec.id} is reserved on GPUs not of this node: {bad}", field="gpu_ids")
        new = replace(rec, state=InstanceState.STARTING, engine=rec.engine or engine)
        await self.store.cas(kv.key, new.to_json(), etag=kv.mod_revision)
        return new

    def _engine_process(self, rec: InstanceRecord, backend: EngineBackend, profile: Profile) -> EngineProcess:
        from flowmaker.catalog import get_model

        ctx = 0
        try:
            m = get_model(rec.model_id)
            hf_id = m.hf_id
            ctx = m.arch.max_ctx if m.arch is not None else 0
        except NotFound:
            hf_id = rec.model_id
        extra: tuple[str, ...] = ()
        if backend.name == "emulated":
            # The model's context, as vLLM reads it from the config: prompt + max_tokens beyond it is a 400.
            # Its GPUs are shared with this node's other emulated engines: while both are busy, two engines
            # on one GPU each run at half speed (flowmaker.engine.gpu_share, the simulator's dynamic rule).
            extra = ("--time-scale", f"{self.settings.engine_time_scale:g}",
                     *(("--max-model-len", str(ctx)) if ctx > 0 else ()),
                     # GPUs by their CUDA index: unique on the node, and a safe name whatever the node is called.
                     "--gpu-ids", ",".join(f"gpu{self.gpus[g].index}" for g in rec.gpu_ids),
                     "--gpu-share-dir", self._gpu_share_dir())
        port = 0 if backend.announces_port else _free_port(self.settings.engine_host)
        spec = EngineSpec(rec.id, rec.model_id, hf_id, rec.tp, rec.pp,
                          tuple(self.gpus[g].index for g in rec.gpu_ids), self.settings.engine_host, port,
                          replace(profile, memory_gb_per_gpu=rec.memory_gb_per_gpu), extra)
        log_path = None
        if self.settings.engine_log_dir:
            self._prepare_log_dir()  # removed since start (a cleaned-up temp dir): recreate, never hang
            log_path = engine_log_path(self.settings.engine_log_dir, rec.id)  # never outside the dir
        api_key = secrets.token_urlsafe(24) if self.settings.engine_api_keys else ""  # per instance
        return EngineProcess(backend, spec, on_exit=self._on_engine_exit, log_path=log_path, api_key=api_key,
                             user=self.settings.engine_ids)

    def _gpu_share_dir(self) -> str:
        """This agent's GPU-sharing directory for its emulated engines: private (0700), one per agent life (the
        engines of a previous life are gone), removed at shutdown (or by the next agent when this one is killed);
        made again if something removed it."""
        if not self._share_dir or not os.path.isdir(self._share_dir):
            self._share_dir = make_share_dir(self.node)
            ids = self.settings.engine_ids
            if ids is not None:  # engines of another user make their busy marks in it; still private to them
                os.chown(self._share_dir, *ids)
        return self._share_dir

    async def _start_engine(self, rec: InstanceRecord, backend: EngineBackend, profile: Profile) -> InstanceRecord:
        # Everything from building the command on is inside the try: whatever fails, the instance ends
        # FAILED with its memory given back, never stuck STARTING with memory reserved.
        proc: EngineProcess | None = None
        try:
            proc = self.procs[rec.id] = self._engine_process(rec, backend, profile)
            await proc.start()
            await self._record_engine(rec.id, proc)
            await proc.wait_healthy(timeout_s=self.settings.engine_start_timeout_s)
        except asyncio.CancelledError:
            # Cancelled by release() or shutdown(), which hold the instance and settle its record.
            self.procs.pop(rec.id, None)
            if proc is not None:
                await proc.stop(grace_s=2.0)
            raise
        except Exception as e:
            self.procs.pop(rec.id, None)
            if proc is not None:
                with contextlib.suppress(Exception):
                    await proc.stop(grace_s=2.0)
            reason = e.reason if isinstance(e, FlowMakerError) else "ENGINE_START_FAILED"
            with contextlib.suppress(FlowMakerError):
                await self._fail(rec.id, str(e), reason)
            if isinstance(e, FlowMakerError):
                raise
            raise Unavailable(f"engine {rec.id} failed to start: {e}", reason="ENGINE_START_FAILED") from e

        def ready(r: InstanceRecord) -> InstanceRecord | None:
            return replace(r, state=InstanceState.READY, endpoint=proc.base_url, api_key=proc.api_key) \
                if r.state is InstanceState.STARTING else None

        try:
            done = await self._update(rec.id, ready)
        except BaseException as e:
            # etcd failed us (or we were cancelled) after the engine came up: the engine must not outlive a
            # record that does not say READY. FAILED if etcd lets us; otherwise the record stays STARTING
            # and the next resync (no engine behind it) marks it FAILED and gives its memory back.
            self.procs.pop(rec.id, None)
            await proc.stop(grace_s=2.0)
            if not isinstance(e, asyncio.CancelledError):
                with contextlib.suppress(FlowMakerError):
                    await self._fail(rec.id, f"could not record READY: {e}", "ENGINE_START_FAILED")
            raise
        if done is None or done.state is not InstanceState.READY:
            # Released or failed while starting: this engine must not outlive its record.
            self.procs.pop(rec.id, None)
            await proc.stop(grace_s=2.0)
            raise FailedPrecondition(f"instance {rec.id} was released or failed while starting")
        log.info("instance %s READY at %s", rec.id, proc.base_url)
        return done

    async def _record_engine(self, iid: str, proc: EngineProcess) -> None:
        """Put the engine's pid and process identity in its record before waiting for it: if this agent
        is SIGKILLed from here on, its next life can find the engine and kill it (`_kill_leftover`)."""
        pid = proc.pid or 0
        ident = procs.identity(pid) if pid else ""

        def with_pid(r: InstanceRecord) -> InstanceRecord | None:
            return replace(r, engine_pid=pid, engine_identity=ident) if r.state is InstanceState.STARTING else None

        await self._update(iid, with_pid)

    async def _on_engine_exit(self, proc: EngineProcess, rc: int) -> None:
        iid = proc.spec.instance_id
        if self.procs.get(iid) is proc:
            del self.procs[iid]
        await self._fail(iid, f"engine exited with code {rc}; last output:\n{proc.last_output(10)}", "ENGINE_EXITED")

    async def _update(self, iid: str, fn: Callable[[InstanceRecord], InstanceRecord | None]) -> InstanceRecord | None:
        """CAS loop on one instance record; `fn` returning None leaves it alone."""
        for _ in range(self.settings.commit_retries):
            kv = await self.store.get(keys.instance(iid))
            if kv is None:
                return None
            new = fn(InstanceRecord.from_json(kv.value))
            if new is None:
                return InstanceRecord.from_json(kv.value)
            try:
                await self.store.cas(kv.key, new.to_json(), etag=kv.mod_revision)
                return new
            except (Conflict, NotFound):
                continue
        raise Conflict(f"instance {iid} kept changing; giving up the update")

    async def _free_txn(self, kv: KeyValue, rec: InstanceRecord, new: InstanceRecord | None) -> bool:
        """One txn: give back `rec`'s GPU memory (if it holds any) and write `new` (None = delete)."""
        compares = [Compare.unchanged(kv.key, kv.mod_revision)]
        puts: list[Put] = []
        deletes: list[str] = []
        if rec.memory_reserved:
            for gid in rec.gpu_ids:
                gkey = keys.gpu(rec.node, gid)
                gkv = await self.store.get(gkey)
                if gkv is None:
                    continue  # GPU gone from the inventory: nothing to give back
                compares.append(Compare.unchanged(gkey, gkv.mod_revision))
                puts.append(Put(gkey, GpuRecord.from_json(gkv.value).with_used(-rec.memory_gb_per_gpu).to_json()))
        if new is None:
            deletes.append(kv.key)
        else:
            puts.append(Put(kv.key, replace(new, memory_reserved=False).to_json()))
        return (await self.store.txn(compares, puts, deletes)).succeeded

    async def _fail(self, iid: str, reason: str, failure_reason: str) -> None:
        """-> FAILED with the reason, memory given back. Idempotent."""
        async with self._locks[iid]:
            await self._fail_locked(iid, reason, failure_reason)

    async def _fail_locked(self, iid: str, reason: str, failure_reason: str) -> None:
        for _ in range(self.settings.commit_retries):
            kv = await self.store.get(keys.instance(iid))
            if kv is None:
                return
            rec = InstanceRecord.from_json(kv.value)
            if rec.state is InstanceState.FAILED and not rec.memory_reserved:
                return
            new = replace(rec, state=InstanceState.FAILED, reason=reason[-2000:], failure_reason=failure_reason,
                          endpoint="")
            if await self._free_txn(kv, rec, new):
                log.warning("instance %s FAILED (%s): %s", iid, failure_reason, reason.splitlines()[0] if reason else "")
                return
        raise Conflict(f"instance {iid}: could not record its failure (state kept changing)")

    # ---- resync --------------------------------------------------------------------------

    async def _resync_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.settings.resync_interval_s)
            try:
                await self.resync()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd down: the next round
                log.warning("node %s: resync failed: %s", self.node, e)

    async def resync(self) -> None:
        """One round of reconciling this node's records with its engine processes (module docstring)."""
        if self._closing or self.keeper is None:
            return
        listing = await self.store.get_prefix(keys.INSTANCES)
        mine = {r.id: r for r in (InstanceRecord.from_json(kv.value) for kv in listing.items) if r.node == self.node}
        for iid in mine:
            # Under the instance's lock (Deploy and Release hold it too), on a fresh read: the listing may be
            # older than a Deploy that has just reserved the instance.
            async with self._locks[iid]:
                kv = await self.store.get(keys.instance(iid))
                if kv is None or iid in self._starting:
                    continue
                rec = InstanceRecord.from_json(kv.value)
                proc = self.procs.get(iid)
                if rec.state in (InstanceState.STARTING, InstanceState.READY) and (proc is None or not proc.is_alive):
                    if proc is None:
                        await self._kill_leftover(rec)
                    await self._fail_locked(iid, "no engine backs this instance on its node (the deployer "
                                            "restarted, or a start was cut short)", "NODE_RESTARTED")
                elif (rec.state is InstanceState.LOST and proc is not None and proc.is_alive and rec.endpoint
                      and not await proc.probe(self.settings.liveness_timeout_s)):
                    # Marked LOST while this agent was cut off (stalled, or etcd out of reach past the lease),
                    # but our engine went on serving, and was routed to: take it back rather than stop it.
                    # Its memory never left the node's accounting; its tasks may have moved off it meanwhile,
                    # and then the reconciler stops it as unreferenced.
                    await self._update(iid, functools.partial(_back_from_lost, endpoint=proc.base_url))
                    log.warning("instance %s: back after this node's lease was lost; its engine still serves", iid)
                elif rec.state is InstanceState.LOST or (rec.state is InstanceState.FAILED and proc is not None):
                    if proc is not None:
                        self.procs.pop(iid, None)
                        await proc.stop(grace_s=self.settings.engine_stop_grace_s)
                    else:
                        await self._kill_leftover(rec)
                    await self._fail_locked(iid, rec.reason or f"stopped: its record says {rec.state.value}",
                                            rec.failure_reason or "NODE_LOST")
        for iid in [i for i in self.procs if i not in mine and i not in self._starting]:
            async with self._locks[iid]:
                proc = self.procs.pop(iid, None)
                if proc is not None:
                    log.warning("instance %s: its record is gone; stopping its engine", iid)
                    await proc.stop(grace_s=self.settings.engine_stop_grace_s)
        await self._fix_accounting()

    async def _fix_accounting(self) -> None:
        """Rewrite GPU memory_used where it differs from the sum over this node's instances holding memory,
        in one txn guarded by every GPU key (every memory change writes one, so a concurrent change aborts it)."""
        gpus_l = await self.store.get_prefix(keys.gpus_of_node(self.node))
        inst_l = await self.store.get_prefix(keys.INSTANCES)
        held = [r for r in (InstanceRecord.from_json(kv.value) for kv in inst_l.items)
                if r.node == self.node and r.memory_reserved]
        compares, puts = [], []
        for kv in gpus_l.items:
            g = GpuRecord.from_json(kv.value)
            used = round(sum(r.memory_gb_per_gpu for r in held if g.id in r.gpu_ids), MEMORY_DIGITS)
            compares.append(Compare.unchanged(kv.key, kv.mod_revision))
            if abs(g.memory_used_gb - used) > 1e-6:
                log.warning("GPU %s: accounted %g GB used, instances hold %g GB; correcting", g.id,
                            g.memory_used_gb, used)
                puts.append(Put(kv.key, replace(g, memory_used_gb=used).to_json()))
        if puts:
            await self.store.txn(compares, puts)

    # ---- observed load ------------------------------------------------------------------

    def _time_scale(self, proc: EngineProcess) -> float:
        """Model seconds per wall second of this engine: only emulated engines run a scaled clock
        (`--time-scale`, see `_engine_process`); real engines' model clock is the wall clock."""
        return self.settings.engine_time_scale if proc.backend.name == "emulated" else 1.0

    async def _load_loop(self) -> None:
        """Scrape every READY engine each interval; one bad round (etcd down, a bug) never ends the loop."""
        interval = self.settings.load_scrape_interval_s
        while not self._closing:
            await asyncio.sleep(interval)
            try:
                await self.observe_loads()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("node %s: observed-load round failed: %s", self.node, e)

    async def observe_loads(self) -> None:
        """One round: scrape the READY engines concurrently, update their meters, write what changed."""
        ready = {iid: p for iid, p in self.procs.items() if iid not in self._starting and p.is_alive}
        for iid in [i for i, (p, _) in self._meters.items() if ready.get(i) is not p]:
            del self._meters[iid]  # stopped, failed or replaced by a new engine: its readings are void
            self._saturation.pop(iid, None)
            self._busy.pop(iid, None)
        for iid, p in ready.items():
            if iid not in self._meters:
                self._saturation[iid] = SaturationMeter(p.spec.profile, max_queue=self.settings.saturation_queue,
                                                        max_slowdown=self.settings.saturation_slowdown,
                                                        half_life_s=self.settings.load_half_life_s)
                self._busy[iid] = BusyMeter(self._time_scale(p), self.settings.load_half_life_s)
                self._meters[iid] = (p, LoadMeter(self._time_scale(p), self.settings.load_half_life_s,
                                                  self.settings.load_peak_window_s))
        timeout = max(0.5, min(5.0, self.settings.load_scrape_interval_s))
        await asyncio.gather(*(self._observe(iid, p, timeout) for iid, p in ready.items()))

    async def _observe(self, iid: str, proc: EngineProcess, timeout_s: float) -> None:
        try:
            metrics = await _scrape(proc, timeout_s)
        except Exception as e:
            # Keep the last value (it ages out for readers); never FAILED from here: the crash watcher
            # owns that, and a slow /metrics under load is no reason to take an instance away.
            log.debug("instance %s: /metrics scrape failed: %s", iid, e)
            return
        entry = self._meters.get(iid)
        sat = self._saturation.get(iid)
        busy = self._busy.get(iid)
        if entry is None or entry[0] is not proc or sat is None or busy is None:
            return  # the engine went (stopped, failed, replaced)
        meter = entry[1]
        wall = time.time()
        saturated = sat.add(time.monotonic(), metrics)
        tokens = metrics.get("generation_tokens_total")
        if tokens is not None:  # the backend may export no token counter (e.g. trtllm's JSON stats)
            meter.add(time.monotonic(), tokens)
        busy.add(time.monotonic(), metrics.get(BUSY_SECONDS_KEY), metrics.get("running"))
        live = self._liveness.get(iid)
        if live is not None and live[0] is proc:
            live[1].progress(time.monotonic(), metrics.get("running"), tokens)
        # A change of `saturated` is always worth a write: it decides whether the selector may reuse the
        # instance at all.
        if sat.reported == saturated and not busy.should_report(
                wall, _MIN_REPORT_CHANGE_BUSY, self.settings.load_report_max_interval_s) and (
                tokens is None or not meter.should_report(
                    wall, self.settings.load_report_min_change, self.settings.load_report_max_interval_s)):
            return
        rate, peak = meter.rate or 0.0, meter.peak
        share = busy.share or 0.0
        if saturated != sat.reported:
            log.warning("instance %s %s (queue %.1f, slowdown %.1fx, latency %.2fs)", iid,
                        "SATURATED" if saturated else "has headroom again", sat.queue, sat.slowdown, sat.latency_s)

        def observed(r: InstanceRecord) -> InstanceRecord | None:
            # Only a record still READY and still this engine's: a concurrent release or failure wins.
            if r.state is not InstanceState.READY or (proc.pid and r.engine_pid and r.engine_pid != proc.pid):
                return None
            return replace(r, observed_load_output_tokens_per_s=round(rate, 3),
                           observed_load_peak_output_tokens_per_s=round(peak, 3), observed_load_at=wall,
                           observed_queue=round(sat.queue, 3), observed_latency_s=round(sat.latency_s, 4),
                           observed_slowdown=round(sat.slowdown, 3), saturated=saturated,
                           observed_busy_share=round(share, 4))

        try:
            new = await self._update(iid, observed)
        except FlowMakerError as e:  # etcd unavailable, or the record kept changing: try next round
            log.debug("instance %s: observed load not recorded: %s", iid, e)
            return
        if new is not None and new.observed_load_at == wall:
            meter.reported = (new.observed_load_output_tokens_per_s, wall)
            sat.reported = saturated
            busy.reported = (new.observed_busy_share, wall)

    # ---- liveness -----------------------------------------------------------------------

    async def _liveness_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.settings.liveness_interval_s)
            try:
                await self.check_liveness()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd down (the record write), a bug: the next round
                log.warning("node %s: liveness round failed: %s", self.node, e)

    async def check_liveness(self) -> None:
        """One round: probe every READY engine at once; kill the hung ones (FAILED, ENGINE_HUNG: the
        reconciler restarts them in place) and record in each record since when it has not answered."""
        ready = {iid: p for iid, p in self.procs.items() if iid not in self._starting and p.is_alive}
        for iid in [i for i, (p, _) in self._liveness.items() if ready.get(i) is not p]:
            del self._liveness[iid]  # stopped, failed or replaced: a new engine starts with a clean slate
        for iid, p in ready.items():
            if iid not in self._liveness:
                self._liveness[iid] = (p, LivenessMeter(self.settings.liveness_failures,
                                                        self.settings.liveness_stall_s))
        timeout = self.settings.liveness_timeout_s
        errors = await asyncio.gather(*(p.probe(timeout) for p in ready.values()))
        now, wall = time.monotonic(), time.time()
        for (iid, proc), err in zip(ready.items(), errors, strict=True):
            entry = self._liveness.get(iid)
            if entry is None or entry[0] is not proc:
                continue
            meter = entry[1]
            meter.probed(now, not err, err)
            why = meter.verdict(now, timeout)
            if why is not None:
                del self._liveness[iid]
                self._spawn(self._kill_hung(iid, proc, why))
                continue
            since = 0.0 if meter.unresponsive_since is None else wall - (now - meter.unresponsive_since)
            if (since == 0.0) != (meter.reported in (None, 0.0)):
                if since:
                    log.warning("instance %s: engine does not answer its health probe (%s)", iid, err)
                self._spawn(self._record_unresponsive(iid, proc, meter, round(since, 3)))

    async def _record_unresponsive(self, iid: str, proc: EngineProcess, meter: LivenessMeter, since: float) -> None:
        def fn(r: InstanceRecord) -> InstanceRecord | None:
            if r.state is not InstanceState.READY or (proc.pid and r.engine_pid and r.engine_pid != proc.pid):
                return None
            return replace(r, unresponsive_since=since)
        try:
            new = await self._update(iid, fn)
        except FlowMakerError as e:
            log.debug("instance %s: liveness not recorded: %s", iid, e)
            return
        if new is not None and new.unresponsive_since == since:
            meter.reported = since

    async def _kill_hung(self, iid: str, proc: EngineProcess, why: str) -> None:
        """Kill a hung engine at once (a stopped process cannot act on SIGTERM) and record it FAILED with the
        reason, memory given back: to the reconciler it is a crash, restarted in place within its budget."""
        async with self._locks[iid]:
            if self.procs.get(iid) is not proc:
                return  # released, failed or replaced meanwhile
            del self.procs[iid]
            log.warning("instance %s: engine pid %s is hung (%s); killing it", iid, proc.pid, why)
            await proc.stop(grace_s=0.0)
            await self._fail_locked(iid, f"engine hung: {why}; killed it", "ENGINE_HUNG")

    # ---- release ------------------------------------------------------------------------

    async def release(self, iid: str, task_id: str = "") -> tuple[InstanceRecord | None, bool]:
        """Drop `task_id`'s reference; stop the instance when no reference is left (or task_id is
        empty: force). Returns (the instance as left, whether it was stopped). Idempotent."""
        if not iid:
            raise InvalidSpec("must not be empty", field="instance_id")
        async with self._locks[iid]:
            draining: InstanceRecord | None = None
            for _ in range(self.settings.commit_retries):
                kv = await self.store.get(keys.instance(iid))
                if kv is None:
                    return None, False
                rec = InstanceRecord.from_json(kv.value)
                if rec.node != self.node:
                    raise FailedPrecondition(f"instance {iid} lives on node {rec.node}; release it there",
                                             field="instance_id")
                refs = {keys.parse_reuse(r.key)[1]: r for r in (await self.store.get_prefix(
                    keys.reuse_of_instance(iid))).items}
                remaining = {t: r for t, r in refs.items() if t != task_id} if task_id else {}
                if remaining:
                    if task_id not in refs:
                        return rec, False  # this task holds no reference; nothing to drop
                    mine = refs[task_id]
                    load = reuse_load(mine.value)
                    new = replace(rec, load_output_tokens_per_s=max(0.0, rec.load_output_tokens_per_s - load))
                    res = await self.store.txn([Compare.unchanged(kv.key, kv.mod_revision),
                                                Compare.unchanged(mine.key, mine.mod_revision)],
                                               [Put(kv.key, new.to_json())], [mine.key])
                    if res.succeeded:
                        return new, False
                    continue
                # Last reference: DRAINING and drop every reference in one txn; a concurrent commit
                # reusing the instance compares the instance key, so exactly one of the two wins.
                new = replace(rec, state=InstanceState.DRAINING, load_output_tokens_per_s=0.0)
                res = await self.store.txn([Compare.unchanged(kv.key, kv.mod_revision),
                                            *(Compare.unchanged(r.key, r.mod_revision) for r in refs.values())],
                                           [Put(kv.key, new.to_json())], [r.key for r in refs.values()])
                if res.succeeded:
                    draining = new
                    break
            if draining is None:
                raise Conflict(f"instance {iid} kept changing; retry the release")
            starting = self._starting.get(iid)
            if starting is not None:
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            proc = self.procs.pop(iid, None)
            if proc is not None:
                await proc.stop(grace_s=self.settings.engine_stop_grace_s)
            for _ in range(self.settings.commit_retries):
                kv = await self.store.get(keys.instance(iid))
                if kv is None:
                    break
                if await self._free_txn(kv, InstanceRecord.from_json(kv.value), None):
                    break
            else:
                raise Conflict(f"instance {iid}: stopped, but its record kept changing; retry the release")
            log.info("instance %s released and stopped", iid)
            return draining, True

    # ---- reads --------------------------------------------------------------------------

    async def alive_nodes(self) -> set[str]:
        return {keys.parse_node(kv.key) for kv in (await self.store.get_prefix(keys.NODES)).items}

    async def list_instances(self, model_id: str = "", task_id: str = "") -> list[tuple[InstanceRecord, list[str], bool]]:
        """(record, task ids referencing it, node alive) for every instance, sorted by id."""
        inst = await self.store.get_prefix(keys.INSTANCES)
        refs = await self.store.get_prefix(keys.REUSE)
        alive = await self.alive_nodes()
        tasks: defaultdict[str, list[str]] = defaultdict(list)
        for kv in refs.items:
            i, t = keys.parse_reuse(kv.key)
            tasks[i].append(t)
        out = []
        for kv in inst.items:
            rec = InstanceRecord.from_json(kv.value)
            if model_id and rec.model_id != model_id:
                continue
            if task_id and task_id not in tasks[rec.id]:
                continue
            out.append((rec, sorted(tasks[rec.id]), rec.node in alive))
        return sorted(out, key=lambda x: x[0].id)

    async def list_gpus(self, node: str = "") -> list[GpuRecord]:
        alive = await self.alive_nodes()
        gpus = [GpuRecord.from_json(kv.value) for kv in (await self.store.get_prefix(
            keys.gpus_of_node(node) if node else keys.GPUS)).items]
        return sorted((g for g in gpus if g.node in alive), key=lambda g: (g.node, g.id))


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
