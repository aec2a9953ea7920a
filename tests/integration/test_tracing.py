"""One trace across services: real gRPC servers (port 0) with the OpenTelemetry interceptors, an in-memory exporter.

Covers generator (the LLM path: a gen_ai CLIENT span whose HTTP request carries `traceparent`)
and profiler (a measured sweep: the job's spans continue the ProfileModel trace). The
DeployTask / Invoke trees of the orchestrator are not asserted here yet (see the report).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from flowmaker import telemetry
from flowmaker.api.generator.v1 import generator_pb2, generator_pb2_grpc
from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc
from flowmaker.generator import GeneratorSettings, make_generator
from flowmaker.rpc.channels import insecure_channel
from flowmaker.rpc.errors import call
from services.generator.servicer import add_servicers as add_generator
from services.profiler.app import build
from services.profiler.servicer import add_servicers as add_profiler
from services.profiler.settings import ProfilerSettings

pytestmark = pytest.mark.integration

GOOD = json.dumps({"candidates": [{"id": "one", "rationale": "single call", "stages": [
    {"id": "answer", "kind": "LLM", "depends_on": [], "input_tokens": 200, "output_tokens": 50,
     "calls_per_request": 1, "latency_s": 0.0, "role": "assistant", "prompt_template": "{input}"}]}]})


@pytest.fixture
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("flowmaker-test", processors=[SimpleSpanProcessor(exporter)])
    return exporter


@pytest.fixture
async def planner() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """An OpenAI-compatible endpoint that answers GOOD and records the headers it received."""
    seen: list[dict[str, str]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        await request.read()
        return web.json_response({"id": "c", "object": "chat.completion", "model": "planner", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": GOOD}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 321, "completion_tokens": 45, "total_tokens": 366}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


def _tree(spans: list[ReadableSpan], trace_id: int) -> dict[int | None, list[ReadableSpan]]:
    children: dict[int | None, list[ReadableSpan]] = {}
    for s in spans:
        if s.context.trace_id == trace_id:
            children.setdefault(s.parent.span_id if s.parent else None, []).append(s)
    return children


def _child(children: dict[int | None, list[ReadableSpan]], parent: ReadableSpan, name: str,
           kind: SpanKind | None = None) -> ReadableSpan:
    found = [s for s in children.get(parent.context.span_id, []) if s.name == name and (kind is None or s.kind == kind)]
    assert found, f"no child {name!r} under {parent.name!r}: {[s.name for s in children.get(parent.context.span_id, [])]}"
    return found[0]


async def test_generator_trace_with_gen_ai_span(start_service: Any, spans: InMemorySpanExporter,
                                                planner: tuple[str, list[dict[str, str]]]) -> None:
    url, seen = planner
    gen = make_generator(GeneratorSettings(llm_base_url=url, llm_model="planner"))
    running = await start_service("generator", lambda s: add_generator(s, gen),
                                  interceptors=telemetry.server_interceptors())
    tracer = telemetry.tracer()
    async with insecure_channel(running.address) as ch:
        stub = generator_pb2_grpc.GeneratorServiceStub(ch)
        with tracer.start_as_current_span("DeployTask") as root:
            resp = await call(stub.GenerateWorkflows(generator_pb2.GenerateWorkflowsRequest(description="Answer")))
    await gen.close()
    assert [w.id for w in resp.workflows] == ["one"]
    tid = root.get_span_context().trace_id
    children = _tree(list(spans.get_finished_spans()), tid)
    root_s = children[None][0]
    method = "/flowmaker.generator.v1.GeneratorService/GenerateWorkflows"
    client = _child(children, root_s, method, SpanKind.CLIENT)
    server = _child(children, client, method, SpanKind.SERVER)
    llm = _child(children, server, "chat planner", SpanKind.CLIENT)
    assert llm.attributes is not None
    assert llm.attributes[telemetry.GEN_AI_REQUEST_MODEL] == "planner"
    assert llm.attributes[telemetry.GEN_AI_USAGE_INPUT_TOKENS] == 321
    assert llm.attributes[telemetry.GEN_AI_USAGE_OUTPUT_TOKENS] == 45
    # The HTTP request to the model carried the same trace, parented by the gen_ai span.
    tp = seen[0].get("traceparent", "")
    assert tp.split("-")[1] == format(tid, "032x") and tp.split("-")[2] == format(llm.context.span_id, "016x")


async def test_profiler_job_continues_the_trace(start_service: Any, etcd_store: Any,
                                                spans: InMemorySpanExporter) -> None:
    settings = ProfilerSettings(host="127.0.0.1", port=0, grace_s=0.5, preload_catalog=False,
                                analytic_gpu_types="A6000", engine_time_scale=50.0, sweep_repeats=1,
                                sweep_output_tokens="2,8", sweep_input_tokens="8,64",
                                throughput_output_tokens=8, max_concurrency=4)
    app = build(settings, etcd_store)
    running = await start_service("profiler", lambda s: add_profiler(s, app.servicer), settings,
                                  on_ready=app.start, on_shutdown=[app.close],
                                  interceptors=telemetry.server_interceptors())
    tracer = telemetry.tracer()
    async with insecure_channel(running.address) as ch:
        stub = profiler_pb2_grpc.ProfilerServiceStub(ch)
        await call(stub.RegisterModel(profiler_pb2.RegisterModelRequest(catalog_name="Llama-3.2-1B-Instruct")))
        with tracer.start_as_current_span("ProfileTask") as root:
            job = (await call(stub.ProfileModel(profiler_pb2.ProfileModelRequest(
                model_id="Llama-3.2-1B-Instruct", configs=[profiler_pb2.ParallelConfig(tp=1, pp=1)])))).job
        deadline = time.monotonic() + 60
        while (await call(stub.GetProfilingJob(profiler_pb2.GetProfilingJobRequest(job_id=job.id)))).job.state in (
                profiler_pb2.ProfilingJob.State.STATE_QUEUED, profiler_pb2.ProfilingJob.State.STATE_RUNNING):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.3)
    tid = root.get_span_context().trace_id
    children = _tree(list(spans.get_finished_spans()), tid)
    method = "/flowmaker.profiler.v1.ProfilerService/ProfileModel"
    client = _child(children, children[None][0], method, SpanKind.CLIENT)
    server = _child(children, client, method, SpanKind.SERVER)
    config = _child(children, server, "profile.config")
    assert config.attributes is not None and config.attributes["flowmaker.tp"] == 1
    _child(children, config, "profile.latency_sweep")
    _child(children, config, "profile.throughput_sweep")
    assert trace.get_current_span().get_span_context().trace_id != tid  # nothing leaked into the test's context
