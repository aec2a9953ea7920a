"""Shared fixtures: a real etcd server (pausable to inject outages) and per-test etcd key namespaces."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# free loopback ports for processes that cannot bind port 0 themselves (the tests import it from here too)
from flowmaker.ports import free_port, free_ports  # noqa: F401 (free_port: re-exported for the tests)

ETCD_BIN = os.environ.get("FLOWMAKER_TEST_ETCD", shutil.which("etcd") or "/usr/bin/etcd")


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` in state T (stopped) per /proc; True when /proc cannot tell (not Linux)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # the thread ended
        if data[data.rfind(b")") + 2:].split()[0] not in (b"T", b"t"):
            return False
    return True


@dataclass
class EtcdServer:
    """A real etcd process on loopback. `pause()` (SIGSTOP) makes it hang like a partitioned
    server: connections stay open but nothing answers, so clients hit their deadlines."""

    proc: subprocess.Popen[bytes]
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    paused: bool = field(default=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def pause(self) -> None:
        """SIGSTOP, then wait until every thread of etcd is stopped: the signal is delivered asynchronously, and
        on a busy machine a thread already running could still answer the next request (seen once in CI:
        `test_unavailable_while_paused` got its read served right after the pause)."""
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True
        end = time.monotonic() + 5.0
        while time.monotonic() < end and not _all_threads_stopped(self.proc.pid):
            time.sleep(0.001)

    def resume(self) -> None:
        if self.paused:
            self.proc.send_signal(signal.SIGCONT)
            self.paused = False

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            if self.healthy():
                return
            time.sleep(0.1)
        raise RuntimeError(f"etcd not healthy after {timeout_s}s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_etcd(base: Path, extra_args: tuple[str, ...] = ()) -> EtcdServer:
    """A real etcd on two free loopback ports, data and log under `base`; `extra_args` go on its command line."""
    if not os.path.exists(ETCD_BIN):
        pytest.skip(f"etcd not installed at {ETCD_BIN} (apt-get install etcd-server)")
    cport, pport = free_ports(2)
    data_dir = base / "etcd-data"
    log_path = base / "etcd.log"
    curl, purl = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    cmd = [ETCD_BIN, "--name", "fm-test", "--data-dir", str(data_dir),
           "--listen-client-urls", curl, "--advertise-client-urls", curl,
           "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
           "--initial-cluster", f"fm-test={purl}", "--initial-cluster-state", "new",
           *extra_args, "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = EtcdServer(proc, cport, pport, data_dir, log_path)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the whole session (starting one takes ~1 s); tests isolate by namespace."""
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> Iterator[EtcdServer]:
    """The session etcd, guaranteed running again after the test even if it paused it."""
    yield etcd_server
    etcd_server.resume()


@pytest.fixture
def etcd_namespace() -> str:
    """A fresh key namespace: tests never see each other's keys."""
    return f"/test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def etcd_store(etcd: EtcdServer, etcd_namespace: str) -> AsyncIterator[object]:
    """An EtcdStore on the session etcd in a fresh namespace; its keys are wiped afterwards."""
    from flowmaker.state.etcd import EtcdStore

    store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=2.0)
    yield store
    etcd.resume()
    try:
        await store.delete_prefix("/")
    finally:
        await store.close()
