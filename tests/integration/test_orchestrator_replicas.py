"""Orchestrator replicas against one etcd (real etcd, real gRPC servers on port 0, emulated engine processes): one
elected leader acts, every replica serves every RPC; a non-leader's approval and delete are carried out by the
leader; when the leader goes, another takes over and finishes what was half done. Also the per-user task quota,
the owner index that ListTasks and authorization read, and the router's per-task metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from flowmaker import convert
from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.errors import AlreadyExists, InvalidSpec, NoCapacity, NotFound, PermissionDenied
from flowmaker.rpc.auth import Principal, current_principal
from flowmaker.rpc.errors import call
from flowmaker.state import keys
from flowmaker.state.election import Election
from services.deployer.node import NodeAgent
from services.deployer.servicer import service_hooks
from services.deployer.settings import DeployerSettings
from services.orchestrator.cache import RoutingCache
from services.orchestrator.servicer import Owners
from tests.integration.test_orchestrator import ONE, SLO, TIME_SCALE

pytestmark = pytest.mark.integration

ACTIVE = task_pb2.Task.STATE_ACTIVE


async def _until(cond: Any, limit_s: float = 30.0) -> None:
    """Wait until `cond()` holds (a generous bound only: not a timing assertion)."""
    end = asyncio.get_running_loop().time() + limit_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.05)


@pytest.fixture
async def replicas(etcd_store: Any, start_service: Any, start_control_plane: Any) -> AsyncIterator[list[Any]]:
    """A deployer with 2 emulated GPUs and two orchestrator replicas: [(core, stub), (core, stub)]."""
    dset = DeployerSettings(host="127.0.0.1", port=0, grace_s=0.5, node="n0", gpu_type="A6000", gpu_count=2,
                            use_nvml=False, backend="emulated", engine_time_scale=TIME_SCALE,
                            engine_start_timeout_s=30, engine_stop_grace_s=2, lease_ttl_s=5)
    agent = NodeAgent(etcd_store, dset)
    add_deployer, deployer_ready = service_hooks(agent)
    await start_service("deployer", add_deployer, dset, on_ready=deployer_ready, on_shutdown=[agent.shutdown])
    out = []
    for _ in range(2):
        out.append(await start_control_plane(etcd_store, tool_time_scale=TIME_SCALE, reconcile_interval_s=0.5,
                                             observe_flush_interval_s=0.2, leader_lease_ttl_s=3))
    await _until(lambda: sum(core.is_leader() for core, _ in out) == 1)
    yield out


def _roles(replicas: list[Any]) -> tuple[Any, Any]:
    leader = next(r for r in replicas if r[0].is_leader())
    return leader, next(r for r in replicas if r is not leader)


async def _deploy(stub: Any, name: str) -> Any:
    return (await call(stub.DeployTask(pb.DeployTaskRequest(
        description=f"task {name}", name=name, slo=convert.slo_to_proto(SLO),
        workflows=[convert.workflow_to_proto(ONE)])))).task


async def test_a_follower_serves_every_rpc_and_the_leader_acts(replicas: list[Any], etcd_store: Any) -> None:
    (leader, lstub), (follower, fstub) = _roles(replicas)
    assert follower.leader()["replica"] == leader.replica_id  # each replica knows who leads
    kv = await etcd_store.get(keys.ORCHESTRATOR_LEADER)
    assert kv is not None and kv.value["replica"] == leader.replica_id
    assert not follower.reconciler.running and leader.reconciler.running

    t = await _deploy(fstub, "via-follower")
    # The follower only writes the intent; the leader's reconciler selects, commits and deploys.
    r = await call(fstub.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=t.id, workflow_ids=["one"]),
                                          timeout=120))
    assert r.task.state == ACTIVE, r.task.failure.message
    assert not follower.workers.busy_tasks() and not follower.reconciler.passes
    for stub in (fstub, lstub):  # both route from their own cache
        out = await call(stub.Invoke(pb.InvokeRequest(task_id=t.id, input="hello")))
        assert out.output
    listed = await call(fstub.ListTasks(pb.ListTasksRequest()))
    assert [x.id for x in listed.tasks] == [t.id] and listed.tasks[0].state == ACTIVE
    # Per-task series (flowmaker.metrics): both requests answered, within the SLO, with their tokens.
    sample = REGISTRY.get_sample_value
    assert sample("flowmaker_task_requests_total", {"task": t.id, "outcome": "ok"}) == 2
    assert sample("flowmaker_task_slo_met_requests_total", {"task": t.id}) == 2
    assert sample("flowmaker_task_latency_seconds_count", {"task": t.id}) == 2
    assert (sample("flowmaker_task_tokens_total", {"task": t.id, "kind": "completion"}) or 0) > 0

    d = await call(fstub.DeleteTask(pb.DeleteTaskRequest(task_id=t.id), timeout=60))
    assert d.task.id == t.id
    assert await etcd_store.get(keys.task(t.id)) is None
    assert not (await call(fstub.ListTasks(pb.ListTasksRequest()))).tasks
    # Deleted: each replica drops the task's series once its cache has seen the delete.
    await _until(lambda: sample("flowmaker_task_requests_total", {"task": t.id, "outcome": "ok"}) is None)


async def test_a_refused_approval_through_a_follower_reports_the_selector_error(replicas: list[Any]) -> None:
    _, (_, fstub) = _roles(replicas)
    t = await _deploy(fstub, "typo")
    with pytest.raises(InvalidSpec) as e:  # INVALID_ARGUMENT, with the selector's reason
        await call(fstub.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=t.id, workflow_ids=["one"],
                                                                     strategy="no-such-strategy"), timeout=60))
    assert e.value.reason == "UNKNOWN_STRATEGY"
    got = (await call(fstub.GetTask(pb.GetTaskRequest(task_id=t.id)))).task
    assert got.state == task_pb2.Task.STATE_AWAITING_APPROVAL
    # Fixed and approved again: the refusal is cleared.
    r = await call(fstub.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=t.id, workflow_ids=["one"]),
                                          timeout=120))
    assert r.task.state == ACTIVE and not r.task.failure.message


async def test_an_approval_taken_while_the_leader_goes_ends_active(replicas: list[Any]) -> None:
    (leader, _), (follower, fstub) = _roles(replicas)
    t = await _deploy(fstub, "handover")
    approval = asyncio.create_task(call(fstub.ApproveWorkflows(pb.ApproveWorkflowsRequest(
        task_id=t.id, workflow_ids=["one"]), timeout=120)))
    await asyncio.sleep(0.05)
    await leader.close()  # steps down (its lease revoked): the follower is elected and resumes the approval
    r = await approval
    assert r.task.state == ACTIVE, r.task.failure.message
    assert follower.is_leader() and follower.reconciler.running
    out = await call(fstub.Invoke(pb.InvokeRequest(task_id=t.id, input="after the handover")))
    assert out.output


async def test_a_crashed_leader_is_replaced_once_its_lease_expires(etcd_store: Any) -> None:
    elected: list[str] = []

    def candidate(name: str) -> Election:
        async def won() -> None:
            elected.append(name)
        return Election(etcd_store, keys.ORCHESTRATOR_LEADER, {"replica": name}, ttl_s=3, on_elected=won)
    a, b = candidate("a"), candidate("b")
    a.start()
    await _until(lambda: a.is_leader)
    b.start()
    await _until(lambda: b.decided.is_set())
    assert not b.is_leader and b.leader == {"replica": "a"}
    # A crash: `a` stops refreshing its lease and never revokes it; the key goes when the lease expires.
    a._lease = 0
    assert a._task is not None
    a._task.cancel()
    await asyncio.gather(a._task, return_exceptions=True)
    assert (await etcd_store.get(keys.ORCHESTRATOR_LEADER)).value == {"replica": "a"}
    await _until(lambda: b.is_leader, limit_s=20)
    assert elected == ["a", "b"] and b.leader == {"replica": "b"}
    await b.stop()
    assert await etcd_store.get(keys.ORCHESTRATOR_LEADER) is None  # a clean exit hands over at once


async def test_owner_index_and_the_per_user_quota(etcd_store: Any) -> None:
    cache = RoutingCache(etcd_store, resync_s=60)
    cache.start()
    try:
        owners = Owners(etcd_store, cache, max_tasks=2)
        await _until(lambda: cache.fresh)
        token = current_principal.set(Principal("alice"))
        try:
            for tid in ("a1", "a2"):
                await owners.check_quota()
                await owners.record(tid)
            with pytest.raises(NoCapacity) as e:
                await owners.check_quota()
            assert e.value.reason == "TASK_QUOTA_EXCEEDED" and "max_tasks_per_user" in str(e.value)
            assert await owners.visible() == {"a1", "a2"}
            await owners.check("a1")
        finally:
            current_principal.reset(token)
        # Another replica's cache learns owners from the watch; until then a miss is looked up in etcd.
        other = Owners(etcd_store, RoutingCache(etcd_store))
        token = current_principal.set(Principal("bob"))
        try:
            with pytest.raises(PermissionDenied):
                await other.check("a1")
            await other.check_quota()  # bob owns nothing
        finally:
            current_principal.reset(token)
        token = current_principal.set(Principal("alice"))
        try:
            await other.check("a2")
        finally:
            current_principal.reset(token)
    finally:
        with contextlib.suppress(Exception):
            await cache.stop()


async def test_task_names_are_unique_per_owner_and_work_as_ids(replicas: list[Any], etcd_store: Any) -> None:
    (_, lstub), (_, fstub) = _roles(replicas)
    t = await _deploy(fstub, "my-summariser")
    with pytest.raises(AlreadyExists) as e:  # through either replica: the name key is created with the task
        await _deploy(lstub, "my-summariser")
    assert e.value.reason == "TASK_NAME_TAKEN" and e.value.field == "name" and t.id in str(e.value)
    # The name works wherever the id does, on every replica.
    for stub in (fstub, lstub):
        assert (await call(stub.GetTask(pb.GetTaskRequest(task_id="my-summariser")))).task.id == t.id
    r = await call(lstub.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id="my-summariser", workflow_ids=["one"]),
                                          timeout=120))
    assert r.task.id == t.id and r.task.state == ACTIVE, r.task.failure.message
    assert (await call(fstub.Invoke(pb.InvokeRequest(task_id="my-summariser", input="hi")))).output
    d = await call(fstub.DeleteTask(pb.DeleteTaskRequest(task_id="my-summariser"), timeout=60))
    assert d.task.id == t.id
    assert await etcd_store.get(keys.task_name("", "my-summariser")) is None  # free again
    again = await _deploy(lstub, "my-summariser")
    assert again.id != t.id
    with pytest.raises(NotFound):
        await call(fstub.GetTask(pb.GetTaskRequest(task_id="no-such-name")))


def _count_resyncs(cache: RoutingCache) -> list[int]:
    """From now on count the cache's full listings (in the returned one-element list)."""
    count = [0]
    real = cache.resync

    async def counted() -> None:
        count[0] += 1
        await real()

    cache.resync = counted  # type: ignore[method-assign]
    return count


