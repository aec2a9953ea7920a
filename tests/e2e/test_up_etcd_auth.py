"""End to end: `flowmaker up --detach` (TLS and etcd auth, the defaults) serves the demo path, and etcd holds each
service to its role (issue 22, item 3):

- the stack comes up with etcd auth provisioned, every service logged in as its own etcd user, and a task deploys,
  invokes and deletes through it;
- the etcd users' password files are 0600 in a 0700 directory; the state file and the services' environments hold
  their paths only;
- stolen credentials, against the live stack's etcd: the selector's certificate reads instance records but no
  engine key (sealed) and cannot rewrite an owner or a user; the generator's certificate and the profiler's
  password read no instance record, owner or token; no credential at all reads nothing;
- `down` + `up` finds etcd provisioned and the task state intact.

Bounded: about 2 minutes on a 2-core machine. Skip with FLOWMAKER_SKIP_E2E=1.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowmaker.errors import PermissionDenied, Unauthenticated, Unavailable
from flowmaker.launcher.stack import read_state
from flowmaker.rpc.tls import pki_files
from flowmaker.state import keys
from flowmaker.state.etcd import EtcdCredentials, EtcdStore
from flowmaker.state.etcd_auth import ROLES, password_file

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]

DEPLOYED: list[str] = []  # the task the demo-path test leaves running for the restart test
SUMMARIZE = "Summarise a document (meeting notes, an article, a report) in a few paragraphs."


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWMAKER_", "COLUMNS"))}
    return {**env, "HOME": str(home), "COLUMNS": "200"}


def _cli(home: Path, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *args], capture_output=True, text=True,
                          env=_env(home), timeout=timeout, check=False)


def _ok(p: subprocess.CompletedProcess[str]) -> Any:
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return json.loads(p.stdout)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _down(home: Path) -> None:
    st = read_state(home / ".flowmaker" / "stack.json")
    p = _cli(home, "down", timeout=120)
    if st is not None and p.returncode != 0:  # never leave a stack behind
        os.kill(int(st["pid"]), signal.SIGTERM)


def _up(home: Path) -> dict[str, Any]:
    return _ok(_cli(home, "up", "--detach", "--json", "--gateway-port", "0", "--time-scale", "50",
                    "--orchestrators", "1", timeout=240))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    if not shutil.which("etcd") and not os.path.exists("/usr/bin/etcd"):
        pytest.skip("etcd not installed")
    home = tmp_path_factory.mktemp("home-etcd-auth")
    try:
        yield home, _up(home)
    finally:
        _down(home)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def test_up_provisions_etcd_auth_and_serves_the_demo_path(stack: tuple[Path, dict[str, Any]]) -> None:
    home, st = stack
    auth_dir = Path(st["etcd_auth_dir"])
    assert auth_dir == Path(st["work_dir"]) / "etcd-auth" and _mode(auth_dir) == 0o700
    passwords = {u: password_file(auth_dir, u).read_text().strip() for u in ("root", *ROLES)}
    for u in passwords:
        assert _mode(password_file(auth_dir, u)) == 0o600
    state_text = (home / ".flowmaker" / "stack.json").read_text()
    for u, pw in passwords.items():
        assert pw not in state_text, u
    # Each etcd-using service is told its user and the path of its password file, never the password.
    for svc in ("orchestrator", "deployer", "profiler", "selector"):
        env = _environ(int(st["pids"][svc]))
        p = f"FLOWMAKER_{svc.upper()}_"
        assert env[p + "ETCD_USER"] == svc and env[p + "ETCD_PASSWORD_FILE"] == str(password_file(auth_dir, svc))
        assert not any(pw in v for v in env.values() for pw in passwords.values()), svc
    assert "FLOWMAKER_GENERATOR_ETCD_USER" not in _environ(int(st["pids"]["generator"]))
    assert "FLOWMAKER_SELECTOR_ENGINE_KEY_SECRET_FILE" not in _environ(int(st["pids"]["selector"]))
    # The demo path, through every service (each on its own etcd user).
    t = _ok(_cli(home, "task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15", "--rate", "0.5",
                 "--name", "behind etcd roles", "--approve", "all", "--json"))
    assert t["state"] == "STATE_ACTIVE", t
    r = _ok(_cli(home, "task", "invoke", t["id"], "Notes: ship on Friday.", "--max-output-tokens", "6", "--json"))
    assert r["output"]
    asyncio.run(_probe_stolen_credentials(st, t["id"], passwords["profiler"]))
    DEPLOYED.append(t["id"])


async def _probe_stolen_credentials(st: dict[str, Any], task_id: str, profiler_password: str) -> None:
    endpoint = st["etcd"]
    pki = Path(st["tls"]["ca"]).parent
    admin = EtcdStore(endpoint, tls=pki_files(pki, "admin"))  # the operator's certificate: the key space
    selector = EtcdStore(endpoint, tls=pki_files(pki, "selector"))  # a stolen certificate: its CN is its etcd user
    generator = EtcdStore(endpoint, tls=pki_files(pki, "generator"))  # no etcd user at all
    profiler = EtcdStore(endpoint, tls=pki_files(pki, "generator"), auth=EtcdCredentials("profiler", profiler_password))
    no_cert_no_user = EtcdStore(endpoint, tls=None)
    try:
        instances = (await admin.get_prefix(keys.INSTANCES)).items
        assert instances, "the deployed task runs on instances"
        assert await admin.get(keys.owner(task_id)) is not None
        # The selector reads instance records (reuse needs them), but no engine key is in them.
        seen = (await selector.get_prefix(keys.INSTANCES)).items
        assert {kv.key for kv in seen} == {kv.key for kv in instances}
        for kv in seen:
            assert kv.value.get("api_key") == "" and str(kv.value.get("api_key_sealed", "")).startswith("v1:"), kv
        for thief in (selector, profiler, generator):
            with pytest.raises((PermissionDenied, Unauthenticated)):
                await thief.put(keys.owner(task_id), {"user": "mallory"})
            with pytest.raises((PermissionDenied, Unauthenticated)):
                await thief.put(keys.user("u-mallory"), {"id": "u-mallory", "name": "mallory", "admin": True})
            with pytest.raises((PermissionDenied, Unauthenticated)):
                await thief.get_prefix(keys.TOKENS)
        for thief in (profiler, generator):
            with pytest.raises((PermissionDenied, Unauthenticated)):
                await thief.get_prefix(keys.INSTANCES)
            with pytest.raises((PermissionDenied, Unauthenticated)):
                await thief.get(keys.owner(task_id))
        with pytest.raises((Unavailable, Unauthenticated, PermissionDenied)):  # no certificate: no TLS handshake
            await no_cert_no_user.get_prefix(keys.INSTANCES)
        # The issue's own probe: etcd's JSON API (grpc-gateway) with a suite certificate.
        for ident in ("selector", "generator", "profiler"):
            for path, body in (("/v3/kv/range", {"key": _b64(keys.INSTANCES), "range_end": _b64(keys.INSTANCES[:-1]
                                                                                                   + "0")}),
                               ("/v3/kv/put", {"key": _b64(keys.owner(task_id)), "value": _b64('{"owner":"x"}')})):
                # etcd refuses the gateway to certificate-only callers once auth is on (it would not know the user)
                status, text = _json_api(endpoint, pki, ident, path, body)
                assert status != 200 or '"error"' in text, (ident, path, status, text[:300])
        owner = await admin.get(keys.owner(task_id))
        assert owner is not None and "mallory" not in json.dumps(owner.value) and '"x"' not in json.dumps(owner.value)
    finally:
        for s in (admin, selector, generator, profiler, no_cert_no_user):
            await s.close()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _json_api(endpoint: str, pki: Path, ident: str, path: str, body: dict[str, str]) -> tuple[int, str]:
    """POST to etcd's JSON gateway over mTLS with the certificate of `ident`: (HTTP status, body)."""
    files = pki_files(pki, ident)
    ctx = ssl.create_default_context(cafile=files.ca)
    ctx.load_cert_chain(files.cert, files.key)
    req = urllib.request.Request(f"https://{endpoint}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_restart_finds_etcd_provisioned_and_the_task_serves_again(stack: tuple[Path, dict[str, Any]]) -> None:
    """`down` + `up`: provisioning finds everything in place (0 changes), and the task deployed before serves
    again: its engines are started anew by the deployer, whose sealed engine keys the orchestrator opens."""
    home, st = stack
    if not DEPLOYED:
        pytest.skip("the demo-path test did not deploy a task")
    _down(home)
    again = _up(home)
    assert again["etcd_auth_dir"] == st["etcd_auth_dir"]
    log = (home / ".flowmaker" / "up.log").read_text()
    assert "auth on (0 change(s))" in log, log[-2000:]
    task_id = DEPLOYED[0]
    assert task_id in [x["id"] for x in _ok(_cli(home, "task", "list", "--json")).get("tasks", [])]
    deadline = time.monotonic() + 90
    while True:
        p = _cli(home, "task", "invoke", task_id, "Notes: ship on Friday.", "--max-output-tokens", "4", "--json")
        if p.returncode == 0:
            assert json.loads(p.stdout)["output"]
            break
        assert time.monotonic() < deadline, p.stderr
        time.sleep(2)
    _ok(_cli(home, "task", "delete", task_id, "--json"))
