"""`flowmaker up|down`, `flowmaker task deploy|approve|invoke|get|list|delete` and `flowmaker instances`.

Client commands talk gRPC to a running stack (see `flowmaker.launcher.client` for how they find
it); a failed call prints one line `error: <CODE> <REASON>: <field>: <message>` on stderr and
exits 1 — never a traceback — and so does a task that ends FAILED (exit codes: `flowmaker.cli.output`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowmaker.cli.output import EXIT_FAILED, KeyedColumn, console, error_line, keyed_table

if TYPE_CHECKING:
    from flowmaker.launcher.client import Stubs

# grpc, protobuf and pydantic load only in the commands that use them (`from flowmaker.launcher... import` in
# their bodies), so `flowmaker --help` starts fast; tests/unit/test_cli_fast.py checks what importing the CLI loads.
# flowmaker.launcher.stack.DEFAULT_GATEWAY_PORT, spelled here for the help text (the same test checks it).
DEFAULT_GATEWAY_PORT = 50080

T = TypeVar("T")

out = console()
err = console(stderr=True)

task_app = typer.Typer(help="Deploy, approve, invoke, inspect and delete tasks (talks to the orchestrator).",
                       no_args_is_help=True)

OrchestratorOpt = Annotated[str | None, typer.Option(
    "--orchestrator", metavar="HOST:PORT",
    help="Orchestrator address (env FLOWMAKER_ORCHESTRATOR_ADDR; default: from `flowmaker up`'s state file, "
         "else 127.0.0.1:50055).")]
DeployerOpt = Annotated[str | None, typer.Option(
    "--deployer", metavar="HOST:PORT",
    help="Deployer address (env FLOWMAKER_DEPLOYER_ADDR; default: from `flowmaker up`'s state file, "
         "else 127.0.0.1:50054).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print proto3 JSON (proto field names) instead of tables.")]


# ---- plumbing --------------------------------------------------------------------------------

def _die(line: str, code: int = 1) -> NoReturn:
    err.print(line, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one command's coroutine; any expected failure is one line on stderr and exit 1."""
    from flowmaker.launcher.client import RpcFailure, failure_of

    try:
        return asyncio.run(coro)
    except RpcFailure as f:
        _die(f.line())
    except KeyboardInterrupt:
        _die("interrupted", 130)
    except Exception as e:  # gRPC / FlowMaker errors that escaped `call`
        import grpc

        from flowmaker.errors import FlowMakerError

        if isinstance(e, grpc.RpcError | FlowMakerError):
            _die(failure_of(e).line())
        raise


async def _with_stubs(fn: Callable[[Stubs], Awaitable[T]], *, orchestrator: str | None = None,
                      deployer: str | None = None, status: str = "") -> T:
    """`fn(stubs)` with channels to the resolved addresses (closed afterwards), under a spinner if `status`.

    With an exporter (OTEL_TRACES_EXPORTER), the whole command is one CLIENT span (`flowmaker task deploy`,
    ...), so its calls (DeployTask then ApproveWorkflows) are one trace across the services."""
    from flowmaker.cli.output import start_tracing, tracing_wanted

    traced = tracing_wanted()
    span: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if traced:
        from opentelemetry.trace import SpanKind

        from flowmaker import telemetry

        start_tracing()
        # The command as typed, options and free text left out: "flowmaker task deploy", "flowmaker instances".
        words = [a for a in sys.argv[1:3] if not a.startswith("-")][:2 if sys.argv[1:2] == ["task"] else 1]
        span = telemetry.tracer().start_as_current_span(" ".join(["flowmaker", *words]), kind=SpanKind.CLIENT)
    stubs = _stubs(orchestrator, deployer, tracing=traced)
    try:
        with span:
            if not status:
                return await fn(stubs)
            with err.status(status):
                return await fn(stubs)
    finally:
        await stubs.close()


def _orchestrator_call(orchestrator: str | None, method: str, request: Any, status: str = "") -> Any:
    """One unary OrchestratorService call, run to completion: its response (a failure exits 1, one line)."""
    from flowmaker.launcher.client import call

    async def go(stubs: Stubs) -> Any:
        return await call(getattr(stubs.orchestrator(), method)(request), stubs.orchestrator_addr)

    return _run(_with_stubs(go, orchestrator=orchestrator, status=status))


def _emit(msg: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """`--json`: the message as proto3 JSON; else `render(msg)` (tables)."""
    from flowmaker.launcher.client import to_json

    if as_json:
        _print_json(to_json(msg))
    else:
        render(msg)


def _state_name(enum_type: Any, value: int) -> str:
    return str(enum_type.Name(value)).removeprefix("STATE_")


def _stubs(orchestrator: str | None = None, deployer: str | None = None, *, tracing: bool = True) -> Stubs:
    from flowmaker.launcher.client import Stubs, resolve, settings

    s = settings()
    return Stubs(orchestrator_addr=resolve("orchestrator", orchestrator, s),
                 deployer_addr=resolve("deployer", deployer, s), timeout_s=s.call_timeout_s, tracing=tracing)


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2))


def _s(x: float) -> str:
    if x == float("inf"):  # a re-derived prediction: an instance it uses can no longer keep up
        return "inf"
    return f"{x:.2f}s" if x else "-"


def _task_state(t: Any) -> str:
    from flowmaker.api.common.v1 import task_pb2

    name = _state_name(task_pb2.Task.State, t.state)
    color = {"ACTIVE": "green", "FAILED": "red", "DEGRADED": "yellow"}.get(name, "cyan")
    return f"[{color}]{name}[/{color}]"


