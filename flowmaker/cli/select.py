"""`flowmaker select`: run a selection strategy on a SelectVariant request file (proto3 JSON)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from flowmaker.cli.output import console, fail, fail_from
from flowmaker.errors import FlowMakerError


def select_cmd(request: Path = typer.Option(..., "--request", "-r", help="SelectVariant request, proto3 JSON."),
               strategy: str | None = typer.Option(None, help="exact (default) | milp | heuristic | exhaustive | bayesopt; "
                                                              "overrides the file's `strategy`."),
               time_budget: float | None = typer.Option(
                   None, "--time-budget", min=0.0,
                   help="Seconds the strategy may search (overrides the file's options.time_budget_s). exact then "
                        "answers with the best variant found, optimal=false and a proven lower bound."),
               json_out: bool = typer.Option(False, "--json", help="Print the SelectVariant response JSON.")) -> None:
    """Pick the least-cost feasible workflow variant (see docs/selection-spec.md and examples/README.md)."""
    import dataclasses

    from flowmaker.convert import select_variant_request_from_json, selection_result_to_json
    from flowmaker.selection import select

    try:
        text = request.read_text()
    except OSError as e:
        fail("INVALID_ARGUMENT", f"cannot read {request}: {e.strerror}", field="--request")
    try:
        req, file_strategy = select_variant_request_from_json(text)
        if time_budget is not None:
            req = dataclasses.replace(req, options=dataclasses.replace(req.options, time_budget_s=time_budget))
        res = select(req, strategy or file_strategy or "exact")
    except FlowMakerError as e:
        fail_from(e)
    if json_out:
        typer.echo(selection_result_to_json(res))
        return
    con = console()
    if res.variant is None:
        con.print(f"[yellow]no feasible variant[/]: {res.reason.value if res.reason else '?'} — {res.reason_detail}")
    else:
        v = res.variant
        con.print(f"workflow [bold]{v.workflow_id}[/]  latency {v.latency_s:.3f} s  accuracy {v.accuracy:.3f}  "
                  f"cost {v.cost:.2f} GB·s  new memory {v.new_memory_gb:.1f} GB on {v.new_gpus} GPUs")
        t = Table("stage", "instance", "model", "tp", "pp", "GPUs", "latency s")
        news = {n.key: n for n in v.new_instances}
        for a in v.assignments:
            keys = a.replica_keys or (a.new_key,)
            inst = a.instance_id if a.reused else f"{a.new_key} (new)"
            gpus = ",".join(a.gpu_ids)
            if len(keys) > 1:  # a replica group: every replica and its GPUs, one per line
                inst = "\n".join(keys) + f"\n({len(keys)} new replicas)"
                gpus = "\n".join(",".join(news[k].gpu_ids) for k in keys if k in news)
            t.add_row(a.stage_id, inst, a.model_id, str(a.tp), str(a.pp), gpus, f"{a.latency_s:.3f}")
        con.print(t)
    if res.optimal:
        proof = "proven optimal" if res.variant is not None else "proven infeasible"
    elif res.variant is not None and res.gap is not None:
        proof = f"not proven optimal: lower bound {res.lower_bound:.2f} GB·s, gap {res.gap:.1%}"
    else:
        proof = "not proven"
    con.print(f"strategy {res.strategy}: {res.variants_evaluated:,} variants evaluated of {res.search_space_size:,} "
              f"in {res.elapsed_s * 1e3:.2f} ms" + (" (timed out)" if res.timed_out else "") + f"; {proof}")
    if res.variant is None:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("select")(select_cmd)
