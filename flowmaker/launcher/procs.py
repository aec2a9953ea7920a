"""Process identity on Linux (/proc): tell a process apart from a later one that reuses its pid, find descendants.

Used by the launcher (no orphans after a stop) and by the deployer (a restarted agent kills the engines
its previous life left running). A pid alone is not an identity: pids are reused. (pid, start time in
clock ticks since boot, boot id) is: the same triple can never name two processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_PR_SET_PDEATHSIG = 1
# prctl is looked up here, in the parent: between fork and exec a child of a threaded process must not
# dlopen (another thread may have held the loader's lock at the fork).
try:
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


_SETPRIV = shutil.which("setpriv")  # util-linux: always there on Debian/Ubuntu


def exec_dying_with_parent(argv: list[str], sig: str = "KILL") -> list[str]:
    """`argv` run so that it gets SIG<sig> when the process that started it dies (PR_SET_PDEATHSIG via
    util-linux `setpriv`, which then execs argv: same pid, same process group). For children of threaded
    async servers, where a Python `preexec_fn` is not safe. Without setpriv: argv unchanged (a restarted
    deployer still reaps what its previous life left, by recorded pid and identity)."""
    if _SETPRIV is None:
        return list(argv)
    return [_SETPRIV, f"--pdeathsig={sig}", "--", *argv]


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` that makes the child get `sig` when its parent dies (PR_SET_PDEATHSIG): engines
    never outlive their deployer, services never outlive their launcher, even after a SIGKILL. Survives
    exec; a no-op where prctl does not exist."""
    prctl = _prctl

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(sig))
    return preexec


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 = state is [0]), or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ')'.
    return stat.rsplit(")", 1)[1].split()


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), or None when there is no such pid."""
    f = _stat_fields(pid)
    return f[19] if f else None


def boot_id() -> str:
    """This boot of this machine ("" where /proc does not say): start times only compare within one boot."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def identity(pid: int) -> str:
    """"<boot id>/<start time>" of a live process, "" when it is gone: store it with the pid."""
    st = start_time(pid)
    return f"{boot_id()}/{st}" if st is not None else ""


def is_same_alive(pid: int, ident: str) -> bool:
    """The process `pid` still runs and is the one `identity(pid)` described (not a zombie, not a reused pid)."""
    if pid <= 0 or not ident:
        return False
    f = _stat_fields(pid)
    if f is None or f[0] in ("Z", "X"):
        return False
    return ident == f"{boot_id()}/{f[19]}"


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of `root` (by parent pid, whatever their session)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        f = _stat_fields(int(d.name))
        if f is None:
            continue
        with contextlib.suppress(ValueError, IndexError):
            children.setdefault(int(f[1]), []).append(int(d.name))
    out: list[tuple[int, str]] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        st = start_time(pid)
        if st is not None:
            out.append((pid, st))
        todo += children.get(pid, [])
    return out


def kill_group_if_same(pid: int, ident: str, grace_s: float) -> bool:
    """SIGTERM the process group led by `pid` (engines are started as group leaders, so their workers
    are in it), SIGKILL it after `grace_s`, but only if `pid` is still the process `ident` describes.
    Blocking (it sleeps while waiting): call it from a worker thread in async code. True if it was
    running and was signalled."""
    if not is_same_alive(pid, ident):
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and is_same_alive(pid, ident):
        time.sleep(0.05)
    # Workers may outlive their leader. While any of them lives, Linux hands out no pid equal to the
    # group's id, so this reaches what is left of that group (the same last step as EngineProcess.stop).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    return True
