"""Measured-profiling jobs: one asyncio task per job runs `flowmaker.profiling.measure` and records progress in etcd.

A job record (under `registry.job_key`) holds the state, `config_states` ("1x1" -> PENDING,
MEASURING, MEASURED or FAILED) and `config_progress` ("1x1" -> 0..1), so GetProfiles and
GetProfilingJob show how far a sweep is. Jobs run one at a time (they need the GPUs).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from flowmaker.domain import GpuType, Model, Profile
from flowmaker.errors import FlowMakerError
from flowmaker.profiling.measure import EngineHandle, EngineLauncher, MeasuredConfig, Progress, SweepPlan, measure_model
from flowmaker.rpc.errors import code_of
from services.profiler.registry import Registry

log = logging.getLogger(__name__)

ACTIVE_STATES = ("QUEUED", "RUNNING")


def config_name(tp: int, pp: int) -> str:
    return f"{tp}x{pp}"


def new_job(model_id: str, gpu_type: str, configs: list[tuple[int, int]], engine: str) -> dict[str, Any]:
    now = time.time()
    return {"id": f"prof-{uuid.uuid4().hex[:12]}", "model_id": model_id, "gpu_type": gpu_type, "engine": engine,
            "configs": [list(c) for c in configs], "state": "QUEUED", "configs_done": 0,
            "configs_total": len(configs), "failure": None, "create_time": now, "update_time": now,
            "config_states": {config_name(*c): "PENDING" for c in configs},
            "config_progress": {config_name(*c): 0.0 for c in configs}}


@dataclass
class _DeployedEngine:
    """An instance started by the deployer for a sweep; `close` releases it (the deployer stops it and
    frees the memory it reserved)."""

    stub: Any
    instance_id: str
    task_id: str
    base_url: str
    model_name: str
    time_scale: float
    emulated: bool = False
    gpu_indices: tuple[int, ...] = ()
    reported_memory_gb_per_gpu: float | None = None
    api_key: str = ""  # the engine's per-instance key, from the Deploy response

    async def close(self) -> None:
        from flowmaker.api.deployer.v1 import deployer_pb2
        from flowmaker.rpc.errors import call

        await call(self.stub.Release(deployer_pb2.ReleaseRequest(instance_id=self.instance_id, task_id=self.task_id)))


# Engine names the deployer runs as emulated engines (on its FLOWMAKER_DEPLOYER_ENGINE_TIME_SCALE clock).
EMULATED_ENGINES = ("emulated", "sim")


@dataclass
class DeployerLauncher:
    """Starts each config through the deployer service (Deploy, placed by the deployer, its memory reserved on
    the cluster's GPUs like any instance), releases it after. `time_scale` must be the deployer's
    FLOWMAKER_DEPLOYER_ENGINE_TIME_SCALE (the profiler's FLOWMAKER_PROFILER_ENGINE_TIME_SCALE); the sweep
    checks it against the emulated engine's own clock."""

    channel: Any  # grpc.aio.Channel to the deployer
    task_id: str
    engine: str = ""
    time_scale: float = 1.0
    start_timeout_s: float = 900.0

    async def launch(self, model: Model, gpu: GpuType, tp: int, pp: int, analytic: Profile) -> EngineHandle:
        from flowmaker.api.deployer.v1 import deployer_pb2, deployer_pb2_grpc
        from flowmaker.rpc.errors import call

        stub = deployer_pb2_grpc.DeployerServiceStub(self.channel)
        resp = await call(stub.Deploy(deployer_pb2.DeployRequest(
            model_id=model.id, tp=tp, pp=pp, memory_gb_per_gpu=analytic.memory_gb_per_gpu, task_id=self.task_id,
            engine=self.engine, request_id=f"{self.task_id}-{tp}x{pp}"), timeout=self.start_timeout_s))
        inst = resp.instance
        # The deployer says which engine it started (the request may leave it to the deployer's default):
        # emulated engines run at the deployer's time scale and were started with the footprint reserved
        # for them; GPU engines run at wall speed on the deployer's host, whose GPUs this process cannot
        # query (memory then falls back to the analytic estimate).
        emulated = (inst.engine or self.engine) in EMULATED_ENGINES
        log.info("profiling %s tp=%d pp=%d on instance %s (%s engine on %s, GPUs %s)", model.id, tp, pp, inst.id,
                 inst.engine, inst.node, list(inst.gpu_ids))
        key = resp.engine_api_key
        return _DeployedEngine(stub, inst.id, self.task_id, inst.endpoint,
                               await _served_name(inst.endpoint, model.id, key),
                               self.time_scale if emulated else 1.0, emulated,
                               reported_memory_gb_per_gpu=analytic.memory_gb_per_gpu if emulated else None,
                               api_key=key)


async def _served_name(base_url: str, default: str, api_key: str = "") -> str:
    """The model name the engine serves (`GET /v1/models`): the catalog id for vLLM and emulated engines,
    the Hugging Face id for trtllm-serve; `default` when it cannot say."""
    import aiohttp

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with aiohttp.ClientSession() as http, http.get(base_url.rstrip("/") + "/v1/models", headers=headers,
                                                             timeout=aiohttp.ClientTimeout(total=30)) as r:
            data = await r.json(content_type=None)
        return str(data["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return default


@dataclass
class JobRunner:
    """Starts jobs and keeps their records current. `launcher_for(job)` picks the engine launcher."""

    registry: Registry
    launcher_for: Any  # Callable[[dict], EngineLauncher]
    plan: SweepPlan = field(default_factory=SweepPlan)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def start(self, job: dict[str, Any], model: Model, gpu: GpuType) -> None:
        self._tasks[job["id"]] = asyncio.create_task(self._run(job, model, gpu), name=f"profiling-{job['id']}")

    async def wait(self, job_id: str) -> None:
        t = self._tasks.get(job_id)
        if t is not None:
            await asyncio.shield(t)

    async def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, job: dict[str, Any], model: Model, gpu: GpuType) -> None:
        async with self._lock:  # one sweep at a time: they compete for the same GPUs
            job["state"] = "RUNNING"
            await self.registry.put_job(job)
            last_written: dict[str, float] = {}

            async def progress(p: Progress) -> None:
                name = config_name(p.tp, p.pp)
                job["config_progress"][name] = round(p.fraction, 3)
                if p.phase != "done":
                    job["config_states"][name] = "MEASURING"
                # Write on phase changes and every 10%: enough to watch, few etcd writes.
                if p.phase in ("starting", "stopping") or p.fraction - last_written.get(name, -1.0) >= 0.1:
                    last_written[name] = p.fraction
                    await self.registry.put_job(job)

            async def config_done(r: MeasuredConfig) -> None:
                await self.registry.put_measured(r.profile, job_id=job["id"], memory_source=r.memory_source,
                                                 sweep_wall_s=round(r.wall_s, 3), overhead_s=r.overhead_s,
                                                 latency_samples=len(r.latency_samples),
                                                 throughput_samples=len(r.throughput_samples))
                name = config_name(r.profile.tp, r.profile.pp)
                job["config_states"][name] = "MEASURED"
                job["config_progress"][name] = 1.0
                job["configs_done"] += 1
                await self.registry.put_job(job)

            try:
                launcher: EngineLauncher = self.launcher_for(job)
                configs = [(int(tp), int(pp)) for tp, pp in job["configs"]]
                await measure_model(model, gpu, configs, launcher, self.plan, on_progress=progress,
                                    on_config_done=config_done)
                job["state"] = "SUCCEEDED"
            except asyncio.CancelledError:
                job["state"] = "FAILED"
                job["failure"] = {"code": "CANCELLED", "reason": "PROFILER_STOPPED", "message": "profiler stopped"}
                self._fail_pending(job)
                await self.registry.put_job(job)
                raise
            except Exception as e:
                log.warning("profiling job %s failed: %s", job["id"], e, exc_info=not isinstance(e, FlowMakerError))
                job["state"] = "FAILED"
                if isinstance(e, FlowMakerError):
                    job["failure"] = {"code": code_of(e).name, "reason": e.reason, "message": str(e)}
                else:
                    job["failure"] = {"code": "INTERNAL", "reason": "INTERNAL", "message": f"{type(e).__name__}: {e}"}
                self._fail_pending(job)
            await self.registry.put_job(job)
            log.info("profiling job %s %s (%d/%d configs)", job["id"], job["state"], job["configs_done"],
                     job["configs_total"])

    @staticmethod
    def _fail_pending(job: dict[str, Any]) -> None:
        for name, st in job["config_states"].items():
            if st in ("PENDING", "MEASURING"):
                job["config_states"][name] = "FAILED"
