"""The gateway's HTTP API: OpenAI's `/v1/models`, `/v1/chat/completions` and `/v1/completions` over the
orchestrator's gRPC API.

A *task* is a model: `/v1/models` lists the ACTIVE tasks (`model_card`: id, name, description, and what is
known of each: state, SLOs, the models serving it and the smallest context window among them), and a
completion whose `model` is a task id, or the name of one of the caller's tasks, runs the request through the
task's workflow by calling the orchestrator's `Invoke` / `InvokeStream`, so the gateway has no serving logic
of its own. What it adds is the OpenAI shape:

- the task's input is the content of the last `user` message (chat; text parts joined) or the `prompt`
  (completions); `max_completion_tokens` / `max_tokens` cap every LLM call (`InvokeRequest.max_output_tokens`);
- parameters are checked as OpenAI checks them (`parse_chat`, `parse_completion`): sampling parameters
  (`temperature` 0..2, `top_p` 0..1, the penalties -2..2, an integer `seed`, up to 4 `stop` sequences;
  `flowmaker.sampling`) go to the orchestrator (`InvokeRequest.sampling`), which passes them to every LLM call
  of the workflow; what a workflow cannot honour (`tools`, a `response_format` other than text, `logprobs`,
  `logit_bias`, `n` > 1, non-text content parts, ...) is refused with a 400 naming the parameter;
- the `model` goes to `Invoke` as the task id with no lookup first: an unknown one is the orchestrator's own
  NOT_FOUND, answered 404 `model_not_found`; a model that is not an id is tried as the name of one of the
  caller's tasks (ListTasks), and what it resolved to is kept for `route_ttl_s` (`Routes`), as is a streamed
  task's final stage (from one GetTask);
- `finish_reason` is the engine's for the final stage (`StageOutput.finish_reason`): "length" when a token cap
  cut the answer, else "stop" (a TOOL final stage: "stop");
- `usage` sums the LLM stages' tokens; on a stream it comes only with `stream_options.include_usage`
  (a last chunk with empty `choices`, as OpenAI sends it);
- a stream carries the deltas of the workflow's final stage only (the intermediate stages' text is not
  the answer); when that stage does not stream (a TOOL stage) its output is sent once it is known;
- every response has `X-FlowMaker-Trace-Id` (the W3C trace id of the request: the gateway's SERVER span,
  the orchestrator's span per stage and the engines' calls all belong to it; an incoming `traceparent`
  is continued) and, when not streamed, `X-FlowMaker-Request-Id` (the orchestrator's request id);
- the caller's `Authorization: Bearer ...` header is passed on as gRPC metadata `authorization`, so the
  gateway asks for exactly the credentials the gRPC API asks for (a header that is not printable ASCII,
  which gRPC metadata cannot carry, is 401 here);
- errors are OpenAI's `{"error": {"message", "type", "param", "code"}}` with the status a client expects
  (`ERRORS`: INVALID_ARGUMENT 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404,
  RESOURCE_EXHAUSTED 429, UNAVAILABLE / DEADLINE_EXCEEDED 503) and OpenAI's parameter names (`model`,
  `max_tokens`, `messages` / `prompt` where the orchestrator says `task_id`, `max_output_tokens`, `input`);
- every malformed request gets a 4xx in that shape: a body that is not JSON (or not UTF-8, or NaN), nests
  deeper than MAX_JSON_DEPTH, holds a lone surrogate or a number out of range is 400 naming the field;
  malformed HTTP (request line, headers) is 400 from the HTTP parser, in the same shape (`GatewayRunner`);
- every request is answered or its connection closed: request headers not complete within `header_timeout_s`
  (from the connection's start or its previous response; also an idle keep-alive connection) close the
  connection, a body not received within `body_timeout_s` is 408, and a handler running past the
  orchestrator deadline plus HANDLER_GRACE_S is 504;
- `GET /ready` is 200 while the orchestrator answers its gRPC health check SERVING, else 503;
  `GET /health` is 200 while the process runs.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from flowmaker import convert, telemetry
from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.errors import InvalidSpec
from flowmaker.orchestration.dag import final_stage
from flowmaker.rpc.channels import channel
from flowmaker.rpc.errors import error_info, field_violations
from flowmaker.sampling import Sampling

log = logging.getLogger(__name__)

TRACE_HEADER = "X-FlowMaker-Trace-Id"
REQUEST_HEADER = "X-FlowMaker-Request-Id"
SERVED = (task_pb2.Task.STATE_ACTIVE, task_pb2.Task.STATE_DEGRADED)
TRACE_ID = web.RequestKey("trace_id", str)
INT32_MAX = 2**31 - 1  # InvokeRequest.max_output_tokens is an int32
MAX_JSON_DEPTH = 32  # an OpenAI request nests 4 deep (messages[0].content[0].text)
HANDLER_GRACE_S = 30.0  # past the orchestrator call's own deadline, before a request is answered 504
LINGER_S = 2.0  # how long an unread request body is drained after the response, before the connection closes
READY_TIMEOUT_S = 5.0

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

# The orchestrator's request fields -> the OpenAI parameter a caller set (`Invocation.names` per request).
DEFAULT_NAMES: dict[str, str] = {"task_id": "model", "max_output_tokens": "max_tokens", "input": "messages"}
NAMES = web.RequestKey("names", dict)
STREAM = web.RequestKey("stream", web.StreamResponse)


class ApiError(Exception):
    """An OpenAI error response: HTTP status, message, type, param, code; `close` ends the connection after it."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.close = close

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        resp = web.json_response(self.body(), status=self.status, headers=headers)
        if self.close:
            resp.force_close()
        return resp


