"""End to end, as a user runs it: `flowmaker up --detach` itself (TLS by default, its own HOME, so ~/.flowmaker
is the test's), then the CLI as subprocesses against it (issues 22 and 23):

- every file with a token or key is 0600 in a 0700 directory, and the state file holds paths, no secret;
- the CLI reads the admin token from the tokens file the state file points to, and reaches the stack without
  any state file from the FLOWMAKER_TLS_* / FLOWMAKER_TOKEN_FILE settings (or the options before the command);
- `task list` at 80 columns keeps every task id whole;
- every service serves Prometheus metrics on a port `up` chose and lists;
- `profiles measure` stores a measured profile through the TLS stack;
- the gateway keeps its port across `down` + `up`.

Skip with FLOWMAKER_SKIP_E2E=1.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowmaker.launcher.stack import read_state

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]

SUMMARIZE = "Summarise a document (meeting notes, an article, a report) in a few paragraphs."
MODEL = "Llama-3.2-1B-Instruct"


class Up:
    """A `flowmaker up --detach` with its own HOME (so its state file is HOME/.flowmaker/stack.json)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.state_file = home / ".flowmaker" / "stack.json"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWMAKER_", "COLUMNS"))}
        return {**env, "HOME": str(self.home), "COLUMNS": "200", **extra}

    def cli(self, *args: str, timeout: float = 180.0, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *args], capture_output=True, text=True,
                              env=self.env(**env), timeout=timeout, check=False)

    def up(self) -> dict[str, Any]:
        # --gateway-port 0: a free port (kept in the work dir), so this test never collides with a real
        # `flowmaker up` on the default port; the restart below checks that it is kept.
        return ok_json(self.cli("up", "--detach", "--json", "--gateway-port", "0", "--time-scale", "50",
                                timeout=240))

    def down(self) -> None:
        st = read_state(self.state_file)
        p = self.cli("down", timeout=120)
        if st is not None and p.returncode != 0:  # never leave a stack behind
            os.kill(int(st["pid"]), signal.SIGTERM)


def ok_json(p: subprocess.CompletedProcess[str]) -> Any:
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return json.loads(p.stdout)


def ids(listing: dict[str, Any]) -> list[tuple[str, str]]:
    """(id, name) of each listed task: what two listings of the same tasks share."""
    return [(t["id"], t.get("name", "")) for t in listing.get("tasks", [])]


def mode(p: Path | str) -> int:
    return stat.S_IMODE(Path(p).stat().st_mode)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, dict[str, Any]]]:
    import shutil

    if not shutil.which("etcd") and not os.path.exists("/usr/bin/etcd"):
        pytest.skip("etcd not installed")
    home = tmp_path_factory.mktemp("home")
    legacy = home / ".flowmaker"
    legacy.mkdir()
    os.chmod(legacy, 0o755)  # as an older FlowMaker left it
    u = Up(home)
    st = u.up()
    try:
        yield u, st
    finally:
        u.down()


def test_credentials_are_private_and_the_state_file_holds_paths(up: tuple[Up, dict[str, Any]]) -> None:
    u, st = up
    fm = u.home / ".flowmaker"
    assert mode(fm) == 0o700, oct(mode(fm))
    assert mode(u.state_file) == 0o600, oct(mode(u.state_file))
    work = Path(st["work_dir"])
    assert work == fm / "stack" and mode(work) == 0o700
    tls = st["tls"]
    pki = Path(tls["ca"]).parent
    assert mode(pki) == 0o700
    for f in [Path(tls["key"]), Path(tls["tokens_file"]), *pki.glob("*.key")]:
        assert mode(f) == 0o600, f"{f}: {oct(mode(f))}"
    tokens = json.loads(Path(tls["tokens_file"]).read_text())
    admin = next(t for t, who in tokens.items() if who.get("admin"))
    text = u.state_file.read_text()
    assert admin not in text and "token" not in json.loads(text)["tls"], text
    assert admin not in (fm / "up.log").read_text()


