"""The gateway's HTTP API: OpenAI's `/v1/models` and `/v1/chat/completions` over the orchestrator's gRPC API.

A *task* is a model: `/v1/models` lists the ACTIVE tasks (id, name, description), and a chat
completion whose `model` is a task id (or a task's unique name) runs the request through the task's
workflow by calling the orchestrator's `Invoke` / `InvokeStream`, so the gateway has no serving logic
of its own. What it adds is the OpenAI shape:

- the request's text is the content of the last `user` message (text parts joined);
  `max_completion_tokens` / `max_tokens` cap every LLM call (`InvokeRequest.max_output_tokens`);
- `usage` sums the LLM stages' tokens; on a stream it comes only with `stream_options.include_usage`
  (a last chunk with empty `choices`, as OpenAI sends it);
- a stream carries the deltas of the workflow's final stage only (the intermediate stages' text is not
  the answer); when that stage does not stream (a TOOL stage) its output is sent once it is known;
- every response has `X-FlowMaker-Trace-Id` (the W3C trace id of the request: the gateway's SERVER span,
  the orchestrator's span per stage and the engines' calls all belong to it; an incoming `traceparent`
  is continued) and, when not streamed, `X-FlowMaker-Request-Id` (the orchestrator's request id);
- the caller's `Authorization: Bearer ...` header is passed on as gRPC metadata `authorization`, so the
  gateway asks for exactly the credentials the gRPC API asks for;
- errors are OpenAI's `{"error": {"message", "type", "param", "code"}}` with the status a client expects
  (`ERRORS`: INVALID_ARGUMENT 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404,
  RESOURCE_EXHAUSTED 429, UNAVAILABLE / DEADLINE_EXCEEDED 503).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from flowmaker import convert, telemetry
from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.orchestration.dag import final_stage
from flowmaker.rpc.channels import channel
from flowmaker.rpc.errors import error_info, field_violations

log = logging.getLogger(__name__)

TRACE_HEADER = "X-FlowMaker-Trace-Id"
REQUEST_HEADER = "X-FlowMaker-Request-Id"
SERVED = (task_pb2.Task.STATE_ACTIVE, task_pb2.Task.STATE_DEGRADED)
TRACE_ID = web.RequestKey("trace_id", str)

# gRPC status -> (HTTP status, OpenAI error.type). Anything else is 500 server_error.
ERRORS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "server_error"),
    grpc.StatusCode.ABORTED: (503, "server_error"),
}


class ApiError(Exception):
    """An OpenAI error response: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                             "code": self.code}}, status=self.status, headers=headers)


def api_error_of(e: grpc.RpcError) -> ApiError:
    """The OpenAI error for a failed orchestrator call (reason and field from its google.rpc details)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    status, type_ = ERRORS.get(code, (500, "server_error"))
    info = error_info(e)
    fields = [v.field for v in field_violations(e)]
    details = e.details() if hasattr(e, "details") else str(e)
    reason = info.reason if info and info.reason else code.name
    return ApiError(status, details or code.name, type_=type_, param=fields[0] if fields else None,
                    code=reason.lower())


@dataclass(frozen=True)
class ChatRequest:
    """What the gateway takes from an OpenAI chat completion request."""

    model: str
    text: str
    max_output_tokens: int
    stream: bool
    include_usage: bool


def parse_chat(body: Any) -> ChatRequest:
    """Validate an OpenAI chat completion body; ApiError 400 naming the parameter otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: a task id from /v1/models", param="model")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    text: str | None = None
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}].role: must be a string", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content: must be a string or a list of parts",
                           param=f"messages[{i}].content")
        if m["role"] == "user":
            text = content or ""
    if text is None:
        raise ApiError(400, "no 'user' message: the last user message is the task's input", param="messages")
    pname = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(pname)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ApiError(400, f"'{pname}' must be an integer >= 1, got {max_tokens!r}", param=pname)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be an object with a boolean 'include_usage'",
                       param="stream_options")
    return ChatRequest(model, text, int(max_tokens or 0), stream, bool(stream and (opts or {}).get("include_usage")))


