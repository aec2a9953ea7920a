"""One error format and one set of exit codes for every command (flowmaker/cli/output.py, docs/cli.md), offline
commands included, and consoles that do not squash tables when output is not a terminal."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from flowmaker.cli.output import PIPE_WIDTH, error_line, width_for

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "FLOWMAKER_STATE_FILE": "/nonexistent", **env},
                          cwd=ROOT, timeout=120, check=False)


@pytest.mark.parametrize(("args", "prefix"), [
    (["profiles", "show", "no-such-model"], "error: NOT_FOUND"),
    (["select", "--request", "/no/such/file.json"], "error: INVALID_ARGUMENT: --request: cannot read"),
    (["select", "--request", "examples/select_request.json", "--strategy", "fastest"],
     "error: INVALID_ARGUMENT UNKNOWN_STRATEGY: strategy: unknown selection strategy"),
    (["task", "deploy", "x", "--accuracy", "0.1", "--latency", "3", "--approve", "all", "--strategy", "fastest"],
     "error: INVALID_ARGUMENT UNKNOWN_STRATEGY: --strategy:"),
    (["task", "deploy", "x", "--accuracy", "0.1", "--latency", "3", "--strategy", "exact"],
     "error: INVALID_ARGUMENT: --strategy: --strategy applies to the approval"),
    (["traces", "stats", "/no/such/trace.csv"], "error: "),
])
def test_failures_are_one_line_and_exit_1(args: list[str], prefix: str) -> None:
    p = run(*args)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert len(lines) == 1 and lines[0].startswith(prefix), p.stderr
    assert "Traceback" not in p.stderr


def test_usage_errors_exit_2() -> None:
    p = run("task", "deploy", "x", "--accuracy", "high", "--latency", "3")
    assert p.returncode == 2, p.stderr


def test_error_line_format() -> None:
    assert error_line("NOT_FOUND", "no task  'x'\n", field="task_id") == "error: NOT_FOUND: task_id: no task 'x'"
    assert error_line("INVALID_ARGUMENT", "m", reason="INVALID_ARGUMENT") == "error: INVALID_ARGUMENT: m"
    assert error_line("UNAVAILABLE", "m", reason="STACK_START_FAILED") == "error: UNAVAILABLE STACK_START_FAILED: m"


def test_width_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert width_for(io.StringIO()) == PIPE_WIDTH > 80
    monkeypatch.setenv("COLUMNS", "132")
    assert width_for(io.StringIO()) == 132

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert width_for(Tty()) is None  # a terminal: rich asks it


def test_a_wide_table_is_not_squashed_in_a_pipe() -> None:
    p = run("models", "list")  # 8 columns, about 100 characters wide; stdout is a pipe, COLUMNS unset
    assert p.returncode == 0, p.stderr
    row = [ln for ln in p.stdout.splitlines() if "Llama-3.2-1B-Instruct" in ln]
    assert row and "131072" in row[0], p.stdout  # one row on one line (at 80 columns the cells wrap)
    assert max(len(ln) for ln in p.stdout.splitlines()) > 80
