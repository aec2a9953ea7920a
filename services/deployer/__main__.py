"""`python -m services.deployer`: the node agent as a gRPC service (settings from FLOWMAKER_DEPLOYER_*).

Like the other four services it exports traces (OTEL_* settings, `flowmaker.telemetry`): a SERVER span per
RPC that continues the caller's trace, so a DeployTask's trace goes on into the deployer. With
`FLOWMAKER_DEPLOYER_METRICS_PORT` it also publishes its instances' planned and observed load, headroom and
engine queue as Prometheus gauges (`flowmaker.metrics`), refreshed every `load_scrape_interval_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from flowmaker import metrics, telemetry
from flowmaker.rpc.server import RunningServer, run, serve
from flowmaker.state import connect
from services.deployer.node import NodeAgent
from services.deployer.servicer import service_hooks
from services.deployer.settings import DeployerSettings

SERVICE = "deployer"
log = logging.getLogger(__name__)


def _queue_of(queues: dict[str, tuple[float, float]], r: Any) -> tuple[float, float] | None:
    return queues.get(r.id)


async def publish_instance_metrics(agent: NodeAgent, interval_s: float) -> None:
    """Forever: this node's instances -> the instance gauges (capacity from their profiles, queue from the
    engines' /metrics). Best effort: a failed round is logged at debug and retried."""
    capacity: dict[tuple[str, int, int], float] = {}
    while True:
        try:
            mine = [rec for rec, _tasks, _alive in await agent.list_instances() if rec.node == agent.node]
            for r in mine:
                k = (r.model_id, r.tp, r.pp)
                if k not in capacity:
                    capacity[k] = (await agent.profile_for(*k)).max_output_tokens_per_s
            queues: dict[str, tuple[float, float]] = {}
            for r in mine:
                proc = agent.procs.get(r.id)
                if proc is not None and proc.is_alive:
                    with contextlib.suppress(Exception):
                        m = await proc.scrape_metrics(timeout_s=min(2.0, interval_s))
                        queues[r.id] = (m.get("running", 0.0), m.get("waiting", 0.0))
            metrics.set_instance_load(mine, capacity=lambda r: capacity.get((r.model_id, r.tp, r.pp)),
                                      queue=functools.partial(_queue_of, queues))
        except Exception as e:
            log.debug("instance metrics not refreshed: %s", e)
        await asyncio.sleep(interval_s)


async def main(settings: DeployerSettings | None = None) -> None:
    s = settings or DeployerSettings()
    telemetry.configure_logging(s.log_level)
    telemetry.setup_tracing("flowmaker-deployer")
    store = connect(s.etcd_endpoint_list, namespace=s.etcd_namespace, timeout_s=s.etcd_timeout_s)
    agent = NodeAgent(store, s)
    add, agent_ready = service_hooks(agent, s.advertise_address_host)
    background: list[asyncio.Task[None]] = []

    async def ready(running: RunningServer) -> None:
        await agent_ready(running)
        if s.metrics_port >= 0:
            background.append(asyncio.create_task(publish_instance_metrics(agent, max(1.0, s.load_scrape_interval_s))))

    async def close() -> None:
        for t in background:
            t.cancel()
        telemetry.shutdown_tracing()

    await serve(SERVICE, add, s, on_ready=ready, on_shutdown=[close, agent.shutdown, store.close],
                interceptors=telemetry.server_interceptors())


if __name__ == "__main__":
    run(main())
