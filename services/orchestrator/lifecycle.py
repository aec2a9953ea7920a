"""Lifecycle commands: DeployTask, ApproveWorkflows, DeleteTask, GetTask and ListTasks, and the workers that carry
an approval or a delete out (select, commit, deploy; roll back; release).

Any replica takes a command; the workers run on the elected leader. A replica that is not the leader writes the
intent (the task SELECTING, or DELETING) and follows the task in its cache while the leader's reconciler carries
it out (`Kind.RESUME_SELECT`, `Kind.RESUME_DELETE`), as it resumes any half-done work after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace

from flowmaker import convert, telemetry
from flowmaker.api.common.v1 import selection_pb2
from flowmaker.cancel import checkpoint, offload
from flowmaker.domain import Slo, Workflow
from flowmaker.errors import (
    AlreadyExists,
    Conflict,
    FailedPrecondition,
    FlowMakerError,
    InvalidSpec,
    NoCapacity,
    NotFound,
)
from flowmaker.orchestration.adapt import ArrivalMeter, TaskLoad
from flowmaker.orchestration.cluster import read_live_cluster
from flowmaker.orchestration.commit import CommitPlan, commit_ops, plan_commit, plan_instances
from flowmaker.orchestration.task import (
    Failure,
    HealAction,
    Healing,
    TaskRecord,
    TaskState,
    derive_state,
    selected_prediction,
)
from flowmaker.rpc.errors import call
from flowmaker.state import keys
from flowmaker.state.records import InstanceRecord, new_instance_id
from flowmaker.state.store import Compare, Put, StateStore
from services.orchestrator.cache import RoutingCache
from services.orchestrator.clients import Clients
from services.orchestrator.deployments import Deployers
from services.orchestrator.records import (
    ATTR_ATTEMPT,
    ATTR_CANDIDATES,
    ATTR_CONFLICT,
    ATTR_CONFLICT_KEYS,
    ATTR_FEASIBLE,
    ATTR_GENERATOR,
    ATTR_GPU_SHARING,
    ATTR_INSTANCES,
    ATTR_NEW_INSTANCES,
    ATTR_REASON,
    ATTR_REUSED,
    ATTR_STRATEGY,
    TaskStore,
    TaskView,
    is_transient,
    tracer,
)
from services.orchestrator.selecting import Selections
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.workers import Workers

log = logging.getLogger(__name__)


def _slug(text: str, default: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return "-".join(s.split("-")[:4])[:32].strip("-") or default


class _Rejected(Exception):
    """The selector refused the approval's request as invalid (INVALID_ARGUMENT / NOT_FOUND)."""

    def __init__(self, error: FlowMakerError) -> None:
        super().__init__(str(error))
        self.error = error


def _check_workflows(workflows: Sequence[Workflow]) -> None:
    """Validate each workflow (ids, DAG, templates) and that workflow ids are distinct."""
    ids: set[str] = set()
    for i, w in enumerate(workflows):
        checkpoint()
        w.validate(f"workflows[{i}]")
        if w.id in ids:
            raise InvalidSpec(f"duplicate workflow id {w.id!r}", field=f"workflows[{i}].id")
        ids.add(w.id)


