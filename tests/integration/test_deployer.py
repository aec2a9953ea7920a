"""The deployer for real: etcd, the gRPC server on port 0, emulated engine processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowmaker.api.common.v1 import cluster_pb2
from flowmaker.api.deployer.v1 import deployer_pb2, deployer_pb2_grpc
from flowmaker.errors import InvalidSpec
from flowmaker.launcher import procs
from flowmaker.rpc import errors as rpc_errors
from flowmaker.rpc.channels import insecure_channel
from flowmaker.state import keys
from flowmaker.state.etcd import EtcdStore
from flowmaker.state.records import GpuRecord, InstanceRecord, InstanceState, read_cluster
from services.deployer.node import DeployParams, NodeAgent
from services.deployer.servicer import SERVICE_NAME, service_hooks
from services.deployer.settings import DeployerSettings

pytestmark = pytest.mark.integration

MODEL = "Llama-3.2-1B-Instruct"  # small: its analytic profile fits one A6000 easily
NODE = "node0"


@dataclass
class Deployer:
    agent: NodeAgent
    stub: deployer_pb2_grpc.DeployerServiceStub
    store: EtcdStore
    address: str


def _settings(etcd_endpoint: str, namespace: str, **kw: Any) -> DeployerSettings:
    base: dict[str, Any] = dict(node=NODE, host="127.0.0.1", port=0, etcd_endpoints=etcd_endpoint,
                                etcd_namespace=namespace, etcd_timeout_s=3.0, use_nvml=False, gpu_type="A6000",
                                gpu_count=4, lease_ttl_s=3, engine_time_scale=50.0, engine_stop_grace_s=3.0,
                                engine_start_timeout_s=60.0, grace_s=0.5)
    base.update(kw)
    return DeployerSettings(**base)


@pytest.fixture
async def deployer(etcd, etcd_namespace: str, etcd_store: EtcdStore, start_service) -> AsyncIterator[Deployer]:  # type: ignore[no-untyped-def]
    settings = _settings(etcd.endpoint, etcd_namespace)
    store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
    agent = NodeAgent(store, settings)

    add, ready = service_hooks(agent)

    srv = await start_service("deployer", add, settings, on_ready=ready, on_shutdown=[agent.shutdown, store.close])
    async with insecure_channel(srv.address, default_timeout_s=60) as ch:
        yield Deployer(agent, deployer_pb2_grpc.DeployerServiceStub(ch), etcd_store, srv.address)


async def _gpus(store: EtcdStore) -> dict[str, GpuRecord]:
    return {g.id: g for g in (GpuRecord.from_json(kv.value) for kv in (await store.get_prefix(keys.GPUS)).items)}


async def _instance(store: EtcdStore, iid: str) -> InstanceRecord | None:
    kv = await store.get(keys.instance(iid))
    return None if kv is None else InstanceRecord.from_json(kv.value)


async def _eventually(check: Callable[[], Any], timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still "exists"; ask ps for its state.
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(out) and not out.startswith("Z")


async def _chat(endpoint: str, model: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.post(endpoint + "/v1/chat/completions", json={
                "model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hello there"}]}) as r:
            assert r.status == 200, await r.text()
            return await r.json()  # type: ignore[no-any-return]


async def test_deploy_ready_serves_chat_accounts_memory_and_release_frees_it(deployer: Deployer) -> None:
    d = deployer
    resp = await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=1, pp=1, task_id="task-a",
                                                          request_id="inst-1"))
    inst = resp.instance
    assert inst.state == cluster_pb2.Instance.STATE_READY and inst.id == "inst-1"
    assert inst.node == NODE and inst.engine == "emulated" and list(inst.task_ids) == ["task-a"]
    assert len(inst.gpu_ids) == 1 and inst.endpoint.startswith("http://127.0.0.1:")
    body = await _chat(inst.endpoint, MODEL)
    assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] == 5

    # Memory is accounted on exactly the chosen GPU (LeastLoaded on an empty node: the smallest id).
    rec = await _instance(d.store, "inst-1")
    assert rec is not None and rec.state is InstanceState.READY and rec.memory_reserved
    assert list(inst.gpu_ids) == ["node0-gpu0"]
    gpus = await _gpus(d.store)
    assert gpus["node0-gpu0"].memory_used_gb == pytest.approx(rec.memory_gb_per_gpu)
    assert rec.memory_gb_per_gpu > 0
    assert all(g.memory_used_gb == 0 for gid, g in gpus.items() if gid != "node0-gpu0")
    listed = await d.stub.ListGpus(deployer_pb2.ListGpusRequest())
    assert [(g.id, g.memory_used_gb) for g in listed.gpus][:2] == [("node0-gpu0", rec.memory_gb_per_gpu),
                                                                   ("node0-gpu1", 0.0)]
    # The selector's view of the same state.
    view = await read_cluster(d.store)
    assert [i.id for i in view.cluster.instances] == ["inst-1"] and len(view.cluster.gpus) == 4

    # A second deploy is placed on the least loaded GPU, not on top of the first.
    second = (await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, request_id="inst-2"))).instance
    assert list(second.gpu_ids) == ["node0-gpu1"]
    # Retrying the same request_id is idempotent (and adds the task's reference).
    again = (await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, request_id="inst-1",
                                                            task_id="task-b"))).instance
    assert again.id == "inst-1" and again.endpoint == inst.endpoint
    listing = await d.stub.ListInstances(deployer_pb2.ListInstancesRequest(task_id="task-b"))
    assert [(i.id, list(i.task_ids)) for i in listing.instances] == [("inst-1", ["task-a", "task-b"])]

    pid = d.agent.procs["inst-1"].pid
    assert pid is not None and _pid_alive(pid)
    # Dropping one of two references keeps the instance.
    rel = await d.stub.Release(deployer_pb2.ReleaseRequest(instance_id="inst-1", task_id="task-a"))
    assert not rel.stopped and rel.instance.state == cluster_pb2.Instance.STATE_READY
    assert _pid_alive(pid)
    # Dropping the last one stops the engine, frees the memory and deletes the instance.
    rel = await d.stub.Release(deployer_pb2.ReleaseRequest(instance_id="inst-1", task_id="task-b"))
    assert rel.stopped and rel.instance.state == cluster_pb2.Instance.STATE_DRAINING
    assert not _pid_alive(pid)
    assert await _instance(d.store, "inst-1") is None
    assert await d.store.get_prefix(keys.reuse_of_instance("inst-1")) is not None
    assert (await d.store.get_prefix(keys.reuse_of_instance("inst-1"))).items == ()
    assert (await _gpus(d.store))["node0-gpu0"].memory_used_gb == 0.0
    # Releasing again is a no-op.
    rel = await d.stub.Release(deployer_pb2.ReleaseRequest(instance_id="inst-1"))
    assert not rel.stopped and not rel.HasField("instance")
    await d.stub.Release(deployer_pb2.ReleaseRequest(instance_id="inst-2"))
    assert all(g.memory_used_gb == 0 for g in (await _gpus(d.store)).values())


async def test_engines_inherit_nothing_of_the_suite(deployer: Deployer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's environment holds its own settings only: not the deployer's TLS key path, the etcd endpoints,
    a token file or any other suite setting (issue 22: with the deployer's key an engine could write etcd)."""
    suite = {"FLOWMAKER_DEPLOYER_TLS_KEY": "/etc/flowmaker/deployer.key", "FLOWMAKER_TLS_CA": "/etc/ca.pem",
             "FLOWMAKER_ETCD_ENDPOINTS": "127.0.0.1:2379", "FLOWMAKER_TOKEN_FILE": "/root/tokens.json",
             "OPENAI_API_KEY": "sk-not-for-engines"}
    for k, v in suite.items():
        monkeypatch.setenv(k, v)
    inst = (await deployer.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, request_id="env-probe"))).instance
    assert inst.state == cluster_pb2.Instance.STATE_READY
    pid = deployer.agent.procs["env-probe"].pid
    assert pid is not None
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
    assert not set(suite) & set(env), sorted(env)
    assert not [k for k in env if k.startswith("FLOWMAKER_") and not k.startswith(("FLOWMAKER_ENGINE_",
                                                                                    "FLOWMAKER_STACK"))], sorted(env)
    assert "PATH" in env and "HOME" in env  # what a process needs stays
    await deployer.stub.Release(deployer_pb2.ReleaseRequest(instance_id="env-probe"))


