"""`flowmaker profiles measure`: a measured sweep against local engines (emulated by default), analytic vs measured."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from flowmaker.catalog import get_gpu_type, get_model
from flowmaker.errors import FlowMakerError
from flowmaker.profiling.measure import (
    BackendLauncher,
    MeasuredConfig,
    Progress,
    SweepPlan,
    measure_model,
    percent_diff,
)

FIELDS = (("memory_gb_per_gpu", "mem/GPU GB", 1.0, "{:.1f}"), ("fixed_s", "fixed ms", 1e3, "{:.2f}"),
          ("prefill_s_per_token", "prefill ms/tok", 1e3, "{:.4f}"), ("decode_s_per_token", "decode ms/tok", 1e3,
                                                                     "{:.2f}"),
          ("max_output_tokens_per_s", "max out tok/s", 1.0, "{:.0f}"))


def measure(
    model: Annotated[str, typer.Argument(help="Catalog model id or Hugging Face id.")],
    gpu: Annotated[str, typer.Option("--gpu", help="GPU type whose analytic profile the emulator is built from.")]
    = "A6000",
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel degree.")] = 1,
    time_scale: Annotated[float, typer.Option("--time-scale", min=0.01,
                                              help="Emulated engine seconds per wall second. Higher is faster but "
                                                   "the emulator's ~1 ms timer jitter is multiplied by it: fixed_s "
                                                   "holds within 10% up to about 4.")] = 4.0,
    backend: Annotated[str, typer.Option("--backend", help="Engine backend: emulated, or vllm / trtllm on a GPU "
                                                           "host (time scale then 1).")] = "emulated",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Sends of each single-request point.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Start (model, tp, pp) on a local engine, sweep it, fit a MEASURED profile, and compare it with the analytic one.

    Needs no stack: the engine is started directly through the deployer's backends. On the emulated
    engine (built from the analytic profile) the difference checks the measurement pipeline.
    """
    err = Console(stderr=True)
    try:
        m, g = get_model(model), get_gpu_type(gpu)
        plan = SweepPlan(output_tokens=(4, 16, 64), repeats=repeats, throughput_output_tokens=64)
        launcher = BackendLauncher(backend, time_scale=time_scale if backend == "emulated" else 1.0)
        last = {"phase": ""}

        def progress(p: Progress) -> None:
            if p.phase != last["phase"] and not as_json:
                err.print(f"tp={p.tp} pp={p.pp}: {p.phase} ({p.fraction:.0%})")
                last["phase"] = p.phase

        results = asyncio.run(measure_model(m, g, [(tp, pp)], launcher, plan, on_progress=progress))
    except FlowMakerError as e:
        err.print(f"[red]error[/red] ({e.reason}): {e}")
        raise typer.Exit(code=2) from None
    if as_json:
        typer.echo(json.dumps([_row(r) for r in results], indent=2))
        return
    for r in results:
        Console().print(_table(r, backend, time_scale))


def _row(r: MeasuredConfig) -> dict[str, object]:
    out: dict[str, object] = {"model_id": r.profile.model_id, "gpu_type": r.profile.gpu_type, "tp": r.profile.tp,
                              "pp": r.profile.pp, "memory_source": r.memory_source, "sweep_wall_s": round(r.wall_s, 2),
                              "overhead_s": r.overhead_s}
    for f, *_ in FIELDS:
        a, mv = getattr(r.analytic, f), getattr(r.profile, f)
        out[f] = {"analytic": a, "measured": mv, "diff_percent": round(percent_diff(mv, a), 2)}
    return out


def _table(r: MeasuredConfig, backend: str, time_scale: float) -> Table:
    scale = f", time scale {time_scale:g}" if backend == "emulated" else ""
    t = Table(title=f"{r.profile.model_id} on {r.profile.gpu_type}, tp={r.profile.tp} pp={r.profile.pp} "
                    f"({backend}{scale}; sweep {r.wall_s:.1f}s; memory from {r.memory_source})")
    for c in ("", "analytic", "measured", "diff %"):
        t.add_column(c, justify="right" if c else "left")
    for f, label, mult, fmt in FIELDS:
        a, mv = getattr(r.analytic, f), getattr(r.profile, f)
        t.add_row(label, fmt.format(a * mult), fmt.format(mv * mult), f"{percent_diff(mv, a):+.1f}")
    return t


def register(app: typer.Typer) -> None:
    """Add `measure` to the `profiles` group (created when the catalog commands are not loaded)."""
    for group in app.registered_groups:
        if group.name == "profiles" and group.typer_instance is not None:
            group.typer_instance.command("measure")(measure)
            return
    profiles = typer.Typer(help="Profiles of a model on a GPU type.", no_args_is_help=True)
    profiles.command("measure")(measure)
    app.add_typer(profiles, name="profiles")