class Lifecycle:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, clients: Clients, *, workers: Workers,
                 deployers: Deployers, selections: Selections, cache: RoutingCache, arrivals: ArrivalMeter,
                 is_leader: Callable[[], bool] = lambda: True,
                 loads: Callable[[str, float], TaskLoad | None] | None = None) -> None:
        self.settings = settings
        self.store = store
        self.clients = clients
        self.tasks = TaskStore(store)
        self.workers = workers
        self.deployers = deployers
        self.selections = selections
        self.cache = cache
        self.arrivals = arrivals
        self.is_leader = is_leader  # whether this replica runs the workers (else the leader's reconciler does)
        self._delete_results: dict[str, list[str]] = {}  # task id -> instances its delete stopped
        # The task's load over every replica (`ReplicaBoard.load`); None = this replica's meter alone.
        self.loads = loads

    def observed_load(self, task_id: str, now: float) -> TaskLoad | None:
        """The task's observed arrival rate and latency quantile, in model time (None: not watched long enough)."""
        if self.loads is not None:
            return self.loads(task_id, now)
        return self.arrivals.load(task_id, now, self.settings.tool_time_scale)

    async def view(self, task_id: str) -> TaskView:
        kv, t = await self.tasks.get(task_id)
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

    async def list_tasks(self, state: TaskState | None = None, *, ids: set[str] | None = None,
                         caught_up: bool = False) -> list[TaskView]:
        """The tasks (only those in `ids` when given), in `state` when given, oldest first. From the routing
        cache once it has listed etcd (with `ids`, no scan of the others), after it has caught up with etcd
        (`RoutingCache.catch_up`: every write made before the call shows, through any replica; `caught_up`: the
        caller has just done so); from etcd before the first listing."""
        if not caught_up:
            await self.cache.catch_up()
        if not self.cache.fresh:
            return await self._list_from_store(state, ids)
        nodes = self.cache.live_nodes()
        now = time.time()
        out = []
        for rev, t in self.cache.task_entries(ids):
            st, f = t.state, t.failure
            if t.state is TaskState.ACTIVE:
                insts = {iid: self.cache.instance(iid) for iid in t.instance_ids}
                st, f = derive_state(t, {iid: r.state.value if r is not None and r.node in nodes else None
                                         for iid, r in insts.items()})
            if state is None or st is state:
                ld = self.observed_load(t.id, now)
                out.append(TaskView(t, rev, st, f, ld.rate_rps if ld else 0.0))
        return sorted(out, key=lambda v: (v.task.create_time, v.task.id))

    async def _list_from_store(self, state: TaskState | None, ids: set[str] | None) -> list[TaskView]:
        out = []
        for kv in (await self.store.get_prefix(keys.TASKS)).items:
            t = TaskRecord.from_json(kv.value)
            if ids is not None and t.id not in ids:
                continue
            st, f = derive_state(t, await self._instance_states(t)) if t.state is TaskState.ACTIVE \
                else (t.state, t.failure)
            if state is None or st is state:
                ld = self.observed_load(t.id, time.time())
                out.append(TaskView(t, kv.mod_revision, st, f, ld.rate_rps if ld else 0.0))
        return sorted(out, key=lambda v: (v.task.create_time, v.task.id))

    async def _instance_states(self, task: TaskRecord) -> dict[str, str | None]:
        """Live state of each instance the task uses: None when the record or its node is gone."""
        nodes = {keys.parse_node(kv.key) for kv in (await self.store.get_prefix(keys.NODES)).items}
        out: dict[str, str | None] = {}
        for iid in task.instance_ids:
            kv = await self.store.get(keys.instance(iid))
            rec = InstanceRecord.from_json(kv.value) if kv else None
            out[iid] = rec.state.value if rec is not None and rec.node in nodes else None
        return out

    async def deploy_task(self, description: str, slo: Slo | None, *, name: str = "", max_workflows: int = 0,
                          workflows: Sequence[Workflow] = (), owner: str = "") -> TaskView:
        """Create the task AWAITING_APPROVAL with its candidates. `owner` (the caller; "" = the anonymous admin of a
        plaintext stack) is recorded with it, and a non-empty `name` must be new among the owner's tasks
        (ALREADY_EXISTS otherwise): task, owner and name keys are written in one transaction."""
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
        with tracer().start_as_current_span("task.create", attributes={telemetry.FLOWMAKER_TASK: tid}) as span:
            candidates = tuple(workflows) or await self._generate(description,
                                                                  max_workflows or self.settings.max_workflows)
            if not candidates:
                raise NoCapacity("the generator proposed no workflow for this description", field="description",
                                 reason="NO_CANDIDATES")
            span.set_attribute(ATTR_CANDIDATES, [w.id for w in candidates])
            now = time.time()
            rec = TaskRecord(tid, description, slo, name=name, candidates=candidates,
                             state=TaskState.AWAITING_APPROVAL, create_time=now, update_time=now)
            compares = [Compare.absent(keys.task(tid))]
            puts = [Put(keys.task(tid), rec.to_json())]
            if name:
                compares.append(Compare.absent(keys.task_name(owner, name)))
                puts.append(Put(keys.task_name(owner, name), {"task_id": tid}))
            if owner:
                puts.append(Put(keys.owner(tid), {"owner": owner}))
            res = await self.store.txn(compares, puts)
            if not res.succeeded:
                taken = await self.store.get(keys.task_name(owner, name)) if name else None
                if taken is not None:
                    raise AlreadyExists(f"a task named {name!r} exists already ({taken.value.get('task_id', '?')}); "
                                        "names are unique per owner: choose another, or delete that task",
                                        field="name", reason="TASK_NAME_TAKEN",
                                        metadata={"task_id": str(taken.value.get("task_id", ""))})
                raise Conflict(f"task {tid} could not be created; retry", field="name")
            rev = res.revision
            self.cache.note_task(rec, rev)  # listed and routed by this replica at once
            if name:
                self.cache.note_name(owner, name, tid, rev)
            if owner:
                self.cache.note_owner(tid, owner, rev)
        log.info("task %s created with %d candidate(s): %s", tid, len(candidates), [w.id for w in candidates])
        return TaskView(rec, rev, rec.state, None)

    async def _generate(self, description: str, n: int) -> tuple[Workflow, ...]:
        gen = self.clients.generator
        with tracer().start_as_current_span("task.generate", attributes={ATTR_GENERATOR: gen.name}) as span:
            # Over gRPC, the channel's OpenTelemetry interceptor makes the call a CLIENT span under this one.
            out = await gen.generate(description, n)
            span.set_attribute(ATTR_CANDIDATES, [w.id for w in out])
            return out

    async def approve(self, task_id: str, workflow_ids: Sequence[str], *, strategy: str = "",
                      options: selection_pb2.SelectionOptions | None = None, etag: str = "") -> TaskView:
        kv, t = await self.tasks.get(task_id)
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
                      options_json="" if options is None else convert.selection_options_to_json(options),
                      failure=None)
        rev = await self.store.cas(kv.key, sel.to_json(), etag=kv.mod_revision)  # Conflict: a concurrent approval won
        if self.is_leader():
            # Shielded: a client that gives up must not leave a half-committed, half-deployed task behind.
            await self.workers.follow(task_id, self.workers.start(task_id, self.select_commit_deploy(task_id)))
        if not self.is_leader():
            # The leader's reconciler selects it (RESUME_SELECT); a leader deposed meanwhile left it to the next.
            settled = await self._await_task(task_id, rev, lambda x: x is None or x.state not in (
                TaskState.SELECTING, TaskState.DEPLOYING))
            if settled is not None and settled.state is TaskState.AWAITING_APPROVAL and settled.failure is not None:
                raise settled.failure.to_error()  # the selector refused the approval (see `select_commit_deploy`)
        return await self.view(task_id)

    async def _await_task(self, task_id: str, after_rev: int, done: Callable[[TaskRecord | None], bool]
                          ) -> TaskRecord | None:
        """Follow a task another replica works on until `done(record)` (None: deleted) holds for a version written
        after `after_rev`: from the cache's watch events, and from etcd every second in case the watch lags.
        Bounded by the RPC's deadline."""
        last_read = time.monotonic()
        while True:
            rev, t = self.cache.task_entry(task_id)
            if rev > after_rev and done(t):
                return t
            if time.monotonic() - last_read >= 1.0:
                last_read = time.monotonic()
                kv = await self.store.get(keys.task(task_id))
                t = TaskRecord.from_json(kv.value) if kv is not None else None
                if (kv is None or kv.mod_revision > after_rev) and done(t):
                    return t
            await asyncio.sleep(0.05)

    async def select_commit_deploy(self, task_id: str) -> None:
        """Select, commit and deploy a SELECTING task (an approval, a resumed one, or a healing re-selection)."""
        _, t = await self.tasks.get(task_id)
        if t.state is not TaskState.SELECTING:
            return
        if t.healing is not None:
            # Re-selection: the references of the variant being replaced go first (idempotent; they may be
            # gone already), so the new commit can reuse any instance, the old ones included.
            await self.deployers.release_all(t)
        try:
            plan = await self.select_and_commit(task_id)
        except _Rejected as r:
            if t.healing is not None:
                await self.wait_for_capacity(task_id, f"the selector refused the request: {r.error}")
                return
            # The approval itself was wrong (an unknown strategy, options the selector refuses): nothing
            # was committed, so the task goes back to AWAITING_APPROVAL and the caller gets the error to
            # fix and approve again, rather than a task FAILED for good by a typo.
            # The error is kept in the record: an approval taken by another replica reports it from there.
            refused = Failure.of(r.error)

            def back(t: TaskRecord) -> TaskRecord | None:
                return t.moved(TaskState.AWAITING_APPROVAL, time.time(), failure=refused) \
                    if t.state is TaskState.SELECTING else None
            with contextlib.suppress(NotFound):
                await self.tasks.update(task_id, back)
            raise r.error from None
        except Exception as e:  # nothing is reserved before the commit: failing the task is all
            if is_transient(e):
                # etcd, the selector or a deployer is unreachable: nothing is committed and the task stays
                # SELECTING; the reconciler selects again on its next pass (after the outage).
                log.warning("task %s: selection interrupted (%s); the reconciler retries it", task_id, e)
                raise
            if not isinstance(e, FlowMakerError):
                log.exception("task %s: selection failed", task_id)
            if t.healing is not None:
                await self.wait_for_capacity(task_id, str(e))
                return
            await self.tasks.fail(task_id, Failure.of(e))
            return
        if plan is not None:
            await self.deploy(task_id)

    async def wait_for_capacity(self, task_id: str, why: str) -> None:
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
            new = await self.tasks.update(task_id, fn)
            if new is not None and new.healing is not None:
                log.warning("task %s: healing waits for capacity (%s); next attempt in %.0fs", task_id, why,
                            new.healing.next_attempt_at - time.time())

    async def select_and_commit(self, task_id: str) -> CommitPlan | None:
        """Select on a fresh view and commit it in one guarded txn; on a lost race select again."""
        last = ""
        protect: set[str] = set()  # instances of the tasks the first choice would break (`Selections.request`)
        who = ""  # those tasks, with their predictions before and after, for the failure
        for attempt in range(1, self.settings.commit_retries + 1):
            _, t = await self.tasks.get(task_id)
            if t.state is not TaskState.SELECTING:
                log.info("task %s left SELECTING (%s) during selection; stopping", task_id, t.state.value)
                return None
            with tracer().start_as_current_span("task.select", attributes={
                    telemetry.FLOWMAKER_TASK: task_id, ATTR_ATTEMPT: attempt, ATTR_STRATEGY: t.strategy}) as span:
                view = await read_live_cluster(self.store)
                req = await self.selections.request(t, view.cluster, protect=protect)
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
                detail = result.reason_detail or reason
                if protect:  # the first choice broke a running task; none is left that keeps it
                    reason, detail = "CO_RESIDENT_SLO", (f"the variants that fit would push co-resident task(s) "
                                                         f"{who} past their latency SLO by the live prediction; "
                                                         f"with their instances protected: {detail}")
                await self._no_variant(task_id, t, reason, detail)
                return None
            v = result.variant
            scale = await self.selections.load_scale(t, v, view.cluster, req.options.capacity_model,
                                           [convert.model_from_proto(m) for m in req.models])
            plan = plan_commit(task_id, v, [new_instance_id(n.model_id) for n in v.new_instances], load_scale=scale)
            if req.options.gpu_sharing == selection_pb2.GPU_SHARING_INTERFERENCE:
                # The live prediction of the placement this commit makes: a task that meets its SLO there now must
                # still meet it (`Selections.breaks`). Once, the selection is made again with that task's instances
                # protected (`cluster.protected`); a second choice that breaks one too is no feasible variant.
                broken, theirs = await self.selections.breaks(
                    replace(t, state=TaskState.ACTIVE, variant=v, stage_instances=plan.stage_instances,
                            new_instances=plan.deploy), view, plan_instances(plan))
                if broken:
                    who = ", ".join(f"{tid} ({x:.3g}s -> {y:.3g}s)" for tid, (x, y) in sorted(broken.items()))
                    if not protect and theirs:
                        protect = theirs
                        log.info("task %s: the selected variant would push %s past their latency SLO by the live "
                                 "prediction; selecting again with their instances protected", task_id, who)
                        continue
                    await self._no_variant(task_id, t, "CO_RESIDENT_SLO", (
                        f"every variant selected would push co-resident task(s) {who} past their latency SLO by "
                        "the live prediction"))
                    return None
            with tracer().start_as_current_span("task.commit", attributes={
                    telemetry.FLOWMAKER_TASK: task_id, ATTR_ATTEMPT: attempt, ATTR_CONFLICT: False}) as span:
                tkv, t = await self.tasks.get(task_id)
                if t.state is not TaskState.SELECTING:
                    return None
                now = time.time()
                healing = None if t.healing is None else Healing(
                    HealAction.RESELECTING.value, t.healing.detail, t.healing.since, t.healing.attempts)
                deploying = t.moved(TaskState.DEPLOYING, now, variant=v, strategy=result.strategy or t.strategy,
                                    stage_instances=plan.stage_instances, new_instances=plan.deploy,
                                    healing=healing, **selected_prediction(v))
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
        _, t = await self.tasks.get(task_id)
        if t.healing is not None:
            await self.wait_for_capacity(task_id, msg)
        else:
            await self.tasks.fail(task_id, Failure("Conflict", "SELECTION_CONFLICT", f"{msg}; approve again"))
        return None

    async def _no_variant(self, task_id: str, t: TaskRecord, reason: str, detail: str) -> None:
        """No variant to commit: a healing task waits for capacity, any other one FAILED (NoCapacity)."""
        if t.healing is not None:
            await self.wait_for_capacity(task_id, f"no feasible variant: {detail}")
            return
        await self.tasks.fail(task_id, Failure("NoCapacity", reason, f"no feasible variant: {detail}"))

    async def deploy(self, task_id: str) -> None:
        """Start every new instance of the committed plan, and wait for the reused ones that are not READY
        yet (another task's new instance, still PENDING or STARTING: Deploy by its id is idempotent and
        waits for the start, or starts it); ACTIVE once all serve, or roll back and FAILED."""
        with tracer().start_as_current_span("task.deploy", attributes={telemetry.FLOWMAKER_TASK: task_id}) as span:
            _, t = await self.tasks.get(task_id)
            if t.state is not TaskState.DEPLOYING:
                return
            nodes = await self.deployers.node_endpoints()
            todo = list(t.new_instances) + await self.deployers.not_ready(
                [i for i in t.instance_ids if i not in {d.instance_id for d in t.new_instances}])
            span.set_attribute(ATTR_INSTANCES, [d.instance_id for d in todo])
            results = await asyncio.gather(*(self.deployers.deploy_one(task_id, d, nodes) for d in todo),
                                           return_exceptions=True)
            errs = [(d, r) for d, r in zip(todo, results, strict=True) if isinstance(r, BaseException)]
            if errs:
                telemetry.mark_error(span, errs[0][1])
        if not errs:
            def active(x: TaskRecord) -> TaskRecord | None:
                return x.moved(TaskState.ACTIVE, time.time(), healing=None) if x.state is TaskState.DEPLOYING \
                    else None
            try:
                if await self.tasks.update(task_id, active) is not None:
                    log.info("task %s ACTIVE: %s", task_id, t.stage_instances)
                    return
            except NotFound:
                pass
            return  # deleted (DELETING) meanwhile: DeleteTask releases everything
        d, e = errs[0]
        if is_transient(e):
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
            _, cur = await self.tasks.get(task_id)
        except NotFound:
            return
        if cur.state is not TaskState.DEPLOYING:
            return
        try:
            await self.deployers.release_all(cur)
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
                await self.tasks.update(task_id, again)
            await self.wait_for_capacity(task_id, why)
            return
        await self.tasks.fail(task_id, Failure(f.error, f.reason, why))

    async def delete(self, task_id: str) -> tuple[TaskRecord, list[str]]:
        def deleting(t: TaskRecord) -> TaskRecord | None:
            return None if t.state is TaskState.DELETING else t.moved(TaskState.DELETING, time.time())
        await self.tasks.update(task_id, deleting)
        kv, t = await self.tasks.get(task_id)
        if not self.is_leader():
            # The leader's reconciler finishes it (RESUME_DELETE); which instances it stopped is its to know.
            await self._await_task(task_id, kv.mod_revision - 1, lambda x: x is None)
            self.cache.note_deleted(task_id)
            return t, []
        # A worker already on the task (a selection, a deploy) sees DELETING and stops; the delete runs
        # once it is done, as the task's next worker.
        cur = self.workers.current(task_id)
        if cur is not None and not cur.done():
            await asyncio.wait({cur}, timeout=self.settings.release_timeout_s)
        # The worker may be the reconciler's (it saw DELETING first): its result is kept for us.
        await asyncio.shield(self.workers.start(task_id, self.finish_delete(task_id)))
        return t, self._delete_results.pop(task_id, [])

    async def finish_delete(self, task_id: str) -> list[str]:
        try:
            _, t = await self.tasks.get(task_id)
        except NotFound:
            return []
        if t.state is not TaskState.DELETING:
            return []
        stopped = await self.deployers.release_all(t)
        deletes = [keys.task(t.id)]
        if t.name:  # the name is free again (only if it still names this task)
            okv = await self.store.get(keys.owner(t.id))
            nkey = keys.task_name(okv.value.get("owner", "") if okv is not None else "", t.name)
            nkv = await self.store.get(nkey)
            if nkv is not None and isinstance(nkv.value, dict) and nkv.value.get("task_id") == t.id:
                deletes.append(nkey)
        await self.store.txn([], (), deletes)
        self.cache.note_deleted(t.id)
        log.info("task %s deleted; stopped %s", t.id, stopped or "nothing")
        if len(self._delete_results) > 1000:  # deletes nobody waited for (resumed after a restart)
            self._delete_results.clear()
        self._delete_results[task_id] = stopped
        self.arrivals.forget(task_id)
        return stopped