def _candidates_table(t: Any) -> Table:
    tab = Table(title=f"Candidate workflows of task {t.id}")
    for c in ("workflow", "stages (kind:id <- deps)", "description"):
        tab.add_column(c)
    for w in t.candidates:
        stages = []
        for st in w.stages:
            kind = "tool" if st.kind == 2 else "llm"
            deps = f" <- {','.join(st.depends_on)}" if st.depends_on else ""
            mult = f" x{st.calls_per_request}" if st.calls_per_request > 1 else ""
            stages.append(f"{kind}:{st.id}{mult}{deps}")
        approved = " (approved)" if w.id in t.approved_workflow_ids else ""
        tab.add_row(w.id + approved, "\n".join(stages), w.description)
    return tab


def _variant_table(t: Any) -> Table:
    from flowmaker.orchestration.task import replicas_of

    v = t.variant
    tab = Table(title=f"Variant of task {t.id}: workflow {v.workflow_id or '-'} (strategy {t.strategy or '-'})")
    now = t.HasField("predict_time")  # re-derived on the current placement: the column beside the selection's
    cols = ("stage", "model", "tp x pp", "instance", "reused", "GPUs", "stage latency", *(("now",) if now else ()),
            "load tok/s")
    for c in cols:
        tab.add_column(c, justify="right" if c in ("stage latency", "now", "load tok/s", "tp x pp") else "left")
    for a in v.assignments:
        inst = a.instance_id or t.stage_instances.get(a.stage_id, "") or a.new_key
        group = replicas_of(dict(t.stage_instances), a.stage_id)
        if len(group) > 1:  # a stage scaled out: every replica, requests spread by least outstanding work
            inst = "\n".join(group) + f"\n({len(group)} replicas)"
        tab.add_row(a.stage_id, a.model_id or "(tool)", f"{a.tp}x{a.pp}" if a.model_id else "-", inst or "-",
                    "[green]reused[/green]" if a.reused else ("new" if a.model_id else "-"),
                    ",".join(a.gpu_ids) or "-", _s(a.latency_s),
                    *((_s(t.predicted_stage_latency_s[a.stage_id]) if a.stage_id in t.predicted_stage_latency_s
                       else "-",) if now else ()), f"{a.load_output_tokens_per_s:.1f}")
    return tab


def _print_task(t: Any) -> None:
    slo = t.slo
    out.print(f"[bold]task {t.id}[/bold] {t.name!r}  state {_task_state(t)}")
    if t.owner:  # a plaintext stack has no identities
        out.print(f"  owner: {escape(t.owner)}", markup=True)
    out.print(f"  description: {t.description}")
    out.print(f"  SLO: accuracy >= {slo.min_accuracy:g}, latency <= {slo.max_latency_s:g}s, "
              f"rate {slo.arrival_rate_rps:g} req/s")
    if t.HasField("failure") and (t.failure.code or t.failure.message):
        out.print(f"  [red]failure[/red]: {t.failure.message}", markup=True)
    if t.observed_arrival_rate_rps or t.HasField("last_reselection"):
        out.print(f"  load: declared {slo.arrival_rate_rps:g} req/s, observed {t.observed_arrival_rate_rps:.3g} req/s")
    if t.HasField("last_reselection"):
        r = t.last_reselection
        ago = time.time() - r.time.ToNanoseconds() / 1e9
        out.print(f"  last re-selection {ago:.0f}s ago for {r.planned_arrival_rate_rps:.3g} req/s: {r.outcome} "
                  f"({escape(r.reason)})", markup=True)
    if t.next_stage_instances:
        out.print(f"  switching to: {dict(t.next_stage_instances)}")
    if t.HasField("healing"):
        h = t.healing
        since = time.time() - h.since_time.ToNanoseconds() / 1e9
        nxt = ""
        if h.HasField("next_attempt_time"):
            nxt = f", next attempt in {max(0.0, h.next_attempt_time.ToNanoseconds() / 1e9 - time.time()):.0f}s"
        out.print(f"  [yellow]healing[/yellow]: {h.action} for {since:.0f}s (attempt {h.attempts}{nxt}): "
                  f"{escape(h.detail)}", markup=True)
    if t.variant.workflow_id:
        v = t.variant
        out.print(_variant_table(t))
        when = ""
        if t.HasField("predict_time"):  # re-derived since the selection: later co-residents moved it
            when = (f" on the current placement ({time.time() - t.predict_time.ToNanoseconds() / 1e9:.0f}s ago; "
                    f"{_s(v.latency_s)} as selected)")
        out.print(f"  predicted latency {_s(t.predicted_latency_s or v.latency_s)}{when} (SLO {slo.max_latency_s:g}s), "
                  f"observed p50 {_s(t.observed_latency_p50_s)} p95 {_s(t.observed_latency_p95_s)} over "
                  f"{t.requests_served} request(s); accuracy {v.accuracy:.3f}; cost {v.cost:.3f} GB·s "
                  f"(new GPU memory x latency); "
                  f"new GPUs {v.new_gpus}, new memory {v.new_memory_gb:.1f} GB")
    elif t.candidates:
        out.print(_candidates_table(t))


# ---- task commands ---------------------------------------------------------------------------

def _approve_ids(t: Any, approve: str) -> list[str]:
    if approve.strip().lower() == "all":
        return [w.id for w in t.candidates]
    return [x.strip() for x in approve.split(",") if x.strip()]


def _check_strategy(strategy: str) -> None:
    """An unknown --strategy is refused before anything is created (the selector runs the same registry)."""
    if not strategy:
        return
    from flowmaker.selection import registry

    registry._load()
    if strategy not in registry.STRATEGIES:
        _die(error_line("INVALID_ARGUMENT", f"unknown selection strategy {strategy!r}; known: "
                        f"{', '.join(sorted(registry.STRATEGIES))}", reason="UNKNOWN_STRATEGY", field="--strategy"))


