"""`flowmaker bench selector|serving|adapt`: benchmarks that print a table and write JSON + PNG plots."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

bench = typer.Typer(help="Benchmarks (JSON + table + PNG plots).", no_args_is_help=True)


@bench.command("selector")
def selector(out: Path = typer.Option(Path("out/bench-selector"), help="Output folder for JSON and PNG."),
             repeats: int = typer.Option(5, help="Timing repeats for exact/heuristic."),
             exhaustive_budget: float = typer.Option(20.0, help="Time budget (s) per exhaustive run."),
             bayesopt_budget: float = typer.Option(15.0, help="Time budget (s) per bayesopt run."),
             bayesopt_trials: int = typer.Option(200, help="Bayesian-optimisation trials."),
             depth_budget: float = typer.Option(5.0, help="Budget (s) for exhaustive/bayesopt in depth/catalog."),
             quick: bool = typer.Option(False, help="Small run for smoke tests (depth 4, catalogs 11/25)."),
             section: list[str] = typer.Option(
                 ["paper", "depth", "catalog", "adversarial"], "--section",
                 help="Experiments to run (repeatable): paper, depth, catalog, adversarial, hard."),
             adversarial_per_kind: int = typer.Option(4, help="Seeded adversarial instances per kind."),
             adversarial_budget: float = typer.Option(1.9, help="exact's time budget (s) on adversarial instances."),
             hard_count: int = typer.Option(20, "--count", help="hard: fresh instances per hard family."),
             family: list[str] = typer.Option(
                 [], "--family", help="hard: only these families (repeatable): chain_clones, wide_fan, fragmented, "
                                      "dag_mix, memory_ties. Default: all."),
             hard_budget: float = typer.Option(2.0, help="hard: exact's time budget (s) per instance."),
             burn: int = typer.Option(0, help="hard: busy-loop processes that load the machine meanwhile."),
             seed: int = typer.Option(0, help="Seed of the synthetic catalog, BO and the adversarial generators."),
             gpu_sharing: str = typer.Option("ignore", help="Contract of every request: ignore (the paper's base "
                                                            "contract) or interference (GPU sharing extension)."),
             json_out: bool = typer.Option(False, "--json", help="Print the JSON instead of tables.")) -> None:
    """Exact vs heuristic vs exhaustive vs Bayesian optimisation: paper scale, depth, catalog size; exact on
    seeded adversarial instances under its time budget (proven optimal or not, gap)."""
    import dataclasses

    from flowmaker.bench.selector import BenchConfig, render, run_selector_bench

    cfg = BenchConfig(repeats=repeats, exhaustive_budget_s=exhaustive_budget, bayesopt_budget_s=bayesopt_budget,
                      bayesopt_trials=bayesopt_trials, depth_budget_s=depth_budget)
    if quick:
        cfg = BenchConfig(repeats=1, exhaustive_budget_s=2.0, bayesopt_budget_s=2.0, bayesopt_trials=15,
                          depth_max=4, depth_budget_s=1.0, catalog_sizes=(11, 25), adversarial_per_kind=1)
    cfg = dataclasses.replace(cfg, sections=tuple(section), seed=seed,
                              adversarial_per_kind=1 if quick else adversarial_per_kind,
                              adversarial_budget_s=adversarial_budget, gpu_sharing=gpu_sharing,
                              hard_count=hard_count, hard_budget_s=hard_budget, hard_burn=burn,
                              hard_families=tuple(family))
    console = Console(stderr=json_out, width=max(150, Console().width))
    from flowmaker.errors import InvalidSpec

    try:
        with console.status("benchmarking selection strategies") as status:
            result = run_selector_bench(out, cfg, progress=lambda m: status.update(m))
    except InvalidSpec as e:  # a bad option value: the option named, no traceback
        raise typer.BadParameter(e.message, param_hint=f"--{(e.field or '').replace('_', '-')}") from None
    if json_out:
        typer.echo((out / "selector.json").read_text())
    else:
        render(result, console)
        console.print(f"JSON: {out / 'selector.json'}")


@bench.command("soak")
def soak(duration: float = typer.Option(600.0, help="Seconds of faults under load."),
         seed: int = typer.Option(1, help="Seed of the fault schedule."),
         rate: float = typer.Option(3.0, help="Steady load, requests/s over the tasks."),
         tasks: int = typer.Option(3, help="Tasks deployed before the faults start."),
         out: Path = typer.Option(Path("out/bench-soak"), help="Output folder for the JSON report."),
         faults: str = typer.Option("", help="Comma-separated fault kinds to draw from (default: all of "
                                    "engine, deployer, orchestrator, etcd_kill, etcd_stop, engine_stop, "
                                    "deployer_stop, etcd_kill_deploying, etcd_stop_deploying, "
                                    "orchestrator_kill_deploying, deployer_stop_deploying, orchestrator_replica, "
                                    "orchestrator_leader)."),
         insecure: bool = typer.Option(False, "--insecure", help="Plaintext stack instead of the shipped mTLS one."),
         fast: bool = typer.Option(False, "--fast", help="Shorter lease and grace times than the defaults."),
         gap: float = typer.Option(30.0, min=1.0, help="Longest quiet time between a heal and the next fault "
                                   "(the shortest is a third of it)."),
         json_out: bool = typer.Option(False, "--json", help="Print the JSON instead of the table.")) -> None:
    """Crash (kill -9) and hang (SIGSTOP) engines, the deployer, the orchestrator and etcd, also in the middle
    of approvals, on a seeded schedule under steady load on a real local stack in the shipped configuration:
    goodput, requests lost, time to heal from each fault's start, invariants every second.
    Exit code 1 when a fault did not heal or an invariant was violated."""
    from flowmaker.bench.soak import FAULTS, SoakConfig, render, run_soak

    console = Console(stderr=json_out)
    kinds = tuple(k.strip() for k in faults.split(",") if k.strip()) or FAULTS
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        raise typer.BadParameter(f"unknown fault kind(s) {unknown}; known: {', '.join(FAULTS)}",
                                 param_hint="--faults")
    cfg = SoakConfig(duration_s=duration, seed=seed, rate_rps=rate, tasks=tasks, faults=kinds, tls=not insecure,
                     fast=fast, gap_s=(gap / 3, gap))
    res = run_soak(cfg, out, progress=lambda m: console.print(f"  {m}", highlight=False))
    if json_out:
        typer.echo((out / "soak.json").read_text())
    else:
        render(res, console)
        console.print(f"JSON: {out / 'soak.json'}")
    if res.violations or res.settled_violations or not all(f.healed for f in res.faults):
        raise typer.Exit(1)


@bench.command("fuzz")
def fuzz(per_rpc: int = typer.Option(1000, help="Cases per RPC (CI runs 150)."),
         seed: int = typer.Option(1, help="Random seed (the same seed replays the same cases)."),
         etcd: str = typer.Option("", help="host:port of an etcd to use (a fresh namespace); "
                                          "empty = start a throw-away etcd."),
         timeout: float = typer.Option(5.0, help="A call unanswered after this many seconds is a hang."),
         out: Path = typer.Option(Path("out/bench-fuzz"), help="Output folder for the JSON report."),
         json_out: bool = typer.Option(False, "--json", help="Print the JSON instead of the table.")) -> None:
    """Fuzz every RPC of the five services (in process, real etcd): status-code histogram, INTERNAL/UNKNOWN,
    hangs, health and etcd after rejected calls. Exit code 1 when any of them is not clean."""
    import asyncio
    import contextlib
    import json
    import logging

    from flowmaker.bench.fuzz import fuzz_with_etcd, temporary_etcd

    logging.getLogger().setLevel(logging.ERROR)
    console = Console(stderr=True)
    with contextlib.ExitStack() as stack:
        endpoint = etcd or stack.enter_context(temporary_etcd())
        with console.status("fuzzing") as status:
            report = asyncio.run(fuzz_with_etcd(endpoint, per_rpc=per_rpc, seed=seed, timeout_s=timeout,
                                                progress=lambda m: status.update(m)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if json_out:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        typer.echo(report.table())
        typer.echo(f"JSON: {out / 'fuzz.json'}")
    raise typer.Exit(0 if report.ok else 1)


@bench.command("paper")
def paper(out: Path = typer.Option(Path("out/bench-paper"), help="Output folder for the JSON."),
          traces: Path | None = typer.Option(None, help="Folder with the Azure 2023 trace CSVs; synthetic when "
                                                        "absent (falls back to ../shared/reference/traces)."),
          experiment: Path | None = typer.Option(None, help="The declared experiment (TOML; default: the shipped "
                                                            "flowmaker/eval/data/paper-scale.toml)."),
          seeds: str = typer.Option("", help="Comma-separated seeds (default: the experiment's spread)."),
          sensitivity: bool = typer.Option(True, "--sensitivity/--no-sensitivity",
                                           help="Also run each sharing mode and single-stage baselines.")) -> None:
    """The whole published comparison on the declared experiment: ours beside the published figures, the
    experiment's hash, the seed spread, sensitivity rows, and FlowMaker against every other policy per cell."""
    from flowmaker.bench.paper import run_paper_bench
    from flowmaker.eval.experiment import load_experiment

    if traces is None:
        guess = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "traces"
        traces = guess if guess.is_dir() else None
    run_paper_bench(out, traces_dir=traces, experiment=load_experiment(experiment),
                    seeds=[int(x) for x in seeds.split(",") if x.strip()] or None, sensitivity=sensitivity)


