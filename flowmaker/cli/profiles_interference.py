"""`flowmaker profiles measure-interference`: measure kappa of a GPU type (flowmaker.sharing) with two engines on one
GPU, print it, and store it in etcd (`flowmaker.state.interference`) where the GPU-sharing model reads it.

The engines are either two running OpenAI-compatible servers placed on the same GPU(s) by the caller
(`--engine-a URL --engine-b URL`: trtllm-serve, vLLM or emulated engines), or, with `--emulated`, two emulated
engines started here on one emulated GPU (`--gpu-ids`, `--gpu-share-dir`), which checks the pipeline (the
emulator shares its GPU by processor sharing: kappa about 1). The measurement: `flowmaker.profiling.interference`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import tempfile
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from flowmaker.cli.output import console, fail, fail_from

if TYPE_CHECKING:  # aiohttp and numpy behind these: imported where used, so `--help` stays fast
    from flowmaker.profiling.interference import InterferencePlan, InterferenceResult
    from flowmaker.state.interference import InterferenceRecord

# flowmaker.profiling.interference.SHARE_SOURCES, spelled here for the help text without importing it (a test
# checks that they agree).
SHARE_SOURCES = ("engine_busy_time", "sampled_running", "estimated")

API_KEY_ENV = "FLOWMAKER_ENGINE_API_KEY"  # the engines' /v1 key, when they need one (never on the command line)


def measure_interference_cmd(
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="GPU type the engines run on (the record's key).")],
    engine_a: Annotated[str, typer.Option("--engine-a", help="URL of engine A (the one whose latency is "
                                                             "measured), e.g. http://127.0.0.1:8000.")] = "",
    engine_b: Annotated[str, typer.Option("--engine-b", help="URL of engine B (the one loaded), on the same "
                                                             "GPU(s) as A.")] = "",
    emulated: Annotated[bool, typer.Option("--emulated", help="Start two emulated engines here sharing one "
                                                              "emulated GPU instead of --engine-a/--engine-b.")]
    = False,
    time_scale: Annotated[float | None, typer.Option("--time-scale", min=0.01,
                                                     help="Engine seconds per wall second: --emulated engines run "
                                                          "at it (default 10); the URLs' engines must run at it "
                                                          "(default 1: real engines).")] = None,
    model: Annotated[str, typer.Option("--model", help="`model` to send to the URLs' engines (default: the first "
                                                       "their /v1/models lists).")] = "",
    shares: Annotated[str, typer.Option("--shares", help="Target busy shares of B, one load level each "
                                                         "(comma-separated).")] = "0.15,0.3,0.45",
    window: Annotated[float | None, typer.Option("--window", min=0.1, help="Engine seconds of A's probes per "
                                                                           "level (default 30; --emulated 40), "
                                                                           "at least 30 of B's lone calls.")]
    = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the Poisson arrival times.")] = 0,
    share_source: Annotated[str, typer.Option("--share-source", help="How B's busy share is read: "
                                                                     f"{', '.join(SHARE_SOURCES)} (default: the "
                                                                     "best B's /metrics allows).")] = "",
    etcd: Annotated[str, typer.Option("--etcd", help="etcd endpoints to store the result in (default: "
                                                     "FLOWMAKER_ETCD_ENDPOINTS, else the running `flowmaker up` "
                                                     "stack's etcd).")] = "",
    etcd_namespace: Annotated[str, typer.Option("--etcd-namespace", envvar="FLOWMAKER_ETCD_NAMESPACE",
                                                help="Key prefix of the stack's etcd keys.")] = "",
    no_store: Annotated[bool, typer.Option("--no-store", help="Measure and print only.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON record.")] = False,
) -> None:
    """Measure how much GPU sharing slows an instance (kappa of the sharing model) on a GPU type, and store it.

    Engine B is loaded open loop at 2-3 levels while engine A's latency is probed at a light load; kappa is the
    least-squares slope through the origin of (A's slowdown - 1) against B's busy share. Prints a table and the
    record stored under /flowmaker/v1/interference/<gpu_type> (docs/profiles.md, "Interference").
    """
    err = console(stderr=True)
    if emulated == bool(engine_a or engine_b):
        fail("INVALID_ARGUMENT", "give --engine-a and --engine-b (two engines on the same GPU), or --emulated",
             field="engine_a")
    if not emulated and not (engine_a and engine_b):
        fail("INVALID_ARGUMENT", "both --engine-a and --engine-b are needed", field="engine_b" if engine_a
             else "engine_a")
    try:
        levels = tuple(float(x) for x in shares.split(",") if x.strip())
    except ValueError:
        fail("INVALID_ARGUMENT", f"must be comma-separated numbers, got {shares!r}", field="shares")
    from flowmaker.errors import FlowMakerError
    from flowmaker.profiling.interference import EMULATED_PLAN, InterferencePlan

    base = EMULATED_PLAN if emulated else InterferencePlan()
    plan = dataclasses.replace(base, b_shares=levels, window_s=window or base.window_s, seed=seed)
    scale = time_scale or (10.0 if emulated else 1.0)
    store_at = None if no_store else _etcd_target(etcd, etcd_namespace)
    progress = None if as_json else (lambda msg: err.print(msg, markup=False, highlight=False))
    try:
        plan.validate()
        result = asyncio.run(_measure(gpu_type, engine_a, engine_b, emulated, scale, model, plan, share_source,
                                      progress))
        record = result.record()
        stored = asyncio.run(_store(record, store_at)) if store_at is not None else None
    except FlowMakerError as e:
        fail_from(e)
    if as_json:
        typer.echo(json.dumps(record.to_json(), indent=2))
        return
    out = console()
    out.print(_table(result, emulated))
    typer.echo(json.dumps(record.to_json(), indent=2))
    if stored:
        err.print(f"stored in etcd at {stored}", markup=False, highlight=False)
    elif no_store:
        err.print("not stored (--no-store)", markup=False, highlight=False)
    else:
        err.print("not stored: no etcd (--etcd, FLOWMAKER_ETCD_ENDPOINTS or a running `flowmaker up`)",
                  markup=False, highlight=False)


def _etcd_target(flag: str, namespace: str) -> tuple[list[str], str, Any] | None:
    """(endpoints, namespace, TLS files or None) of the etcd to store in, or None when there is none."""
    endpoints = flag or os.environ.get("FLOWMAKER_ETCD_ENDPOINTS", "")
    tls = None
    if not endpoints:
        from flowmaker.launcher.client import settings
        from flowmaker.launcher.stack import read_state

        state = read_state(settings().state_file) or {}
        endpoints = str(state.get("etcd") or "")
        t = state.get("tls")
        if endpoints and isinstance(t, dict) and all(t.get(k) for k in ("ca", "cert", "key")):
            from flowmaker.rpc.tls import TlsFiles

            tls = TlsFiles(t["ca"], t["cert"], t["key"])
    eps = [e.strip() for e in endpoints.split(",") if e.strip()]
    return (eps, namespace, tls) if eps else None


async def _measure(gpu_type: str, url_a: str, url_b: str, emulated: bool, scale: float, model: str,
                   plan: InterferencePlan, share_source: str, progress: Any) -> InterferenceResult:
    from flowmaker.profiling.interference import connect_engine, launch_emulated_pair, measure_interference

    if not emulated:
        key = os.environ.get(API_KEY_ENV, "")
        a = await connect_engine(url_a, model=model, api_key=key, time_scale=scale, field_name="engine_a")
        b = await connect_engine(url_b, model=model, api_key=key, time_scale=scale, field_name="engine_b")
        return await measure_interference(a, b, gpu_type, plan, share_source=share_source, on_progress=progress)
    with tempfile.TemporaryDirectory(prefix="flowmaker-gpu-share-") as share_dir:
        if progress is not None:
            progress(f"starting two emulated engines on one emulated GPU (time scale {scale:g}, {share_dir})")
        ea, eb = await launch_emulated_pair(share_dir, time_scale=scale)
        try:
            return await measure_interference(ea, eb, gpu_type, plan, share_source=share_source,
                                              on_progress=progress)
        finally:
            for h in (ea, eb):
                with contextlib.suppress(Exception):
                    await h.close()


async def _store(record: InterferenceRecord, target: tuple[list[str], str, Any]) -> str:
    from flowmaker.state.etcd import EtcdStore
    from flowmaker.state.interference import InterferenceStore
    from flowmaker.state.keys import interference

    endpoints, namespace, tls = target
    store = EtcdStore(endpoints, namespace=namespace, timeout_s=5.0, tls=tls)
    try:
        await InterferenceStore(store).put(record)
    finally:
        await store.close()
    return f"{','.join(endpoints)} {namespace}{interference(record.gpu_type)}"


def _table(r: InterferenceResult, emulated: bool) -> Table:
    how = "emulated engines" if emulated else f"{r.engine_a} beside {r.engine_b}"
    t = Table(title=f"interference on {r.gpu_type}: kappa = {r.kappa:.3f} ({how}; A alone {r.alone_s * 1e3:.1f} ms, "
                    f"latency from the {r.latency_source}, B's share from {r.share_source}; {r.wall_s:.0f}s)")
    for c in ("target share", "B calls/s", "B busy share", "A probes", "A ms", "slowdown", "kappa"):
        t.add_column(c, justify="right")
    for p in r.points:
        t.add_row(f"{p.target_share:g}", f"{p.b_rate_per_s:.3g}", f"{p.co_share:.3f}", str(p.a_calls),
                  f"{p.shared_s * 1e3:.1f}", f"{p.slowdown:.3f}", f"{p.kappa:.3f}")
    return t


def register(app: typer.Typer) -> None:
    """Add `measure-interference` to the `profiles` group (profiles_measure.register calls it)."""
    for group in app.registered_groups:
        if group.name == "profiles" and group.typer_instance is not None:
            group.typer_instance.command("measure-interference")(measure_interference_cmd)
            return