def api_error_of(e: grpc.RpcError, names: Mapping[str, str] | None = None) -> ApiError:
    """The OpenAI error for a failed orchestrator call (reason and field from its google.rpc details). `names`
    maps the orchestrator's field names to the parameters the caller used (`max_output_tokens` -> `max_tokens`);
    an identifier renamed so is renamed in the message too."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    status, type_ = ERRORS.get(code, (500, "server_error"))
    info = error_info(e)
    fields = [v.field for v in field_violations(e)]
    details = (e.details() if hasattr(e, "details") else str(e)) or code.name
    reason = info.reason if info and info.reason else code.name
    param = fields[0] if fields else None
    ours = (names or DEFAULT_NAMES).get(param or "")
    if param and ours:
        if "_" in param or "." in param:  # an identifier, never an English word: safe to rename in the text
            details = re.sub(rf"\b{re.escape(param)}\b", ours, details)
        param = ours
    return ApiError(status, details, type_=type_, param=param, code=reason.lower())


# ---- the request body ---------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


# A string runs to its closing quote, or (invalid JSON, which json.loads then refuses) to the end of the text: a
# match from every opening quote, so the scan stays linear whatever the quotes and backslashes.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def _too_deep(text: str, limit: int = 8 * MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests deeper than `limit` (brackets outside strings), found before parsing: `json`
    would recurse 5,000 levels deep into a RecursionError, which is best never raised at all. (Past
    MAX_JSON_DEPTH but within `limit`, `check_json` names the field after parsing.)"""
    d = 0
    for c in _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)):
        d += 1 if c in "[{" else -1
        if d > limit:
            return True
    return False


