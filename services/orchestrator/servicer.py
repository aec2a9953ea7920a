"""OrchestratorService servicer: parse the request, call the router (Invoke) or the lifecycle commands (the rest),
convert the task back (thin). Authorization reads the owners from the replica's watch-fed cache. The user RPCs
(admin only) call services/orchestrator/users.py, whose token lookup this replica's auth policy consults."""

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
from flowmaker.cancel import checkpoint, incoming_deadline, offload, remaining_s, wait_for
from flowmaker.errors import DeadlineExceeded, NoCapacity, PermissionDenied
from flowmaker.rpc.auth import current_principal, policy_of
from flowmaker.state import keys
from services.orchestrator.cache import RoutingCache
from services.orchestrator.engines import request_sampling
from services.orchestrator.orchestrator import Orchestrator, TaskView

T = TypeVar("T")

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name


def _workflows_from_proto(workflows: Any) -> list[Any]:
    out = []
    for w in workflows:
        checkpoint()
        out.append(convert.workflow_from_proto(w))
    return out


def _task(v: TaskView, owner: str) -> task_pb2.Task:
    return convert.task_to_proto(v.task, etag=v.etag, state=v.state, failure=v.failure,
                                 observed_rate_rps=v.observed_rate_rps, owner=owner)


class Owners:
    """Task ownership: the principal that deployed a task (flowmaker.rpc.auth.current_principal) is its
    owner, recorded under `keys.owner(task_id)`; only the owner or an admin may get, approve, invoke or
    delete it, and ListTasks shows a user only their own tasks. Anyone else gets PERMISSION_DENIED,
    whether or not the task exists (AIP-211: no probing for ids). A plaintext stack has no principals:
    every caller is the anonymous admin.

    Owners are read from the replica's cache (its watch on the owner keys): no etcd round trip on a request's
    path. A task the cache has not seen yet (deployed through another replica a moment ago) is looked up in
    etcd. `max_tasks` (OrchestratorSettings.max_tasks_per_user) caps what one user owns at once."""

    def __init__(self, store: Any, cache: RoutingCache | None = None, *, max_tasks: int = 0) -> None:
        self.store = store
        self.cache = cache
        self.max_tasks = max_tasks

    async def record(self, task_id: str) -> None:
        p = current_principal.get()
        if p.name:
            rev = await self.store.put(keys.owner(task_id), {"owner": p.name})
            if self.cache is not None:
                self.cache.note_owner(task_id, p.name, rev)

    async def check(self, task_id: str) -> None:
        p = current_principal.get()
        if p.admin:
            return
        owner = self.cache.owner(task_id) if self.cache is not None and task_id else None
        if owner is None and task_id:
            kv = await self.store.get(keys.owner(task_id))
            owner = kv.value.get("owner") if kv is not None and isinstance(kv.value, dict) else None
        if owner != p.name:
            raise PermissionDenied(f"{p.shown!r} may not use task {task_id[:64]!r}: it is not theirs, or does not "
                                   "exist", field="task_id", reason="NOT_TASK_OWNER")

    async def of(self, task_id: str) -> str:
        """The task's owner id ("" for none: a plaintext stack's), from the cache, else etcd (the owner key
        may reach this replica's watch after the task's)."""
        owner = self.cache.owner(task_id) if self.cache is not None else None
        if owner is None:
            kv = await self.store.get(keys.owner(task_id))
            owner = kv.value.get("owner") if kv is not None and isinstance(kv.value, dict) else None
        return str(owner or "")

    async def of_all(self, task_ids: list[str]) -> dict[str, str]:
        """Owner ids of many tasks: from a synced cache (no etcd read on a listing), else one etcd range."""
        if self.cache is not None and self.cache.fresh:
            return {tid: self.cache.owner(tid) or "" for tid in task_ids}
        listing = await self.store.get_prefix(keys.OWNERS)
        owners = {keys.parse_owner(kv.key): str(kv.value.get("owner") or "") for kv in listing.items
                  if isinstance(kv.value, dict)}
        return {tid: owners.get(tid, "") for tid in task_ids}

    async def visible(self) -> set[str] | None:
        """Task ids the caller may see; None = all (admin)."""
        p = current_principal.get()
        if p.admin:
            return None
        if self.cache is not None and self.cache.fresh:
            return set(self.cache.tasks_of(p.name))
        listing = await self.store.get_prefix(keys.OWNERS)
        return {keys.parse_owner(kv.key) for kv in listing.items
                if isinstance(kv.value, dict) and kv.value.get("owner") == p.name}

    async def resolve(self, ref: str) -> str:
        """The task `ref` names: a task id, else the name of one of the caller's tasks (names are unique per
        owner), else `ref` unchanged (the check and the call then say it does not exist). An id in the cache
        costs no etcd round trip."""
        if not ref or (self.cache is not None and self.cache.task(ref) is not None):
            return ref
        owner = current_principal.get().name
        tid = self.cache.named(owner, ref) if self.cache is not None else None
        if tid:
            return tid
        if await self.store.get(keys.task(ref)) is not None:
            return ref
        kv = await self.store.get(keys.task_name(owner, ref))
        return str(kv.value.get("task_id") or ref) if kv is not None and isinstance(kv.value, dict) else ref

    async def check_quota(self) -> None:
        """RESOURCE_EXHAUSTED when the caller (not an admin) already owns `max_tasks` tasks."""
        p = current_principal.get()
        if p.admin or not p.name or self.max_tasks <= 0:
            return
        owned = await self.visible() or set()
        if len(owned) >= self.max_tasks:
            raise NoCapacity(f"{p.shown!r} owns {len(owned)} tasks, the most one user may own at once "
                             f"(max_tasks_per_user = {self.max_tasks}); delete one first",
                             reason="TASK_QUOTA_EXCEEDED",
                             metadata={"limit": "max_tasks_per_user", "max": str(self.max_tasks),
                                       "owned": str(len(owned))})

    async def forget(self, task_id: str) -> None:
        await self.store.delete(keys.owner(task_id))
        if self.cache is not None:
            self.cache.note_owner_deleted(task_id)


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self.router = orch.router
        self.lifecycle = orch.lifecycle
        self.owners = Owners(orch.store, orch.cache, max_tasks=orch.settings.max_tasks_per_user)
        self.users = orch.users  # the same directory its token pruner (on the leader) prunes

    async def DeployTask(self, request: orchestrator_pb2.DeployTaskRequest, context: grpc.aio.ServicerContext
                         ) -> orchestrator_pb2.DeployTaskResponse:
        await self.owners.check_quota()
        # The owner is recorded with the task, and its name is checked unique among the owner's, in one txn.
        v = await self.lifecycle.deploy_task(
            request.description, convert.slo_from_proto(request.slo) if request.HasField("slo") else None,
            name=request.name, max_workflows=request.max_workflows,
            workflows=await offload(_workflows_from_proto, request.workflows),  # a big DAG: off the event loop
            owner=current_principal.get().name)
        return orchestrator_pb2.DeployTaskResponse(task=_task(v, current_principal.get().name))

    async def ApproveWorkflows(self, request: orchestrator_pb2.ApproveWorkflowsRequest,
                               context: grpc.aio.ServicerContext) -> orchestrator_pb2.ApproveWorkflowsResponse:
        tid = await self.owners.resolve(request.task_id)
        await self.owners.check(tid)
        v = await self.lifecycle.approve(tid, list(request.workflow_ids), strategy=request.strategy,
                                    options=request.options if request.HasField("options") else None,
                                    etag=request.etag)
        return orchestrator_pb2.ApproveWorkflowsResponse(task=_task(v, await self.owners.of(tid)))

    async def GetTask(self, request: orchestrator_pb2.GetTaskRequest, context: grpc.aio.ServicerContext
                      ) -> orchestrator_pb2.GetTaskResponse:
        tid = await self.owners.resolve(request.task_id)
        await self.owners.check(tid)
        v = await self.lifecycle.view(tid)
        return orchestrator_pb2.GetTaskResponse(task=_task(v, await self.owners.of(tid)))

    async def ListTasks(self, request: orchestrator_pb2.ListTasksRequest, context: grpc.aio.ServicerContext
                        ) -> orchestrator_pb2.ListTasksResponse:
        # A user's own tasks are looked up by id in the cache's owner index, not filtered out of a scan; both the
        # owners and the tasks as etcd holds them now (a task created through another replica a moment ago shows).
        await self.lifecycle.cache.catch_up()
        views = await self.lifecycle.list_tasks(convert.task_state_from_proto(request.state),
                                                ids=await self.owners.visible(), caught_up=True)
        owners = await self.owners.of_all([v.task.id for v in views])
        return orchestrator_pb2.ListTasksResponse(tasks=[_task(v, owners[v.task.id]) for v in views])

    async def DeleteTask(self, request: orchestrator_pb2.DeleteTaskRequest, context: grpc.aio.ServicerContext
                         ) -> orchestrator_pb2.DeleteTaskResponse:
        tid = await self.owners.resolve(request.task_id)
        await self.owners.check(tid)
        owner = await self.owners.of(tid)  # before its key goes with the task
        t, stopped = await self.lifecycle.delete(tid)
        await self.owners.forget(tid)
        return orchestrator_pb2.DeleteTaskResponse(task=convert.task_to_proto(t, owner=owner),
                                                   released_instance_ids=stopped)

    async def Invoke(self, request: orchestrator_pb2.InvokeRequest, context: grpc.aio.ServicerContext
                     ) -> orchestrator_pb2.InvokeResponse:
        tid = await self.owners.resolve(request.task_id)
        await self.owners.check(tid)
        request_sampling.set(convert.sampling_from_proto(request.sampling))  # read by every engine call of it
        rid = uuid.uuid4().hex
        ex = await self._bounded(self.router.invoke(tid, request.input,
                                                  max_output_tokens=request.max_output_tokens))
        resp = convert.execution_to_proto(ex, rid)
        resp.task_id = tid  # the id, when the caller named the task (the gateway answers with it)
        return resp

    async def _bounded(self, aw: Awaitable[T]) -> T:
        """The whole invocation, TOOL stages included, within the caller's deadline or, when it set none,
        `invoke_timeout_s` (which then also caps every engine call made for it)."""
        left = remaining_s()
        if left is None:
            left = self.router.settings.invoke_timeout_s
            incoming_deadline.set(time.monotonic() + left)  # this RPC's context only
        try:
            return await wait_for(aw, max(left, 0.0))
        except TimeoutError:
            raise DeadlineExceeded(f"the invocation did not finish within {left:.3g} s (the caller's deadline or "
                                   "invoke_timeout_s)", reason="INVOKE_TIMEOUT") from None

    async def InvokeStream(self, request: orchestrator_pb2.InvokeStreamRequest, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[orchestrator_pb2.InvokeStreamResponse]:
        tid = await self.owners.resolve(request.task_id)
        await self.owners.check(tid)
        request_sampling.set(convert.sampling_from_proto(request.sampling))  # the run's task copies the context
        rid = uuid.uuid4().hex
        queue: asyncio.Queue[orchestrator_pb2.InvokeStreamResponse] = asyncio.Queue()

        async def on_event(kind: str, payload: Any) -> None:
            if kind == "delta":
                sid, piece = payload
                await queue.put(orchestrator_pb2.InvokeStreamResponse(delta=piece, stage_id=sid))
            else:
                await queue.put(orchestrator_pb2.InvokeStreamResponse(stage_done=convert.stage_result_to_proto(payload),
                                                                      stage_id=payload.stage_id))

        run = asyncio.create_task(self._bounded(self.router.invoke(
            tid, request.input, max_output_tokens=request.max_output_tokens, on_event=on_event)))
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


    # ---- users and tokens managed live (admin only) ------------------------------------------------

    @staticmethod
    def _admin_only(rpc: str) -> None:
        p = current_principal.get()
        if not p.admin:
            raise PermissionDenied(f"{p.shown[:64]!r} may not call {rpc}: users are managed by an admin",
                                   reason="ADMIN_ONLY")

    async def CreateUser(self, request: orchestrator_pb2.CreateUserRequest, context: grpc.aio.ServicerContext
                         ) -> orchestrator_pb2.CreateUserResponse:
        self._admin_only("CreateUser")
        user, token, tid = await self.users.create_user(
            request.name, admin=request.admin, expires_in_s=convert.duration_s_from_proto(request.expires_in,
                                                                                          "expires_in"))
        return orchestrator_pb2.CreateUserResponse(user=convert.user_to_proto(user, now=time.time()), token=token,
                                                   token_id=tid)

    async def CreateToken(self, request: orchestrator_pb2.CreateTokenRequest, context: grpc.aio.ServicerContext
                          ) -> orchestrator_pb2.CreateTokenResponse:
        self._admin_only("CreateToken")
        user, token, tid = await self.users.create_token(
            request.user, expires_in_s=convert.duration_s_from_proto(request.expires_in, "expires_in"))
        return orchestrator_pb2.CreateTokenResponse(user=convert.user_to_proto(user, now=time.time()), token=token,
                                                    token_id=tid)

    async def ListUsers(self, request: orchestrator_pb2.ListUsersRequest, context: grpc.aio.ServicerContext
                        ) -> orchestrator_pb2.ListUsersResponse:
        self._admin_only("ListUsers")
        now = time.time()
        return orchestrator_pb2.ListUsersResponse(users=[convert.user_to_proto(u, now=now)
                                                         for u in await self.users.list_users()])

    async def Revoke(self, request: orchestrator_pb2.RevokeRequest, context: grpc.aio.ServicerContext
                     ) -> orchestrator_pb2.RevokeResponse:
        self._admin_only("Revoke")
        user, deleted, ids = await self.users.revoke(request.target)
        return orchestrator_pb2.RevokeResponse(user=convert.user_to_proto(user, now=time.time()), user_deleted=deleted,
                                               revoked_token_ids=ids)


def add_servicers(server: grpc.aio.Server, orch: Orchestrator) -> list[str]:
    servicer = OrchestratorServicer(orch)
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(servicer, server)
    policy = policy_of(server)
    if policy is not None:  # bearer tokens created live are admitted beside the tokens file's
        policy.live = servicer.users.lookup
    return [SERVICE_NAME]
