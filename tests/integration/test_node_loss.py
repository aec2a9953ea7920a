"""A node lost for good: two deployer processes (real etcd, engine processes), an in-process selector and
orchestrator. kill -9 of the deployer serving a task: its engine dies with it, its lease expires, the reconciler
marks its instance LOST and re-selects the task onto the remaining node; when the node comes back, its agent
stops what is left and the reconciler releases the unreferenced record, with every GPU's accounting exact."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flowmaker import convert
from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.domain import Slo, Stage, Workflow
from flowmaker.launcher.procs import is_same_alive
from flowmaker.rpc.errors import call
from flowmaker.state import keys
from flowmaker.state.records import GpuRecord, InstanceRecord

pytestmark = pytest.mark.integration

ONE = Workflow("one", (Stage("answer", input_tokens=50, output_tokens=10, prompt_template="{input}"),))


async def _spawn(etcd: Any, namespace: str, node: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "FLOWMAKER_DEPLOYER_NODE": node, "FLOWMAKER_DEPLOYER_PORT": "0",
           "FLOWMAKER_DEPLOYER_ETCD_ENDPOINTS": etcd.endpoint, "FLOWMAKER_DEPLOYER_ETCD_NAMESPACE": namespace,
           "FLOWMAKER_DEPLOYER_USE_NVML": "false", "FLOWMAKER_DEPLOYER_GPU_COUNT": "2",
           "FLOWMAKER_DEPLOYER_LEASE_TTL_S": "3", "FLOWMAKER_DEPLOYER_ENGINE_TIME_SCALE": "20",
           "FLOWMAKER_DEPLOYER_RESYNC_INTERVAL_S": "1", "FLOWMAKER_DEPLOYER_GRACE_S": "1",
           "OTEL_TRACES_EXPORTER": "none"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.deployer", env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert proc.stdout is not None
    lines = []
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert raw, "deployer exited early:\n" + "".join(lines)
        lines.append(raw.decode())
        if raw.startswith(b"FLOWMAKER_READY "):
            json.loads(raw.decode().split(" ", 1)[1])
            # Keep reading its output so its pipe never fills.
            asyncio.get_running_loop().create_task(_drain(proc))
            return proc


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


@pytest.fixture
async def two_nodes(etcd: Any, etcd_namespace: str, etcd_store: Any, start_control_plane: Any
                    ) -> AsyncIterator[tuple[Any, dict[str, asyncio.subprocess.Process], Any]]:
    procs = {n: await _spawn(etcd, etcd_namespace, n) for n in ("na", "nb")}
    _orch, stub = await start_control_plane(etcd_store, tool_time_scale=20, reconcile_interval_s=0.5,
                                            reconcile_node_lost_grace_s=2, reconcile_orphan_grace_s=2,
                                            follow_load=False)
    try:
        yield etcd_store, procs, stub
    finally:
        for p in procs.values():
            if p.returncode is None:
                p.terminate()
                await p.wait()


async def _instances(store: Any) -> dict[str, InstanceRecord]:
    return {r.id: r for r in (InstanceRecord.from_json(kv.value)
                              for kv in (await store.get_prefix(keys.INSTANCES)).items)}


async def test_lost_node_tasks_move_and_the_returning_node_is_cleaned(two_nodes: Any, etcd: Any,
                                                                      etcd_namespace: str) -> None:
    store, procs, stub = two_nodes
    t = (await call(stub.DeployTask(pb.DeployTaskRequest(description="d", name="mover", slo=convert.slo_to_proto(
        Slo(0.1, 30.0, 0.5)), workflows=[convert.workflow_to_proto(ONE)])))).task
    t = (await call(stub.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=t.id, workflow_ids=["one"]),
                                          timeout=120))).task
    assert t.state == task_pb2.Task.STATE_ACTIVE, t.failure.message
    old = (await _instances(store))[t.stage_instances["answer"]]
    lost, other = old.node, ({"na", "nb"} - {old.node}).pop()
    assert is_same_alive(old.engine_pid, old.engine_identity)

    procs[lost].kill()  # kill -9: no shutdown hook, no lease revoke
    await procs[lost].wait()
    killed = time.monotonic()
    deadline = killed + 5
    while is_same_alive(old.engine_pid, old.engine_identity):  # dies with its deployer, not an orphan
        assert time.monotonic() < deadline, "the engine outlived its deployer"
        await asyncio.sleep(0.05)

    # Lease TTL (3 s) + the reconciler's grace (2 s): LOST, re-selected onto the other node, ACTIVE again.
    while True:
        g = (await call(stub.GetTask(pb.GetTaskRequest(task_id=t.id)))).task
        insts = await _instances(store)
        cur = insts.get(g.stage_instances.get("answer", ""))
        if g.state == task_pb2.Task.STATE_ACTIVE and cur is not None and cur.node == other:
            break
        assert time.monotonic() - killed < 45, (g.state, g.healing, cur)
        await asyncio.sleep(0.2)
    assert insts[old.id].state.value == "LOST"
    out = await call(stub.Invoke(pb.InvokeRequest(task_id=t.id, input="on the other node")))
    assert out.stages[0].instance_id == cur.id

    # The node comes back: its agent stops what is left (FAILED, memory given back) and the reconciler
    # releases the record no task references.
    procs[lost] = await _spawn(etcd, etcd_namespace, lost)
    start = time.monotonic()
    while old.id in await _instances(store):
        assert time.monotonic() - start < 45, (await _instances(store))[old.id]
        await asyncio.sleep(0.2)
    gpus = [GpuRecord.from_json(kv.value) for kv in (await store.get_prefix(keys.GPUS)).items]
    live = await _instances(store)
    for gpu in gpus:
        held = sum(i.memory_gb_per_gpu for i in live.values() if i.memory_reserved and gpu.id in i.gpu_ids)
        assert gpu.memory_used_gb == pytest.approx(held) and gpu.memory_used_gb <= gpu.memory_total_gb
    assert all(gpu.memory_used_gb == 0 for gpu in gpus if gpu.node == lost)
    assert list(live) == [cur.id]
