"""The one gRPC server bootstrap of all five services: error map, health, reflection, graceful shutdown.

Lifecycle (`serve`):
1. bind `settings.host:settings.port` (port 0 = any free port; the bound port is logged and
   printed as `FLOWMAKER_READY {"service": ..., "address": ...}` on stdout once serving; with
   `settings.metrics_port` >= 0, Prometheus `/metrics` is served there too and the line has `"metrics"`);
2. health reports NOT_SERVING while `on_ready(running)` connects dependencies (etcd, channels,
   node registration); SERVING only after it returns;
3. SIGTERM / SIGINT -> health NOT_SERVING for everyone (load balancers stop routing) ->
   `server.stop(grace)` lets in-flight RPCs finish -> `on_shutdown` hooks run in order
   (e.g. stop engines, revoke the etcd lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from flowmaker.metrics import MetricsInterceptor, serve_metrics
from flowmaker.rpc.auth import AuthPolicy, bind_policy, load_tokens, policy_for
from flowmaker.rpc.errors import ErrorInterceptor
from flowmaker.rpc.tls import TlsFiles, server_credentials
from flowmaker.settings import ServiceSettings

log = logging.getLogger(__name__)

AddServicers = Callable[[grpc.aio.Server], Sequence[str]]
Hook = Callable[[], Awaitable[None]]
ReadyHook = Callable[["RunningServer"], Awaitable[None]]  # gets the bound server (its port, for registration)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


@dataclass
class RunningServer:
    """A started server: its bound address, health servicer and shutdown hooks."""

    name: str
    server: grpc.aio.Server
    health: HealthServicer
    host: str
    port: int
    services: tuple[str, ...]
    on_shutdown: list[Hook] = field(default_factory=list)
    grace_s: float = 5.0
    _stopped: bool = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        st = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for s in ("", *self.services):
            await self.health.set(s, st)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, drain in-flight RPCs for `grace_s`, then the shutdown hooks."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.grace_s if grace_s is None else grace_s
        log.info("%s stopping (grace %.1fs)", self.name, grace)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for hook in self.on_shutdown:
            try:
                await hook()
            except Exception:  # one failing hook must not keep the others (lease revoke) from running
                log.exception("%s shutdown hook %r failed", self.name, hook)
        log.info("%s stopped", self.name)


async def start_server(service_name: str, add_servicers: AddServicers, settings: ServiceSettings, *,
                       on_ready: ReadyHook | None = None, on_shutdown: Sequence[Hook] = (),
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                       auth: AuthPolicy | None = None) -> RunningServer:
    """Build, bind and start the server; SERVING once `on_ready(running)` has returned (it gets the
    RunningServer, so it can publish the bound address, e.g. in an etcd registration).

    `add_servicers(server)` registers the service's servicers and returns their full names
    (e.g. `["flowmaker.deployer.v1.DeployerService"]`) for health and reflection.
    `interceptors` (e.g. OpenTelemetry's) run outside the error interceptor, so they see the
    final status code.

    With `settings.tls_enabled` the listener is TLS only: every service but the orchestrator demands
    a client certificate of the suite's CA, and calls are authorized by `auth` (default: the suite's
    policy for `service_name`, flowmaker.rpc.auth.policy_for). Without TLS files it is plaintext with
    no authentication (local debugging), and says so in a warning.
    """
    creds = None
    if settings.tls_enabled:
        files = TlsFiles(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
        creds = server_credentials(files, require_client_cert=service_name != "orchestrator")
        if auth is None:
            auth = policy_for(service_name, load_tokens(settings.auth_tokens_file))
    elif auth is None and settings.auth_tokens_file:
        # Tokens without TLS (e.g. inside a Kubernetes namespace fenced by NetworkPolicies): callers are still
        # authenticated, but their tokens cross the network in the clear.
        log.warning("%s: bearer tokens over PLAINTEXT gRPC: set tls_* files to encrypt them", service_name)
        auth = AuthPolicy(identities=frozenset(), tokens=load_tokens(settings.auth_tokens_file))
    # Metrics outermost: they count the status the caller gets, whatever the inner interceptors did.
    server = grpc.aio.server(interceptors=[MetricsInterceptor(service_name), *interceptors, ErrorInterceptor(auth=auth)])
    if auth is not None:
        bind_policy(server, auth)  # the servicers may feed it (the orchestrator's live users)
    names = tuple(add_servicers(server))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((*names, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    if creds is not None:
        port = server.add_secure_port(f"{settings.host}:{settings.port}", creds)
    else:
        if settings.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("%s: PLAINTEXT and unauthenticated on %s (no TLS files): local debugging only",
                        service_name, settings.host)
        port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise OSError(f"{service_name}: cannot bind {settings.host}:{settings.port}")
    running = RunningServer(service_name, server, health, settings.host, port, names, list(on_shutdown),
                            settings.grace_s)
    await running.set_serving(False)
    await server.start()
    log.info("%s listening on %s (NOT_SERVING until ready)", service_name, running.address)
    if on_ready is not None:
        try:
            await on_ready(running)
        except BaseException:
            log.exception("%s: dependencies not ready; stopping", service_name)
            await running.stop(0)
            raise
    await running.set_serving(True)
    log.info("%s SERVING on %s: %s", service_name, running.address, ", ".join(names))
    return running


async def serve(service_name: str, add_servicers: AddServicers, settings: ServiceSettings, *,
                on_ready: ReadyHook | None = None, on_shutdown: Sequence[Hook] = (),
                interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                stop_event: asyncio.Event | None = None,
                on_started: Callable[[RunningServer], None] | None = None) -> None:
    """Run a service until SIGTERM/SIGINT (or `stop_event`), then shut it down gracefully.

    The process entry point of every service: `asyncio.run(serve("deployer", add, settings, ...))`.
    """
    settings.log_effective(service_name)
    if settings.etcd_tls:  # the store connects lazily, on the first call (on_ready at the earliest)
        from flowmaker.state.etcd import configure_etcd_tls

        configure_etcd_tls(TlsFiles(settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file))
    if settings.etcd_user:  # etcd auth: this service's own etcd user (flowmaker.state.etcd_auth)
        from flowmaker.state.etcd import EtcdCredentials, configure_etcd_auth

        configure_etcd_auth(EtcdCredentials.from_file(settings.etcd_user, settings.etcd_password_file))
    if settings.engine_key_secret_file:  # engine API keys are sealed in instance records (deployer, orchestrator)
        from flowmaker.state.records import configure_engine_key_sealing

        configure_engine_key_sealing(settings.engine_key_secret_file)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not main thread / Windows
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        running = await start_server(service_name, add_servicers, settings, on_ready=on_ready,
                                     on_shutdown=on_shutdown, interceptors=interceptors)
        # One machine-readable line, so a launcher using port 0 learns where the service is.
        ready: dict[str, str] = {"service": service_name, "address": running.address}
        if settings.metrics_port >= 0:
            ready["metrics"] = f"{settings.host}:{serve_metrics(settings.metrics_port, settings.host)}"
            log.info("%s metrics on http://%s/metrics", service_name, ready["metrics"])
        print("FLOWMAKER_READY " + json.dumps(ready), flush=True)
        if on_started is not None:
            on_started(running)
        # Not server.wait_for_termination(): cancelling that wait cancels grpc's own shutdown
        # future, and with it the graceful stop below.
        await stop.wait()
        await running.stop()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def run(main: Awaitable[None]) -> None:
    """`asyncio.run` for a service's `__main__`, exiting 0 on Ctrl-C and 1 on a startup failure."""
    try:
        asyncio.run(main)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pass
    except Exception as e:
        log.error("fatal: %s", e, exc_info=True)
        sys.exit(1)
