"""GeneratorService servicer: parse the request, call the Generator, convert the candidates back."""

from __future__ import annotations

import logging

import grpc

from flowmaker import convert
from flowmaker.api.generator.v1 import generator_pb2, generator_pb2_grpc
from flowmaker.errors import InvalidSpec
from flowmaker.generator import Generator

log = logging.getLogger(__name__)


class GeneratorServicer(generator_pb2_grpc.GeneratorServiceServicer):
    def __init__(self, generator: Generator, default_max_workflows: int = 3) -> None:
        self.generator = generator
        self.default_max_workflows = default_max_workflows

    async def GenerateWorkflows(self, request: generator_pb2.GenerateWorkflowsRequest,
                                context: grpc.aio.ServicerContext) -> generator_pb2.GenerateWorkflowsResponse:
        if request.max_workflows < 0:
            raise InvalidSpec(f"must be >= 0 (0 = default), got {request.max_workflows}", field="max_workflows")
        n = request.max_workflows or self.default_max_workflows
        workflows = await self.generator.generate(request.description, n)
        log.info("generated %d candidate(s) with %s: %s", len(workflows), self.generator.name,
                 [w.id for w in workflows])
        return generator_pb2.GenerateWorkflowsResponse(workflows=[convert.workflow_to_proto(w) for w in workflows])


def add_servicers(server: grpc.aio.Server, generator: Generator, default_max_workflows: int = 3) -> list[str]:
    generator_pb2_grpc.add_GeneratorServiceServicer_to_server(GeneratorServicer(generator, default_max_workflows),
                                                              server)
    return [generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"].full_name]