@bench.command("serving")
def serving(out: Path = typer.Option(Path("out/bench-serving"), help="Output folder for JSON and PNG."),
            traces: Path | None = typer.Option(None, help="Folder with the Azure 2023 trace CSVs; synthetic when "
                                                          "absent (falls back to ../shared/reference/traces)."),
            seed: int = typer.Option(0, help="Random seed (the run is deterministic under it)."),
            colocation: str = typer.Option("dynamic", help="GPU sharing in the simulator: dynamic (instances on "
                                                           "a GPU share it while busy), ignore, worst-case."),
            plan_tokens: str = typer.Option("median", help="Request the selector-based policies size stages "
                                                           "with: median or mean."),
            experiment: Path | None = typer.Option(None, help="The declared experiment (TOML; default: the "
                                                               "shipped flowmaker/eval/data/paper-scale.toml)."),
            variant: list[str] = typer.Option([], "--variant", help="Sensitivity variant of the experiment, "
                                                                  "repeatable: product-targets (the tasks' own "
                                                                  "accuracy targets), published-latency-scale "
                                                                  "(generated tokens x 4)."),
            segment_requests: int | None = typer.Option(None, help="Override the experiment's requests per "
                                                                   "replayed segment (a new experiment)."),
            colocation_kappa: float = typer.Option(1.0, help="Sensitivity: how much a busy co-resident slows an "
                                                             "instance in the simulator (1: time sharing), and "
                                                             "the kappa the selector-based policies plan with."),
            baseline_workflow: str = typer.Option("fixed", help="The baselines' workflow: fixed (declared) or "
                                                                "single-stage (sensitivity)."),
            langchain_model: str = typer.Option("smallest", help="LangChain's model rule: smallest (meeting "
                                                                 "the accuracy target) or strong (Qwen2.5-14B)."),
            loads: str = typer.Option("", help="Comma-separated load levels (default: the experiment's)."),
            policies: str = typer.Option("", help="Comma-separated policies (default: all)."),
            trace_kinds: str = typer.Option("code,conv", "--trace-kinds", help="Comma-separated: code, conv."),
            burst_headroom: bool = typer.Option(True, "--burst-headroom/--no-burst-headroom",
                                                help="FlowMaker plans for the bursts seen before each deploy, or "
                                                     "at the measured rate (the published system)."),
            max_instance_gpus: int = typer.Option(0, help="Sensitivity: the selector-based policies choose "
                                                          "configurations of at most this many GPUs (0: any)."),
            gpu_price_gb: float = typer.Option(0.0, help="Sensitivity: the selector-based policies price each GPU "
                                                         "a new instance spans at this many GB (0: memory only, "
                                                         "-1: one GPU's memory)."),
            json_out: bool = typer.Option(False, "--json", help="Print the JSON instead of tables.")) -> None:
    """Trace-driven simulation of every policy on 8xA6000: every published comparison per trace and load."""
    from flowmaker.bench.serving import run_serving_bench
    from flowmaker.eval.experiment import load_experiment
    from flowmaker.eval.experiment import variant as experiment_variant

    if traces is None:
        guess = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "traces"
        traces = guess if guess.is_dir() else None
    exp = load_experiment(experiment)
    for v in variant:
        exp = experiment_variant(exp, v)
    result = run_serving_bench(out, traces_dir=traces, seed=seed, colocation=colocation, plan_tokens=plan_tokens,
                               experiment=exp, segment_requests=segment_requests, colocation_kappa=colocation_kappa,
                               baseline_workflow=baseline_workflow, langchain_rule=langchain_model, quiet=json_out,
                               loads=[float(x) for x in loads.split(",") if x.strip()] or None,
                               policies=[x.strip() for x in policies.split(",") if x.strip()] or None,
                               traces=[x.strip() for x in trace_kinds.split(",") if x.strip()],
                               burst_headroom=burst_headroom, max_instance_gpus=max_instance_gpus,
                               gpu_price_gb=gpu_price_gb)
    if json_out:
        import json

        typer.echo(json.dumps(result, indent=1, default=str))


