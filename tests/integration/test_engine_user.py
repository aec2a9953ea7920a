"""Engines as their own user (issue 22 item 5): a root deployer with `engine_user` starts a real emulated engine
that runs under that uid, serves, writes its log through the deployer, and cannot read the suite's 0600 keys."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from flowmaker.errors import InvalidSpec
from flowmaker.launcher import procs
from flowmaker.state.etcd import EtcdStore
from flowmaker.state.records import InstanceState
from services.deployer import backends
from services.deployer.backends import EmulatedBackend
from services.deployer.node import DeployParams, NodeAgent
from services.deployer.settings import DeployerSettings

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="engines run as another user only under a root deployer"),
]

MODEL = "Llama-3.2-1B-Instruct"
REPO = Path(__file__).resolve().parents[2]


def _as(uid: int, gid: int, argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """argv run with exactly this uid/gid and no supplementary groups, the way the deployer starts an engine
    (an executable the user may not run: returncode 126, as a shell gives)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd="/", user=uid,
                              group=gid, extra_groups=[])
    except PermissionError as e:
        return subprocess.CompletedProcess(argv, 126, "", str(e))


@pytest.fixture
def engine_user() -> Iterator[tuple[str, int, int]]:
    """A throwaway system user (removed after), or `nobody` where useradd is missing: (name, uid, gid)."""
    import pwd

    name = ""
    if shutil.which("useradd") and shutil.which("userdel"):
        name = f"fm-eng-{uuid.uuid4().hex[:8]}"
        r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            name = ""
    pw = pwd.getpwnam(name or "nobody")
    try:
        yield pw.pw_name, pw.pw_uid, pw.pw_gid
    finally:
        if name:
            subprocess.run(["userdel", name], capture_output=True, timeout=30)


def _engine_python(uid: int, gid: int) -> tuple[str, str]:
    """(python, PYTHONPATH) that the user can run the emulated engine with: this venv's python when the user can
    execute it, else the system python of the same version with this venv's packages; skip when neither works."""
    probe = ["-c", "import flowmaker.engine.server"]
    if _as(uid, gid, [sys.executable, *probe]).returncode == 0:
        return sys.executable, ""
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(ver, path="/usr/bin:/usr/local/bin:/bin")
    pythonpath = f"{sysconfig.get_paths()['purelib']}:{REPO}"
    if system and _as(uid, gid, [system, *probe], env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"}
                      ).returncode == 0:
        return system, pythonpath
    pytest.skip(f"uid {uid} can run neither {sys.executable} (a venv under a 0700 home?) nor a system {ver} "
                "with this venv's packages: the engine could not start as that user")


def _status_ids(pid: int) -> tuple[list[int], list[int], str]:
    """(Uid fields, Gid fields, Groups line) from /proc/<pid>/status."""
    lines = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return ([int(x) for x in lines["Uid"].split()], [int(x) for x in lines["Gid"].split()], lines["Groups"].strip())


