"""One trace across services: real gRPC servers (port 0) with the OpenTelemetry interceptors, an in-memory exporter.

Covers generator (the LLM path: a gen_ai CLIENT span whose HTTP request carries `traceparent`),
profiler (a measured sweep: the job's spans continue the ProfileModel trace), and the orchestrator
over the running suite (real etcd, generator, selector, deployer with emulated engine processes):
DeployTask + ApproveWorkflows as one trace through every service, and Invoke / InvokeStream as a
root SERVER span with a span per stage and a `chat <model>` span per engine call.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from flowmaker import convert, telemetry
from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.generator.v1 import generator_pb2, generator_pb2_grpc
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as opb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc
from flowmaker.domain import Slo, Stage, StageKind, Workflow
from flowmaker.generator import GeneratorSettings, make_generator
from flowmaker.rpc.channels import insecure_channel
from flowmaker.rpc.errors import call
from services.deployer.node import NodeAgent
from services.deployer.servicer import service_hooks
from services.deployer.settings import DeployerSettings
from services.generator.servicer import add_servicers as add_generator
from services.orchestrator.clients import Clients
from services.orchestrator.engines import EngineClient
from services.orchestrator.orchestrator import Orchestrator
from services.orchestrator.servicer import add_servicers as add_orchestrator
from services.orchestrator.settings import OrchestratorSettings
from services.profiler.app import build
from services.profiler.servicer import add_servicers as add_profiler
from services.profiler.settings import ProfilerSettings
from services.selector.servicer import add_servicers as add_selector
from services.selector.settings import SelectorSettings

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
                                analytic_gpu_types="A6000", engine_time_scale=10.0, sweep_repeats=1,
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


# ---- the orchestrator over the running suite ----------------------------------------------------------------

TIME_SCALE = 20.0  # engines and TOOL stages run 20x faster than model time
SLO = Slo(min_accuracy=0.1, max_latency_s=30.0, arrival_rate_rps=0.5)
# A TOOL stage and an LLM stage run in parallel; `final` needs both.
DAG = Workflow("dag", (
    Stage("draft", input_tokens=60, output_tokens=12, prompt_template="Draft an answer to: {input}"),
    Stage("lookup", kind=StageKind.TOOL, latency_s=1.0, prompt_template="facts about {input}"),
    Stage("final", depends_on=("draft", "lookup"), input_tokens=120, output_tokens=8,
          prompt_template="Question: {input}\nDraft: {draft}\nFacts: {lookup}\nFinal answer:"),
))
ORCH = "/flowmaker.orchestrator.v1.OrchestratorService/"


@dataclass
class Suite:
    orch: orchestrator_pb2_grpc.OrchestratorServiceStub  # over a traced channel: the call is a CLIENT span
    bare: orchestrator_pb2_grpc.OrchestratorServiceStub  # no client tracing: the server span is the root
    engine_headers: list[dict[str, str]]  # the headers of every HTTP request the orchestrator sent to an engine


@pytest.fixture
async def suite(etcd_store: Any, start_service: Any, spans: InMemorySpanExporter) -> AsyncIterator[Suite]:
    """generator, selector, deployer (emulated engines) and orchestrator, each a real server on port 0 with
    the OpenTelemetry server interceptors, on a real etcd; the orchestrator calls the generator over gRPC."""
    interceptors = telemetry.server_interceptors()
    dset = DeployerSettings(host="127.0.0.1", port=0, grace_s=0.5, node="n0", gpu_type="A6000", gpu_count=2,
                            use_nvml=False, backend="emulated", engine_time_scale=TIME_SCALE,
                            engine_start_timeout_s=30, engine_stop_grace_s=2, lease_ttl_s=5)
    agent = NodeAgent(etcd_store, dset)

    add_deployer, deployer_ready = service_hooks(agent)

    await start_service("deployer", add_deployer, dset, on_ready=deployer_ready, on_shutdown=[agent.shutdown],
                        interceptors=interceptors)
    sset = SelectorSettings(host="127.0.0.1", port=0, grace_s=0.5)
    sel = await start_service("selector", lambda s: add_selector(s, sset, etcd_store), sset,
                              interceptors=interceptors)
    gen = await start_service("generator", lambda s: add_generator(s, make_generator(GeneratorSettings())),
                              interceptors=interceptors)

    # The headers that actually went out on the wire to the engine (the emulated engine does not echo them).
    seen: list[dict[str, str]] = []

    async def on_headers_sent(session: aiohttp.ClientSession, ctx: SimpleNamespace,
                              params: aiohttp.TraceRequestHeadersSentParams) -> None:
        seen.append(dict(params.headers))

    tc = aiohttp.TraceConfig()
    tc.on_request_headers_sent.append(on_headers_sent)
    oset = OrchestratorSettings(host="127.0.0.1", port=0, grace_s=0.5, selector_address=sel.address,
                                generator_address=gen.address, tool_time_scale=TIME_SCALE, deploy_timeout_s=60)
    clients = Clients(oset.selector_address, oset.generator_address, timeout_s=30)
    orch = Orchestrator(oset, etcd_store, clients, EngineClient(trace_configs=[tc]))

    async def close() -> None:
        await orch.close()
        await clients.close()

    async def ready(running: Any) -> None:
        await orch.resume()  # the cache, the election and the reconciler (which runs the lifecycle workers)

    o = await start_service("orchestrator", lambda s: add_orchestrator(s, orch), oset, on_ready=ready,
                            on_shutdown=[close], interceptors=interceptors)
    traced = insecure_channel(o.address, default_timeout_s=120)
    bare = insecure_channel(o.address, default_timeout_s=120, tracing=False)
    yield Suite(orchestrator_pb2_grpc.OrchestratorServiceStub(traced),
                orchestrator_pb2_grpc.OrchestratorServiceStub(bare), seen)
    # Tasks are deleted so the deployer's shutdown has no engine left to stop.
    for t in (await call(orchestrator_pb2_grpc.OrchestratorServiceStub(bare).ListTasks(
            opb.ListTasksRequest()))).tasks:
        await call(orchestrator_pb2_grpc.OrchestratorServiceStub(bare).DeleteTask(
            opb.DeleteTaskRequest(task_id=t.id)))
    await traced.close(None)
    await bare.close(None)


def render(children: dict[int | None, list[ReadableSpan]], keys: tuple[str, ...] = ()) -> str:
    """The trace as an indented tree (kind, name, the attributes named in `keys`), children by start time."""
    lines: list[str] = []

    def walk(s: ReadableSpan, depth: int) -> None:
        attrs = {k: v for k, v in (s.attributes or {}).items() if k in keys}
        shown = " ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in attrs.items())
        lines.append(f"{'  ' * depth}{s.kind.name:<8} {s.name} {shown}".rstrip())
        for c in sorted(children.get(s.context.span_id, []), key=lambda x: x.start_time or 0):
            walk(c, depth + 1)

    for r in children.get(None, []):
        walk(r, 0)
    return "\n".join(lines)


SHOWN = (telemetry.FLOWMAKER_TASK, telemetry.FLOWMAKER_STAGE, telemetry.FLOWMAKER_INSTANCE,
         telemetry.FLOWMAKER_WORKFLOW, "flowmaker.commit.attempt", "flowmaker.commit.conflict",
         telemetry.GEN_AI_REQUEST_MODEL, telemetry.GEN_AI_USAGE_INPUT_TOKENS, telemetry.GEN_AI_USAGE_OUTPUT_TOKENS)


def _grpc(children: dict[int | None, list[ReadableSpan]], parent: ReadableSpan, method: str) -> ReadableSpan:
    """The CLIENT span of `method` under `parent`, and check the callee's SERVER span continues it."""
    client = _child(children, parent, method, SpanKind.CLIENT)
    return _child(children, client, method, SpanKind.SERVER)


