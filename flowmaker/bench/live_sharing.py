"""`flowmaker bench live-sharing`: predicted vs measured stage latency on the live stack under GPU sharing.

What it does, end to end, on this machine:

1. starts the local stack (`flowmaker.launcher.LocalStack`, as `flowmaker demo` / `up` do): etcd, the five
   services and an emulated node of `gpus` x `gpu_type` whose engines run `time_scale` times faster than wall
   time and slow each other on shared GPUs (`flowmaker.engine.gpu_share`, processor sharing);
2. registers the catalog's models and deploys evaluation tasks (`flowmaker.eval.tasks`) at `load` x their
   nominal rate, every candidate approved, under the orchestrator's default selection contract (BUSY_TIME +
   INTERFERENCE: instances may share GPUs and every assignment's `latency_s` is slowed by its co-residents);
   the placement (instances' `gpu_ids`) says which GPUs are shared;
3. sends open-loop Poisson load to every task at its declared rate (model time: `rate x time_scale` requests
   per wall second) through the orchestrator's `Invoke` for `duration_s` wall seconds, recording each
   request's end-to-end latency and, per stage, the latency the orchestrator measured (`InvokeResponse.stages`);
   meanwhile every engine's `/metrics` is sampled each second (busy time, e2e histogram, GPU neighbours);
4. reports per task p95 vs the latency SLO, and per LLM stage (shared GPUs first) the predicted stage latency vs
   the measured mean, and the ratio. "Predicted" is the product's CURRENT prediction, read from the API after the
   load (`Task.predicted_stage_latency_s`: the orchestrator re-derives it on the placement whenever that changes,
   so a task deployed before its co-residents is predicted beside them); the selection's own figure (the
   assignment's `latency_s`, made when the task was deployed) is kept beside it ("selected"). With what explains
   a gap:
   the stage's latency alone (profile formula, nominal and actual tokens), the multipliers predicted and
   measured, the co-residents' busy shares predicted (`1 - exp(-n)`) and measured, the GPU slowdown the
   engine saw while busy, and the engine-side latency (without the orchestrator's hop);
5. stops everything it started (the launcher's stop path), on errors and Ctrl-C too.

Time: requests, latencies and rates are reported in MODEL seconds (what a real engine would take): the
orchestrator's wall latencies x `time_scale`. Measurement starts `warmup_s` wall seconds into the load;
requests arriving after that are measured (and waited for, up to `drain_s`). The load lasts 5 minutes by
default: at the utilisations sharing reaches, a window much shorter is a sample whose mean the simulator itself
moves by a fifth (`sample_factor`: this run's own arrivals replayed in the simulator, over its Poisson twin).

So that what is measured is the GPU sharing and not the harness:
- every request's input is sized (`input_words_for`) so that the selected workflow's LLM stages get prompts as
  close as possible to the nominal `input_tokens` the selector planned with (the demo pads every input to the
  trace's median context instead, which doubles some stages' prompts);
- the load is open-loop: each task's requests are spread over `callers_per_task` clients (distinct bearer
  tokens; without TLS the orchestrator accepts any and keys its 64-concurrent-calls-per-caller limit on them),
  and the orchestrator's HTTP pool to the engines is raised to `http_pool_size` (its default, 100, queues calls);
- the orchestrator does not re-select for load during the run (`follow_load` off), so the measured variants
  are the deployed ones (each task's `variant_changed` says whether one changed anyway).

Diagnostics (`instances`; approximations of `flowmaker.sharing`'s model, evaluated on the FINAL placement): n =
offered call-seconds per second (rate x latency alone at nominal tokens), predicted busy share 1 - exp(-n), rho =
busy-time compute share (rate x (prefill + decode at the profile's pure-decode throughput) per call), f = 1 +
kappa x the co-residents' busy shares on the most crowded GPU (predicted, or measured by the engines' busy-time
counters), multiplier f (1 - rho) / (1 - rho f); and what later selections saw of the instance while the tasks were
deployed (no traffic yet, so no measured busy share): rho0 = planned load / max_output_tokens_per_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flowmaker.cancel import wait_for
from flowmaker.launcher.client import RpcFailure, Stubs, call
from flowmaker.launcher.stack import LocalStack, StackConfig, StackError

ProgressFn = Callable[[str], None]
JSON_NAME = "live_sharing.json"


@dataclass(frozen=True)
class LiveSharingConfig:
    """What the bench runs. The defaults are the full-size run (~2.5-3 min wall on 2 cores)."""

    tasks: tuple[str, ...] = ()  # evaluation task names; empty = all of EVAL_TASKS
    load: float = 1.0  # fraction of each task's nominal rate it is deployed and driven at
    time_scale: float = 2.0  # emulated engines' model seconds per wall second
    # Wall seconds of load. A shared stage near saturation has a long memory: in the simulator, math's explain stage
    # of this bench's seed-0 plan has window means between -15% and +21% of the median (10th-90th percentile over
    # 60 arrival samples) over 75 s of load, and between -8% and +15% over 300 s (30 samples). A comparison with
    # a prediction within 25% needs the longer window to say something about the prediction.
    duration_s: float = 300.0
    warmup_s: float = 15.0  # wall seconds at the start of the load not measured
    drain_s: float = 20.0  # wall seconds to wait for measured requests still in flight after the load
    gpus: int = 8
    gpu_type: str = "A6000"
    seed: int = 0
    follow_load: bool = False  # let the orchestrator re-select during the run (off: the variant stays measured)
    # The orchestrator's options.gpu_price_gb (None: its default, one GPU's memory). Priced GPUs avoid sharing where
    # they can; 0 (memory only, the paper's objective) shares GPUs at these rates, which this bench measures.
    gpu_price_gb: float | None = None
    sample_s: float = 1.0  # wall seconds between two scrapes of every engine's /metrics
    # Open-loop clients: each task's requests are spread over this many callers (a distinct bearer token each,
    # which is what the orchestrator's per-caller concurrency limit keys on without TLS: 64 running at once
    # per caller), so that the front door's protection against one greedy client does not close the loop.
    callers_per_task: int = 8
    # The orchestrator's HTTP connection pool to the engines (its default, 100, queues engine calls beyond
    # 100 in flight, which would add to the measured stage latencies whatever the GPUs do).
    http_pool_size: int = 1000
    work_dir: Path | None = None  # keep the stack's work dir (logs) here; None = a temp dir, removed


# ---- small helpers -------------------------------------------------------------------------------------

def _q(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of xs, None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _now(run: TaskRun) -> Any:
    """The task as the API shows it last: after the load, else right after the deploys settled."""
    return run.task_end if run.task_end is not None else run.task


def _state(t: Any) -> str:
    from flowmaker.api.common.v1 import task_pb2

    return str(task_pb2.Task.State.Name(t.state)).removeprefix("STATE_")


def _parse_metrics(text: str) -> dict[str, float]:
    """The few samples of an emulated engine's /metrics the bench reads (summed over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {"vllm:e2e_request_latency_seconds_sum": "e2e_sum", "vllm:e2e_request_latency_seconds_count": "e2e_count",
            "flowmaker_engine_busy_seconds_total": "busy_s", "vllm:num_requests_running": "running",
            "vllm:num_requests_waiting": "waiting", "flowmaker_engine_gpu_speed": "speed",
            "flowmaker_engine_gpu_busy_neighbours": "neighbours", "vllm:request_success_total": "finished"}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = want.get(s.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


# ---- records -------------------------------------------------------------------------------------------

@dataclass
class StageObs:
    stage_id: str
    instance_id: str
    latency_s: float  # model seconds
    input_tokens: int
    output_tokens: int


@dataclass
class RequestObs:
    task: str
    scheduled_s: float  # wall offset from the load's start
    late_s: float  # how late the bench sent it (wall; a loaded CPU shows here)
    ok: bool = False
    latency_s: float = 0.0  # model seconds, the orchestrator's measurement
    client_latency_s: float = 0.0  # model seconds, as the bench saw it (gRPC hop included)
    stages: list[StageObs] = field(default_factory=list)
    error: str = ""


@dataclass
class TaskRun:
    name: str
    slo_accuracy: float
    slo_latency_s: float
    rate_rps: float  # model requests/s (declared)
    context_tokens: int
    input_words: int = 0  # words of every request's input (sized to the selected workflow's nominal shapes)
    task_id: str = ""
    state: str = ""
    failure: str = ""
    deploy_s: float = 0.0
    task: Any = None  # the orchestrator's Task after deployment
    task_end: Any = None  # ... after the load (variant switches show here)
    requests: list[RequestObs] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state in ("ACTIVE", "DEGRADED") and self.task is not None and bool(self.task.variant.workflow_id)


# ---- request inputs sized to the workflow's nominal token shapes ----------------------------------------

def _stage_inputs(workflow: Any, words: int) -> dict[str, int]:
    """Prompt words each LLM stage gets for an input of `words` words, as the orchestrator fills prompts
    (`flowmaker.orchestration.dag.fill_prompt`): an LLM stage outputs `output_tokens` words (the emulated
    engine answers exactly max_tokens words), an emulated TOOL stage passes its filled prompt through."""
    from flowmaker.orchestration.dag import fill_prompt

    text = " ".join(["w"] * words)
    outputs: dict[str, str] = {}
    inputs: dict[str, int] = {}
    for i in workflow.topo_order():
        st = workflow.stages[i]
        prompt = fill_prompt(st, text, outputs)
        if st.is_llm:
            inputs[st.id] = len(prompt.split())
            outputs[st.id] = " ".join(["o"] * max(1, st.output_tokens))
        else:
            outputs[st.id] = prompt
    return inputs


def input_words_for(workflow: Any, max_words: int = 7000) -> int:
    """The input length (words) whose prompts come closest to the workflow's nominal LLM stage inputs (least sum
    of absolute differences, the smaller length on ties): the load then has the token shapes the selector
    planned with. A stage's prompt length is affine in the input length, so the optimum is at a breakpoint."""
    base, unit = _stage_inputs(workflow, 0), _stage_inputs(workflow, 100)
    nominal = {st.id: st.input_tokens for st in workflow.stages if st.is_llm}
    lines = [(base[k], (unit[k] - base[k]) / 100, nominal[k]) for k in nominal]
    cands = {1} | {min(max_words, max(1, round((nom - c) / a))) for c, a, nom in lines if a > 0}
    return min(sorted(cands), key=lambda n: sum(abs(c + a * n - nom) for c, a, nom in lines))


def request_text(task_name: str, words: int) -> str:
    """The task's sample input (the demo's), cut or padded with the demo's filler words to `words` words."""
    from flowmaker.cli.demo import _FILLER, _SAMPLES

    head = _SAMPLES.get(task_name, "Hello.").split()[:words]
    return " ".join(head + [_FILLER[i % len(_FILLER)] for i in range(words - len(head))])


# ---- phases ----------------------------------------------------------------------------------------------

async def _deploy(stubs: Stubs, runs: list[TaskRun], progress: ProgressFn) -> None:
    from flowmaker.cli.demo import deploy_and_approve
    from flowmaker.eval.tasks import get_task

    for run in runs:
        et = get_task(run.name)
        t0 = time.monotonic()
        try:
            # No options: the orchestrator's defaults (BUSY_TIME capacity, INTERFERENCE GPU sharing).
            t = await deploy_and_approve(stubs, et.name, et.description, run.slo_accuracy, run.slo_latency_s,
                                         run.rate_rps)
            run.task_id = t.id
            run.task, run.state = t, _state(t)
            run.failure = t.failure.message
        except RpcFailure as f:
            run.state, run.failure = "FAILED", f.line().removeprefix("error: ")
        run.deploy_s = time.monotonic() - t0
        v = run.task.variant if run.task is not None else None
        if v is not None and v.workflow_id:
            progress(f"deployed {run.name}: {run.state} workflow {v.workflow_id}, {len(v.new_instances)} new / "
                     f"{len(v.reuse)} reused instance(s), predicted {v.latency_s:.2f}s ({run.deploy_s:.1f}s)")
        else:
            progress(f"deploy of {run.name} failed: {run.state} {run.failure} ({run.deploy_s:.1f}s)")


async def _instances(stubs: Stubs) -> list[Any]:
    from flowmaker.api.deployer.v1 import deployer_pb2 as dpb

    r = await call(stubs.deployer().ListInstances(dpb.ListInstancesRequest()), stubs.deployer_addr)
    return list(r.instances)


async def _profiles(stubs: Stubs, keys: set[tuple[str, int, int]], gpu_type: str) -> dict[tuple[str, int, int], Any]:
    from flowmaker.api.profiler.v1 import profiler_pb2 as ppb

    prof = stubs.profiler()
    out: dict[tuple[str, int, int], Any] = {}
    for model, tp, pp in sorted(keys):
        with contextlib.suppress(RpcFailure):
            r = await call(prof.GetProfiles(ppb.GetProfilesRequest(
                model_id=model, gpu_type=gpu_type, configs=[ppb.ParallelConfig(tp=tp, pp=pp)])), stubs.profiler_addr)
            for c in r.configs:
                if c.config.tp == tp and c.config.pp == pp:
                    out[(model, tp, pp)] = c.profile
    return out


class MetricsSampler:
    """Scrapes every engine's /metrics every `period_s` wall seconds; keeps (wall time, samples) per instance."""

    def __init__(self, endpoints: dict[str, str], period_s: float) -> None:
        self.endpoints = endpoints
        self.period_s = period_s
        self.series: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
        self.errors = 0

    async def scrape_all(self, http: Any) -> None:
        async def one(iid: str, url: str) -> None:
            try:
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                self.series[iid].append((time.monotonic(), _parse_metrics(text)))
            except Exception:  # a scrape that fails is a missing sample, not a failed bench
                self.errors += 1

        await asyncio.gather(*(one(i, u) for i, u in self.endpoints.items()))

    async def run(self, stop: asyncio.Event) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while not stop.is_set():
                await self.scrape_all(http)
                with contextlib.suppress(TimeoutError):
                    await wait_for(stop.wait(), self.period_s)
            await self.scrape_all(http)

    def window(self, iid: str, t0: float, t1: float, scale: float) -> dict[str, Any]:
        """Figures of one engine over wall [t0, t1]: busy share, mean engine e2e (model s), calls, and the GPU
        slowdown it ran at while busy (mean of 1 + busy neighbours over the scrapes that found it busy)."""
        pts = [(t, m) for t, m in self.series.get(iid, []) if t0 - self.period_s / 2 <= t <= t1 + self.period_s / 2]
        if len(pts) < 2:
            return {}
        (ta, a), (tb, b) = pts[0], pts[-1]
        dt = (tb - ta) * scale
        calls = b.get("e2e_count", 0.0) - a.get("e2e_count", 0.0)
        busy = [m for _, m in pts if m.get("running", 0.0) + m.get("waiting", 0.0) > 0]
        return {
            "window_model_s": _r(dt, 2),
            "busy_share": _r(min(1.0, max(0.0, (b.get("busy_s", 0.0) - a.get("busy_s", 0.0)) / dt)) if dt > 0 else None),
            "engine_calls": int(calls),
            "engine_e2e_mean_s": _r((b.get("e2e_sum", 0.0) - a.get("e2e_sum", 0.0)) / calls) if calls > 0 else None,
            "gpu_slowdown_while_busy": _r(_mean([1.0 + m.get("neighbours", 0.0) for m in busy])),
            "batch_while_busy": _r(_mean([m.get("running", 0.0) for m in busy]), 2),
            "queue_while_busy": _r(_mean([m.get("waiting", 0.0) for m in busy]), 2),
            # Calls in the engine (batch + queue) at the window's first and last scrape: growing = not keeping up.
            "in_engine_start": int(a.get("running", 0.0) + a.get("waiting", 0.0)),
            "in_engine_end": int(b.get("running", 0.0) + b.get("waiting", 0.0)),
            "backlog_grew": (b.get("running", 0.0) + b.get("waiting", 0.0)) - (a.get("running", 0.0) + a.get("waiting", 0.0))
            > max(20.0, 0.5 * (a.get("running", 0.0) + a.get("waiting", 0.0))),
            "samples": len(pts), "busy_samples": len(busy),
        }


async def _drive(stubs: Stubs, runs: list[TaskRun], cfg: LiveSharingConfig, progress: ProgressFn) -> float:
    """Open-loop Poisson arrivals per task for `duration_s` wall seconds; returns the load's start (monotonic)."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as opb

    orch = stubs.orchestrator()
    rng = random.Random(cfg.seed)
    scale = cfg.time_scale
    pending: set[asyncio.Task[None]] = set()
    start = time.monotonic()

    async def one(run: TaskRun, text: str, at: float, caller: str) -> None:
        sent = time.monotonic()
        obs = RequestObs(run.name, at, max(0.0, sent - start - at))
        run.requests.append(obs)
        try:
            r = await call(orch.Invoke(opb.InvokeRequest(task_id=run.task_id, input=text),
                                       metadata=(("authorization", f"Bearer {caller}"),)), stubs.orchestrator_addr)
            obs.client_latency_s = (time.monotonic() - sent) * scale
            obs.ok, obs.latency_s = True, r.latency_s * scale
            obs.stages = [StageObs(s.stage_id, s.instance_id, s.latency_s * scale, s.input_tokens, s.output_tokens)
                          for s in r.stages]
        except RpcFailure as f:
            obs.error = f.line().removeprefix("error: ")

    async def arrivals(run: TaskRun, seed: int) -> None:
        r = random.Random(seed)
        text = request_text(run.name, run.input_words)
        wall_rate = run.rate_rps * scale
        callers = [f"live-sharing-bench-{run.name}-{k}" for k in range(max(1, cfg.callers_per_task))]
        at = r.expovariate(wall_rate)
        k = 0
        while at < cfg.duration_s:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(run, text, at, callers[k % len(callers)]))
            k += 1
            pending.add(task)
            task.add_done_callback(pending.discard)
            at += r.expovariate(wall_rate)

    active = [run for run in runs if run.active and run.rate_rps > 0]
    total = sum(run.rate_rps for run in active)
    progress(f"load: {len(active)} task(s), {total:.2f} req/s model = {total * scale:.2f} req/s wall, "
             f"{cfg.duration_s:g}s wall ({cfg.warmup_s:g}s warm-up)")
    await asyncio.gather(*(arrivals(run, rng.randrange(2**31)) for run in active))
    inflight = list(pending)
    if inflight:
        progress(f"load done; waiting up to {cfg.drain_s:g}s for {len(inflight)} request(s) in flight")
        _, late = await asyncio.wait(inflight, timeout=cfg.drain_s)
        for t in late:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        for run in active:
            for obs in run.requests:
                if not obs.ok and not obs.error:
                    obs.error = "unfinished: still in flight after the drain"
    return start


# ---- the prediction model, evaluated on the final placement (diagnostics) ------------------------------

def _alone(profile: Any, calls: int, tin: float, tout: float) -> float:
    """Feasibility 2: a stage's latency alone on its profile (calls one after another)."""
    return calls * (profile.fixed_s + profile.prefill_s_per_token * tin + profile.decode_s_per_token * tout)


def _busy_time(profile: Any, tin: float, tout: float) -> float:
    """GPU busy time of one call at full batching efficiency (the BUSY_TIME capacity model's b_w(p))."""
    d = profile.decode_tokens_per_s or profile.max_output_tokens_per_s
    return profile.prefill_s_per_token * tin + tout / d


def _multiplier(f: float, rho: float) -> float | None:
    """flowmaker.sharing's latency multiplier at speed 1/f with compute share rho (None: cannot keep up)."""
    return None if rho * f >= 1 else f * (1 - rho) / (1 - rho * f)


# Model seconds of Poisson load the twin serves: 40x the default measured window, so that its own sampling error
# (the mean of a shared stage near saturation moves by +-12% between 1,200 s windows) is a few percent.
TWIN_MODEL_S = 6000.0


def twin_slowdowns(cfg: LiveSharingConfig, runs: list[TaskRun], insts: dict[str, Any],
                   profiles: dict[tuple[str, int, int], Any], *, replay: bool = False
                   ) -> dict[tuple[str, str, str], float]:
    """Per (instance, task, stage), the call slowdown (latency at load over latency alone) the simulator predicts
    for this very placement at the declared rates: the same engine model (continuous batching, prefill stalls, KV budget) and
    the same processor sharing of a GPU's busy instances (`dynamic`) as the emulated node runs, fed Poisson
    arrivals of each task's nominal request. What the selector's multiplier leaves out (an engine's own batching
    and queueing at its load) is in it; it is the plan's digital twin, not a fit to the measurement.

    `replay`: fed instead the very arrivals this run sent (each request at its scheduled time), measured from the
    end of the warm-up as the run is. Against the Poisson twin it says how far this run's arrival sample alone
    moves a stage's mean (a window of a minute or two at high load is far from the long-run mean); against the
    measurement, how far the live stack is from the simulator on the same requests."""
    from flowmaker.catalog import default_models, get_gpu_type
    from flowmaker.convert import profile_from_proto
    from flowmaker.domain import Gpu
    from flowmaker.eval.tasks import get_task
    from flowmaker.eval.traces import Arrival
    from flowmaker.orchestration.task import replicas_of
    from flowmaker.sim import SimInstance, TaskDeployment, simulate
    from flowmaker.sim.cluster import Route

    gt = get_gpu_type(cfg.gpu_type)
    gids = sorted({g for i in insts.values() for g in i.gpu_ids})
    gpus = [Gpu(g, g.rsplit("/", 1)[0] if "/" in g else "node", gt.memory_gb, 0.0, gt.name) for g in gids]
    sims = [SimInstance(i.id, profile_from_proto(profiles[(i.model_id, i.tp, i.pp)]), tuple(i.gpu_ids))
            for i in insts.values() if (i.model_id, i.tp, i.pp) in profiles]
    known = {x.id for x in sims}
    deps, arrivals = [], []
    rng = random.Random(f"flowmaker-twin/{cfg.seed}")
    horizon = cfg.duration_s * cfg.time_scale if replay else TWIN_MODEL_S
    for run in runs:
        if not run.active:
            continue
        et = get_task(run.name)
        wf_id = run.task.variant.workflow_id
        wf = et.candidate(wf_id)
        pairs = tuple((st.id, iid) for st in wf.stages for iid in replicas_of(dict(run.task.stage_instances), st.id)
                      if iid in known)
        deps.append(TaskDeployment(et, (Route(wf_id, pairs),)))
        ctx, gen = et.nominal_tokens()
        if replay:
            times = sorted(r.scheduled_s * cfg.time_scale for r in run.requests)
        else:
            times, t = [], 0.0
            while run.rate_rps > 0:
                t += rng.expovariate(run.rate_rps)
                if t >= horizon:
                    break
                times.append(t)
        arrivals += [Arrival(t, run.name, f"{run.name}-{k:06d}", ctx, gen) for k, t in enumerate(times)]
    if not deps:
        return {}
    arrivals.sort(key=lambda a: (a.time_s, a.task, a.req_id))
    res = simulate(sims, deps, arrivals, gpus, {m.id: m for m in default_models()}, gt, duration_s=horizon,
                   measure_from_s=cfg.warmup_s * cfg.time_scale if replay else 0.1 * horizon, colocation="dynamic")
    return {(m.id, task, stage): sd for m in res.per_instance for task, stage, sd in m.stage_slowdowns if sd > 0}


# ---- the whole bench --------------------------------------------------------------------------------------

async def _bench(stack: LocalStack, cfg: LiveSharingConfig, runs: list[TaskRun], progress: ProgressFn,
                 phases: dict[str, float]) -> dict[str, Any]:
    stubs = Stubs(orchestrator_addr=stack.addresses["orchestrator"], deployer_addr=stack.addresses["deployer"],
                  profiler_addr=stack.addresses["profiler"], timeout_s=300.0, tls=None)
    try:
        return await _bench_with(stubs, cfg, runs, progress, phases)
    finally:
        await stubs.close()


async def _bench_with(stubs: Stubs, cfg: LiveSharingConfig, runs: list[TaskRun], progress: ProgressFn,
                      phases: dict[str, float]) -> dict[str, Any]:
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as opb
    from flowmaker.cli.demo import _register_models
    from flowmaker.convert import workflow_from_proto

    t = time.monotonic()
    n = await _register_models(stubs)
    progress(f"registered {n} models")
    await _deploy(stubs, runs, progress)
    phases["deploy_s"] = time.monotonic() - t

    for run in runs:
        wf = next((w for w in run.task.candidates if w.id == run.task.variant.workflow_id), None) if run.active \
            else None
        run.input_words = input_words_for(workflow_from_proto(wf)) if wf is not None else run.context_tokens
    insts = {i.id: i for i in await _instances(stubs)}
    by_gpu: dict[str, list[str]] = defaultdict(list)
    for i in insts.values():
        for g in i.gpu_ids:
            by_gpu[g].append(i.id)
    shared_gpus = sorted(g for g, ids in by_gpu.items() if len(ids) > 1)
    progress(f"placement: {len(insts)} instance(s) on {len(by_gpu)} GPU(s); shared GPUs: "
             + (", ".join(f"{g} ({'+'.join(by_gpu[g])})" for g in shared_gpus) or "none"))

    sampler = MetricsSampler({i.id: i.endpoint for i in insts.values() if i.endpoint}, cfg.sample_s)
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    t = time.monotonic()
    try:
        start = await _drive(stubs, runs, cfg, progress)
    finally:
        stop.set()
        await sampling
    phases["load_s"] = time.monotonic() - t
    meas_t0, meas_t1 = start + cfg.warmup_s, start + cfg.duration_s
    t = time.monotonic()

    orch = stubs.orchestrator()
    for run in runs:
        if run.task_id:
            with contextlib.suppress(RpcFailure):
                run.task_end = (await call(orch.GetTask(opb.GetTaskRequest(task_id=run.task_id)),
                                           stubs.orchestrator_addr)).task
    insts_end = {i.id: i for i in await _instances(stubs)}
    keys = {(i.model_id, i.tp, i.pp) for i in insts.values()}
    profiles = await _profiles(stubs, keys, cfg.gpu_type)
    phases["collect_s"] = time.monotonic() - t
    return _report(cfg, runs, insts, insts_end, by_gpu, shared_gpus, profiles, sampler, meas_t0, meas_t1)


def _report(cfg: LiveSharingConfig, runs: list[TaskRun], insts: dict[str, Any], insts_end: dict[str, Any],
            by_gpu: dict[str, list[str]], shared_gpus: list[str], profiles: dict[tuple[str, int, int], Any],
            sampler: MetricsSampler, meas_t0: float, meas_t1: float) -> dict[str, Any]:
    from flowmaker.orchestration.task import replicas_of

    scale = cfg.time_scale
    kappa = 1.0  # a fresh stack has no stored kappa: the orchestrator plans with full processor sharing
    # -- per task: latency vs SLO ---------------------------------------------------------------------------
    tasks_out: list[dict[str, Any]] = []
    for run in runs:
        measured = [r for r in run.requests if r.scheduled_s >= cfg.warmup_s]
        lat = [r.latency_s for r in measured if r.ok]
        p95 = _q(lat, 0.95)
        v = run.task.variant if run.task is not None else None
        v_end = run.task_end.variant if run.task_end is not None else None
        errors: dict[str, int] = defaultdict(int)
        for r in measured:
            if r.error:
                errors[r.error[:120]] += 1
        tasks_out.append({
            "name": run.name, "task_id": run.task_id, "state": run.state, "failure": run.failure,
            "workflow_id": v.workflow_id if v is not None else "",
            "variant_changed": bool(v is not None and v_end is not None and v_end.workflow_id and (
                v_end.workflow_id != v.workflow_id or dict(run.task_end.stage_instances) != dict(run.task.stage_instances))),
            "slo_accuracy": run.slo_accuracy, "slo_latency_s": run.slo_latency_s, "rate_rps": _r(run.rate_rps),
            "input_words": run.input_words,
            # The product's current prediction (re-derived on the placement), and the selection's at deploy.
            "predicted_latency_s": _r(_now(run).predicted_latency_s) if v is not None and v.workflow_id else None,
            "selected_latency_s": _r(v.latency_s) if v is not None and v.workflow_id else None,
            "prediction_rederived": bool(v is not None and v.workflow_id and _now(run).HasField("predict_time")),
            "sent": len(run.requests), "measured": len(measured), "ok": len(lat), "failed": len(measured) - len(lat),
            "unfinished": sum(r.error.startswith("unfinished") for r in measured),
            "errors": dict(errors),
            "latency_p50_s": _r(_q(lat, 0.5)), "latency_p95_s": _r(p95), "latency_mean_s": _r(_mean(lat)),
            "latency_max_s": _r(max(lat) if lat else None),
            "client_latency_p95_s": _r(_q([r.client_latency_s for r in measured if r.ok], 0.95)),
            "p95_over_slo": _r(_div(p95, run.slo_latency_s)),
            "slo_met": None if p95 is None else p95 <= run.slo_latency_s,
            "send_late_p95_s": _r(_q([r.late_s for r in run.requests], 0.95)),
            "deploy_s": _r(run.deploy_s, 2),
        })

    # -- per LLM stage: what the variant predicts, what ran ---------------------------------------------------
    stages_out: list[dict[str, Any]] = []
    per_inst_n: dict[str, float] = defaultdict(float)  # offered call-seconds/s (selector's n), nominal tokens
    per_inst_rho: dict[str, float] = defaultdict(float)  # busy-time compute share at nominal tokens
    for run in runs:
        if not run.active:
            continue
        t = run.task
        v = t.variant
        wf = next((w for w in t.candidates if w.id == v.workflow_id), None)
        stage_by_id = {s.id: s for s in wf.stages} if wf is not None else {}
        for a in v.assignments:
            if not a.model_id:
                continue
            st = stage_by_id.get(a.stage_id)
            calls = max(1, st.calls_per_request) if st is not None else 1
            tin = st.input_tokens if st is not None else 0
            tout = st.output_tokens if st is not None else 0
            ids = replicas_of(dict(t.stage_instances), a.stage_id) or ([a.instance_id] if a.instance_id else [])
            prof = profiles.get((a.model_id, a.tp, a.pp))
            alone = _alone(prof, calls, tin, tout) if prof is not None else None
            for iid in ids:
                if alone is not None and prof is not None:
                    per_inst_n[iid] += run.rate_rps * alone / len(ids)
                    per_inst_rho[iid] += run.rate_rps * calls * _busy_time(prof, tin, tout) / len(ids)
                obs = [s for r in run.requests if r.scheduled_s >= cfg.warmup_s and r.ok
                       for s in r.stages if s.stage_id == a.stage_id and s.instance_id == iid]
                lat = [s.latency_s for s in obs]
                # Per call: the orchestrator reports a stage's tokens summed over its calls_per_request calls.
                ain = _mean([s.input_tokens / calls for s in obs])
                aout = _mean([s.output_tokens / calls for s in obs])
                alone_actual = (_alone(prof, calls, ain, aout) if prof is not None and ain is not None
                                and aout is not None else None)
                inst = insts.get(iid)
                gpus = list(inst.gpu_ids) if inst is not None else list(a.gpu_ids)
                co = sorted({j for g in gpus for j in by_gpu.get(g, []) if j != iid})
                mean = _mean(lat)
                pred = dict(_now(run).predicted_stage_latency_s).get(a.stage_id, a.latency_s)
                stages_out.append({
                    "task": run.name, "stage_id": a.stage_id, "instance_id": iid, "model_id": a.model_id,
                    "tp": a.tp, "pp": a.pp, "reused": a.reused, "gpu_ids": gpus,
                    "shared": any(g in shared_gpus for g in gpus), "co_residents": co,
                    "calls_per_request": calls, "nominal_tokens": [tin, tout],
                    "actual_tokens": [_r(ain, 1), _r(aout, 1)],
                    "predicted_latency_s": _r(pred), "selected_latency_s": _r(a.latency_s),
                    "measured_mean_s": _r(mean),
                    "measured_p50_s": _r(_q(lat, 0.5)), "measured_p95_s": _r(_q(lat, 0.95)), "n": len(lat),
                    "ratio_measured_over_predicted": _r(_div(mean, pred)),
                    "ratio_measured_over_selected": _r(_div(mean, a.latency_s)),
                    "alone_nominal_s": _r(alone), "alone_actual_tokens_s": _r(alone_actual),
                    "predicted_multiplier": _r(_div(pred, alone)),
                    "selected_multiplier": _r(_div(a.latency_s, alone)),
                    "measured_multiplier": _r(_div(mean, alone_actual)),
                })

    # -- per instance: busy shares and slowdowns, predicted (final placement) vs measured ---------------------
    orch_calls: dict[str, list[float]] = defaultdict(list)  # per engine call, as the orchestrator timed it
    for run in runs:
        calls_of = {}
        if run.active:
            wf = next((w for w in run.task.candidates if w.id == run.task.variant.workflow_id), None)
            calls_of = {st.id: max(1, st.calls_per_request) for st in (wf.stages if wf is not None else ())}
        for r in run.requests:
            if r.ok and r.scheduled_s >= cfg.warmup_s:
                for so in r.stages:
                    if so.instance_id:
                        c = calls_of.get(so.stage_id, 1)
                        orch_calls[so.instance_id] += [so.latency_s / c] * c
    win = {iid: sampler.window(iid, meas_t0, meas_t1, scale) for iid in insts}
    pred_b = {iid: -math.expm1(-per_inst_n[iid]) for iid in insts}
    meas_b = {iid: win[iid].get("busy_share") for iid in insts}
    inst_out: list[dict[str, Any]] = []
    for iid, i in sorted(insts.items()):
        co_pred = max((sum(pred_b[j] for j in by_gpu[g] if j != iid) for g in i.gpu_ids), default=0.0)
        co_meas = max((sum((meas_b[j] or 0.0) for j in by_gpu[g] if j != iid) for g in i.gpu_ids), default=0.0)
        rho = per_inst_rho.get(iid, 0.0)
        f_pred, f_meas_b = 1 + kappa * co_pred, 1 + kappa * co_meas
        end = insts_end.get(iid)
        prof = profiles.get((i.model_id, i.tp, i.pp))
        # What a later selection saw of this instance while the tasks were being deployed (no traffic yet, so no
        # measured busy share): compute share rho0 = planned load / max_output_tokens_per_s, busy share = rho0.
        rho0 = _div(i.load_output_tokens_per_s, prof.max_output_tokens_per_s if prof is not None else None)
        w = win[iid]
        orch_mean = _mean(orch_calls.get(iid, []))
        inst_out.append({
            "instance_id": iid, "model_id": i.model_id, "tp": i.tp, "pp": i.pp, "gpu_ids": list(i.gpu_ids),
            "task_ids": list(i.task_ids), "shared": any(g in shared_gpus for g in i.gpu_ids),
            "profile": None if prof is None else {
                "fixed_s": _r(prof.fixed_s, 5), "prefill_s_per_token": _r(prof.prefill_s_per_token, 8),
                "decode_s_per_token": _r(prof.decode_s_per_token, 6),
                "max_output_tokens_per_s": _r(prof.max_output_tokens_per_s, 1),
                "decode_tokens_per_s": _r(prof.decode_tokens_per_s, 1)},
            "planned_load_tok_s": _r(i.load_output_tokens_per_s, 2),
            # What the deployer's meters said at the end (ListInstances does not carry its busy share).
            "deployer_observed": None if end is None else {
                "load_tok_s": _r(end.observed_load_output_tokens_per_s, 2), "queue": _r(end.observed_queue, 2),
                "latency_s": _r(end.observed_latency_s), "slowdown": _r(end.observed_slowdown),
                "saturated": end.saturated},
            "compute_share_seen_at_deploy": _r(rho0), "busy_share_seen_at_deploy": _r(min(1.0, rho0) if rho0 else None),
            "orchestrator_call_mean_s": _r(orch_mean), "orchestrator_calls": len(orch_calls.get(iid, [])),
            "overhead_per_call_s": _r(orch_mean - w["engine_e2e_mean_s"]) if orch_mean is not None
            and w.get("engine_e2e_mean_s") is not None else None,
            "offered_call_s_per_s": _r(per_inst_n[iid]), "compute_share_busy_time": _r(rho),
            "busy_share_predicted": _r(pred_b[iid]), "busy_share_measured": meas_b[iid],
            "co_busy_predicted": _r(co_pred), "co_busy_measured": _r(co_meas),
            # The sharing model on the FINAL placement: with the predicted busy shares of every co-resident
            # (what a selection made now would use), and with the measured ones.
            "f_predicted_final": _r(f_pred), "multiplier_predicted_final": _r(_multiplier(f_pred, rho)),
            "f_with_measured_busy": _r(f_meas_b), "multiplier_with_measured_busy": _r(_multiplier(f_meas_b, rho)),
            **win[iid],
        })
    by_id = {x["instance_id"]: x for x in inst_out}
    for s in stages_out:
        x = by_id.get(s["instance_id"], {})
        s["multiplier_predicted_final"] = x.get("multiplier_predicted_final")
        s["gpu_slowdown_while_busy"] = x.get("gpu_slowdown_while_busy")
        s["engine_e2e_mean_s"] = x.get("engine_e2e_mean_s")  # the instance's, over every stage it serves
        s["overhead_per_call_s"] = x.get("overhead_per_call_s")
        s["backlog_grew"] = x.get("backlog_grew")
    try:
        twin = twin_slowdowns(cfg, runs, insts, profiles)
        replayed = twin_slowdowns(cfg, runs, insts, profiles, replay=True)
    except Exception as e:  # a diagnostic: never lose the measurement for it
        twin, replayed = {}, {}
        twin_error = f"{type(e).__name__}: {e}"
    else:
        twin_error = ""
    for s in stages_out:
        key = (s["instance_id"], s["task"], s["stage_id"])
        alone = s["alone_nominal_s"]
        pred = alone * twin[key] if key in twin and alone is not None else None
        rep = alone * replayed[key] if key in replayed and alone is not None else None
        s["twin_slowdown"] = _r(twin.get(key))
        s["twin_predicted_s"] = _r(pred)
        s["ratio_measured_over_twin"] = _r(_div(s["measured_mean_s"], pred))
        # This run's own arrivals through the simulator: how far the sample moves the mean (replay / twin), and
        # how far the live stack is from the simulator on the same requests (measured / replay).
        s["replay_twin_s"] = _r(rep)
        s["sample_factor"] = _r(_div(rep, pred))
        s["ratio_measured_over_replay"] = _r(_div(s["measured_mean_s"], rep))
        s["ratio_replay_over_predicted"] = _r(_div(rep, s["predicted_latency_s"]))
    stages_out.sort(key=lambda s: (not s["shared"], s["task"], s["stage_id"]))

    shared_stages = [s for s in stages_out if s["shared"] and s["ratio_measured_over_predicted"] is not None]
    ratios = [s["ratio_measured_over_predicted"] for s in shared_stages]
    alone_stages = [s for s in stages_out if not s["shared"] and s["ratio_measured_over_predicted"] is not None]
    finals = [_r(_div(s["measured_multiplier"], s.get("multiplier_predicted_final"))) for s in shared_stages]
    selected = [s["ratio_measured_over_selected"] for s in shared_stages if s["ratio_measured_over_selected"] is not None]
    return {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                   "tasks": [r.name for r in runs], "contract": "orchestrator defaults (BUSY_TIME + INTERFERENCE)",
                   "kappa": kappa},
        "placement": {"instances": len(insts), "gpus_used": len(by_gpu), "shared_gpus": shared_gpus,
                      "sharing": bool(shared_gpus), "by_gpu": {g: by_gpu[g] for g in sorted(by_gpu)}},
        "tasks": tasks_out,
        "stages": stages_out,
        "instances": inst_out,
        "summary": {
            "tasks_active": sum(r.active for r in runs),
            "tasks_meeting_slo_p95": sum(bool(x["slo_met"]) for x in tasks_out),
            "shared_stages": len(shared_stages),
            "shared_ratio_mean": _r(_mean(ratios)), "shared_ratio_min": _r(min(ratios) if ratios else None),
            "shared_ratio_max": _r(max(ratios) if ratios else None),
            "shared_within_25pct": sum(abs(x - 1) <= 0.25 for x in ratios),
            "unshared_ratio_mean": _r(_mean([s["ratio_measured_over_predicted"] for s in alone_stages])),
            # The selections' own predictions, made when each task was deployed (before its later co-residents).
            "shared_selected_ratios": selected,
            "shared_selected_within_25pct": sum(abs(x - 1) <= 0.25 for x in selected),
            # The selector's own sharing model re-evaluated on the FINAL placement (every co-resident deployed):
            # measured multiplier / predicted multiplier per shared stage.
            "shared_final_ratios": finals,
            "shared_final_within_25pct": len([x for x in finals if x is not None and abs(x - 1) <= 0.25]),
            # The plan's digital twin (`twin_slowdowns`): the same placement and rates through the simulator.
            "shared_twin_ratios": [s["ratio_measured_over_twin"] for s in shared_stages],
            "shared_twin_within_25pct": sum(abs(s["ratio_measured_over_twin"] - 1) <= 0.25 for s in shared_stages
                                            if s["ratio_measured_over_twin"] is not None),
            "unshared_twin_ratios": [s["ratio_measured_over_twin"] for s in alone_stages],
            # The run's own arrivals replayed through the simulator: the sample's effect on each shared stage's
            # mean (replay / Poisson twin), the live stack against the simulator on the same requests, and the
            # prediction against the replay (the model's error on this very sample).
            "shared_sample_factors": [s["sample_factor"] for s in shared_stages],
            "shared_measured_over_replay": [s["ratio_measured_over_replay"] for s in shared_stages],
            "shared_replay_over_predicted": [s["ratio_replay_over_predicted"] for s in shared_stages],
            "twin_error": twin_error,
            "load_avg_1m": _r(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "cpus": os.cpu_count(), "scrape_errors": sampler.errors,
        },
    }


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_live_sharing(cfg: LiveSharingConfig, out: Path, *, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run the bench; write the JSON to `out` (a folder: `<out>/live_sharing.json`, or a `.json` file path) and
    return it. Everything started is stopped before this returns, whatever happened (KeyboardInterrupt, raised on
    Ctrl-C and SIGTERM, propagates after the stop)."""
    from flowmaker.eval.tasks import EVAL_TASKS, get_task

    say = progress or (lambda m: None)
    names = cfg.tasks or tuple(t.name for t in EVAL_TASKS)
    runs = []
    for name in names:
        et = get_task(name)
        runs.append(TaskRun(et.name, et.min_accuracy, et.max_latency_s, et.nominal_rate_rps * cfg.load,
                            et.nominal_tokens()[0]))
    extra = {"FLOWMAKER_ORCHESTRATOR_HTTP_POOL_SIZE": str(cfg.http_pool_size)}
    if not cfg.follow_load:
        extra["FLOWMAKER_ORCHESTRATOR_FOLLOW_LOAD"] = "false"
    if cfg.gpu_price_gb is not None:
        extra["FLOWMAKER_ORCHESTRATOR_DEFAULT_GPU_PRICE_GB"] = repr(float(cfg.gpu_price_gb))
    stack = LocalStack(StackConfig(gpus=cfg.gpus, gpu_type=cfg.gpu_type, time_scale=cfg.time_scale,
                                   log_level="WARNING", work_dir=cfg.work_dir, keep_work_dir=cfg.work_dir is not None,
                                   extra_env=extra),
                       progress=lambda step, detail: say(f"{step}: {detail}") if "ready" in detail else None)
    phases: dict[str, float] = {}
    result: dict[str, Any] = {}
    main = threading.current_thread() is threading.main_thread()  # signal handlers only from the main thread
    old_term = signal.signal(signal.SIGTERM, _interrupt) if main else None
    t0 = time.monotonic()
    try:
        stack.start()
        phases["start_s"] = time.monotonic() - t0
        say(f"stack up in {phases['start_s']:.1f}s (emulated {cfg.gpus} x {cfg.gpu_type}, time scale "
            f"{cfg.time_scale:g})")
        result = asyncio.run(_bench(stack, cfg, runs, say, phases))
    except (StackError, RpcFailure) as e:
        line = e.line() if isinstance(e, RpcFailure) else f"error: UNAVAILABLE {e.reason}: {e}"
        say(line)
        result = {"error": line.removeprefix("error: ")}
    finally:
        if main:  # a second Ctrl-C must not interrupt the stop
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        t = time.monotonic()
        say("stopping the stack")
        stack.stop()
        phases["stop_s"] = time.monotonic() - t
        if main:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, old_term)
    phases["total_s"] = time.monotonic() - t0
    result["wall_s"] = {k: round(v, 1) for k, v in phases.items()}
    path = out if out.suffix == ".json" else out / JSON_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    result["json_path"] = str(path)
    return result


# ---- rendering --------------------------------------------------------------------------------------------

def render(res: dict[str, Any], console: Console) -> None:
    if "error" in res and "tasks" not in res:
        console.print(f"error: {res['error']}", markup=False, highlight=False)
        return
    cfg = res["config"]
    pl = res["placement"]
    console.print(f"[bold]live GPU sharing[/bold]: {len(cfg['tasks'])} task(s) at {cfg['load']:g} x nominal rate, "
                  f"{cfg['duration_s']:g}s wall of load (first {cfg['warmup_s']:g}s not measured), time scale "
                  f"{cfg['time_scale']:g}; latencies in model seconds; kappa {cfg['kappa']:g}")
    console.print(f"placement: {pl['instances']} instance(s) on {pl['gpus_used']} GPU(s); shared: "
                  + (", ".join(f"{g} ({' + '.join(pl['by_gpu'][g])})" for g in pl["shared_gpus"]) or "[red]none[/red]"))
    tt = Table(title="Tasks: p95 latency vs SLO")
    for c in ("task", "state", "workflow", "rate req/s", "ok / measured", "predicted", "p50", "p95", "SLO",
              "p95 / SLO", ""):
        tt.add_column(c, justify="left" if c in ("task", "state", "workflow", "") else "right")
    for t in res["tasks"]:
        met = "-" if t["slo_met"] is None else ("[green]met[/green]" if t["slo_met"] else "[red]missed[/red]")
        tt.add_row(t["name"], t["state"] + (" [yellow](switched)[/yellow]" if t["variant_changed"] else ""),
                   t["workflow_id"] or (t["failure"] or "-")[:60], _fmt(t["rate_rps"], ".3f"),
                   f"{t['ok']} / {t['measured']}", _fmt(t["predicted_latency_s"], ".2f", "s"),
                   _fmt(t["latency_p50_s"], ".2f", "s"), _fmt(t["latency_p95_s"], ".2f", "s"),
                   f"{t['slo_latency_s']:g}s", _fmt(t["p95_over_slo"], ".2f"), met)
    console.print(tt)
    st = Table(title="LLM stages: predicted (the orchestrator's current prediction, re-derived on the placement) vs "
                     "measured mean stage latency; selected = the selection's at deploy")
    for c in ("task/stage", "instance", "GPUs", "shared with", "n", "predicted", "measured", "ratio",
              "selected", "ratio sel", "twin", "ratio twin", "alone nom/act", "mult pred/final/meas",
              "GPU slowdown busy"):
        st.add_column(c, justify="left" if c in ("task/stage", "instance", "GPUs", "shared with") else "right")
    for s in res["stages"]:
        ratio = s["ratio_measured_over_predicted"]
        rs = _fmt(ratio, ".2f")
        if ratio is not None and abs(ratio - 1) > 0.25:
            rs = f"[red]{rs}[/red]"
        if s.get("backlog_grew"):
            rs += " [yellow](backlog)[/yellow]"
        st.add_row(f"{s['task']}/{s['stage_id']}", f"{s['instance_id']} {s['model_id']} {s['tp']}x{s['pp']}",
                   ",".join(s["gpu_ids"]), ",".join(s["co_residents"]) if s["shared"] else "[dim]alone[/dim]",
                   str(s["n"]), _fmt(s["predicted_latency_s"], ".2f", "s"), _fmt(s["measured_mean_s"], ".2f", "s"),
                   rs, _fmt(s.get("selected_latency_s"), ".2f", "s"), _fmt(s.get("ratio_measured_over_selected"), ".2f"),
                   _fmt(s.get("twin_predicted_s"), ".2f", "s"), _fmt(s.get("ratio_measured_over_twin"), ".2f"),
                   f"{_fmt(s['alone_nominal_s'])} / {_fmt(s['alone_actual_tokens_s'])}",
                   f"{_fmt(s['predicted_multiplier'])} / {_fmt(s['multiplier_predicted_final'])} / "
                   f"{_fmt(s['measured_multiplier'])}",
                   _fmt(s["gpu_slowdown_while_busy"]))
    console.print(st)
    it = Table(title="Instances: busy shares (predicted 1-exp(-n) vs measured) and slowdown")
    for c in ("instance", "GPUs", "tasks", "n", "rho", "rho0 at deploy", "busy pred", "busy meas",
              "co-busy pred/meas", "f final pred / meas-b", "GPU slowdown busy", "batch", "queue",
              "call: orch / engine"):
        it.add_column(c, justify="left" if c in ("instance", "GPUs", "tasks") else "right")
    for i in res["instances"]:
        it.add_row(f"{i['instance_id']} {i['model_id']} {i['tp']}x{i['pp']}", ",".join(i["gpu_ids"]),
                   str(len(i["task_ids"])), _fmt(i["offered_call_s_per_s"]), _fmt(i["compute_share_busy_time"]),
                   _fmt(i["compute_share_seen_at_deploy"]), _fmt(i["busy_share_predicted"]),
                   _fmt(i["busy_share_measured"]),
                   f"{_fmt(i['co_busy_predicted'])} / {_fmt(i['co_busy_measured'])}",
                   f"{_fmt(i['f_predicted_final'])} / {_fmt(i['f_with_measured_busy'])}",
                   _fmt(i.get("gpu_slowdown_while_busy")), _fmt(i.get("batch_while_busy"), ".1f"),
                   _fmt(i.get("queue_while_busy"), ".1f"),
                   f"{_fmt(i['orchestrator_call_mean_s'])} / {_fmt(i.get('engine_e2e_mean_s'))}")
    console.print(it)
    sm = res["summary"]
    console.print(f"shared stages: {sm['shared_stages']}, measured/predicted mean {_fmt(sm['shared_ratio_mean'])} "
                  f"(min {_fmt(sm['shared_ratio_min'])}, max {_fmt(sm['shared_ratio_max'])}), within 25%: "
                  f"{sm['shared_within_25pct']}; the selections' own (at deploy): within 25% "
                  f"{sm.get('shared_selected_within_25pct')} / {sm['shared_stages']} (ratios "
                  f"{sm.get('shared_selected_ratios')}); the selector's model on the final placement: within 25% "
                  f"{sm.get('shared_final_within_25pct')} / {sm['shared_stages']} (ratios {sm.get('shared_final_ratios')}); "
                  f"unshared stages' mean ratio {_fmt(sm['unshared_ratio_mean'])}; "
                  f"against the plan's simulated twin: shared stages within 25% "
                  f"{sm.get('shared_twin_within_25pct')} / {sm['shared_stages']} (ratios {sm.get('shared_twin_ratios')}), "
                  f"unshared {sm.get('unshared_twin_ratios')}{'; twin error ' + sm['twin_error'] if sm.get('twin_error') else ''}; "
                  f"this run's arrivals replayed in the simulator, shared stages: replay / twin (the sample) "
                  f"{sm.get('shared_sample_factors')}, measured / replay {sm.get('shared_measured_over_replay')}; "
                  f"tasks meeting the SLO at p95: {sm['tasks_meeting_slo_p95']} / {sm['tasks_active']}; "
                  f"load average {sm['load_avg_1m']} on {sm['cpus']} CPU(s); wall {res.get('wall_s', {})}",
                  highlight=False)


def summary_json(res: dict[str, Any]) -> dict[str, Any]:
    """The figures the brief asks for, compact: per task p95 vs SLO, per shared stage predicted vs measured."""
    if "tasks" not in res:
        return {k: res[k] for k in ("error", "wall_s", "json_path") if k in res}
    return {
        "tasks": [{k: t[k] for k in ("name", "state", "workflow_id", "rate_rps", "ok", "measured",
                                     "predicted_latency_s", "selected_latency_s", "latency_p95_s",
                                     "slo_latency_s", "p95_over_slo",
                                     "slo_met")} for t in res["tasks"]],
        "shared_stages": [{k: s[k] for k in ("task", "stage_id", "instance_id", "model_id", "gpu_ids",
                                             "co_residents", "n", "predicted_latency_s", "measured_mean_s",
                                             "ratio_measured_over_predicted", "selected_latency_s",
                                             "ratio_measured_over_selected", "twin_predicted_s",
                                             "ratio_measured_over_twin")}
                          for s in res["stages"] if s["shared"]],
        "placement": {k: res["placement"][k] for k in ("instances", "shared_gpus", "sharing")},
        "summary": res["summary"], "wall_s": res.get("wall_s"), "json_path": res.get("json_path"),
    }
