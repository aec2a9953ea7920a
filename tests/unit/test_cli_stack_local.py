"""The CLI's local side, without a stack: tables that keep ids whole, help without `<bool>`, `flowmaker up`'s
checks before it starts anything, private state files, and the client's credentials from flags and env vars
(issues 22 and 23; the same against real stacks: tests/e2e/test_cli_up.py)."""

from __future__ import annotations

import inspect
import io
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
LONG_IDS = ["summarise-a-document-meeting-notes-7d3f0a1b", "extract-entities-and-fields-from-0c9e22d4",
            "answer-customer-support-questions-5b1e9f70"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWMAKER_")}
    return subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *args], capture_output=True, text=True,
                          env={**base, "FLOWMAKER_STATE_FILE": "/nonexistent/stack.json", **(env or {})},
                          cwd=ROOT, timeout=120, check=False)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# ---- tables ----------------------------------------------------------------------------------------------


def _list_response() -> object:
    from flowmaker.api.common.v1 import task_pb2
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb

    resp = pb.ListTasksResponse()
    for i, tid in enumerate(LONG_IDS):
        t = resp.tasks.add(id=tid, name=f"task number {i}", state=task_pb2.Task.STATE_AWAITING_APPROVAL)
        t.slo.min_accuracy, t.slo.max_latency_s, t.slo.arrival_rate_rps = 0.25, 12.5, 0.5
        t.variant.workflow_id = "summarise-then-check-quality"
        t.requests_served = 12345
    return resp