@bench.command("adapt")
def adapt(out: Path = typer.Option(Path("out/bench-adapt"), help="Output folder for JSON and PNG."),
          traces: Path | None = typer.Option(None, help="Folder with the Azure 2023 trace CSVs; synthetic when "
                                                        "absent (falls back to ../shared/reference/traces)."),
          seed: int = typer.Option(0, help="Random seed (segment offsets, request-to-task draw)."),
          loads: str = typer.Option("", help="Comma-separated load levels (default 0.25,0.5,0.75,1)."),
          trace_kinds: str = typer.Option("code,conv", "--trace-kinds", help="Comma-separated: code, conv."),
          replay: str = typer.Option("experiment", help="experiment: the declared experiment's replay, tasks, "
                                                         "SLOs and rates (its clock: period = window = its monitor "
                                                         "window); segment: the older fixed-seconds segment."),
          experiment: Path | None = typer.Option(None, help="The declared experiment (TOML; default: the shipped "
                                                            "flowmaker/eval/data/paper-scale.toml)."),
          segment_s: float = typer.Option(600.0, help="segment replay: trace seconds replayed per load level."),
          band: float = typer.Option(2.0, help="Drift band (LoadPolicy.band)."),
          hold_down: float = typer.Option(30.0, help="Hold-down, trace seconds (LoadPolicy.hold_down_s)."),
          period: float = typer.Option(60.0, help="Controller period, trace seconds."),
          window: float = typer.Option(60.0, help="Observed rate/latency window, trace seconds."),
          ready: float = typer.Option(15.0, help="Re-selection to new variant serving, trace seconds."),
          colocation: str = typer.Option("dynamic", help="GPU sharing in the simulator: dynamic or ignore."),
          max_replicas: int = typer.Option(4, help="Replicas per stage a re-selection may scale out to."),
          gpu_sharing: str = typer.Option("interference", help="GPU sharing of the selections: interference "
                                                               "(docs/selection-spec.md) or ignore (the paper)."),
          capacity_model: str = typer.Option("busy_time", help="Capacity model of the selections: busy_time or "
                                                               "output_tokens (docs/selection-spec.md)."),
          json_out: bool = typer.Option(False, "--json", help="Print the JSON instead of tables.")) -> None:
    """Deploy-once vs adaptive re-selection (the orchestrator's drift rule) on a replayed Azure trace segment:
    goodput, cost, re-selections, plots over time."""
    from flowmaker.bench.adapt import AdaptConfig, run_adapt_bench
    from flowmaker.errors import InvalidSpec
    from flowmaker.eval.experiment import load_experiment

    if replay not in ("experiment", "segment"):
        raise InvalidSpec(f"unknown replay {replay!r}; known: experiment, segment", field="replay")
    if traces is None:
        guess = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "traces"
        traces = guess if guess.is_dir() else None
    cfg = AdaptConfig(band=band, hold_down_trace_s=hold_down, period_trace_s=period, window_trace_s=window,
                      ready_trace_s=ready, colocation=colocation, seed=seed, segment_s=segment_s,
                      max_replicas=max_replicas, capacity_model=capacity_model, gpu_sharing=gpu_sharing)
    result = run_adapt_bench(out, traces_dir=traces, cfg=cfg,
                             loads=[float(x) for x in loads.split(",") if x.strip()] or None,
                             traces=[x.strip() for x in trace_kinds.split(",") if x.strip()],
                             console=Console(stderr=json_out, width=200),
                             experiment=load_experiment(experiment) if replay == "experiment" else None)
    if json_out:
        import json

        typer.echo(json.dumps(result, indent=1, default=str))


