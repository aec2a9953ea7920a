"""`selection.stackroom`: the selection runs from a frame large enough to open its own stack chunk."""

from __future__ import annotations

import resource
import sys

import pytest

from flowmaker.selection import stackroom
from flowmaker.selection.stackroom import ROOM_SLOTS, with_room


def test_with_room_passes_arguments_results_and_errors_through() -> None:
    assert with_room(lambda a, b=0: (a, b), 1, b=2) == (1, 2)
    with pytest.raises(KeyError, match="x"):
        with_room({}.__getitem__, "x")


def test_the_trampoline_frame_has_the_slots_that_open_a_chunk_of_its_own() -> None:
    # A frame needs its code's locals as slots; more than a 16 KiB chunk holds opens a larger chunk.
    assert stackroom._trampoline.__code__.co_nlocals >= ROOM_SLOTS
    assert ROOM_SLOTS * 8 > 2 * 16 * 1024


def _oscillate(depth: int, reps: int) -> int:
    """Go `depth` frames down and back `reps` times (a depth-first search's up and down)."""
    def down(d: int) -> int:
        return 0 if d == 0 else 1 + down(d - 1)
    return sum(down(depth) for _ in range(reps))


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the chunk behaviour measured is CPython 3.11's")
def test_recursion_inside_the_room_does_not_map_a_chunk_per_descent() -> None:
    """From some depths, a recursion that goes up and down across a chunk boundary maps a chunk (and faults its
    pages) on each descent; inside `with_room` the same recursion runs within the room's chunk. Looked for at several
    starting depths, so that one of them sits on a boundary."""
    def faults(fn) -> int:  # type: ignore[no-untyped-def]
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    def at_depth(extra: int, fn) -> int:  # type: ignore[no-untyped-def]
        return faults(fn) if extra == 0 else at_depth(extra - 1, fn)

    bare = max(at_depth(k, lambda: _oscillate(30, 2000)) for k in range(0, 200, 3))
    roomy = max(at_depth(k, lambda: with_room(_oscillate, 30, 2000)) for k in range(0, 200, 3))
    assert bare > 1000, bare  # some starting depth thrashes without the room
    assert roomy < bare / 10, (roomy, bare)