async def test_deploy_task_is_one_trace_across_the_services(suite: Suite, spans: InMemorySpanExporter) -> None:
    # What `flowmaker task deploy` does: DeployTask, then ApproveWorkflows, under the caller's one span.
    with telemetry.tracer().start_as_current_span("task deploy") as root:
        r = await call(suite.orch.DeployTask(opb.DeployTaskRequest(
            description="Answer questions about our docs with retrieval", slo=convert.slo_to_proto(SLO))))
        assert "rag-retrieve-answer" in [w.id for w in r.task.candidates]
        a = (await call(suite.orch.ApproveWorkflows(opb.ApproveWorkflowsRequest(
            task_id=r.task.id, workflow_ids=["rag-retrieve-answer"]), timeout=120))).task
    assert a.state == task_pb2.Task.STATE_ACTIVE, a.failure.message
    tid = root.get_span_context().trace_id
    children = _tree(list(spans.get_finished_spans()), tid)
    print("\n" + render(children, SHOWN))
    assert [s.name for s in children[None]] == ["task deploy"]  # one trace, one root
    root_s = children[None][0]

    deploy_srv = _grpc(children, root_s, ORCH + "DeployTask")
    create = _child(children, deploy_srv, "task.create")
    assert create.attributes is not None and create.attributes[telemetry.FLOWMAKER_TASK] == r.task.id
    generate = _child(children, create, "task.generate")
    assert generate.attributes is not None and generate.attributes["flowmaker.generator"] == "generator-service"
    _grpc(children, generate, "/flowmaker.generator.v1.GeneratorService/GenerateWorkflows")

    approve_srv = _grpc(children, root_s, ORCH + "ApproveWorkflows")
    select = _child(children, approve_srv, "task.select")
    assert select.attributes is not None and select.attributes["flowmaker.commit.attempt"] == 1
    assert select.attributes[telemetry.FLOWMAKER_WORKFLOW] == "rag-retrieve-answer"
    _grpc(children, select, "/flowmaker.selector.v1.SelectorService/SelectVariant")
    commit = _child(children, approve_srv, "task.commit")
    assert commit.attributes is not None
    assert commit.attributes["flowmaker.commit.attempt"] == 1 and commit.attributes["flowmaker.commit.conflict"] is False
    assert commit.start_time is not None and select.end_time is not None and commit.start_time >= select.end_time
    deploy = _child(children, approve_srv, "task.deploy")
    one = _child(children, deploy, "task.deploy_instance")
    assert one.attributes is not None
    assert one.attributes[telemetry.FLOWMAKER_INSTANCE] == a.stage_instances["answer"]
    _grpc(children, one, "/flowmaker.deployer.v1.DeployerService/Deploy")
    # Every span of the work is in the trace: nothing started a trace of its own meanwhile.
    others = {s.name for s in spans.get_finished_spans() if s.context.trace_id != tid}
    assert not others & {"task.create", "task.select", "task.commit", "task.deploy", "task.deploy_instance"}