async def test_killed_engine_is_marked_failed_and_memory_freed(deployer: Deployer) -> None:
    d = deployer
    inst = (await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=2, request_id="doomed"))).instance
    assert inst.state == cluster_pb2.Instance.STATE_READY and len(inst.gpu_ids) == 2
    pid = d.agent.procs["doomed"].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)

    async def failed() -> InstanceRecord | None:
        rec = await _instance(d.store, "doomed")
        return rec if rec is not None and rec.state is InstanceState.FAILED else None

    rec = await _eventually(failed)
    assert rec.failure_reason == "ENGINE_EXITED" and "exited with code" in rec.reason and not rec.memory_reserved
    assert all(g.memory_used_gb == 0 for g in (await _gpus(d.store)).values())
    shown = (await d.stub.ListInstances(deployer_pb2.ListInstancesRequest())).instances
    assert [(i.id, i.state) for i in shown] == [("doomed", cluster_pb2.Instance.STATE_FAILED)]
    assert shown[0].failure.message.startswith("engine exited") and shown[0].endpoint == ""
    assert "doomed" not in [i.id for i in (await read_cluster(d.store)).cluster.instances]
    # Releasing a FAILED instance deletes its record without freeing memory twice.
    rel = await d.stub.Release(deployer_pb2.ReleaseRequest(instance_id="doomed"))
    assert rel.stopped and await _instance(d.store, "doomed") is None
    assert all(g.memory_used_gb == 0 for g in (await _gpus(d.store)).values())


