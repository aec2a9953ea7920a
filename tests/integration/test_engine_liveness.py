"""Engine liveness on a real node agent: a SIGSTOPped engine is seen as unresponsive, killed and failed
(ENGINE_HUNG); a Deploy retry of a STARTING record whose start died starts it again instead of returning it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from flowmaker.api.common.v1 import cluster_pb2
from flowmaker.api.deployer.v1 import deployer_pb2, deployer_pb2_grpc
from flowmaker.rpc.channels import insecure_channel
from flowmaker.state import keys
from flowmaker.state.etcd import EtcdStore
from flowmaker.state.records import InstanceState
from services.deployer.node import LivenessMeter, NodeAgent
from services.deployer.servicer import service_hooks
from tests.integration.test_deployer import MODEL, Deployer, _eventually, _gpus, _instance, _pid_alive, _settings

pytestmark = pytest.mark.integration


@pytest.fixture
async def live_deployer(etcd, etcd_namespace: str, etcd_store: EtcdStore, start_service) -> AsyncIterator[Deployer]:  # type: ignore[no-untyped-def]
    settings = _settings(etcd.endpoint, etcd_namespace, liveness_interval_s=0.3, liveness_timeout_s=0.5,
                         liveness_failures=2, load_scrape_interval_s=0.3)
    store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
    agent = NodeAgent(store, settings)
    add, ready = service_hooks(agent)
    srv = await start_service("deployer", add, settings, on_ready=ready, on_shutdown=[agent.shutdown, store.close])
    async with insecure_channel(srv.address, default_timeout_s=60) as ch:
        yield Deployer(agent, deployer_pb2_grpc.DeployerServiceStub(ch), etcd_store, srv.address)


async def test_sigstopped_engine_is_marked_unresponsive_then_killed_and_failed_hung(live_deployer: Deployer) -> None:
    d = live_deployer
    resp = await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=1, pp=1, task_id="t",
                                                          request_id="hang-1"))
    assert resp.instance.state == cluster_pb2.Instance.STATE_READY
    rec = await _instance(d.store, "hang-1")
    assert rec is not None and rec.engine_pid and rec.unresponsive_since == 0.0
    pid = rec.engine_pid
    used_before = sum(g.memory_used_gb for g in (await _gpus(d.store)).values())
    assert used_before > 0
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        async def failed() -> bool:
            r = await _instance(d.store, "hang-1")
            return r is not None and r.state is InstanceState.FAILED
        await _eventually(failed, timeout_s=15.0)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    rec = await _instance(d.store, "hang-1")
    assert rec is not None and rec.failure_reason == "ENGINE_HUNG" and "health" in rec.reason
    assert not rec.memory_reserved
    assert sum(g.memory_used_gb for g in (await _gpus(d.store)).values()) == pytest.approx(0.0, abs=1e-6)
    # Two failed probes of 0.5 s, 0.3 s apart: well under the 15 s bound, never the first probe's answer.
    assert took < 10.0
    await _eventually(lambda: asyncio.sleep(0, result=not _pid_alive(pid)), timeout_s=5.0)
    # Restarted in place (what the reconciler does): a fresh engine, answering.
    again = await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=1, pp=1, task_id="t",
                                                           request_id="hang-1"))
    assert again.instance.state == cluster_pb2.Instance.STATE_READY and not again.instance.HasField("unresponsive_time")


async def test_unresponsive_time_is_shown_while_probes_fail(etcd, etcd_namespace: str, etcd_store: EtcdStore,  # type: ignore[no-untyped-def]
                                                            start_service) -> None:
    # Many failures allowed: the engine stays READY (not yet killed) but shows as unresponsive, then recovers.
    settings = _settings(etcd.endpoint, etcd_namespace, liveness_interval_s=0.3, liveness_timeout_s=0.5,
                         liveness_failures=1000)
    store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
    agent = NodeAgent(store, settings)
    add, ready = service_hooks(agent)
    srv = await start_service("deployer", add, settings, on_ready=ready, on_shutdown=[agent.shutdown, store.close])
    async with insecure_channel(srv.address, default_timeout_s=60) as ch:
        stub = deployer_pb2_grpc.DeployerServiceStub(ch)
        await stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=1, pp=1, task_id="t", request_id="slow-1"))
        rec = await _instance(etcd_store, "slow-1")
        assert rec is not None
        os.kill(rec.engine_pid, signal.SIGSTOP)
        try:
            async def shown() -> bool:
                listed = await stub.ListInstances(deployer_pb2.ListInstancesRequest())
                return any(i.id == "slow-1" and i.HasField("unresponsive_time") for i in listed.instances)
            await _eventually(shown, timeout_s=10.0)
            r = await _instance(etcd_store, "slow-1")
            assert r is not None and r.state is InstanceState.READY and r.unresponsive_since > 0
        finally:
            os.kill(rec.engine_pid, signal.SIGCONT)

        async def cleared() -> bool:
            r = await _instance(etcd_store, "slow-1")
            return r is not None and r.unresponsive_since == 0.0
        await _eventually(cleared, timeout_s=10.0)


async def test_deploy_retry_restarts_a_starting_record_whose_start_died(live_deployer: Deployer) -> None:
    """What an etcd kill during an approval leaves: a STARTING record (memory reserved) with no start and no
    engine behind it. The orchestrator's retried Deploy must start it, not return it as success."""
    d = live_deployer
    await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=1, pp=1, task_id="t", request_id="cut-1"))
    kv = await d.store.get(keys.instance("cut-1"))
    assert kv is not None
    rec = await _instance(d.store, "cut-1")
    assert rec is not None
    # The engine dies with the start cut short: drop it from the agent as the failed READY write does.
    proc = d.agent.procs.pop("cut-1")
    await proc.stop(grace_s=0.0)
    await d.store.put(keys.instance("cut-1"), replace(rec, state=InstanceState.STARTING, endpoint="").to_json())
    resp = await d.stub.Deploy(deployer_pb2.DeployRequest(model_id=MODEL, tp=1, pp=1, task_id="t",
                                                          request_id="cut-1"))
    assert resp.instance.state == cluster_pb2.Instance.STATE_READY, resp.instance
    assert resp.instance.endpoint and resp.instance.endpoint != rec.endpoint
    assert d.agent.procs["cut-1"].is_alive
    used = [g.memory_used_gb for g in (await _gpus(d.store)).values() if g.memory_used_gb > 0]
    assert used == [pytest.approx(rec.memory_gb_per_gpu)]  # reserved once, not twice


