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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn, TextIO

import typer
from rich.console import Console, RenderableType
from rich.table import Table

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


@dataclass(frozen=True, slots=True)
class KeyedColumn:
    """A column of a `keyed_table` beside its key: `min_width`, the narrowest its cells stay legible (wrapped or
    cut with "…"); `keep`, its rank when the terminal is too narrow for all of them (1 = given up last)."""

    name: str
    min_width: int
    justify: Literal["left", "right"] = "left"
    keep: int = 99


def keyed_table(title: str, key: str, columns: Sequence[KeyedColumn],
                rows: Sequence[tuple[str, Mapping[str, RenderableType]]], *, width: int | None) -> Table:
    """A table whose first column (`key`: the ids every other command takes) is never wrapped or cut, whatever
    the width: the other columns wrap or truncate, and when `width` cannot hold them all at their `min_width`
    beside the whole key, the least wanted give way (the caption names them; `--json` has everything).
    `rows`: (key, {column name: cell}). Border and padding: 3 characters a column, plus 1."""
    key_width = max([len(key), *(len(k) for k, _ in rows)])
    kept = list(columns)
    if width is not None:
        by_keep = sorted(kept, key=lambda c: c.keep)
        while kept and key_width + sum(c.min_width for c in kept) + 3 * (len(kept) + 1) + 1 > width:
            kept.remove(by_keep.pop())
    hidden = [c.name for c in columns if c not in kept]
    tab = Table(title=title, caption=f"not shown at this width: {', '.join(hidden)} (widen the terminal or set "
                                     "COLUMNS, or use --json)" if hidden else None)
    tab.add_column(key, no_wrap=True, min_width=key_width)
    for c in kept:
        tab.add_column(c.name, justify=c.justify)
    for k, cells in rows:
        tab.add_row(k, *(cells.get(c.name, "") for c in kept))
    return tab


def tracing_wanted() -> bool:
    """Whether OTEL_TRACES_EXPORTER names an exporter (default none): without one a command's spans would go
    nowhere, and it skips loading the SDK and the gRPC instrumentation (its calls then start no trace of their
    own; the services' spans are roots, as for any untraced client)."""
    names = os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",")
    return any(n.strip().lower() not in ("", "none") for n in names)


def start_tracing() -> None:
    """Trace this command like the services (OTEL_* settings, default exporter none; `flowmaker.cli.main` flushes
    it at exit). Called by the commands that call services, on their first call: the SDK is not loaded for
    `--help` and the offline commands."""
    from flowmaker import telemetry

    try:
        telemetry.setup_tracing("flowmaker-cli")
    except FlowMakerError as e:  # e.g. OTEL_TRACES_EXPORTER=otlp without the exporter installed: run untraced
        typer.echo(f"warning: tracing off: {e}", err=True)


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


def error_line_from(e: FlowMakerError) -> str:
    """The error line of a FlowMaker error raised in this process (its gRPC code, reason and field)."""
    from flowmaker.rpc.errors import code_of  # loads grpc: only on the error path

    return error_line(code_of(e).name, e.message, reason=e.reason, field=e.field)


def fail_from(e: FlowMakerError) -> NoReturn:
    """`fail` for a FlowMaker error raised in this process."""
    typer.echo(error_line_from(e), err=True)
    raise typer.Exit(EXIT_FAILED)
