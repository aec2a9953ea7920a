"""Liveness under faults that kill nothing: a hung engine, a stalled node agent, a stall during an approval.

A whole local stack (real etcd, the five services as processes, engine processes), SIGSTOP on its processes,
with the launcher's supervisor as under `flowmaker up`. The engine liveness settings are the shipped defaults;
the reconciler's lease and grace times are the self-healing tests' shorter ones. Skip with FLOWMAKER_SKIP_E2E=1.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from flowmaker.bench.faults import (
    ACTIVE,
    DEPLOYING,
    NEW_MODEL_SLO,
    Client,
    Load,
    Supervisor,
    check_invariants,
    engine_pid,
    etcd_snapshot,
    spawn_deployer,
    stop_process,
    stopped,
    wait_task_state,
)
from flowmaker.launcher import LocalStack
from flowmaker.state import keys
from flowmaker.state.records import InstanceRecord
from tests.e2e.test_self_healing import _settle
from tests.e2e.test_self_healing import stack as stack  # the same shipped-timing stack fixture

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(out) and not out.startswith("Z")


def _instance(stack: LocalStack, iid: str) -> InstanceRecord:
    return InstanceRecord.from_json(etcd_snapshot(stack.etcd_endpoint, keys.instance(iid))[keys.instance(iid)])


def test_sigstopped_engine_serves_again_within_30s_losing_at_most_5_percent(stack: LocalStack) -> None:
    c = Client(stack)
    with Supervisor(stack):
        a = c.approve(c.deploy("hung").id)
        assert a.state == ACTIVE, a.failure.message
        iid = a.stage_instances["answer"]
        load = Load(c, [a.id], rate_rps=4.0).start()
        try:
            time.sleep(2)
            pid = engine_pid(stack)
            assert pid is not None
            t0 = time.monotonic()
            p95_during = 0.0
            with stopped(pid):  # hung, not dead: its port still accepts connections
                while _running(pid) and time.monotonic() - t0 < 30:
                    if time.monotonic() - t0 > 6:  # requests waiting on the hang count in the task's p95
                        p95_during = max(p95_during, c.get(a.id).observed_latency_p95_s)
                    time.sleep(0.5)
                killed_after = time.monotonic() - t0
            assert not _running(pid), "the hung engine was not killed within 30 s"
            while True:
                try:
                    c.invoke(a.id, "after the hang", timeout_s=10)
                    break
                except grpc.RpcError:
                    assert time.monotonic() - t0 < 30, "not serving again within 30 s of the hang"
                    time.sleep(0.2)
            serving_after = time.monotonic() - t0
            time.sleep(max(0.0, 60 - (time.monotonic() - t0)))  # the minute the fault started
        finally:
            load.stop()
        lost = load.sent - load.outcomes["OK"]
        assert load.sent >= 200 and lost <= 0.05 * load.sent, (killed_after, serving_after, load.outcomes,
                                                                 load.failures[:5])
        assert p95_during > 3.0, p95_during  # completed requests alone took well under a second
        t = c.get(a.id)
        assert t.stage_instances["answer"] == iid  # restarted in place, not re-selected
        rec = _instance(stack, iid)
        assert rec.state.value == "READY" and rec.engine_pid != pid
        _settle(c, stack, [a.id], 30)
    c.close()


def test_one_node_deployer_stall_keeps_serving(stack: LocalStack) -> None:
    """The node agent stalls past its lease and the grace: its instance is marked LOST, yet its engine answers,
    so requests keep being routed to it; when the agent wakes it takes the instance back (READY, same engine)."""
    c = Client(stack)
    with Supervisor(stack):
        a = c.approve(c.deploy("stall").id)
        assert a.state == ACTIVE, a.failure.message
        iid = a.stage_instances["answer"]
        before = _instance(stack, iid)
        load = Load(c, [a.id], rate_rps=4.0).start()
        try:
            time.sleep(2)
            pid = stack.pid_of("deployer")
            assert pid is not None
            seen_lost = False
            with stopped(pid):
                end = time.monotonic() + 15  # lease 4 s + grace 3 s: LOST well before the end
                while time.monotonic() < end:
                    seen_lost = seen_lost or _instance(stack, iid).state.value == "LOST"
                    time.sleep(0.5)
            assert seen_lost, "the stall never got the instance marked LOST: the test tests nothing"
            t, _ = c.wait_state(a.id, (ACTIVE,), 30)
            assert t is not None and t.state == ACTIVE, t
            time.sleep(3)
        finally:
            load.stop()
        lost = load.sent - load.outcomes["OK"]
        assert load.sent >= 60 and lost <= 0.01 * load.sent, (load.outcomes, load.failures[:5])
        after = _instance(stack, iid)
        assert after.state.value == "READY" and after.engine_pid == before.engine_pid  # taken back, not restarted
        _settle(c, stack, [a.id], 30)
    c.close()


def test_approval_onto_a_stalled_node_answers_and_lands_on_another(stack: LocalStack, tmp_path: Path) -> None:
    """The selector places a new instance on a node whose agent is SIGSTOPped but whose lease still holds (its
    GPUs have the most free memory). The Deploy call blocks; the instance goes LOST with the node; the
    approval is re-planned at once onto the live node and answers ACTIVE well within 30 s."""
    c = Client(stack)
    big = spawn_deployer(stack, "node-big", tmp_path / "node-big.log", gpus=2, gpu_memory_gb=80.0)
    try:
        with Supervisor(stack):
            pending = c.deploy("replan")
            got: dict[str, object] = {}

            def approve() -> None:
                t0 = time.monotonic()
                try:
                    got["task"] = c.approve(pending.id, timeout_s=90)
                except grpc.RpcError as e:
                    got["error"] = f"{e.code().name}: {e.details()}"
                got["took"] = time.monotonic() - t0
            with stopped(big.pid):
                th = threading.Thread(target=approve, daemon=True)
                th.start()
                th.join(60)
            assert not th.is_alive(), "the approval did not answer within 60 s"
            assert "task" in got, got
            assert float(got["took"]) < 30, got["took"]  # type: ignore[arg-type]
            t = got["task"]
            assert t.state == ACTIVE, t  # type: ignore[attr-defined]
            iid = t.stage_instances["answer"]  # type: ignore[attr-defined]
            assert _instance(stack, iid).node != "node-big"
            assert c.invoke(pending.id, "after the re-plan").output
    finally:
        stop_process(big)
    _settle(c, stack, [pending.id], 60)
    c.close()


def test_stalled_node_with_a_serving_engine_is_left_make_before_break(stack: LocalStack, tmp_path: Path) -> None:
    """A task serves from a node whose agent then stalls for good: its instance goes LOST, but its engine
    answers, so requests keep going to it while the task moves to the live node make-before-break."""
    c = Client(stack)
    big = spawn_deployer(stack, "node-big", tmp_path / "node-big.log", gpus=2, gpu_memory_gb=80.0)
    try:
        with Supervisor(stack):
            a = c.approve(c.deploy("moving").id)
            assert a.state == ACTIVE, a.failure.message
            old = a.stage_instances["answer"]
            assert _instance(stack, old).node == "node-big"  # the most free memory: the premise of the test
            load = Load(c, [a.id], rate_rps=4.0).start()
            try:
                time.sleep(2)
                with stopped(big.pid):
                    end = time.monotonic() + 40
                    moved = ""
                    while time.monotonic() < end and not moved:
                        t = c.get(a.id)
                        if t.stage_instances["answer"] != old and t.state == ACTIVE:
                            moved = t.stage_instances["answer"]
                        time.sleep(0.5)
                    assert moved, "the task did not move off the stalled node within 40 s"
                    assert _instance(stack, moved).node != "node-big"
                    time.sleep(2)
            finally:
                load.stop()
            lost = load.sent - load.outcomes["OK"]
            assert load.sent >= 20 and lost <= 0.01 * load.sent, (load.outcomes, load.failures[:5])
    finally:
        stop_process(big)
    c.close()


def test_etcd_kill_aimed_at_deploying_ends_active(stack: LocalStack) -> None:
    c = Client(stack)
    with Supervisor(stack):
        ids = []
        for i in range(2):
            # Each approval starts a new instance (the second asks for a model the first does not run), so the
            # kill lands while its Deploy call is in flight.
            pending = c.deploy(f"cut{i}", slo=NEW_MODEL_SLO) if i else c.deploy(f"cut{i}")
            th = threading.Thread(target=lambda tid=pending.id: _swallow(lambda: c.approve(tid, timeout_s=90)),
                                  daemon=True)
            th.start()
            assert wait_task_state(c, pending.id, (DEPLOYING, ACTIVE)) == DEPLOYING
            pid = stack.pid_of("etcd")
            assert pid
            os.kill(pid, 9)
            th.join(100)
            t, _ = c.wait_state(pending.id, (ACTIVE,), 60)
            assert t is not None and t.state == ACTIVE, t
            ids.append(pending.id)
        _settle(c, stack, ids, 30)
        assert check_invariants(stack, settled=True) == []
    c.close()


def _swallow(fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except grpc.RpcError:
        pass
