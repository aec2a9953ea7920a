"""Integration fixtures: gRPC services started in-process on port 0 through the shared bootstrap."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from flowmaker.rpc.server import AddServicers, RunningServer, start_server
from flowmaker.settings import ServiceSettings

StartService = Callable[..., Awaitable[RunningServer]]


@pytest.fixture
async def start_service() -> AsyncIterator[StartService]:
    """`await start_service(name, add_servicers, settings=None, **start_server_kwargs)` -> RunningServer
    bound to 127.0.0.1:0; every server started is stopped (hooks included) after the test."""
    started: list[RunningServer] = []

    async def _start(name: str, add_servicers: AddServicers, settings: ServiceSettings | None = None,
                     **kw: Any) -> RunningServer:
        s = settings or ServiceSettings(host="127.0.0.1", port=0, grace_s=0.5)
        running = await start_server(name, add_servicers, s, **kw)
        started.append(running)
        return running

    yield _start
    for r in reversed(started):
        await r.stop(0.5)
