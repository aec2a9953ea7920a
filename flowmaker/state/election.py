"""Leader election over the StateStore, the Patroni way: one key, created only if absent and bound to the
candidate's lease; the leader refreshes its lease well within the TTL and holds the key while it does; the others
watch the key and stand for election again when it goes (deleted on a clean exit, expired with the lease after a
crash). A leader that cannot refresh its lease steps down before the lease can expire at the store, so two leaders
never act at once for longer than the store's own clock skew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from flowmaker.cancel import wait_for
from flowmaker.errors import AlreadyExists, FlowMakerError, InvalidSpec
from flowmaker.state.store import EventKind, Json, StateStore

log = logging.getLogger(__name__)

Callback = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


class Election:
    """Stand for election on `key` as `value` (a JSON object naming the candidate) with a lease of `ttl_s`.

    `on_elected` is awaited when this candidate becomes the leader, `on_deposed` when it stops being one (lease
    not refreshed in time, key gone or taken, or `stop`). `leader` is the value of the current leader as last
    seen (None: no leader known).

    `ttl_s` bounds the takeover after a crash: the lease is granted for a second less (at least 2 s), since etcd
    expires leases on a ~0.5 s tick and the others then need the delete event and one transaction."""

    def __init__(self, store: StateStore, key: str, value: dict[str, Any], *, ttl_s: int,
                 on_elected: Callback = _nothing, on_deposed: Callback = _nothing) -> None:
        if ttl_s < 2:
            raise InvalidSpec(f"lease TTL must be >= 2 s, got {ttl_s}", field="leader_lease_ttl_s")
        self.store = store
        self.key = key
        self.value = value
        self.ttl_s = max(2, ttl_s - 1)  # the lease's TTL (see the class docstring)
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.leader: Json = None
        self.is_leader = False
        self.decided = asyncio.Event()  # set once the first round has a result (won, or someone else leads)
        self.terms = 0  # how many times this candidate was elected
        self._task: asyncio.Task[None] | None = None
        self._lease = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"election {self.key}")

    async def stop(self) -> None:
        """Step down (the key is deleted with the lease, so another candidate takes over at once)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._step_down("stopping")
        if self._lease:
            with contextlib.suppress(FlowMakerError):
                await self.store.revoke_lease(self._lease)
            self._lease = 0

    async def _run(self) -> None:
        delay = 0.2
        while True:
            try:
                await self._round()
                delay = 0.2
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the store unreachable: stand again once it answers
                log.warning("election %s: %s", self.key, e)
                await self._step_down(f"store error: {e}")
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.ttl_s / 3)

    async def _round(self) -> None:
        """Hold a live lease; take the key when it is free; hold it (leading) or watch it (following)."""
        if not self._lease or await self.store.refresh_lease(self._lease) <= 0:
            self._lease = await self.store.grant_lease(self.ttl_s)
        try:
            await self.store.create(self.key, self.value, lease=self._lease)
        except AlreadyExists:
            kv = await self.store.get(self.key)
            self.leader = kv.value if kv is not None else None
            self.decided.set()
            if kv is not None:
                await self._follow(kv.mod_revision)
            return
        self.leader = self.value
        self.is_leader = True
        self.terms += 1
        self.decided.set()
        log.warning("election %s: elected (%s), term %d", self.key, self.value, self.terms)
        why = "stopping"
        try:
            await self.on_elected()
            await self._lead()
            why = "lease not refreshed in time, or the key is gone"
        finally:
            await self._step_down(why)

    async def _lead(self) -> None:
        """Refresh the lease every ttl/3 while the key is ours; return (step down) when a refresh has not
        succeeded for 2/3 of the TTL, or the key is gone or someone else's."""
        interval = self.ttl_s / 3.0
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                left = await wait_for(self.store.refresh_lease(self._lease), timeout=interval)
                kv = await wait_for(self.store.get(self.key), timeout=interval)
            except (FlowMakerError, TimeoutError) as e:
                if time.monotonic() - last_ok < 2 * interval:
                    log.warning("election %s: lease refresh failed (%s); retrying", self.key, e)
                    continue
                log.error("election %s: no lease refresh for %.1fs; stepping down", self.key,
                          time.monotonic() - last_ok)
                return
            if left <= 0 or kv is None or kv.lease != self._lease:
                log.error("election %s: the leader key is no longer ours; stepping down", self.key)
                return
            last_ok = time.monotonic()

    async def _follow(self, revision: int) -> None:
        """Wait until the leader key changes after `revision` (watched, and re-read every ttl/3 in case the
        watch missed it), keeping this candidate's lease alive meanwhile."""
        changed = asyncio.Event()

        async def watch() -> None:
            with contextlib.suppress(Exception):
                async for ev in self.store.watch_prefix(self.key, start_revision=revision + 1):
                    if ev.key == self.key and (ev.kind is EventKind.DELETE or ev.mod_revision > revision):
                        changed.set()
                        return
        w = asyncio.create_task(watch())
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await wait_for(changed.wait(), self.ttl_s / 3.0)
                if await self.store.refresh_lease(self._lease) <= 0:
                    self._lease = 0
                    return
                kv = await self.store.get(self.key)
                if kv is None or kv.mod_revision != revision:
                    self.leader = kv.value if kv is not None else None
                    return
        finally:
            w.cancel()
            await asyncio.gather(w, return_exceptions=True)

    async def _step_down(self, why: str) -> None:
        if not self.is_leader:
            return
        self.is_leader = False
        self.leader = None
        log.warning("election %s: no longer the leader (%s)", self.key, why)
        try:
            await self.on_deposed()
        except Exception:
            log.exception("election %s: on_deposed failed", self.key)
        # The key may still be ours (a refresh that only timed out): give it up so that another takes over.
        if self._lease:
            with contextlib.suppress(FlowMakerError):
                await self.store.revoke_lease(self._lease)
            self._lease = 0