async def test_impossible_deploy_is_resource_exhausted_with_error_info(deployer: Deployer) -> None:
    d = deployer
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=2, memory_gb_per_gpu=60.0))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = rpc_errors.error_info(ei.value)
    assert info is not None and info.reason == "NO_CAPACITY" and info.domain == "flowmaker.io"
    assert info.metadata["node"] == NODE and info.metadata["gpus_needed"] == "2"
    # Nothing was reserved or recorded.
    assert all(g.memory_used_gb == 0 for g in (await _gpus(d.store)).values())
    assert (await d.store.get_prefix(keys.INSTANCES)).items == ()
    # More GPUs than the node has: also no capacity, not a crash.
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=8))
    assert ei.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)


async def test_bad_requests_name_the_field(deployer: Deployer) -> None:
    d = deployer
    cases = [
        (deployer_pb2.DeployRequest(model_id=""), "model_id"),
        (deployer_pb2.DeployRequest(model_id=MODEL, tp=2, gpu_ids=["node0-gpu0"]), "gpu_ids"),
        (deployer_pb2.DeployRequest(model_id=MODEL, gpu_ids=["other-gpu0"]), "gpu_ids"),
        (deployer_pb2.DeployRequest(model_id=MODEL, engine="nope"), "engine"),
    ]
    for req, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await d.stub.Deploy(req)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        assert [v.field for v in rpc_errors.field_violations(ei.value)] == [field]
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await d.stub.Deploy(deployer_pb2.DeployRequest(model_id="no-such-model"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


async def test_concurrent_deploys_never_overcommit(deployer: Deployer) -> None:
    d = deployer
    # 4 x 48 GB; each instance needs 2 GPUs x 30 GB: exactly two fit, whatever the interleaving.
    reqs = [d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=2, memory_gb_per_gpu=30.0,
                                                     request_id=f"c{i}", no_wait=True)) for i in range(4)]
    results = await asyncio.gather(*reqs, return_exceptions=True)
    ok = [r for r in results if isinstance(r, deployer_pb2.DeployResponse)]
    errs = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(ok) == 2 and len(errs) == 2
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errs)
    used = sorted(gid for r in ok for gid in r.instance.gpu_ids)
    assert used == ["node0-gpu0", "node0-gpu1", "node0-gpu2", "node0-gpu3"]
    gpus = await _gpus(d.store)
    assert all(g.memory_used_gb == pytest.approx(30.0) for g in gpus.values())
    for r in ok:
        await d.stub.Release(deployer_pb2.ReleaseRequest(instance_id=r.instance.id))
    assert all(g.memory_used_gb == 0 for g in (await _gpus(d.store)).values())


