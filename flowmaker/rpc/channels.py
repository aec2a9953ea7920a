"""Outgoing gRPC channels: every call gets a deadline (a default, capped by the deadline of the RPC being served),
and every channel presents the process's mTLS identity once one is configured."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from flowmaker.errors import DeadlineExceeded
from flowmaker.rpc.errors import incoming_deadline
from flowmaker.rpc.tls import TlsFiles, channel_credentials
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


# The identity this process presents on every channel it opens (mTLS), set once at start from the
# service's settings (`configure_client_tls`); None = plaintext channels.
_client_tls: TlsFiles | None = None


def configure_client_tls(settings: Any) -> None:
    """Use the service's TLS files (ServiceSettings.tls_*) for every channel opened from now on."""
    global _client_tls
    _client_tls = (TlsFiles(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
                   if getattr(settings, "tls_enabled", False) else None)


def channel(target: str, *, default_timeout_s: float = DEFAULT_TIMEOUT_S,
            interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
            options: Sequence[tuple[str, Any]] = (), tracing: bool = True,
            tls: TlsFiles | bool | None = True, token: str = "", tls_server_name: str = "") -> grpc.aio.Channel:
    """An aio channel to `target` ("host:port") whose calls always carry a deadline.
    `interceptors` run outside the deadline interceptor. With `tracing` (default), OpenTelemetry's
    client interceptors come first: every call is a CLIENT span and carries the trace context.
    `tls`: True = the process's identity (configure_client_tls; plaintext when none is configured),
    explicit TlsFiles, or False/None = plaintext. `token`: sent as `authorization: Bearer <token>` on
    every call (TLS only: gRPC never sends call credentials in the clear). `tls_server_name`: the name the
    server's certificate must carry, instead of the host of `target` (TLS only): for a peer dialled by an
    address its certificate cannot list in advance, e.g. a Kubernetes deployer at its pod IP, whose
    certificate names it `deployer`."""
    otel = client_interceptors() if tracing else []
    chain = [*otel, *interceptors, _DeadlineInterceptor(default_timeout_s)]
    files = _client_tls if tls is True else (tls or None)
    if files is not None:
        if tls_server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls_server_name)]
        creds = channel_credentials(files)
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        return grpc.aio.secure_channel(target, creds, options=list(options), interceptors=chain)  # type: ignore[arg-type]
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=chain)  # type: ignore[arg-type]


def insecure_channel(target: str, *, default_timeout_s: float = DEFAULT_TIMEOUT_S,
                     interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
                     options: Sequence[tuple[str, Any]] = (), tracing: bool = True,
                     tls_server_name: str = "") -> grpc.aio.Channel:
    """Kept for its callers: `channel()`, which is TLS once the process has an identity configured."""
    return channel(target, default_timeout_s=default_timeout_s, interceptors=interceptors, options=options,
                   tracing=tracing, tls_server_name=tls_server_name)
