"""CPU-heavy work off the event loop, cancelled cooperatively when the caller's deadline passes.

`offload(fn, *args)` runs `fn` in a worker thread and waits at most until the deadline of the RPC
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
from collections.abc import Callable
from typing import Any, TypeVar

from flowmaker.errors import DeadlineExceeded

T = TypeVar("T")

# Absolute deadline (time.monotonic()) of the RPC being served, so work done for it never outlives it.
incoming_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("incoming_deadline", default=None)
# Set in a worker's context by `offload`; `checkpoint()` raises once it is set.
_cancelled: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("cancelled", default=None)


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
        return await asyncio.wait_for(asyncio.shield(fut), wait)
    except TimeoutError:
        ev.set()
        raise DeadlineExceeded(f"gave up after {wait:.3g} s (the caller's deadline)") from None
    except asyncio.CancelledError:
        ev.set()
        raise