async def test_node_drops_out_when_its_lease_expires_and_reregisters(deployer: Deployer) -> None:
    d = deployer
    await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, request_id="alive-1", no_wait=True))
    view = await read_cluster(d.store)
    assert len(view.cluster.gpus) == 4 and [i.id for i in view.cluster.instances] == ["alive-1"]
    node = await d.store.get(keys.node(NODE))
    assert node is not None and node.value["endpoint"] == d.address and node.lease
    keeper = d.agent.keeper
    assert keeper is not None
    # The agent hangs (stops refreshing) without revoking: the lease runs out after its TTL.
    keeper._task.cancel()  # type: ignore[union-attr]
    await _eventually(lambda: _absent(d.store, keys.node(NODE)), timeout_s=10)
    view = await read_cluster(d.store)
    assert view.cluster.gpus == () and view.cluster.instances == ()
    shown = (await d.stub.ListInstances(deployer_pb2.ListInstancesRequest())).instances
    assert shown[0].state == cluster_pb2.Instance.STATE_LOST
    assert rpc_errors_reason(shown[0]) == "NODE_LOST"
    # Re-registering brings the node, its GPUs and its (still running) instances back.
    await d.agent._reclaim()
    assert (await d.store.get(keys.node(NODE))) is not None
    assert [i.id for i in (await read_cluster(d.store)).cluster.instances] == ["alive-1"]
    # And when the keeper itself sees its lease gone (here: revoked behind its back), the agent
    # re-registers on its own under a new lease.
    old_lease = d.agent.keeper.id  # type: ignore[union-attr]
    await d.store.revoke_lease(old_lease)

    async def back() -> bool:
        kv = await d.store.get(keys.node(NODE))
        return kv is not None and kv.lease != old_lease

    await _eventually(back, timeout_s=10)


async def _absent(store: EtcdStore, key: str) -> bool:
    return await store.get(key) is None


def rpc_errors_reason(inst: cluster_pb2.Instance) -> str:
    from google.rpc import error_details_pb2

    info = error_details_pb2.ErrorInfo()
    inst.failure.details[0].Unpack(info)
    return info.reason


def _deployer_env(etcd: Any, namespace: str, node: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "FLOWMAKER_DEPLOYER_NODE": node, "FLOWMAKER_DEPLOYER_PORT": "0",
            "FLOWMAKER_DEPLOYER_ETCD_ENDPOINTS": etcd.endpoint, "FLOWMAKER_DEPLOYER_ETCD_NAMESPACE": namespace,
            "FLOWMAKER_DEPLOYER_USE_NVML": "false", "FLOWMAKER_DEPLOYER_GPU_COUNT": "2",
            "FLOWMAKER_DEPLOYER_LEASE_TTL_S": "5", "FLOWMAKER_DEPLOYER_ENGINE_TIME_SCALE": "50",
            "FLOWMAKER_DEPLOYER_GRACE_S": "1", "OTEL_TRACES_EXPORTER": "none", **extra}


