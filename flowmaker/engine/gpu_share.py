"""Busy marks that let emulated engines on one node share their emulated GPUs across processes.

The emulated node's engines slow each other down exactly as the simulator's `colocation="dynamic"`
does (`flowmaker.sim.cluster`, `flowmaker.sharing`): while an engine has a call in flight it is
*busy*, and at every moment it runs at speed 1/k, k = the most busy engines on any of its GPUs,
itself included.

State is a directory per node (`--gpu-share-dir`), one subdirectory per GPU id, and in it one empty
file per busy engine, named `<pid>-<process start time>-<nonce>`:

* an engine creates its mark in every one of its GPUs' directories when it becomes busy and removes
  them when it becomes idle (or stops);
* a reader lists its GPUs' directories and counts the marks of engines that are still alive. A mark
  whose process is gone (an engine killed with SIGKILL never removes its marks), a zombie, or whose
  pid now belongs to another process (the start time differs) is stale: ignored, and removed.

The node agent makes the directory (`make_share_dir`: private, one per agent life, removed at its
shutdown; those of agents killed before they could are removed by the next one).

Pure file-system operations, no locks: a listing is a consistent-enough snapshot, each mark has one
writer, and a listing of a few entries every few milliseconds costs microseconds.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Sequence

_GPU_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}")
_MARK = re.compile(r"(\d+)-(\d+)-([0-9a-f]+)")


def check_gpu_id(gid: str) -> str:
    """A GPU id names a directory: letters, digits, `_.:-`, not starting with a dot; ValueError otherwise."""
    if not _GPU_ID.fullmatch(gid):
        raise ValueError(f"gpu id {gid[:64]!r}: must be 1-128 of [A-Za-z0-9_.:-], not starting with '.' or '-'")
    return gid


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) from /proc/<pid>/stat; None when there is no
    such process. Raises OSError other than "not found" (no /proc at all) to the caller."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so split after the LAST ')'.
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return rest[0].decode(), int(rest[19])
    except (IndexError, ValueError):
        return None


_HAVE_PROC = os.path.isdir("/proc/self") and _proc_stat(os.getpid()) is not None


def process_start(pid: int) -> int:
    """The process's start time (clock ticks since boot) where /proc has it, else 0 (not checked)."""
    if not _HAVE_PROC:
        return 0
    st = _proc_stat(pid)
    return st[1] if st is not None else 0


def process_alive(pid: int, start: int) -> bool:
    """True while the process `pid` that started at `start` runs (not a zombie, not a reused pid)."""
    if _HAVE_PROC:
        try:
            st = _proc_stat(pid)
        except OSError:
            return True  # cannot tell: never let a neighbour run faster than it should
        if st is None or st[0] in ("Z", "X", "x"):
            return False
        return start == 0 or st[1] == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class GpuShare:
    """One engine's view of the node's shared GPU state (see the module docstring)."""

    def __init__(self, directory: str, gpu_ids: Sequence[str]) -> None:
        if not gpu_ids:
            raise ValueError("gpu_ids: at least one GPU id is needed")
        if len(set(gpu_ids)) != len(gpu_ids):
            raise ValueError(f"gpu_ids: must be distinct, got {list(gpu_ids)}")
        self.directory = directory
        self.gpu_ids = tuple(check_gpu_id(g) for g in gpu_ids)
        self._dirs = tuple(os.path.join(directory, g) for g in self.gpu_ids)
        pid = os.getpid()
        self.pid = pid
        self._start = process_start(pid)
        self.mark = f"{pid}-{self._start}-{secrets.token_hex(4)}"
        self.busy = False
        for d in self._dirs:
            os.makedirs(d, exist_ok=True)

    def set_busy(self, busy: bool) -> None:
        """Create (busy) or remove (idle) this engine's mark on each of its GPUs."""
        if busy == self.busy:
            return
        for d in self._dirs:
            path = os.path.join(d, self.mark)
            if busy:
                try:
                    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
                except FileNotFoundError:  # the directory was removed under us: make it again
                    os.makedirs(d, exist_ok=True)
                    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
                os.close(fd)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self.busy = busy  # only once every GPU says so: a failure is retried at the next call

    def busy_others(self) -> int:
        """The most OTHER busy engines on any one of this engine's GPUs (stale marks ignored and removed)."""
        worst = 0
        for d in self._dirs:
            n = 0
            for name in _listdir(d):
                if name == self.mark:
                    continue
                m = _MARK.fullmatch(name)
                if m is None:
                    continue
                pid, start = int(m.group(1)), int(m.group(2))
                if (pid == self.pid and start == self._start) or process_alive(pid, start):
                    n += 1  # another engine of this process (tests) counts: it has its own nonce
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(d, name))
            worst = max(worst, n)
        return worst

    def close(self) -> None:
        self.set_busy(False)


def _listdir(d: str) -> Iterable[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return ()


# ---- the node's side: one directory per node agent -------------------------------------------------

SHARE_DIR_PREFIX = "flowmaker-gpu-share-"
_OWNER = ".owner"  # `<pid> <start time>` of the agent that made the directory (GPU ids never start with '.')


def make_share_dir(node: str, parent: str | None = None) -> str:
    """A new private (0700) sharing directory for one node agent's engines, in `parent` (the temp dir by
    default), recording its owner; the directories of owners that are gone (an agent killed before it
    could remove its own) are removed first."""
    parent = parent or tempfile.gettempdir()
    remove_dead_share_dirs(parent)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node)[:64]
    d = tempfile.mkdtemp(prefix=f"{SHARE_DIR_PREFIX}{safe}-", dir=parent)
    pid = os.getpid()
    tmp = os.path.join(d, _OWNER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{pid} {process_start(pid)}")
    os.replace(tmp, os.path.join(d, _OWNER))
    return d


def remove_dead_share_dirs(parent: str) -> None:
    """Remove the sharing directories in `parent` whose owning agent is no longer alive (best effort;
    a directory without an owner yet, being made right now, is left alone)."""
    for name in _listdir(parent):
        if not name.startswith(SHARE_DIR_PREFIX):
            continue
        d = os.path.join(parent, name)
        try:
            with open(os.path.join(d, _OWNER)) as f:
                pid_s, start_s = f.read().split()
            pid, start = int(pid_s), int(start_s)
        except (OSError, ValueError):
            continue
        if not process_alive(pid, start):
            shutil.rmtree(d, ignore_errors=True)
