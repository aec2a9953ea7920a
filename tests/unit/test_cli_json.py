"""`--json` prints only JSON, everywhere (issue 23): every command that has the option is run here as a user
runs it (a subprocess; progress and tables may go to stderr) and its stdout must parse as one JSON document;
the commands that need a running stack are json-parsed by the stack tests named in STACK_TESTS. A command that
gains --json without a test here or there fails `test_every_json_command_is_covered`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Commands whose --json needs a stack: the test that runs them and json.loads their output.
STACK_TESTS = {
    "up": "tests/e2e/test_cli_up.py (Up.up)",
    "instances": "tests/e2e/test_cli_up.py", "task deploy": "tests/e2e/test_cli_up.py",
    "task invoke": "tests/e2e/test_cli_up.py", "task get": "tests/e2e/test_cli_up.py",
    "task list": "tests/e2e/test_cli_up.py", "task delete": "tests/e2e/test_cli_up.py",
    "task approve": "tests/e2e/test_cli.py", "profiles measure": "tests/e2e/test_cli_up.py (and --local below)",
    "bench soak": "tests/e2e/test_cli_json_stack.py", "bench live-sharing": "tests/e2e/test_cli_json_stack.py",
    "bench throughput": "tests/e2e/test_cli_json_stack.py",
    "user create": "tests/integration/test_live_users.py", "user token": "tests/integration/test_live_users.py",
    "user list": "tests/integration/test_live_users.py", "user revoke": "tests/integration/test_live_users.py",
}


def _json_commands() -> list[str]:
    import typer

    from flowmaker.cli.main import app

    found: list[str] = []

    def walk(c: Any, path: list[str]) -> None:
        for name, sub in (getattr(c, "commands", None) or {}).items():
            walk(sub, [*path, name])
        if not getattr(c, "commands", None) and any("--json" in getattr(p, "opts", ()) for p in c.params):
            found.append(" ".join(path))

    walk(typer.main.get_command(app), [])
    return found


class HungCommandWarning(UserWarning):
    """A command gave no result within RUN_TIMEOUT_S and was run again; the message holds where its threads were."""


RUN_TIMEOUT_S = 240


def _run_once(tmp: Path, env: dict[str, str], args: tuple[str, ...]) -> subprocess.CompletedProcess[str] | str:
    """The command's result, or (no result within RUN_TIMEOUT_S) the innermost frames of each of its threads: it is
    sent SIGABRT, which PYTHONFAULTHANDLER turns into a traceback of every thread, then its whole process group
    (servers it started, such as `bench fuzz`'s etcd, included) is killed."""
    proc = subprocess.Popen([sys.executable, "-m", "flowmaker.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "PYTHONFAULTHANDLER": "1"}, cwd=tmp,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGABRT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            err = ""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return err[-6000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(tmp: Path, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWMAKER_", "OTEL_"))}
    env.update({"FLOWMAKER_STATE_FILE": str(tmp / "nowhere" / "stack.json"), "FLOWMAKER_CONFIG":
                str(tmp / "config.json"), "COLUMNS": "80", "HOME": str(tmp)})
    p = _run_once(tmp, env, args)
    if isinstance(p, str):
        # A command that hangs once in many runs (CI at d23af87: `bench fuzz --per-rpc 1`, 3 s here in 60 runs, gave
        # nothing in 240 s) is run once more: this test is about what stdout holds; where it hung is reported.
        warnings.warn(HungCommandWarning(f"`flowmaker {' '.join(args)}` gave no result within {RUN_TIMEOUT_S} s; "
                                         f"run again. Its threads:\n{p}"), stacklevel=2)
        p = _run_once(tmp, env, args)
        assert not isinstance(p, str), f"{args}: no result within {RUN_TIMEOUT_S} s, twice; its threads:\n{p}"
    assert p.returncode == 0, f"{args}: rc={p.returncode}\nstdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-2000:]}"
    try:
        return json.loads(p.stdout)
    except ValueError:
        pytest.fail(f"`flowmaker {' '.join(args)}` printed more than JSON on stdout:\n{p.stdout[:3000]}")


RUN_HERE: dict[str, list[str]] = {
    "select": ["select", "--request", str(ROOT / "examples" / "select_request.json"), "--json"],
    "models list": ["models", "list", "--json"],
    "gpus list": ["gpus", "list", "--json"],
    "profiles show": ["profiles", "show", "Llama-3.2-1B-Instruct", "--json"],
    "traces stats": ["traces", "stats", "trace.csv", "--json"],
    "context add": ["context", "add", "k8s", "--orchestrator", "10.0.0.1:50055", "--json"],
    "context current": ["context", "current", "--json"],
    "context list": ["context", "list", "--json"],
    "bench fuzz": ["bench", "fuzz", "--per-rpc", "1", "--out", "fuzz", "--json"],
    "bench serving": ["bench", "serving", "--loads", "0.25", "--policies", "flowmaker", "--trace-kinds", "code",
                      "--segment-requests", "30", "--out", "serving", "--json"],
    "bench adapt": ["bench", "adapt", "--loads", "0.25", "--trace-kinds", "code", "--replay", "segment",
                    "--segment-s", "60", "--out",
                    "adapt", "--json"],
    "bench selector": ["bench", "selector", "--quick", "--section", "paper", "--out", "selector", "--json"],
    "profiles measure-interference": ["profiles", "measure-interference", "--gpu-type", "A6000", "--emulated",
                                      "--no-store", "--window", "2", "--shares", "0.3", "--json"],
}


def test_every_json_command_is_covered() -> None:
    missing = [c for c in _json_commands() if c not in RUN_HERE and c not in STACK_TESTS]
    assert not missing, f"commands with --json and no test of it: {missing}"


@pytest.mark.parametrize("command", sorted(RUN_HERE))
def test_json_is_all_that_stdout_holds(command: str, tmp_path: Path) -> None:
    if command == "traces stats":
        subprocess.run([sys.executable, "-m", "flowmaker.cli.main", "traces", "synth", "--kind", "code", "--out",
                        str(tmp_path / "trace.csv"), "--requests", "50"], check=True, capture_output=True,
                       timeout=120)
    if command == "context current":
        run(tmp_path, *RUN_HERE["context add"])
    out = run(tmp_path, *RUN_HERE[command])
    assert out not in (None, "", [], {}), out


def test_profiles_measure_local_prints_json_only(tmp_path: Path) -> None:
    rows = run(tmp_path, "profiles", "measure", "Llama-3.2-1B-Instruct", "--local", "--time-scale", "20",
               "--repeats", "1", "--json")
    assert rows and rows[0]["mode"] == "local"