async def _spawn_deployer(env: dict[str, str], lines: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m services.deployer` and the address it prints once SERVING."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.deployer", env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert proc.stdout is not None
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert raw, "deployer exited early:\n" + "".join(lines)
        line = raw.decode()
        lines.append(line)
        if line.startswith("FLOWMAKER_READY "):
            return proc, str(json.loads(line.split(" ", 1)[1])["address"])


async def _kill(proc: asyncio.subprocess.Process | None) -> None:
    if proc is not None and proc.returncode is None:
        proc.kill()
        await proc.wait()


async def test_process_entry_point_registers_serves_and_shuts_down_on_sigterm(etcd, etcd_namespace: str,  # type: ignore[no-untyped-def]
                                                                             etcd_store: EtcdStore) -> None:
    lines: list[str] = []
    proc = None
    try:
        proc, address = await _spawn_deployer(_deployer_env(etcd, etcd_namespace, "proc-node"), lines)
        node = await etcd_store.get(keys.node("proc-node"))
        assert node is not None and node.value["endpoint"] == address and node.value["gpu_count"] == 2
        async with insecure_channel(address, default_timeout_s=60) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            inst = (await deployer_pb2_grpc.DeployerServiceStub(ch).Deploy(
                deployer_pb2.DeployRequest(model_id=MODEL, request_id="p1"))).instance
        assert inst.state == cluster_pb2.Instance.STATE_READY
        await _chat(inst.endpoint, MODEL)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 20)
        assert rc == 0
        # Lease revoked at once (not after the TTL), engine stopped, memory given back.
        assert await etcd_store.get(keys.node("proc-node")) is None
        rec = await _instance(etcd_store, "p1")
        assert rec is not None and rec.state is InstanceState.FAILED and rec.failure_reason == "NODE_SHUTDOWN"
        assert all(g.memory_used_gb == 0 for g in (await _gpus(etcd_store)).values())
        with pytest.raises(aiohttp.ClientError):
            await _chat(inst.endpoint, MODEL)
    finally:
        await _kill(proc)


async def test_engines_die_with_a_sigkilled_deployer_and_its_successor_reconciles(etcd, etcd_namespace: str,  # type: ignore[no-untyped-def]
                                                                        etcd_store: EtcdStore) -> None:
    """Engines run in their own session, but with PR_SET_PDEATHSIG: SIGKILLing the deployer kills them too
    (no orphan). The next deployer of the same node marks their instances FAILED (NODE_RESTARTED) and gives
    their memory back; it would also kill an engine still running (found by pid + process identity)."""
    env = _deployer_env(etcd, etcd_namespace, "phoenix", FLOWMAKER_DEPLOYER_LEASE_TTL_S="2",
                        FLOWMAKER_DEPLOYER_ENGINE_STOP_GRACE_S="1")
    lines: list[str] = []
    first = second = None
    engine_pid = 0
    try:
        first, address = await _spawn_deployer(env, lines)
        async with insecure_channel(address, default_timeout_s=60) as ch:
            inst = (await deployer_pb2_grpc.DeployerServiceStub(ch).Deploy(
                deployer_pb2.DeployRequest(model_id=MODEL, request_id="orphan-1"))).instance
        assert inst.state == cluster_pb2.Instance.STATE_READY
        rec = await _instance(etcd_store, "orphan-1")
        assert rec is not None and rec.engine_pid > 0 and rec.engine_identity
        engine_pid = rec.engine_pid
        assert procs.is_same_alive(engine_pid, rec.engine_identity)

        first.kill()  # no shutdown hook runs: the engine is left behind
        await first.wait()
        deadline = time.monotonic() + 5
        while procs.is_same_alive(engine_pid, rec.engine_identity):
            assert time.monotonic() < deadline, "the engine outlived its SIGKILLed deployer (an orphan)"
            await asyncio.sleep(0.05)
        with pytest.raises(aiohttp.ClientError):
            await _chat(inst.endpoint, MODEL)

        second, _ = await _spawn_deployer(env, lines)
        assert not procs.is_same_alive(engine_pid, rec.engine_identity), "the restarted deployer left the engine"
        after = await _instance(etcd_store, "orphan-1")
        assert after is not None and after.state is InstanceState.FAILED and after.failure_reason == "NODE_RESTARTED"
        assert all(g.memory_used_gb == 0 for g in (await _gpus(etcd_store)).values())
        with pytest.raises(aiohttp.ClientError):
            await _chat(inst.endpoint, MODEL)
        # A recorded pid that now names another process (same pid, other identity) is never signalled.
        assert not procs.kill_group_if_same(os.getpid(), "not-this-process", 0.1)
    finally:
        await _kill(first)
        await _kill(second)
        if engine_pid and procs.start_time(engine_pid) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine_pid, signal.SIGKILL)


async def test_missing_engine_log_dir_is_created_not_a_hang(etcd, etcd_namespace: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """FLOWMAKER_DEPLOYER_ENGINE_LOG_DIR naming a directory that does not exist used to make every Deploy
    wait for engine_start_timeout_s (the engine's output reader died on open()); now it is created."""
    log_dir = tmp_path / "not" / "yet" / "there"
    store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
    agent = NodeAgent(store, _settings(etcd.endpoint, etcd_namespace, engine_log_dir=str(log_dir),
                                       engine_start_timeout_s=40.0))
    try:
        await agent.start()
        t0 = time.monotonic()
        rec = await agent.deploy(DeployParams(model_id=MODEL, request_id="logged-1"))
        assert rec.state is InstanceState.READY
        assert time.monotonic() - t0 < 20, "Deploy waited for the start timeout"
        assert "LISTENING" in (log_dir / "logged-1.log").read_text()
        # Removed while the agent runs (a cleaned-up temp dir): the next engine recreates it.
        shutil.rmtree(log_dir)
        rec2 = await agent.deploy(DeployParams(model_id=MODEL, request_id="logged-2"))
        assert rec2.state is InstanceState.READY and (log_dir / "logged-2.log").exists()
    finally:
        await agent.shutdown()
    # A directory that cannot be made is a clear error at start, naming the setting.
    (tmp_path / "a-file").write_text("x")
    bad = NodeAgent(store, _settings(etcd.endpoint, etcd_namespace, engine_log_dir=str(tmp_path / "a-file" / "logs")))
    with pytest.raises(InvalidSpec) as ei:
        await bad.start()
    assert ei.value.field == "engine_log_dir" and "a-file" in ei.value.message
    assert await store.get(keys.node(NODE)) is None  # it failed before registering
    await store.close()


def test_inventory_from_nvml_when_present_else_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML is imported lazily; with it (a stand-in module here: no GPU on CI) the inventory is the
    devices', names mapped to the catalog and memory in GiB; without it, settings decide."""
    import types

    from services.deployer.settings import gpu_inventory

    settings = DeployerSettings(node="n", use_nvml=True, gpu_type="L40S", gpu_count=3)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails -> settings
    assert [(g.index, g.gpu_type, g.memory_total_gb) for g in gpu_inventory(settings)] == \
        [(0, "L40S", 48.0), (1, "L40S", 48.0), (2, "L40S", 48.0)]

    fake = types.ModuleType("pynvml")
    calls: list[str] = []
    fake.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    fake.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H200"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=143771 * 2**20)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    inv = gpu_inventory(settings)
    assert [(g.index, g.gpu_type) for g in inv] == [(0, "H200"), (1, "H200")]
    assert inv[0].memory_total_gb == pytest.approx(140.4, abs=0.1)
    assert calls == ["init", "shutdown"]
    assert len(gpu_inventory(DeployerSettings(node="n", use_nvml=False, gpu_count=3))) == 3

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    fake.nvmlInit = no_driver  # type: ignore[attr-defined]
    assert [g.gpu_type for g in gpu_inventory(settings)] == ["L40S"] * 3


async def test_failed_registration_leaves_no_lease_refreshing() -> None:
    """etcd failing between granting the lease and creating the node key (the re-registration loop
    retries exactly that) must not leave a keeper refreshing an unused lease, one more per retry."""
    from flowmaker.errors import Unavailable
    from flowmaker.state.memory import MemoryStore

    class NodeKeyFails(MemoryStore):
        async def create(self, key: str, value: Any, *, lease: int = 0) -> int:
            raise Unavailable("etcd went away", reason="ETCD_UNAVAILABLE")

    store = NodeKeyFails()
    agent = NodeAgent(store, DeployerSettings(node="n", use_nvml=False, gpu_count=1, lease_ttl_s=2))
    for _ in range(3):
        with pytest.raises(Unavailable):
            await agent._claim_node()
    await asyncio.sleep(0)
    assert [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("lease-keepalive")] == []
    assert store._leases == {}  # every lease granted was revoked
    assert agent.keeper is None
