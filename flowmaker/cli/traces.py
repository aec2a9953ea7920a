"""`flowmaker traces ...`: download the Azure LLM inference traces, synthesise look-alikes, print statistics."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from flowmaker.cli.output import console, fail, fail_from
from flowmaker.errors import FlowMakerError
from flowmaker.eval.trace_stats import TRACE_KINDS

# flowmaker.eval.traces (numpy) and urllib are imported by the commands that use them: `--help` stays fast.

traces_app = typer.Typer(help="Azure LLM inference traces: download, synthesise, inspect.", no_args_is_help=True)


def download(dest: Path, kinds: tuple[str, ...] = TRACE_KINDS, timeout_s: float = 60.0) -> list[Path]:
    """Fetch the trace CSVs into `dest`; raise RuntimeError with the URL and the cause when a download fails."""
    import urllib.error
    import urllib.request

    from flowmaker.eval.traces import TRACE_FILES, TRACE_URL, load_trace

    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for kind in kinds:
        url = TRACE_URL.format(kind=kind)
        target = dest / TRACE_FILES[kind]
        tmp = target.with_suffix(".csv.part")
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp, tmp.open("wb") as f:
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"could not download {url}: {e}. Without internet, download it elsewhere and "
                               f"copy it to {target}, or use `flowmaker traces synth --kind {kind}`.") from e
        tmp.replace(target)
        load_trace(target, kind)  # fail now, not at benchmark time, if the file is not a trace
        out.append(target)
    return out


@traces_app.command("download")
def download_cmd(dest: Path = typer.Option(Path("traces"), "--dest", help="Directory to write the CSVs to."),
                 kind: list[str] = typer.Option(list(TRACE_KINDS), "--kind", help="code and/or conv.")) -> None:
    """Download AzureLLMInferenceTrace_{code,conv}.csv from the AzurePublicDataset on GitHub."""
    bad = [k for k in kind if k not in TRACE_KINDS]
    if bad:
        raise typer.BadParameter(f"unknown trace kind(s) {bad}; known: {list(TRACE_KINDS)}", param_hint="--kind")
    try:
        paths = download(dest, tuple(kind))
    except FlowMakerError as e:
        fail_from(e)
    except RuntimeError as e:
        fail("UNAVAILABLE", str(e), reason="DOWNLOAD_FAILED")
    for p in paths:
        typer.echo(f"wrote {p}")


@traces_app.command("synth")
def synth_cmd(kind: str = typer.Option(..., "--kind", help="code or conv: which trace to imitate."),
              out: Path = typer.Option(..., "--out", help="CSV file to write (Azure trace format)."),
              requests: int = typer.Option(0, "--requests", help="Number of requests (0 = as many as the real trace)."),
              seed: int = typer.Option(0, "--seed")) -> None:
    """Write a deterministic synthetic trace with the real trace's rate, burstiness and token distributions."""
    from flowmaker.eval.traces import synthesize, write_trace

    try:
        tr = synthesize(kind, requests or None, seed)
    except FlowMakerError as e:
        raise typer.BadParameter(str(e), param_hint="--kind" if e.field == "kind" else "--requests") from None
    write_trace(tr, out)
    typer.echo(f"wrote {out} ({len(tr)} requests, {tr.source})")


@traces_app.command("stats")
def stats_cmd(file: Path = typer.Argument(..., help="A trace CSV."),
              as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Rate, inter-arrival burstiness and token percentiles of a trace file."""
    from flowmaker.eval.traces import load_trace, trace_stats

    try:
        st = trace_stats(load_trace(file))
    except FlowMakerError as e:
        fail_from(e)
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    con = console()
    con.print(f"[bold]{file}[/] kind={st['kind']} requests={st['n_requests']} duration={st['duration_s']:.1f}s "
              f"rate={st['mean_rate_rps']:.3f} req/s inter-arrival mean={st['interarrival_mean_s']:.4f}s "
              f"median={st['interarrival_median_s']:.4f}s CV={st['interarrival_cv']:.2f}")
    t = Table("tokens", "min", "p10", "p25", "median", "mean", "p75", "p90", "p95", "p99", "max", "std")
    for col in ("context", "generated"):
        d = st[col]
        assert isinstance(d, dict)
        t.add_row(col, *(f"{d[k]:.0f}" for k in ("minimum", "p10", "p25", "median", "mean", "p75", "p90", "p95",
                                                  "p99", "maximum", "std")))
    con.print(t)


def register(app: typer.Typer) -> None:
    app.add_typer(traces_app, name="traces")