def loads_request(raw: bytes) -> Any:
    """A request body as JSON (UTF-8, -16 or -32), checked by `check_json`; ApiError 400 otherwise."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty: a JSON object is required")
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # what json.loads(bytes) does
        if _too_deep(text):
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, an integer of over 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    check_json(body)
    return body


def _path(trail: tuple[Any, ...] | None) -> str:
    keys: list[Any] = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    out = ""
    for k in reversed(keys):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out if len(out) <= 200 else out[:197] + "..."


def _check_text(s: str, trail: tuple[Any, ...] | None) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        where = _path(trail) or "the request body"
        raise ApiError(400, f"{where}: holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode",
                       param=_path(trail) or None) from None


def check_json(body: Any) -> None:
    """ApiError 400 naming the field of the first string (value or key) that is not valid Unicode (a lone
    surrogate, which `json` decodes but nothing can encode), or of a container nested deeper than
    MAX_JSON_DEPTH. Iterative: no recursion however the body nests."""
    stack: list[tuple[Any, tuple[Any, ...] | None, int]] = [(body, None, 0)]
    while stack:
        v, trail, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v, trail)
        elif isinstance(v, dict | list):
            if depth >= MAX_JSON_DEPTH:
                where = _path(trail) or "the request body"
                raise ApiError(400, f"{where}: nests deeper than {MAX_JSON_DEPTH} levels", param=_path(trail) or None)
            items: Iterable[tuple[Any, Any]] = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    _check_text(k, (trail, k))
                stack.append((x, (trail, k), depth + 1))


# ---- the parameters ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Invocation:
    """What the gateway takes from an OpenAI (chat) completion request."""

    model: str
    text: str
    max_output_tokens: int
    stream: bool
    include_usage: bool
    tokens_param: str = "max_tokens"  # the cap's name as the caller set it
    input_param: str = "messages"  # "prompt" for /v1/completions
    sampling: Sampling | None = None

    @property
    def names(self) -> dict[str, str]:
        return {"task_id": "model", "max_output_tokens": self.tokens_param, "input": self.input_param,
                **{f"sampling.{n}": n for n in SAMPLING_NAMES}}



def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unsupported(body: dict[str, Any], name: str, fine: Callable[[Any], bool], why: str) -> None:
    if name in body and not fine(body[name]):
        raise ApiError(400, f"'{name}' is not supported: {why}", param=name, code="unsupported_parameter")


_NO_TOOLS = "a task runs its own workflow and calls no tools of the caller's"
SAMPLING_NAMES = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop")


def _sampling(body: dict[str, Any]) -> Sampling | None:
    """The request's sampling parameters (None when none is set); ApiError 400 naming one out of range."""
    try:
        s = Sampling.from_openai(body)
    except InvalidSpec as e:
        raise ApiError(400, f"'{e.field}' {e.message}", param=e.field, code="invalid_value") from None
    return s if s.is_set else None


def _common(body: Any) -> tuple[str, int, str, bool, bool]:
    """The checks chat and completions share: model, the token cap, stream, n, sampling (`_sampling`),
    logit_bias. (model, cap, the cap's parameter name, stream, include_usage)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: a task id (or the name of one of your tasks) from /v1/models",
                       param="model")
    cap = 0
    pname = "max_tokens"
    for name in ("max_tokens", "max_completion_tokens"):  # max_completion_tokens wins when both are set
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v) or not 1 <= v <= INT32_MAX:
            raise ApiError(400, f"'{name}' must be an integer from 1 to {INT32_MAX}, got {_show(v)}", param=name,
                           code="invalid_value")
        cap, pname = v, name
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(400, f"only n=1 is supported, got {_show(n)}", param="n", code="unsupported_value")
    _sampling(body)
    _unsupported(body, "logit_bias", lambda v: v in (None, {}), "the workflow's models sample on their own")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be an object with a boolean 'include_usage'",
                       param="stream_options")
    return model, cap, pname, stream, bool(stream and (opts or {}).get("include_usage"))


def parse_chat(body: Any) -> Invocation:
    """Validate an OpenAI chat completion body; ApiError 400 naming the parameter otherwise."""
    model, cap, pname, stream, include_usage = _common(body)
    for name in ("tools", "functions"):
        _unsupported(body, name, lambda v: v in (None, []), _NO_TOOLS)
    for name in ("tool_choice", "function_call"):
        _unsupported(body, name, lambda v: v in (None, "none"), _NO_TOOLS)
    _unsupported(body, "response_format", lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
                 "the answer is the text of the workflow's final stage; only {\"type\": \"text\"}")
    _unsupported(body, "logprobs", lambda v: v in (None, False), "the gateway returns no log probabilities")
    _unsupported(body, "top_logprobs", lambda v: v in (None, 0), "the gateway returns no log probabilities")
    _unsupported(body, "modalities", lambda v: v in (None, ["text"]), "a task answers with text only")
    for name in ("audio", "prediction"):
        _unsupported(body, name, lambda v: v is None, "a task answers with text only")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    text: str | None = None
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}]: must be an object with 'role' and 'content'", param=f"messages[{i}]")
        if not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}].role: must be a string", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type", "text") != "text" or not isinstance(p.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": "
                                   "...}) are supported", param=f"messages[{i}].content[{j}]",
                                   code="unsupported_value")
                parts.append(p["text"])
            content = "\n".join(parts)
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content: must be a string or a list of parts",
                           param=f"messages[{i}].content")
        if m["role"] == "user":
            text = content or ""
    if text is None:
        raise ApiError(400, "no 'user' message: the last user message is the task's input", param="messages")
    return Invocation(model, text, cap, stream, include_usage, pname, "messages", _sampling(body))


def parse_completion(body: Any) -> Invocation:
    """Validate an OpenAI (legacy) completion body: `prompt` is the task's input. ApiError 400 naming the
    parameter otherwise. Without `max_tokens` each stage keeps its own cap (OpenAI's default is 16)."""
    model, cap, pname, stream, include_usage = _common(body)
    _unsupported(body, "suffix", lambda v: v in (None, ""), "the answer is the workflow's output, nothing is inserted")
    _unsupported(body, "echo", lambda v: v in (None, False), "the answer is the workflow's output alone")
    _unsupported(body, "best_of", lambda v: v in (None, 1), "a task runs its workflow once per request")
    _unsupported(body, "logprobs", lambda v: v is None, "the gateway returns no log probabilities")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        raise ApiError(400, "'prompt' as token ids is not supported: send the text", param="prompt",
                       code="unsupported_value")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "one prompt per request: 'prompt' must be a string (or a list of one string)",
                       param="prompt", code="unsupported_value")
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' is required: a string, the task's input", param="prompt")
    return Invocation(model, prompt, cap, stream, include_usage, pname, "prompt", _sampling(body))


