"""OrchestratorService servicer: parse the request, call the Orchestrator, convert the task back (thin)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc

from flowmaker import convert
from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from flowmaker.cancel import checkpoint, incoming_deadline, offload, remaining_s
from flowmaker.errors import DeadlineExceeded, PermissionDenied
from flowmaker.rpc.auth import current_principal
from flowmaker.state import keys
from services.orchestrator.orchestrator import Orchestrator, TaskView

T = TypeVar("T")

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name


def _workflows_from_proto(workflows: Any) -> list[Any]:
    out = []
    for w in workflows:
        checkpoint()
        out.append(convert.workflow_from_proto(w))
    return out


def _task(v: TaskView) -> task_pb2.Task:
    return convert.task_to_proto(v.task, etag=v.etag, state=v.state, failure=v.failure,
                                 observed_rate_rps=v.observed_rate_rps)


class Owners:
    """Task ownership: the principal that deployed a task (flowmaker.rpc.auth.current_principal) is its
    owner, recorded under `keys.owner(task_id)`; only the owner or an admin may get, approve, invoke or
    delete it, and ListTasks shows a user only their own tasks. Anyone else gets PERMISSION_DENIED,
    whether or not the task exists (AIP-211: no probing for ids). A plaintext stack has no principals:
    every caller is the anonymous admin."""

    def __init__(self, store: Any) -> None:
        self.store = store

    async def record(self, task_id: str) -> None:
        p = current_principal.get()
        if p.name:
            await self.store.put(keys.owner(task_id), {"owner": p.name})

    async def check(self, task_id: str) -> None:
        p = current_principal.get()
        if p.admin:
            return
        kv = await self.store.get(keys.owner(task_id)) if task_id else None
        if kv is None or not isinstance(kv.value, dict) or kv.value.get("owner") != p.name:
            raise PermissionDenied(f"{p.name!r} may not use task {task_id[:64]!r}: it is not theirs, or does not "
                                   "exist", field="task_id", reason="NOT_TASK_OWNER")

    async def visible(self) -> set[str] | None:
        """Task ids the caller may see; None = all (admin)."""
        p = current_principal.get()
        if p.admin:
            return None
        listing = await self.store.get_prefix(keys.OWNERS)
        return {keys.parse_owner(kv.key) for kv in listing.items
                if isinstance(kv.value, dict) and kv.value.get("owner") == p.name}

    async def forget(self, task_id: str) -> None:
        await self.store.delete(keys.owner(task_id))


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self.owners = Owners(orch.store)

    async def DeployTask(self, request: orchestrator_pb2.DeployTaskRequest, context: grpc.aio.ServicerContext
                         ) -> orchestrator_pb2.DeployTaskResponse:
        v = await self.orch.deploy_task(
            request.description, convert.slo_from_proto(request.slo) if request.HasField("slo") else None,
            name=request.name, max_workflows=request.max_workflows,
            workflows=await offload(_workflows_from_proto, request.workflows))  # a big DAG: off the event loop
        await self.owners.record(v.task.id)
        return orchestrator_pb2.DeployTaskResponse(task=_task(v))

    async def ApproveWorkflows(self, request: orchestrator_pb2.ApproveWorkflowsRequest,
                               context: grpc.aio.ServicerContext) -> orchestrator_pb2.ApproveWorkflowsResponse:
        await self.owners.check(request.task_id)
        v = await self.orch.approve(request.task_id, list(request.workflow_ids), strategy=request.strategy,
                                    options=request.options if request.HasField("options") else None,
                                    etag=request.etag)
        return orchestrator_pb2.ApproveWorkflowsResponse(task=_task(v))

    async def GetTask(self, request: orchestrator_pb2.GetTaskRequest, context: grpc.aio.ServicerContext
                      ) -> orchestrator_pb2.GetTaskResponse:
        await self.owners.check(request.task_id)
        return orchestrator_pb2.GetTaskResponse(task=_task(await self.orch.view(request.task_id)))

    async def ListTasks(self, request: orchestrator_pb2.ListTasksRequest, context: grpc.aio.ServicerContext
                        ) -> orchestrator_pb2.ListTasksResponse:
        views = await self.orch.list_tasks(convert.task_state_from_proto(request.state))
        mine = await self.owners.visible()
        if mine is not None:
            views = [v for v in views if v.task.id in mine]
        return orchestrator_pb2.ListTasksResponse(tasks=[_task(v) for v in views])

    async def DeleteTask(self, request: orchestrator_pb2.DeleteTaskRequest, context: grpc.aio.ServicerContext
                         ) -> orchestrator_pb2.DeleteTaskResponse:
        await self.owners.check(request.task_id)
        t, stopped = await self.orch.delete(request.task_id)
        await self.owners.forget(request.task_id)
        return orchestrator_pb2.DeleteTaskResponse(task=convert.task_to_proto(t), released_instance_ids=stopped)

    async def Invoke(self, request: orchestrator_pb2.InvokeRequest, context: grpc.aio.ServicerContext
                     ) -> orchestrator_pb2.InvokeResponse:
        await self.owners.check(request.task_id)
        rid = uuid.uuid4().hex
        ex = await self._bounded(self.orch.invoke(request.task_id, request.input,
                                                  max_output_tokens=request.max_output_tokens))
        return convert.execution_to_proto(ex, rid)

    async def _bounded(self, aw: Awaitable[T]) -> T:
        """The whole invocation, TOOL stages included, within the caller's deadline or, when it set none,
        `invoke_timeout_s` (which then also caps every engine call made for it)."""
        left = remaining_s()
        if left is None:
            left = self.orch.settings.invoke_timeout_s
            incoming_deadline.set(time.monotonic() + left)  # this RPC's context only
        try:
            return await asyncio.wait_for(aw, max(left, 0.0))
        except TimeoutError:
            raise DeadlineExceeded(f"the invocation did not finish within {left:.3g} s (the caller's deadline or "
                                   "invoke_timeout_s)", reason="INVOKE_TIMEOUT") from None

    async def InvokeStream(self, request: orchestrator_pb2.InvokeStreamRequest, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[orchestrator_pb2.InvokeStreamResponse]:
        await self.owners.check(request.task_id)
        rid = uuid.uuid4().hex
        queue: asyncio.Queue[orchestrator_pb2.InvokeStreamResponse] = asyncio.Queue()

        async def on_event(kind: str, payload: Any) -> None:
            if kind == "delta":
                sid, piece = payload
                await queue.put(orchestrator_pb2.InvokeStreamResponse(delta=piece, stage_id=sid))
            else:
                await queue.put(orchestrator_pb2.InvokeStreamResponse(stage_done=convert.stage_result_to_proto(payload),
                                                                      stage_id=payload.stage_id))

        run = asyncio.create_task(self._bounded(self.orch.invoke(
            request.task_id, request.input, max_output_tokens=request.max_output_tokens, on_event=on_event)))
        try:
            while True:
                get = asyncio.create_task(queue.get())
                await asyncio.wait({get, run}, return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                    continue
                get.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                ex = run.result()  # raises the invocation's error, which the error map sends as the status
                yield orchestrator_pb2.InvokeStreamResponse(done=convert.execution_to_proto(ex, rid))
                return
        finally:
            if not run.done():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)


def add_servicers(server: grpc.aio.Server, orch: Orchestrator) -> list[str]:
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(OrchestratorServicer(orch), server)
    return [SERVICE_NAME]
