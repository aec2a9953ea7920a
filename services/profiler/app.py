"""Wiring of the profiler service: store -> registry -> job runner -> servicer, shared by `__main__` and tests."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc.aio

from flowmaker.catalog import default_models, get_gpu_type, gpu_types
from flowmaker.errors import InvalidSpec
from flowmaker.profiling.measure import BackendLauncher, EngineLauncher, SweepPlan
from flowmaker.rpc.channels import insecure_channel
from flowmaker.state import StateStore
from services.profiler.jobs import DeployerLauncher, JobRunner
from services.profiler.registry import Registry
from services.profiler.servicer import ProfilerServicer
from services.profiler.settings import ProfilerSettings

log = logging.getLogger(__name__)


@dataclass
class ProfilerApp:
    """Everything one profiler process holds; `start()` after etcd answers, `close()` at shutdown."""

    settings: ProfilerSettings
    store: StateStore
    registry: Registry
    runner: JobRunner
    servicer: ProfilerServicer
    deployer_channel: grpc.aio.Channel | None = None

    async def start(self, running: object = None) -> None:
        """The server's on_ready hook (`running` is the bound server, unused)."""
        n = await self.registry.fail_orphaned_jobs()
        if n:
            log.warning("marked %d profiling job(s) of a previous profiler process FAILED", n)
        if self.settings.preload_catalog:
            for m in default_models():
                await self.registry.register(m, exist_ok=True)

    async def close(self) -> None:
        await self.runner.close()
        if self.deployer_channel is not None:
            await self.deployer_channel.close(None)


def _ints(text: str, field: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidSpec(f"must be comma-separated integers, got {text!r}", field=field) from None


def build(settings: ProfilerSettings, store: StateStore) -> ProfilerApp:
    names = [n.strip() for n in settings.analytic_gpu_types.split(",") if n.strip()]
    gpus = [get_gpu_type(n) for n in names] if names else list(gpu_types().values())
    registry = Registry(store, gpus, settings.gpus_per_node)
    channel = None
    if settings.deployer_address:
        channel = insecure_channel(settings.deployer_address, default_timeout_s=settings.call_timeout_s,
                                   tls_server_name=settings.deployer_tls_server_name)

    def launcher_for(job: dict[str, Any]) -> EngineLauncher:
        if channel is not None:
            return DeployerLauncher(channel, task_id=f"profiling-{job['id']}", engine=job.get("engine", ""),
                                    time_scale=settings.engine_time_scale)
        return BackendLauncher(job.get("engine") or settings.engine_backend, time_scale=settings.engine_time_scale)

    concurrency = tuple(c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if c <= settings.max_concurrency)
    plan = SweepPlan(input_tokens=_ints(settings.sweep_input_tokens, "sweep_input_tokens"),
                     output_tokens=_ints(settings.sweep_output_tokens, "sweep_output_tokens"),
                     repeats=settings.sweep_repeats, throughput_output_tokens=settings.throughput_output_tokens,
                     concurrency=concurrency or (1,)).validate()
    runner = JobRunner(registry, launcher_for, plan)
    servicer = ProfilerServicer(registry, runner, default_gpu_type=settings.gpu_type,
                                default_max_gpus=settings.gpus_per_node,
                                engine_available=bool(channel is not None or settings.engine_backend))
    return ProfilerApp(settings, store, registry, runner, servicer, channel)
