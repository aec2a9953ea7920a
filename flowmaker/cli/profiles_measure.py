"""`flowmaker profiles measure`: a measured sweep on the running stack's profiler (or on a local engine), analytic vs
measured.

Where it measures: `--local` → a local engine started here (no stack, nothing stored); else the profiler
found like every client command finds its service (`--profiler`, `FLOWMAKER_PROFILER_ADDR`, the state file of
a running `flowmaker up`, 127.0.0.1:50052), reached with the same TLS files as every client command
(`FLOWMAKER_TLS_*`, else the state file's; see `flowmaker.launcher.client`). On the stack the profiler's
`ProfileModel` deploys the config through the stack's deployer (an instance on the cluster's GPUs, its memory
reserved like any other), sweeps it, and stores a MEASURED profile in etcd beside the analytic one; this
command follows the job (`GetProfilingJob`, per-config progress from `GetProfiles`) and prints both profiles
side by side. A profiler that does not answer is an error (exit 1), never a quiet local measurement: only
`--local` measures here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar
from rich.table import Table

from flowmaker.cli.output import console, fail, fail_from

if TYPE_CHECKING:  # numpy, aiohttp, protobuf: imported where used, so `--help` stays fast
    from flowmaker.domain import Profile
    from flowmaker.profiling.measure import MeasuredConfig, Progress

FIELDS = (("memory_gb_per_gpu", "mem/GPU GB", 1.0, "{:.1f}"), ("fixed_s", "fixed ms", 1e3, "{:.2f}"),
          ("prefill_s_per_token", "prefill ms/tok", 1e3, "{:.4f}"), ("decode_s_per_token", "decode ms/tok", 1e3,
                                                                     "{:.2f}"),
          ("max_output_tokens_per_s", "max out tok/s", 1.0, "{:.0f}"))
LOCAL_GPU = "A6000"  # the local emulator's GPU type when --gpu is not given (the stack's is the cluster's)
POLL_S = 0.5


class _Failed(Exception):
    """A stack-mode failure, already one line (`error: CODE [REASON]: [field:] message`)."""


def measure(
    model: Annotated[str, typer.Argument(help="Catalog model id (registered with the profiler from the catalog "
                                              "when it does not know it yet).")],
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU type. Stack: default the cluster's. Local: the "
                                                          "type whose analytic profile the emulator is built from "
                                                          f"(default {LOCAL_GPU}).")] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel degree.")] = 1,
    local: Annotated[bool, typer.Option("--local", help="Measure on an engine started here, without the stack "
                                                        "(nothing is stored). Without it, a stack's profiler must "
                                                        "answer.")]
    = False,
    profiler: Annotated[str | None, typer.Option("--profiler", help="Profiler host:port (default: "
                                                                    "FLOWMAKER_PROFILER_ADDR, the state file of "
                                                                    "`flowmaker up`, 127.0.0.1:50052).")] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="Engine: stack: the deployer's engine (default "
                                                                  "its own); local: emulated (default), or vllm / "
                                                                  "trtllm on a GPU host (time scale then 1).")]
    = None,
    time_scale: Annotated[float, typer.Option("--time-scale", min=0.01,
                                              help="Local emulated engine seconds per wall second. Higher is faster "
                                                   "but the emulator's ~1 ms timer jitter is multiplied by it: a "
                                                   "7-8B model's fixed_s holds within 10% up to about 4, a 1B "
                                                   "model's at 1. (On the stack: the profiler's "
                                                   "FLOWMAKER_PROFILER_ENGINE_TIME_SCALE.)")] = 4.0,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Local: sends of each single-request point.")] = 5,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Stack: give up following the job after "
                                                                      "this many seconds (it keeps running).")]
    = 3600.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (a list of rows) instead of a table.")] = False,
) -> None:
    """Measure (model, tp, pp): deploy it, sweep load against its OpenAI API, fit a MEASURED profile, and compare
    it with the analytic one.

    On the running stack (default) the profiler does it through the stack's deployer and stores the measured
    profile in etcd, where the selector prefers it; no profiler reachable is an error. `--local` starts the
    engine here through the deployer's backends and stores nothing. On the emulated engine (built from the
    analytic profile) the difference checks the measurement pipeline.
    """
    err = console(stderr=True)
    if not local:
        from flowmaker.cli.output import start_tracing, tracing_wanted
        from flowmaker.launcher.client import RpcFailure, credentials, resolve, settings

        if tracing_wanted():
            start_tracing()  # its calls are CLIENT spans, exported as the OTEL_* settings say

        s = settings()
        addr = resolve("profiler", profiler, s)
        try:
            tls, _ = credentials((addr,), s)
        except RpcFailure as f:
            fail(f.code, f.message, reason=f.reason, field=f.field)
        why = asyncio.run(_not_serving(addr, tls))
        if why:
            how = "over TLS with " + (f"{tls.cert}" if tls.cert else "no client certificate") if tls else "plaintext"
            fail("UNAVAILABLE", f"cannot reach the profiler at {addr} ({how}): {why}. Start the stack (`flowmaker "
                 "up`) or name it: --profiler / FLOWMAKER_PROFILER_ADDR, with its CA and a client certificate for a "
                 "TLS stack (FLOWMAKER_TLS_CA/_CERT/_KEY). Nothing was measured; --local measures on an engine "
                 "started here instead (nothing stored)", reason="PROFILER_UNREACHABLE")
        try:
            rows = asyncio.run(_measure_on_stack(addr, model, gpu or "", tp, pp, backend or "", timeout,
                                                 None if as_json else err, s.call_timeout_s, tls))
        except _Failed as e:
            err.print(str(e), markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
        _print(rows, as_json)
        return
    _measure_locally(model, gpu or LOCAL_GPU, tp, pp, backend or "emulated", time_scale, repeats, as_json, err)


# ---- on the stack ------------------------------------------------------------------------------------


async def _not_serving(addr: str, tls: Any, timeout_s: float = 3.0) -> str:
    """Why the gRPC server at `addr` does not answer health SERVING over `tls` (TlsFiles, or None for
    plaintext); "" when it does."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from flowmaker.rpc.channels import channel

    try:
        async with channel(addr, default_timeout_s=timeout_s, tls=tls) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout_s)
    except grpc.RpcError as e:
        return f"{e.code().name}: {' '.join(str(e.details() or '').split())[:300]}"  # type: ignore[attr-defined]
    except (OSError, ValueError) as e:
        return str(e)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
    return ""


