"""A channel to several orchestrator replicas ("a:1,b:2", flowmaker.rpc.channels): calls are spread round robin,
idempotent calls answered UNAVAILABLE are retried on another replica, the others are not, and a replica that goes
away costs nothing once its connection is gone. Real gRPC servers on loopback (fakes of the service)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import grpc
import pytest

from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.rpc.channels import channel

pytestmark = pytest.mark.integration


class Replica(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, name: str, *, unavailable: bool = False) -> None:
        self.name = name
        self.unavailable = unavailable  # answer UNAVAILABLE, as a replica that is stopping does
        self.calls: Counter[str] = Counter()

    async def GetTask(self, request: Any, context: grpc.aio.ServicerContext) -> pb.GetTaskResponse:
        self.calls["GetTask"] += 1
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is stopping")
        return pb.GetTaskResponse(task=task_pb2.Task(id=request.task_id, name=self.name))

    async def DeployTask(self, request: Any, context: grpc.aio.ServicerContext) -> pb.DeployTaskResponse:
        self.calls["DeployTask"] += 1
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is stopping")
        return pb.DeployTaskResponse(task=task_pb2.Task(id="new", name=self.name))


async def _serve(replica: Replica) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_round_robin_retry_and_a_replica_gone() -> None:
    a, b = Replica("a"), Replica("b")
    (sa, addr_a), (sb, addr_b) = await _serve(a), await _serve(b)
    ch = channel(f"{addr_a},{addr_b}", default_timeout_s=5, tls=False, tracing=False)
    stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
    try:
        served = Counter([(await stub.GetTask(pb.GetTaskRequest(task_id="t"))).task.name for _ in range(20)])
        assert set(served) == {"a", "b"}  # both replicas take calls

        a.unavailable = True  # GetTask is idempotent: retried on b, never seen failing
        for _ in range(20):
            assert (await stub.GetTask(pb.GetTaskRequest(task_id="t"))).task.name == "b"
        assert a.calls["GetTask"] > 0
        codes = Counter()
        for _ in range(20):  # DeployTask creates a task each time: not retried, a's refusals reach the caller
            try:
                await stub.DeployTask(pb.DeployTaskRequest())
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
        assert codes["UNAVAILABLE"] > 0 and codes["OK"] > 0

        a.unavailable = False
        await sa.stop(None)  # a replica killed: its connection goes, calls go to the other
        for _ in range(20):
            assert (await stub.GetTask(pb.GetTaskRequest(task_id="t"))).task.name == "b"
    finally:
        await ch.close(None)
        await sa.stop(None)
        await sb.stop(None)