async def test_a_late_note_of_an_own_write_never_hides_a_newer_watch_event(etcd_store: Any) -> None:
    """A replica notes its own task writes in its cache at once, with their etcd revisions: a note that comes after
    the watch brought a newer revision of the task (another replica's write) leaves the newer record in place."""
    from dataclasses import replace

    from flowmaker.domain import Slo
    from flowmaker.orchestration.task import TaskRecord, TaskState

    cache = RoutingCache(etcd_store, resync_s=600)
    cache.start()
    try:
        await _until(lambda: cache.fresh)
        mine = TaskRecord("late1", "d", Slo(0.1, 1.0, 1.0), candidates=(ONE,), state=TaskState.AWAITING_APPROVAL)
        r1 = await etcd_store.put(keys.task(mine.id), mine.to_json())
        theirs = replace(mine, description="written by another replica")
        r2 = await etcd_store.put(keys.task(mine.id), theirs.to_json())
        await _until(lambda: cache.task_entry(mine.id)[0] == r2)
        cache.note_task(mine, r1)  # this replica's note of its own, older write
        assert cache.task_entry(mine.id)[0] == r2 and cache.task(mine.id).description == theirs.description
        newest = replace(mine, description="this replica again")
        cache.note_task(newest, r2 + 1)
        assert cache.task(mine.id).description == newest.description
    finally:
        await cache.stop()


