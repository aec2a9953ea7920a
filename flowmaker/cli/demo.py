"""`flowmaker demo` (`make demo`): a local stack, the 11 models, the 7 evaluation tasks, a burst of requests, a report.

Steps: start etcd + the five services + an emulated 8 x A6000 node (`flowmaker.launcher`);
register the catalog's models with the profiler; deploy the evaluation tasks one after another
(candidates from the generator, all approved); send `--requests` concurrent requests per task
through the orchestrator, all tasks at once; print per task the chosen variant, which instances
were reused and which started, observed vs predicted latency vs the SLO, and the GPU memory in use;
stop everything.

Time: the emulated engines run their clock `--time-scale` times faster than wall time so the
burst takes seconds. Latencies in the report are in model seconds (what a real engine would
take): the observed wall time of a request times the scale. The orchestrator's own overhead is
scaled up with it, so observed latencies are slightly pessimistic.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from flowmaker.cli.output import console

if TYPE_CHECKING:  # grpc and pydantic behind these: imported where used, so `flowmaker --help` stays fast
    from flowmaker.launcher.client import Stubs
    from flowmaker.launcher.stack import LocalStack

DEMO_TIME_SCALE = 10.0
# The demo's load level: the seven tasks at half their nominal rates all fit on 8 A6000 with GPU sharing counted.
DEMO_LOAD = 0.5
_FILLER = ("the quarterly report notes that revenue grew while costs in the northern region rose and the team "
           "plans to revisit supplier contracts before the next review").split()
_SAMPLES = {
    "chat": "Hi! Can you suggest a three-day itinerary for Lisbon with good food and a day trip?",
    "code": "def parse_config(path: str) -> dict:\n    # read the YAML file and validate required keys",
    "math": "A baker sells 24 muffins a day at $3 each and 15 loaves at $5 each. How much in a week?",
    "summarize": "Meeting notes: the team reviewed the roadmap, agreed to ship the API in May, and flagged hiring.",
    "multihop_qa": "Which river flows through the city where the author of 'Dubliners' was born?",
    "translate": "Translate into German: Our service keeps customer data encrypted at rest and in transit.",
    "extract": "Extract people, companies and dates: On 3 May 2024 Ana Lopez joined Acme Corp as CTO.",
}

con = console()


@dataclass
class TaskReport:
    """What the demo learned about one evaluation task."""

    name: str
    slo_accuracy: float
    slo_latency_s: float
    task_id: str = ""
    state: str = ""
    failure: str = ""
    task: Any = None
    deploy_s: float = 0.0
    alone_s: float | None = None  # one request with nothing else in flight, model seconds
    wall_latencies_s: list[float] = field(default_factory=list)
    client_latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _request_text(task_name: str, context_tokens: int) -> str:
    """The task's sample input padded with filler words to its nominal context size (the emulated engines
    count whitespace words as tokens), so observed latency is comparable with the selector's prediction."""
    words = _SAMPLES.get(task_name, "Hello.").split()
    pad = max(0, context_tokens - len(words))
    return " ".join(words + [_FILLER[i % len(_FILLER)] for i in range(pad)])


def _state(t: Any) -> str:
    from flowmaker.api.common.v1 import task_pb2

    return str(task_pb2.Task.State.Name(t.state)).removeprefix("STATE_")


async def _register_models(stubs: Stubs) -> int:
    from flowmaker.api.profiler.v1 import profiler_pb2 as ppb
    from flowmaker.catalog import default_models
    from flowmaker.launcher.client import RpcFailure, call

    prof = stubs.profiler()
    n = 0
    for m in default_models():
        try:
            await call(prof.RegisterModel(ppb.RegisterModelRequest(catalog_name=m.id)), stubs.profiler_addr)
        except RpcFailure as f:
            if f.code != "ALREADY_EXISTS":  # a profiler that preloads the catalog is fine
                raise
        n += 1
    return n