@pytest.mark.parametrize("width", [80, 60, 100, 240])
def test_task_list_never_cuts_an_id(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowmaker.cli import stack as cli_stack

    buf = io.StringIO()
    monkeypatch.setattr(cli_stack, "out", Console(file=buf, width=width, color_system=None))
    cli_stack._tasks_table(_list_response())
    text = buf.getvalue()
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= width, text
    for tid in LONG_IDS:
        assert any(tid in ln for ln in lines), f"id {tid} cut at {width} columns:\n{text}"
    assert "…" not in "".join(ln.split("│")[1] for ln in lines if ln.startswith("│")), text  # the id cell itself
    if width >= 240:
        assert "not shown" not in text  # wide enough: every column, nothing hidden
    else:
        assert "AWAIT" in text  # the state column stays


def test_instances_table_never_cuts_an_id() -> None:
    from flowmaker.cli.output import KeyedColumn, keyed_table

    ids = ["inst-Llama-3.1-70B-Instruct-tp4-pp1-0123456789ab"]
    cols = [KeyedColumn(f"column {i}", 6) for i in range(12)]
    buf = io.StringIO()
    Console(file=buf, width=80, color_system=None).print(
        keyed_table("x", "id", cols, [(ids[0], {c.name: "some long cell text" for c in cols})], width=80))
    assert ids[0] in buf.getvalue()


def test_help_shows_no_type_on_flags() -> None:
    p = run("task", "list", "--help", env={"COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    assert "<bool>" not in p.stdout, p.stdout
    json_line = next(ln for ln in p.stdout.splitlines() if "--json" in ln)
    assert "Print proto3 JSON" in json_line
    assert any("--state" in ln and "<str>" in ln for ln in p.stdout.splitlines())  # options with a value keep it
    p = run("up", "--help", env={"COLUMNS": "200"})
    assert "<bool>" not in p.stdout and "--no-metrics" in p.stdout and "--gateway-port" in p.stdout, p.stdout


# ---- flowmaker up: the gateway's port, before anything starts ------------------------------------------------


def test_up_gateway_port_default_is_fixed() -> None:
    from flowmaker.cli.stack import up
    from flowmaker.launcher.stack import DEFAULT_GATEWAY_PORT

    default = inspect.signature(up).parameters["gateway_port"].default
    assert default == DEFAULT_GATEWAY_PORT and 1024 < default < 65536
    assert inspect.signature(up).parameters["metrics"].default is True  # metrics on by default


def test_up_refuses_a_taken_gateway_port_naming_the_option(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = run("up", "--gateway-port", str(port), env={"FLOWMAKER_STATE_FILE": str(tmp_path / "st" / "stack.json")})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: UNAVAILABLE PORT_IN_USE: --gateway-port:") and str(port) in lines[0]
    assert not (tmp_path / "st" / "stack.json").exists()  # nothing started, nothing written
    p = run("up", "--gateway-port", "50999", "--port", "50999",
            env={"FLOWMAKER_STATE_FILE": str(tmp_path / "st" / "stack.json")})
    assert p.returncode == 1 and p.stderr.startswith("error: INVALID_ARGUMENT: --gateway-port:"), p.stderr
    p = run("up", "--gateway-port", "70000")
    assert p.returncode == 2 and "--gateway-port" in p.stderr


def test_up_engine_user_reaches_only_the_deployer_and_a_bad_one_is_refused_first(tmp_path: Path) -> None:
    """`flowmaker up --engine-user` becomes FLOWMAKER_DEPLOYER_ENGINE_USER (no other service gets it); an unknown
    user is one INVALID_ARGUMENT line naming the option before anything starts."""
    from flowmaker.launcher.stack import StackConfig, service_env

    for svc in ("deployer", "orchestrator"):
        env = service_env(svc, host="127.0.0.1", port=1, addrs={}, etcd_endpoint="e:1",
                          cfg=StackConfig(engine_user="nobody"), log_dir=tmp_path)
        assert (env.get("FLOWMAKER_DEPLOYER_ENGINE_USER") == "nobody") == (svc == "deployer")
        assert not any(k.endswith("_ENGINE_USER") for k in env if svc != "deployer")
    assert "FLOWMAKER_DEPLOYER_ENGINE_USER" not in service_env(
        "deployer", host="127.0.0.1", port=1, addrs={}, etcd_endpoint="e:1", cfg=StackConfig(), log_dir=tmp_path)
    p = run("up", "--engine-user", "no-such-user-fm", env={"FLOWMAKER_STATE_FILE": str(tmp_path / "st" / "stack.json")})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: INVALID_ARGUMENT: --engine-user:") and "no-such-user-fm" in lines[0]
    assert not (tmp_path / "st" / "stack.json").exists()


def test_stack_config_gateway_port_taken_is_a_stack_error(tmp_path: Path) -> None:
    from flowmaker.launcher import LocalStack, StackConfig, StackError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        stack = LocalStack(StackConfig(work_dir=tmp_path / "w", gateway_port=port))
        with pytest.raises(StackError, match=f"gateway's port 127.0.0.1:{port} is in use") as e:
            stack.start()
    assert e.value.field == "gateway_port"


# ---- private files -----------------------------------------------------------------------------------------


def test_write_state_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowmaker.launcher.stack import default_state_dir, write_state

    new = tmp_path / "a" / "b" / "stack.json"
    write_state(new, {"pid": 1})
    assert mode(new) == 0o600 and mode(new.parent) == 0o700 and mode(new.parent.parent) == 0o700
    # The default ~/.flowmaker of an older FlowMaker (0755, a 0644 state file) is tightened.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    legacy = default_state_dir()
    legacy.mkdir(parents=True)
    os.chmod(legacy, 0o755)
    (legacy / "stack.json").write_text("{}")
    os.chmod(legacy / "stack.json", 0o644)
    (legacy / "stack.tmp").write_text("")
    os.chmod(legacy / "stack.tmp", 0o644)  # a leftover temp file keeps no wider mode either
    write_state(legacy / "stack.json", {"pid": 1})
    assert mode(legacy) == 0o700 and mode(legacy / "stack.json") == 0o600
    # A directory the user named and that exists (it may be shared, like /tmp) is not chmodded.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    write_state(shared / "stack.json", {"pid": 1})
    assert mode(shared) == 0o755 and mode(shared / "stack.json") == 0o600


def test_state_holds_paths_not_secrets(tmp_path: Path) -> None:
    from flowmaker.launcher import LocalStack, StackConfig
    from flowmaker.launcher.stack import admin_token
    from flowmaker.rpc.tls import ensure_pki

    stack = LocalStack(StackConfig(tls=True))
    stack.pki_dir = ensure_pki(tmp_path / "pki")
    token = admin_token(stack.pki_dir)
    st = stack.state()
    assert token not in json.dumps(st)
    assert "token" not in st["tls"]
    assert st["tls"]["tokens_file"] == str(tmp_path / "pki" / "tokens.json")
    assert mode(tmp_path / "pki") == 0o700 and mode(tmp_path / "pki" / "tokens.json") == 0o600
    assert mode(Path(st["tls"]["key"])) == 0o600


# ---- credentials: flags, env vars, the state file -----------------------------------------------------------


@pytest.fixture()
def pki(tmp_path: Path) -> Path:
    from flowmaker.launcher.stack import admin_token
    from flowmaker.rpc.auth import write_tokens
    from flowmaker.rpc.tls import ensure_pki

    d = ensure_pki(tmp_path / "pki", identities=("admin",))
    write_tokens(d / "tokens.json", {"alice-token": {"user": "alice"}})
    admin_token(d)
    return d


def _admin_of(pki: Path) -> str:
    return next(t for t, who in json.loads((pki / "tokens.json").read_text()).items() if who.get("admin"))


def test_credentials_from_env(pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowmaker.launcher.client import ServerOnlyTls, credentials, settings
    from flowmaker.rpc.tls import TlsFiles

    for k in [k for k in os.environ if k.startswith("FLOWMAKER_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("FLOWMAKER_STATE_FILE", str(tmp_path / "none.json"))
    assert credentials(("h:1",), settings()) == (None, "")
    monkeypatch.setenv("FLOWMAKER_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("FLOWMAKER_TOKEN_FILE", str(pki / "tokens.json"))
    tls, token = credentials(("h:1",), settings())
    assert isinstance(tls, ServerOnlyTls) and token == _admin_of(pki)  # a tokens.json: its admin token
    assert tls.read()[1:] == (None, None)  # TLS with no client certificate
    monkeypatch.setenv("FLOWMAKER_TLS_CERT", str(pki / "admin.pem"))
    monkeypatch.setenv("FLOWMAKER_TLS_KEY", str(pki / "admin.key"))
    monkeypatch.setenv("FLOWMAKER_TOKEN", "explicit")
    tls, token = credentials(("h:1",), settings())
    assert tls == TlsFiles(str(pki / "ca.pem"), str(pki / "admin.pem"), str(pki / "admin.key")) and token == "explicit"
    (tmp_path / "mine").write_text("  bob-token\n")
    monkeypatch.delenv("FLOWMAKER_TOKEN")
    monkeypatch.setenv("FLOWMAKER_TOKEN_FILE", str(tmp_path / "mine"))
    assert credentials(("h:1",), settings())[1] == "bob-token"


@pytest.mark.parametrize(("env", "field", "needle"), [
    ({"FLOWMAKER_TLS_CA": "/no/such/ca.pem"}, "FLOWMAKER_TLS_CA", "cannot read /no/such/ca.pem"),
    ({"FLOWMAKER_TLS_CA": "{ca}", "FLOWMAKER_TLS_CERT": "{cert}"}, "FLOWMAKER_TLS_KEY", "go together"),
    ({"FLOWMAKER_TLS_CERT": "{cert}", "FLOWMAKER_TLS_KEY": "{key}"}, "FLOWMAKER_TLS_CA", "CA is needed"),
    ({"FLOWMAKER_TOKEN_FILE": "/no/such/token"}, "FLOWMAKER_TOKEN_FILE", "cannot read"),
    ({"FLOWMAKER_TOKEN_FILE": "{empty}"}, "FLOWMAKER_TOKEN_FILE", "holds no token"),
])
def test_bad_credential_settings_name_the_variable(env: dict[str, str], field: str, needle: str, pki: Path,
                                                   tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    files = {"ca": pki / "ca.pem", "cert": pki / "admin.pem", "key": pki / "admin.key", "empty": tmp_path / "empty"}
    p = run("task", "list", "--orchestrator", "127.0.0.1:1", env={k: v.format(**files) for k, v in env.items()})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: INVALID_ARGUMENT: {field}: ") and needle in lines[0], lines[0]


def test_flags_go_before_the_command_and_are_checked(pki: Path) -> None:
    p = run("--tls-ca", "/no/such/ca.pem", "task", "list")
    assert p.returncode == 2 and "--tls-ca" in p.stderr, p.stderr
    p = run("--tls-cert", str(pki / "admin.pem"), "task", "list")
    assert p.returncode == 2 and "--tls-key" in p.stderr, p.stderr


def test_state_file_token_comes_from_its_tokens_file(pki: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from flowmaker.launcher.client import credentials, settings
    from flowmaker.rpc.tls import TlsFiles, pki_files

    for k in [k for k in os.environ if k.startswith("FLOWMAKER_")]:
        monkeypatch.delenv(k)
    f = pki_files(pki, "admin")
    state = tmp_path / "stack.json"
    state.write_text(json.dumps({"pid": os.getpid(), "services": {"orchestrator": "127.0.0.1:7"},
                                 "tls": {"ca": f.ca, "cert": f.cert, "key": f.key,
                                         "tokens_file": str(pki / "tokens.json")}}))
    monkeypatch.setenv("FLOWMAKER_STATE_FILE", str(state))
    assert credentials(("127.0.0.1:7",), settings()) == (TlsFiles(f.ca, f.cert, f.key), _admin_of(pki))
    assert credentials(("127.0.0.1:8",), settings()) == (None, "")  # another stack's address: not these files


# ---- profiles measure: no quiet local measurement -----------------------------------------------------------


def test_profiles_measure_without_a_profiler_fails_loudly(tmp_path: Path) -> None:
    """No profiler answers where the state file says it is (and none was named): exit 1, one line, nothing
    measured (it used to measure on a local engine, store nothing and exit 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tmp_path / "stack.json"
    state.write_text(json.dumps({"pid": os.getpid(), "services": {"profiler": f"127.0.0.1:{port}"}}))
    p = run("profiles", "measure", "Llama-3.2-1B-Instruct", "--json", env={"FLOWMAKER_STATE_FILE": str(state)})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: UNAVAILABLE PROFILER_UNREACHABLE: cannot reach the "
                                                   f"profiler at 127.0.0.1:{port}"), p.stderr
    assert "--local" in lines[0] and p.stdout == ""
