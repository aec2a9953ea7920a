"""The orchestrator's I/O: carries out the core's decisions against etcd, the selector, the deployers and the engines.

Everything it knows lives in etcd (task records under `keys.task`, plus the deployer's GPU, instance and
reuse keys), so a restarted orchestrator resumes where it stopped (`resume()`): a DEPLOYING task's
instances are deployed again (Deploy is idempotent by request_id = instance id), a DELETING task's
release is finished, and a SELECTING task (nothing committed yet) goes back to AWAITING_APPROVAL.
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
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import trace

from flowmaker import convert, telemetry
from flowmaker.api.common.v1 import cluster_pb2, selection_pb2
from flowmaker.api.deployer.v1 import deployer_pb2
from flowmaker.api.selector.v1 import selector_pb2
from flowmaker.domain import Slo, Stage, Workflow
from flowmaker.errors import (
    Conflict,
    FailedPrecondition,
    FlowMakerError,
    InvalidSpec,
    NoCapacity,
    NotFound,
    Unavailable,
)
from flowmaker.orchestration.cluster import read_live_cluster
from flowmaker.orchestration.commit import CommitPlan, ReleaseAction, commit_ops, plan_commit, plan_release
from flowmaker.orchestration.dag import Execution, StageResult, execute
from flowmaker.orchestration.task import SERVING_STATES, DeployedInstance, Failure, TaskRecord, TaskState, derive_state
from flowmaker.rpc.channels import deadline_s
from flowmaker.rpc.errors import call, incoming_deadline
from flowmaker.state import keys
from flowmaker.state.records import InstanceRecord, InstanceState, NodeRecord, new_instance_id
from flowmaker.state.store import KeyValue, StateStore
from services.orchestrator.clients import Clients
from services.orchestrator.engines import EngineClient, OnDelta
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


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, clients: Clients,
                 engines: EngineClient | None = None) -> None:
        self.settings = settings
        self.store = store
        self.clients = clients
        self.engines = engines or EngineClient(settings.http_pool_size)
        self._obs_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._background: set[asyncio.Task[Any]] = set()

    async def close(self) -> None:
        for t in tuple(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.engines.close()

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
        return TaskView(t, kv.mod_revision, state, failure)

    async def list_tasks(self, state: TaskState | None = None) -> list[TaskView]:
        out = []
        for kv in (await self.store.get_prefix(keys.TASKS)).items:
            t = TaskRecord.from_json(kv.value)
            st, f = derive_state(t, await self._instance_states(t)) if t.state is TaskState.ACTIVE \
                else (t.state, t.failure)
            if state is None or st is state:
                out.append(TaskView(t, kv.mod_revision, st, f))
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
        ids: set[str] = set()
        for i, w in enumerate(workflows):
            w.validate(f"workflows[{i}]")
            if w.id in ids:
                raise InvalidSpec(f"duplicate workflow id {w.id!r}", field=f"workflows[{i}].id")
            ids.add(w.id)
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
                      strategy=strategy or self.settings.default_strategy)
        await self.store.cas(kv.key, sel.to_json(), etag=kv.mod_revision)  # Conflict: a concurrent approval won
        # Shielded: a client that gives up must not leave a half-committed, half-deployed task behind.
        await asyncio.shield(self._spawn(self._select_commit_deploy(task_id, options)))
        return await self.view(task_id)

    async def _select_commit_deploy(self, task_id: str, options: selection_pb2.SelectionOptions | None) -> None:
        try:
            plan = await self._select_and_commit(task_id, options)
        except _Rejected as r:
            # The approval itself was wrong (an unknown strategy, options the selector refuses): nothing
            # was committed, so the task goes back to AWAITING_APPROVAL and the caller gets the error to
            # fix and approve again, rather than a task FAILED for good by a typo.
            def back(t: TaskRecord) -> TaskRecord | None:
                return t.moved(TaskState.AWAITING_APPROVAL, time.time()) if t.state is TaskState.SELECTING else None
            with contextlib.suppress(NotFound):
                await self._update(task_id, back)
            raise r.error from None
        except Exception as e:  # nothing is reserved before the commit: failing the task is all
            if not isinstance(e, FlowMakerError):
                log.exception("task %s: selection failed", task_id)
            await self._fail(task_id, Failure.of(e))
            return
        if plan is not None:
            await self._deploy(task_id)

    async def _select_and_commit(self, task_id: str, options: selection_pb2.SelectionOptions | None
                                 ) -> CommitPlan | None:
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
                req = selector_pb2.SelectVariantRequest(
                    slo=convert.slo_to_proto(t.slo),
                    workflows=[convert.workflow_to_proto(w) for w in t.candidates if w.id in t.approved_workflow_ids],
                    cluster=convert.cluster_to_proto(view.cluster), strategy=t.strategy)
                if options is not None:
                    req.options.CopyFrom(options)
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
                await self._fail(task_id, Failure("NoCapacity", reason,
                                                  f"no feasible variant: {result.reason_detail or reason}"))
                return None
            v = result.variant
            plan = plan_commit(task_id, v, [new_instance_id(n.model_id) for n in v.new_instances])
            with _tracer().start_as_current_span("task.commit", attributes={
                    telemetry.FLOWMAKER_TASK: task_id, ATTR_ATTEMPT: attempt, ATTR_CONFLICT: False}) as span:
                tkv, t = await self._get(task_id)
                if t.state is not TaskState.SELECTING:
                    return None
                now = time.time()
                deploying = t.moved(TaskState.DEPLOYING, now, variant=v, strategy=result.strategy or t.strategy,
                                    stage_instances=plan.stage_instances, new_instances=plan.deploy,
                                    predicted_latency_s=v.latency_s)
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
        await self._fail(task_id, Failure("Conflict", "SELECTION_CONFLICT",
                                          f"the cluster kept changing during {self.settings.commit_retries} "
                                          f"select-and-commit attempts (last: {last}); approve again"))
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

    async def _deploy(self, task_id: str) -> None:
        """Start every new instance of the committed plan, and wait for the reused ones that are not READY
        yet (another task's new instance, still PENDING or STARTING: Deploy by its id is idempotent and
        waits for the start, or starts it); ACTIVE once all serve, or roll back and FAILED."""
        with _tracer().start_as_current_span("task.deploy", attributes={telemetry.FLOWMAKER_TASK: task_id}) as span:
            _, t = await self._get(task_id)
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
                return x.moved(TaskState.ACTIVE, time.time()) if x.state is TaskState.DEPLOYING else None
            try:
                if await self._update(task_id, active) is not None:
                    log.info("task %s ACTIVE: %s", task_id, t.stage_instances)
                    return
            except NotFound:
                pass
            return  # deleted (DELETING) meanwhile: DeleteTask releases everything
        d, e = errs[0]
        f = Failure.of(e)
        failure = Failure(f.error, f.reason, f"deploying instance {d.instance_id} ({d.model_id} on "
                                             f"{'+'.join(d.gpu_ids)}) failed: {f.message}")
        try:
            _, cur = await self._get(task_id)
            if cur.state is TaskState.DEPLOYING:
                await self._release_all(cur)
        except NotFound:
            pass
        except FlowMakerError as rel:
            # FAILED all the same (nothing serves); the references left are listed on the instances, and
            # DeleteTask releases them (it releases whatever reuse keys still name the task).
            log.warning("task %s: rollback incomplete (%s); DeleteTask will finish it", task_id, rel)
        await self._fail(task_id, failure)

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
        stopped = await asyncio.shield(self._spawn(self._finish_delete(t)))
        return t, stopped

    async def _finish_delete(self, t: TaskRecord) -> list[str]:
        stopped = await self._release_all(t)
        await self.store.delete(keys.task(t.id))
        log.info("task %s deleted; stopped %s", t.id, stopped or "nothing")
        return stopped

    # ---- restart -------------------------------------------------------------------------------

    async def resume(self) -> None:
        """Finish what a previous life of the orchestrator left half done (see the module docstring)."""
        for kv in (await self.store.get_prefix(keys.TASKS)).items:
            t = TaskRecord.from_json(kv.value)
            if t.state is TaskState.SELECTING:
                with contextlib.suppress(FlowMakerError):
                    await self.store.cas(kv.key, t.moved(TaskState.AWAITING_APPROVAL, time.time()).to_json(),
                                         etag=kv.mod_revision)
                    log.warning("task %s was SELECTING when the orchestrator stopped; approve it again", t.id)
            elif t.state is TaskState.DEPLOYING:
                log.warning("task %s was DEPLOYING when the orchestrator stopped; resuming", t.id)
                self._spawn(self._deploy(t.id))
            elif t.state is TaskState.DELETING:
                self._spawn(self._finish_delete(t))

    # ---- Invoke --------------------------------------------------------------------------------

    async def invoke(self, task_id: str, text: str, *, max_output_tokens: int = 0,
                     on_event: OnEvent | None = None) -> Execution:
        # The RPC's SERVER span is the request's root: it names the task, and each stage gets a child span.
        root = trace.get_current_span()
        root.set_attribute(telemetry.FLOWMAKER_TASK, task_id)
        if max_output_tokens < 0:
            raise InvalidSpec(f"must be >= 0 (0 = the stage's output_tokens), got {max_output_tokens}",
                              field="max_output_tokens")
        _, t = await self._get(task_id)
        if t.state not in SERVING_STATES:
            raise FailedPrecondition(f"task {task_id} is {t.state.value}; only an ACTIVE task serves requests",
                                     field="task_id", metadata={"state": t.state.value})
        wf = t.workflow
        if wf is None:
            raise FailedPrecondition(f"task {task_id} has no selected workflow", field="task_id")
        root.set_attribute(telemetry.FLOWMAKER_WORKFLOW, wf.id)
        insts: dict[str, InstanceRecord] = {}
        for iid in t.instance_ids:
            kv = await self.store.get(keys.instance(iid))
            rec = InstanceRecord.from_json(kv.value) if kv else None
            if rec is None or rec.state is not InstanceState.READY or not rec.endpoint:
                state = rec.state.value if rec else "gone"
                raise Unavailable(f"task {task_id} is DEGRADED: instance {iid} is {state}"
                                  + (f" ({rec.reason.splitlines()[0]})" if rec and rec.reason else ""),
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
            rec = insts[t.stage_instances[stage.id]]
            max_tokens = min(stage.output_tokens, max_output_tokens) if max_output_tokens else stage.output_tokens
            on_delta: OnDelta | None = None
            if on_event is not None:
                async def on_delta(piece: str) -> None:
                    await on_event("delta", (stage.id, piece))
            pt = ct = 0
            text = ""
            # calls_per_request > 1 (e.g. sampling several answers) runs the calls one after the other,
            # as the latency model counts them; the last answer is the stage's output.
            for _ in range(max(1, stage.calls_per_request)):
                c = await self.engines.chat(rec.endpoint, rec.model_id, prompt, max(1, max_tokens),
                                            timeout_s=deadline_s(self.settings.invoke_timeout_s),
                                            instance_id=rec.id, on_delta=on_delta)
                pt, ct, text = pt + c.prompt_tokens, ct + c.completion_tokens, c.text
            return StageResult(stage.id, text, rec.id, rec.model_id, pt, ct)

        async def done(r: StageResult) -> None:
            if on_event is not None:
                await on_event("stage_done", r)

        ex = await execute(wf, text, run_stage, done)
        await self._observe(task_id, ex.latency_s)
        return ex

    async def _observe(self, task_id: str, latency_s: float) -> None:
        """Account one served request (latency window + count) in the task record; best effort."""
        def fn(t: TaskRecord) -> TaskRecord | None:
            if t.state is not TaskState.ACTIVE:
                return None
            return t.with_observation(latency_s, time.time(), self.settings.latency_window)
        try:
            async with self._obs_locks[task_id]:  # one writer per task in this process: fewer CAS retries
                await self._update(task_id, fn)
        except FlowMakerError as e:
            log.warning("task %s: could not record an observed latency: %s", task_id, e)