def test_the_cli_uses_the_stacks_tls_and_token_and_keeps_ids_whole(up: tuple[Up, dict[str, Any]]) -> None:
    u, _ = up
    t = ok_json(u.cli("task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15", "--rate", "0.5",
                      "--name", "a task with quite a long name", "--approve", "all", "--json"))
    assert t["state"] == "STATE_ACTIVE", t
    p = u.cli("task", "list", COLUMNS="80")
    assert p.returncode == 0, p.stderr
    assert t["id"] in p.stdout, f"the id {t['id']} is cut at 80 columns:\n{p.stdout}"
    assert max(len(ln) for ln in p.stdout.splitlines()) <= 80
    p = u.cli("instances", COLUMNS="80")
    assert p.returncode == 0, p.stderr
    inst = ok_json(u.cli("instances", "--json"))
    for i in inst["instances"]:
        assert i["id"] in p.stdout, f"instance id {i['id']} is cut at 80 columns:\n{p.stdout}"


def test_the_cli_reaches_the_stack_without_its_state_file(up: tuple[Up, dict[str, Any]]) -> None:
    u, st = up
    tls = st["tls"]
    addrs = {"FLOWMAKER_ORCHESTRATOR_ADDR": st["services"]["orchestrator"],
             "FLOWMAKER_DEPLOYER_ADDR": st["services"]["deployer"]}
    nowhere = {"FLOWMAKER_STATE_FILE": str(u.home / "no-such-state.json"), **addrs}
    # No state file and no credentials: a plaintext client gets no handshake, and the error says what is missing.
    p = u.cli("task", "list", **nowhere)
    assert p.returncode == 1 and "FLOWMAKER_TLS_CA" in p.stderr and "Traceback" not in p.stderr, p.stderr
    # The stack's files and token, from the environment.
    env = {**nowhere, "FLOWMAKER_TLS_CA": tls["ca"], "FLOWMAKER_TLS_CERT": tls["cert"],
           "FLOWMAKER_TLS_KEY": tls["key"], "FLOWMAKER_TOKEN_FILE": tls["tokens_file"]}
    # The task an earlier test deployed, through any replica: a listing first catches the replica's cache up with
    # etcd (read-your-writes), unless etcd is too slow to say how it stands (0.5 s) on a loaded machine, when the
    # cache's word stands; a short poll covers that case only.
    deadline = time.monotonic() + 10.0
    listed = ok_json(u.cli("task", "list", "--json", **env))
    while not listed.get("tasks") and time.monotonic() < deadline:
        time.sleep(0.5)
        listed = ok_json(u.cli("task", "list", "--json", **env))
    assert listed.get("tasks"), listed
    task = listed["tasks"][0]["id"]
    assert ok_json(u.cli("task", "get", task, "--json", **env))["id"] == task
    assert len(ok_json(u.cli("instances", "--json", **env))["gpus"]) == 8
    # The same as options before the command.
    flags = ["--tls-ca", tls["ca"], "--tls-cert", tls["cert"], "--tls-key", tls["key"], "--token-file",
             tls["tokens_file"]]
    # (the same tasks: a task record itself may move meanwhile, e.g. the leader re-derives its prediction)
    assert ids(ok_json(u.cli(*flags, "task", "list", "--json", **nowhere))) == ids(listed)
    # A user with only the CA and a token reaches the orchestrator.
    admin = next(t for t, who in json.loads(Path(tls["tokens_file"]).read_text()).items() if who.get("admin"))
    assert ids(ok_json(u.cli("task", "list", "--json", FLOWMAKER_TLS_CA=tls["ca"], FLOWMAKER_TOKEN=admin,
                             **nowhere))) == ids(listed)


def test_every_service_serves_metrics_on_a_port_up_lists(up: tuple[Up, dict[str, Any]]) -> None:
    _, st = up
    metrics = st["metrics"]
    # `up` starts two orchestrator replicas (docs/orchestrator.md, "Replicas"), each with its metrics port.
    assert set(metrics) == {"generator", "profiler", "selector", "deployer", "orchestrator", "orchestrator-2",
                            "gateway"}, metrics
    for name, url in metrics.items():
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    body = r.read().decode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        assert "flowmaker_" in body, f"{name}: {url} serves no FlowMaker metric"


def test_profiles_measure_goes_through_the_tls_stack(up: tuple[Up, dict[str, Any]]) -> None:
    u, st = up
    rows = ok_json(u.cli("profiles", "measure", MODEL, "--tp", "1", "--pp", "1", "--json", timeout=300))
    assert len(rows) == 1 and rows[0]["mode"] == "stack", rows
    assert rows[0]["profiler"] == st["services"]["profiler"] and rows[0]["state"] == "STATE_MEASURED"


