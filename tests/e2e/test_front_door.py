"""End to end, as a new user meets FlowMaker: the `flowmaker` CLI, the official `openai` client through the
OpenAI-compatible gateway, and an OTLP receiver, all against one whole local stack (real etcd, the five
services and the gateway as processes, emulated engines) on loopback.

Skip with FLOWMAKER_SKIP_E2E=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from flowmaker.launcher import LocalStack, StackConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]

openai = pytest.importorskip("openai")

FIVE = ("generator", "profiler", "selector", "deployer", "orchestrator")
SUMMARIZE = "Summarise a document (meeting notes, an article, a report) in a few paragraphs."
# A workflow whose last stage is a TOOL stage: it streams nothing, its output is the answer.
LLM_THEN_TOOL = [{"id": "draft-then-format", "description": "an LLM draft, formatted by a tool", "stages": [
    {"id": "draft", "kind": "STAGE_KIND_LLM", "input_tokens": 60, "output_tokens": 12, "prompt_template": "{input}"},
    {"id": "format", "kind": "STAGE_KIND_TOOL", "depends_on": ["draft"], "latency_s": 0.05,
     "prompt_template": "FORMATTED: {draft}"}]}]


class Collector:
    """A minimal OTLP/gRPC trace receiver (opentelemetry-proto's TraceService) that keeps every span."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans: list[tuple[str, Any]] = []  # (service.name, Span)
        self._lock = threading.Lock()
        outer = self

        class Svc(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                with outer._lock:
                    for rs in request.resource_spans:
                        name = next((a.value.string_value for a in rs.resource.attributes
                                     if a.key == "service.name"), "")
                        outer.spans.extend((name, s) for ss in rs.scope_spans for s in ss.spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Svc(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def services_in(self, trace_id: bytes) -> set[str]:
        with self._lock:
            return {svc for svc, s in self.spans if s.trace_id == trace_id}

    def traces_with(self, name: str) -> set[bytes]:
        with self._lock:
            return {s.trace_id for _, s in self.spans if s.name == name}


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.server.stop(0)


def otlp_env(c: Collector) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{c.port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, collector: Collector) -> Iterator[LocalStack]:
    metrics_env = {f"FLOWMAKER_{svc.upper()}_METRICS_PORT": "0" for svc in FIVE}  # /metrics on a free port each
    cfg = StackConfig(time_scale=50.0, log_level="WARNING", work_dir=tmp_path_factory.mktemp("front-door"),
                      keep_work_dir=True, startup_timeout_s=120.0, extra_env={**otlp_env(collector), **metrics_env})
    if not os.path.exists(cfg.etcd_bin):
        pytest.skip(f"etcd not installed at {cfg.etcd_bin}")
    s = LocalStack(cfg)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def cli(stack: LocalStack, *args: str, env_extra: dict[str, str] | None = None,
        timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLOWMAKER_ORCHESTRATOR_ADDR", "FLOWMAKER_DEPLOYER_ADDR", "COLUMNS")}
    env.update({"FLOWMAKER_STATE_FILE": "/nonexistent/flowmaker-stack.json",
                "FLOWMAKER_ORCHESTRATOR_ADDR": stack.addresses["orchestrator"], **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def ok_json(p: subprocess.CompletedProcess[str]) -> Any:
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return json.loads(p.stdout)


def one_error_line(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert p.returncode == 1, f"rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr + p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def task_ids(stack: LocalStack) -> set[str]:
    return {t["id"] for t in ok_json(cli(stack, "task", "list", "--json")).get("tasks", [])}


@pytest.fixture(scope="module")
def summarize_task(stack: LocalStack) -> str:
    t = ok_json(cli(stack, "task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15", "--rate", "0.5",
                    "--name", "summarize", "--approve", "all", "--json"))
    assert t["state"] == "STATE_ACTIVE", t
    return str(t["id"])


@pytest.fixture(scope="module")
def tool_last_task(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> str:
    wf = tmp_path_factory.mktemp("wf") / "workflows.json"
    wf.write_text(json.dumps(LLM_THEN_TOOL))
    t = ok_json(cli(stack, "task", "deploy", "Draft an answer, then format it", "--accuracy", "0.1",
                    "--latency", "15", "--rate", "0.2", "--workflows", str(wf), "--approve", "all", "--json"))
    assert t["state"] == "STATE_ACTIVE", t
    return str(t["id"])


# ---- telemetry first: the first deploy on a fresh stack starts new instances (Deploy RPCs) --------

def test_deploy_with_approve_is_one_trace_across_the_services(stack: LocalStack, collector: Collector) -> None:
    t = ok_json(cli(stack, "task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15", "--rate", "0.3",
                    "--approve", "all", "--json", env_extra=otlp_env(collector)))
    assert t["state"] == "STATE_ACTIVE", t
    roots = wait_for(lambda: collector.traces_with("flowmaker task deploy"))
    assert len(roots) >= 1
    want = {"flowmaker-cli", "flowmaker-orchestrator", "flowmaker-generator", "flowmaker-selector",
            "flowmaker-deployer", "flowmaker-profiler"}
    # The CLI's one span holds DeployTask and ApproveWorkflows: one trace reaches all five services (the
    # orchestrator asks the profiler for the registered models it offers the selector).
    seen = wait_for(lambda: next((collector.services_in(tid) for tid in roots
                                  if want <= collector.services_in(tid)), None))
    assert seen is not None, {tid.hex(): collector.services_in(tid) for tid in roots}
    ids = {tid for tid in roots if want <= collector.services_in(tid)}
    tid = ids.pop()
    with collector._lock:
        names = {s.name for svc, s in collector.spans if s.trace_id == tid}
    assert {"/flowmaker.orchestrator.v1.OrchestratorService/DeployTask",
            "/flowmaker.orchestrator.v1.OrchestratorService/ApproveWorkflows"} <= names, names
    assert any(n.startswith("/flowmaker.deployer.v1.DeployerService/") for n in names), names
    assert "/flowmaker.profiler.v1.ProfilerService/ListModels" in names, names


# ---- the CLI's rough edges ---------------------------------------------------------------------

def test_deploy_approve_all_exits_1_when_the_task_ends_failed(stack: LocalStack) -> None:
    p = cli(stack, "task", "deploy", SUMMARIZE, "--accuracy", "0.99", "--latency", "15", "--rate", "0.5",
            "--approve", "all", "--json")
    line = one_error_line(p, "is FAILED")
    t = json.loads(p.stdout)  # the task is still printed, for the record
    assert t["state"] == "STATE_FAILED" and t["id"] in line


def test_bad_approve_or_strategy_leaves_no_task_behind(stack: LocalStack, tmp_path: Path) -> None:
    before = task_ids(stack)
    one_error_line(cli(stack, "task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15",
                       "--approve", "all", "--strategy", "fastest"), "INVALID_ARGUMENT", "--strategy", "fastest")
    one_error_line(cli(stack, "task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15",
                       "--approve", " , "), "INVALID_ARGUMENT", "--approve")
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(LLM_THEN_TOOL))
    one_error_line(cli(stack, "task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15",
                       "--workflows", str(wf), "--approve", "nope"), "INVALID_ARGUMENT", "nope")
    # generated candidates: the ids are known only after DeployTask, so the task is deleted again
    one_error_line(cli(stack, "task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15",
                       "--approve", "no-such-candidate"), "INVALID_ARGUMENT", "no-such-candidate")
    left = task_ids(stack) - before
    if left:  # a deleted task may linger as DELETING for a moment; never AWAITING_APPROVAL
        states = {ok_json(cli(stack, "task", "get", i, "--json")).get("state") for i in left}
        assert states <= {"STATE_DELETING"}, states


def test_invoke_stream_prints_the_final_output_of_a_tool_stage(stack: LocalStack, tool_last_task: str) -> None:
    p = cli(stack, "task", "invoke", tool_last_task, "hello there", "--stream")
    assert p.returncode == 0, p.stderr
    assert "format>" in p.stdout and "FORMATTED:" in p.stdout, p.stdout
    unary = ok_json(cli(stack, "task", "invoke", tool_last_task, "hello there", "--json"))
    assert unary["output"].startswith("FORMATTED:")


def test_tables_are_not_squashed_in_a_log_and_cost_has_its_unit(stack: LocalStack, summarize_task: str) -> None:
    p = cli(stack, "task", "list")  # stdout is a pipe, COLUMNS unset
    assert p.returncode == 0, p.stderr
    row = [ln for ln in p.stdout.splitlines() if summarize_task in ln]
    assert row and "summarize" in row[0] and "ACTIVE" in row[0], p.stdout  # one row, one line
    assert max(len(ln) for ln in p.stdout.splitlines()) > 80
    g = cli(stack, "task", "get", summarize_task)
    assert g.returncode == 0 and "GB·s" in g.stdout, g.stdout


# ---- the OpenAI-compatible gateway, with the official client -----------------------------------

def client(stack: LocalStack, **kw: Any) -> Any:
    assert stack.gateway_url, "the stack started no gateway"
    return openai.OpenAI(base_url=stack.gateway_url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def test_openai_client_lists_and_calls_a_task(stack: LocalStack, summarize_task: str, tool_last_task: str) -> None:
    c = client(stack)
    models = {m.id: m for m in c.models.list().data}
    assert summarize_task in models and tool_last_task in models
    assert getattr(models[summarize_task], "description", None) == SUMMARIZE
    assert c.models.retrieve(summarize_task).id == summarize_task

    raw = c.chat.completions.with_raw_response.create(
        model=summarize_task, messages=[{"role": "user", "content": "Meeting notes: ship on Friday."}],
        max_tokens=16)
    trace_id = raw.headers.get("x-flowmaker-trace-id")
    assert trace_id and len(trace_id) == 32 and int(trace_id, 16) != 0
    r = raw.parse()
    assert r.choices[0].message.content.strip() and r.choices[0].finish_reason == "length"
    assert r.model == summarize_task
    assert r.usage is not None and r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the same run as the orchestrator's Invoke: the task counted it (accounting is batched, within seconds)
    served = wait_for(lambda: int(ok_json(cli(stack, "task", "get", summarize_task, "--json")).get(
        "requests_served", 0)) >= 1, timeout_s=15)
    assert served

    # by name too
    assert c.chat.completions.create(model="summarize", messages=[{"role": "user", "content": "x"}],
                                     max_tokens=4).model == summarize_task


def test_openai_client_streams_with_usage_only_when_asked(stack: LocalStack, summarize_task: str,
                                                          tool_last_task: str) -> None:
    c = client(stack)
    chunks = list(c.chat.completions.create(model=summarize_task, stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": "Stream me."}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.strip()
    assert all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"

    chunks = list(c.chat.completions.create(model=tool_last_task, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "hello tool"}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.startswith("FORMATTED:"), text  # the TOOL stage's output, though it streams nothing
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_openai_errors(stack: LocalStack, summarize_task: str) -> None:
    c = client(stack)
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="no-such-task", messages=[{"role": "user", "content": "x"}])
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-task")
    with pytest.raises(openai.BadRequestError) as br:
        c.chat.completions.create(model=summarize_task, messages=[])
    assert br.value.param == "messages" and br.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as br:
        c.chat.completions.create(model=summarize_task, messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert br.value.param == "max_tokens"


# ---- telemetry: an OTLP receiver sees the services ---------------------------------------------

def wait_for(cond: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_every_service_and_the_gateway_export_spans(stack: LocalStack, collector: Collector,
                                                    summarize_task: str) -> None:
    from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc

    # The profiler is not on the deploy path (profiles are read from etcd): call it directly.
    with grpc.insecure_channel(stack.addresses["profiler"]) as ch:
        profiler_pb2_grpc.ProfilerServiceStub(ch).ListModels(profiler_pb2.ListModelsRequest(), timeout=30)
    raw = client(stack).chat.completions.with_raw_response.create(
        model=summarize_task, messages=[{"role": "user", "content": "trace me"}], max_tokens=4)
    gw_trace = bytes.fromhex(raw.headers["x-flowmaker-trace-id"])
    services = wait_for(lambda: (lambda s: s if {"flowmaker-gateway", "flowmaker-orchestrator"} <= s else None)(
        collector.services_in(gw_trace)))
    assert services, collector.services_in(gw_trace)  # the header's trace id is the request's trace
    with collector._lock:
        everyone = {svc for svc, _ in collector.spans}
    assert {"flowmaker-orchestrator", "flowmaker-generator", "flowmaker-selector", "flowmaker-deployer",
            "flowmaker-profiler", "flowmaker-gateway", "flowmaker-cli"} <= everyone, everyone


# ---- Prometheus metrics on every service -------------------------------------------------------

def metrics_of(stack: LocalStack, svc: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape a service's /metrics (its address from the FLOWMAKER_READY line in its log)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    ready = [json.loads(ln.split(" ", 1)[1]) for ln in (stack.log_dir / f"{svc}.log").read_text().splitlines()
             if ln.startswith("FLOWMAKER_READY ")]
    assert ready and "metrics" in ready[-1], f"{svc} serves no metrics: {ready}"
    with urllib.request.urlopen(f"http://{ready[-1]['metrics']}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_every_service_serves_prometheus_metrics(stack: LocalStack, summarize_task: str) -> None:
    ok = [{svc: sum(v for (n, lab), v in metrics_of(stack, svc).items()
                    if n == "flowmaker_rpc_requests_total" and ("code", "OK") in lab) for svc in FIVE}]
    # every service has answered RPCs by now (health checks at least); the deploy path more than that
    assert all(v > 0 for v in ok[0].values()), ok
    sel = metrics_of(stack, "selector")
    assert any(n == "flowmaker_selection_duration_seconds_count" and v > 0 for (n, _), v in sel.items())
    orch = metrics_of(stack, "orchestrator")
    assert any(n == "flowmaker_reconcile_duration_seconds_count" and v > 0 for (n, _), v in orch.items())
    assert any(n == "flowmaker_rpc_duration_seconds_count" and ("method", "OrchestratorService/ApproveWorkflows")
               in lab for (n, lab), _ in orch.items())
    # the deployer's instance gauges: planned and observed load and headroom of the task's instances
    got = wait_for(lambda: [k for k in metrics_of(stack, "deployer")
                            if k[0] == "flowmaker_instance_headroom_output_tokens_per_second"], 20)
    assert got, "the deployer publishes no instance headroom"
    dep = metrics_of(stack, "deployer")
    kinds = {dict(lab)["kind"] for (n, lab) in dep if n == "flowmaker_instance_load_output_tokens_per_second"}
    assert kinds == {"planned", "observed"}
    assert any(n == "flowmaker_instance_queue_requests" for (n, _) in dep)
