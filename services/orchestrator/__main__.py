"""`python -m services.orchestrator`: run the orchestrator service until SIGTERM."""

from __future__ import annotations

from flowmaker import telemetry
from flowmaker.rpc.channels import configure_client_tls
from flowmaker.rpc.server import RunningServer, run, serve
from flowmaker.state import connect
from flowmaker.state.etcd import EtcdStore
from services.orchestrator.clients import Clients
from services.orchestrator.orchestrator import Orchestrator
from services.orchestrator.servicer import add_servicers
from services.orchestrator.settings import OrchestratorSettings


async def main() -> None:
    settings = OrchestratorSettings()
    configure_client_tls(settings)  # every channel opened below presents this service's certificate
    telemetry.configure_logging(settings.log_level)
    telemetry.setup_tracing("flowmaker-orchestrator")
    store = connect(settings.etcd_endpoint_list, namespace=settings.etcd_namespace, timeout_s=settings.etcd_timeout_s)
    clients = Clients(settings.selector_address, settings.generator_address, timeout_s=settings.call_timeout_s,
                      profiler_address=settings.profiler_address,
                      deployer_tls_server_name=settings.deployer_tls_server_name)
    orch = Orchestrator(settings, store, clients)

    async def ready(running: RunningServer) -> None:
        if isinstance(store, EtcdStore):
            await store.ping()
        orch.set_address(running.address)  # what the leader key shows (when no advertise_address is set)
        await orch.resume()

    async def close() -> None:
        await orch.close()
        await clients.close()
        await store.close()
        telemetry.shutdown_tracing()

    await serve("orchestrator", lambda server: add_servicers(server, orch), settings, on_ready=ready,
                on_shutdown=[close], interceptors=telemetry.server_interceptors())


if __name__ == "__main__":
    run(main())
