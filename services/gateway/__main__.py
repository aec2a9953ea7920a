"""`python -m services.gateway`: the OpenAI-compatible HTTP front door until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

from aiohttp import web

from flowmaker import telemetry
from flowmaker.rpc.server import run
from services.gateway.app import Gateway
from services.gateway.settings import GatewaySettings


async def main() -> None:
    s = GatewaySettings()
    telemetry.configure_logging(s.log_level)
    telemetry.setup_tracing("flowmaker-gateway")
    s.log_effective()
    gw = Gateway(s.orchestrator_address, timeout_s=s.call_timeout_s, ca_file=s.tls_ca_file,
                 header_timeout_s=s.header_timeout_s, body_timeout_s=s.body_timeout_s, route_ttl_s=s.route_ttl_s)
    # Gateway.runner: the header and body timeouts, and a client that disconnects cancels its request (and
    # with it the orchestrator call).
    runner = gw.runner(shutdown_timeout=s.grace_s)
    await runner.setup()
    site = web.TCPSite(runner, s.host, s.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1] if site._server else s.port  # type: ignore[union-attr,attr-defined]
    # The same machine-readable line as the gRPC services (flowmaker.rpc.server.serve), plus the base URL.
    print("FLOWMAKER_READY " + json.dumps({"service": "gateway", "address": f"{s.host}:{port}",
                                           "url": f"http://{s.host}:{port}/v1"}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await gw.close()
        telemetry.shutdown_tracing()


if __name__ == "__main__":
    run(main())