async def test_invoke_trace_has_a_span_per_stage_and_gen_ai_calls(suite: Suite, spans: InMemorySpanExporter) -> None:
    r = await call(suite.orch.DeployTask(opb.DeployTaskRequest(
        description="dag", slo=convert.slo_to_proto(SLO), workflows=[convert.workflow_to_proto(DAG)])))
    a = (await call(suite.orch.ApproveWorkflows(opb.ApproveWorkflowsRequest(
        task_id=r.task.id, workflow_ids=["dag"]), timeout=120))).task
    assert a.state == task_pb2.Task.STATE_ACTIVE, a.failure.message
    spans.clear()
    suite.engine_headers.clear()

    out = await call(suite.bare.Invoke(opb.InvokeRequest(task_id=a.id, input="why is the sky blue?")))
    by_stage = {s.stage_id: s for s in out.stages}
    (srv,) = [s for s in spans.get_finished_spans() if s.name == ORCH + "Invoke"]
    assert srv.kind == SpanKind.SERVER and srv.parent is None  # the request's root
    children = _tree(list(spans.get_finished_spans()), srv.context.trace_id)
    print("\n" + render(children, SHOWN))
    assert srv.attributes is not None and srv.attributes[telemetry.FLOWMAKER_TASK] == a.id
    assert srv.attributes[telemetry.FLOWMAKER_WORKFLOW] == "dag"
    assert sorted(s.name for s in children[srv.context.span_id]) == ["stage draft", "stage final", "stage lookup"]
    lookup = _child(children, srv, "stage lookup")
    assert lookup.attributes is not None and lookup.attributes["flowmaker.stage.kind"] == "TOOL"
    assert children.get(lookup.context.span_id, []) == []  # an emulated tool calls no engine
    # (trace id, parent span id) of each `traceparent` (version-traceid-parentid-flags) sent to an engine.
    sent = {tuple(h.get("traceparent", "---").split("-")[1:3]) for h in suite.engine_headers}
    for sid in ("draft", "final"):
        stage = _child(children, srv, f"stage {sid}")
        assert stage.attributes is not None
        assert stage.attributes[telemetry.FLOWMAKER_STAGE] == sid
        assert stage.attributes[telemetry.FLOWMAKER_INSTANCE] == a.stage_instances[sid]
        model = by_stage[sid].model_id
        chat = _child(children, stage, f"chat {model}", SpanKind.CLIENT)
        assert chat.attributes is not None
        assert chat.attributes[telemetry.GEN_AI_REQUEST_MODEL] == model
        assert chat.attributes[telemetry.GEN_AI_USAGE_INPUT_TOKENS] == by_stage[sid].input_tokens > 0
        assert chat.attributes[telemetry.GEN_AI_USAGE_OUTPUT_TOKENS] == by_stage[sid].output_tokens
        assert chat.attributes[telemetry.FLOWMAKER_INSTANCE] == a.stage_instances[sid]
        # The HTTP request to the engine carried this trace, parented by the chat span (W3C traceparent).
        assert (f"{srv.context.trace_id:032x}", f"{chat.context.span_id:016x}") in sent
    assert by_stage["draft"].output_tokens == 12 and by_stage["final"].output_tokens == 8
    assert len(suite.engine_headers) == 2

    # InvokeStream: the same tree; the streamed answer's usage lands on the chat spans too.
    spans.clear()
    chunks = [c async for c in suite.bare.InvokeStream(opb.InvokeStreamRequest(task_id=a.id, input="stream"))]
    assert chunks[-1].WhichOneof("chunk") == "done"
    (ssrv,) = [s for s in spans.get_finished_spans() if s.name == ORCH + "InvokeStream"]
    children = _tree(list(spans.get_finished_spans()), ssrv.context.trace_id)
    print("\n" + render(children, SHOWN))
    final = _child(children, ssrv, "stage final")
    chat = _child(children, final, f"chat {by_stage['final'].model_id}", SpanKind.CLIENT)
    streamed = {s.stage_id: s for s in chunks[-1].done.stages}["final"]
    assert chat.attributes is not None and chat.attributes[telemetry.GEN_AI_USAGE_OUTPUT_TOKENS] == 8
    assert chat.attributes[telemetry.GEN_AI_USAGE_INPUT_TOKENS] == streamed.input_tokens != 0


