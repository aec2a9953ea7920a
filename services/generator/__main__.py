"""`python -m services.generator`: run the generator service until SIGTERM."""

from __future__ import annotations

import asyncio

from flowmaker import telemetry
from flowmaker.generator import make_generator
from flowmaker.rpc.server import serve
from services.generator.servicer import add_servicers
from services.generator.settings import GeneratorServiceSettings


async def main() -> None:
    settings = GeneratorServiceSettings()  # type: ignore[call-arg]  # ServiceSettings uses Field(<positional default>)
    telemetry.configure_logging(settings.log_level)
    telemetry.setup_tracing("flowmaker-generator")
    generator = make_generator(settings)

    async def close() -> None:
        await generator.close()
        telemetry.shutdown_tracing()

    await serve("generator", lambda server: add_servicers(server, generator, settings.max_candidates), settings,
                on_shutdown=[close], interceptors=telemetry.server_interceptors())


if __name__ == "__main__":
    asyncio.run(main())
