"""THE error map: FlowMaker exceptions <-> gRPC status codes with google.rpc.ErrorInfo (and BadRequest).

Server side, `ErrorInterceptor` turns any `FlowMakerError` a servicer raises into
`context.abort_with_status(...)` with the bound code, an `ErrorInfo(reason, domain="flowmaker.io",
metadata)` and, when the error names a field, a `BadRequest.FieldViolation`. Anything else becomes
INTERNAL with a generic message; its traceback is logged, never sent.

Before a handler runs, the same interceptor answers INVALID_ARGUMENT for a request that does not
decode (bad wire format, bad UTF-8) or breaks a rule of `flowmaker.rpc.validate` (unknown enum
value, non-finite number, a bound of the limits table), and RESOURCE_EXHAUSTED for a caller that
already has `concurrent_calls_per_caller` RPCs in flight on this server. Messages and metadata
echoed back are truncated, so a huge id never comes back whole.

Client side, `from_rpc_error(e)` rebuilds the typed exception, so a service calling another one
handles `NoCapacity`, `Conflict`... exactly as if the call had been local.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from flowmaker import cancel as _cancel
from flowmaker.errors import (
    AlreadyExists,
    Conflict,
    DeadlineExceeded,
    FailedPrecondition,
    FlowMakerError,
    InvalidSpec,
    NoCapacity,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from flowmaker.limits import LIMITS
from flowmaker.rpc.auth import ANONYMOUS_ADMIN, AuthPolicy, current_principal
from flowmaker.rpc.validate import validate_request

log = logging.getLogger(__name__)

DOMAIN = "flowmaker.io"
STATUS_DETAILS_KEY = "grpc-status-details-bin"

# Most specific first: the first isinstance match wins (subclasses such as EngineStartError
# keep their parent's code but carry their own reason).
CODES: tuple[tuple[type[FlowMakerError], grpc.StatusCode], ...] = (
    (InvalidSpec, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (Conflict, grpc.StatusCode.ABORTED),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (NoCapacity, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
)
_BY_CODE: dict[grpc.StatusCode, type[FlowMakerError]] = {code: cls for cls, code in CODES}

INTERNAL_REASON = "INTERNAL"

# Absolute deadline (time.monotonic()) of the RPC being served, so outgoing calls made while
# serving it never outlive it (see flowmaker.rpc.channels) and offloaded work stops with it.
incoming_deadline = _cancel.incoming_deadline


def code_of(e: FlowMakerError) -> grpc.StatusCode:
    for cls, code in CODES:
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.UNKNOWN  # a bare FlowMakerError: expected, but of no known kind


MAX_MESSAGE_CHARS = 1024  # of a status message; trailers must stay well under the default 8 KiB
MAX_METADATA_CHARS = 256  # of each ErrorInfo metadata value and of a field path


def truncate(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 20] + f"...[{len(text) - n + 20} more]"


def to_status_proto(e: FlowMakerError) -> status_pb2.Status:
    """The google.rpc.Status a FlowMakerError is sent as (texts truncated: they may echo user input)."""
    code = code_of(e)
    metadata = {truncate(str(k), 64): truncate(str(v), MAX_METADATA_CHARS) for k, v in list(e.metadata.items())[:16]}
    field = truncate(e.field, MAX_METADATA_CHARS) if e.field else None
    if field:
        metadata.setdefault("field", field)
    details = [_pack(error_details_pb2.ErrorInfo(reason=e.reason, domain=DOMAIN, metadata=metadata))]
    if field:
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=truncate(e.message,
                                                                                         MAX_MESSAGE_CHARS))])))
    return status_pb2.Status(code=code.value[0], message=truncate(str(e), MAX_MESSAGE_CHARS), details=details)


def _pack(msg: Any) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def to_grpc_status(e: FlowMakerError) -> grpc.Status:
    return rpc_status.to_status(to_status_proto(e))  # type: ignore[no-any-return]


def internal_status() -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(  # type: ignore[no-any-return]
        code=code_pb2.INTERNAL, message="internal error (logged on the server)",
        details=[_pack(error_details_pb2.ErrorInfo(reason=INTERNAL_REASON, domain=DOMAIN))]))


def status_from_rpc_error(e: grpc.RpcError) -> status_pb2.Status | None:
    """The rich google.rpc.Status in an RpcError's trailers, if the server sent one."""
    trailers: Any = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == STATUS_DETAILS_KEY:
            st = status_pb2.Status()
            st.ParseFromString(value if isinstance(value, bytes) else value.encode())
            return st
    return None