async def deploy_and_approve(stubs: Stubs, name: str, description: str, min_accuracy: float, max_latency_s: float,
                             rate_rps: float) -> Any:
    """DeployTask, then ApproveWorkflows of every candidate with no options (the orchestrator's defaults); the
    task (orchestrator proto) as the approval left it. RpcFailure on a failed call."""
    from flowmaker.api.common.v1 import workflow_pb2
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as opb
    from flowmaker.launcher.client import call

    orch = stubs.orchestrator()
    t = (await call(orch.DeployTask(opb.DeployTaskRequest(
        description=description, name=name,
        slo=workflow_pb2.Slo(min_accuracy=min_accuracy, max_latency_s=max_latency_s, arrival_rate_rps=rate_rps))),
        stubs.orchestrator_addr)).task
    return (await call(orch.ApproveWorkflows(opb.ApproveWorkflowsRequest(
        task_id=t.id, workflow_ids=[w.id for w in t.candidates])), stubs.orchestrator_addr)).task


async def _deploy(stubs: Stubs, reports: list[TaskReport], load: float) -> None:
    from flowmaker.eval.tasks import EVAL_TASKS
    from flowmaker.launcher.client import RpcFailure

    for et, rep in zip(EVAL_TASKS, reports, strict=True):
        slo = et.slo(load)
        t0 = time.monotonic()
        with con.status(f"deploying {et.name}: generating candidates, selecting, starting engines…"):
            try:
                t = await deploy_and_approve(stubs, et.name, et.description, slo.min_accuracy, slo.max_latency_s,
                                             slo.arrival_rate_rps)
                rep.task_id = t.id
                rep.task, rep.state = t, _state(t)
                if t.failure.message:
                    rep.failure = t.failure.message
            except RpcFailure as f:
                rep.state, rep.failure = "FAILED", f.line().removeprefix("error: ")
        rep.deploy_s = time.monotonic() - t0
        v = rep.task.variant if rep.task is not None else None
        if v is not None and v.workflow_id:
            new = len(v.new_instances)
            reused = len(v.reuse)
            con.print(f"  [green]✓[/green] {et.name:<12} {rep.state:<9} workflow {v.workflow_id:<22} "
                      f"{new} new / {reused} reused instance(s)   {rep.deploy_s:5.1f}s")
        else:
            con.print(f"  [red]✗[/red] {et.name:<12} {rep.state:<9} {rep.failure}   {rep.deploy_s:5.1f}s",
                      highlight=False)