def register(app: typer.Typer) -> None:
    app.add_typer(bench, name="bench")


@bench.command("live-sharing")
def live_sharing(out: Path = typer.Option(Path("out/bench-live-sharing"), help="Output folder for the JSON report "
                                                                            "(or a path ending in .json)."),
                 tasks: str = typer.Option("", help="Comma-separated evaluation tasks (default: all 7)."),
                 load: float = typer.Option(1.0, min=0.01, help="Fraction of each task's nominal rate, deployed "
                                                                "and sent."),
                 time_scale: float = typer.Option(2.0, min=0.1, help="Emulated engines' model seconds per wall "
                                                                     "second."),
                 duration: float = typer.Option(300.0, min=1.0, help="Wall seconds of load (a shorter window at "
                                                                     "high load is a noisy sample)."),
                 warmup: float = typer.Option(15.0, min=0.0, help="Wall seconds at the start of the load not "
                                                                  "measured."),
                 drain: float = typer.Option(20.0, min=0.0, help="Wall seconds to wait for requests in flight "
                                                                 "after the load."),
                 gpus: int = typer.Option(8, min=1, max=64, help="GPUs of the emulated node."),
                 gpu_type: str = typer.Option("A6000", help="GPU type of the emulated node."),
                 seed: int = typer.Option(0, help="Seed of the arrival times."),
                 follow_load: bool = typer.Option(False, help="Let the orchestrator re-select for load during the "
                                                              "run (off: the deployed variants are what is measured)."),
                 gpu_price_gb: float | None = typer.Option(None, min=-1.0, max=10_000.0, help="The orchestrator's "
                                                           "default options.gpu_price_gb (absent: its own default, "
                                                           "one GPU's memory; 0: memory only, which shares GPUs at "
                                                           "the declared rates)."),
                 work_dir: Path | None = typer.Option(None, help="Keep the stack's work dir (logs) here."),
                 json_out: bool = typer.Option(False, "--json", help="Print the full JSON instead of the tables.")
                 ) -> None:
    """Live stack under GPU sharing: deploy tasks until instances share GPUs, send open-loop load at the declared
    rates, report per task p95 vs SLO and per shared stage predicted vs measured latency. Exit 0 (figures only;
    130 when interrupted)."""
    import json

    from flowmaker.bench.live_sharing import LiveSharingConfig, render, run_live_sharing, summary_json
    from flowmaker.eval.tasks import EVAL_TASKS

    names = tuple(x.strip() for x in tasks.split(",") if x.strip())
    known = [t.name for t in EVAL_TASKS]
    if any(n not in known for n in names):
        raise typer.BadParameter(f"unknown task(s) {[n for n in names if n not in known]}; known: {known}",
                                 param_hint="--tasks")
    cfg = LiveSharingConfig(tasks=names, load=load,
                            time_scale=time_scale, duration_s=duration, warmup_s=min(warmup, duration / 2),
                            drain_s=drain, gpus=gpus, gpu_type=gpu_type, seed=seed, follow_load=follow_load,
                            gpu_price_gb=gpu_price_gb, work_dir=work_dir)
    console = Console(stderr=True, width=max(200, Console().width))
    try:
        res = run_live_sharing(cfg, out, progress=lambda m: console.print(f"  {m}", highlight=False, markup=False))
    except KeyboardInterrupt:
        console.print("interrupted")
        raise typer.Exit(130) from None
    if json_out:
        typer.echo(json.dumps(res, indent=1))
        return
    render(res, Console(width=max(200, Console().width)))
    typer.echo(json.dumps(summary_json(res), indent=1))


