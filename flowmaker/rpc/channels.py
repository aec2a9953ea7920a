"""Outgoing gRPC channels: every call gets a deadline (a default, capped by the deadline of the RPC being served)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from flowmaker.errors import DeadlineExceeded
from flowmaker.rpc.errors import incoming_deadline
from flowmaker.telemetry import client_interceptors

DEFAULT_TIMEOUT_S = 30.0


def deadline_s(timeout_s: float | None = None, *, default_s: float = DEFAULT_TIMEOUT_S) -> float:
    """The timeout to give an outgoing call: `timeout_s` (or the default), never beyond what is
    left of the incoming RPC's deadline. DeadlineExceeded when nothing is left."""
    t = default_s if timeout_s is None else timeout_s
    dl = incoming_deadline.get()
    if dl is not None:
        left = dl - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the deadline of the request being served has passed")
        t = min(t, left)
    return t


class _DeadlineInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
                           grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    """Fills in (or caps) the timeout of every call made on the channel."""

    def __init__(self, default_s: float) -> None:
        self.default_s = default_s

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        timeout = deadline_s(d.timeout, default_s=self.default_s)
        return grpc.aio.ClientCallDetails(d.method, timeout, d.metadata, d.credentials, d.wait_for_ready)

    async def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation: Callable[..., Any], client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)

    async def intercept_stream_unary(self, continuation: Callable[..., Any], client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(self, continuation: Callable[..., Any], client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def insecure_channel(target: str, *, default_timeout_s: float = DEFAULT_TIMEOUT_S,
                     interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
                     options: Sequence[tuple[str, Any]] = (), tracing: bool = True) -> grpc.aio.Channel:
    """An aio channel to `target` ("host:port") whose calls always carry a deadline.
    `interceptors` run outside the deadline interceptor. With `tracing` (default), OpenTelemetry's
    client interceptors come first: every call is a CLIENT span and carries the trace context."""
    otel = client_interceptors() if tracing else []
    return grpc.aio.insecure_channel(
        target, options=list(options),
        interceptors=[*otel, *interceptors, _DeadlineInterceptor(default_timeout_s)])  # type: ignore[list-item]