async def test_engine_runs_as_its_own_user_serves_and_cannot_read_the_suite_keys(
        etcd, etcd_namespace: str, engine_user: tuple[str, int, int], tmp_path: Path,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    name, uid, gid = engine_user
    python, pythonpath = _engine_python(uid, gid)
    if pythonpath:  # the allowlisted PYTHONPATH reaches the engine (engine_base_env)
        monkeypatch.setenv("PYTHONPATH", pythonpath)
    monkeypatch.setitem(backends.BACKENDS, "emulated", lambda: EmulatedBackend(python=python))
    # The suite's secrets: a 0600 root file in a directory everyone may enter (so only the file's mode
    # protects it), next to a 0644 file the engine's user CAN read: the denial is the key's mode, nothing else.
    keys_dir = Path(tempfile.mkdtemp(prefix="fm-keys-"))
    try:
        keys_dir.chmod(0o755)
        key = keys_dir / "deployer.key"
        key.write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
        key.chmod(0o600)
        public = keys_dir / "ca.pem"
        public.write_text("public\n")
        public.chmod(0o644)

        log_dir = tmp_path / "engines"  # root's, 0700 under pytest's tmp: only the deployer writes it
        settings = DeployerSettings(node="node0", host="127.0.0.1", port=0, etcd_endpoints=etcd.endpoint,
                                    etcd_namespace=etcd_namespace, etcd_timeout_s=3.0, use_nvml=False,
                                    gpu_type="A6000", gpu_count=2, lease_ttl_s=3, engine_time_scale=50.0,
                                    engine_stop_grace_s=3.0, engine_start_timeout_s=60.0, engine_user=name,
                                    engine_log_dir=str(log_dir), load_scrape_interval_s=0, liveness_interval_s=0)
        assert settings.engine_ids == (uid, gid)
        store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
        agent = NodeAgent(store, settings)
        pid = 0
        try:
            await agent.start()
            rec = await agent.deploy(DeployParams(model_id=MODEL, request_id="as-user-1"))
            assert rec.state is InstanceState.READY
            proc = agent.procs["as-user-1"]
            assert proc.pid is not None
            pid = proc.pid
            uids, gids, groups = _status_ids(pid)
            assert uids == [uid] * 4 and gids == [gid] * 4, (uids, gids)  # real, effective, saved, fs
            assert groups == "", f"root's supplementary groups leaked to the engine: {groups!r}"
            assert os.getuid() == 0  # while the deployer stays root
            # The emulated GPU-sharing directory is the engine user's (it makes its GPUs' busy marks there), still 0700.
            share = Path(agent._share_dir).stat()
            assert share.st_uid == uid and share.st_mode & 0o777 == 0o700
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
                async with http.post(rec.endpoint + "/v1/chat/completions", json={
                        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["usage"]["completion_tokens"] == 4
            # Its output still reaches its log, which the deployer (root) writes; the engine never opens it.
            log_file = log_dir / "as-user-1.log"
            assert "LISTENING" in log_file.read_text()
            assert log_file.stat().st_uid == 0
            # As the engine's identity: the world-readable file reads, the 0600 key does not.
            assert _as(uid, gid, ["cat", str(public)]).stdout == "public\n"
            denied = _as(uid, gid, ["cat", str(key)])
            assert denied.returncode != 0 and "Permission denied" in denied.stderr and "secret" not in denied.stdout
            # Nor anything the engine's environment could point it at: no suite credential is in it.
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not [e for e in env if e.startswith((b"FLOWMAKER_DEPLOYER_", b"FLOWMAKER_TLS"))]
        finally:
            await agent.shutdown()
            await store.close()
            if pid and procs.start_time(pid) is not None:  # shutdown should have stopped it; never leave one
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        assert not pid or procs.start_time(pid) is None or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    finally:
        shutil.rmtree(keys_dir, ignore_errors=True)


async def test_engine_user_that_cannot_run_the_engine_fails_at_start(
        etcd, etcd_namespace: str, engine_user: tuple[str, int, int], monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A Python the engine's user cannot execute is a clear error naming engine_user when the agent starts,
    before it registers, not a failed start of every engine."""
    name, uid, _ = engine_user
    blocked = Path(tempfile.mkdtemp(prefix="fm-py-"))  # 0700, root's: the engine's user cannot enter it
    try:
        (blocked / "python").symlink_to(sys.executable)
        monkeypatch.setitem(backends.BACKENDS, "emulated", lambda: EmulatedBackend(python=str(blocked / "python")))
        store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
        agent = NodeAgent(store, DeployerSettings(node="node0", etcd_endpoints=etcd.endpoint,
                                                  etcd_namespace=etcd_namespace, use_nvml=False, gpu_count=1,
                                                  engine_user=name))
        try:
            with pytest.raises(InvalidSpec) as ei:
                await agent.start()
            assert ei.value.field == "engine_user" and f"uid {uid}" in ei.value.message
            assert agent.keeper is None  # failed before claiming the node
        finally:
            await agent.shutdown()
            await store.close()
    finally:
        shutil.rmtree(blocked, ignore_errors=True)


def test_engine_user_without_root_is_a_setting_error(engine_user: tuple[str, int, int]) -> None:
    """A deployer that is not root refuses engine_user at startup, naming the field, rather than running the
    engines as itself; and an unknown user is refused too."""
    _, uid, gid = engine_user
    python, pythonpath = _engine_python(uid, gid)
    code = ("from services.deployer.settings import DeployerSettings\n"
            "try:\n    DeployerSettings(engine_user='root')\n"
            "except ValueError as e:\n    print(e)\nelse:\n    print('accepted')\n")
    r = _as(uid, gid, [python, "-c", code], env={"PYTHONPATH": pythonpath or str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "engine_user" in r.stdout and "needs the deployer to run as root" in r.stdout, r.stdout
    with pytest.raises(ValueError, match="no such user"):
        DeployerSettings(engine_user="no-such-user-fm")
