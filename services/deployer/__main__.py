"""`python -m services.deployer`: the node agent as a gRPC service (settings from FLOWMAKER_DEPLOYER_*)."""

from __future__ import annotations

import grpc.aio

from flowmaker.rpc.server import RunningServer, run, serve
from flowmaker.state import connect
from services.deployer.node import NodeAgent
from services.deployer.servicer import SERVICE_NAME, DeployerServicer
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

    def add(server: grpc.aio.Server) -> list[str]:
        from flowmaker.api.deployer.v1 import deployer_pb2_grpc

        deployer_pb2_grpc.add_DeployerServiceServicer_to_server(DeployerServicer(agent), server)
        return [SERVICE_NAME]

    async def ready(running: RunningServer) -> None:
        # The node record carries this deployer's address; with port 0 it is known only once bound.
        agent.endpoint = f"{s.advertise_address_host}:{running.port}"
        await agent.start()

    await serve(SERVICE, add, s, on_ready=ready, on_shutdown=[agent.shutdown, store.close])


if __name__ == "__main__":
    run(main())
