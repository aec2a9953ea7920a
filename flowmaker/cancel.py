"""CPU-heavy work off the event loop, cancelled cooperatively when the caller's deadline passes.

`wait_for(aw, timeout)` is `asyncio.wait_for` without Python 3.11's lost cancellation, for every wait in the
product. `offload(fn, *args)` runs `fn` in a worker thread and waits at most until the deadline of the RPC
being served (`incoming_deadline`, set by the server interceptor). When the deadline passes, or the
RPC is cancelled, the caller gets DeadlineExceeded at once and the worker's cancellation flag is
set: long loops call `checkpoint()`, which raises in the worker, so the thread is freed instead of
burning a CPU for a caller who has gone. Pure asyncio + threading: no gRPC here.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from flowmaker.errors import DeadlineExceeded

T = TypeVar("T")

# Absolute deadline (time.monotonic()) of the RPC being served, so work done for it never outlives it.
incoming_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("incoming_deadline", default=None)
# Set in a worker's context by `offload`; `checkpoint()` raises once it is set.
_cancelled: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("cancelled", default=None)


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """`aw` within `timeout` seconds (None: no limit), else TimeoutError, as `asyncio.wait_for`. On Python 3.11
    `asyncio.wait_for` loses a cancellation that arrives as `aw` finishes (CPython gh-86296, fixed in 3.12 by this
    same construction): a loop stopped at that moment runs on, and whoever awaits its end hangs. Measured: the
    orchestrator's reconciler, waiting for a cache change when the stack shut down under load, kept running and
    its stop() never returned (a test that hung for 600 s, about 1 run in 50 under load)."""
    async with asyncio.timeout(timeout):
        return await aw


def checkpoint() -> None:
    """Raise DeadlineExceeded when the work this thread does was given up (call it in long loops)."""
    ev = _cancelled.get()
    if ev is not None and ev.is_set():
        raise DeadlineExceeded("the deadline of the request passed; work abandoned", reason="CANCELLED")


def remaining_s(default: float | None = None) -> float | None:
    dl = incoming_deadline.get()
    if dl is None:
        return default
    left = dl - time.monotonic()
    return left if default is None else min(left, default)


async def offload(fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
    """`fn(*args)` in a worker thread, bounded by the incoming deadline (and `timeout_s`)."""
    ev = threading.Event()
    ctx = contextvars.copy_context()
    ctx.run(_cancelled.set, ev)
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, ctx.run, fn, *args)
    wait = remaining_s(timeout_s)
    if wait is not None and wait <= 0:
        ev.set()
        raise DeadlineExceeded("the deadline of the request has passed")
    try:
        return await wait_for(asyncio.shield(fut), wait)
    except TimeoutError:
        ev.set()
        raise DeadlineExceeded(f"gave up after {wait:.3g} s (the caller's deadline)") from None
    except asyncio.CancelledError:
        ev.set()
        raise
