"""Entry point of the `flowmaker` command: one typer app, each area's commands in its own module."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="FlowMaker: serve multi-step LLM workflows at least cost within SLOs.",
                  no_args_is_help=True, pretty_exceptions_enable=False)

# (module, attribute) of each area's commands; each module exposes `register(app)`.
_AREAS = (
    "flowmaker.cli.catalog",  # models list, profiles show
    "flowmaker.cli.select",  # select
    "flowmaker.cli.bench",  # bench selector, bench serving
    "flowmaker.cli.traces",  # traces download / synth
    "flowmaker.cli.stack",  # up, task ..., instances
    "flowmaker.cli.profiles_measure",  # profiles measure
    "flowmaker.cli.demo",  # demo
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
    exporter none): one span per command, flushed before the process exits."""
    from flowmaker import telemetry
    from flowmaker.errors import FlowMakerError

    try:
        telemetry.setup_tracing("flowmaker-cli")
    except FlowMakerError as e:  # e.g. OTEL_TRACES_EXPORTER=otlp without the exporter installed: run untraced
        typer.echo(f"warning: tracing off: {e}", err=True)
    try:
        app()
    finally:
        telemetry.shutdown_tracing()


if __name__ == "__main__":
    main()
