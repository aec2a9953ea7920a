"""`flowmaker context add|use|list|current|remove`: named stacks to talk to, as kubectl's contexts.

The store is `flowmaker.launcher.contexts`; how a context ranks against the flags and the environment is
`flowmaker.launcher.client`'s. No gRPC here: these commands start as fast as `--help`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from flowmaker.cli.output import console, error_line

ctx_app = typer.Typer(help="Named stacks to talk to (addresses, CA, client certificate, token file), as kubectl's "
                           "contexts; stored 0600 in FLOWMAKER_CONFIG (default ~/.flowmaker/config.json).",
                      no_args_is_help=True)

_PEM = {"exists": True, "dir_okay": False, "readable": True, "resolve_path": True}
_ADDR = re.compile(r"^[^\s,/]+:\d{1,5}$")
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _die(line: str) -> NoReturn:
    typer.echo(line, err=True)
    raise typer.Exit(1)


def _path() -> Path:
    from flowmaker.launcher.client import settings

    return settings().config_file


def _check_addr(value: str, opt: str) -> str:
    for a in value.split(","):
        if not _ADDR.match(a.strip()):
            _die(error_line("INVALID_ARGUMENT", f"expected host:port (replicas separated by commas), got {value!r}",
                            field=opt))
    return ",".join(a.strip() for a in value.split(","))


@ctx_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="The context's name (replaces one of that name).")],
    orchestrator: Annotated[str, typer.Option("--orchestrator", metavar="HOST:PORT[,...]",
                                              help="The orchestrator (replicas separated by commas).")] = "",
    deployer: Annotated[str, typer.Option("--deployer", metavar="HOST:PORT", help="The deployer (`instances`).")
                        ] = "",
    profiler: Annotated[str, typer.Option("--profiler", metavar="HOST:PORT", help="The profiler "
                                                                                  "(`profiles measure`).")] = "",
    gateway: Annotated[str, typer.Option("--gateway", metavar="URL", help="The OpenAI-compatible base URL "
                                                                          "(listed, for your clients).")] = "",
    ca: Annotated[Path | None, typer.Option("--ca", metavar="PEM", **_PEM, help="The stack's CA (TLS).")] = None,
    cert: Annotated[Path | None, typer.Option("--cert", metavar="PEM", **_PEM,
                                              help="A client certificate of that CA (with --key): needed by "
                                                   "every service but the orchestrator.")] = None,
    key: Annotated[Path | None, typer.Option("--key", metavar="PEM", **_PEM, help="The key of --cert.")] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", metavar="FILE", **_PEM, help="The orchestrator's bearer token: a file with the token "
                                                     "alone, or a tokens.json (its admin token).")] = None,
    use: Annotated[bool, typer.Option("--use", help="Make it the current context (the first one added is).")
                   ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Add (or replace) a context: the files are kept as absolute paths, never copied."""
    from flowmaker.launcher.contexts import Context, ContextError, upsert

    if (cert is None) != (key is None):
        _die(error_line("INVALID_ARGUMENT", "a client certificate and its key go together",
                        field="--key" if cert is not None else "--cert"))
    if (cert is not None or token_file is not None) and ca is None:
        _die(error_line("INVALID_ARGUMENT", "a client certificate or a token is sent over TLS only: give the "
                        "stack's CA", field="--ca"))
    if gateway and not gateway.startswith(("http://", "https://")):
        _die(error_line("INVALID_ARGUMENT", f"expected an http(s) URL, got {gateway!r}", field="--gateway"))
    ctx = Context(orchestrator=_check_addr(orchestrator, "--orchestrator") if orchestrator else "",
                  deployer=_check_addr(deployer, "--deployer") if deployer else "",
                  profiler=_check_addr(profiler, "--profiler") if profiler else "", gateway=gateway,
                  tls_ca=str(ca or ""), tls_cert=str(cert or ""), tls_key=str(key or ""),
                  token_file=str(token_file or ""))
    path = _path()
    try:
        c = upsert(path, name, ctx, make_current=True if use else None)
    except ContextError as e:
        _die(error_line("INVALID_ARGUMENT", e.message, field=e.field))
    except OSError as e:
        _die(error_line("FAILED_PRECONDITION", f"cannot write {path}: {e.strerror or e}", field="FLOWMAKER_CONFIG"))
    if as_json:
        typer.echo(json.dumps({"name": name, "current": c.current == name, **ctx.to_json()}, indent=2))
    else:
        typer.echo(f"context {name} saved in {path}" + ("; it is the current context" if c.current == name else
                                                        f"; use it with `flowmaker context use {name}`"))


@ctx_app.command("use")
def use_(name: Annotated[str, typer.Argument(help="The context to make current.")]) -> None:
    """Make a context the current one: every command then talks to its stack."""
    from flowmaker.launcher.contexts import load, save

    path = _path()
    c = load(path)
    if c.get(name) is None:
        _die(error_line("NOT_FOUND", f"no context {name!r} in {path} (known: {', '.join(sorted(c.all)) or 'none'})",
                        field="NAME"))
    c.current = name
    save(path, c)
    typer.echo(f"switched to context {name}")


@ctx_app.command("remove")
def remove(name: Annotated[str, typer.Argument(help="The context to remove.")]) -> None:
    """Remove a context (the files it names stay); when it was current, no context is."""
    from flowmaker.launcher.contexts import load, save

    path = _path()
    c = load(path)
    if c.all.pop(name, None) is None:
        _die(error_line("NOT_FOUND", f"no context {name!r} in {path}", field="NAME"))
    if c.current == name:
        c.current = ""
    save(path, c)
    typer.echo(f"removed context {name}")


@ctx_app.command("current")
def current(as_json: JsonOpt = False) -> None:
    """Print the context in use (FLOWMAKER_CONTEXT or the current one); exit 1 when there is none."""
    from flowmaker.launcher.client import settings
    from flowmaker.launcher.contexts import ContextError, active

    s = settings()
    try:
        found = active(s.config_file, s.context)
    except ContextError as e:
        _die(error_line("NOT_FOUND", e.message, field=e.field))
    if found is None:
        _die(error_line("NOT_FOUND", f"no current context in {s.config_file}; `flowmaker context use NAME`"))
    typer.echo(json.dumps({"name": found[0], **found[1].to_json()}, indent=2) if as_json else found[0])


@ctx_app.command("list")
def list_(as_json: JsonOpt = False) -> None:
    """List the contexts; the current one is marked *."""
    from rich.table import Table

    from flowmaker.launcher.client import settings
    from flowmaker.launcher.contexts import ContextError, load

    s = settings()
    try:
        c = load(s.config_file)
    except ContextError as e:
        _die(error_line("FAILED_PRECONDITION", e.message, field=e.field))
    if as_json:
        typer.echo(json.dumps({"current": c.current, "contexts": {n: x.to_json() for n, x in sorted(c.all.items())}},
                              indent=2))
        return
    tab = Table(title=f"{len(c.all)} context(s) in {s.config_file}")
    for col in ("", "name", "orchestrator", "deployer", "profiler", "TLS", "token file"):
        tab.add_column(col, no_wrap=col == "name")
    for n, x in sorted(c.all.items()):
        tls = ("mTLS" if x.tls_cert else "TLS (CA only)") if x.tls_ca else "plaintext"
        tab.add_row("*" if n == c.current else "", n, x.orchestrator or "-", x.deployer or "-", x.profiler or "-",
                    tls, x.token_file or "-")
    console().print(tab)


def register(app: typer.Typer) -> None:
    app.add_typer(ctx_app, name="context")