def _job_failure_line(job: Any) -> str:
    from google.rpc import code_pb2

    from flowmaker.launcher.client import RpcFailure

    code = code_pb2.Code.Name(job.failure.code) if job.failure.code else "UNKNOWN"
    reason, _, message = job.failure.message.partition(": ")
    if not message:
        reason, message = "", reason
    return RpcFailure(code, reason, f"profiling job {job.id} failed: {message or 'no reason given'}").line()


async def _measure_on_stack(addr: str, model: str, gpu: str, tp: int, pp: int, engine: str, timeout_s: float,
                            err: Console | None, call_timeout_s: float, tls: Any = None) -> list[dict[str, Any]]:
    """ProfileModel for one config, follow the job, and return its row (analytic vs measured). `tls`: the
    TlsFiles to reach the profiler with (`credentials`), None for plaintext."""
    from flowmaker.api.profiler.v1 import profiler_pb2
    from flowmaker.launcher.client import RpcFailure, Stubs, call

    PJ = profiler_pb2.ProfilingJob
    stubs = Stubs(profiler_addr=addr, timeout_s=call_timeout_s, tls=tls)
    try:
        prof = stubs.profiler()
        cfg = profiler_pb2.ParallelConfig(tp=tp, pp=pp)

        async def config_state(gpu_type: str) -> Any:
            resp = await call(prof.GetProfiles(profiler_pb2.GetProfilesRequest(model_id=model, gpu_type=gpu_type,
                                                                               configs=[cfg])), addr)
            return resp.configs[0]

        try:
            await config_state(gpu)  # also rejects a config that cannot run, naming why, before anything starts
        except RpcFailure as f:
            if f.code != "NOT_FOUND" or f.field != "model_id":
                raise
            # Not registered yet (the profiler preloads the catalog unless told not to): register it from the catalog.
            await call(prof.RegisterModel(profiler_pb2.RegisterModelRequest(catalog_name=model)), addr)
            if err is not None:
                err.print(f"registered {model} with the profiler (from the catalog)")
        req = profiler_pb2.ProfileModelRequest(model_id=model, gpu_type=gpu, configs=[cfg], engine=engine)
        deadline = time.monotonic() + timeout_s
        job = (await call(prof.ProfileModel(req), addr)).job
        while (tp, pp) not in [(c.tp, c.pp) for c in job.configs]:
            # ProfileModel returns the job already running for this model and GPU type: let it finish first.
            if err is not None:
                err.print(f"waiting for profiling job {job.id} of {model} "
                          f"({', '.join(f'{c.tp}x{c.pp}' for c in job.configs)}) to finish first")
            await _follow(prof, job, None, None, deadline, addr)
            job = (await call(prof.ProfileModel(req), addr)).job
        if err is not None:
            err.print(f"profiling job {job.id}: {model} tp={tp} pp={pp} on {job.gpu_type} through the stack's "
                      f"deployer (profiler {addr})")
        job = await _follow(prof, job, lambda: config_state(job.gpu_type), err, deadline, addr)
        if job.state != PJ.State.STATE_SUCCEEDED:
            raise _Failed(_job_failure_line(job))
        pc = await config_state(job.gpu_type)
        if not pc.HasField("measured"):
            raise _Failed(f"error: INTERNAL: profiling job {job.id} succeeded but GetProfiles shows no measured "
                          f"profile for tp={tp} pp={pp}")
        from flowmaker import convert

        a, m = convert.profile_from_proto(pc.analytic), convert.profile_from_proto(pc.measured)
        wall = job.update_time.ToNanoseconds() / 1e9 - job.create_time.ToNanoseconds() / 1e9
        row: dict[str, Any] = {"mode": "stack", "profiler": addr, "job_id": job.id, "model_id": model,
                               "gpu_type": job.gpu_type, "tp": tp, "pp": pp,
                               "state": profiler_pb2.ProfileConfig.State.Name(pc.state), "job_wall_s": round(wall, 2),
                               **_diffs(a, m)}
        return [row]
    except RpcFailure as f:
        raise _Failed(f.line()) from None
    finally:
        await stubs.close()


