"""OpenTelemetry for every FlowMaker process: tracer setup from the standard OTEL_* settings, gRPC aio
interceptors, `gen_ai.*` spans for model calls, trace context on HTTP, and JSON logs.

Configuration follows the OpenTelemetry specification's environment variables
rather than FlowMaker settings, so that a collector deployment configures every
service the same way:

- `OTEL_TRACES_EXPORTER`: `none` (default here: tests and local runs export
  nothing), `console`, `otlp`; a comma-separated list is allowed.
- `OTEL_SERVICE_NAME`: overrides the service name a process passes in.
- `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
  `OTEL_EXPORTER_OTLP_PROTOCOL` (`grpc` default, or `http/protobuf`), headers,
  etc.: read by the OTLP exporter itself. The exporter is an optional extra
  (`pip install 'flowmaker[otlp]'`), imported only when asked for.
- `OTEL_PROPAGATORS`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_*`: read by the SDK.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from flowmaker.errors import FailedPrecondition, InvalidSpec

log = logging.getLogger(__name__)

TRACER_NAME = "flowmaker"

# Attribute names of the OpenTelemetry semantic conventions for generative AI
# (https://opentelemetry.io/docs/specs/semconv/gen-ai/), kept here so every
# caller spells them the same way.
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat", "text_completion"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"  # who serves the model: "openai" for any OpenAI-compatible API
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
# The request's sampling parameters, by their OpenAI names (`SAMPLING_ATTRIBUTES`).
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty"
GEN_AI_REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
SAMPLING_ATTRIBUTES = {"temperature": GEN_AI_REQUEST_TEMPERATURE, "top_p": GEN_AI_REQUEST_TOP_P,
                       "presence_penalty": GEN_AI_REQUEST_PRESENCE_PENALTY,
                       "frequency_penalty": GEN_AI_REQUEST_FREQUENCY_PENALTY, "seed": GEN_AI_REQUEST_SEED,
                       "stop": GEN_AI_REQUEST_STOP_SEQUENCES}
SERVER_ADDRESS = "server.address"
# FlowMaker's own attributes, namespaced so they never clash with the conventions.
FLOWMAKER_TASK = "flowmaker.task"
FLOWMAKER_STAGE = "flowmaker.stage"
FLOWMAKER_INSTANCE = "flowmaker.instance"
FLOWMAKER_WORKFLOW = "flowmaker.workflow"

_EXPORTERS = ("none", "console", "otlp")
_provider: TracerProvider | None = None


def _otlp_exporter() -> SpanExporter:
    # Imported here: the exporter pulls opentelemetry-proto and is an optional extra.
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            return OTLPSpanExporter()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpOTLPSpanExporter,
            )
            return HttpOTLPSpanExporter()
    except ImportError as e:
        pkg = "grpc" if protocol == "grpc" else "http"
        raise FailedPrecondition(
            f"OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install 'flowmaker[otlp]' "
            f"(opentelemetry-exporter-otlp-proto-{pkg}); import failed: {e}",
            field="OTEL_TRACES_EXPORTER", reason="OTLP_EXPORTER_MISSING") from e
    raise InvalidSpec(f"unsupported protocol {protocol!r}; use 'grpc' or 'http/protobuf'",
                      field="OTEL_EXPORTER_OTLP_PROTOCOL")


def exporter_names(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The exporters OTEL_TRACES_EXPORTER asks for ("none" -> ()); unknown names are a clear error."""
    env = os.environ if env is None else env
    raw = env.get("OTEL_TRACES_EXPORTER", "none")
    names = tuple(n.strip().lower() for n in raw.split(",") if n.strip())
    for n in names:
        if n not in _EXPORTERS:
            raise InvalidSpec(f"unknown exporter {n!r}; known: {list(_EXPORTERS)}", field="OTEL_TRACES_EXPORTER")
    return tuple(n for n in names if n != "none")


def build_tracer_provider(service_name: str, *, env: Mapping[str, str] | None = None,
                          processors: Sequence[SpanProcessor] = ()) -> TracerProvider:
    """A tracer provider for `service_name` (OTEL_SERVICE_NAME wins) exporting to what
    OTEL_TRACES_EXPORTER names, plus `processors` (tests pass a SimpleSpanProcessor over
    an InMemorySpanExporter). Does not install it globally: see `setup_tracing`."""
    env = os.environ if env is None else env
    name = env.get("OTEL_SERVICE_NAME") or service_name
    # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES; the explicit name wins over it.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    for exp in exporter_names(env):
        exporter = ConsoleSpanExporter() if exp == "console" else _otlp_exporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    for p in processors:
        provider.add_span_processor(p)
    return provider


def setup_tracing(service_name: str, *, processors: Sequence[SpanProcessor] = ()) -> TracerProvider:
    """Build the process's tracer provider from the OTEL_* environment and install it as the
    global one. The global provider can be set only once per process, so a second call
    (several services in one test process) returns the first provider."""
    global _provider
    if _provider is not None:
        for p in processors:
            _provider.add_span_processor(p)
        return _provider
    _provider = build_tracer_provider(service_name, processors=processors)
    trace.set_tracer_provider(_provider)
    log.info("tracing: service=%s exporters=%s", _provider.resource.attributes.get(SERVICE_NAME),
             list(exporter_names()) or ["none"])
    return _provider


