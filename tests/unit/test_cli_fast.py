"""The CLI starts fast (issue 23): importing it, and `flowmaker --help`, load none of the heavy libraries the
commands use (grpc, protobuf, numpy, scipy, pydantic, aiohttp, the OpenTelemetry SDK); each command imports
what it needs when it runs. Startup times are measured, not asserted (docs/cli.md, "Startup time")."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("grpc", "google.protobuf", "numpy", "scipy", "pydantic", "pydantic_settings", "aiohttp",
         "opentelemetry.sdk", "flowmaker.launcher.client", "flowmaker.telemetry")


def _loaded_after(code: str) -> list[str]:
    probe = (f"import sys, json\n{code}\n"
             f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False,
                       env={"PATH": "/usr/bin:/bin", "FLOWMAKER_STATE_FILE": "/nonexistent/stack.json",
                            "COLUMNS": "120"})
    assert p.returncode == 0, p.stderr
    return list(json.loads(p.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_loads_no_heavy_library() -> None:
    assert _loaded_after("import flowmaker.cli.main") == []


def _help(*argv: list[str]) -> str:
    return ("from flowmaker.cli.main import app\n"
            f"for argv in {list(argv)!r}:\n"
            "    try:\n"
            "        app(argv, prog_name='flowmaker')\n"
            "    except SystemExit:\n"
            "        pass")


def test_help_loads_no_heavy_library() -> None:
    assert _loaded_after(_help(["--help"])) == []
    # Below the top level typer itself (0.29) converts the global options' values with pydantic: that one is
    # typer's; nothing else heavy comes in.
    sub = _loaded_after(_help(["task", "--help"], ["context", "--help"], ["profiles", "--help"], ["task", "list",
                                                                                                  "--help"]))
    assert [m for m in sub if not m.startswith("pydantic")] == []


def test_the_help_texts_constants_agree_with_their_sources() -> None:
    """Spelled in the CLI so its help needs no import of the modules that define them."""
    from flowmaker.cli import profiles_interference, stack
    from flowmaker.launcher.stack import DEFAULT_GATEWAY_PORT
    from flowmaker.profiling.interference import SHARE_SOURCES

    assert stack.DEFAULT_GATEWAY_PORT == DEFAULT_GATEWAY_PORT
    assert profiles_interference.SHARE_SOURCES == SHARE_SOURCES


def test_a_client_command_without_an_exporter_loads_no_tracing_sdk() -> None:
    """`task list` needs grpc and its protos, not the OpenTelemetry SDK when no exporter is configured (the
    default): its spans would go nowhere."""
    code = ("import sys\nsys.argv = ['flowmaker', 'task', 'list', '--orchestrator', '127.0.0.1:1']\n"
            "from flowmaker.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert 'grpc' in sys.modules  # it did make the call")
    assert [m for m in _loaded_after(code) if m in ("opentelemetry.sdk", "flowmaker.telemetry")] == []
