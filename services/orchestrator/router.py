"""The request router: Invoke on every replica, from the watch-fed cache (no etcd round trip once it has seen the
task): routing, replica choice, admission control, retry on a replacement when an instance dies under a call,
and the accounting of each request (the arrival meter, latencies batched into the task records, and the per-task
Prometheus series: requests by outcome, latency, SLO attainment, tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import trace

from flowmaker import metrics, telemetry
from flowmaker.cancel import wait_for
from flowmaker.catalog import default_models, get_model
from flowmaker.domain import Stage, Workflow
from flowmaker.errors import FailedPrecondition, FlowMakerError, InvalidSpec, NoCapacity, NotFound, Unavailable
from flowmaker.limits import LimitExceeded
from flowmaker.orchestration.adapt import ArrivalMeter
from flowmaker.orchestration.cluster import OBSERVED_LOAD_MAX_AGE_S
from flowmaker.orchestration.dag import Execution, StageResult, execute
from flowmaker.orchestration.task import SERVING_STATES, TaskRecord, TaskState, replicas_of
from flowmaker.rpc.channels import deadline_s
from flowmaker.state import keys
from flowmaker.state.records import InstanceRecord, InstanceState
from flowmaker.state.store import StateStore
from services.orchestrator.cache import RoutingCache
from services.orchestrator.engines import EngineClient, OnDelta
from services.orchestrator.records import ATTR_STAGE_KIND, TaskStore, tracer
from services.orchestrator.settings import OrchestratorSettings

log = logging.getLogger(__name__)

OnEvent = Callable[[str, Any], Awaitable[None]]  # ("delta", (stage_id, text)) or ("stage_done", StageResult)


class Router:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, cache: RoutingCache, engines: EngineClient,
                 arrivals: ArrivalMeter, *, answers: Callable[[str], bool] = lambda iid: False) -> None:
        self.settings = settings
        self.store = store
        self.tasks = TaskStore(store)
        self.cache = cache
        self.engines = engines
        self.arrivals = arrivals
        # Whether a LOST instance's engine still answers the leader's probes (the reconciler's memory; a replica
        # that is not the leader has none, and routes to READY instances only).
        self.answers = answers
        # Invoke latencies not yet written to their task records (flushed by `flush_loop`).
        self.pending_obs: defaultdict[str, list[float]] = defaultdict(list)
        self.inflight: defaultdict[str, int] = defaultdict(int)  # instance id -> engine calls in progress
        # Model id -> context length (prompt + completion tokens): the catalog's, and the registered models'
        # once a selection has listed them (`Selections.models`). Every engine call's max_tokens is clamped to it.
        self.contexts: dict[str, int] = {m.id: m.arch.max_ctx for m in default_models() if m.arch is not None}
        self._flusher: asyncio.Task[None] | None = None
        self._metered: set[str] = set()  # tasks with per-task series in flowmaker.metrics

    def start(self) -> None:
        if self._flusher is None:
            self._flusher = asyncio.create_task(self.flush_loop())

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None
        with contextlib.suppress(Exception):
            await wait_for(self.flush_observations(), 2.0)

    async def invoke(self, task_id: str, text: str, *, max_output_tokens: int = 0,
                     on_event: OnEvent | None = None) -> Execution:
        # The RPC's SERVER span is the request's root: it names the task, and each stage gets a child span.
        root = trace.get_current_span()
        root.set_attribute(telemetry.FLOWMAKER_TASK, task_id)
        if max_output_tokens < 0:
            raise InvalidSpec(f"must be >= 0 (0 = the stage's output_tokens), got {max_output_tokens}",
                              field="max_output_tokens")
        t = await self.route_task(task_id)
        if t.state not in SERVING_STATES:
            if t.healing is not None:
                raise Unavailable(f"task {task_id} is healing ({t.healing.action}: {t.healing.detail}); retry "
                                  f"shortly", field="task_id", reason="TASK_HEALING", metadata={"state": t.state.value})
            raise FailedPrecondition(f"task {task_id} is {t.state.value}; only an ACTIVE task serves requests",
                                     field="task_id", metadata={"state": t.state.value})
        wf = t.workflow
        if wf is None:
            raise FailedPrecondition(f"task {task_id} has no selected workflow", field="task_id")
        root.set_attribute(telemetry.FLOWMAKER_WORKFLOW, wf.id)
        # Counted as waiting from here: the latency quantiles see a request that never completes.
        # Bursts are metered over one latency SLO (wall seconds): what the load follower plans for.
        token = self.arrivals.arrived(task_id, time.time(), t.slo.max_latency_s / self.settings.tool_time_scale)
        try:
            insts: dict[str, InstanceRecord] = {}
            for iid in t.instance_ids:
                rec = await self.route_instance(iid)
                if rec is not None and rec.endpoint and (rec.state is InstanceState.READY or (
                        rec.state is InstanceState.LOST and self.answers(iid))):
                    insts[iid] = rec
            for stage in wf.stages:
                ids = replicas_of(t.stage_instances, stage.id) if stage.is_llm else []
                if not ids or any(i in insts for i in ids):
                    continue  # a replica group serves while at least one of its replicas does
                iid = ids[0]
                # Being healed: wait (within the request's deadline) for the replacement rather than fail.
                rec = await self.await_replacement(task_id, iid, None)
                if rec is None:
                    cur = await self.route_instance(iid)
                    state = cur.state.value if cur else "gone"
                    raise Unavailable(f"task {task_id} is DEGRADED: instance {iid} is {state}"
                                      + (f" ({cur.reason.splitlines()[0]})" if cur and cur.reason else ""),
                                      reason="INSTANCE_FAILED", metadata={"instance_id": iid})
                insts[iid] = rec

            async def run_stage(stage: Stage, prompt: str) -> StageResult:
                attrs = {telemetry.FLOWMAKER_TASK: task_id, telemetry.FLOWMAKER_WORKFLOW: wf.id,
                         telemetry.FLOWMAKER_STAGE: stage.id, ATTR_STAGE_KIND: stage.kind.value}
                if stage.is_llm:
                    attrs[telemetry.FLOWMAKER_INSTANCE] = t.stage_instances[stage.id]
                with tracer().start_as_current_span(f"stage {stage.id}", attributes=attrs):
                    return await stage_io(stage, prompt)

            async def stage_io(stage: Stage, prompt: str) -> StageResult:
                if not stage.is_llm:
                    # TOOL stages are emulated: they take their declared latency and pass their filled
                    # prompt through as output (no real tool runs).
                    await asyncio.sleep(stage.latency_s / self.settings.tool_time_scale)
                    return StageResult(stage.id, prompt, input_tokens=len(prompt.split()),
                                       output_tokens=len(prompt.split()))
                rec = self.pick_replica(insts, replicas_of(t.stage_instances, stage.id))
                max_tokens = min(stage.output_tokens, max_output_tokens) if max_output_tokens else stage.output_tokens
                max_tokens = self.clamp_to_context(stage, rec.model_id, prompt, max_tokens)
                on_delta: OnDelta | None = None
                if on_event is not None:
                    async def on_delta(piece: str) -> None:
                        await on_event("delta", (stage.id, piece))
                pt = ct = 0
                text = ""
                streamed = False

                async def counted(piece: str) -> None:
                    nonlocal streamed
                    streamed = True
                    if on_delta is not None:
                        await on_delta(piece)
                # calls_per_request > 1 (e.g. sampling several answers) runs the calls one after the other,
                # as the latency model counts them; the last answer is the stage's output.
                for _ in range(max(1, stage.calls_per_request)):
                    self.inflight[rec.id] += 1
                    try:
                        c = await self.engines.chat(rec.endpoint, rec.model_id, prompt, max(1, max_tokens),
                                                    timeout_s=deadline_s(self.settings.invoke_timeout_s),
                                                    api_key=rec.api_key,  # the engine's per-instance key (deployer)
                                                    instance_id=rec.id, on_delta=counted if on_event else None)
                    except Unavailable:
                        # The instance died under this call. A chat call has no side effect, so it is retried
                        # once on the replacement (restarted in place, or the re-selected variant's instance),
                        # within the request's deadline; not once output was streamed to the caller.
                        if streamed:
                            raise
                        new = await self.await_replacement(task_id, rec.id, rec.endpoint, stage.id)
                        if new is None:
                            raise
                        self.inflight[rec.id] -= 1
                        rec = new
                        self.inflight[rec.id] += 1
                        c = await self.engines.chat(rec.endpoint, rec.model_id, prompt, max(1, max_tokens),
                                                    timeout_s=deadline_s(self.settings.invoke_timeout_s),
                                                    api_key=rec.api_key,  # the engine's per-instance key (deployer)
                                                    instance_id=rec.id, on_delta=counted if on_event else None)
                    finally:
                        self.inflight[rec.id] -= 1
                    pt, ct, text = pt + c.prompt_tokens, ct + c.completion_tokens, c.text
                # finish_reason: the engine's, of the last call (the one whose text is the output).
                return StageResult(stage.id, text, rec.id, rec.model_id, pt, ct, finish_reason=c.finish_reason)

            async def done(r: StageResult) -> None:
                if on_event is not None:
                    await on_event("stage_done", r)

            self.admit(task_id, t, wf, insts)
            ex = await execute(wf, text, run_stage, done)
        except BaseException as e:
            self.arrivals.abandoned(task_id, token)
            self._metered.add(task_id)
            metrics.observe_task_request(task_id, "cancelled" if isinstance(e, asyncio.CancelledError) else "error")
            raise
        self.arrivals.finished(task_id, time.time(), ex.latency_s, token)
        self._metered.add(task_id)
        metrics.observe_task_request(
            task_id, "ok", latency_s=ex.latency_s * self.settings.tool_time_scale, slo_s=t.slo.max_latency_s,
            prompt_tokens=sum(r.input_tokens for r in ex.stages if r.model_id),
            completion_tokens=sum(r.output_tokens for r in ex.stages if r.model_id))
        # Accounting is off the request's path: batched into the task record by `_flush_loop`.
        pending = self.pending_obs[task_id]
        pending.append(ex.latency_s)
        del pending[:-self.settings.latency_window]
        return ex

    def clamp_to_context(self, stage: Stage, model_id: str, prompt: str, max_tokens: int) -> int:
        """`max_tokens` clamped so that prompt + completion fit the model's context (when it is known);
        INVALID_ARGUMENT (limit context_tokens) when the prompt alone leaves no room. The prompt is counted
        in words, as the emulated engine counts; a real engine whose tokenizer counts more answers 400,
        which `EngineClient.chat` reports as INVALID_ARGUMENT too."""
        ctx = self.contexts.get(model_id)
        if ctx is None:
            with contextlib.suppress(NotFound):
                arch = get_model(model_id).arch
                ctx = arch.max_ctx if arch is not None else None
        if not ctx:
            return max_tokens
        in_tokens = len(prompt.split())
        room = ctx - in_tokens
        if room < 1:
            raise LimitExceeded(f"stage {stage.id!r}: its prompt has {in_tokens} tokens, which leaves no room for "
                                f"an answer in the {ctx}-token context of model {model_id!r} (limit context_tokens)",
                                field="input", metadata={"limit": "context_tokens", "max": str(ctx),
                                                         "stage_id": stage.id})
        return min(max_tokens, room)

    def pick_replica(self, insts: dict[str, InstanceRecord], ids: list[str]) -> InstanceRecord:
        """The serving replica with the least outstanding work (engine calls in flight from here); ties at
        random, so that equal replicas share the load. One whose engine does not answer its node's health probe
        (`unresponsive_since`, maybe hung) only when no other replica serves."""
        recs = [insts[i] for i in ids if i in insts]
        return min(recs, key=lambda r: (r.unresponsive_since > 0, self.inflight[r.id], random.random()))

    def admit(self, task_id: str, t: TaskRecord, wf: Workflow, insts: dict[str, InstanceRecord]) -> None:
        """Admission control: reject at once (RESOURCE_EXHAUSTED, with a retry hint) a request that cannot
        finish within its deadline, rather than queue it for minutes. The estimate is the latency the
        deployers measure on the task's instances right now (recent mean e2e per stage call, model seconds)
        summed along the workflow's critical path, against the time the caller has left."""
        now = time.time()
        per_stage = {}
        for stage in wf.stages:
            if not stage.is_llm:
                per_stage[stage.id] = stage.latency_s
                continue
            rec = insts.get(t.stage_instances.get(stage.id, ""))
            fresh = rec is not None and now - rec.observed_load_at <= OBSERVED_LOAD_MAX_AGE_S
            per_stage[stage.id] = (rec.observed_latency_s if fresh and rec is not None else 0.0) * max(
                1, stage.calls_per_request)
        est: dict[str, float] = {}
        for stage in wf.stages:  # topological order
            est[stage.id] = per_stage[stage.id] + max((est[d] for d in stage.depends_on), default=0.0)
        expected = max(est.values(), default=0.0) / self.settings.tool_time_scale  # wall seconds
        left = deadline_s(self.settings.invoke_timeout_s)
        if expected > left:
            retry = max(1.0, min(60.0, expected - left))
            raise NoCapacity(f"task {task_id} cannot answer within the request's deadline: its instances take "
                             f"{expected:.3g}s now (measured), {left:.3g}s are left; retry in {retry:.0f}s",
                             field="task_id", reason="DEADLINE_UNREACHABLE",
                             metadata={"retry_after_s": f"{retry:.0f}", "expected_latency_s": f"{expected:.3g}"})

    # ---- routing (the reconciler's cache; etcd only when the cache has not seen the task yet) ----------

    async def route_task(self, task_id: str) -> TaskRecord:
        if not task_id:
            raise InvalidSpec("must not be empty", field="task_id")
        t = self.cache.task(task_id) if self.cache.fresh else None
        if t is not None and t.state in SERVING_STATES:
            return t
        # Not in the cache, or not serving there: etcd may be ahead of the watch (a task that has just gone
        # ACTIVE). When etcd does not answer, the cache's word stands.
        try:
            return (await self.tasks.get(task_id))[1]
        except Unavailable:
            if t is None:
                raise
            return t

    async def route_instance(self, iid: str) -> InstanceRecord | None:
        rec = self.cache.instance(iid) if self.cache.fresh else None
        if rec is not None and rec.state is InstanceState.READY:
            return rec
        try:
            kv = await self.store.get(keys.instance(iid))
        except Unavailable:
            return rec
        return InstanceRecord.from_json(kv.value) if kv else None

    async def await_replacement(self, task_id: str, iid: str, old_endpoint: str | None,
                                 stage_id: str = "") -> InstanceRecord | None:
        """Wait, within the request's deadline and `invoke_heal_wait_s`, until the instance serving
        `stage_id` (or `iid`) is READY at an endpoint other than `old_endpoint`: the same instance
        restarted in place, or the re-selected variant's. None when that does not happen in time."""
        wait = min(self.settings.invoke_heal_wait_s, deadline_s(self.settings.invoke_timeout_s) - 1.0)
        if wait <= 0 or not self.cache.fresh:
            return None
        self.cache.kick()
        end = time.monotonic() + wait
        while time.monotonic() < end:
            t = self.cache.task(task_id)
            if t is None or t.state is TaskState.DELETING or t.state is TaskState.FAILED:
                return None
            cur = t.stage_instances.get(stage_id, iid) if stage_id else iid
            rec = self.cache.instance(cur)
            if (t.state is TaskState.ACTIVE and rec is not None and rec.state is InstanceState.READY
                    and rec.endpoint and rec.endpoint != old_endpoint):
                return rec
            await asyncio.sleep(0.1)
        return None

    def forget_gone(self) -> None:
        """Drop the per-task series of tasks the cache no longer holds (deleted, by whichever replica)."""
        if not self.cache.fresh:
            return
        for tid in [x for x in self._metered if self.cache.task(x) is None]:
            metrics.forget_task(tid)
            self._metered.discard(tid)

    async def flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.observe_flush_interval_s)
            self.forget_gone()
            try:
                await self.flush_observations()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd down: keep them (bounded) for the next flush
                log.debug("request accounting not flushed: %s", e)

    async def flush_observations(self) -> None:
        """Write the batched Invoke latencies into their task records (one CAS per task); best effort."""
        for task_id in list(self.pending_obs):
            batch = self.pending_obs.pop(task_id)
            if not batch:
                continue

            def fn(t: TaskRecord, batch: list[float] = batch) -> TaskRecord | None:
                if t.state is not TaskState.ACTIVE:
                    return None
                now = time.time()
                for lat in batch:
                    t = t.with_observation(lat, now, self.settings.latency_window)
                return t
            try:
                await self.tasks.update(task_id, fn)
            except NotFound:
                continue
            except FlowMakerError:
                kept = self.pending_obs[task_id]
                kept[:0] = batch
                del kept[:-self.settings.latency_window]
                raise