async def _follow(prof: Any, job: Any, config_state: Callable[[], Any] | None, err: Console | None,
                  deadline: float, addr: str) -> Any:
    """Poll GetProfilingJob until the job ends (and GetProfiles for the config's progress bar on stderr)."""
    from flowmaker.api.profiler.v1 import profiler_pb2
    from flowmaker.launcher.client import call

    PJ = profiler_pb2.ProfilingJob
    done = (PJ.State.STATE_SUCCEEDED, PJ.State.STATE_FAILED)
    bar = Bar(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
              console=err, transient=False, disable=err is None)
    with bar:
        task = bar.add_task(f"{job.id} {PJ.State.Name(job.state).removeprefix('STATE_').lower()}", total=1.0)
        while True:
            job = (await call(prof.GetProfilingJob(profiler_pb2.GetProfilingJobRequest(job_id=job.id)), addr)).job
            state = PJ.State.Name(job.state).removeprefix("STATE_").lower()
            if config_state is not None and err is not None:
                pc = await config_state()
                bar.update(task, completed=pc.progress,
                           description=f"{job.id} {state}: {profiler_pb2.ProfileConfig.State.Name(pc.state)}")
            if job.state in done:
                return job
            if time.monotonic() > deadline:
                raise _Failed(f"error: DEADLINE_EXCEEDED: profiling job {job.id} still {state} after --timeout; it "
                              "keeps running on the profiler")
            await asyncio.sleep(POLL_S)


# ---- locally -----------------------------------------------------------------------------------------


def _measure_locally(model: str, gpu: str, tp: int, pp: int, backend: str, time_scale: float, repeats: int,
                     as_json: bool, err: Console) -> None:
    from flowmaker.catalog import get_gpu_type, get_model
    from flowmaker.errors import FlowMakerError
    from flowmaker.profiling.measure import BackendLauncher, SweepPlan, measure_model

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
        fail_from(e)
    rows = [_row(r, backend, time_scale) for r in results]
    _print(rows, as_json)


def _diffs(a: Profile, m: Profile) -> dict[str, Any]:
    from flowmaker.profiling.measure import percent_diff

    return {f: {"analytic": getattr(a, f), "measured": getattr(m, f),
                "diff_percent": round(percent_diff(getattr(m, f), getattr(a, f)), 2)} for f, *_ in FIELDS}


def _row(r: MeasuredConfig, backend: str = "emulated", time_scale: float = 1.0) -> dict[str, object]:
    return {"mode": "local", "backend": backend, "time_scale": time_scale if backend == "emulated" else 1.0,
            "model_id": r.profile.model_id, "gpu_type": r.profile.gpu_type, "tp": r.profile.tp, "pp": r.profile.pp,
            "memory_source": r.memory_source, "sweep_wall_s": round(r.wall_s, 2), "overhead_s": r.overhead_s,
            **_diffs(r.analytic, r.profile)}


def _print(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        console().print(_table(r))


def _table(r: dict[str, Any]) -> Table:
    if r["mode"] == "stack":
        how = f"on the stack, job {r['job_id']}, {r['job_wall_s']:.1f}s; stored in etcd"
    else:
        scale = f", time scale {r['time_scale']:g}" if r["backend"] == "emulated" else ""
        how = f"local {r['backend']}{scale}; sweep {r['sweep_wall_s']:.1f}s; memory from {r['memory_source']}"
    t = Table(title=f"{r['model_id']} on {r['gpu_type']}, tp={r['tp']} pp={r['pp']} ({how})")
    for c in ("", "analytic", "measured", "diff %"):
        t.add_column(c, justify="right" if c else "left")
    for f, label, mult, fmt in FIELDS:
        d = r[f]
        t.add_row(label, fmt.format(d["analytic"] * mult), fmt.format(d["measured"] * mult),
                  f"{d['diff_percent']:+.1f}")
    return t


def register(app: typer.Typer) -> None:
    """Add `measure` and `measure-interference` to the `profiles` group (created when the catalog commands are not
    loaded)."""
    from flowmaker.cli import profiles_interference

    for group in app.registered_groups:
        if group.name == "profiles" and group.typer_instance is not None:
            group.typer_instance.command("measure")(measure)
            profiles_interference.register(app)
            return
    profiles = typer.Typer(help="Profiles of a model on a GPU type.", no_args_is_help=True)
    profiles.command("measure")(measure)
    app.add_typer(profiles, name="profiles")
    profiles_interference.register(app)