async def test_the_engine_span_joins_the_callers_trace(spans: InMemorySpanExporter) -> None:
    """The emulated engine (in this process, so its spans reach the same exporter) reads the `traceparent` the
    orchestrator's engine client sends: its SERVER span is a child of the client's `chat m1` span, with the
    token counts and the sampling parameters that arrived."""
    from flowmaker.domain import Profile
    from flowmaker.engine.server import EmulatedEngine
    from flowmaker.sampling import Sampling

    profile = Profile("m1", 1, 1, 10.0, fixed_s=0.01, prefill_s_per_token=0.0001, decode_s_per_token=0.001,
                      max_output_tokens_per_s=1000.0)
    runner = web.AppRunner(EmulatedEngine("m1", profile, time_scale=10.0).app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    client = EngineClient()
    try:
        c = await client.chat(url, "m1", "four words of prompt", 6, timeout_s=30,
                              sampling=Sampling(temperature=0.5, seed=3))
        streamed = await client.chat(url, "m1", "two words", 4, timeout_s=30, on_delta=_ignore)
    finally:
        await client.close()
        await runner.cleanup()
    assert (c.prompt_tokens, c.completion_tokens) == (4, 6) and streamed.completion_tokens == 4
    done = spans.get_finished_spans()
    clients = [s for s in done if s.name == "chat m1" and s.kind == SpanKind.CLIENT]
    servers = [s for s in done if s.name == "chat m1" and s.kind == SpanKind.SERVER]
    assert len(clients) == 2 and len(servers) == 2, [(s.name, s.kind) for s in done]
    for cs in clients:
        ss = next(s for s in servers if s.parent is not None and s.parent.span_id == cs.context.span_id)
        assert ss.context.trace_id == cs.context.trace_id
        attrs, sent = dict(ss.attributes or {}), dict(cs.attributes or {})
        assert attrs[telemetry.GEN_AI_USAGE_OUTPUT_TOKENS] == sent[telemetry.GEN_AI_USAGE_OUTPUT_TOKENS]
        assert attrs[telemetry.GEN_AI_USAGE_INPUT_TOKENS] == sent[telemetry.GEN_AI_USAGE_INPUT_TOKENS]
        assert attrs[telemetry.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    sampled = next(s for s in servers if telemetry.GEN_AI_REQUEST_SEED in (s.attributes or {}))
    assert sampled.attributes[telemetry.GEN_AI_REQUEST_TEMPERATURE] == 0.5  # type: ignore[index]
    assert sampled.attributes[telemetry.GEN_AI_REQUEST_SEED] == 3  # type: ignore[index]


async def _ignore(piece: str) -> None:
    return None
