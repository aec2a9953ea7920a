"""`flowmaker context ...` (issue 23): named stacks in a 0600 file, one current, and how a context ranks against
the flags, the environment and the state file (`flowmaker.launcher.client.settings`). The whole task lifecycle
through a context is tests/e2e/test_cli_up.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest


def cli(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWMAKER_")}
    base.update({"HOME": str(tmp), "FLOWMAKER_STATE_FILE": str(tmp / "fm" / "stack.json"), "COLUMNS": "200", **env})
    return subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *args], capture_output=True, text=True,
                          env=base, timeout=60, check=False)


def pem(tmp: Path, name: str) -> str:
    p = tmp / name
    p.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    return str(p)


def test_add_use_list_current_remove(tmp_path: Path) -> None:
    ca, cert, key, tok = (pem(tmp_path, n) for n in ("ca.pem", "admin.pem", "admin.key", "tokens.json"))
    p = cli(tmp_path, "context", "add", "k8s", "--orchestrator", "10.0.0.7:50055,10.0.0.8:50055", "--deployer",
            "10.0.0.7:50054", "--ca", ca, "--cert", cert, "--key", key, "--token-file", tok)
    assert p.returncode == 0 and "current context" in p.stdout, p.stderr
    assert cli(tmp_path, "context", "add", "compose", "--orchestrator", "127.0.0.1:50055").returncode == 0
    cfg = tmp_path / "fm" / "config.json"  # beside the state file
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    listed = json.loads(cli(tmp_path, "context", "list", "--json").stdout)
    assert listed["current"] == "k8s"  # the first one added
    assert listed["contexts"]["k8s"] == {"orchestrator": "10.0.0.7:50055,10.0.0.8:50055",
                                         "deployer": "10.0.0.7:50054", "tls_ca": ca, "tls_cert": cert,
                                         "tls_key": key, "token_file": tok}
    assert cli(tmp_path, "context", "use", "compose").returncode == 0
    assert cli(tmp_path, "context", "current").stdout.strip() == "compose"
    assert cli(tmp_path, "context", "current", FLOWMAKER_CONTEXT="k8s").stdout.strip() == "k8s"
    table = cli(tmp_path, "context", "list").stdout
    assert "compose" in table and "mTLS" in table
    assert cli(tmp_path, "context", "remove", "compose").returncode == 0
    gone = cli(tmp_path, "context", "current")
    assert gone.returncode == 1 and gone.stderr.startswith("error: NOT_FOUND")
    # FLOWMAKER_CONFIG moves the file.
    other = tmp_path / "elsewhere.json"
    assert cli(tmp_path, "context", "add", "x", "--orchestrator", "h:1", FLOWMAKER_CONFIG=str(other)).returncode == 0
    assert json.loads(other.read_text())["current"] == "x"


@pytest.mark.parametrize(("args", "field"), [
    (["--orchestrator", "no-port"], "--orchestrator"),
    (["--orchestrator", "h:1", "--gateway", "ftp://x"], "--gateway"),
    (["--token-file", "CA"], "--ca"),
    (["--ca", "CA", "--cert", "CA"], "--key"),
])
def test_bad_contexts_name_the_option(tmp_path: Path, args: list[str], field: str) -> None:
    ca = pem(tmp_path, "ca.pem")
    p = cli(tmp_path, "context", "add", "bad", *[ca if a == "CA" else a for a in args])
    assert p.returncode == 1 and f"INVALID_ARGUMENT: {field}:" in p.stderr, p.stderr
    assert not (tmp_path / "fm" / "config.json").exists()


def test_an_unknown_context_is_one_error_before_the_command(tmp_path: Path) -> None:
    p = cli(tmp_path, "--context", "nope", "task", "list")
    assert p.returncode == 1 and p.stderr.startswith("error: NOT_FOUND: --context: no context 'nope'"), p.stderr
    p = cli(tmp_path, "task", "list", FLOWMAKER_CONTEXT="nope")
    assert p.returncode == 1 and "FLOWMAKER_CONTEXT" in p.stderr and "Traceback" not in p.stderr


def test_the_environment_wins_over_the_context_and_the_context_over_the_state_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowmaker.launcher import contexts
    from flowmaker.launcher.client import resolve, settings
    from flowmaker.launcher.stack import write_state

    for k in [k for k in os.environ if k.startswith("FLOWMAKER_")]:
        monkeypatch.delenv(k)
    state = tmp_path / "fm" / "stack.json"
    monkeypatch.setenv("FLOWMAKER_STATE_FILE", str(state))
    write_state(state, {"pid": os.getpid(), "services": {"orchestrator": "state:1", "deployer": "state:2"}})
    assert resolve("orchestrator", None, settings()) == "state:1"
    ca = pem(tmp_path, "ca.pem")
    contexts.upsert(contexts.default_path(state), "c", contexts.Context(orchestrator="ctx:1", tls_ca=ca,
                                                                        token_file=ca))
    s = settings()
    assert (resolve("orchestrator", None, s), resolve("deployer", None, s)) == ("ctx:1", "state:2")
    assert (s.tls_ca, s.token_file) == (ca, ca)
    monkeypatch.setenv("FLOWMAKER_ORCHESTRATOR_ADDR", "env:1")
    monkeypatch.setenv("FLOWMAKER_TLS_CA", str(tmp_path / "env-ca.pem"))
    s = settings()
    assert resolve("orchestrator", None, s) == "env:1" and resolve("orchestrator", "flag:1", s) == "flag:1"
    assert (s.tls_ca, s.tls_cert) == (str(tmp_path / "env-ca.pem"), "")  # never mixed with the context's files