# ---- responses -------------------------------------------------------------------------------------


def usage_of(stages: Sequence[Any]) -> dict[str, int]:
    """OpenAI usage of one workflow run: the tokens of its LLM calls (TOOL stages have no model)."""
    p = sum(s.input_tokens for s in stages if s.model_id)
    c = sum(s.output_tokens for s in stages if s.model_id)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def finish_reason_of(stages: Sequence[Any], final_id: str, cap: int) -> str:
    """OpenAI's finish_reason of a run: the engine's reason for its final stage ("length" when a token cap cut
    it; "content_filter" passes through), else "stop". A TOOL final stage stops when done. An orchestrator
    that does not pass the engine's reason on: "length" when the final stage produced the caller's cap."""
    st = next((s for s in stages if s.stage_id == final_id), None) if final_id else None
    if st is None and stages:
        st = stages[-1]
    if st is None or not st.model_id:
        return "stop"
    reason = getattr(st, "finish_reason", "")
    if reason:
        return reason if reason in ("length", "content_filter") else "stop"
    return "length" if cap and st.output_tokens >= cap else "stop"


@functools.lru_cache(maxsize=256)
def context_of(model_id: str) -> int | None:
    """A catalog model's context window in tokens; None when the model is not in the catalog (e.g. registered
    at run time) or its architecture is unknown."""
    from flowmaker.catalog import get_model
    from flowmaker.errors import NotFound

    try:
        arch = get_model(model_id).arch
    except NotFound:
        return None
    return int(arch.max_ctx) if arch is not None and arch.max_ctx else None


def model_card(t: Any) -> dict[str, Any]:
    """A task as an OpenAI model, with what is known of it: state, SLOs, its selected workflow and the models
    serving it, and `context_length`, the smallest context window among those models (absent when one of them
    is not a catalog model)."""
    models = sorted({a.model_id for a in t.variant.assignments if a.model_id})
    card: dict[str, Any] = {
        "id": t.id, "object": "model", "created": int(t.create_time.seconds), "owned_by": "flowmaker",
        "name": t.name, "description": t.description,
        "state": task_pb2.Task.State.Name(t.state).removeprefix("STATE_"),
        "slo": {"min_accuracy": t.slo.min_accuracy, "max_latency_s": t.slo.max_latency_s,
                "arrival_rate_rps": t.slo.arrival_rate_rps},
        "workflow_id": t.variant.workflow_id, "models": models}
    ctx = [context_of(m) for m in models]
    if ctx and all(ctx):
        card["context_length"] = min(c for c in ctx if c)
    return card


def final_stage_id(t: Any) -> str:
    wf = next((w for w in t.candidates if w.id == t.variant.workflow_id), None)
    return final_stage(convert.workflow_from_proto(wf)).id if wf is not None else ""


def final_of(r: Any) -> str:
    """The final stage of an InvokeResponse: the last stage whose output is the request's ("" when none is)."""
    return next((st.stage_id for st in reversed(r.stages) if st.output == r.output), "")


