"""`python -m services.selector`: run the selector service until SIGTERM."""

from __future__ import annotations

from flowmaker import telemetry
from flowmaker.rpc.server import RunningServer, run, serve
from flowmaker.state import connect
from flowmaker.state.etcd import EtcdStore
from services.selector.servicer import add_servicers
from services.selector.settings import SelectorSettings


async def main() -> None:
    settings = SelectorSettings()
    telemetry.configure_logging(settings.log_level)
    telemetry.setup_tracing("flowmaker-selector")
    store = connect(settings.etcd_endpoint_list, namespace=settings.etcd_namespace,
                    timeout_s=settings.etcd_timeout_s) if settings.live_state else None

    async def ready(running: RunningServer) -> None:
        if isinstance(store, EtcdStore):
            await store.ping()  # SERVING only once etcd answers

    async def close() -> None:
        if store is not None:
            await store.close()
        telemetry.shutdown_tracing()

    await serve("selector", lambda server: add_servicers(server, settings, store), settings, on_ready=ready,
                on_shutdown=[close], interceptors=telemetry.server_interceptors())


if __name__ == "__main__":
    run(main())