async def test_catch_up_shows_what_another_replica_wrote_a_moment_ago(etcd_store: Any, etcd: Any) -> None:
    """Read-your-writes across replicas: `catch_up` asks etcd how the prefixes stand and waits for the watch; a cache
    whose watch is not running lists them instead; with etcd stopped, the cache's word stands within the ask bound."""
    import time

    from services.orchestrator import cache as cache_mod

    lagging = RoutingCache(etcd_store, resync_s=600)  # no watch: only catch_up can bring news
    await lagging.resync()
    await etcd_store.put(keys.owner("t1"), {"owner": "alice"})  # another replica's write
    assert lagging.owner("t1") is None
    await lagging.catch_up(wait_s=0.1)
    assert lagging.owner("t1") == "alice"
    await etcd_store.delete(keys.owner("t1"))  # a deletion alone (the count tells)
    await lagging.catch_up(wait_s=0.1)
    assert lagging.owner("t1") is None
    # An unreadable task record: listed once, then counted (not a listing at every catch-up).
    await etcd_store.put(keys.task("garbled"), {"not": "a task record"})
    await lagging.catch_up(wait_s=0.1)
    assert lagging.task("garbled") is None
    relists = _count_resyncs(lagging)
    await lagging.catch_up(wait_s=0.1)
    assert relists == [0], "an unreadable record made the cache look behind"

    live = RoutingCache(etcd_store, resync_s=600)
    live.start()
    try:
        await _until(lambda: live.fresh)
        await _until(lambda: live._owners.through > 0 and live._tasks.through > 0)
        resyncs = _count_resyncs(live)
        for i in range(5):
            await etcd_store.put(keys.owner(f"w{i}"), {"owner": "bob"})
            await live.catch_up()
            assert live.owner(f"w{i}") == "bob"
        await etcd_store.delete(keys.owner("w0"))
        await live.catch_up()
        assert live.owner("w0") is None
        assert resyncs == [0], "the watch kept up: catch_up should not have needed a listing"
        etcd.pause()
        try:
            t0 = time.monotonic()
            await live.catch_up()
            assert time.monotonic() - t0 < cache_mod.CATCH_UP_ASK_S + 1.0
            assert live.owner("w1") == "bob"  # the cache's word stands while etcd is away
        finally:
            etcd.resume()
    finally:
        await live.stop()
