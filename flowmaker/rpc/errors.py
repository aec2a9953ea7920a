"""THE error map: FlowMaker exceptions <-> gRPC status codes with google.rpc.ErrorInfo (and BadRequest).

Server side, `ErrorInterceptor` turns any `FlowMakerError` a servicer raises into
`context.abort_with_status(...)` with the bound code, an `ErrorInfo(reason, domain="flowmaker.io",
metadata)` and, when the error names a field, a `BadRequest.FieldViolation`. Anything else becomes
INTERNAL with a generic message; its traceback is logged, never sent.

Client side, `from_rpc_error(e)` rebuilds the typed exception, so a service calling another one
handles `NoCapacity`, `Conflict`... exactly as if the call had been local.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from flowmaker.errors import (
    AlreadyExists,
    Conflict,
    DeadlineExceeded,
    FailedPrecondition,
    FlowMakerError,
    InvalidSpec,
    NoCapacity,
    NotFound,
    Unavailable,
)

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
)
_BY_CODE: dict[grpc.StatusCode, type[FlowMakerError]] = {code: cls for cls, code in CODES}

INTERNAL_REASON = "INTERNAL"

# Absolute deadline (time.monotonic()) of the RPC being served, so outgoing calls made while
# serving it never outlive it (see flowmaker.rpc.channels).
incoming_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("incoming_deadline", default=None)


def code_of(e: FlowMakerError) -> grpc.StatusCode:
    for cls, code in CODES:
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.UNKNOWN  # a bare FlowMakerError: expected, but of no known kind


def to_status_proto(e: FlowMakerError) -> status_pb2.Status:
    """The google.rpc.Status a FlowMakerError is sent as."""
    code = code_of(e)
    metadata = {str(k): str(v) for k, v in e.metadata.items()}
    if e.field:
        metadata.setdefault("field", e.field)
    details = [_pack(error_details_pb2.ErrorInfo(reason=e.reason, domain=DOMAIN, metadata=metadata))]
    if e.field:
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=e.field, description=e.message)])))
    return status_pb2.Status(code=code.value[0], message=str(e), details=details)


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
        log.info("%s -> %s %s: %s", method, code_of(exc).name, exc.reason, exc)
        await context.abort_with_status(to_grpc_status(exc))  # type: ignore[attr-defined]
    if isinstance(exc, NotImplementedError):  # what generated base servicers raise for a missing method
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented")
    log.error("%s failed with an unexpected error", method, exc_info=exc)
    await context.abort_with_status(internal_status())  # type: ignore[attr-defined]


def _set_deadline(context: grpc.aio.ServicerContext) -> contextvars.Token[float | None]:
    remaining = context.time_remaining()
    return incoming_deadline.set(None if remaining is None else time.monotonic() + remaining)


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        token = _set_deadline(context)
        try:
            result = behavior(request_or_iterator, context)
            return (await result) if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:
            raise  # the servicer aborted on purpose; its status stands
        except Exception as e:
            await _abort(context, e, method)
        finally:
            incoming_deadline.reset(token)
    return wrapper


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def gen_wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            token = _set_deadline(context)
            try:
                async for item in behavior(request_or_iterator, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _abort(context, e, method)
            finally:
                incoming_deadline.reset(token)
        return gen_wrapper
    # A coroutine handler that writes with context.write() (or a sync iterator): same as unary.
    return _wrap_unary(behavior, method)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Applies the error map to every RPC of the server (unary and streaming alike)."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, method),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, method),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, method),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, method),
                                                         handler.request_deserializer, handler.response_serializer)
        return handler
