"""The orchestrator's I/O: carries out the core's decisions against etcd, the selector, the deployers and the engines.

Everything it knows lives in etcd (task records under `keys.task`, plus the deployer's GPU, instance and
reuse keys). The reconciler (`services.orchestrator.reconciler`) compares that desired state with what runs
and calls back in here: it resumes whatever a crash or an etcd outage left half done (a SELECTING task is
selected again, a DEPLOYING task's instances deployed again — Deploy is idempotent by request_id = instance
id —, a DELETING task's release finished), restarts failed engines in place, re-selects tasks whose
instances cannot come back, and releases leaked references. At most one worker per task runs at a time
(`start_worker`). Invoke routes through the reconciler's cache, so it needs no etcd round trip; its
accounting is batched in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

from opentelemetry import trace

from flowmaker import convert, telemetry
from flowmaker.api.common.v1 import cluster_pb2, selection_pb2
from flowmaker.api.deployer.v1 import deployer_pb2
from flowmaker.api.selector.v1 import selector_pb2
from flowmaker.cancel import checkpoint, offload
from flowmaker.catalog import default_models, get_model
from flowmaker.domain import Cluster, Model, Slo, Stage, Variant, Workflow
from flowmaker.errors import (
    Conflict,
    FailedPrecondition,
    FlowMakerError,
    InvalidSpec,
    NoCapacity,
    NotFound,
    Unavailable,
)
from flowmaker.limits import LimitExceeded
from flowmaker.orchestration.adapt import ArrivalMeter, LoadPolicy, TaskLoad
from flowmaker.orchestration.cluster import (
    OBSERVED_LOAD_MAX_AGE_S,
    cluster_gpu_type,
    excluding_task,
    planned_busy_shares,
    read_live_cluster,
    read_task_uses,
    read_used_profiles,
    tolerances_of,
    with_planned_busy,
    with_tolerances,
)
from flowmaker.orchestration.commit import (
    CommitPlan,
    ReleaseAction,
    busy_load_scale,
    commit_ops,
    plan_commit,
    plan_release,
)
from flowmaker.orchestration.dag import Execution, StageResult, execute
from flowmaker.orchestration.reconcile import Policy
from flowmaker.orchestration.task import (
    SERVING_STATES,
    DeployedInstance,
    Failure,
    HealAction,
    Healing,
    Reselection,
    TaskRecord,
    TaskState,
    derive_state,
    replicas_of,
)
from flowmaker.rpc.channels import deadline_s
from flowmaker.rpc.errors import call, incoming_deadline
from flowmaker.sharing import DEFAULT_INTERFERENCE
from flowmaker.state import keys
from flowmaker.state.interference import InterferenceStore
from flowmaker.state.records import (
    ORPHAN_GC_TASK_ID,
    InstanceRecord,
    InstanceState,
    NodeRecord,
    new_instance_id,
    reuse_load,
    reuse_value,
)
from flowmaker.state.store import Compare, KeyValue, Put, StateStore
from services.orchestrator.clients import Clients
from services.orchestrator.engines import EngineClient, OnDelta
from services.orchestrator.reconciler import Reconciler
from services.orchestrator.settings import OrchestratorSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

OnEvent = Callable[[str, Any], Awaitable[None]]  # ("delta", (stage_id, text)) or ("stage_done", StageResult)

# Span attributes of the orchestrator's own steps (the shared ones, flowmaker.task/stage/instance/workflow
# and gen_ai.*, are in flowmaker.telemetry).
ATTR_ATTEMPT = "flowmaker.commit.attempt"  # 1-based select-and-commit attempt
ATTR_CONFLICT = "flowmaker.commit.conflict"  # the txn lost a race (or the view no longer fit): select again
ATTR_CONFLICT_KEYS = "flowmaker.commit.failed_keys"
ATTR_GENERATOR = "flowmaker.generator"  # "generator-service" (gRPC) or "templates" (in process)
ATTR_CANDIDATES = "flowmaker.candidates"  # the candidate workflow ids
ATTR_STRATEGY = "flowmaker.strategy"
ATTR_GPU_SHARING = "flowmaker.gpu_sharing"  # the selection's effective options.gpu_sharing (defaults applied)
ATTR_FEASIBLE = "flowmaker.feasible"
ATTR_REASON = "flowmaker.reason"
ATTR_NEW_INSTANCES = "flowmaker.new_instances"
ATTR_REUSED = "flowmaker.reused_instances"
ATTR_INSTANCES = "flowmaker.instances"  # a list: the instances a deploy starts/waits for, a release stopped
ATTR_MODEL = "flowmaker.model"
ATTR_NODE = "flowmaker.node"
ATTR_GPUS = "flowmaker.gpus"
ATTR_STAGE_KIND = "flowmaker.stage.kind"


def _tracer() -> trace.Tracer:
    return telemetry.tracer()


def _slug(text: str, default: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return "-".join(s.split("-")[:4])[:32].strip("-") or default


# Failures that say "not now" rather than "not this": etcd or a service unreachable, or a node whose key is
# missing (its lease lapsed while etcd was down: it re-registers when etcd is back; one gone for good is the
# reconciler's REPLAN_DEPLOY after the grace). A worker hitting one leaves its task where it is, for the
# reconciler to carry on once the outage is over.
_TRANSIENT_REASONS = frozenset({"ETCD_UNAVAILABLE", "UNAVAILABLE", "NODE_LOST"})


def _is_transient(e: BaseException) -> bool:
    return isinstance(e, Unavailable) and e.reason in _TRANSIENT_REASONS


class _Rejected(Exception):
    """The selector refused the approval's request as invalid (INVALID_ARGUMENT / NOT_FOUND)."""

    def __init__(self, error: FlowMakerError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True, slots=True)
class TaskView:
    """A task as read: the record, its etag, and the state/failure a reader sees (DEGRADED derived)."""

    task: TaskRecord
    etag: int
    state: TaskState
    failure: Failure | None
    observed_rate_rps: float = 0.0  # model-time arrivals/s over the orchestrator's window (0: not measured)


