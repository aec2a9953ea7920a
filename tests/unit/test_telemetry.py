"""Unit tests of flowmaker.telemetry: one trace across a real grpc.aio client/server on loopback, gen_ai
attributes, trace context on HTTP headers, exporter selection from OTEL_* variables, JSON logs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from flowmaker import telemetry as tel
from flowmaker.errors import FailedPrecondition, InvalidSpec


@pytest.fixture
def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = tel.build_tracer_provider("test-svc", env={}, processors=[SimpleSpanProcessor(exporter)])
    return provider, exporter


async def test_one_trace_client_server_handler(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    seen: dict[str, str] = {}

    async def say(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        with tel.llm_span("Qwen2.5-7B-Instruct", input_tokens=120, max_tokens=64, server_address="127.0.0.1:9",
                          attributes={tel.FLOWMAKER_STAGE: "answer"}, tracer_provider=provider) as span:
            seen.update(tel.inject_http_headers({"content-type": "application/json"}))
            tel.record_llm_usage(span, output_tokens=42, response_model="Qwen2.5-7B-Instruct",
                                 finish_reasons=["stop"])
        return b"ok:" + request

    server = grpc.aio.server(interceptors=tel.server_interceptors(provider))
    handler = grpc.unary_unary_rpc_method_handler(say)  # raw bytes in and out: no generated code needed
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.v1.EchoService", {"Say": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             interceptors=tel.client_interceptors(provider)) as ch:
            reply = await ch.unary_unary("/test.v1.EchoService/Say", None, None)(b"hi", timeout=5)
    finally:
        await server.stop(None)
    assert reply == b"ok:hi"

    assert len(exporter.get_finished_spans()) == 3
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    llm = by_name["chat Qwen2.5-7B-Instruct"]
    rpc = [s for s in exporter.get_finished_spans() if s.name == "/test.v1.EchoService/Say"]
    client = next(s for s in rpc if s.kind is SpanKind.CLIENT)
    srv = next(s for s in rpc if s.kind is SpanKind.SERVER)

    assert client.context.trace_id == srv.context.trace_id == llm.context.trace_id
    assert srv.parent is not None and srv.parent.span_id == client.context.span_id
    assert llm.parent is not None and llm.parent.span_id == srv.context.span_id
    assert llm.kind is SpanKind.CLIENT
    assert dict(llm.attributes or {}) == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "Qwen2.5-7B-Instruct",
        "gen_ai.provider.name": "openai", "gen_ai.usage.input_tokens": 120, "gen_ai.request.max_tokens": 64,
        "server.address": "127.0.0.1:9", "flowmaker.stage": "answer", "gen_ai.usage.output_tokens": 42,
        "gen_ai.response.model": "Qwen2.5-7B-Instruct", "gen_ai.response.finish_reasons": ("stop",),
    }
    # the HTTP call to the engine would carry the handler's span as its parent (W3C traceparent)
    assert seen["content-type"] == "application/json"
    version, trace_id, span_id, _flags = seen["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", format(llm.context.trace_id, "032x"),
                                            format(llm.context.span_id, "016x"))
    assert llm.resource.attributes["service.name"] == "test-svc"


def test_llm_span_records_errors(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    with pytest.raises(RuntimeError), tel.llm_span("m", tracer_provider=provider):
        raise RuntimeError("engine down")
    with tel.llm_span("m", operation="text_completion", tracer_provider=provider) as span:
        tel.mark_error(span, TimeoutError("slow"))
    a, b = exporter.get_finished_spans()
    assert a.status.status_code is StatusCode.ERROR and "engine down" in (a.status.description or "")
    assert b.name == "text_completion m" and b.status.status_code is StatusCode.ERROR
    assert b.events[0].name == "exception"


def test_inject_without_span_adds_nothing() -> None:
    assert "traceparent" not in tel.inject_http_headers()


def test_exporter_selection_from_env() -> None:
    assert tel.exporter_names({}) == ()
    assert tel.exporter_names({"OTEL_TRACES_EXPORTER": "none"}) == ()
    assert tel.exporter_names({"OTEL_TRACES_EXPORTER": "console, otlp"}) == ("console", "otlp")
    with pytest.raises(InvalidSpec) as e:
        tel.exporter_names({"OTEL_TRACES_EXPORTER": "jaeger"})
    assert e.value.field == "OTEL_TRACES_EXPORTER" and "jaeger" in e.value.message

    p = tel.build_tracer_provider("svc", env={"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "from-env"})
    assert p.resource.attributes["service.name"] == "from-env"
    procs = p._active_span_processor._span_processors
    assert len(procs) == 1 and isinstance(procs[0], BatchSpanProcessor)
    assert isinstance(procs[0].span_exporter, ConsoleSpanExporter)
    p.shutdown()


def test_otlp_exporter_is_lazy_and_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
    # importing telemetry must not import the extra
    probe = f"import sys, flowmaker.telemetry; assert {mod!r} not in sys.modules"
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0
    monkeypatch.setitem(sys.modules, mod, None)  # behave as if the extra were not installed
    with pytest.raises(FailedPrecondition) as e:
        tel.build_tracer_provider("svc", env={"OTEL_TRACES_EXPORTER": "otlp"})
    assert e.value.reason == "OTLP_EXPORTER_MISSING" and "flowmaker[otlp]" in e.value.message
    monkeypatch.undo()
    pytest.importorskip(mod)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    p = tel.build_tracer_provider("svc", env={"OTEL_TRACES_EXPORTER": "otlp"})
    proc = p._active_span_processor._span_processors[0]
    assert isinstance(proc, BatchSpanProcessor)
    exp = proc.span_exporter
    assert type(exp).__module__ == mod
    p.shutdown()


def test_json_log_formatter_carries_trace_ids(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, _ = traced
    fmt = tel.JsonLogFormatter()
    rec = logging.LogRecord("flowmaker.x", logging.WARNING, __file__, 1, "deployed %s", ("inst-1",), None)
    rec.task = "t1"  # what `extra={"task": "t1"}` does
    with tel.tracer(provider).start_as_current_span("op") as span:
        line = fmt.format(rec)
    out = json.loads(line)
    assert out["message"] == "deployed inst-1" and out["level"] == "WARNING" and out["logger"] == "flowmaker.x"
    assert out["task"] == "t1"
    assert out["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert out["ts"].endswith("Z")
    try:
        raise ValueError("boom")
    except ValueError:
        rec2 = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    out2 = json.loads(fmt.format(rec2))
    assert "trace_id" not in out2 and "ValueError: boom" in out2["exc_info"]
