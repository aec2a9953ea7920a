"""The profiler's state in etcd: registered models, analytic and measured profiles, profiling jobs.

Profiles live under `keys.profile(gpu_type, model_id, tp, pp, source)` (source ANALYTIC or
MEASURED), so the selector can read them straight from etcd; a MEASURED record carries the
sweep's provenance beside the Profile fields (readers ignore unknown fields).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

from flowmaker.domain import GpuType, Model, ModelArch, Profile, ProfileSource
from flowmaker.errors import AlreadyExists, InvalidSpec, NotFound
from flowmaker.limits import check_model
from flowmaker.profiling.analytic import config_set, explain_profile
from flowmaker.state import Put, StateStore, keys
from flowmaker.state.records import NodeRecord

log = logging.getLogger(__name__)

# Key builders the shared key module does not have yet (to move into flowmaker.state.keys).
MODELS = keys.ROOT + "models/"
PROFILING_JOBS = keys.ROOT + "profiling-jobs/"
_TXN_OPS = 100  # etcd's default --max-txn-ops is 128


def model_key(model_id: str) -> str:
    return MODELS + quote(model_id, safe="")


def job_key(job_id: str) -> str:
    return PROFILING_JOBS + quote(job_id, safe="")


# ---- records -----------------------------------------------------------------------------------


def model_to_json(m: Model) -> dict[str, Any]:
    return dataclasses.asdict(m)


def model_from_json(d: dict[str, Any]) -> Model:
    arch = d.get("arch")
    names = {f.name for f in dataclasses.fields(Model)}
    fields = {k: v for k, v in d.items() if k in names and k != "arch"}
    arch_names = {f.name for f in dataclasses.fields(ModelArch)}
    return Model(**fields, arch=None if not arch else ModelArch(**{k: v for k, v in arch.items() if k in arch_names}))


def profile_to_json(p: Profile, **meta: Any) -> dict[str, Any]:
    d = dataclasses.asdict(p)
    d["source"] = p.source.value
    return {**d, **meta}


def profile_from_json(d: dict[str, Any]) -> Profile:
    names = {f.name for f in dataclasses.fields(Profile)}
    fields = {k: v for k, v in d.items() if k in names}
    fields["source"] = ProfileSource(fields.get("source", "ANALYTIC"))
    return Profile(**fields)


class Registry:
    """Models, profiles and jobs over a StateStore."""

    def __init__(self, store: StateStore, analytic_gpu_types: Sequence[GpuType], max_gpus: int = 8) -> None:
        self.store = store
        self.analytic_gpu_types = tuple(analytic_gpu_types)
        self.max_gpus = max_gpus

    # ---- models ----

    async def register(self, model: Model, *, exist_ok: bool = False) -> Model:
        """Store the model and its analytic profiles. An id already taken is AlreadyExists, unless
        `exist_ok` and the stored model is the same (catalog preload at every start)."""
        model.validate()
        check_model(model)
        for gpu in self.analytic_gpu_types:  # a model the analytic model cannot profile fails before it is stored
            try:
                explain_profile(model, gpu, 1, 1)
            except (ArithmeticError, ValueError) as e:
                raise InvalidSpec(f"cannot be profiled: {e}", field="model") from None
        try:
            await self.store.create(model_key(model.id), model_to_json(model))
        except AlreadyExists:
            existing = await self.get_model(model.id)
            if not (exist_ok and existing == model):
                raise AlreadyExists(f"model id {model.id!r} is already registered", field="model_id") from None
        for gpu in self.analytic_gpu_types:
            await self.ensure_analytic(model, gpu)
        return model

    async def get_model(self, model_id: str) -> Model:
        kv = await self.store.get(model_key(model_id))
        if kv is None:
            raise NotFound(f"model {model_id!r} is not registered (RegisterModel first)", field="model_id")
        return model_from_json(kv.value)

    async def list_models(self) -> list[Model]:
        """Every registered model. A record that no longer passes the limits (stored by an older
        version, or by hand) is skipped with a warning: one bad record must not fail every caller."""
        listing = await self.store.get_prefix(MODELS)
        out = []
        for kv in listing.items:
            try:
                m = model_from_json(kv.value)
                check_model(m)
            except Exception as e:
                log.warning("skipping unusable model record %s: %s", kv.key[:200], str(e)[:200])
                continue
            out.append(m)
        return sorted(out, key=lambda m: m.id)

    # ---- profiles ----

    async def ensure_analytic(self, model: Model, gpu: GpuType, max_gpus: int | None = None) -> dict[
            tuple[int, int], Profile]:
        """The analytic profiles of every config that runs, computed and stored on first use."""
        prefix = keys.profiles_of_gpu_type(gpu.name) + quote(model.id, safe="") + "/"
        stored = {}
        for kv in (await self.store.get_prefix(prefix)).items:
            _, _, tp, pp, source = keys.parse_profile(kv.key)
            if source == ProfileSource.ANALYTIC.value:
                stored[(tp, pp)] = profile_from_json(kv.value)
        puts = []
        for tp, pp in config_set(max_gpus or self.max_gpus):
            if (tp, pp) in stored:
                continue
            b = explain_profile(model, gpu, tp, pp)
            if b.excluded:
                continue
            p = b.profile()
            stored[(tp, pp)] = p
            puts.append(Put(keys.profile(gpu.name, model.id, tp, pp, ProfileSource.ANALYTIC.value),
                            profile_to_json(p)))
        for i in range(0, len(puts), _TXN_OPS):
            await self.store.txn([], puts[i:i + _TXN_OPS])
        return stored

    async def measured(self, model_id: str, gpu_type: str) -> dict[tuple[int, int], Profile]:
        return {c: profile_from_json(r) for c, r in (await self.measured_records(model_id, gpu_type)).items()}

    async def measured_records(self, model_id: str, gpu_type: str) -> dict[tuple[int, int], dict[str, Any]]:
        """The stored MEASURED records (Profile fields plus the sweep's provenance: job_id, memory_source...)."""
        prefix = keys.profiles_of_gpu_type(gpu_type) + quote(model_id, safe="") + "/"
        out = {}
        for kv in (await self.store.get_prefix(prefix)).items:
            _, _, tp, pp, source = keys.parse_profile(kv.key)
            if source == ProfileSource.MEASURED.value:
                out[(tp, pp)] = dict(kv.value)
        return out

    async def put_measured(self, p: Profile, **meta: Any) -> None:
        await self.store.put(keys.profile(p.gpu_type, p.model_id, p.tp, p.pp, ProfileSource.MEASURED.value),
                             profile_to_json(p, measured_at=time.time(), **meta))

    # ---- the cluster's GPU type ----

    async def cluster_gpu(self) -> tuple[str | None, int | None]:
        """(GPU type, GPUs per node) of the registered deployer nodes, or (None, None) when there are none."""
        nodes = [NodeRecord.from_json(kv.value) for kv in (await self.store.get_prefix(keys.NODES)).items
                 if isinstance(kv.value, dict)]
        if not nodes:
            return None, None
        types = sorted({n.gpu_type for n in nodes})
        return types[0], max(n.gpu_count for n in nodes)

    # ---- jobs ----

    async def put_job(self, job: dict[str, Any]) -> None:
        job["update_time"] = time.time()
        await self.store.put(job_key(job["id"]), job)

    async def get_job(self, job_id: str) -> dict[str, Any]:
        kv = await self.store.get(job_key(job_id))
        if kv is None:
            raise NotFound(f"no profiling job {job_id!r}", field="job_id")
        return dict(kv.value)

    async def jobs(self, model_id: str | None = None, gpu_type: str | None = None) -> list[dict[str, Any]]:
        out = [dict(kv.value) for kv in (await self.store.get_prefix(PROFILING_JOBS)).items]
        return sorted((j for j in out if (model_id is None or j["model_id"] == model_id)
                       and (gpu_type is None or j["gpu_type"] == gpu_type)), key=lambda j: j["create_time"])

    async def fail_orphaned_jobs(self, states: Iterable[str] = ("QUEUED", "RUNNING")) -> int:
        """Jobs a previous profiler process left running can never finish: mark them FAILED."""
        n = 0
        for job in await self.jobs():
            if job["state"] in states:
                job["state"] = "FAILED"
                job["failure"] = {"code": "ABORTED", "reason": "PROFILER_RESTARTED",
                                  "message": "the profiler restarted while the job ran; start it again"}
                for c, st in job["config_states"].items():
                    if st in ("PENDING", "MEASURING"):
                        job["config_states"][c] = "FAILED"
                await self.put_job(job)
                n += 1
        return n