def _check_approve(approve: str | None, strategy: str, known_ids: list[str] | None) -> None:
    """--approve and --strategy are checked before DeployTask: a typo must not leave an orphan task behind.
    `known_ids`: the candidate ids when they are known up front (--workflows), else None."""
    if strategy and approve is None:
        _die(error_line("INVALID_ARGUMENT", "--strategy applies to the approval; add --approve all|ID,...",
                        field="--strategy"))
    _check_strategy(strategy)
    if approve is None:
        return
    if approve.strip().lower() != "all" and not [x for x in approve.split(",") if x.strip()]:
        _die(error_line("INVALID_ARGUMENT", f"expected 'all' or candidate ids separated by commas, got {approve!r}",
                        field="--approve"))
    if known_ids is not None and approve.strip().lower() != "all":
        unknown = [x.strip() for x in approve.split(",") if x.strip() and x.strip() not in known_ids]
        if unknown:
            _die(error_line("INVALID_ARGUMENT", f"not among the --workflows ids {known_ids}: {unknown}",
                            field="--approve"))


def _exit_if_failed(t: Any) -> None:
    """A task that ended FAILED is a failed command: the task was printed, now one error line and exit 1."""
    from flowmaker.api.common.v1 import task_pb2

    if t.state != task_pb2.Task.STATE_FAILED:
        return
    import grpc

    code = next((c.name for c in grpc.StatusCode if c.value[0] == t.failure.code), "UNKNOWN")
    reason = ""
    for d in t.failure.details:
        from google.rpc import error_details_pb2

        info = error_details_pb2.ErrorInfo()
        if d.Unpack(info):
            reason = info.reason
    _die(error_line(code, f"task {t.id} is FAILED: {t.failure.message or 'no reason recorded'}", reason=reason),
         EXIT_FAILED)


WaitOpt = Annotated[bool, typer.Option(
    "--wait/--no-wait", help="When the connection is cut during the approval (an orchestrator restart, an etcd "
    "stall), keep waiting, reconnecting, until the task settles; the control plane finishes an approval it "
    "accepted. --no-wait: exit at once (code 1) saying how to follow it.")]
WaitTimeoutOpt = Annotated[float, typer.Option("--wait-timeout", min=1.0, help="Seconds --wait waits at most.")]
_CUT = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # the call's outcome is unknown: the work may well go on


def _settled(t: Any) -> bool:
    """Whether an approved task is done moving: serving, FAILED, or waiting for capacity with its reason."""
    from flowmaker.api.common.v1 import task_pb2

    T = task_pb2.Task
    if t.state in (T.STATE_ACTIVE, T.STATE_DEGRADED, T.STATE_FAILED, T.STATE_DELETING):
        return not (t.state == T.STATE_DEGRADED and t.healing.action == "RESELECTING")
    return t.HasField("healing") and t.healing.action == "WAITING_FOR_CAPACITY"


async def _approve_following(stubs: Stubs, task_id: str, ids: list[str], strategy: str, *, wait: bool,
                             timeout_s: float) -> Any:
    """ApproveWorkflows; when the call is cut (UNAVAILABLE / DEADLINE_EXCEEDED) its outcome is unknown: the
    orchestrator may have accepted the approval, and then its worker (or, after a restart, its reconciler)
    finishes it. Say so, and with `wait` follow the task across reconnects until it settles, sending the
    approval again only if it never reached etcd (the task still AWAITING_APPROVAL)."""
    from flowmaker.api.common.v1 import task_pb2
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
    from flowmaker.launcher.client import RpcFailure, call

    req = pb.ApproveWorkflowsRequest(task_id=task_id, workflow_ids=ids, strategy=strategy)
    follow = f"follow it with `flowmaker task get {task_id}`"
    try:
        return (await call(stubs.orchestrator().ApproveWorkflows(req), stubs.orchestrator_addr)).task
    except RpcFailure as f:
        if f.code not in _CUT:
            raise
        if not wait:
            raise RpcFailure(f.code, f.reason, f"{f.message} -- the approval of task {task_id} was cut off; if the "
                             f"orchestrator had accepted it, the work goes on: {follow}", f.field, f.target) from None
        err.print(f"the approval of task {task_id} was cut off ({f.code}: {f.message}); the control plane goes on "
                  f"with an approval it accepted: waiting for the task to settle (or {follow})",
                  markup=False, highlight=False, soft_wrap=True)
    deadline = time.monotonic() + timeout_s
    last: RpcFailure | None = None
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        try:
            t = (await call(stubs.orchestrator().GetTask(pb.GetTaskRequest(task_id=task_id)),
                            stubs.orchestrator_addr)).task
            if t.state == task_pb2.Task.STATE_AWAITING_APPROVAL:  # the approval never got recorded: again
                t = (await call(stubs.orchestrator().ApproveWorkflows(req), stubs.orchestrator_addr)).task
            if _settled(t):
                return t
        except RpcFailure as f:
            if f.code not in _CUT:
                raise
            last = f  # still cut off: reconnect on the next round (the channel does)
    raise RpcFailure("DEADLINE_EXCEEDED", "", f"task {task_id} did not settle within --wait-timeout {timeout_s:g}s"
                     + (f" (last error: {last.code} {last.message})" if last else "") + f"; {follow}")