def test_liveness_meter_probe_failures_and_progress_stall() -> None:
    m = LivenessMeter(failures=3, stall_s=10.0)
    m.probed(0.0, False, "no answer within 3s")
    m.probed(1.0, False, "no answer within 3s")
    assert m.verdict(1.0, 3.0) is None and m.unresponsive_since == 0.0
    m.probed(2.0, True)
    assert m.unresponsive_since is None and m.failed == 0  # an answer resets the run
    for t in (3.0, 4.0, 5.0):
        m.probed(t, False, "no answer within 3s")
    assert m.verdict(5.0, 3.0) is not None and "3 times" in (m.verdict(5.0, 3.0) or "")
    s = LivenessMeter(failures=3, stall_s=10.0)
    s.progress(0.0, 2.0, 100.0)
    s.progress(5.0, 2.0, 100.0)
    assert s.verdict(5.0, 3.0) is None
    s.progress(11.0, 2.0, 100.0)
    assert "no token produced" in (s.verdict(11.0, 3.0) or "")
    s.progress(12.0, 2.0, 101.0)  # a token: progress
    assert s.verdict(12.0, 3.0) is None
    s.progress(30.0, 0.0, 101.0)  # idle is no stall
    assert s.verdict(30.0, 3.0) is None
    off = LivenessMeter(failures=3, stall_s=0.0)
    off.progress(0.0, 1.0, 5.0)
    off.progress(100.0, 1.0, 5.0)
    assert off.verdict(100.0, 3.0) is None
