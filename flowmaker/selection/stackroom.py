"""Room on CPython's frame stack for the searches' recursion.

CPython 3.11 keeps frames on a stack of chunks (16 KiB each unless a frame needs more). A chunk is unmapped as soon as
the frame that opened it returns, and mapped again at the next call past that depth. A depth-first search whose
recursion goes up and down across a chunk boundary therefore maps and unmaps a chunk, and takes a page fault per page,
on nearly every node; where the boundary falls depends on how deep the caller's stack already is, so the same search
runs at different speeds from different callers. Measured: chain_clones 1433011 under sharing, whose tie enumeration
visits 50,000 nodes, took 1.4-1.8 s with 139,000 page faults called from `flowmaker bench` and 0.4 s (17,000 faults)
from a script; inside `with_room` it takes 0.78 s in all (2,500-6,000 faults) from both.

`with_room(fn, *args)` calls fn from a frame of ROOM_SLOTS slots: no chunk holds it, so it opens a chunk of twice that
size or more, and the frames below it (the whole selection, its recursion included) fit in the rest of that chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

ROOM_SLOTS = 16_384  # frame slots of the trampoline: a 256 KiB chunk, about 128 KiB of it left to the frames below

# The slots are locals that are never assigned (the branch never runs): the frame has them, filling costs nothing.
_SRC = ("def _with_room(fn, args, kwargs):\n"
        "    if False:\n"
        f"        {' = '.join(f'_{i}' for i in range(ROOM_SLOTS))} = None\n"
        "    return fn(*args, **kwargs)\n")
_ns: dict[str, Any] = {}
# (a fixed source, built above: the one way to give a frame this many slots)
exec(compile(_SRC, "<flowmaker.selection.stackroom>", "exec"), _ns)
_trampoline: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] = _ns["_with_room"]


def with_room(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs), called from a frame that opens a large stack chunk (module docstring)."""
    return _trampoline(fn, args, kwargs)  # type: ignore[no-any-return]
