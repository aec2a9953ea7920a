"""`python -m services.deployer`: the node agent as a gRPC service (settings from FLOWMAKER_DEPLOYER_*)."""

from __future__ import annotations

from flowmaker.rpc.server import run, serve
from flowmaker.state import connect
from services.deployer.node import NodeAgent
from services.deployer.servicer import service_hooks
from services.deployer.settings import DeployerSettings

SERVICE = "deployer"


async def main(settings: DeployerSettings | None = None) -> None:
    s = settings or DeployerSettings()
    try:
        from flowmaker.telemetry import configure_logging

        configure_logging(s.log_level)
    except ImportError:  # telemetry is optional for running the agent
        import logging

        logging.basicConfig(level=s.log_level)
    store = connect(s.etcd_endpoint_list, namespace=s.etcd_namespace, timeout_s=s.etcd_timeout_s)
    agent = NodeAgent(store, s)

    add, ready = service_hooks(agent, s.advertise_address_host)
    await serve(SERVICE, add, s, on_ready=ready, on_shutdown=[agent.shutdown, store.close])


if __name__ == "__main__":
    run(main())
