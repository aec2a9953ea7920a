"""Self-healing under real faults: a whole local stack (real etcd, the five services as processes, engine
processes), the launcher's supervisor restarting what dies, and kill -9 / SIGSTOP on its processes.

Each test asserts the acceptance of issue 9 and, afterwards, the invariants of `flowmaker.bench.faults`:
no GPU over-commit, no orphan engine, no leaked reservation. Skip with FLOWMAKER_SKIP_E2E=1.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from flowmaker.api.common.v1 import task_pb2
from flowmaker.bench.faults import (
    ACTIVE,
    FAILED,
    Client,
    Load,
    Supervisor,
    check_invariants,
    etcd_stopped,
    kill_engine,
    kill_service,
)
from flowmaker.launcher import LocalStack, StackConfig
from flowmaker.launcher.procs import is_same_alive

AWAITING = task_pb2.Task.STATE_AWAITING_APPROVAL
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]

# Faster healing than the defaults, so each fault fits a test; the mechanisms are the same.
FAST = {
    "FLOWMAKER_ORCHESTRATOR_RECONCILE_INTERVAL_S": "1",
    "FLOWMAKER_ORCHESTRATOR_RECONCILE_NODE_LOST_GRACE_S": "3",
    "FLOWMAKER_ORCHESTRATOR_RECONCILE_ORPHAN_GRACE_S": "5",
    "FLOWMAKER_ORCHESTRATOR_RECONCILE_HEAL_BACKOFF_MAX_S": "3",
    "FLOWMAKER_DEPLOYER_LEASE_TTL_S": "4",
    "FLOWMAKER_DEPLOYER_RESYNC_INTERVAL_S": "2",
}


def _config(work_dir: Path) -> StackConfig:
    return StackConfig(gpus=2, time_scale=20.0, log_level="WARNING", work_dir=work_dir, keep_work_dir=True,
                       startup_timeout_s=120.0, extra_env=dict(FAST))


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    cfg = _config(tmp_path / "stack")
    if not os.path.exists(cfg.etcd_bin):
        pytest.skip(f"etcd not installed at {cfg.etcd_bin}")
    s = LocalStack(cfg).start()
    try:
        yield s
    finally:
        before = s.processes()
        s.stop()
        left = [pid for pid, st in before if is_same_alive(pid, st)]
        assert not left, f"processes left running after stop: {left}"


def _settle(client: Client, stack: LocalStack, task_ids: list[str], timeout_s: float) -> None:
    """Every task ACTIVE (not healing) and the settled invariants hold, within `timeout_s`."""
    end = time.monotonic() + timeout_s
    bad: list[str] = []
    while time.monotonic() < end:
        states = {}
        for tid in task_ids:
            try:
                t = client.get(tid)
                states[tid] = (t.state, t.HasField("healing"))
            except grpc.RpcError:
                states[tid] = (0, True)
        bad = check_invariants(stack, settled=True)
        if all(st == ACTIVE and not h for st, h in states.values()) and not bad:
            return
        time.sleep(0.5)
    raise AssertionError(f"not settled within {timeout_s}s: tasks {states}, invariants {bad}")


def test_engine_and_deployer_kill_heal_under_load(stack: LocalStack) -> None:
    c = Client(stack)
    with Supervisor(stack) as sup:
        a = c.approve(c.deploy("alpha").id)
        assert a.state == ACTIVE, a.failure.message
        iid = a.stage_instances["answer"]
        load = Load(c, [a.id], rate_rps=4.0).start()
        try:
            time.sleep(2)
            # 1. kill -9 the engine: restarted in place (same instance id), ACTIVE and serving within 30 s.
            assert kill_engine(stack) is not None
            killed_at = time.monotonic()
            t, _ = c.wait_state(a.id, (ACTIVE,), 30)
            assert t is not None and t.state == ACTIVE and not t.HasField("healing"), t
            assert t.stage_instances["answer"] == iid  # healed in place
            assert c.invoke(a.id, "after the engine kill").output
            assert time.monotonic() - killed_at < 30
            assert check_invariants(stack) == []
            time.sleep(1)
            failed_engine = load.sent - load.outcomes["OK"]
            # At most the requests in flight at the kill fail (the others wait for the replacement).
            assert failed_engine <= 4, (load.outcomes, load.failures)

            # 2. kill -9 the deployer: its engine dies with it (no orphan), the supervisor restarts it, the
            # new deployer reconciles, and the task is ACTIVE again within 60 s of the node being back.
            assert kill_service(stack, "deployer")
            deadline = time.monotonic() + 30
            while not any("deployer restarted" in e for _, e in sup.events):
                assert time.monotonic() < deadline, sup.events
                time.sleep(0.2)
            back_at = time.monotonic()
            t, _ = c.wait_state(a.id, (ACTIVE,), 60)
            assert t is not None and t.state == ACTIVE and not t.HasField("healing"), t
            assert time.monotonic() - back_at < 60
            assert c.invoke(a.id, "after the deployer kill").output
        finally:
            load.stop()
        _settle(c, stack, [a.id], 30)
        assert load.outcomes["OK"] > 0
    c.close()


def test_etcd_stall_and_kill_during_approve(stack: LocalStack) -> None:
    c = Client(stack)
    with Supervisor(stack):
        serving = c.approve(c.deploy("serving").id)
        assert serving.state == ACTIVE, serving.failure.message
        c.invoke(serving.id)  # warm the routing cache

        # 1. etcd SIGSTOPped for 15 s while a second task is being approved; requests to the ACTIVE task keep
        # succeeding meanwhile (routing needs no etcd).
        pending = c.deploy("stalled")
        result: dict[str, object] = {}

        def approve() -> None:
            try:
                result["task"] = c.approve(pending.id, timeout_s=90)
            except grpc.RpcError as e:
                result["error"] = e.code().name

        th = threading.Thread(target=approve, daemon=True)
        ok = failed = 0
        th.start()
        _wait_approval_accepted(c, pending.id)
        with etcd_stopped(stack):
            stall_end = time.monotonic() + 15
            while time.monotonic() < stall_end:
                try:
                    c.invoke(serving.id, "during the stall", timeout_s=10)
                    ok += 1
                except grpc.RpcError:
                    failed += 1
                time.sleep(0.5)
        assert ok >= 10 and failed == 0, (ok, failed)
        th.join(100)
        t, _ = c.wait_state(pending.id, (ACTIVE, FAILED), 60)
        assert t is not None and t.state in (ACTIVE, FAILED), t
        if t.state == FAILED:
            assert t.failure.message
        _settle_or_failed(c, stack, [serving.id], [pending.id])

        # 2. etcd kill -9 (the supervisor restarts it on the same data dir) during another approval.
        other = c.deploy("killed")
        th2 = threading.Thread(target=lambda: _swallow(lambda: c.approve(other.id, timeout_s=90)), daemon=True)
        th2.start()
        _wait_approval_accepted(c, other.id)
        assert kill_service(stack, "etcd")
        th2.join(100)
        t2, _ = c.wait_state(other.id, (ACTIVE, FAILED), 60)
        assert t2 is not None and t2.state in (ACTIVE, FAILED), t2
        _settle_or_failed(c, stack, [serving.id], [pending.id, other.id])
    c.close()


def _wait_approval_accepted(c: Client, task_id: str) -> None:
    """Until the approval is in etcd (SELECTING or later): the fault then hits an accepted approval."""
    end = time.monotonic() + 20
    while c.get(task_id).state == AWAITING:
        assert time.monotonic() < end, "the approval never started"
        time.sleep(0.02)


def _swallow(fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except grpc.RpcError:
        pass


def _settle_or_failed(c: Client, stack: LocalStack, active: list[str], either: list[str]) -> None:
    """`active` tasks ACTIVE, `either` ACTIVE or FAILED, and no reservation left by a FAILED one."""
    end = time.monotonic() + 30
    bad: list[str] = []
    while time.monotonic() < end:
        ok = all(c.get(t).state == ACTIVE for t in active) and all(
            c.get(t).state in (ACTIVE, FAILED) for t in either)
        bad = check_invariants(stack, settled=True)
        if ok and not bad:
            return
        time.sleep(0.5)
    raise AssertionError(f"not settled: {[(t, c.get(t).state) for t in active + either]}; {bad}")


def test_down_and_up_with_the_same_work_dir_brings_tasks_back(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "stack")
    if not os.path.exists(cfg.etcd_bin):
        pytest.skip(f"etcd not installed at {cfg.etcd_bin}")
    first = LocalStack(cfg).start()
    try:
        c = Client(first)
        ids = []
        for name in ("one", "two"):
            t = c.approve(c.deploy(name).id)
            assert t.state == ACTIVE, t.failure.message
            ids.append(t.id)
        c.close()
    finally:
        before = first.processes()
        first.stop()
        assert not [pid for pid, st in before if is_same_alive(pid, st)]
    second = LocalStack(_config(tmp_path / "stack")).start()
    try:
        c = Client(second)
        _settle(c, second, ids, 60)
        for tid in ids:
            assert c.invoke(tid, "back again").output
        c.close()
    finally:
        before = second.processes()
        second.stop()
        assert not [pid for pid, st in before if is_same_alive(pid, st)]
