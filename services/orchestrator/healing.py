"""Healing actions, called by the reconciler on the elected leader: re-select a task whose variant cannot serve
again, restart a failed instance in place, mark a lost node's instances LOST, re-plan a deploy stuck on a lost
node, clear a healed task's note, and release leaked references and orphan instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from flowmaker import telemetry
from flowmaker.api.deployer.v1 import deployer_pb2
from flowmaker.errors import Conflict, FlowMakerError, NotFound, Unavailable
from flowmaker.orchestration.commit import ReleaseAction
from flowmaker.orchestration.task import HealAction, Healing, TaskRecord, TaskState
from flowmaker.rpc.errors import call
from flowmaker.state import keys
from flowmaker.state.records import ORPHAN_GC_TASK_ID, InstanceRecord, InstanceState
from flowmaker.state.store import StateStore
from services.orchestrator.clients import Clients
from services.orchestrator.deployments import Deployers
from services.orchestrator.lifecycle import Lifecycle
from services.orchestrator.records import ATTR_GPUS, ATTR_MODEL, ATTR_NODE, TaskStore, tracer
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.workers import Workers

log = logging.getLogger(__name__)


class Healer:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, clients: Clients, *, workers: Workers,
                 deployers: Deployers, lifecycle: Lifecycle) -> None:
        self.settings = settings
        self.store = store
        self.clients = clients
        self.tasks = TaskStore(store)
        self.workers = workers
        self.deployers = deployers
        self.lifecycle = lifecycle
        self._replanning: set[str] = set()  # tasks a REPLAN_DEPLOY is on (`replan_deploy`)

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
        if await self.tasks.update(task_id, fn) is None:
            return
        log.warning("task %s: re-selecting (%s)", task_id, why)
        await self.lifecycle.select_commit_deploy(task_id)

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
                await self.tasks.update(tid, fn)
        kv = await self.store.get(keys.instance(iid))
        if kv is None:
            return
        rec = InstanceRecord.from_json(kv.value)
        if rec.state is not InstanceState.FAILED:
            return
        endpoint = (await self.deployers.node_endpoints()).get(rec.node)
        if not endpoint:
            raise Unavailable(f"node {rec.node} of instance {iid} is not alive", reason="NODE_LOST")
        with tracer().start_as_current_span("task.restart_instance", attributes={
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
            await self.tasks.update(task_id, fn)

    async def release_failed(self, task_id: str) -> None:
        """Finish the rollback of a FAILED task whose references could not all be released then."""
        with contextlib.suppress(NotFound):
            _, t = await self.tasks.get(task_id)
            if t.state is TaskState.FAILED:
                await self.deployers.release_all(t)

    async def drop_reference(self, iid: str, task_id: str, node: str) -> None:
        """A reference naming a task that does not exist, or a settled ACTIVE task that does not use the
        instance (a delete, rollback or switch cut short): drop it."""
        endpoint = (await self.deployers.node_endpoints()).get(node) if node else ""
        kv = await self.store.get(keys.task(task_id))
        if kv is not None:
            t = TaskRecord.from_json(kv.value)
            if (t.state is not TaskState.ACTIVE or t.next_variant is not None or iid in t.instance_ids
                    or task_id in self.workers.busy_tasks()):
                return
        await self.deployers.release_one(task_id, ReleaseAction(iid, node, False), {node: endpoint} if endpoint else {})

    async def stop_orphan(self, iid: str, node: str) -> None:
        """Stop an instance no reference names. The deployer stops it only if it is still unreferenced
        when it looks (an id that names no task: a concurrent reuse commit keeps it alive)."""
        endpoint = (await self.deployers.node_endpoints()).get(node)
        if not endpoint:
            return
        await call(self.clients.deployer(endpoint).Release(
            deployer_pb2.ReleaseRequest(instance_id=iid, task_id=ORPHAN_GC_TASK_ID),
            timeout=self.settings.release_timeout_s))

    def replan_deploy(self, task_id: str, why: str) -> None:
        """A DEPLOYING task with an instance LOST (its node stalled or died during the deploy): stop waiting on
        it now, whether or not a worker is still blocked in its Deploy call, and select again against the live
        cluster (`_replan`). The blocked worker is cancelled; an approval waiting on it follows the new one."""
        if task_id in self._replanning:
            return
        self._replanning.add(task_id)
        old = self.workers.current(task_id)

        async def run() -> None:
            try:
                if old is not None and not old.done():
                    old.cancel()
                    await asyncio.wait({old})
                await self._replan(task_id, why)
            finally:
                self._replanning.discard(task_id)
        # Registered at once, in the old worker's place: the reconciler sees the task busy, and an approval
        # waiting on the old worker finds this one (`Workers.follow`).
        self.workers.register(task_id, self.workers.spawn(run()))

    async def _replan(self, task_id: str, why: str) -> None:
        try:
            _, t = await self.tasks.get(task_id)
        except NotFound:
            return
        if t.state is not TaskState.DEPLOYING:
            return
        log.warning("task %s: re-planning its deploy: %s", task_id, why)
        try:
            await self.deployers.release_all(t)  # a lost node's references are dropped; a live node's instances released
        except FlowMakerError as e:  # the references left are released by the selection's own release
            log.warning("task %s: release before re-planning incomplete (%s)", task_id, e)

        def again(x: TaskRecord) -> TaskRecord | None:
            if x.state is not TaskState.DEPLOYING:
                return None
            now, h = time.time(), x.healing
            return x.moved(TaskState.SELECTING, now, healing=Healing(
                HealAction.RESELECTING.value, why, h.since if h else now, (h.attempts if h else 0) + 1))
        if await self.tasks.update(task_id, again) is None:
            return
        await self.lifecycle.select_commit_deploy(task_id)