def _check_workflows(workflows: Sequence[Workflow]) -> None:
    """Validate each workflow (ids, DAG, templates) and that workflow ids are distinct."""
    ids: set[str] = set()
    for i, w in enumerate(workflows):
        checkpoint()
        w.validate(f"workflows[{i}]")
        if w.id in ids:
            raise InvalidSpec(f"duplicate workflow id {w.id!r}", field=f"workflows[{i}].id")
        ids.add(w.id)


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, clients: Clients,
                 engines: EngineClient | None = None) -> None:
        self.settings = settings
        self.store = store
        self.clients = clients
        self.engines = engines or EngineClient(settings.http_pool_size)
        self._background: set[asyncio.Task[Any]] = set()
        self._workers: dict[str, asyncio.Task[Any]] = {}  # task id -> the one worker on it
        self._replanning: set[str] = set()  # tasks a REPLAN_DEPLOY is on (`replan_deploy`)
        # Invoke latencies not yet written to their task records (flushed by `_flush_loop`).
        self._pending_obs: defaultdict[str, list[float]] = defaultdict(list)
        self._inflight: defaultdict[str, int] = defaultdict(int)  # instance id -> engine calls in progress
        self._delete_results: dict[str, list[str]] = {}  # task id -> instances its delete stopped
        # Model id -> context length (prompt + completion tokens): the catalog's, and the registered models'
        # once a selection has listed them (`_models`). Every engine call's max_tokens is clamped to it.
        self._contexts: dict[str, int] = {m.id: m.arch.max_ctx for m in default_models() if m.arch is not None}
        self.arrivals = ArrivalMeter(settings.load_window_s)
        s = settings
        self.reconciler = Reconciler(self, store, Policy(
            restart_backoff_s=s.reconcile_restart_backoff_s, max_restarts=s.reconcile_max_restarts,
            restart_window_s=s.reconcile_restart_window_s, node_lost_grace_s=s.reconcile_node_lost_grace_s,
            orphan_grace_s=s.reconcile_orphan_grace_s, deploying_deadline_s=s.reconcile_deploying_deadline_s),
            interval_s=s.reconcile_interval_s, heal=s.reconcile_heal,
            load_policy=LoadPolicy(band=s.load_band, hold_down_s=s.load_hold_down_s) if s.follow_load else None)
        self._started = False

    async def start(self) -> None:
        """Start the reconciler (its first pass resumes what a previous life left half done) and the
        batched request accounting."""
        if self._started:
            return
        self._started = True
        self.reconciler.start()
        self._spawn(self._flush_loop())

    async def close(self) -> None:
        await self.reconciler.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._flush_observations(), 2.0)
        for t in (*self._background, *self._workers.values()):
            t.cancel()
        await asyncio.gather(*self._background, *self._workers.values(), return_exceptions=True)
        await self.engines.close()

    def observed_load(self, task_id: str, now: float) -> TaskLoad | None:
        """The task's observed arrival rate and latency quantile, in model time (None: not watched long enough)."""
        return self.arrivals.load(task_id, now, self.settings.tool_time_scale)

    def busy_tasks(self) -> set[str]:
        return {tid for tid, t in self._workers.items() if not t.done()}

    def start_worker(self, task_id: str, coro: Awaitable[T]) -> asyncio.Task[Any]:
        """Run `coro` as THE worker of `task_id` (selection, deploy, release, delete), unless one is already
        on it: then `coro` is dropped and the running worker returned. Workers outlive their RPC."""
        cur = self._workers.get(task_id)
        if cur is not None and not cur.done():
            if asyncio.iscoroutine(coro):
                coro.close()
            return cur
        return self._register_worker(task_id, self._spawn(coro))

    def _register_worker(self, task_id: str, t: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self._workers[task_id] = t

        def done(_t: asyncio.Task[Any]) -> None:
            if self._workers.get(task_id) is _t:
                del self._workers[task_id]
            if not _t.cancelled() and _t.exception() is not None:
                e = _t.exception()
                log.warning("task %s: worker ended with %s: %s", task_id, type(e).__name__, e)
            self.reconciler.kick()
        t.add_done_callback(done)
        return t

    def replan_deploy(self, task_id: str, why: str) -> None:
        """A DEPLOYING task with an instance LOST (its node stalled or died during the deploy): stop waiting on
        it now, whether or not a worker is still blocked in its Deploy call, and select again against the live
        cluster (`_replan`). The blocked worker is cancelled; an approval waiting on it follows the new one."""
        if task_id in self._replanning:
            return
        self._replanning.add(task_id)
        old = self._workers.get(task_id)

        async def run() -> None:
            try:
                if old is not None and not old.done():
                    old.cancel()
                    await asyncio.wait({old})
                await self._replan(task_id, why)
            finally:
                self._replanning.discard(task_id)
        # Registered at once, in the old worker's place: the reconciler sees the task busy, and an approval
        # waiting on the old worker finds this one (`_follow_worker`).
        self._register_worker(task_id, self._spawn(run()))

    async def _replan(self, task_id: str, why: str) -> None:
        try:
            _, t = await self._get(task_id)
        except NotFound:
            return
        if t.state is not TaskState.DEPLOYING:
            return
        log.warning("task %s: re-planning its deploy: %s", task_id, why)
        try:
            await self._release_all(t)  # a lost node's references are dropped; a live node's instances released
        except FlowMakerError as e:  # the references left are released by the selection's own release
            log.warning("task %s: release before re-planning incomplete (%s)", task_id, e)

        def again(x: TaskRecord) -> TaskRecord | None:
            if x.state is not TaskState.DEPLOYING:
                return None
            now, h = time.time(), x.healing
            return x.moved(TaskState.SELECTING, now, healing=Healing(
                HealAction.RESELECTING.value, why, h.since if h else now, (h.attempts if h else 0) + 1))
        if await self._update(task_id, again) is None:
            return
        await self.select_commit_deploy(task_id)

    async def _follow_worker(self, task_id: str, w: asyncio.Task[Any]) -> None:
        """Wait for the task's worker `w` and, when the reconciler replaced it meanwhile (`replan_deploy`), for
        its successor: the RPC that started the work answers once the work is done or waits with a reason."""
        while True:
            try:
                await asyncio.shield(w)
            except asyncio.CancelledError:
                cur = asyncio.current_task()
                if cur is not None and cur.cancelling():
                    raise  # the RPC itself was cancelled
            nxt = self._workers.get(task_id)
            if nxt is None or nxt is w:
                return
            w = nxt

    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        async def run() -> T:
            # Background work outlives the RPC that started it: no inherited deadline.
            incoming_deadline.set(None)
            return await coro
        t = asyncio.create_task(run())
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    # ---- task records ------------------------------------------------------------------------

    async def _get(self, task_id: str) -> tuple[KeyValue, TaskRecord]:
        if not task_id:
            raise InvalidSpec("must not be empty", field="task_id")
        kv = await self.store.get(keys.task(task_id))
        if kv is None:
            raise NotFound(f"no task {task_id!r}", field="task_id", reason="TASK_NOT_FOUND")
        return kv, TaskRecord.from_json(kv.value)

    async def _update(self, task_id: str, fn: Callable[[TaskRecord], TaskRecord | None]) -> TaskRecord | None:
        """CAS loop: `fn` maps the current record to the new one (None = leave it)."""
        for _ in range(50):
            kv, t = await self._get(task_id)
            new = fn(t)
            if new is None:
                return None
            try:
                await self.store.cas(kv.key, new.to_json(), etag=kv.mod_revision)
                return new
            except Conflict:
                await asyncio.sleep(random.uniform(0.001, 0.02))
        raise Conflict(f"task {task_id} kept changing; retry", field="task_id")

    async def _fail(self, task_id: str, failure: Failure) -> TaskRecord | None:
        log.warning("task %s FAILED: %s %s", task_id, failure.reason, failure.message)

        def fn(t: TaskRecord) -> TaskRecord | None:
            if t.state in (TaskState.FAILED, TaskState.DELETING):
                return None
            return t.moved(TaskState.FAILED, time.time(), failure=failure)
        try:
            return await self._update(task_id, fn)
        except NotFound:
            return None

    async def _instance_states(self, task: TaskRecord) -> dict[str, str | None]:
        """Live state of each instance the task uses: None when the record or its node is gone."""
        nodes = {keys.parse_node(kv.key) for kv in (await self.store.get_prefix(keys.NODES)).items}
        out: dict[str, str | None] = {}
        for iid in task.instance_ids:
            kv = await self.store.get(keys.instance(iid))
            rec = InstanceRecord.from_json(kv.value) if kv else None
            out[iid] = rec.state.value if rec is not None and rec.node in nodes else None
        return out

    async def view(self, task_id: str) -> TaskView:
        kv, t = await self._get(task_id)
        state, failure = derive_state(t, await self._instance_states(t)) if t.state is TaskState.ACTIVE \
            else (t.state, t.failure)
        now = time.time()
        ld = self.observed_load(task_id, now)
        return TaskView(self._with_waiting(t, now), kv.mod_revision, state, failure, ld.rate_rps if ld else 0.0)

    def _with_waiting(self, t: TaskRecord, now: float) -> TaskRecord:
        """The record as GetTask shows it: the requests this orchestrator still waits on join its latency window
        with their age so far once that exceeds the window's median (`ArrivalMeter`), so a task whose instance
        hangs shows the wait in its p95 instead of the last completed requests' latencies."""
        waiting = self.arrivals.overdue(t.id, now, list(t.observed_latencies_s))
        return replace(t, observed_latencies_s=(*t.observed_latencies_s, *waiting)) if waiting else t

    async def list_tasks(self, state: TaskState | None = None) -> list[TaskView]:
        out = []
        for kv in (await self.store.get_prefix(keys.TASKS)).items:
            t = TaskRecord.from_json(kv.value)
            st, f = derive_state(t, await self._instance_states(t)) if t.state is TaskState.ACTIVE \
                else (t.state, t.failure)
            if state is None or st is state:
                ld = self.observed_load(t.id, time.time())
                out.append(TaskView(t, kv.mod_revision, st, f, ld.rate_rps if ld else 0.0))
        return sorted(out, key=lambda v: (v.task.create_time, v.task.id))

    # ---- DeployTask ----------------------------------------------------------------------------

    async def deploy_task(self, description: str, slo: Slo | None, *, name: str = "", max_workflows: int = 0,
                          workflows: Sequence[Workflow] = ()) -> TaskView:
        if slo is None:
            raise InvalidSpec("is required", field="slo")
        slo.validate("slo")
        if max_workflows < 0:
            raise InvalidSpec(f"must be >= 0 (0 = default), got {max_workflows}", field="max_workflows")
        if not workflows and not description.strip():
            raise InvalidSpec("must describe the task (or give workflows)", field="description")
        if workflows:
            # CPU work proportional to the DAGs: in a worker, bounded by the caller's deadline.
            await offload(_check_workflows, tuple(workflows))
        tid = f"{_slug(name or description, 'task')}-{uuid.uuid4().hex[:8]}"
        with _tracer().start_as_current_span("task.create", attributes={telemetry.FLOWMAKER_TASK: tid}) as span:
            candidates = tuple(workflows) or await self._generate(description,
                                                                  max_workflows or self.settings.max_workflows)
            if not candidates:
                raise NoCapacity("the generator proposed no workflow for this description", field="description",
                                 reason="NO_CANDIDATES")
            span.set_attribute(ATTR_CANDIDATES, [w.id for w in candidates])
            now = time.time()
            rec = TaskRecord(tid, description, slo, name=name, candidates=candidates,
                             state=TaskState.AWAITING_APPROVAL, create_time=now, update_time=now)
            rev = await self.store.create(keys.task(tid), rec.to_json())
        log.info("task %s created with %d candidate(s): %s", tid, len(candidates), [w.id for w in candidates])
        return TaskView(rec, rev, rec.state, None)

    async def _generate(self, description: str, n: int) -> tuple[Workflow, ...]:
        gen = self.clients.generator
        with _tracer().start_as_current_span("task.generate", attributes={ATTR_GENERATOR: gen.name}) as span:
            # Over gRPC, the channel's OpenTelemetry interceptor makes the call a CLIENT span under this one.
            out = await gen.generate(description, n)
            span.set_attribute(ATTR_CANDIDATES, [w.id for w in out])
            return out

    # ---- ApproveWorkflows ------------------------------------------------------------------------

    async def approve(self, task_id: str, workflow_ids: Sequence[str], *, strategy: str = "",
                      options: selection_pb2.SelectionOptions | None = None, etag: str = "") -> TaskView:
        kv, t = await self._get(task_id)
        if etag and etag != str(kv.mod_revision):
            raise Conflict(f"task {task_id} changed since etag {etag} (now {kv.mod_revision}); re-read it",
                           field="etag")
        if not workflow_ids:
            raise InvalidSpec("approve at least one candidate workflow", field="workflow_ids")
        known = {w.id for w in t.candidates}
        for i, wid in enumerate(workflow_ids):
            if wid not in known:
                raise InvalidSpec(f"{wid!r} is not a candidate of task {task_id} (candidates: {sorted(known)})",
                                  field=f"workflow_ids[{i}]")
        if t.state is not TaskState.AWAITING_APPROVAL:
            raise FailedPrecondition(f"task {task_id} is {t.state.value}, not AWAITING_APPROVAL", field="task_id")
        if options is not None:
            convert.selection_options_from_proto(options).validate("options")
        chosen = tuple(dict.fromkeys(workflow_ids))
        sel = t.moved(TaskState.SELECTING, time.time(), approved_workflow_ids=chosen,
                      strategy=strategy or self.settings.default_strategy,
                      options_json="" if options is None else convert.selection_options_to_json(options))
        await self.store.cas(kv.key, sel.to_json(), etag=kv.mod_revision)  # Conflict: a concurrent approval won
        # Shielded: a client that gives up must not leave a half-committed, half-deployed task behind.
        await self._follow_worker(task_id, self.start_worker(task_id, self.select_commit_deploy(task_id)))
        return await self.view(task_id)

    async def select_commit_deploy(self, task_id: str) -> None:
        """Select, commit and deploy a SELECTING task (an approval, a resumed one, or a healing re-selection)."""
        _, t = await self._get(task_id)
        if t.state is not TaskState.SELECTING:
            return
        if t.healing is not None:
            # Re-selection: the references of the variant being replaced go first (idempotent; they may be
            # gone already), so the new commit can reuse any instance, the old ones included.
            await self._release_all(t)
        try:
            plan = await self._select_and_commit(task_id)
        except _Rejected as r:
            if t.healing is not None:
                await self._wait_for_capacity(task_id, f"the selector refused the request: {r.error}")
                return
            # The approval itself was wrong (an unknown strategy, options the selector refuses): nothing
            # was committed, so the task goes back to AWAITING_APPROVAL and the caller gets the error to
            # fix and approve again, rather than a task FAILED for good by a typo.
            def back(t: TaskRecord) -> TaskRecord | None:
                return t.moved(TaskState.AWAITING_APPROVAL, time.time()) if t.state is TaskState.SELECTING else None
            with contextlib.suppress(NotFound):
                await self._update(task_id, back)
            raise r.error from None
        except Exception as e:  # nothing is reserved before the commit: failing the task is all
            if _is_transient(e):
                # etcd, the selector or a deployer is unreachable: nothing is committed and the task stays
                # SELECTING; the reconciler selects again on its next pass (after the outage).
                log.warning("task %s: selection interrupted (%s); the reconciler retries it", task_id, e)
                raise
            if not isinstance(e, FlowMakerError):
                log.exception("task %s: selection failed", task_id)
            if t.healing is not None:
                await self._wait_for_capacity(task_id, str(e))
                return
            await self._fail(task_id, Failure.of(e))
            return
        if plan is not None:
            await self.deploy(task_id)

    async def _models(self) -> tuple[Model, ...]:
        """The models a selection may use: the catalog's, and those registered with the profiler (which win
        by id). Best effort: an unreachable profiler leaves the catalog (empty = the selector's default)."""
        try:
            registered = await self.clients.registered_models(min(5.0, self.settings.select_timeout_s))
        except FlowMakerError as e:
            log.warning("registered models unavailable (%s); selecting among the catalog's", e)
            return ()
        if not registered:
            return ()
        by_id = {m.id: m for m in default_models()}
        by_id.update({m.id: m for m in registered})
        self._contexts.update({m.id: m.arch.max_ctx for m in registered if m.arch is not None and m.arch.max_ctx > 0})
        return tuple(by_id.values())

    async def _wait_for_capacity(self, task_id: str, why: str) -> None:
        """A healing task found no way to serve yet: it stays SELECTING (nothing reserved) and the
        reconciler tries again after an exponential backoff."""
        def fn(t: TaskRecord) -> TaskRecord | None:
            if t.state is not TaskState.SELECTING or t.healing is None:
                return None
            h = t.healing
            delay = min(self.settings.reconcile_heal_backoff_max_s, 2.0 ** min(h.attempts, 10))
            now = time.time()
            return t.moved(TaskState.SELECTING, now, healing=Healing(
                HealAction.WAITING_FOR_CAPACITY.value, why, h.since, h.attempts + 1, now + delay))
        with contextlib.suppress(NotFound):
            new = await self._update(task_id, fn)
            if new is not None and new.healing is not None:
                log.warning("task %s: healing waits for capacity (%s); next attempt in %.0fs", task_id, why,
                            new.healing.next_attempt_at - time.time())

    async def _select_and_commit(self, task_id: str) -> CommitPlan | None:
        """Select on a fresh view and commit it in one guarded txn; on a lost race select again."""
        last = ""
        for attempt in range(1, self.settings.commit_retries + 1):
            _, t = await self._get(task_id)
            if t.state is not TaskState.SELECTING:
                log.info("task %s left SELECTING (%s) during selection; stopping", task_id, t.state.value)
                return None
            with _tracer().start_as_current_span("task.select", attributes={
                    telemetry.FLOWMAKER_TASK: task_id, ATTR_ATTEMPT: attempt, ATTR_STRATEGY: t.strategy}) as span:
                view = await read_live_cluster(self.store)
                req = await self._selection_request(t, view.cluster)
                span.set_attribute(ATTR_GPU_SHARING, selection_pb2.GpuSharing.Name(req.options.gpu_sharing))
                try:
                    resp = await call(self.clients.selector.SelectVariant(req, timeout=self.settings.select_timeout_s))
                except (InvalidSpec, NotFound) as e:
                    raise _Rejected(e) from e
                result = convert.selection_result_from_proto(resp)
                span.set_attribute(ATTR_FEASIBLE, result.variant is not None)
                if result.variant is not None:
                    span.set_attributes({telemetry.FLOWMAKER_WORKFLOW: result.variant.workflow_id,
                                         ATTR_NEW_INSTANCES: len(result.variant.new_instances),
                                         ATTR_REUSED: len(result.variant.reuse)})
                elif result.reason is not None:
                    span.set_attribute(ATTR_REASON, result.reason.value)
            if result.variant is None:
                reason = result.reason.value if result.reason else "NO_FEASIBLE_VARIANT"
                if t.healing is not None:
                    await self._wait_for_capacity(task_id, f"no feasible variant: {result.reason_detail or reason}")
                    return None
                await self._fail(task_id, Failure("NoCapacity", reason,
                                                  f"no feasible variant: {result.reason_detail or reason}"))
                return None
            v = result.variant
            scale = await self._load_scale(t, v, view.cluster, req.options.capacity_model,
                                           [convert.model_from_proto(m) for m in req.models])
            plan = plan_commit(task_id, v, [new_instance_id(n.model_id) for n in v.new_instances], load_scale=scale)
            with _tracer().start_as_current_span("task.commit", attributes={
                    telemetry.FLOWMAKER_TASK: task_id, ATTR_ATTEMPT: attempt, ATTR_CONFLICT: False}) as span:
                tkv, t = await self._get(task_id)
                if t.state is not TaskState.SELECTING:
                    return None
                now = time.time()
                healing = None if t.healing is None else Healing(
                    HealAction.RESELECTING.value, t.healing.detail, t.healing.since, t.healing.attempts)
                deploying = t.moved(TaskState.DEPLOYING, now, variant=v, strategy=result.strategy or t.strategy,
                                    stage_instances=plan.stage_instances, new_instances=plan.deploy,
                                    predicted_latency_s=v.latency_s, healing=healing)
                try:
                    compares, puts = commit_ops(plan, view, tkv, deploying, now)
                except NoCapacity as e:  # the view moved under the selector's feet; select again
                    last = str(e)
                    span.set_attributes({ATTR_CONFLICT: True, ATTR_REASON: last})
                    continue
                res = await self.store.txn(compares, puts)
                span.set_attribute(ATTR_CONFLICT, not res.succeeded)
                if not res.succeeded:
                    span.set_attribute(ATTR_CONFLICT_KEYS, list(res.failed))
            if res.succeeded:
                log.info("committed (attempt %d) %s", attempt, plan.describe())
                return plan
            last = f"changed concurrently: {', '.join(res.failed)}"
            log.info("task %s: commit attempt %d lost a race (%s); selecting again", task_id, attempt, last)
            await asyncio.sleep(random.uniform(0.005, 0.05) * attempt)
        msg = (f"the cluster kept changing during {self.settings.commit_retries} select-and-commit attempts "
               f"(last: {last})")
        _, t = await self._get(task_id)
        if t.healing is not None:
            await self._wait_for_capacity(task_id, msg)
        else:
            await self._fail(task_id, Failure("Conflict", "SELECTION_CONFLICT", f"{msg}; approve again"))
        return None

    async def _node_endpoints(self) -> dict[str, str]:
        out = {}
        for kv in (await self.store.get_prefix(keys.NODES)).items:
            if isinstance(kv.value, dict):
                n = NodeRecord.from_json(kv.value)
                out[n.node] = n.endpoint
        return out

    async def _deploy_one(self, task_id: str, d: DeployedInstance, nodes: dict[str, str]) -> None:
        with _tracer().start_as_current_span("task.deploy_instance", attributes={
                telemetry.FLOWMAKER_TASK: task_id, telemetry.FLOWMAKER_INSTANCE: d.instance_id,
                ATTR_MODEL: d.model_id, ATTR_NODE: d.node, ATTR_GPUS: list(d.gpu_ids)}):
            endpoint = nodes.get(d.node)
            if not endpoint:
                raise Unavailable(f"node {d.node} of instance {d.instance_id} is not alive", reason="NODE_LOST")
            resp = await call(self.clients.deployer(endpoint).Deploy(deployer_pb2.DeployRequest(
                model_id=d.model_id, tp=d.tp, pp=d.pp, gpu_ids=list(d.gpu_ids),
                memory_gb_per_gpu=d.memory_gb_per_gpu, task_id=task_id, request_id=d.instance_id),
                timeout=self.settings.deploy_timeout_s))
            if resp.instance.state != cluster_pb2.Instance.STATE_READY:
                raise Unavailable(f"instance {d.instance_id} is "
                                  f"{cluster_pb2.Instance.State.Name(resp.instance.state)} after Deploy: "
                                  f"{resp.instance.failure.message}", reason="INSTANCE_NOT_READY")

    async def deploy(self, task_id: str) -> None:
        """Start every new instance of the committed plan, and wait for the reused ones that are not READY
        yet (another task's new instance, still PENDING or STARTING: Deploy by its id is idempotent and
        waits for the start, or starts it); ACTIVE once all serve, or roll back and FAILED."""
        with _tracer().start_as_current_span("task.deploy", attributes={telemetry.FLOWMAKER_TASK: task_id}) as span:
            _, t = await self._get(task_id)
            if t.state is not TaskState.DEPLOYING:
                return
            nodes = await self._node_endpoints()
            todo = list(t.new_instances) + await self._reused_not_ready(t)
            span.set_attribute(ATTR_INSTANCES, [d.instance_id for d in todo])
            results = await asyncio.gather(*(self._deploy_one(task_id, d, nodes) for d in todo),
                                           return_exceptions=True)
            errs = [(d, r) for d, r in zip(todo, results, strict=True) if isinstance(r, BaseException)]
            if errs:
                telemetry.mark_error(span, errs[0][1])
        if not errs:
            def active(x: TaskRecord) -> TaskRecord | None:
                return x.moved(TaskState.ACTIVE, time.time(), healing=None) if x.state is TaskState.DEPLOYING \
                    else None
            try:
                if await self._update(task_id, active) is not None:
                    log.info("task %s ACTIVE: %s", task_id, t.stage_instances)
                    return
            except NotFound:
                pass
            return  # deleted (DELETING) meanwhile: DeleteTask releases everything
        d, e = errs[0]
        if _is_transient(e):
            # etcd or the deployer unreachable: leave the task DEPLOYING; the reconciler deploys it again
            # (idempotent) after the outage, or rolls it back past its deadline.
            log.warning("task %s: deploy interrupted (%s); the reconciler retries it", task_id, e)
            raise e
        f = Failure.of(e)
        await self.rollback(task_id, f"deploying instance {d.instance_id} ({d.model_id} on "
                                     f"{'+'.join(d.gpu_ids)}) failed: {f.message}", f)

    async def rollback(self, task_id: str, why: str, failure: Failure | None = None) -> None:
        """Give back what a DEPLOYING task's commit reserved; FAILED, or (healing) SELECTING again later."""
        f = failure or Failure("DeadlineExceeded", "DEPLOY_DEADLINE_EXCEEDED", why)
        try:
            _, cur = await self._get(task_id)
        except NotFound:
            return
        if cur.state is not TaskState.DEPLOYING:
            return
        try:
            await self._release_all(cur)
        except FlowMakerError as rel:
            # FAILED all the same (nothing serves); the reconciler releases the references left
            # (a FAILED task holding references) once the deployer or etcd answers again.
            log.warning("task %s: rollback incomplete (%s); the reconciler finishes it", task_id, rel)
        if cur.healing is not None:
            def again(x: TaskRecord) -> TaskRecord | None:
                if x.state is not TaskState.DEPLOYING or x.healing is None:
                    return None
                return x.moved(TaskState.SELECTING, time.time(), healing=replace(
                    x.healing, action=HealAction.WAITING_FOR_CAPACITY.value, detail=why))
            with contextlib.suppress(NotFound):
                await self._update(task_id, again)
            await self._wait_for_capacity(task_id, why)
            return
        await self._fail(task_id, Failure(f.error, f.reason, why))

    async def _reused_not_ready(self, t: TaskRecord) -> list[DeployedInstance]:
        new = {d.instance_id for d in t.new_instances}
        out = []
        for iid in t.instance_ids:
            if iid in new:
                continue
            kv = await self.store.get(keys.instance(iid))
            rec = InstanceRecord.from_json(kv.value) if kv else None
            if rec is None:
                raise Unavailable(f"reused instance {iid} is gone", reason="INSTANCE_FAILED")
            if rec.state is not InstanceState.READY:
                out.append(DeployedInstance(iid, "", rec.model_id, rec.tp, rec.pp, rec.node, rec.gpu_ids,
                                            rec.memory_gb_per_gpu, 0.0))
        return out

    # ---- release -------------------------------------------------------------------------------

    async def _release_all(self, t: TaskRecord) -> list[str]:
        """Drop every reference the task holds; return the ids of instances stopped (no other user)."""
        with _tracer().start_as_current_span("task.release", attributes={telemetry.FLOWMAKER_TASK: t.id}) as span:
            stopped = await self._release_refs(t)
            span.set_attribute(ATTR_INSTANCES, stopped)
            return stopped

    async def _release_refs(self, t: TaskRecord) -> list[str]:
        refs = [keys.parse_reuse(kv.key) for kv in (await self.store.get_prefix(keys.REUSE)).items]
        mine = {iid for iid, tid in refs if tid == t.id}
        ids = set(t.instance_ids) | {d.instance_id for d in t.new_instances} | mine
        instances: dict[str, InstanceRecord] = {}
        for iid in sorted(ids):
            kv = await self.store.get(keys.instance(iid))
            if kv is not None:
                instances[iid] = InstanceRecord.from_json(kv.value)
            elif iid in mine:  # the instance is gone already; only our reference is left
                await self.store.delete(keys.reuse(iid, t.id))
        actions = plan_release(t, instances, refs)
        log.info("task %s: release %s", t.id, ", ".join(f"{a.instance_id}{'(stop)' if a.stop else ''}"
                                                         for a in actions) or "-")
        nodes = await self._node_endpoints()
        results = await asyncio.gather(*(self._release_one(t.id, a, nodes) for a in actions))
        return [a.instance_id for a, stopped in zip(actions, results, strict=True) if stopped]

    async def _release_one(self, task_id: str, a: ReleaseAction, nodes: dict[str, str]) -> bool:
        endpoint = nodes.get(a.node)
        if endpoint:
            # A live node's deployer must do it: dropping the reference behind its back would leave a
            # running engine nobody references, holding its GPU memory for good. Its errors propagate, the
            # task stays DELETING, and DeleteTask (or the next orchestrator's resume) tries again.
            resp = await call(self.clients.deployer(endpoint).Release(
                deployer_pb2.ReleaseRequest(instance_id=a.instance_id, task_id=task_id),
                timeout=self.settings.release_timeout_s))
            return bool(resp.stopped)
        # The node is gone: its instances are out of the live cluster already. Dropping our reference
        # is all that is left; the node's agent reconciles its GPUs when it comes back.
        await self.store.delete(keys.reuse(a.instance_id, task_id))
        return False

    # ---- DeleteTask ------------------------------------------------------------------------------

    async def delete(self, task_id: str) -> tuple[TaskRecord, list[str]]:
        def deleting(t: TaskRecord) -> TaskRecord | None:
            return None if t.state is TaskState.DELETING else t.moved(TaskState.DELETING, time.time())
        await self._update(task_id, deleting)
        _, t = await self._get(task_id)
        # A worker already on the task (a selection, a deploy) sees DELETING and stops; the delete runs
        # once it is done, as the task's next worker.
        cur = self._workers.get(task_id)
        if cur is not None and not cur.done():
            await asyncio.wait({cur}, timeout=self.settings.release_timeout_s)
        # The worker may be the reconciler's (it saw DELETING first): its result is kept for us.
        await asyncio.shield(self.start_worker(task_id, self.finish_delete(task_id)))
        return t, self._delete_results.pop(task_id, [])

    async def finish_delete(self, task_id: str) -> list[str]:
        try:
            _, t = await self._get(task_id)
        except NotFound:
            return []
        if t.state is not TaskState.DELETING:
            return []
        stopped = await self._release_all(t)
        await self.store.delete(keys.task(t.id))
        log.info("task %s deleted; stopped %s", t.id, stopped or "nothing")
        if len(self._delete_results) > 1000:  # deletes nobody waited for (resumed after a restart)
            self._delete_results.clear()
        self._delete_results[task_id] = stopped
        self.arrivals.forget(task_id)
        return stopped

    # ---- restart -------------------------------------------------------------------------------

    async def resume(self) -> None:
        """Finish what a previous life of the orchestrator left half done: the reconciler's first pass
        does it (see the module docstring); this waits for that pass when etcd answers."""
        await self.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.reconciler.synced.wait(), self.settings.reconcile_interval_s + 5.0)

    # ---- following the load (called by the reconciler) ----------------------------------------------

    async def reselect_for_load(self, task_id: str, rate_rps: float, why: str) -> None:
        """Make-before-break re-selection of a serving task for the rate it really gets: select against the
        live cluster, commit the new variant beside the current one in one guarded txn, deploy it, switch
        requests to it, drain and release the old one. The task keeps serving on its current variant
        throughout; on any failure it stays there.

        Two selections: (A) the task may keep its instances at the new rate (its own share taken off them),
        which says whether the current variant still fits; (B) the instances only it uses are not offered
        (they would be released), which says what a fresh variant costs. Reuse is free in the spec's cost,
        so without (B) a task would never give back capacity it no longer needs. The current variant is
        kept when it fits and costs no more (its exclusive memory x its latency) than (B)'s."""
        _, t = await self._get(task_id)
        if t.state is not TaskState.ACTIVE or t.healing is not None or t.next_variant is not None:
            return
        log.warning("task %s: re-selecting for load at %.3g req/s (%s)", task_id, rate_rps, why)
        listing = (await self.store.get_prefix(keys.REUSE)).items
        refs = {keys.parse_reuse(kv.key)[0]: reuse_load(kv.value) for kv in listing
                if keys.parse_reuse(kv.key)[1] == task_id}
        shared = {keys.parse_reuse(kv.key)[0] for kv in listing if keys.parse_reuse(kv.key)[1] != task_id}
        exclusive = set(refs) - shared
        note = Reselection(time.time(), why, rate_rps, previous_shares=refs)
        capacity_model: selection_pb2.CapacityModel | None = None
        for attempt in range(1, self.settings.commit_retries + 1):
            view = await read_live_cluster(self.store)
            if capacity_model is None:
                capacity_model = (await self._selection_options(t, view.cluster)).capacity_model
            seen = excluding_task(view, refs)
            reps = self.settings.load_max_replicas  # scaling a stage out is one of the answers
            a = await self._select_at(t, rate_rps, seen.cluster, max_replicas=reps)
            fresh = replace(seen.cluster, instances=tuple(i for i in seen.cluster.instances if i.id not in exclusive))
            b = await self._select_at(t, rate_rps, fresh, max_replicas=reps) if exclusive else None
            tkv, cur = await self._get(task_id)
            if cur.state is not TaskState.ACTIVE or cur.next_variant is not None:
                return
            fits = a is not None and a.workflow_id == (cur.variant.workflow_id if cur.variant else "") and \
                not a.new_instances and {x.stage_id: x.instance_id for x in a.assignments if x.reused} == \
                cur.stage_instances
            chosen: Variant | None = a or b
            same = False
            if fits and a is not None:
                mem = {i.id: i for i in view.instances.values()}
                keep_cost = sum(mem[i].memory_gb_per_gpu * mem[i].tp * mem[i].pp for i in exclusive if i in mem) \
                    * a.latency_s
                chosen, same = (a, True) if b is None or keep_cost <= b.cost else (b, False)
            if chosen is None:
                await self._note_reselection(task_id, replace(
                    note, outcome="FAILED", reason=f"{why}; no feasible variant at {rate_rps:.3g} req/s"))
                return
            v = chosen
            scale = await self._load_scale(t, v, view.cluster, capacity_model, await self._models())
            plan = plan_commit(task_id, v, [new_instance_id(n.model_id) for n in v.new_instances], load_scale=scale)
            now = time.time()
            if same:
                # The current variant still fits the new rate and costs no more: only its shares move.
                new_t = replace(cur, update_time=now, planned_rate_rps=rate_rps, variant=v,
                                predicted_latency_s=v.latency_s, last_reselection=replace(
                                    note, outcome="DONE", reason=f"{why}; the current variant fits"))
            else:
                new_t = replace(cur, update_time=now, next_variant=v, next_stage_instances=plan.stage_instances,
                                next_new_instances=plan.deploy, last_reselection=note)
            try:
                compares, puts = commit_ops(plan, view, tkv, new_t, now, held=refs)
            except NoCapacity:
                continue
            res = await self.store.txn(compares, puts)
            if not res.succeeded:
                await asyncio.sleep(random.uniform(0.005, 0.05) * attempt)
                continue
            if same:
                return
            log.info("task %s: switching (attempt %d) %s", task_id, attempt, plan.describe())
            await self.switch_variant(task_id)
            return
        await self._note_reselection(task_id, replace(note, outcome="FAILED",
                                                      reason=f"{why}; the cluster kept changing"))

    async def _select_at(self, t: TaskRecord, rate_rps: float, cluster: Cluster, *, max_replicas: int = 1
                         ) -> Variant | None:
        """The selector's variant for `t`'s approved workflows at `rate_rps` on `cluster` (None: infeasible),
        with at least `max_replicas` replicas per new instance allowed."""
        req = await self._selection_request(t, cluster, rate_rps=rate_rps, max_replicas=max_replicas)
        result = convert.selection_result_from_proto(await call(self.clients.selector.SelectVariant(
            req, timeout=self.settings.select_timeout_s)))
        return result.variant

    async def _selection_request(self, t: TaskRecord, cluster: Cluster, *, rate_rps: float | None = None,
                                 max_replicas: int = 0) -> selector_pb2.SelectVariantRequest:
        """The SelectVariant request for `t`'s approved workflows on `cluster`, at `rate_rps` (None: the SLO's
        declared rate), with at least `max_replicas` replicas per new instance allowed (0: the options' own).
        An approval's selection, a healing re-selection and the load follower's all build it here: the
        approval's options with the orchestrator's defaults for what they leave unset (`_selection_options`),
        and under INTERFERENCE each running instance's `max_slowdown`, the least SLO / latency alone of the
        other tasks using it, so that no selection slows co-residents past their SLOs, and its `busy_share` =
        max(the measured one when fresh, the planned one: occupancy of the call-seconds/s the other tasks' variants
        offer it at their planned rates), so that an instance deployed before its traffic arrives is not taken for
        idle (both from flowmaker.orchestration.cluster.read_task_uses)."""
        models = await self._models()
        options = await self._selection_options(t, cluster)
        if max_replicas:
            options.max_replicas = max(options.max_replicas, max_replicas)
        gpu_type = cluster_gpu_type(cluster, "")
        if options.gpu_sharing == selection_pb2.GPU_SHARING_INTERFERENCE and cluster.instances and gpu_type:
            uses = await read_task_uses(self.store, gpu_type, models or default_models(), exclude=t.id)
            cluster = with_planned_busy(with_tolerances(cluster, tolerances_of(uses)), planned_busy_shares(uses))
        slo = t.slo if rate_rps is None else replace(t.slo, arrival_rate_rps=rate_rps)
        return selector_pb2.SelectVariantRequest(
            slo=convert.slo_to_proto(slo),
            workflows=[convert.workflow_to_proto(w) for w in t.candidates if w.id in t.approved_workflow_ids],
            cluster=convert.cluster_to_proto(cluster), strategy=t.strategy,
            models=[convert.model_to_proto(m) for m in models], options=options)

    async def _load_scale(self, t: TaskRecord, v: Variant, cluster: Cluster,
                          capacity_model: selection_pb2.CapacityModel | None, models: Sequence[Model]
                          ) -> dict[tuple[str, int, int], float] | None:
        """What turns `v`'s loads into the planned loads a commit records (`plan_commit`'s `load_scale`): under
        BUSY_TIME their busy-time equivalent at `v`'s workflow's mean request on the profiles the selector saw
        (`busy_load_scale`), which is how later selections read running loads; None otherwise (output
        tokens/s as selected), or when the profiles cannot be read (logged)."""
        if capacity_model != selection_pb2.CAPACITY_MODEL_BUSY_TIME:
            return None
        wf = next((w for w in t.candidates if w.id == v.workflow_id), None)
        if wf is None or not any(s.is_llm for s in wf.stages):
            return None
        used = {(a.model_id, a.tp, a.pp) for a in v.assignments if a.model_id}
        used |= {(n.model_id, n.tp, n.pp) for n in v.new_instances}
        gpu_type = cluster_gpu_type(cluster, "")
        if not used or not gpu_type:
            return None
        try:
            profiles = await read_used_profiles(self.store, gpu_type, models or default_models(), used)
        except (NotFound, InvalidSpec) as e:
            log.warning("task %s: no profiles on GPU type %r to record busy-time loads: %s", t.id, gpu_type, e)
            return None
        return busy_load_scale(wf, profiles.values())

    async def _selection_options(self, t: TaskRecord, cluster: Cluster) -> selection_pb2.SelectionOptions:
        """The approval's options (`t.options_json`) with what they leave unset taken from the settings:
        `capacity_model` (DEFAULT_CAPACITY_MODEL, BUSY_TIME), `gpu_sharing` (DEFAULT_GPU_SHARING, INTERFERENCE)
        and, under INTERFERENCE, `interference` (DEFAULT_INTERFERENCE, or when that is negative the kappa the
        profiler stored for the cluster's GPU type; 1 when none is). Explicit options always win."""
        s = self.settings
        o = convert.selection_options_from_json(t.options_json) if t.options_json else selection_pb2.SelectionOptions()
        if o.capacity_model == selection_pb2.CAPACITY_MODEL_UNSPECIFIED:
            o.capacity_model = cast(selection_pb2.CapacityModel, selection_pb2.CapacityModel.Value(
                f"CAPACITY_MODEL_{s.default_capacity_model}"))
        if o.gpu_sharing == selection_pb2.GPU_SHARING_UNSPECIFIED:
            o.gpu_sharing = cast(selection_pb2.GpuSharing, selection_pb2.GpuSharing.Value(
                f"GPU_SHARING_{s.default_gpu_sharing}"))
        if o.gpu_sharing == selection_pb2.GPU_SHARING_INTERFERENCE and not o.HasField("interference"):
            if s.default_interference >= 0:
                o.interference = s.default_interference
            else:
                gpu_type = cluster_gpu_type(cluster, "")
                o.interference = await InterferenceStore(self.store).kappa(gpu_type) if gpu_type \
                    else DEFAULT_INTERFERENCE
        return o

    async def switch_variant(self, task_id: str) -> None:
        """Deploy the task's next variant, route requests to it, drain and release what only the old one used.
        Idempotent (the reconciler resumes it); past its deadline, or when the deploy fails, the next variant
        is rolled back and the task keeps its current one."""
        _, t = await self._get(task_id)
        if t.next_variant is None:
            return
        nodes = await self._node_endpoints()
        todo = list(t.next_new_instances)
        new_ids = {d.instance_id for d in todo}
        for iid in sorted(set(t.next_stage_instances.values()) - new_ids):
            kv = await self.store.get(keys.instance(iid))
            rec = InstanceRecord.from_json(kv.value) if kv else None
            if rec is not None and rec.state is not InstanceState.READY:
                todo.append(DeployedInstance(iid, "", rec.model_id, rec.tp, rec.pp, rec.node, rec.gpu_ids,
                                             rec.memory_gb_per_gpu, 0.0))
        results = await asyncio.gather(*(self._deploy_one(task_id, d, nodes) for d in todo), return_exceptions=True)
        errs = [r for r in results if isinstance(r, BaseException)]
        if errs:
            if _is_transient(errs[0]):
                raise errs[0]  # the reconciler resumes the switch after the outage
            await self.abort_switch(task_id, f"deploying the new variant failed: {errs[0]}")
            return

        def swap(x: TaskRecord) -> TaskRecord | None:
            if x.next_variant is None or x.state is not TaskState.ACTIVE:
                return None
            note = x.last_reselection
            return replace(x, update_time=time.time(), variant=x.next_variant, stage_instances=x.next_stage_instances,
                           new_instances=x.next_new_instances, next_variant=None, next_stage_instances={},
                           next_new_instances=(), planned_rate_rps=note.rate_rps if note else x.planned_rate_rps,
                           predicted_latency_s=x.next_variant.latency_s,
                           last_reselection=replace(note, outcome="DONE") if note else None)
        old = set(t.stage_instances.values())
        new = await self._update(task_id, swap)
        if new is None:
            return
        self.reconciler.note_task(new)
        log.warning("task %s: switched to %s", task_id, new.stage_instances)
        await self._drain_and_release(task_id, old - set(new.stage_instances.values()))

    async def _drain_and_release(self, task_id: str, instance_ids: set[str]) -> None:
        """Let requests already routed to the old instances finish (bounded), then drop the task's references."""
        end = time.monotonic() + self.settings.drain_timeout_s
        while any(self._inflight.get(i, 0) for i in instance_ids) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        nodes = await self._node_endpoints()
        recs = {}
        for iid in instance_ids:
            kv = await self.store.get(keys.instance(iid))
            if kv is not None:
                recs[iid] = InstanceRecord.from_json(kv.value)
        await asyncio.gather(*(self._release_one(task_id, ReleaseAction(iid, r.node, False), nodes)
                               for iid, r in sorted(recs.items())))

    async def abort_switch(self, task_id: str, why: str) -> None:
        """Roll back a next variant: drop its references (stopping what only it used), restore the current
        variant's shares, keep serving on the current variant."""
        _, t = await self._get(task_id)
        if t.next_variant is None:
            return
        old_ids = set(t.stage_instances.values())
        nodes = await self._node_endpoints()
        for iid in sorted(set(t.next_stage_instances.values()) - old_ids):
            kv = await self.store.get(keys.instance(iid))
            if kv is not None:
                await self._release_one(task_id, ReleaseAction(iid, InstanceRecord.from_json(kv.value).node, False),
                                        nodes)
        # The shares of instances both variants use were moved to the new rate: back to what they were.
        before = t.last_reselection.previous_shares if t.last_reselection else {}
        for iid in sorted(old_ids & set(t.next_stage_instances.values())):
            if iid in before:
                await self._set_share(iid, task_id, before[iid])

        def clear(x: TaskRecord) -> TaskRecord | None:
            if x.next_variant is None:
                return None
            note = x.last_reselection
            return replace(x, update_time=time.time(), next_variant=None, next_stage_instances={},
                           next_new_instances=(), last_reselection=replace(note, outcome="FAILED", reason=f"{note.reason}; {why}")
                           if note else None)
        await self._update(task_id, clear)
        log.warning("task %s: switch aborted (%s); it keeps its current variant", task_id, why)

    async def _set_share(self, iid: str, task_id: str, load: float) -> None:
        """Rewrite one reuse reference's load and the instance's planned load by the difference (one txn)."""
        for _ in range(self.settings.commit_retries):
            ikv, rkv = await self.store.get(keys.instance(iid)), await self.store.get(keys.reuse(iid, task_id))
            if ikv is None or rkv is None:
                return
            rec = InstanceRecord.from_json(ikv.value)
            new = replace(rec, load_output_tokens_per_s=round(max(0.0, rec.load_output_tokens_per_s
                                                                  - reuse_load(rkv.value) + load), 6))
            res = await self.store.txn([Compare.unchanged(ikv.key, ikv.mod_revision),
                                        Compare.unchanged(rkv.key, rkv.mod_revision)],
                                       [Put(ikv.key, new.to_json()), Put(rkv.key, reuse_value(iid, task_id, load))])
            if res.succeeded:
                return

    async def _note_reselection(self, task_id: str, note: Reselection) -> None:
        def fn(x: TaskRecord) -> TaskRecord | None:
            return replace(x, last_reselection=note, update_time=time.time()) if x.state is TaskState.ACTIVE else None
        with contextlib.suppress(NotFound):
            await self._update(task_id, fn)
        log.warning("task %s: re-selection for load %s: %s", task_id, note.outcome, note.reason)

    # ---- healing (called by the reconciler) ------------------------------------------------------

    async def reselect(self, task_id: str, why: str) -> None:
        """An ACTIVE task whose variant cannot serve again: select a new one against the live cluster
        (releasing the old references first), commit it with the same guarded txn as an approval, deploy."""
        def fn(t: TaskRecord) -> TaskRecord | None:
            if t.state is not TaskState.ACTIVE:
                return None
            now = time.time()
            h = t.healing
            return t.moved(TaskState.SELECTING, now, healing=Healing(
                HealAction.RESELECTING.value, why, h.since if h else now, (h.attempts if h else 0) + 1))
        if await self._update(task_id, fn) is None:
            return
        log.warning("task %s: re-selecting (%s)", task_id, why)
        await self.select_commit_deploy(task_id)

    async def restart_instance(self, iid: str, task_ids: Sequence[str], why: str) -> None:
        """Restart a FAILED instance in place (same id, GPUs and memory): every task sharing it heals."""
        for tid in task_ids:
            def fn(t: TaskRecord) -> TaskRecord | None:
                if t.state is not TaskState.ACTIVE:
                    return None
                now = time.time()
                h = t.healing
                return replace(t, update_time=now, healing=Healing(
                    HealAction.RESTARTING_INSTANCE.value, why, h.since if h else now, (h.attempts if h else 0) + 1))
            with contextlib.suppress(NotFound):
                await self._update(tid, fn)
        kv = await self.store.get(keys.instance(iid))
        if kv is None:
            return
        rec = InstanceRecord.from_json(kv.value)
        if rec.state is not InstanceState.FAILED:
            return
        endpoint = (await self._node_endpoints()).get(rec.node)
        if not endpoint:
            raise Unavailable(f"node {rec.node} of instance {iid} is not alive", reason="NODE_LOST")
        with _tracer().start_as_current_span("task.restart_instance", attributes={
                telemetry.FLOWMAKER_INSTANCE: iid, ATTR_MODEL: rec.model_id, ATTR_NODE: rec.node,
                ATTR_GPUS: list(rec.gpu_ids)}):
            await call(self.clients.deployer(endpoint).Deploy(deployer_pb2.DeployRequest(
                model_id=rec.model_id, tp=rec.tp, pp=rec.pp, gpu_ids=list(rec.gpu_ids),
                memory_gb_per_gpu=rec.memory_gb_per_gpu, task_id=task_ids[0] if task_ids else "",
                request_id=iid, engine=rec.engine), timeout=self.settings.deploy_timeout_s))
        log.warning("instance %s restarted in place for %s", iid, ", ".join(task_ids))

    async def mark_lost(self, iid: str, why: str) -> None:
        def fn(r: InstanceRecord) -> InstanceRecord | None:
            if r.state not in (InstanceState.PENDING, InstanceState.STARTING, InstanceState.READY):
                return None
            # The endpoint stays: an engine whose node agent is only cut off may still answer, and is routed to
            # while it does (the reconciler probes it) until its tasks have moved off it.
            return replace(r, state=InstanceState.LOST, reason=why, failure_reason="NODE_LOST")
        for _ in range(self.settings.commit_retries):
            kv = await self.store.get(keys.instance(iid))
            if kv is None:
                return
            new = fn(InstanceRecord.from_json(kv.value))
            if new is None:
                return
            if await self.store.get(keys.node(new.node)) is not None:
                return  # the node came back meanwhile
            try:
                await self.store.cas(kv.key, new.to_json(), etag=kv.mod_revision)
                return
            except Conflict:
                continue

    async def clear_healing(self, task_id: str) -> None:
        def fn(t: TaskRecord) -> TaskRecord | None:
            if t.state is not TaskState.ACTIVE or t.healing is None:
                return None
            log.info("task %s healed after %.1fs (%s)", task_id, time.time() - t.healing.since, t.healing.action)
            return replace(t, healing=None, update_time=time.time())
        with contextlib.suppress(NotFound):
            await self._update(task_id, fn)

    async def release_failed(self, task_id: str) -> None:
        """Finish the rollback of a FAILED task whose references could not all be released then."""
        with contextlib.suppress(NotFound):
            _, t = await self._get(task_id)
            if t.state is TaskState.FAILED:
                await self._release_all(t)

    async def drop_reference(self, iid: str, task_id: str, node: str) -> None:
        """A reference naming a task that does not exist, or a settled ACTIVE task that does not use the
        instance (a delete, rollback or switch cut short): drop it."""
        endpoint = (await self._node_endpoints()).get(node) if node else ""
        kv = await self.store.get(keys.task(task_id))
        if kv is not None:
            t = TaskRecord.from_json(kv.value)
            if (t.state is not TaskState.ACTIVE or t.next_variant is not None or iid in t.instance_ids
                    or task_id in self.busy_tasks()):
                return
        await self._release_one(task_id, ReleaseAction(iid, node, False), {node: endpoint} if endpoint else {})

    async def stop_orphan(self, iid: str, node: str) -> None:
        """Stop an instance no reference names. The deployer stops it only if it is still unreferenced
        when it looks (an id that names no task: a concurrent reuse commit keeps it alive)."""
        endpoint = (await self._node_endpoints()).get(node)
        if not endpoint:
            return
        await call(self.clients.deployer(endpoint).Release(
            deployer_pb2.ReleaseRequest(instance_id=iid, task_id=ORPHAN_GC_TASK_ID),
            timeout=self.settings.release_timeout_s))

    # ---- Invoke --------------------------------------------------------------------------------

    async def invoke(self, task_id: str, text: str, *, max_output_tokens: int = 0,
                     on_event: OnEvent | None = None) -> Execution:
        # The RPC's SERVER span is the request's root: it names the task, and each stage gets a child span.
        root = trace.get_current_span()
        root.set_attribute(telemetry.FLOWMAKER_TASK, task_id)
        if max_output_tokens < 0:
            raise InvalidSpec(f"must be >= 0 (0 = the stage's output_tokens), got {max_output_tokens}",
                              field="max_output_tokens")
        t = await self._route_task(task_id)
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
        token = self.arrivals.arrived(task_id, time.time())
        try:
            insts: dict[str, InstanceRecord] = {}
            for iid in t.instance_ids:
                rec = await self._route_instance(iid)
                if rec is not None and rec.endpoint and (rec.state is InstanceState.READY or (
                        rec.state is InstanceState.LOST and self.reconciler.answers(iid))):
                    insts[iid] = rec
            for stage in wf.stages:
                ids = replicas_of(t.stage_instances, stage.id) if stage.is_llm else []
                if not ids or any(i in insts for i in ids):
                    continue  # a replica group serves while at least one of its replicas does
                iid = ids[0]
                # Being healed: wait (within the request's deadline) for the replacement rather than fail.
                rec = await self._await_replacement(task_id, iid, None)
                if rec is None:
                    cur = await self._route_instance(iid)
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
                with _tracer().start_as_current_span(f"stage {stage.id}", attributes=attrs):
                    return await stage_io(stage, prompt)

            async def stage_io(stage: Stage, prompt: str) -> StageResult:
                if not stage.is_llm:
                    # TOOL stages are emulated: they take their declared latency and pass their filled
                    # prompt through as output (no real tool runs).
                    await asyncio.sleep(stage.latency_s / self.settings.tool_time_scale)
                    return StageResult(stage.id, prompt, input_tokens=len(prompt.split()),
                                       output_tokens=len(prompt.split()))
                rec = self._pick_replica(insts, replicas_of(t.stage_instances, stage.id))
                max_tokens = min(stage.output_tokens, max_output_tokens) if max_output_tokens else stage.output_tokens
                max_tokens = self._clamp_to_context(stage, rec.model_id, prompt, max_tokens)
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
                    self._inflight[rec.id] += 1
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
                        new = await self._await_replacement(task_id, rec.id, rec.endpoint, stage.id)
                        if new is None:
                            raise
                        self._inflight[rec.id] -= 1
                        rec = new
                        self._inflight[rec.id] += 1
                        c = await self.engines.chat(rec.endpoint, rec.model_id, prompt, max(1, max_tokens),
                                                    timeout_s=deadline_s(self.settings.invoke_timeout_s),
                                                    api_key=rec.api_key,  # the engine's per-instance key (deployer)
                                                    instance_id=rec.id, on_delta=counted if on_event else None)
                    finally:
                        self._inflight[rec.id] -= 1
                    pt, ct, text = pt + c.prompt_tokens, ct + c.completion_tokens, c.text
                # finish_reason: the engine's, of the last call (the one whose text is the output).
                return StageResult(stage.id, text, rec.id, rec.model_id, pt, ct, finish_reason=c.finish_reason)

            async def done(r: StageResult) -> None:
                if on_event is not None:
                    await on_event("stage_done", r)

            self._admit(task_id, t, wf, insts)
            ex = await execute(wf, text, run_stage, done)
        except BaseException:
            self.arrivals.abandoned(task_id, token)
            raise
        self.arrivals.finished(task_id, time.time(), ex.latency_s, token)
        # Accounting is off the request's path: batched into the task record by `_flush_loop`.
        pending = self._pending_obs[task_id]
        pending.append(ex.latency_s)
        del pending[:-self.settings.latency_window]
        return ex

    def _clamp_to_context(self, stage: Stage, model_id: str, prompt: str, max_tokens: int) -> int:
        """`max_tokens` clamped so that prompt + completion fit the model's context (when it is known);
        INVALID_ARGUMENT (limit context_tokens) when the prompt alone leaves no room. The prompt is counted
        in words, as the emulated engine counts; a real engine whose tokenizer counts more answers 400,
        which `EngineClient.chat` reports as INVALID_ARGUMENT too."""
        ctx = self._contexts.get(model_id)
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

    def _pick_replica(self, insts: dict[str, InstanceRecord], ids: list[str]) -> InstanceRecord:
        """The serving replica with the least outstanding work (engine calls in flight from here); ties at
        random, so that equal replicas share the load. One whose engine does not answer its node's health probe
        (`unresponsive_since`, maybe hung) only when no other replica serves."""
        recs = [insts[i] for i in ids if i in insts]
        return min(recs, key=lambda r: (r.unresponsive_since > 0, self._inflight[r.id], random.random()))

    def _admit(self, task_id: str, t: TaskRecord, wf: Workflow, insts: dict[str, InstanceRecord]) -> None:
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

    async def _route_task(self, task_id: str) -> TaskRecord:
        if not task_id:
            raise InvalidSpec("must not be empty", field="task_id")
        t = self.reconciler.task(task_id) if self.reconciler.fresh else None
        if t is not None and t.state in SERVING_STATES:
            return t
        # Not in the cache, or not serving there: etcd may be ahead of the watch (a task that has just gone
        # ACTIVE). When etcd does not answer, the cache's word stands.
        try:
            return (await self._get(task_id))[1]
        except Unavailable:
            if t is None:
                raise
            return t

    async def _route_instance(self, iid: str) -> InstanceRecord | None:
        rec = self.reconciler.instance(iid) if self.reconciler.fresh else None
        if rec is not None and rec.state is InstanceState.READY:
            return rec
        try:
            kv = await self.store.get(keys.instance(iid))
        except Unavailable:
            return rec
        return InstanceRecord.from_json(kv.value) if kv else None

    async def _await_replacement(self, task_id: str, iid: str, old_endpoint: str | None,
                                 stage_id: str = "") -> InstanceRecord | None:
        """Wait, within the request's deadline and `invoke_heal_wait_s`, until the instance serving
        `stage_id` (or `iid`) is READY at an endpoint other than `old_endpoint`: the same instance
        restarted in place, or the re-selected variant's. None when that does not happen in time."""
        wait = min(self.settings.invoke_heal_wait_s, deadline_s(self.settings.invoke_timeout_s) - 1.0)
        if wait <= 0 or not self.reconciler.fresh:
            return None
        self.reconciler.kick()
        end = time.monotonic() + wait
        while time.monotonic() < end:
            t = self.reconciler.task(task_id)
            if t is None or t.state is TaskState.DELETING or t.state is TaskState.FAILED:
                return None
            cur = t.stage_instances.get(stage_id, iid) if stage_id else iid
            rec = self.reconciler.instance(cur)
            if (t.state is TaskState.ACTIVE and rec is not None and rec.state is InstanceState.READY
                    and rec.endpoint and rec.endpoint != old_endpoint):
                return rec
            await asyncio.sleep(0.1)
        return None

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.observe_flush_interval_s)
            try:
                await self._flush_observations()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd down: keep them (bounded) for the next flush
                log.debug("request accounting not flushed: %s", e)

    async def _flush_observations(self) -> None:
        """Write the batched Invoke latencies into their task records (one CAS per task); best effort."""
        for task_id in list(self._pending_obs):
            batch = self._pending_obs.pop(task_id)
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
                await self._update(task_id, fn)
            except NotFound:
                continue
            except FlowMakerError:
                kept = self._pending_obs[task_id]
                kept[:0] = batch
                del kept[:-self.settings.latency_window]
                raise