def shutdown_tracing() -> None:
    """Flush and stop the exporters (call at graceful shutdown)."""
    if _provider is not None:
        _provider.shutdown()


def server_interceptors(tracer_provider: trace.TracerProvider | None = None) -> list[Any]:
    """The aio server interceptors to pass to `grpc.aio.server(interceptors=...)`: one SERVER
    span per RPC, continuing the caller's trace from the request metadata."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=tracer_provider)]


def client_interceptors(tracer_provider: trace.TracerProvider | None = None) -> list[Any]:
    """The aio client interceptors to pass to `grpc.aio.insecure_channel(..., interceptors=...)`:
    one CLIENT span per call, with the trace context injected into the metadata."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=tracer_provider))


def tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)


@contextlib.contextmanager
def llm_span(model: str, *, operation: str = "chat", input_tokens: int | None = None,
             max_tokens: int | None = None, server_address: str | None = None,
             attributes: Mapping[str, str | int | float | bool] | None = None,
             tracer_provider: trace.TracerProvider | None = None) -> Iterator[Span]:
    """A CLIENT span for one model call, named "<operation> <model>" as the gen_ai
    conventions ask, with the request attributes set. Record the answer's usage with
    `record_llm_usage`. An exception leaving the block marks the span as an error."""
    attrs: dict[str, Any] = {GEN_AI_OPERATION_NAME: operation, GEN_AI_REQUEST_MODEL: model,
                             GEN_AI_PROVIDER_NAME: "openai"}
    if input_tokens is not None:
        attrs[GEN_AI_USAGE_INPUT_TOKENS] = int(input_tokens)
    if max_tokens is not None:
        attrs[GEN_AI_REQUEST_MAX_TOKENS] = int(max_tokens)
    if server_address:
        attrs[SERVER_ADDRESS] = server_address
    attrs.update(attributes or {})
    with tracer(tracer_provider).start_as_current_span(f"{operation} {model}", kind=SpanKind.CLIENT,
                                                       attributes=attrs) as span:
        yield span


def sampling_attributes(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The `gen_ai.request.*` attributes of the sampling fields of an OpenAI request body (those set)."""
    out: dict[str, Any] = {}
    for name, attr in SAMPLING_ATTRIBUTES.items():
        v = fields.get(name)
        if v is not None and v != []:
            out[attr] = [v] if isinstance(v, str) else v
    return out


@contextlib.contextmanager
def engine_span(model: str, headers: Mapping[str, str], *, operation: str = "chat",
                attributes: Mapping[str, Any] | None = None,
                tracer_provider: trace.TracerProvider | None = None) -> Iterator[Span]:
    """The SERVER span of one model call at an engine, named "<operation> <model>", a child of the caller's span
    when `headers` carry a W3C `traceparent` (the orchestrator's `chat` CLIENT span sends one), else a root.
    Record the answer's usage with `record_llm_usage`, as on the client's span."""
    attrs: dict[str, Any] = {GEN_AI_OPERATION_NAME: operation, GEN_AI_REQUEST_MODEL: model,
                             GEN_AI_PROVIDER_NAME: "openai", **(attributes or {})}
    ctx = propagate.extract(headers)
    with tracer(tracer_provider).start_as_current_span(f"{operation} {model}", context=ctx, kind=SpanKind.SERVER,
                                                       attributes=attrs) as span:
        yield span


def record_llm_usage(span: Span, *, input_tokens: int | None = None, output_tokens: int | None = None,
                     response_model: str | None = None, finish_reasons: Sequence[str] = ()) -> None:
    """Put the answer's usage on an `llm_span` (from the OpenAI `usage` object)."""
    if input_tokens is not None:
        span.set_attribute(GEN_AI_USAGE_INPUT_TOKENS, int(input_tokens))
    if output_tokens is not None:
        span.set_attribute(GEN_AI_USAGE_OUTPUT_TOKENS, int(output_tokens))
    if response_model:
        span.set_attribute(GEN_AI_RESPONSE_MODEL, response_model)
    if finish_reasons:
        span.set_attribute(GEN_AI_RESPONSE_FINISH_REASONS, list(finish_reasons))


def mark_error(span: Span, exc: BaseException) -> None:
    """Record a handled failure on a span (an unhandled one is recorded by the context manager)."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc)))


def inject_http_headers(headers: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Add the current trace context (W3C `traceparent`/`tracestate`, baggage) to HTTP headers
    for a call to an engine; returns the same mapping (a new dict when None)."""
    carrier: MutableMapping[str, str] = {} if headers is None else headers
    propagate.inject(carrier)
    return carrier


# --- logs ---------------------------------------------------------------------------------------

_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the current trace/span
    ids (so logs join traces in the UI), every `extra=` field, and the exception."""

    converter = time.gmtime  # type: ignore[assignment]  # timestamps in UTC, as the trailing Z says

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out["trace_id"] = format(ctx.trace_id, "032x")
            out["span_id"] = format(ctx.span_id, "016x")
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str | int = "INFO", *, json_logs: bool = True) -> None:
    """Route the root logger to stderr, as JSON lines (services) or plain text (CLI)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if json_logs else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