async def _probe(stubs: Stubs, reports: list[TaskReport], scale: float) -> None:
    """One request per task, one at a time: the latency the selector's prediction is about (no queueing)."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as opb
    from flowmaker.eval.tasks import get_task
    from flowmaker.launcher.client import RpcFailure, call

    orch = stubs.orchestrator()
    with con.status("one request per task, one at a time…"):
        for rep in reports:
            if rep.state not in ("ACTIVE", "DEGRADED"):
                continue
            text = _request_text(rep.name, get_task(rep.name).nominal_tokens()[0])
            try:
                r = await call(orch.Invoke(opb.InvokeRequest(task_id=rep.task_id, input=text)),
                               stubs.orchestrator_addr)
                rep.alone_s = r.latency_s * scale
            except RpcFailure as f:
                rep.errors.append(f.line().removeprefix("error: "))


async def _burst(stubs: Stubs, reports: list[TaskReport], per_task: int) -> float:
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as opb
    from flowmaker.eval.tasks import get_task
    from flowmaker.launcher.client import RpcFailure, call

    orch = stubs.orchestrator()

    async def one(rep: TaskReport, text: str) -> None:
        t0 = time.monotonic()
        try:
            r = await call(orch.Invoke(opb.InvokeRequest(task_id=rep.task_id, input=text)), stubs.orchestrator_addr)
            rep.wall_latencies_s.append(r.latency_s)  # measured by the orchestrator: the workflow, no client hop
            rep.client_latencies_s.append(time.monotonic() - t0)
        except RpcFailure as f:
            rep.errors.append(f.line().removeprefix("error: "))

    jobs = []
    for rep in reports:
        if rep.state in ("ACTIVE", "DEGRADED"):
            text = _request_text(rep.name, get_task(rep.name).nominal_tokens()[0])
            jobs += [one(rep, text) for _ in range(per_task)]
    t0 = time.monotonic()
    with con.status(f"sending {len(jobs)} requests at once through the orchestrator…"):
        await asyncio.gather(*jobs)
    return time.monotonic() - t0


async def _refresh(stubs: Stubs, reports: list[TaskReport]) -> tuple[Any, Any]:
    from flowmaker.api.deployer.v1 import deployer_pb2 as dpb
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as opb
    from flowmaker.launcher.client import RpcFailure, call

    orch = stubs.orchestrator()
    for rep in reports:
        if rep.task_id:
            with contextlib.suppress(RpcFailure):
                rep.task = (await call(orch.GetTask(opb.GetTaskRequest(task_id=rep.task_id)),
                                       stubs.orchestrator_addr)).task
                rep.state = _state(rep.task)
    dep = stubs.deployer()
    insts = await call(dep.ListInstances(dpb.ListInstancesRequest()), stubs.deployer_addr)
    gpus = await call(dep.ListGpus(dpb.ListGpusRequest()), stubs.deployer_addr)
    return insts, gpus


def _report(reports: list[TaskReport], insts: Any, gpus: Any, scale: float, per_task: int) -> None:
    from flowmaker.cli.stack import _gpu_table

    tab = Table(title=f"Tasks after the burst ({per_task} concurrent requests per task; latencies in model seconds "
                      f"= wall x {scale:g})", show_lines=True)
    for c in ("task", "SLO acc / lat", "state", "variant: stage -> model tp x pp", "new", "reused",
              "predicted", "alone", "burst p50 / max", "SLO"):
        tab.add_column(c, justify="right" if c in ("new", "reused", "predicted", "alone", "burst p50 / max")
                       else "left")
    for rep in reports:
        t = rep.task
        v = t.variant if t is not None else None
        if v is None or not v.workflow_id:
            tab.add_row(rep.name, f"{rep.slo_accuracy:g} / {rep.slo_latency_s:g}s", f"[red]{rep.state}[/red]",
                        rep.failure or "-", "-", "-", "-", "-", "-", "-")
            continue
        lines = [f"[bold]{v.workflow_id}[/bold] (acc {v.accuracy:.3f})"]
        for a in v.assignments:
            if not a.model_id:
                lines.append(f"{a.stage_id}: tool")
                continue
            tag = "[green]reused[/green]" if a.reused else "new"
            inst = a.instance_id or t.stage_instances.get(a.stage_id, "")
            lines.append(f"{a.stage_id} -> {a.model_id} {a.tp}x{a.pp} {tag} {inst}")
        predicted = t.predicted_latency_s or v.latency_s
        obs = [x * scale for x in rep.wall_latencies_s]
        if obs:
            p50, worst = statistics.median(obs), max(obs)
            observed = f"{p50:.2f}s / {worst:.2f}s"
            # Judged on the slowest request of the burst; "p50 only" when just the tail is over.
            ok = "[green]met[/green]" if worst <= rep.slo_latency_s else "[yellow]p50 only[/yellow]"
            if p50 > rep.slo_latency_s:
                ok = "[red]missed[/red]"
        else:
            observed, ok = "-", "-"
        if rep.errors:
            observed += f"\n[red]{len(rep.errors)} failed[/red]: {rep.errors[0][:60]}"
        state = rep.state if rep.state == "ACTIVE" else f"[yellow]{rep.state}[/yellow]"
        tab.add_row(rep.name, f"{rep.slo_accuracy:g} / {rep.slo_latency_s:g}s", state, "\n".join(lines),
                    str(len(v.new_instances)), str(len(v.reuse)), f"{predicted:.2f}s",
                    "-" if rep.alone_s is None else f"{rep.alone_s:.2f}s", observed, ok)
    con.print(tab)
    itab = Table(title=f"{len(insts.instances)} running instance(s)")
    for c in ("instance", "model", "tp x pp", "GPUs", "load tok/s", "tasks"):
        itab.add_column(c, justify="right" if c in ("tp x pp", "load tok/s") else "left")
    for i in insts.instances:
        itab.add_row(i.id, i.model_id, f"{i.tp}x{i.pp}", ",".join(i.gpu_ids), f"{i.load_output_tokens_per_s:.1f}",
                     ", ".join(i.task_ids))
    con.print(itab)
    con.print(_gpu_table(gpus.gpus))


async def _run_demo(stack: LocalStack, per_task: int, scale: float, load: float) -> list[TaskReport]:
    from flowmaker.eval.tasks import EVAL_TASKS
    from flowmaker.launcher.client import Stubs

    # The demo's own stack is plaintext: no FLOWMAKER_TLS_* meant for another stack applies to it.
    stubs = Stubs(orchestrator_addr=stack.addresses["orchestrator"], deployer_addr=stack.addresses["deployer"],
                  profiler_addr=stack.addresses["profiler"], timeout_s=120.0, tls=None)
    reports = [TaskReport(et.name, et.min_accuracy, et.max_latency_s) for et in EVAL_TASKS]
    try:
        t0 = time.monotonic()
        with con.status("registering models with the profiler…"):
            n = await _register_models(stubs)
        con.print(f"[bold]2. registered {n} models[/bold] ({time.monotonic() - t0:.1f}s)")
        con.print(f"[bold]3. deploying the {len(EVAL_TASKS)} evaluation tasks[/bold] at {load:.0%} of their nominal "
                  "rates (all candidates approved)")
        await _deploy(stubs, reports, load)
        active = sum(r.state in ("ACTIVE", "DEGRADED") for r in reports)
        await _probe(stubs, reports, scale)
        burst_s = await _burst(stubs, reports, per_task)
        con.print(f"[bold]4. requests[/bold]: one per task alone, then a burst of {per_task * active} requests over {active} task(s) in {burst_s:.1f}s wall "
                  f"({sum(len(r.wall_latencies_s) for r in reports)} ok, {sum(len(r.errors) for r in reports)} failed)")
        insts, gpus = await _refresh(stubs, reports)
        _report(reports, insts, gpus, scale, per_task)
    finally:
        await stubs.close()
    return reports


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def demo(
    requests: Annotated[int, typer.Option("--requests", min=1, max=100, help="Concurrent requests per task.")] = 5,
    time_scale: Annotated[float, typer.Option("--time-scale", min=0.01,
                                              help="Emulated engines' clock speed-up over wall time.")
                          ] = DEMO_TIME_SCALE,
    gpus: Annotated[int, typer.Option("--gpus", min=1, max=64, help="GPUs of the emulated node.")] = 8,
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="GPU type of the emulated node.")] = "A6000",
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="Keep etcd data and logs here.")] = None,
    load: Annotated[float, typer.Option("--load", min=0.01, max=4.0,
                                        help="Declared rates as a fraction of the tasks' nominal rates. At 1.0 the "
                                             "seven tasks do not all fit on 8 A6000 once GPU sharing is counted: "
                                             "the selector refuses the task that would overload its neighbours.")
                  ] = DEMO_LOAD,
) -> None:
    """Run the whole system end to end on this machine and print what it did; stops everything afterwards."""
    t_start = time.monotonic()
    con.print(f"[bold]FlowMaker demo[/bold]: emulated node with {gpus} x {gpu_type}; emulated engines run "
              f"{time_scale:g}x faster than real time (latencies below are model seconds)")
    con.print("[bold]1. starting the local stack[/bold] (etcd + generator, profiler, selector, deployer, orchestrator)")
    from flowmaker.cli.stack import progress_printer
    from flowmaker.launcher.client import RpcFailure
    from flowmaker.launcher.stack import LocalStack, StackConfig, StackError

    cfg = StackConfig(gpus=gpus, gpu_type=gpu_type, time_scale=time_scale, work_dir=work_dir,
                      keep_work_dir=work_dir is not None, log_level="WARNING")
    stack = LocalStack(cfg, progress=progress_printer(con))
    old = signal.signal(signal.SIGTERM, _interrupt)
    code = 0
    try:
        stack.start()
        kept = "" if work_dir is not None else " (removed at the end; --work-dir DIR keeps them)"
        con.print(f"   stack up in {time.monotonic() - t_start:.1f}s; logs in {stack.log_dir}{kept}")
        reports = asyncio.run(_run_demo(stack, requests, time_scale, load))
        if not any(r.state in ("ACTIVE", "DEGRADED") for r in reports):
            code = 1
    except StackError as e:
        con.print(f"error: UNAVAILABLE {e.reason}: {e}", markup=False, highlight=False)
        code = 1
    except RpcFailure as f:
        con.print(f.line(), markup=False, highlight=False)
        code = 1
    except KeyboardInterrupt:
        con.print("interrupted")
        code = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        con.print("[bold]5. stopping everything[/bold]")
        stack.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, old)
    con.print(f"demo finished in {time.monotonic() - t_start:.1f}s wall")
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
