"""`python -m services.profiler`: run the profiler service until SIGTERM."""

from __future__ import annotations

from flowmaker import telemetry
from flowmaker.rpc.channels import configure_client_tls
from flowmaker.rpc.server import run, serve
from flowmaker.state import connect
from services.profiler.app import build
from services.profiler.servicer import add_servicers
from services.profiler.settings import ProfilerSettings


async def main() -> None:
    settings = ProfilerSettings()
    configure_client_tls(settings)  # every channel opened below presents this service's certificate
    telemetry.configure_logging(settings.log_level)
    telemetry.setup_tracing("flowmaker-profiler")
    store = connect(settings.etcd_endpoints, namespace=settings.etcd_namespace, timeout_s=settings.etcd_timeout_s)
    app = build(settings, store)

    async def close() -> None:
        await app.close()
        await store.close()
        telemetry.shutdown_tracing()

    await serve("profiler", lambda server: add_servicers(server, app.servicer), settings, on_ready=app.start,
                on_shutdown=[close], interceptors=telemetry.server_interceptors())


if __name__ == "__main__":
    run(main())
