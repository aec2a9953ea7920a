"""The orchestrator's outgoing gRPC clients: selector, per-node deployers (by the address in their node
record), and the generator service (or the in-process template library when no address is set)."""

from __future__ import annotations

import grpc.aio

from flowmaker import convert
from flowmaker.api.deployer.v1 import deployer_pb2_grpc
from flowmaker.api.generator.v1 import generator_pb2, generator_pb2_grpc
from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc
from flowmaker.api.selector.v1 import selector_pb2_grpc
from flowmaker.domain import Model, Workflow
from flowmaker.generator import Generator, TemplateGenerator
from flowmaker.rpc.channels import insecure_channel
from flowmaker.rpc.errors import call


class GeneratorClient:
    """The Generator interface over the generator service's GenerateWorkflows."""

    name = "generator-service"

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float) -> None:
        self.stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        self.timeout_s = timeout_s

    async def generate(self, description: str, max_candidates: int = 3) -> tuple[Workflow, ...]:
        resp = await call(self.stub.GenerateWorkflows(
            generator_pb2.GenerateWorkflowsRequest(description=description, max_workflows=max_candidates),
            timeout=self.timeout_s))
        return tuple(convert.workflow_from_proto(w) for w in resp.workflows)

    async def close(self) -> None:
        return None


class Clients:
    """Channels are created once and reused; every call on them carries a deadline (rpc.channels)."""

    def __init__(self, selector_address: str, generator_address: str = "", *, timeout_s: float = 30.0,
                 profiler_address: str = "", deployer_tls_server_name: str = "") -> None:
        self.timeout_s = timeout_s
        self.deployer_tls_server_name = deployer_tls_server_name
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self.selector = selector_pb2_grpc.SelectorServiceStub(self.channel(selector_address))
        self.profiler = (profiler_pb2_grpc.ProfilerServiceStub(self.channel(profiler_address))
                         if profiler_address else None)
        self.generator: Generator = (GeneratorClient(self.channel(generator_address), timeout_s)
                                     if generator_address else TemplateGenerator())

    def channel(self, address: str, tls_server_name: str = "") -> grpc.aio.Channel:
        key = (address, tls_server_name)
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = insecure_channel(address, default_timeout_s=self.timeout_s,
                                                        tls_server_name=tls_server_name)
        return ch

    async def registered_models(self, timeout_s: float) -> tuple[Model, ...] | None:
        """The models registered with the profiler (None when no profiler is configured)."""
        if self.profiler is None:
            return None
        resp = await call(self.profiler.ListModels(profiler_pb2.ListModelsRequest(), timeout=timeout_s))
        return tuple(convert.model_from_proto(m) for m in resp.models)

    def deployer(self, address: str) -> deployer_pb2_grpc.DeployerServiceStub:
        return deployer_pb2_grpc.DeployerServiceStub(self.channel(address, self.deployer_tls_server_name))

    async def close(self) -> None:
        await self.generator.close()
        for ch in self._channels.values():
            await ch.close(None)
        self._channels.clear()
