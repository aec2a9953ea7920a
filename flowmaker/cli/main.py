"""Entry point of the `flowmaker` command: one typer app, each area's commands in its own module."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperOption

app = typer.Typer(help="FlowMaker: serve multi-step LLM workflows at least cost within SLOs.",
                  no_args_is_help=True, pretty_exceptions_enable=False)


# typer's rich help prints a type for every option, `<bool>` for a plain flag too, which takes no value: a
# flag (not a counter) shows none, as click's plain help does.
_display_type_rich = TyperOption.display_type_rich


def _flag_shows_no_type(self: TyperOption, ctx: Any) -> str | None:
    if self.is_flag and not self.count:
        return None
    return _display_type_rich(self, ctx)


TyperOption.display_type_rich = _flag_shows_no_type  # type: ignore[method-assign]

_PEM = {"exists": True, "dir_okay": False, "readable": True, "resolve_path": True}


@app.callback()
def _connection(
    tls_ca: Annotated[Path | None, typer.Option(
        "--tls-ca", metavar="PEM", **_PEM, help="The stack's CA: TLS to every service (env FLOWMAKER_TLS_CA; default: "
                                                "the state file of a running `flowmaker up`).")] = None,
    tls_cert: Annotated[Path | None, typer.Option(
        "--tls-cert", metavar="PEM", **_PEM, help="Client certificate of that CA, with --tls-key (env "
                                                  "FLOWMAKER_TLS_CERT): needed by every service but the orchestrator.")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option("--tls-key", metavar="PEM", **_PEM,
                                                 help="Key of --tls-cert (env FLOWMAKER_TLS_KEY).")] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", metavar="FILE", **_PEM, help="The orchestrator's bearer token: a file with the token alone, "
                                                     "or a tokens.json (its admin token). Env FLOWMAKER_TOKEN_FILE; "
                                                     "FLOWMAKER_TOKEN holds a token itself.")] = None,
    context: Annotated[str | None, typer.Option(
        "--context", metavar="NAME", help="Talk to this context's stack (`flowmaker context list`) instead of the "
                                          "current one (env FLOWMAKER_CONTEXT).")] = None,
) -> None:
    """Options for reaching a stack this CLI did not start (compose, Kubernetes, another `flowmaker up`); they go
    before the command (`flowmaker --tls-ca ca.pem task list`) and win over the environment variables."""
    if (tls_cert is None) != (tls_key is None):
        given, missing = ("--tls-cert", "--tls-key") if tls_cert is not None else ("--tls-key", "--tls-cert")
        raise typer.BadParameter(f"{given} needs {missing} (a client certificate and its key go together)",
                                 param_hint=missing)
    for var, value in (("FLOWMAKER_TLS_CA", tls_ca), ("FLOWMAKER_TLS_CERT", tls_cert),
                       ("FLOWMAKER_TLS_KEY", tls_key), ("FLOWMAKER_TOKEN_FILE", token_file),
                       ("FLOWMAKER_CONTEXT", context)):
        if value is not None:  # read by flowmaker.launcher.client.settings(), here and in what this process starts
            os.environ[var] = str(value)
    if os.environ.get("FLOWMAKER_CONTEXT"):
        # A context that does not exist is an error before any command runs (settings() alone would ignore it).
        from flowmaker.cli.output import fail
        from flowmaker.launcher.client import settings
        from flowmaker.launcher.contexts import ContextError, active

        s = settings()
        try:
            active(s.config_file, s.context)
        except ContextError as e:
            fail("NOT_FOUND", e.message, field="--context" if context else "FLOWMAKER_CONTEXT")

# (module, attribute) of each area's commands; each module exposes `register(app)`.
_AREAS = (
    "flowmaker.cli.catalog",  # models list, profiles show
    "flowmaker.cli.select",  # select
    "flowmaker.cli.bench",  # bench selector, bench serving
    "flowmaker.cli.traces",  # traces download / synth
    "flowmaker.cli.stack",  # up, task ..., instances
    "flowmaker.cli.profiles_measure",  # profiles measure
    "flowmaker.cli.demo",  # demo
    "flowmaker.cli.context",  # context add/use/list/current/remove
    "flowmaker.cli.users",  # user create/token/list/revoke
)

for _mod in _AREAS:
    try:
        _m = importlib.import_module(_mod)
    except ModuleNotFoundError as e:  # an area not built yet must not break the others
        if e.name != _mod:
            raise
        continue
    _m.register(app)


def main() -> None:
    """The `flowmaker` command. Client commands are traced like the services (OTEL_* settings, default
    exporter none; `flowmaker.cli.output.start_tracing`): one span per command, flushed before the process
    exits."""
    from flowmaker.errors import FlowMakerError

    try:
        app()
    except FlowMakerError as e:
        # One a command did not turn into its error line itself (e.g. `bench serving --colocation-kappa 9`, rejected
        # by the core): the same one line and exit 1 as every other failure (flowmaker.cli.output), no traceback.
        from flowmaker.cli.output import EXIT_FAILED, error_line_from

        typer.echo(error_line_from(e), err=True)
        raise SystemExit(EXIT_FAILED) from None
    finally:
        telemetry = sys.modules.get("flowmaker.telemetry")  # loaded only by a command that traced
        if telemetry is not None:
            telemetry.shutdown_tracing()


if __name__ == "__main__":
    main()
