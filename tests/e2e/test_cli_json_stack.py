"""`--json` prints only JSON on the benchmarks that start a stack of their own (`bench soak`, `bench
live-sharing`), each on the smallest run that exercises its whole path; the other commands' --json are run in
tests/unit/test_cli_json.py. Skip with FLOWMAKER_SKIP_E2E=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]

COMMANDS = {
    "bench soak": ["bench", "soak", "--duration", "5", "--tasks", "1", "--rate", "1", "--faults", "engine", "--gap",
                   "3", "--out", "soak", "--json"],
    "bench live-sharing": ["bench", "live-sharing", "--tasks", "summarize", "--duration", "3", "--warmup", "0",
                           "--drain", "2", "--time-scale", "10", "--out", "ls", "--json"],
    "bench throughput": ["bench", "throughput", "--rates", "5", "--duration", "1", "--out", "tp", "--json"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_stack_benchmarks_print_json_only(command: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWMAKER_", "OTEL_"))}
    env.update({"HOME": str(tmp_path), "FLOWMAKER_STATE_FILE": str(tmp_path / "nowhere" / "stack.json")})
    p = subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *COMMANDS[command]], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=600, check=False)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stderr[-3000:]}"
    try:
        out = json.loads(p.stdout)
    except ValueError:
        pytest.fail(f"`flowmaker {command} --json` printed more than JSON:\n{p.stdout[:3000]}")
    assert isinstance(out, dict) and out
    if command == "bench throughput":  # every front door answered the small load
        assert {r["path"] for r in out["rows"]} == {"grpc-admin", "grpc-user", "gateway"}
        assert all(r["ok"] == r["sent"] > 0 and not r["errors"] for r in out["rows"]), out["rows"]
