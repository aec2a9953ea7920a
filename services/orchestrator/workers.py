"""The per-task worker registry: at most one background worker (selection, deploy, release, delete, switch)
runs on a task at a time, and workers outlive the RPC that started them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from flowmaker.rpc.errors import incoming_deadline

log = logging.getLogger(__name__)

T = TypeVar("T")


class Workers:
    def __init__(self, on_done: Callable[[], None] | None = None) -> None:
        self._background: set[asyncio.Task[Any]] = set()
        self._workers: dict[str, asyncio.Task[Any]] = {}  # task id -> the one worker on it
        self.on_done = on_done  # called when any worker ends (the reconciler looks again)

    def busy_tasks(self) -> set[str]:
        return {tid for tid, t in self._workers.items() if not t.done()}

    def current(self, task_id: str) -> asyncio.Task[Any] | None:
        return self._workers.get(task_id)

    def start(self, task_id: str, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run `coro` as THE worker of `task_id`, unless one is already on it: then `coro` is dropped and the
        running worker returned."""
        cur = self._workers.get(task_id)
        if cur is not None and not cur.done():
            if asyncio.iscoroutine(coro):
                coro.close()
            return cur
        return self.register(task_id, self.spawn(coro))

    def register(self, task_id: str, t: asyncio.Task[Any]) -> asyncio.Task[Any]:
        """Make `t` the task's worker (in place of any other: `Healing.replan_deploy`)."""
        self._workers[task_id] = t

        def done(_t: asyncio.Task[Any]) -> None:
            if self._workers.get(task_id) is _t:
                del self._workers[task_id]
            if not _t.cancelled() and _t.exception() is not None:
                e = _t.exception()
                log.warning("task %s: worker ended with %s: %s", task_id, type(e).__name__, e)
            if self.on_done is not None:
                self.on_done()
        t.add_done_callback(done)
        return t

    async def follow(self, task_id: str, w: asyncio.Task[Any]) -> None:
        """Wait for the task's worker `w` and, when the reconciler replaced it meanwhile (`replan_deploy`), for
        its successor: the RPC that started the work answers once the work is done or waits with a reason."""
        while True:
            try:
                await asyncio.shield(w)
            except asyncio.CancelledError:
                cur = asyncio.current_task()
                if cur is not None and cur.cancelling():
                    raise  # the RPC itself was cancelled
            nxt = self._workers.get(task_id)
            if nxt is None or nxt is w:
                return
            w = nxt

    def spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        async def run() -> T:
            # Background work outlives the RPC that started it: no inherited deadline.
            incoming_deadline.set(None)
            return await coro
        t = asyncio.create_task(run())
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    async def cancel_all(self) -> None:
        """Stop every worker and background job (shutdown, or leadership lost: the next leader resumes them)."""
        pending = (*self._background, *self._workers.values())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