@task_app.command("deploy")
def task_deploy(
    description: Annotated[str, typer.Argument(help="What the task does, in natural language.")],
    accuracy: Annotated[float, typer.Option("--accuracy", help="Accuracy SLO: minimum accuracy, 0..1.")],
    latency: Annotated[float, typer.Option("--latency", help="Latency SLO: end-to-end seconds per request.")],
    rate: Annotated[float, typer.Option("--rate", help="Expected arrival rate, requests/s.")] = 0.0,
    name: Annotated[str, typer.Option("--name", help="Short name of the task.")] = "",
    max_workflows: Annotated[int, typer.Option("--max-workflows", help="Most candidates to generate; 0 = default.")
                             ] = 0,
    workflows_file: Annotated[Path | None, typer.Option(
        "--workflows", help="JSON file with your own candidate workflows (a list, proto3 JSON); skips the generator.")
    ] = None,
    approve: Annotated[str | None, typer.Option(
        "--approve", metavar="all|ID,...", help="Approve these candidates right away (select + deploy).")] = None,
    strategy: Annotated[str, typer.Option("--strategy", help="Selection strategy for --approve.")] = "",
    wait: WaitOpt = True,
    wait_timeout: WaitTimeoutOpt = 900.0,
    orchestrator: OrchestratorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a task: candidate workflows are generated (state AWAITING_APPROVAL); with --approve, deploy it."""
    from google.protobuf import json_format

    from flowmaker.api.common.v1 import workflow_pb2
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
    from flowmaker.launcher.client import RpcFailure, call

    req = pb.DeployTaskRequest(description=description, name=name, max_workflows=max_workflows,
                               slo=workflow_pb2.Slo(min_accuracy=accuracy, max_latency_s=latency,
                                                    arrival_rate_rps=rate))
    if workflows_file is not None:
        try:
            items = json.loads(workflows_file.read_text())
            for w in items if isinstance(items, list) else [items]:
                json_format.ParseDict(w, req.workflows.add())
        except (OSError, ValueError, json_format.ParseError) as e:
            _die(f"error: INVALID_ARGUMENT: --workflows: cannot read {workflows_file}: {e}")
    _check_approve(approve, strategy, [w.id for w in req.workflows] if workflows_file is not None else None)

    async def go(stubs: Stubs) -> Any:
        orch = stubs.orchestrator()
        with err.status("generating candidate workflows…"):
            t = (await call(orch.DeployTask(req), stubs.orchestrator_addr)).task
        if approve is not None:
            ids = _approve_ids(t, approve)
            unknown = [i for i in ids if i not in {w.id for w in t.candidates}]
            if unknown:  # generated ids are known only now: delete the task rather than leave it orphaned
                await call(orch.DeleteTask(pb.DeleteTaskRequest(task_id=t.id)), stubs.orchestrator_addr)
                raise RpcFailure("INVALID_ARGUMENT", "", f"not candidates of the task (deleted {t.id}): {unknown}; "
                                 f"its candidates were {[w.id for w in t.candidates]}", "--approve")
            if not as_json:
                err.print(f"task {t.id}: {len(t.candidates)} candidate(s); approving {', '.join(ids)}")
            with err.status("selecting the variant and deploying its instances…"):
                t = await _approve_following(stubs, t.id, ids, strategy, wait=wait, timeout_s=wait_timeout)
        return t

    t = _run(_with_stubs(go, orchestrator=orchestrator))
    _emit(t, as_json, _print_task)
    if approve is None and not as_json:
        out.print(f"approve with: flowmaker task approve {t.id} [IDS...]  (no ids = all)")
    _exit_if_failed(t)


@task_app.command("approve")
def task_approve(
    task_id: Annotated[str, typer.Argument(help="The task.")],
    workflow_ids: Annotated[list[str] | None, typer.Argument(help="Candidate ids to approve; none = all.")] = None,
    strategy: Annotated[str, typer.Option("--strategy", help="Selection strategy (default: exact).")] = "",
    wait: WaitOpt = True,
    wait_timeout: WaitTimeoutOpt = 900.0,
    orchestrator: OrchestratorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve candidate workflows: the selector picks the best variant and the deployer starts it."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
    from flowmaker.launcher.client import call

    _check_strategy(strategy)

    async def go(stubs: Stubs) -> Any:
        orch = stubs.orchestrator()
        ids = [x.strip() for w in workflow_ids or [] for x in w.split(",") if x.strip()]  # "a,b" or "a b"
        if not ids:
            t = (await call(orch.GetTask(pb.GetTaskRequest(task_id=task_id)), stubs.orchestrator_addr)).task
            ids = [w.id for w in t.candidates]
        with err.status(f"selecting among {', '.join(ids)} and deploying…"):
            return await _approve_following(stubs, task_id, ids, strategy, wait=wait, timeout_s=wait_timeout)

    t = _run(_with_stubs(go, orchestrator=orchestrator))
    _emit(t, as_json, _print_task)
    _exit_if_failed(t)


@task_app.command("invoke")
def task_invoke(
    task_id: Annotated[str, typer.Argument(help="The task (ACTIVE or DEGRADED).")],
    text: Annotated[str, typer.Argument(help="The request's input text.")],
    stream: Annotated[bool, typer.Option("--stream", help="Print text as the stages produce it.")] = False,
    max_output_tokens: Annotated[int, typer.Option("--max-output-tokens", help="Cap per LLM call; 0 = stage's.")
                                 ] = 0,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", help="Sampling temperature of every LLM call, 0..2 (0 = greedy); default: the "
                              "engine's.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling, 0..1; default: the engine's.")
                     ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed: the same seed and input, the same "
                                                            "output (where the engine honours it).")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="End each LLM call's output before this text "
                                                                  "(repeatable, up to 4).")] = None,
    orchestrator: OrchestratorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run one request through the task's workflow and print the output with per-stage timings."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
    from flowmaker.launcher.client import failure_of, to_json

    sampling = pb.Sampling(temperature=temperature, top_p=top_p, seed=seed, stop=stop or [])

    async def streamed(stubs: Stubs) -> None:
        final: Any = None
        current = ""
        streamed: dict[str, str] = {}  # text printed per stage (LLM stages stream; TOOL stages do not)
        try:
            async for chunk in stubs.orchestrator().InvokeStream(pb.InvokeStreamRequest(
                    task_id=task_id, input=text, max_output_tokens=max_output_tokens, sampling=sampling)):
                kind = chunk.WhichOneof("chunk")
                if as_json:
                    typer.echo(json.dumps(to_json(chunk)))
                elif kind == "delta":
                    if chunk.stage_id != current:
                        current = chunk.stage_id
                        out.print(f"\n[bold]{current}>[/bold] ", end="")
                    out.print(chunk.delta, end="", markup=False, highlight=False)
                    streamed[current] = streamed.get(current, "") + chunk.delta
                elif kind == "stage_done":
                    sd = chunk.stage_done
                    err.print(f"\n[dim]stage {sd.stage_id} done in {sd.latency_s:.3f}s "
                              f"({sd.input_tokens} in / {sd.output_tokens} out, {sd.model_id or 'tool'})[/dim]")
                if kind == "done":
                    final = chunk.done
        except Exception as e:
            raise failure_of(e, stubs.orchestrator_addr) from None
        if final is not None and not as_json:
            if final.output and final.output != streamed.get(current):
                # The last stage did not stream (a TOOL stage): its output is the answer, print it.
                last = final.stages[-1].stage_id if final.stages else "output"
                out.print(f"\n[bold]{last}>[/bold] ", end="")
                out.print(final.output, end="", markup=False, highlight=False)
            out.print(f"\n[bold]done[/bold] in {final.latency_s:.3f}s (request {final.request_id})")

    if stream:
        _run(_with_stubs(streamed, orchestrator=orchestrator))
        return
    resp = _orchestrator_call(orchestrator, "Invoke", pb.InvokeRequest(
        task_id=task_id, input=text, max_output_tokens=max_output_tokens, sampling=sampling), status="invoking…")

    def show(r: Any) -> None:
        out.print(r.output, markup=False, highlight=False)
        tab = Table(title=f"request {r.request_id}: {r.latency_s:.3f}s end to end")
        for c in ("stage", "model", "instance", "in tok", "out tok", "start", "latency"):
            tab.add_column(c, justify="right" if c not in ("stage", "model", "instance") else "left")
        for st in r.stages:
            tab.add_row(st.stage_id, st.model_id or "(tool)", st.instance_id or "-", str(st.input_tokens),
                        str(st.output_tokens), f"{st.start_s:.3f}s", f"{st.latency_s:.3f}s")
        err.print(tab)

    _emit(resp, as_json, show)


@task_app.command("get")
def task_get(task_id: Annotated[str, typer.Argument(help="The task.")],
             orchestrator: OrchestratorOpt = None, as_json: JsonOpt = False) -> None:
    """Show a task: state, SLO, the chosen variant with its reuse mapping, predicted and observed latency."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb

    t = _orchestrator_call(orchestrator, "GetTask", pb.GetTaskRequest(task_id=task_id)).task
    _emit(t, as_json, _print_task)


@task_app.command("list")
def task_list(
    state: Annotated[str, typer.Option("--state", help="Only tasks in this state (e.g. ACTIVE).")] = "",
    orchestrator: OrchestratorOpt = None, as_json: JsonOpt = False,
) -> None:
    """List tasks, oldest first."""
    from flowmaker.api.common.v1 import task_pb2
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb

    st: Any = 0
    if state:
        key = "STATE_" + state.upper().removeprefix("STATE_")
        try:
            st = task_pb2.Task.State.Value(key)
        except ValueError:
            names = [n.removeprefix("STATE_") for n in task_pb2.Task.State.keys()[1:]]
            _die(f"error: INVALID_ARGUMENT: --state: unknown state {state!r}; known: {', '.join(names)}")

    _emit(_orchestrator_call(orchestrator, "ListTasks", pb.ListTasksRequest(state=st)), as_json, _tasks_table)


# `task list`'s columns after the id; `keep` ranks them for a narrow terminal (the id is never cut).
_TASK_COLUMNS = (KeyedColumn("name", 8, keep=2), KeyedColumn("state", 6, keep=1),
                 KeyedColumn("accuracy >=", 5, "right", keep=3), KeyedColumn("latency <=", 6, "right", keep=4),
                 KeyedColumn("rate", 4, "right", keep=5), KeyedColumn("workflow", 8, keep=9),
                 KeyedColumn("predicted", 6, "right", keep=8), KeyedColumn("p50", 5, "right", keep=7),
                 KeyedColumn("requests", 4, "right", keep=6), KeyedColumn("owner", 6, keep=10))


def _tasks_table(resp: Any) -> None:
    rows = [(t.id, {"state": _task_state(t), "name": t.name, "accuracy >=": f"{t.slo.min_accuracy:g}",
                    "latency <=": f"{t.slo.max_latency_s:g}s", "rate": f"{t.slo.arrival_rate_rps:g}",
                    "requests": str(t.requests_served), "p50": _s(t.observed_latency_p50_s),
                    "predicted": _s(t.predicted_latency_s), "workflow": t.variant.workflow_id or "-",
                    "owner": t.owner or "-"})
            for t in resp.tasks]
    out.print(keyed_table(f"{len(resp.tasks)} task(s)", "id", _TASK_COLUMNS, rows, width=out.width))


@task_app.command("delete")
def task_delete(task_id: Annotated[str, typer.Argument(help="The task.")],
                orchestrator: OrchestratorOpt = None, as_json: JsonOpt = False) -> None:
    """Delete a task; instances no other task uses are stopped."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb

    resp = _orchestrator_call(orchestrator, "DeleteTask", pb.DeleteTaskRequest(task_id=task_id),
                              status="releasing instances…")

    def show(r: Any) -> None:
        rel = ", ".join(r.released_instance_ids) or "none (all still used by other tasks)"
        out.print(f"deleted task {task_id}; instances stopped: {rel}")

    _emit(resp, as_json, show)


# ---- instances -------------------------------------------------------------------------------

def instances(
    model: Annotated[str, typer.Option("--model", help="Only instances of this model.")] = "",
    task: Annotated[str, typer.Option("--task", help="Only instances this task uses.")] = "",
    deployer: DeployerOpt = None, as_json: JsonOpt = False,
) -> None:
    """List model instances (state, GPUs, load, tasks) and the GPUs' memory, from the deployer."""
    from flowmaker.api.common.v1 import cluster_pb2
    from flowmaker.api.deployer.v1 import deployer_pb2 as pb
    from flowmaker.launcher.client import call, to_json

    async def go(stubs: Stubs) -> tuple[Any, Any]:
        d = stubs.deployer()
        insts = await call(d.ListInstances(pb.ListInstancesRequest(model_id=model, task_id=task)), stubs.deployer_addr)
        return insts, await call(d.ListGpus(pb.ListGpusRequest()), stubs.deployer_addr)

    insts, gpus = _run(_with_stubs(go, deployer=deployer))
    if as_json:
        _print_json({"instances": to_json(insts).get("instances", []), "gpus": to_json(gpus).get("gpus", [])})
        return
    rows = []
    for i in insts.instances:
        seen = i.HasField("observed_time")
        state = _state_name(cluster_pb2.Instance.State, i.state)
        if i.HasField("unresponsive_time"):  # the node's health probe gets no answer: maybe hung
            state += f" [red](unresponsive {max(0.0, time.time() - i.unresponsive_time.ToSeconds()):.0f}s)[/red]"
        rows.append((i.id, {
            "model": i.model_id, "tp x pp": f"{i.tp}x{i.pp}", "state": state, "GPUs": ",".join(i.gpu_ids),
            "planned tok/s": f"{i.load_output_tokens_per_s:.1f}",
            "observed tok/s": f"{i.observed_load_output_tokens_per_s:.1f}" if seen else "-",
            "queue": f"{i.observed_queue:.1f}" if seen else "-",
            "slowdown": f"{i.observed_slowdown:.1f}x" if seen else "-",
            "headroom": ("[red]none (saturated)[/red]" if i.saturated else "yes") if seen else "-",
            "tasks": ",".join(i.task_ids) or "-", "endpoint": i.endpoint or "-"}))
    # The id is never cut, at any width; see _INSTANCE_COLUMNS.
    out.print(keyed_table(f"{len(insts.instances)} instance(s)", "id", _INSTANCE_COLUMNS, rows, width=out.width))
    out.print(_gpu_table(gpus.gpus))


# `instances`' columns after the id, ranked by `keep` for a narrow terminal (the id is never cut).
_INSTANCE_COLUMNS = (KeyedColumn("model", 8, keep=1), KeyedColumn("tp x pp", 3, "right", keep=5),
                     KeyedColumn("state", 6, keep=2), KeyedColumn("GPUs", 4, keep=4),
                     KeyedColumn("planned tok/s", 5, "right", keep=6), KeyedColumn("observed tok/s", 5, "right", keep=7),
                     KeyedColumn("queue", 4, "right", keep=8), KeyedColumn("slowdown", 4, "right", keep=9),
                     KeyedColumn("headroom", 4, keep=10), KeyedColumn("tasks", 8, keep=3),
                     KeyedColumn("endpoint", 8, keep=11))


def _gpu_table(gpus: Any) -> Table:
    used = sum(g.memory_used_gb for g in gpus)
    total = sum(g.memory_total_gb for g in gpus)
    tab = Table(title=f"GPU memory: {used:.1f} / {total:.0f} GB in use")
    for c in ("GPU", "node", "type", "used GB", "total GB", ""):
        tab.add_column(c, justify="right" if "GB" in c else "left")
    for g in gpus:
        frac = g.memory_used_gb / g.memory_total_gb if g.memory_total_gb else 0.0
        bar = "█" * round(frac * 20) + "·" * (20 - round(frac * 20))
        tab.add_row(g.id, g.node, g.gpu_type, f"{g.memory_used_gb:.1f}", f"{g.memory_total_gb:.0f}", bar)
    return tab


# ---- up / down -------------------------------------------------------------------------------

def progress_printer(console: Console) -> Any:
    """A launcher progress callback printing one line per step (with elapsed time)."""
    t0 = time.monotonic()

    def show(step: str, detail: str) -> None:
        icon = "[green]✓[/green]" if detail.startswith(("ready", "stopped")) else "[cyan]•[/cyan]"
        console.print(f"  {icon} [{time.monotonic() - t0:5.1f}s] {step:<12} {detail}", highlight=False)

    return show


def up(
    gpus: Annotated[int, typer.Option("--gpus", min=1, max=64, help="GPUs of the emulated node.")] = 8,
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="GPU type of the emulated node (catalog name).")
                        ] = "A6000",
    time_scale: Annotated[float, typer.Option(
        "--time-scale", min=0.001, help="Emulated engines run their model clock this many times faster than wall "
                                        "time (1 = real time).")] = 1.0,
    port: Annotated[int, typer.Option("--port", min=0, max=65535,
                                      help="Orchestrator port; 0 = a free port (clients find it in the state file).")
                    ] = 0,
    orchestrators: Annotated[int, typer.Option(
        "--orchestrators", min=1, max=16, help="Orchestrator replicas, each supervised on its own port; every one "
                                               "serves every request, one elected replica reconciles. Clients get "
                                               "the list of addresses.")] = 2,
    gateway_port: Annotated[int, typer.Option(
        "--gateway-port", min=0, max=65535,
        help="Port of the OpenAI-compatible gateway, the same at every start so a client's base URL "
             f"(http://127.0.0.1:{DEFAULT_GATEWAY_PORT}/v1) survives restarts; taken = an error. 0 = a free port, "
             "kept in the work dir for the next start.")] = DEFAULT_GATEWAY_PORT,
    metrics: Annotated[bool, typer.Option(
        "--metrics/--no-metrics", help="Prometheus /metrics on every service, each on a port of its own (kept "
                                       "across restarts), listed in the output and the state file.")] = True,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Start in the background and return once ready; "
                                                                "stop it with `flowmaker down`.")] = False,
    foreground: Annotated[bool, typer.Option("--foreground", help="Run until Ctrl-C (the default).")] = True,
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="etcd data, logs and ports here, kept across "
                                                  "`down`/`up` (tasks come back); default: `stack/` beside the "
                                                  "state file (~/.flowmaker/stack).")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Empty the work dir first: start from a blank cluster "
                                                        "state.")] = False,
    etcd_bin: Annotated[str | None, typer.Option("--etcd-bin", help="etcd executable (default: etcd on PATH).")
                        ] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Plaintext gRPC with no authentication (local "
                                                              "debugging only). Default: mTLS between all services "
                                                              "with a local CA in <work dir>/pki, and bearer tokens "
                                                              "at the orchestrator.")] = False,
    engine_user: Annotated[str, typer.Option(
        "--engine-user", help="Run the engines as this user (name or uid), unable to read the suite's keys and "
                              "tokens; needs root, and a Python that user can run. Default: the deployer's own "
                              "user.")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Start a local stack (etcd + the five services + an emulated GPU node) and keep it running until Ctrl-C.

    Endpoints and the pid are written to the state file (FLOWMAKER_STATE_FILE, default
    ~/.flowmaker/stack.json) so the client commands find the stack and `flowmaker down` can stop it."""
    from flowmaker.launcher.client import settings
    from flowmaker.launcher.stack import (
        LocalStack,
        StackConfig,
        StackError,
        default_state_dir,
        port_free,
        private_dir,
        read_state,
        write_state,
    )

    s = settings()
    running = read_state(s.state_file)
    if running:
        _die(f"error: FAILED_PRECONDITION: a stack is already running (pid {running['pid']}, orchestrator "
             f"{running['services'].get('orchestrator')}); `flowmaker down` first")
    if gateway_port and gateway_port == port:
        _die(error_line("INVALID_ARGUMENT", f"--gateway-port {gateway_port} is also the orchestrator's --port",
                        field="--gateway-port"))
    if engine_user:
        from pydantic import ValidationError

        from services.deployer.settings import DeployerSettings

        try:  # the deployer's own check (a known user, and root), here before anything starts
            DeployerSettings(engine_user=engine_user, use_nvml=False)
        except ValidationError as e:
            _die(error_line("INVALID_ARGUMENT", str(e.errors()[0]["msg"]).removeprefix("Value error, "),
                            field="--engine-user"))
    host = StackConfig.host
    if gateway_port and not port_free(host, gateway_port):
        _die(error_line("UNAVAILABLE", f"{host}:{gateway_port} is in use (another `flowmaker up`, or another "
                        "program): pick a free port, or 0 for any free port, kept for the next start",
                        reason="PORT_IN_USE", field="--gateway-port"))
    state_dir = s.state_file.parent
    # The state file, the background log and (by default) the work dir with its pki live here: owner only.
    try:
        private_dir(state_dir, tighten=state_dir == default_state_dir())
    except OSError as e:
        _die(error_line("FAILED_PRECONDITION", f"cannot create the state file's directory {state_dir}: "
                        f"{e.strerror or e}", field="FLOWMAKER_STATE_FILE"))
    if detach:
        _up_detached(s.state_file, [a for a in sys.argv[1:] if a not in ("--detach", "-d")], as_json)
        return
    if work_dir is None:
        work_dir = private_dir(state_dir / "stack", tighten=state_dir == default_state_dir())
    if fresh and work_dir.exists():
        shutil.rmtree(work_dir)
    cfg = StackConfig(gpus=gpus, gpu_type=gpu_type, time_scale=time_scale, work_dir=work_dir,
                      keep_work_dir=True, ports={"orchestrator": port} if port else {}, tls=not insecure,
                      etcd_auth=not insecure,
                      gateway_port=gateway_port, metrics=metrics, orchestrators=orchestrators,
                      engine_user=engine_user)
    if etcd_bin:
        cfg.etcd_bin = etcd_bin
    con = err
    con.print(f"[bold]Starting the FlowMaker stack[/bold]: emulated node {cfg.node} with {gpus} x {gpu_type}, "
              f"engine time scale {time_scale:g}x")
    stack = LocalStack(cfg, progress=progress_printer(con))
    # SIGTERM (from `flowmaker down`) unwinds like Ctrl-C, through the same stop path.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        stack.start()
    except StackError as e:
        _die(f"error: UNAVAILABLE {e.reason}: {e}")
    except KeyboardInterrupt:
        _die("interrupted; everything started was stopped", 130)
    try:
        st = stack.state()
        _register_context(s, st)
        write_state(s.state_file, {**st, "ready": True})
        if as_json:
            typer.echo(json.dumps(st), nl=True)
            sys.stdout.flush()
        else:
            tab = Table(title="FlowMaker stack (Ctrl-C to stop)")
            tab.add_column("component")
            tab.add_column("address")
            tab.add_row("etcd", st["etcd"])
            for name, addr in st["services"].items():
                tab.add_row(name, addr)
            if st.get("gateway"):
                tab.add_row("OpenAI-compatible gateway", st["gateway"])
            for name, url in st.get("metrics", {}).items():
                tab.add_row(f"metrics: {name}", url)
            tab.add_row("work dir (etcd data, logs; kept)", str(stack.work_dir))
            tls = st.get("tls")
            tab.add_row("TLS (CA, admin cert, tokens)", f"{tls['ca']}, {tls['cert']}, {tls['tokens_file']}" if tls
                        else "OFF (--insecure): plaintext, no authentication")
            tab.add_row("etcd auth (a user and role per service)",
                        f"{st['etcd_auth_dir']} (password files)" if st.get("etcd_auth_dir") else "OFF (--insecure)")
            tab.add_row("state file", str(s.state_file))
            out.print(tab)
            out.print(f"try: flowmaker task deploy \"Summarise a document\" --accuracy 0.3 --latency 20 --rate 0.5 "
                      f"--approve all   (or export FLOWMAKER_ORCHESTRATOR_ADDR={st['services']['orchestrator']})")
            if st.get("gateway"):
                key = (f", OPENAI_API_KEY=<your FlowMaker token; the admin's is in {st['tls']['tokens_file']}>"
                       if st.get("tls") else "")
                out.print(f"then call a task with any OpenAI client: OPENAI_BASE_URL={st['gateway']}{key} "
                          "(model = the task id; GET /models lists the ACTIVE tasks)", markup=False)
        while True:
            time.sleep(1.0)
            # Supervise: a child that died is restarted with backoff; the stack is never torn down for it.
            events = stack.supervise()
            for line in events:
                con.print(f"  [yellow]![/yellow] {line}", highlight=False)
            if events:
                write_state(s.state_file, {**stack.state(), "ready": True})
    except KeyboardInterrupt:
        con.print("stopping…")
    except StackError as e:
        con.print(f"error: UNAVAILABLE {e.reason}: {e}", markup=False)
        raise typer.Exit(1) from None
    finally:
        # A second Ctrl-C / SIGTERM must not cut the clean-up short (that is what leaves orphans).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        with contextlib.suppress(OSError):
            st_now = read_state(s.state_file)
            if st_now is None or st_now.get("pid") == os.getpid():
                s.state_file.unlink(missing_ok=True)
    con.print("stack stopped")


LOCAL_CONTEXT = "local"


def _register_context(s: Any, st: dict[str, Any]) -> None:
    """`up` keeps its own context, `local`, up to date with this start's addresses and files (current when no
    context is), so the stack is reached the same way as compose's or Kubernetes'. Failing to write it costs the
    stack nothing: the state file still leads the CLI here."""
    from flowmaker.launcher.contexts import Context, ContextError, upsert

    tls = st.get("tls") or {}
    svc = st.get("services", {})
    ctx = Context(orchestrator=svc.get("orchestrator", ""), deployer=svc.get("deployer", ""),
                  profiler=svc.get("profiler", ""), gateway=st.get("gateway") or "", tls_ca=tls.get("ca", ""),
                  tls_cert=tls.get("cert", ""), tls_key=tls.get("key", ""), token_file=tls.get("tokens_file", ""))
    try:
        upsert(s.config_file, LOCAL_CONTEXT, ctx)
    except (OSError, ContextError) as e:
        err.print(f"warning: context {LOCAL_CONTEXT!r} not saved in {s.config_file}: {e}", markup=False)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _up_detached(state_file: Path, args: list[str], as_json: bool) -> None:
    from flowmaker.launcher.stack import read_state

    log = state_file.parent / "up.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "flowmaker.cli.main", *args], stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    with err.status("starting the stack in the background…"):
        while time.monotonic() < deadline:
            st = read_state(state_file)
            if st and st.get("pid") == proc.pid and st.get("ready"):
                if as_json:
                    typer.echo(json.dumps(st))
                else:
                    gw = f", OpenAI-compatible gateway {st['gateway']}" if st.get("gateway") else ""
                    out.print(f"stack running (pid {proc.pid}); orchestrator {st['services']['orchestrator']}, "
                              f"deployer {st['services']['deployer']}{gw}; log {log}; stop with `flowmaker down`")
                return
            if proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                _die(f"error: UNAVAILABLE STACK_START_FAILED: the background stack exited with code "
                     f"{proc.returncode}; {log}:\n{tail}")
            time.sleep(0.3)
    proc.terminate()
    _die(f"error: DEADLINE_EXCEEDED: the background stack was not ready within 180s; see {log}")


def down() -> None:
    """Stop the stack started by `flowmaker up` (found through its state file)."""
    from flowmaker.launcher.client import settings
    from flowmaker.launcher.stack import read_state

    s = settings()
    st = read_state(s.state_file)
    if st is None:
        _die(f"error: NOT_FOUND: no running stack (state file {s.state_file})")
    pid = int(st["pid"])
    os.kill(pid, signal.SIGTERM)
    with err.status(f"stopping the stack (pid {pid})…"):
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                out.print("stack stopped")
                return
            time.sleep(0.2)
    _die(f"error: DEADLINE_EXCEEDED: pid {pid} still running after 90s")


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("down")(down)
    app.command("instances")(instances)
    app.add_typer(task_app, name="task")