def test_the_gateway_keeps_its_port_across_a_restart(up: tuple[Up, dict[str, Any]]) -> None:
    u, st = up
    before = st["gateway"]
    u.down()
    assert read_state(u.state_file) is None
    again = u.up()
    assert again["gateway"] == before, (before, again["gateway"])
    assert again["metrics"] == st["metrics"]  # the metrics ports are kept too
    admin = next(t for t, who in json.loads(Path(again["tls"]["tokens_file"]).read_text()).items()
                 if who.get("admin"))
    req = urllib.request.Request(before + "/models", headers={"Authorization": f"Bearer {admin}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["object"] == "list"


def test_a_context_runs_the_task_lifecycle_without_the_state_file(up: tuple[Up, dict[str, Any]],
                                                                   tmp_path: Path) -> None:
    """Issue 23's done-when: with FLOWMAKER_STATE_FILE pointing nowhere (another machine, another HOME), a
    context made from the stack's files, as the compose and Kubernetes docs make one, runs the whole task
    lifecycle; the environment still wins over the context."""
    u, st = up
    tls, svc = st["tls"], st["services"]
    cfg = tmp_path / "cfg" / "config.json"
    elsewhere = {"HOME": str(tmp_path), "FLOWMAKER_STATE_FILE": str(tmp_path / "nowhere" / "stack.json"),
                 "FLOWMAKER_CONFIG": str(cfg)}
    assert u.cli("task", "list", **elsewhere).returncode == 1  # no state file, no context: nothing to reach
    added = ok_json(u.cli("context", "add", "other", "--orchestrator", svc["orchestrator"], "--deployer",
                          svc["deployer"], "--profiler", svc["profiler"], "--ca", tls["ca"], "--cert", tls["cert"],
                          "--key", tls["key"], "--token-file", tls["tokens_file"], "--json", **elsewhere))
    assert added["current"] is True and added["orchestrator"] == svc["orchestrator"]
    assert mode(cfg) == 0o600 and "token" not in json.loads(cfg.read_text())["contexts"]["other"].get("tls_ca", "")
    assert ok_json(u.cli("context", "current", "--json", **elsewhere))["name"] == "other"
    t = ok_json(u.cli("task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15", "--rate", "0.5",
                      "--name", "through a context", "--approve", "all", "--json", **elsewhere))
    assert t["state"] == "STATE_ACTIVE", t
    r = ok_json(u.cli("task", "invoke", t["id"], "Notes: ship on Friday.", "--seed", "9", "--temperature", "1",
                      "--max-output-tokens", "6", "--json", **elsewhere))
    again = ok_json(u.cli("task", "invoke", t["id"], "Notes: ship on Friday.", "--seed", "9", "--temperature", "1",
                          "--max-output-tokens", "6", "--json", **elsewhere))
    assert r["output"] and r["output"] == again["output"]  # the seed reached the engines
    bad = u.cli("task", "invoke", t["id"], "x", "--temperature", "3", **elsewhere)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "sampling.temperature" in bad.stderr
    assert ok_json(u.cli("task", "get", t["id"], "--json", **elsewhere))["id"] == t["id"]
    assert t["id"] in [x["id"] for x in ok_json(u.cli("task", "list", "--json", **elsewhere))["tasks"]]
    assert ok_json(u.cli("instances", "--json", **elsewhere))["gpus"]  # the deployer, with the client cert
    ok_json(u.cli("task", "delete", t["id"], "--json", **elsewhere))
    gone = u.cli("task", "get", t["id"], **elsewhere)
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr, gone.stderr
    # The environment wins over the context.
    p = u.cli("task", "list", FLOWMAKER_ORCHESTRATOR_ADDR="127.0.0.1:1", **elsewhere)
    assert p.returncode == 1 and "127.0.0.1:1" in p.stderr, p.stderr
    # `up` registered its own context, current in its HOME, naming the same stack.
    local = ok_json(u.cli("context", "list", "--json"))
    assert local["current"] == "local" and local["contexts"]["local"]["orchestrator"] == svc["orchestrator"]
    assert mode(u.home / ".flowmaker" / "config.json") == 0o600
    nope = u.cli("--context", "missing", "task", "list")
    assert nope.returncode == 1 and "--context" in nope.stderr
