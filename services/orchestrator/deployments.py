"""Calls to the node deployers on a task's behalf: start (or wait for) one instance, release a task's references.

Lifecycle commands, healing actions and the load follower all deploy and release through here.
"""

from __future__ import annotations

import asyncio
import logging

from flowmaker import telemetry
from flowmaker.api.common.v1 import cluster_pb2
from flowmaker.api.deployer.v1 import deployer_pb2
from flowmaker.errors import Unavailable
from flowmaker.orchestration.commit import ReleaseAction, plan_release
from flowmaker.orchestration.task import DeployedInstance, TaskRecord
from flowmaker.rpc.errors import call
from flowmaker.state import keys
from flowmaker.state.records import InstanceRecord, InstanceState, NodeRecord
from flowmaker.state.store import StateStore
from services.orchestrator.clients import Clients
from services.orchestrator.records import (
    ATTR_GPUS,
    ATTR_INSTANCES,
    ATTR_MODEL,
    ATTR_NODE,
    tracer,
)
from services.orchestrator.settings import OrchestratorSettings

log = logging.getLogger(__name__)


class Deployers:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, clients: Clients) -> None:
        self.settings = settings
        self.store = store
        self.clients = clients

    async def node_endpoints(self) -> dict[str, str]:
        out = {}
        for kv in (await self.store.get_prefix(keys.NODES)).items:
            if isinstance(kv.value, dict):
                n = NodeRecord.from_json(kv.value)
                out[n.node] = n.endpoint
        return out

    async def deploy_one(self, task_id: str, d: DeployedInstance, nodes: dict[str, str]) -> None:
        with tracer().start_as_current_span("task.deploy_instance", attributes={
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

    async def not_ready(self, ids: list[str]) -> list[DeployedInstance]:
        """The instances among `ids` (reused ones) that are not READY yet, to deploy (wait for) by their id."""
        out = []
        for iid in ids:
            kv = await self.store.get(keys.instance(iid))
            rec = InstanceRecord.from_json(kv.value) if kv else None
            if rec is None:
                raise Unavailable(f"reused instance {iid} is gone", reason="INSTANCE_FAILED")
            if rec.state is not InstanceState.READY:
                out.append(DeployedInstance(iid, "", rec.model_id, rec.tp, rec.pp, rec.node, rec.gpu_ids,
                                            rec.memory_gb_per_gpu, 0.0))
        return out

    async def release_all(self, t: TaskRecord) -> list[str]:
        """Drop every reference the task holds; return the ids of instances stopped (no other user)."""
        with tracer().start_as_current_span("task.release", attributes={telemetry.FLOWMAKER_TASK: t.id}) as span:
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
        nodes = await self.node_endpoints()
        results = await asyncio.gather(*(self.release_one(t.id, a, nodes) for a in actions))
        return [a.instance_id for a, stopped in zip(actions, results, strict=True) if stopped]

    async def release_one(self, task_id: str, a: ReleaseAction, nodes: dict[str, str]) -> bool:
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