@dataclass(frozen=True, slots=True)
class Route:
    """What a `model` resolved to: the task id, and the final stage of its workflow ("" = not looked up)."""

    task_id: str
    final_id: str = ""


class Routes:
    """`model` -> Route per caller (names resolve among the caller's own tasks), each kept `ttl_s`: the
    lookup behind a name, or behind a stream's final stage, is made once per TTL rather than per request. A
    task re-selected or deleted meanwhile is at worst `ttl_s` stale: the orchestrator checks every call, and an
    entry whose call fails is dropped."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._d: dict[tuple[str, str], tuple[float, Route]] = {}

    def get(self, model: str, who: str) -> Route | None:
        hit = self._d.get((model, who))
        if hit is None or hit[0] < time.monotonic():
            return None
        return hit[1]

    def put(self, model: str, who: str, route: Route) -> Route:
        if self.ttl_s <= 0:
            return route
        if len(self._d) >= self.max_entries:  # many callers x models: start over rather than grow
            self._d.clear()
        self._d[(model, who)] = (time.monotonic() + self.ttl_s, route)
        return route

    def drop(self, model: str, who: str) -> None:
        self._d.pop((model, who), None)


def _caller(request: web.Request) -> str:
    """Who is asking, as a `Routes` key: a digest of the Authorization header (the token is not kept)."""
    return hashlib.sha256(request.headers.get("Authorization", "").encode(errors="surrogateescape")).hexdigest()


def _about_the_task(e: grpc.RpcError) -> bool:
    """Whether a failed Invoke refused the task id itself (unknown, someone else's, not an id at all)."""
    code = e.code() if hasattr(e, "code") else None
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
        return True
    return code == grpc.StatusCode.INVALID_ARGUMENT and [v.field for v in field_violations(e)][:1] == ["task_id"]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---- the HTTP server: malformed HTTP answered in OpenAI's shape ----------------------------------------


class _Protocol(RequestHandler):
    """aiohttp's connection handler, answering what its HTTP parser refuses (a bad request line, a header
    with a control character, ...) as OpenAI JSON, logged without a traceback and without echoing the bytes
    (they may hold a credential)."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            log.error("gateway: error handling a request from %s", request.remote, exc_info=exc)
            err = ApiError(status, "internal error in the gateway", type_="server_error")
        else:
            log.debug("gateway: malformed HTTP request from %s: %s", request.remote, type(exc).__name__)
            err = ApiError(status, f"malformed HTTP request ({type(exc).__name__ if exc else 'bad request'}): the "
                                   "request line, a header or the body's framing or encoding is not valid HTTP/1.1")
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started: no error response can follow")
        resp = err.response()
        resp.force_close()
        return resp


    def log_exception(self, *args: Any, **kw: Any) -> None:
        # A body that cannot be decoded (a bad gzip stream, say) fails again when aiohttp drains it after the
        # response (which the handler already answered 400): the client's fault, not worth a traceback.
        if isinstance(kw.get("exc_info"), RequestPayloadError):
            log.debug("gateway: an unreadable request body was dropped: %s", kw["exc_info"])
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections answer HTTP parse errors as OpenAI JSON (`_Protocol`). aiohttp has no
    option for it: the server it builds becomes a `_Server` (the same object, one method more); should a later
    aiohttp refuse that, its own text/plain 400s are kept."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        try:
            server.__class__ = _Server
        except TypeError:  # pragma: no cover - an aiohttp whose Server has another layout
            log.warning("gateway: aiohttp's Server cannot be extended; HTTP parse errors are answered as text")
        return server


class Gateway:
    """The HTTP handlers over one channel to the orchestrator."""

    def __init__(self, orchestrator_address: str, *, timeout_s: float = 300.0, ca_file: str = "",
                 header_timeout_s: float = 30.0, body_timeout_s: float = 30.0, route_ttl_s: float = 5.0) -> None:
        self.orchestrator_address = orchestrator_address
        self.routes = Routes(route_ttl_s)
        if ca_file:
            # TLS, verifying the orchestrator against the suite's CA, and deliberately no client certificate:
            # the caller's bearer token, passed on below, is the only identity the orchestrator sees.
            from flowmaker.rpc.channels import target_options
            from flowmaker.rpc.tls import channel_credentials

            # Every orchestrator replica ("a:1,b:2"): round robin, idempotent calls retried on UNAVAILABLE.
            target, options = target_options(orchestrator_address, secure=True)
            self.channel = grpc.aio.secure_channel(target, channel_credentials(None, ca_file=ca_file),
                                                   options=options, interceptors=telemetry.client_interceptors())
        else:
            self.channel = channel(orchestrator_address, default_timeout_s=timeout_s, tls=False)
        self.timeout_s = timeout_s
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
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
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        return app

    def runner(self, **kw: Any) -> web.AppRunner:
        """The app's runner with the gateway's connection settings: the header timeout (aiohttp's keep-alive
        timer, which also runs from a connection's start and closes one whose request is still incomplete),
        a short drain of unread bodies, and a client that disconnects cancels its request (and with it the
        orchestrator call)."""
        opts: dict[str, Any] = {"handler_cancellation": True, "keepalive_timeout": self.header_timeout_s,
                                "lingering_time": LINGER_S, **kw}
        return GatewayRunner(self.app(), **opts)

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
                async with asyncio.timeout(self.timeout_s + HANDLER_GRACE_S):
                    resp = await handler(request)
            except ConnectionResetError:  # the client is gone: nothing to answer
                raise
            except Exception as e:
                resp = self._error_response(request, e)
            span.set_attribute("http.response.status_code", resp.status)
        if not resp.prepared:
            resp.headers[TRACE_HEADER] = trace_id
        self.requests.labels(route, str(resp.status)).inc()
        self.latency.labels(route).observe(time.perf_counter() - t0)
        return resp

    def _error_response(self, request: web.Request, e: Exception) -> web.StreamResponse:
        started = request.get(STREAM)
        if started is not None and started.prepared:
            # A stream already sent its status: it ends here (aiohttp finishes it), and the client sees the cut.
            log.warning("gateway: %s %s failed mid-stream: %s", request.method, request.path, type(e).__name__)
            return started
        if isinstance(e, ApiError):
            return e.response()
        if isinstance(e, web.HTTPException):
            hint = {404: ": the API is /v1/models, /v1/chat/completions and /v1/completions",
                    413: f": {e.text}" if e.text else ""}.get(e.status, "")
            type_ = "invalid_request_error" if e.status < 500 else "server_error"
            return ApiError(e.status, f"{e.reason}{hint}", type_=type_).response()
        if isinstance(e, grpc.RpcError):
            return api_error_of(e, request.get(NAMES)).response()
        if isinstance(e, TimeoutError):
            return ApiError(504, f"the request did not finish within {self.timeout_s + HANDLER_GRACE_S:g} s",
                            type_="server_error", code="timeout").response()
        log.exception("gateway: %s %s failed", request.method, request.path)
        return ApiError(500, "internal error in the gateway", type_="server_error").response()

    @staticmethod
    def _metadata(request: web.Request) -> list[tuple[str, str]]:
        """The caller's credentials for the orchestrator: `Authorization` as gRPC metadata `authorization`.
        gRPC metadata is printable ASCII: anything else is 401 here (never passed on, never echoed)."""
        auth = request.headers.get("Authorization")
        if auth is None:
            return []
        if not (auth.isascii() and auth.isprintable()):
            raise ApiError(401, "the Authorization header must be 'Bearer <token>' in printable ASCII",
                           type_="authentication_error", code="invalid_api_key")
        return [("authorization", auth)] if auth else []

    async def _json(self, request: web.Request) -> Any:
        """The request body as checked JSON (`loads_request`); 408, closing the connection, when it does not
        arrive within `body_timeout_s`."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                           code="request_timeout", close=True) from None
        except RequestPayloadError as e:  # e.g. a Content-Encoding the body does not decode as
            raise ApiError(400, f"the request body could not be read: {' '.join(str(e).split())[:200]}",
                           close=True) from None
        return loads_request(raw)

    async def _task(self, model: str, md: list[tuple[str, str]]) -> Any:
        """The task a `model` names: its id, or the name of one of the caller's tasks (an admin's: any task).
        Names resolve among the tasks ListTasks shows the caller, so a user naming their own task is not told
        PERMISSION_DENIED, which the orchestrator answers for ids that are not theirs. 404 model_not_found when
        nothing matches (403 stays 403 for an id that is someone else's)."""
        _check_text(model, (None, "model"))
        try:
            t = (await self.stub.GetTask(pb.GetTaskRequest(task_id=model), metadata=md, timeout=self.timeout_s)).task
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                                grpc.StatusCode.INVALID_ARGUMENT):
                raise
            t = await self._named(model, md, e)
        if t.state not in SERVED:
            state = task_pb2.Task.State.Name(t.state).removeprefix("STATE_")
            raise ApiError(404, f"The model `{model}` is not being served: the task is {state}", param="model",
                           code="model_not_found")
        return t

    async def _named(self, model: str, md: list[tuple[str, str]], e: grpc.RpcError) -> Any:
        """The caller's task named `model`, after `e` refused it as a task id: a served one first; 404
        ambiguous for several served ones; none: `e` itself, a 403 as it is, anything else as OpenAI's 404
        model_not_found with the orchestrator's message."""
        mine = (await self.stub.ListTasks(pb.ListTasksRequest(), metadata=md, timeout=self.timeout_s)).tasks
        named = [x for x in mine if x.name == model]
        served = [x for x in named if x.state in SERVED]
        if len(served) > 1:
            raise ApiError(404, f"The model `{model}` is ambiguous: {len(served)} served tasks have that name ("
                           + ", ".join(x.id for x in served[:5]) + "); use a task id", param="model",
                           code="model_not_found") from None
        if not named:
            if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise e
            said = " ".join((e.details() or "").split())[:300] if hasattr(e, "details") else ""
            raise ApiError(404, f"The model `{model[:200]}` does not exist (no task with that id or name)"
                           + (f": {said}" if said else ""), param="model", code="model_not_found") from None
        return served[0] if served else named[0]

    async def _invoke(self, request: web.Request, req: Invocation, md: list[tuple[str, str]]) -> tuple[Any, Route]:
        """Invoke with `model` as the task id (or what it resolved to within the TTL): no lookup first. An
        orchestrator that resolves names itself says which task served (`InvokeResponse.task_id`); one that
        refuses the id: `model` may be one of the caller's task names, resolved here (ListTasks), kept, and
        invoked. (The response, the route it took.)"""
        who = _caller(request)
        route = self.routes.get(req.model, who) or Route(req.model)
        try:
            r = await self._call_invoke(route.task_id, req, md)
            if r.task_id and r.task_id != route.task_id:  # the orchestrator resolved a name: keep what it was
                route = self.routes.put(req.model, who, Route(r.task_id))
            return r, route
        except grpc.RpcError as e:
            self.routes.drop(req.model, who)
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and [v.field for v in field_violations(e)][:1] == [
                    "task_id"]:  # the task exists but is not served (not ACTIVE yet, FAILED, DELETING)
                said = " ".join((e.details() or "").split())[:300]
                raise ApiError(404, f"The model `{req.model[:200]}` is not being served: {said}", param="model",
                               code="model_not_found") from None
            if route.task_id != req.model or not _about_the_task(e):
                raise
            t = await self._named(req.model, md, e)
        route = self.routes.put(req.model, who, Route(t.id, final_stage_id(t)))
        return await self._call_invoke(t.id, req, md), route

    async def _call_invoke(self, task_id: str, req: Invocation, md: list[tuple[str, str]]) -> Any:
        trace.get_current_span().set_attribute(telemetry.FLOWMAKER_TASK, task_id)
        return await self.stub.Invoke(pb.InvokeRequest(
            task_id=task_id, input=req.text, max_output_tokens=req.max_output_tokens,
            sampling=convert.sampling_to_proto(req.sampling)), metadata=md, timeout=self.timeout_s)

    async def _stream_route(self, request: web.Request, req: Invocation, md: list[tuple[str, str]]) -> Route:
        """A stream needs the final stage before the first delta (only its text is the answer): one GetTask (and
        for a name, ListTasks) per model and caller per TTL."""
        who = _caller(request)
        route = self.routes.get(req.model, who)
        if route is None or not route.final_id:
            t = await self._task(req.model, md)
            route = self.routes.put(req.model, who, Route(t.id, final_stage_id(t)))
        trace.get_current_span().set_attribute(telemetry.FLOWMAKER_TASK, route.task_id)
        return route

    # ---- handlers ---------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def ready(self, request: web.Request) -> web.Response:
        """200 while the orchestrator answers its health check SERVING; else 503 naming what it answered."""
        try:
            r = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=""),
                                             timeout=min(READY_TIMEOUT_S, self.timeout_s))
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            status = e.code().name if hasattr(e, "code") else "UNAVAILABLE"
        if status != "SERVING":
            raise ApiError(503, f"not ready: the orchestrator at {self.orchestrator_address} answered {status}",
                           type_="server_error", code="not_ready")
        return web.json_response({"status": "ready", "orchestrator": status})

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
        md = self._metadata(request)
        return await self._run(request, parse_chat(await self._json(request)), md, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        md = self._metadata(request)
        return await self._run(request, parse_completion(await self._json(request)), md, chat=False)

    async def _run(self, request: web.Request, req: Invocation, md: list[tuple[str, str]], *,
                   chat: bool) -> web.StreamResponse:
        request[NAMES] = req.names
        if req.stream:
            route = await self._stream_route(request, req, md)
            return await self._stream(request, req, route.task_id, md, route.final_id, chat=chat)
        r, route = await self._invoke(request, req, md)
        finish = finish_reason_of(r.stages, route.final_id or final_of(r), req.max_output_tokens)
        head = {"created": int(time.time()), "model": route.task_id}
        if chat:
            body = {"id": f"chatcmpl-{r.request_id}", "object": "chat.completion", **head,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": r.output},
                                 "finish_reason": finish, "logprobs": None}]}
        else:
            body = {"id": f"cmpl-{r.request_id}", "object": "text_completion", **head,
                    "choices": [{"index": 0, "text": r.output, "finish_reason": finish, "logprobs": None}]}
        return web.json_response({**body, "usage": usage_of(r.stages)}, headers={REQUEST_HEADER: r.request_id})

    async def _stream(self, request: web.Request, req: Invocation, task_id: str, md: list[tuple[str, str]],
                      final_id: str, *, chat: bool) -> web.StreamResponse:
        call = self.stub.InvokeStream(pb.InvokeStreamRequest(
            task_id=task_id, input=req.text, max_output_tokens=req.max_output_tokens,
            sampling=convert.sampling_to_proto(req.sampling)), metadata=md, timeout=self.timeout_s)
        chunks = call.__aiter__()
        try:  # the first message (or the call's error) before any byte is sent: errors keep their status
            first: Any = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        except grpc.RpcError:
            self.routes.drop(req.model, _caller(request))
            raise
        oid = f"{'chatcmpl' if chat else 'cmpl'}-{request[TRACE_ID][:24]}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(text: str | None, finish: str | None = None, *, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            c: dict[str, Any] = {"id": oid, "object": obj, "created": created, "model": task_id, "choices": [choice]}
            if req.include_usage:
                c["usage"] = None
            return c

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           TRACE_HEADER: request[TRACE_ID]})
        request[STREAM] = resp
        await resp.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        if chat:
            await send(chunk("", role=True))
        streamed = ""
        done: Any = None
        try:
            msg = first
            while msg is not None:
                kind = msg.WhichOneof("chunk")
                if kind == "delta" and msg.stage_id == final_id and msg.delta:
                    streamed += msg.delta
                    await send(chunk(msg.delta))
                elif kind == "done":
                    done = msg.done
                try:
                    msg = await chunks.__anext__()
                except StopAsyncIteration:
                    msg = None
        except grpc.RpcError as e:  # mid-stream: the status is sent; OpenAI clients raise on an error event
            await send(api_error_of(e, req.names).body())
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away: stop the workflow run (the orchestrator drops its engine requests).
            call.cancel()
            raise
        if done is not None:
            rest = done.output[len(streamed):] if done.output.startswith(streamed) else ""
            if rest:  # the final stage did not stream (a TOOL stage), or streamed only part of its output
                await send(chunk(rest))
            await send(chunk(None if chat else "", finish_reason_of(done.stages, final_id, req.max_output_tokens)))
            if req.include_usage:
                await send({"id": oid, "object": obj, "created": created, "model": task_id, "choices": [],
                            "usage": usage_of(done.stages)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