@bench.command("frontdoor")
def frontdoor(tasks: int = typer.Option(1000, min=1, help="Task records seeded in etcd (one is the user's)."),
              calls: int = typer.Option(200, min=10, help="Timed calls per measurement."),
              etcd: str = typer.Option("", help="host:port of an etcd (a fresh namespace); default: start one."),
              out: Path = typer.Option(Path("out/bench-frontdoor"), help="Output folder for the JSON.")) -> None:
    """The orchestrator's front door over many tasks: ListTasks for a user with one task, for the admin, GetTask,
    and the old etcd-scan listing for comparison (flowmaker.bench.frontdoor). Figures only; asserts nothing."""
    from flowmaker.bench.frontdoor import main as frontdoor_main

    frontdoor_main(["--tasks", str(tasks), "--calls", str(calls), "--etcd", etcd, "--out", str(out)])


@bench.command("throughput")
def throughput(rates: str = typer.Option("50,150,300", help="Comma-separated open-loop rates, req/s."),
               duration: float = typer.Option(10.0, min=1.0, help="Seconds of load per path and rate."),
               time_scale: float = typer.Option(200.0, help="Emulated engines' model seconds per wall second."),
               orchestrators: int = typer.Option(1, min=1, help="Orchestrator replicas (round robin)."),
               paths: str = typer.Option("grpc-admin,grpc-user,gateway", help="Which front doors to load."),
               out: Path = typer.Option(Path("out/bench-throughput"), help="Output folder for the JSON."),
               json_out: bool = typer.Option(False, "--json", help="Print the JSON instead of the table.")) -> None:
    """Open-loop Invoke through each front door of a real TLS stack (admin token, non-admin token, the OpenAI
    gateway): errors and p50/p99 per rate, and the hop above the engine. Figures only; asserts nothing."""
    from flowmaker.bench.throughput import PATHS, ThroughputConfig, render, run_throughput
    from flowmaker.errors import InvalidSpec

    ps = tuple(p.strip() for p in paths.split(",") if p.strip())
    if not ps or any(p not in PATHS for p in ps):
        raise InvalidSpec(f"paths must name some of {list(PATHS)}, got {paths!r}", field="paths")
    try:
        rs = tuple(float(x) for x in rates.split(",") if x.strip())
    except ValueError:
        raise InvalidSpec(f"rates must be numbers, got {rates!r}", field="rates") from None
    if not rs or any(r <= 0 for r in rs):
        raise InvalidSpec(f"rates must be > 0, got {rates!r}", field="rates")
    res = run_throughput(ThroughputConfig(rates=rs, duration_s=duration, time_scale=time_scale,
                                          orchestrators=orchestrators, paths=ps), out)
    if json_out:
        import json

        typer.echo(json.dumps(res, indent=1))
    else:
        typer.echo(render(res))
