"""What every `flowmaker` command prints: consoles that do not squash tables in logs, one error line, exit codes.

Exit codes (docs/cli.md, "Exit codes"), the same for every command:

- 0: done;
- 1: failed: the request was refused or went wrong (any gRPC status, an option value FlowMaker rejects,
  a task that ended FAILED, no feasible variant), printed as ONE line on stderr:
  `error: <CODE> [<REASON>]: [<field>: ]<message>`, CODE a gRPC status name (`INVALID_ARGUMENT`,
  `NOT_FOUND`, `UNAVAILABLE`, ...), REASON the stable `ErrorInfo.reason` when there is one;
- 2: command-line usage: an unknown option, a missing argument, a value of the wrong type (reported by
  the argument parser with the command's usage);
- 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn, TextIO

import typer
from rich.console import Console

from flowmaker.errors import FlowMakerError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# Width when output goes to a file, a pipe or a CI log: wide enough that a table keeps one row per
# line (rich would otherwise assume 80 columns and wrap every cell). COLUMNS, when set, wins.
PIPE_WIDTH = 240


def width_for(stream: TextIO) -> int | None:
    """The console width for `stream`: None (rich asks the terminal) on a TTY, else COLUMNS or PIPE_WIDTH."""
    try:
        if stream.isatty():
            return None
    except (AttributeError, ValueError):
        pass
    cols = os.environ.get("COLUMNS", "")
    return int(cols) if cols.isdigit() and int(cols) > 0 else PIPE_WIDTH


def console(*, stderr: bool = False) -> Console:
    """A rich console for stdout (tables, results) or stderr (progress, errors)."""
    return Console(stderr=stderr, width=width_for(sys.stderr if stderr else sys.stdout))


def error_line(code: str, message: str, *, reason: str = "", field: str | None = None) -> str:
    """`error: CODE [REASON]: [field: ]message`, the one format of every failure."""
    where = f" {field}:" if field else ""
    why = f" {reason}" if reason and reason != code else ""
    return f"error: {code}{why}:{where} {' '.join(message.split())}"


def fail(code: str, message: str, *, reason: str = "", field: str | None = None,
         exit_code: int = EXIT_FAILED) -> NoReturn:
    """Print the one error line on stderr and exit (1 unless told otherwise)."""
    typer.echo(error_line(code, message, reason=reason, field=field), err=True)
    raise typer.Exit(exit_code)


def fail_from(e: FlowMakerError) -> NoReturn:
    """`fail` for a FlowMaker error raised in this process (its gRPC code, reason and field)."""
    from flowmaker.rpc.errors import code_of  # loads grpc: only on the error path

    fail(code_of(e).name, e.message, reason=e.reason, field=e.field)
