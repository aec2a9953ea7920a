"""Integration fixtures: gRPC services started in-process on port 0 through the shared bootstrap."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from flowmaker.rpc.server import AddServicers, RunningServer, start_server
from flowmaker.settings import ServiceSettings

StartService = Callable[..., Awaitable[RunningServer]]

class StuckTaskWarning(UserWarning):
    """A task left running by a test did not end once cancelled (see `_no_task_left_running`)."""


# How long the tasks a test left running get to end once cancelled, and how long a server started by `start_service`
# gets to stop after the test.
LEFT_TASKS_GRACE_S = 20.0
SERVER_STOP_S = 60.0


def _await_chain(task: asyncio.Task[Any]) -> str:
    """Where a task is suspended: its coroutine and each coroutine it awaits, outermost first (Task.get_stack gives
    only the outermost frame of a suspended coroutine)."""
    lines, obj = [], task.get_coro()
    while obj is not None:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        nxt = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
        if nxt is None and frame is None:
            lines.append(f"  awaiting {obj!r}")
        obj = nxt
    return "\n".join(lines) or "  (no frames)"


@pytest.fixture(autouse=True)
async def _no_task_left_running() -> AsyncIterator[None]:
    """After a test and all its fixtures (autouse: set up first, so torn down last), the tasks still running on its
    loop are cancelled here and given LEFT_TASKS_GRACE_S to end. One that does not end would freeze the loop's own
    teardown, which waits for every task with no limit and no alarm left to stop it (CI lost 25 minutes so, twice,
    then ran the part again): such a task is detached from the loop so the run goes on, and reported with where it
    is stuck, as a warning in the test summary and a `STUCK TASK` line that scripts/run_tests.sh repeats at the end.
    A warning, not a failure: the test's own assertions passed, and what hangs in a teardown (most often a library's
    shutdown) is a finding for the log, not a verdict on the test."""
    yield
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in left:
        t.cancel()
    if not left:
        return
    _, stuck = await asyncio.wait(left, timeout=LEFT_TASKS_GRACE_S)
    if stuck:
        report = "\n".join(f"STUCK TASK {t.get_name()} ({t.get_coro()!r}):\n{_await_chain(t)}" for t in stuck)
        print(report, file=sys.stderr, flush=True)
        for t in stuck:
            asyncio.tasks._unregister_task(t)  # the loop's teardown would wait for it for ever
        warnings.warn(StuckTaskWarning(f"{len(stuck)} task(s) did not end within {LEFT_TASKS_GRACE_S:.0f}s of being "
                                       f"cancelled after the test (detached):\n{report}"), stacklevel=1)


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
        try:
            await asyncio.wait_for(r.stop(0.5), SERVER_STOP_S)
        except TimeoutError:
            # A server whose stop (its shutdown hooks included) does not end would freeze the fixture's teardown, and
            # the part with it (CI once lost 10 minutes so, in a deployer's shutdown): reported as `_no_task_left_
            # running` reports a stuck task, with where every task of the loop waits, and the run goes on.
            chains = "\n".join(f"STUCK TASK {t.get_name()} ({t.get_coro()!r}):\n{_await_chain(t)}"
                               for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done())
            report = f"STUCK TASK stopping server {r.name!r} took over {SERVER_STOP_S:.0f}s; the loop's tasks:\n{chains}"
            print(report, file=sys.stderr, flush=True)
            warnings.warn(StuckTaskWarning(report), stacklevel=1)


@pytest.fixture
async def start_control_plane(start_service: StartService) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """`await start_control_plane(store, **orchestrator_settings)` -> (Orchestrator, OrchestratorService stub):
    a selector and an orchestrator (with its reconciler) on port 0 over `store`, stopped after the test."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
    from flowmaker.rpc.channels import insecure_channel
    from services.orchestrator.clients import Clients
    from services.orchestrator.orchestrator import Orchestrator
    from services.orchestrator.servicer import add_servicers as add_orchestrator
    from services.orchestrator.settings import OrchestratorSettings
    from services.selector.servicer import add_servicers as add_selector
    from services.selector.settings import SelectorSettings

    channels: list[Any] = []

    async def _start(store: Any, **settings: Any) -> tuple[Any, Any]:
        sset = SelectorSettings(host="127.0.0.1", port=0, grace_s=0.5)
        sel = await start_service("selector", lambda s: add_selector(s, sset, store), sset)
        oset = OrchestratorSettings(host="127.0.0.1", port=0, grace_s=0.5, selector_address=sel.address,
                                    **{"deploy_timeout_s": 60, **settings})
        clients = Clients(oset.selector_address, timeout_s=30)
        orch = Orchestrator(oset, store, clients)

        async def close() -> None:
            await orch.close()
            await clients.close()

        async def ready(running: RunningServer) -> None:
            await orch.resume()

        o = await start_service("orchestrator", lambda s: add_orchestrator(s, orch), oset, on_ready=ready,
                                on_shutdown=[close])
        channel = insecure_channel(o.address, default_timeout_s=60)
        channels.append(channel)
        return orch, orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

    yield _start
    for ch in channels:
        await ch.close(None)


class Engine:
    """An emulated engine process started by `start_engine_proc` (its URL on loopback)."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture
async def start_engine_proc() -> AsyncIterator[Callable[..., Awaitable[Engine]]]:
    """`await start_engine_proc(profile, *flags)`: `python -m flowmaker.engine.server` on port 0 with that profile
    (its stderr discarded); every process started is killed and reaped afterwards."""
    from flowmaker.engine.server import profile_to_json

    procs: list[asyncio.subprocess.Process] = []

    async def start(profile: Any, *extra: str) -> Engine:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flowmaker.engine.server", "--model", "m1", "--profile-json", profile_to_json(profile),
            "--host", "127.0.0.1", "--port", "0", *extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        procs.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.startswith(b"LISTENING "), line
        return Engine(proc, int(line.split()[1]))

    yield start
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await p.wait()
