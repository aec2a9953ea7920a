"""The generator service as a real process (`python -m services.generator`) on a free port: template
candidates over gRPC, the LLM path against a scripted emulated engine, and errors with their reasons."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from flowmaker import convert
from flowmaker.api.generator.v1 import generator_pb2, generator_pb2_grpc
from flowmaker.errors import FailedPrecondition, InvalidSpec
from flowmaker.rpc.errors import call

pytestmark = pytest.mark.integration


def _start(args: list[str], env: dict[str, str], marker: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "OTEL_TRACES_EXPORTER": "none", **env})
    assert p.stdout is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 0.2)[0]:
            line = p.stdout.readline()
            if line.startswith(marker):
                return p, line[len(marker):].strip()
            if not line and p.poll() is not None:
                break
    p.kill()
    raise RuntimeError(f"{args} did not start (exit code {p.poll()})")


@pytest.fixture
def procs() -> Iterator[Callable[[list[str], dict[str, str], str], str]]:
    started: list[subprocess.Popen[str]] = []

    def start(args: list[str], env: dict[str, str], marker: str) -> str:
        p, rest = _start(args, env, marker)
        started.append(p)
        return rest

    yield start
    for p in reversed(started):
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _generator(start: Callable[[list[str], dict[str, str], str], str], **env: str) -> str:
    rest = start(["services.generator"], {"FLOWMAKER_GENERATOR_PORT": "0", **env}, "FLOWMAKER_READY ")
    return str(json.loads(rest)["address"])


async def test_templates_over_grpc(procs: Callable[[list[str], dict[str, str], str], str]) -> None:
    addr = _generator(procs)
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = generator_pb2_grpc.GeneratorServiceStub(ch)
        resp = await call(stub.GenerateWorkflows(
            generator_pb2.GenerateWorkflowsRequest(description="Solve math word problems", max_workflows=2),
            timeout=10))
        wfs = [convert.workflow_from_proto(w).validate() for w in resp.workflows]
        assert len(wfs) == 2 and all(w.id.startswith("math-") and w.rationale for w in wfs)
        assert all(w.description == "Solve math word problems" for w in wfs)
        default = await call(stub.GenerateWorkflows(
            generator_pb2.GenerateWorkflowsRequest(description="Summarise articles"), timeout=10))
        assert len(default.workflows) == 3
        with pytest.raises(InvalidSpec) as e:
            await call(stub.GenerateWorkflows(generator_pb2.GenerateWorkflowsRequest(description=" "), timeout=10))
        assert e.value.field == "description"


async def test_llm_over_grpc(procs: Callable[[list[str], dict[str, str], str], str], tmp_path: Path) -> None:
    good = json.dumps({"candidates": [{"id": "one", "rationale": "single call", "stages": [
        {"id": "answer", "kind": "LLM", "depends_on": [], "input_tokens": 200, "output_tokens": 50,
         "calls_per_request": 1, "latency_s": 0.0, "role": "assistant", "prompt_template": "{input}"}]}]})
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"content": c, "delay_s": 0.0} for c in ("{oops", good, "x", "y")]))
    port = procs(["flowmaker.engine.server", "--model", "planner", "--port", "0", "--script", str(script)], {},
                 "LISTENING ")
    addr = _generator(procs, FLOWMAKER_GENERATOR_LLM_BASE_URL=f"http://127.0.0.1:{port}",
                      FLOWMAKER_GENERATOR_LLM_MODEL="planner", FLOWMAKER_GENERATOR_LLM_MAX_ATTEMPTS="2")
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = generator_pb2_grpc.GeneratorServiceStub(ch)
        req = generator_pb2.GenerateWorkflowsRequest(description="Answer questions")
        resp = await call(stub.GenerateWorkflows(req, timeout=20))
        assert [w.id for w in resp.workflows] == ["one"]  # after one malformed answer and a retry
        with pytest.raises(FailedPrecondition) as e:  # "x" then "y": unusable twice
            await call(stub.GenerateWorkflows(req, timeout=20))
        assert e.value.reason == "GENERATOR_UNUSABLE_ANSWERS" and "after 2 attempt(s)" in e.value.message