def error_info(e: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    st = status_from_rpc_error(e)
    for d in st.details if st else ():
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            return info
    return None


def field_violations(e: grpc.RpcError) -> list[error_details_pb2.BadRequest.FieldViolation]:
    st = status_from_rpc_error(e)
    out: list[error_details_pb2.BadRequest.FieldViolation] = []
    for d in st.details if st else ():
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            d.Unpack(br)
            out += list(br.field_violations)
    return out


def from_rpc_error(e: grpc.RpcError) -> FlowMakerError:
    """The typed FlowMakerError for a failed call (the inverse of the server-side map).

    Codes without a FlowMaker type (UNIMPLEMENTED, INTERNAL, CANCELLED...) give a plain
    FlowMakerError whose reason is the ErrorInfo reason or the code's name. A connection
    failure (UNAVAILABLE with no details) is Unavailable; a client-side deadline is
    DeadlineExceeded."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    message = (e.details() if hasattr(e, "details") else None) or code.name
    info = error_info(e)
    violations = field_violations(e)
    field = violations[0].field if violations else (info.metadata.get("field") if info else None) or None
    if field and message.startswith(f"{field}: "):
        message = message[len(field) + 2:]  # str(FlowMakerError) prefixed it; don't repeat it
    metadata = dict(info.metadata) if info else {}
    metadata.pop("field", None)
    reason = info.reason if info and info.reason else None
    cls = _BY_CODE.get(code)
    if cls is None:
        return FlowMakerError(message, field=field, reason=reason or code.name, metadata=metadata)
    return cls(message, field=field, reason=reason, metadata=metadata)


async def call(awaitable: Awaitable[Any]) -> Any:
    """Await one client call, re-raising a gRPC failure as its typed FlowMakerError."""
    try:
        return await awaitable
    except grpc.aio.AioRpcError as e:
        raise from_rpc_error(e) from e


# ---- server side ---------------------------------------------------------------------------

async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, FlowMakerError):
        log.info("%s -> %s %s: %s", method, code_of(exc).name, exc.reason, truncate(str(exc), MAX_MESSAGE_CHARS))
        await context.abort_with_status(to_grpc_status(exc))  # type: ignore[attr-defined]
    if isinstance(exc, NotImplementedError):  # what generated base servicers raise for a missing method
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented")
    log.error("%s failed with an unexpected error", method, exc_info=exc)
    await context.abort_with_status(internal_status())  # type: ignore[attr-defined]


def _set_deadline(context: grpc.aio.ServicerContext) -> contextvars.Token[float | None]:
    remaining = context.time_remaining()
    return incoming_deadline.set(None if remaining is None else time.monotonic() + remaining)


class Undecodable:
    """What the request deserializer returns for bytes that are not a valid message, so the
    handler wrapper can answer INVALID_ARGUMENT (grpc itself would answer UNKNOWN)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, bad UTF-8, RecursionError on absurd nesting
            return Undecodable(f"{type(e).__name__}: {e}")
    return parse


# Requests larger than this (serialized bytes) are validated off the event loop (flowmaker.cancel.offload);
# smaller ones are checked in place, where a thread hop would cost more than the walk.
OFFLOAD_CHECK_BYTES = 32_768


def _check_request(request: Any) -> None:
    """The edge checks, before any handler code: decodable, then valid (flowmaker.rpc.validate)."""
    if isinstance(request, Undecodable):
        raise InvalidSpec(f"the request is not a valid protobuf message ({truncate(request.error, 200)})",
                          field="(request)", reason="UNDECODABLE_REQUEST")
    if isinstance(request, Message):
        validate_request(request)


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for per-caller limits: the TLS client certificate's name, else a digest of
    the bearer token, else the peer's address without its port."""
    try:
        auth: Any = context.auth_context() or {}
    except Exception:
        auth = {}
    cn = list(auth.get("x509_common_name") or ())
    if cn:
        return "cert:" + cn[0].decode(errors="replace")
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return "token:" + hashlib.sha256(value.encode()).hexdigest()[:16]
    peer = context.peer() or ""
    return "peer:" + peer.rsplit(":", 1)[0]


class CallerLimiter:
    """At most `limit` RPCs run at once per caller on one server; the caller's next ones wait their turn
    (within their deadline), so a burst from one caller never takes the slots of the others. A caller
    with `queue` more already waiting is answered RESOURCE_EXHAUSTED (reason TOO_MANY_REQUESTS) at once."""

    def __init__(self, limit: int = LIMITS.concurrent_calls_per_caller, queue: int | None = None) -> None:
        self.limit = limit
        self.queue = 16 * limit if queue is None else queue
        self.in_flight: dict[str, int] = {}  # running + waiting, per caller
        self._slots: dict[str, asyncio.Semaphore] = {}

    async def enter(self, caller: str) -> None:
        n = self.in_flight.get(caller, 0)
        if n >= self.limit + self.queue:
            raise NoCapacity(f"too many concurrent requests from this caller: {self.limit} run at once and "
                             f"{self.queue} may wait (limit concurrent_calls_per_caller)", reason="TOO_MANY_REQUESTS",
                             metadata={"limit": "concurrent_calls_per_caller", "max": str(self.limit)})
        self.in_flight[caller] = n + 1
        sem = self._slots.setdefault(caller, asyncio.Semaphore(self.limit))
        try:
            left = _cancel.remaining_s()
            if left is None:
                await sem.acquire()
            else:
                await _cancel.wait_for(sem.acquire(), max(left, 0.0))
        except BaseException as e:
            self._forget(caller)
            if isinstance(e, TimeoutError):
                raise DeadlineExceeded(f"still waiting behind this caller's other {self.limit} requests at the "
                                       "deadline (limit concurrent_calls_per_caller)",
                                       reason="TOO_MANY_REQUESTS") from None
            raise

    def exit(self, caller: str) -> None:
        sem = self._slots.get(caller)
        if sem is not None:
            sem.release()
        self._forget(caller)

    def _forget(self, caller: str) -> None:
        n = self.in_flight.get(caller, 1) - 1
        if n <= 0:
            self.in_flight.pop(caller, None)
            self._slots.pop(caller, None)
        else:
            self.in_flight[caller] = n


_UNLIMITED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


@dataclass
class _Edge:
    """What runs before a handler, in order: authentication (the service's AuthPolicy), decoding and
    validation of the request, the per-caller concurrency limit."""

    method: str
    limiter: CallerLimiter | None
    auth: AuthPolicy | None
    check: bool = True

    async def enter(self, request: Any, context: grpc.aio.ServicerContext) -> tuple[str | None, Any]:
        """(caller counted by the limiter, token of the principal binding) - give both to exit()."""
        principal = self.auth.authenticate(context, self.method) if self.auth is not None else ANONYMOUS_ADMIN
        ptoken = current_principal.set(principal)
        try:
            if self.check:
                if isinstance(request, Message) and request.ByteSize() > OFFLOAD_CHECK_BYTES:
                    # A big request (a maximal DAG, a long profile list) is validated in a worker, bounded by
                    # the caller's deadline: health checks and other callers keep being answered meanwhile.
                    await _cancel.offload(_check_request, request)
                else:
                    _check_request(request)
            caller = None
            if self.limiter is not None:
                c = f"principal:{principal.name}" if principal.name else caller_of(context)
                await self.limiter.enter(c)
                caller = c
        except BaseException:
            current_principal.reset(ptoken)
            raise
        return caller, ptoken

    def exit(self, state: tuple[str | None, Any] | None) -> None:
        if state is None:
            return
        caller, ptoken = state
        if caller is not None and self.limiter is not None:
            self.limiter.exit(caller)
        _reset(current_principal, ptoken)


def _reset(var: Any, token: Any) -> None:
    """Reset a context variable, unless this runs in another context than the one that set it: a stream
    abandoned by its client is finalized by the event loop's async-generator hook, in a task of its own."""
    try:
        var.reset(token)
    except ValueError:
        pass


def _wrap_unary(behavior: Callable[..., Any], edge: _Edge) -> Callable[..., Any]:
    async def wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        token = _set_deadline(context)
        state = None
        try:
            state = await edge.enter(request_or_iterator, context)
            result = behavior(request_or_iterator, context)
            return (await result) if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:
            raise  # the servicer aborted on purpose; its status stands
        except Exception as e:
            await _abort(context, e, edge.method)
        finally:
            edge.exit(state)
            incoming_deadline.reset(token)
    return wrapper


def _wrap_stream(behavior: Callable[..., Any], edge: _Edge) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def gen_wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            token = _set_deadline(context)
            state = None
            agen = None
            try:
                state = await edge.enter(request_or_iterator, context)
                agen = behavior(request_or_iterator, context)
                async for item in agen:
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _abort(context, e, edge.method)
            finally:
                if agen is not None:
                    # A client that went away: the handler's own cleanup (cancelling its engine calls) runs
                    # now, not whenever the garbage collector gets to the generator.
                    await agen.aclose()
                edge.exit(state)
                _reset(incoming_deadline, token)
        return gen_wrapper
    # A coroutine handler that writes with context.write() (or a sync iterator): same as unary.
    return _wrap_unary(behavior, edge)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The one server interceptor of every service: undecodable or invalid requests become
    INVALID_ARGUMENT before the handler runs, per-caller concurrency is bounded, and the error map
    applies to every RPC (unary and streaming alike). With an `auth` policy, every call is
    authenticated first (UNAUTHENTICATED / PERMISSION_DENIED) and its principal bound to
    `flowmaker.rpc.auth.current_principal` for the handler."""

    def __init__(self, max_calls_per_caller: int = LIMITS.concurrent_calls_per_caller, *,
                 auth: AuthPolicy | None = None) -> None:
        self.limiter = CallerLimiter(max_calls_per_caller) if max_calls_per_caller > 0 else None
        self.auth = auth

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        limiter = None if method.startswith(_UNLIMITED_PREFIXES) else self.limiter
        edge = _Edge(method, limiter, self.auth)
        deser = _safe_deserializer(handler.request_deserializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, edge),
                                                       deser, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, edge),
                                                        deser, handler.response_serializer)
        # Client streaming: the request is an iterator; its messages are the handler's to check.
        raw = _Edge(method, limiter, self.auth, check=False)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, raw),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, raw),
                                                         handler.request_deserializer, handler.response_serializer)
        return handler
