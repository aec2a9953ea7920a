"""DeployerService over gRPC: parse the request, call the node agent, convert the records back (thin)."""

from __future__ import annotations

import grpc.aio
from google.protobuf import timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from flowmaker.api.common.v1 import cluster_pb2
from flowmaker.api.deployer.v1 import deployer_pb2, deployer_pb2_grpc
from flowmaker.rpc.errors import DOMAIN
from flowmaker.state.records import GpuRecord, InstanceRecord, InstanceState
from services.deployer.node import DeployParams, NodeAgent

SERVICE_NAME = deployer_pb2.DESCRIPTOR.services_by_name["DeployerService"].full_name

_STATES = {
    InstanceState.PENDING: cluster_pb2.Instance.STATE_PENDING,
    InstanceState.STARTING: cluster_pb2.Instance.STATE_STARTING,
    InstanceState.READY: cluster_pb2.Instance.STATE_READY,
    InstanceState.DRAINING: cluster_pb2.Instance.STATE_DRAINING,
    InstanceState.FAILED: cluster_pb2.Instance.STATE_FAILED,
}


def instance_to_proto(rec: InstanceRecord, task_ids: list[str] | None = None, node_alive: bool = True
                      ) -> cluster_pb2.Instance:
    """An instance record as the API shows it. An instance whose node lost its lease is shown
    FAILED (NODE_LOST) even though its record still says otherwise: nothing backs it any more."""
    state, reason, message = rec.state, rec.failure_reason, rec.reason
    if not node_alive and state is not InstanceState.FAILED:
        state, reason, message = InstanceState.FAILED, "NODE_LOST", f"node {rec.node} is not alive (lease expired)"
    m = cluster_pb2.Instance(
        id=rec.id, model_id=rec.model_id, tp=rec.tp, pp=rec.pp, gpu_ids=list(rec.gpu_ids),
        load_output_tokens_per_s=rec.load_output_tokens_per_s, endpoint=rec.endpoint if node_alive else "",
        state=_STATES[state], node=rec.node, engine=rec.engine, task_ids=list(task_ids or ()))
    if rec.created_at:
        ts = timestamp_pb2.Timestamp()
        ts.FromNanoseconds(int(rec.created_at * 1e9))
        m.create_time.CopyFrom(ts)
    if state is InstanceState.FAILED:
        info = error_details_pb2.ErrorInfo(reason=reason or "FAILED", domain=DOMAIN, metadata={"instance_id": rec.id})
        st = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message)
        st.details.add().Pack(info)
        m.failure.CopyFrom(st)
    return m


def gpu_to_proto(g: GpuRecord) -> cluster_pb2.Gpu:
    return cluster_pb2.Gpu(id=g.id, node=g.node, memory_total_gb=g.memory_total_gb, memory_used_gb=g.memory_used_gb,
                           gpu_type=g.gpu_type)


class DeployerServicer(deployer_pb2_grpc.DeployerServiceServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    async def Deploy(self, request: deployer_pb2.DeployRequest, context: grpc.aio.ServicerContext
                     ) -> deployer_pb2.DeployResponse:
        rec = await self.agent.deploy(DeployParams(
            model_id=request.model_id, tp=request.tp or 1, pp=request.pp or 1, gpu_ids=tuple(request.gpu_ids),
            memory_gb_per_gpu=request.memory_gb_per_gpu, task_id=request.task_id, engine=request.engine,
            request_id=request.request_id, no_wait=request.no_wait))
        return deployer_pb2.DeployResponse(instance=instance_to_proto(rec, [request.task_id] if request.task_id else []))

    async def Release(self, request: deployer_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
                      ) -> deployer_pb2.ReleaseResponse:
        rec, stopped = await self.agent.release(request.instance_id, request.task_id)
        resp = deployer_pb2.ReleaseResponse(stopped=stopped)
        if rec is not None:
            resp.instance.CopyFrom(instance_to_proto(rec))
        return resp

    async def ListInstances(self, request: deployer_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
                            ) -> deployer_pb2.ListInstancesResponse:
        rows = await self.agent.list_instances(request.model_id, request.task_id)
        return deployer_pb2.ListInstancesResponse(instances=[instance_to_proto(r, t, a) for r, t, a in rows])

    async def ListGpus(self, request: deployer_pb2.ListGpusRequest, context: grpc.aio.ServicerContext
                       ) -> deployer_pb2.ListGpusResponse:
        return deployer_pb2.ListGpusResponse(gpus=[gpu_to_proto(g) for g in await self.agent.list_gpus(request.node)])
