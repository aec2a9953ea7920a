"""DeployerService over gRPC: parse the request, call the node agent, convert the records back (thin)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc.aio

from flowmaker import convert
from flowmaker.api.deployer.v1 import deployer_pb2, deployer_pb2_grpc
from flowmaker.rpc.server import RunningServer
from services.deployer.node import DeployParams, NodeAgent

SERVICE_NAME = deployer_pb2.DESCRIPTOR.services_by_name["DeployerService"].full_name

class DeployerServicer(deployer_pb2_grpc.DeployerServiceServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    async def Deploy(self, request: deployer_pb2.DeployRequest, context: grpc.aio.ServicerContext
                     ) -> deployer_pb2.DeployResponse:
        rec = await self.agent.deploy(DeployParams(
            model_id=request.model_id, tp=request.tp or 1, pp=request.pp or 1, gpu_ids=tuple(request.gpu_ids),
            memory_gb_per_gpu=request.memory_gb_per_gpu, task_id=request.task_id, engine=request.engine,
            request_id=request.request_id, no_wait=request.no_wait))
        return deployer_pb2.DeployResponse(
            instance=convert.instance_record_to_proto(rec, [request.task_id] if request.task_id else []),
            engine_api_key=rec.api_key)

    async def Release(self, request: deployer_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
                      ) -> deployer_pb2.ReleaseResponse:
        rec, stopped = await self.agent.release(request.instance_id, request.task_id)
        resp = deployer_pb2.ReleaseResponse(stopped=stopped)
        if rec is not None:
            resp.instance.CopyFrom(convert.instance_record_to_proto(rec))
        return resp

    async def ListInstances(self, request: deployer_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
                            ) -> deployer_pb2.ListInstancesResponse:
        rows = await self.agent.list_instances(request.model_id, request.task_id)
        return deployer_pb2.ListInstancesResponse(instances=[convert.instance_record_to_proto(r, t, a) for r, t, a in rows])

    async def ListGpus(self, request: deployer_pb2.ListGpusRequest, context: grpc.aio.ServicerContext
                       ) -> deployer_pb2.ListGpusResponse:
        return deployer_pb2.ListGpusResponse(gpus=[convert.gpu_record_to_proto(g) for g in await self.agent.list_gpus(request.node)])


def service_hooks(agent: NodeAgent, advertise_host: str = ""
                  ) -> tuple[Callable[[grpc.aio.Server], list[str]], Callable[[RunningServer], Awaitable[None]]]:
    """(add_servicers, on_ready) for `serve`/`start_server`: register the servicer, then, once bound,
    publish this deployer's address in its node record and start the agent. The address is known
    only after binding (port 0); `advertise_host` replaces the bind host when peers must use another."""

    def add(server: grpc.aio.Server) -> list[str]:
        deployer_pb2_grpc.add_DeployerServiceServicer_to_server(DeployerServicer(agent), server)
        return [SERVICE_NAME]

    async def ready(running: RunningServer) -> None:
        agent.endpoint = f"{advertise_host}:{running.port}" if advertise_host else running.address
        await agent.start()

    return add, ready