def usage_of(stages: Sequence[Any]) -> dict[str, int]:
    """OpenAI usage of one workflow run: the tokens of its LLM calls (TOOL stages have no model)."""
    p = sum(s.input_tokens for s in stages if s.model_id)
    c = sum(s.output_tokens for s in stages if s.model_id)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def model_card(t: Any) -> dict[str, Any]:
    return {"id": t.id, "object": "model", "created": int(t.create_time.seconds), "owned_by": "flowmaker",
            "name": t.name, "description": t.description}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gateway:
    """The HTTP handlers over one channel to the orchestrator."""

    def __init__(self, orchestrator_address: str, *, timeout_s: float = 300.0, ca_file: str = "") -> None:
        self.orchestrator_address = orchestrator_address
        if ca_file:
            # TLS, verifying the orchestrator against the suite's CA, and deliberately no client certificate:
            # the caller's bearer token, passed on below, is the only identity the orchestrator sees.
            from flowmaker.rpc.tls import channel_credentials

            self.channel = grpc.aio.secure_channel(orchestrator_address, channel_credentials(None, ca_file=ca_file),
                                                   interceptors=telemetry.client_interceptors())
        else:
            self.channel = channel(orchestrator_address, default_timeout_s=timeout_s, tls=False)
        self.timeout_s = timeout_s
        self.stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self.channel)
        self.registry = CollectorRegistry()
        self.requests = Counter("flowmaker_gateway_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("flowmaker_gateway_request_duration_seconds", "HTTP request latency by route.",
                                 ["route"], registry=self.registry)

    async def close(self) -> None:
        await self.channel.close(None)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    # ---- plumbing ---------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """One SERVER span per request (continuing an incoming traceparent), its trace id in a header,
        errors as OpenAI JSON, request counts and latency."""
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        t0 = time.perf_counter()
        ctx = propagate.extract(dict(request.headers))
        with telemetry.tracer().start_as_current_span(f"{request.method} {route}", context=ctx,
                                                      kind=SpanKind.SERVER) as span:
            span.set_attribute("http.request.method", request.method)
            span.set_attribute("http.route", route)
            trace_id = format(span.get_span_context().trace_id, "032x")
            request[TRACE_ID] = trace_id
            try:
                resp = await handler(request)
            except ApiError as e:
                resp = e.response()
            except web.HTTPException as e:
                resp = ApiError(e.status, e.reason or "not found").response()
            except grpc.RpcError as e:
                resp = api_error_of(e).response()
            except ConnectionResetError:  # the client is gone: nothing to answer
                raise
            except Exception:
                log.exception("gateway: %s %s failed", request.method, request.path)
                resp = ApiError(500, "internal error in the gateway", type_="server_error").response()
            span.set_attribute("http.response.status_code", resp.status)
        if not resp.prepared:
            resp.headers[TRACE_HEADER] = trace_id
        self.requests.labels(route, str(resp.status)).inc()
        self.latency.labels(route).observe(time.perf_counter() - t0)
        return resp

    @staticmethod
    def _metadata(request: web.Request) -> list[tuple[str, str]]:
        """The caller's credentials for the orchestrator: `Authorization` as gRPC metadata `authorization`."""
        auth = request.headers.get("Authorization")
        return [("authorization", auth)] if auth else []

    async def _task(self, model: str, md: list[tuple[str, str]]) -> Any:
        """The task a `model` names (an id, or the unique name of a served task); 404 model_not_found if none."""
        try:
            t = (await self.stub.GetTask(pb.GetTaskRequest(task_id=model), metadata=md, timeout=self.timeout_s)).task
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            served = (await self.stub.ListTasks(pb.ListTasksRequest(), metadata=md, timeout=self.timeout_s)).tasks
            named = [x for x in served if x.name == model and x.state in SERVED]
            if len(named) != 1:
                raise ApiError(404, f"The model `{model}` does not exist (no task with that id"
                               + (", and its name is ambiguous)" if named else " or name)"),
                               param="model", code="model_not_found") from None
            t = named[0]
        if t.state not in SERVED:
            state = task_pb2.Task.State.Name(t.state).removeprefix("STATE_")
            raise ApiError(404, f"The model `{model}` is not being served: the task is {state}", param="model",
                           code="model_not_found")
        return t

    # ---- handlers ---------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        resp = await self.stub.ListTasks(pb.ListTasksRequest(state=task_pb2.Task.STATE_ACTIVE),
                                         metadata=self._metadata(request), timeout=self.timeout_s)
        return web.json_response({"object": "list", "data": [model_card(t) for t in resp.tasks]})

    async def get_model(self, request: web.Request) -> web.Response:
        t = await self._task(request.match_info["model"], self._metadata(request))
        return web.json_response(model_card(t))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        req = parse_chat(body)
        md = self._metadata(request)
        t = await self._task(req.model, md)
        span = trace.get_current_span()
        span.set_attribute(telemetry.FLOWMAKER_TASK, t.id)
        if not req.stream:
            r = await self.stub.Invoke(pb.InvokeRequest(task_id=t.id, input=req.text,
                                                        max_output_tokens=req.max_output_tokens), metadata=md,
                                       timeout=self.timeout_s)
            return web.json_response({
                "id": f"chatcmpl-{r.request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": t.id, "choices": [{"index": 0, "message": {"role": "assistant", "content": r.output},
                                            "finish_reason": "stop", "logprobs": None}],
                "usage": usage_of(r.stages)}, headers={REQUEST_HEADER: r.request_id})
        return await self._stream(request, req, t, md)

    async def _stream(self, request: web.Request, req: ChatRequest, t: Any,
                      md: list[tuple[str, str]]) -> web.StreamResponse:
        wf = next((w for w in t.candidates if w.id == t.variant.workflow_id), None)
        final_id = final_stage(convert.workflow_from_proto(wf)).id if wf is not None else ""
        call = self.stub.InvokeStream(pb.InvokeStreamRequest(task_id=t.id, input=req.text,
                                                             max_output_tokens=req.max_output_tokens), metadata=md,
                                      timeout=self.timeout_s)
        chunks = call.__aiter__()
        try:  # the first message (or the call's error) before any byte is sent: errors keep their status
            first: Any = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        oid = f"chatcmpl-{request[TRACE_ID][:24]}"
        created = int(time.time())

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            c: dict[str, Any] = {"id": oid, "object": "chat.completion.chunk", "created": created, "model": t.id,
                                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if req.include_usage:
                c["usage"] = None
            return c

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           TRACE_HEADER: request[TRACE_ID]})
        await resp.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        await send(chunk({"role": "assistant", "content": ""}))
        streamed = ""
        done: Any = None
        try:
            msg = first
            while msg is not None:
                kind = msg.WhichOneof("chunk")
                if kind == "delta" and msg.stage_id == final_id and msg.delta:
                    streamed += msg.delta
                    await send(chunk({"content": msg.delta}))
                elif kind == "done":
                    done = msg.done
                try:
                    msg = await chunks.__anext__()
                except StopAsyncIteration:
                    msg = None
        except grpc.RpcError as e:  # mid-stream: the status is sent; OpenAI clients raise on an error event
            err = api_error_of(e)
            await send({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away: stop the workflow run (the orchestrator drops its engine requests).
            call.cancel()
            raise
        if done is not None:
            rest = done.output[len(streamed):] if done.output.startswith(streamed) else ""
            if rest:  # the final stage did not stream (a TOOL stage), or streamed only part of its output
                await send(chunk({"content": rest}))
            await send(chunk({}, "stop"))
            if req.include_usage:
                await send({"id": oid, "object": "chat.completion.chunk", "created": created, "model": t.id,
                            "choices": [], "usage": usage_of(done.stages)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
