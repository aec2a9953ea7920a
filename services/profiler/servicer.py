"""ProfilerService servicer: parse, call the registry / job runner, convert back."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import grpc
from google.protobuf import timestamp_pb2
from google.rpc import code_pb2, status_pb2

from flowmaker import convert
from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc
from flowmaker.catalog import get_gpu_type, get_model, model_from_hf_config
from flowmaker.domain import GpuType, Model
from flowmaker.errors import FailedPrecondition, InvalidSpec, PermissionDenied
from flowmaker.limits import check_hf_config, check_model
from flowmaker.profiling.analytic import ConfigExcluded, explain_profile
from flowmaker.rpc.auth import current_principal
from services.profiler.jobs import ACTIVE_STATES, JobRunner, config_name, new_job
from services.profiler.registry import Registry, profile_from_json

log = logging.getLogger(__name__)

PC = profiler_pb2.ProfileConfig
PJ = profiler_pb2.ProfilingJob


def _accuracy(request: profiler_pb2.RegisterModelRequest) -> float | None:
    if not request.HasField("accuracy"):
        return None
    a = request.accuracy
    if not 0.0 <= a <= 1.0:
        raise InvalidSpec(f"must be within [0, 1], got {a}", field="accuracy")
    return a


def _ts(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


def job_to_proto(job: dict[str, Any]) -> profiler_pb2.ProfilingJob:
    out = PJ(id=job["id"], model_id=job["model_id"], gpu_type=job["gpu_type"],
             configs=[profiler_pb2.ParallelConfig(tp=tp, pp=pp) for tp, pp in job["configs"]],
             state=f"STATE_{job['state']}", configs_done=job["configs_done"],
             configs_total=job["configs_total"], create_time=_ts(job["create_time"]),
             update_time=_ts(job["update_time"]))
    f = job.get("failure")
    if f:
        out.failure.CopyFrom(status_pb2.Status(code=code_pb2.Code.Value(f.get("code", "UNKNOWN")),
                                               message=f"{f.get('reason', '')}: {f.get('message', '')}"))
    return out


class ProfilerServicer(profiler_pb2_grpc.ProfilerServiceServicer):
    def __init__(self, registry: Registry, runner: JobRunner | None, *, default_gpu_type: str,
                 default_max_gpus: int, engine_available: bool = True) -> None:
        self.registry = registry
        self.runner = runner
        self.default_gpu_type = default_gpu_type
        self.default_max_gpus = default_max_gpus
        self.engine_available = engine_available and runner is not None

    async def RegisterModel(self, request: profiler_pb2.RegisterModelRequest,
                            context: grpc.aio.ServicerContext) -> profiler_pb2.RegisterModelResponse:
        origin = request.WhichOneof("origin")
        accuracy = _accuracy(request)
        who = current_principal.get()
        if (accuracy is not None or origin == "hf_config_json") and not who.admin:
            # The selector trusts accuracy to meet users' SLOs: only the catalog's published figures may come
            # from any component of the suite; a claimed accuracy is the admin's to make (issue 22).
            raise PermissionDenied(f"{who.name[:64]!r} may register catalog models with their published accuracy "
                                   "only; an accuracy claim (accuracy, or hf_config_json) needs the admin identity",
                                   field="accuracy", reason="ACCURACY_NEEDS_ADMIN")
        model: Model
        if origin == "catalog_name":
            try:
                model = get_model(request.catalog_name)
            except Exception as e:  # NotFound names field "model"; the request calls it catalog_name
                if hasattr(e, "field"):
                    e.field = "catalog_name"
                raise
            model = dataclasses.replace(model, id=request.model_id or model.id)
            if accuracy is not None:
                model = dataclasses.replace(model, accuracy=accuracy)
        elif origin == "hf_config_json":
            if not request.model_id.strip():
                raise InvalidSpec("required with hf_config_json", field="model_id")
            if accuracy is None:
                raise InvalidSpec("required with hf_config_json (0..1 scale of Slo.min_accuracy)", field="accuracy")
            # Size and depth were checked at the edge (limits hf_config_bytes, hf_config_depth).
            try:
                cfg = json.loads(request.hf_config_json)
            except (json.JSONDecodeError, RecursionError) as e:
                raise InvalidSpec(f"not valid JSON: {e}", field="hf_config_json") from None
            if isinstance(cfg, dict):
                check_hf_config(cfg, "hf_config_json")
            try:
                model = model_from_hf_config(cfg, request.model_id, accuracy)
            except InvalidSpec as e:
                if e.field and not e.field.startswith(("model_id", "accuracy")):
                    e.field = f"hf_config_json.{e.field.removeprefix('config.')}"
                raise
            except (ArithmeticError, ValueError, TypeError) as e:  # numbers the analytic model cannot use
                raise InvalidSpec(f"config.json describes no usable architecture: {e}",
                                  field="hf_config_json") from None
        else:
            raise InvalidSpec("set catalog_name or hf_config_json", field="origin")
        source = request.source or model.source
        if accuracy is not None:  # say whose figure it is, wherever the model is listed
            source = f"accuracy {accuracy:g} claimed by {who.name or 'admin'} at registration" + (
                f"; {request.source}" if request.source else "")
        model = dataclasses.replace(model, hf_id=request.hf_id or model.hf_id, source=source)
        check_model(model, "model")  # nothing out of the limits table is ever stored
        await self.registry.register(model)
        log.info("registered model %s (accuracy %.4f, %.2fB params)", model.id, model.accuracy, model.params_b)
        return profiler_pb2.RegisterModelResponse(model=convert.model_to_proto(model))

    async def ListModels(self, request: profiler_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> profiler_pb2.ListModelsResponse:
        return profiler_pb2.ListModelsResponse(models=[convert.model_to_proto(m)
                                                       for m in await self.registry.list_models()])

    async def _gpu(self, name: str) -> tuple[GpuType, int]:
        cluster_type, cluster_gpus = await self.registry.cluster_gpu()
        try:
            gpu = get_gpu_type(name or cluster_type or self.default_gpu_type)
        except Exception as e:
            if hasattr(e, "field"):
                e.field = "gpu_type"
            raise
        return gpu, cluster_gpus or self.default_max_gpus

    def _requested(self, model: Model, gpu: GpuType, configs: Any) -> list[tuple[int, int]] | None:
        if not configs:
            return None
        out = []
        for i, c in enumerate(configs):
            if c.tp < 1 or c.pp < 1:
                raise InvalidSpec(f"tp and pp must be >= 1, got tp={c.tp} pp={c.pp}", field=f"configs[{i}]")
            b = explain_profile(model, gpu, c.tp, c.pp)
            if b.excluded:
                raise ConfigExcluded(f"tp={c.tp} pp={c.pp} cannot run {model.id} on {gpu.name}: {b.excluded}",
                                     field=f"configs[{i}]")
            out.append((c.tp, c.pp))
        return out

    async def GetProfiles(self, request: profiler_pb2.GetProfilesRequest,
                          context: grpc.aio.ServicerContext) -> profiler_pb2.GetProfilesResponse:
        model = await self.registry.get_model(request.model_id)
        gpu, max_gpus = await self._gpu(request.gpu_type)
        wanted = self._requested(model, gpu, request.configs)
        analytic = await self.registry.ensure_analytic(model, gpu, max([max_gpus, *(tp * pp for tp, pp in wanted or [])]))
        records = await self.registry.measured_records(model.id, gpu.name)
        measured = {c: profile_from_json(r) for c, r in records.items()}
        jobs = await self.registry.jobs(model.id, gpu.name)
        running = [j for j in jobs if j["state"] in ACTIVE_STATES]
        configs = wanted if wanted is not None else [c for c in analytic if c[0] * c[1] <= max_gpus]
        out = []
        for tp, pp in sorted(configs, key=lambda c: (c[0] * c[1], c[0])):
            name = config_name(tp, pp)
            a, m = analytic[(tp, pp)], measured.get((tp, pp))
            measuring = next((j for j in running if j["config_states"].get(name) in ("PENDING", "MEASURING")), None)
            job_id, progress = str(records.get((tp, pp), {}).get("job_id", "")), 1.0 if m else 0.0
            if measuring is not None:
                state = PC.State.STATE_MEASURING
                job_id, progress = measuring["id"], float(measuring["config_progress"].get(name, 0.0))
            elif m is not None:
                state = PC.State.STATE_MEASURED
            elif jobs and jobs[-1]["config_states"].get(name) == "FAILED":
                state = PC.State.STATE_MEASURE_FAILED
                job_id = jobs[-1]["id"]
            else:
                state = PC.State.STATE_ANALYTIC
            pc = PC(config=profiler_pb2.ParallelConfig(tp=tp, pp=pp), profile=convert.profile_to_proto(m or a),
                    state=state, analytic=convert.profile_to_proto(a), progress=progress, job_id=job_id)
            if m is not None:
                pc.measured.CopyFrom(convert.profile_to_proto(m))
            out.append(pc)
        return profiler_pb2.GetProfilesResponse(configs=out)

    async def ProfileModel(self, request: profiler_pb2.ProfileModelRequest,
                           context: grpc.aio.ServicerContext) -> profiler_pb2.ProfileModelResponse:
        if not self.engine_available or self.runner is None:
            raise FailedPrecondition("no deployer and no local engine backend configured: set "
                                     "FLOWMAKER_PROFILER_DEPLOYER_ADDRESS or FLOWMAKER_PROFILER_ENGINE_BACKEND",
                                     field="deployer_address", reason="NO_ENGINES")
        model = await self.registry.get_model(request.model_id)
        gpu, max_gpus = await self._gpu(request.gpu_type)
        for job in await self.registry.jobs(model.id, gpu.name):
            if job["state"] in ACTIVE_STATES:
                return profiler_pb2.ProfileModelResponse(job=job_to_proto(job))
        wanted = self._requested(model, gpu, request.configs)
        configs = wanted or sorted(await self.registry.ensure_analytic(model, gpu, max_gpus),
                                   key=lambda c: (c[0] * c[1], c[0]))
        job = new_job(model.id, gpu.name, configs, request.engine)
        await self.registry.put_job(job)
        self.runner.start(job, model, gpu)
        log.info("profiling job %s: %s on %s, configs %s", job["id"], model.id, gpu.name,
                 [config_name(*c) for c in configs])
        return profiler_pb2.ProfileModelResponse(job=job_to_proto(job))

    async def GetProfilingJob(self, request: profiler_pb2.GetProfilingJobRequest,
                              context: grpc.aio.ServicerContext) -> profiler_pb2.GetProfilingJobResponse:
        if not request.job_id:
            raise InvalidSpec("must not be empty", field="job_id")
        return profiler_pb2.GetProfilingJobResponse(job=job_to_proto(await self.registry.get_job(request.job_id)))


def add_servicers(server: grpc.aio.Server, servicer: ProfilerServicer) -> list[str]:
    profiler_pb2_grpc.add_ProfilerServiceServicer_to_server(servicer, server)
    return [profiler_pb2.DESCRIPTOR.services_by_name["ProfilerService"].full_name]
