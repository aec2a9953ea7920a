"""Outgoing gRPC channels: every call gets a deadline (a default, capped by the deadline of the RPC being served),
and every channel presents the process's mTLS identity once one is configured. A target that lists several
addresses ("host:port,host:port": the orchestrator's replicas) is balanced round robin, with idempotent calls
retried on another replica when one answers UNAVAILABLE (it died, or is stopping)."""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from flowmaker.errors import DeadlineExceeded
from flowmaker.rpc.errors import incoming_deadline
from flowmaker.rpc.tls import TlsFiles, channel_credentials

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


# Calls that are safe to send again when the replica that took them went away: reads, Invoke (an engine call has
# no side effect), and DeleteTask (deleting a DELETING task waits for the same delete). DeployTask (a new task
# each time) and ApproveWorkflows (a second approval is refused) are not retried.
_RETRYABLE = {"flowmaker.orchestrator.v1.OrchestratorService": ("GetTask", "ListTasks", "Invoke", "InvokeStream",
                                                               "DeleteTask")}
RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "1s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}


def service_config(*, balanced: bool) -> str:
    """The gRPC service config of a channel: the retry policy of the idempotent calls, and round robin over
    every address the target resolves to when `balanced`."""
    cfg: dict[str, Any] = {"methodConfig": [{
        "name": [{"service": svc, "method": m} for svc, methods in _RETRYABLE.items() for m in methods],
        "retryPolicy": RETRY_POLICY}]}
    if balanced:
        cfg["loadBalancingConfig"] = [{"round_robin": {}}]
    return json.dumps(cfg)


def split_addresses(target: str) -> list[str]:
    """The addresses of a target: "a:1,b:2" -> ["a:1", "b:2"] (one for a plain target)."""
    return [a.strip() for a in target.split(",") if a.strip()]


def target_options(target: str, *, secure: bool, tls_server_name: str = "") -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target and channel options for `target` ("host:port", or several comma-separated): the service
    config (round robin over a list or a DNS name, the retry policy) and, with TLS (`secure`), the name the
    servers' certificates are checked against (`tls_server_name`, else a list's first host). For sync channels
    too (grpc.secure_channel / insecure_channel take the same)."""
    options: list[tuple[str, Any]] = []
    addresses = split_addresses(target)
    if len(addresses) > 1:
        target = _multi_target(addresses)
        options.append(("grpc.default_authority", addresses[0]))
        if secure and not tls_server_name:
            tls_server_name = addresses[0].rpartition(":")[0].strip("[]")
    options.append(("grpc.service_config", service_config(balanced=len(addresses) > 1 or _named(target))))
    if secure and tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return target, options


def _named(target: str) -> bool:
    """Whether `target` is a DNS name (which may list several servers: a headless Service) rather than one IP.
    Round robin uses only the addresses it can connect to, so a name that also resolves to an unused IPv6
    loopback costs nothing."""
    if target.startswith("dns:"):
        return True
    if ":" not in target or target.startswith(("ipv4:", "ipv6:", "unix:", "[")):
        return False
    try:
        ipaddress.ip_address(target.rpartition(":")[0])
    except ValueError:
        return True
    return False


def _multi_target(addresses: Sequence[str]) -> str:
    """One gRPC target for several host:port addresses: the static `ipv4:`/`ipv6:` resolver over their IPs
    (host names resolved once, here; gRPC has no static resolver for names)."""
    v4: list[str] = []
    v6: list[str] = []
    for a in addresses:
        host, _, port = a.rpartition(":")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0])
        (v4 if ip.version == 4 else v6).append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    if v4 and v6:
        raise ValueError(f"mixed IPv4 and IPv6 addresses in one target: {', '.join(addresses)}")
    return ("ipv4:" + ",".join(v4)) if v4 else ("ipv6:" + ",".join(v6))


class _CallDetails:
    """Fills in (or caps) the timeout of a call made on the channel, and adds `metadata` (the bearer token) to it.
    The token travels as plain call metadata rather than as gRPC call credentials: those run a Python metadata
    plugin from gRPC's own threads, and closing a channel that holds one can deadlock on the GIL (grpc/grpc#42247),
    the kind of freeze that pytest-timeout cannot break."""

    def __init__(self, default_s: float, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.default_s = default_s
        self.metadata = tuple(metadata)

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        timeout = deadline_s(d.timeout, default_s=self.default_s)
        md = d.metadata
        if self.metadata:
            md = grpc.aio.Metadata(*(tuple(md) if md is not None else ()), *self.metadata)
        return grpc.aio.ClientCallDetails(d.method, timeout, md, d.credentials, d.wait_for_ready)


# One class per kind of call: grpc.aio files an interceptor under the first kind it is an instance of, so a
# class that implements all four intercepts unary-unary calls only.
class _UnaryUnary(_CallDetails, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_CallDetails, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_CallDetails, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Any], client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_CallDetails, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Any], client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def call_interceptors(default_s: float, metadata: Sequence[tuple[str, str]] = ()) -> list[Any]:
    """The deadline (and token) interceptors of a channel, one for each kind of call."""
    return [k(default_s, metadata) for k in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


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
    certificate names it `deployer`. `target` may list several addresses ("a:1,b:2"): calls are balanced round
    robin over them (and the idempotent ones retried on UNAVAILABLE); with TLS each server's certificate is
    checked against the first address's host unless `tls_server_name` says otherwise."""
    otel: list[Any] = []
    if tracing:
        # Imported here: the OpenTelemetry SDK is only loaded by a process that traces (the CLI starts faster).
        from flowmaker.telemetry import client_interceptors

        otel = client_interceptors()
    files = _client_tls if tls is True else (tls or None)
    # Like gRPC's call credentials, the token is only ever sent over TLS.
    bearer = [("authorization", f"Bearer {token}")] if token and files is not None else []
    chain = [*otel, *interceptors, *call_interceptors(default_timeout_s, bearer)]
    target, extra = target_options(target, secure=files is not None, tls_server_name=tls_server_name)
    options = [*options, *extra]
    if files is not None:
        creds = channel_credentials(files)
        return grpc.aio.secure_channel(target, creds, options=list(options), interceptors=chain)  # type: ignore[arg-type]
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=chain)  # type: ignore[arg-type]


def insecure_channel(target: str, *, default_timeout_s: float = DEFAULT_TIMEOUT_S,
                     interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
                     options: Sequence[tuple[str, Any]] = (), tracing: bool = True,
                     tls_server_name: str = "") -> grpc.aio.Channel:
    """Kept for its callers: `channel()`, which is TLS once the process has an identity configured."""
    return channel(target, default_timeout_s=default_timeout_s, interceptors=interceptors, options=options,
                   tracing=tracing, tls_server_name=tls_server_name)
