"""flowmaker.cancel.wait_for: a cancellation is never lost, whenever it arrives."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from flowmaker.cancel import wait_for


async def test_a_cancel_that_arrives_as_the_wait_ends_stops_the_loop() -> None:
    """A loop waiting for an event with a timeout (the reconciler's, the election's) is cancelled in the same
    turn of the event loop as the event is set. Python 3.11's asyncio.wait_for returned the event's result and
    swallowed the cancel: the loop ran on and stop() hung."""
    ev = asyncio.Event()
    turns = 0

    async def loop() -> None:
        nonlocal turns
        while True:
            with contextlib.suppress(TimeoutError):
                await wait_for(ev.wait(), 30.0)
            turns += 1
            ev.clear()

    for _ in range(5):  # (the order of the loop's callbacks decides the race: the same each round)
        ev.clear()
        t = asyncio.create_task(loop())
        await asyncio.sleep(0.01)
        ev.set()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):  # (not TimeoutError: the loop ran on)
            async with asyncio.timeout(2.0):
                await t
    assert turns == 0


async def test_wait_for_returns_the_result_or_raises_timeouterror() -> None:
    assert await wait_for(asyncio.sleep(0.0, result=7), 1.0) == 7
    assert await wait_for(asyncio.sleep(0.0, result=8), None) == 8
    with pytest.raises(TimeoutError):
        await wait_for(asyncio.sleep(10.0), 0.05)
    with pytest.raises(TimeoutError):
        await wait_for(asyncio.Event().wait(), 0.0)  # (no time at all: as asyncio.wait_for's timeout <= 0)


async def test_an_outside_cancel_is_not_taken_for_the_timeout() -> None:
    async def waiting() -> None:
        await wait_for(asyncio.sleep(10.0), 5.0)

    t = asyncio.create_task(waiting())
    await asyncio.sleep(0.01)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
