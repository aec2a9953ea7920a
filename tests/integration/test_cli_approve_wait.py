"""`flowmaker task approve` when the approval's connection is cut: the CLI says the work goes on and how to
follow it, and with --wait (the default) follows the task across the cut until it settles.

The orchestrator here is a real gRPC server on a loopback port that cuts the first ApproveWorkflows call
(UNAVAILABLE, as a restarting orchestrator or an etcd stall does) and then reports the task's progress; the
CLI runs as its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc

pytestmark = pytest.mark.integration
T = task_pb2.Task


@dataclass
class FakeOrchestrator(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """GetTask walks `states` (the last one repeats); ApproveWorkflows is cut `cuts` times, then answers."""

    states: list[int]
    cuts: int = 1
    approvals: int = 0
    gets: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ApproveWorkflows(self, request: pb.ApproveWorkflowsRequest, context: grpc.ServicerContext) -> pb.ApproveWorkflowsResponse:
        with self.lock:
            self.approvals += 1
            cut = self.approvals <= self.cuts
        if cut:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the orchestrator went away")
        return pb.ApproveWorkflowsResponse(task=T(id=request.task_id, state=T.STATE_ACTIVE))

    def GetTask(self, request: pb.GetTaskRequest, context: grpc.ServicerContext) -> pb.GetTaskResponse:
        with self.lock:
            st = self.states[min(self.gets, len(self.states) - 1)]
            self.gets += 1
        return pb.GetTaskResponse(task=T(id=request.task_id, state=st))


@pytest.fixture
def serve() -> Iterator[object]:
    servers: list[grpc.Server] = []

    def start(fake: FakeOrchestrator) -> str:
        srv = grpc.server(futures.ThreadPoolExecutor(4))
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(fake, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return f"127.0.0.1:{port}"
    yield start
    for s in servers:
        s.stop(0)


def _cli(addr: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLOWMAKER_ORCHESTRATOR_ADDR": addr, "FLOWMAKER_STATE_FILE": str(tmp_path / "none.json"),
           "OTEL_TRACES_EXPORTER": "none", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "flowmaker.cli.main", "task", "approve", "t1", "one", *args],
                          env=env, capture_output=True, text=True, timeout=60)


def test_cut_approval_is_followed_until_active(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake = FakeOrchestrator([T.STATE_SELECTING, T.STATE_DEPLOYING, T.STATE_ACTIVE])
    r = _cli(serve(fake), tmp_path)
    assert r.returncode == 0, r.stderr
    assert "cut off" in r.stderr and "goes on" in r.stderr and "flowmaker task get t1" in r.stderr
    assert fake.approvals == 1 and fake.gets >= 3  # followed, never approved twice


def test_cut_approval_that_never_got_recorded_is_sent_again(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake = FakeOrchestrator([T.STATE_AWAITING_APPROVAL])
    r = _cli(serve(fake), tmp_path)
    assert r.returncode == 0, r.stderr
    assert fake.approvals == 2


def test_no_wait_says_the_work_goes_on_and_how_to_follow_it(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake = FakeOrchestrator([T.STATE_ACTIVE])
    r = _cli(serve(fake), tmp_path, "--no-wait")
    assert r.returncode == 1
    assert "UNAVAILABLE" in r.stderr and "the work goes on" in r.stderr and "flowmaker task get t1" in r.stderr
    assert fake.gets == 0
