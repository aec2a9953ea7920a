"""Building the selector's requests: the models offered, the approval's options with the orchestrator's defaults,
co-residents' tolerances and planned busy shares; and the busy-time loads a commit records.

An approval's selection, a healing re-selection and the load follower's all ask the selector through here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import cast

from flowmaker import convert
from flowmaker.api.common.v1 import selection_pb2
from flowmaker.api.selector.v1 import selector_pb2
from flowmaker.catalog import default_models
from flowmaker.domain import Cluster, Instance, Model, Variant, default_gpu_price
from flowmaker.errors import FlowMakerError, InvalidSpec, NotFound
from flowmaker.orchestration.cluster import (
    cluster_gpu_type,
    planned_busy_shares,
    protected,
    read_task_uses,
    read_tolerating_tasks,
    read_used_profiles,
    tolerances_of,
    with_planned_busy,
    with_tolerances,
)
from flowmaker.orchestration.commit import busy_load_scale
from flowmaker.orchestration.predict import profile_keys, slo_breaks
from flowmaker.orchestration.task import TaskRecord, TaskState
from flowmaker.rpc.errors import call
from flowmaker.sharing import DEFAULT_INTERFERENCE
from flowmaker.state.interference import InterferenceStore
from flowmaker.state.records import ClusterView
from flowmaker.state.store import StateStore
from services.orchestrator.clients import Clients
from services.orchestrator.settings import OrchestratorSettings

log = logging.getLogger(__name__)


class Selections:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, clients: Clients,
                 contexts: dict[str, int]) -> None:
        self.settings = settings
        self.store = store
        self.clients = clients
        # Model id -> context length, shared with the router (which clamps max_tokens to it): the registered
        # models' are added once a selection has listed them (`models`).
        self.contexts = contexts

    async def models(self) -> tuple[Model, ...]:
        """The models a selection may use: the catalog's, and those registered with the profiler (which win
        by id). Best effort: an unreachable profiler leaves the catalog (empty = the selector's default)."""
        try:
            registered = await self.clients.registered_models(min(5.0, self.settings.select_timeout_s))
        except FlowMakerError as e:
            log.warning("registered models unavailable (%s); selecting among the catalog's", e)
            return ()
        if not registered:
            return ()
        by_id = {m.id: m for m in default_models()}
        by_id.update({m.id: m for m in registered})
        self.contexts.update({m.id: m.arch.max_ctx for m in registered if m.arch is not None and m.arch.max_ctx > 0})
        return tuple(by_id.values())

    async def select_at(self, t: TaskRecord, rate_rps: float, cluster: Cluster, *, max_replicas: int = 1,
                        protect: Iterable[str] = ()) -> Variant | None:
        """The selector's variant for `t`'s approved workflows at `rate_rps` on `cluster` (None: infeasible),
        with at least `max_replicas` replicas per new instance allowed; `protect` as in `request`."""
        req = await self.request(t, cluster, rate_rps=rate_rps, max_replicas=max_replicas, protect=protect)
        result = convert.selection_result_from_proto(await call(self.clients.selector.SelectVariant(
            req, timeout=self.settings.select_timeout_s)))
        return result.variant

    async def request(self, t: TaskRecord, cluster: Cluster, *, rate_rps: float | None = None,
                      max_replicas: int = 0, protect: Iterable[str] = ()
                      ) -> selector_pb2.SelectVariantRequest:
        """The SelectVariant request for `t`'s approved workflows on `cluster`, at `rate_rps` (None: the SLO's
        declared rate), with at least `max_replicas` replicas per new instance allowed (0: the options' own).
        An approval's selection, a healing re-selection and the load follower's all build it here: the
        approval's options with the orchestrator's defaults for what they leave unset (`options`),
        and under INTERFERENCE each running instance's `max_slowdown`, the least SLO / latency alone of the
        other tasks using it, so that no selection slows co-residents past their SLOs, and its `busy_share` =
        max(the measured one when fresh, the planned one: occupancy of the call-seconds/s the other tasks' variants
        offer it at their planned rates), so that an instance deployed before its traffic arrives is not taken for
        idle (both from flowmaker.orchestration.cluster.read_task_uses). `protect` (instance ids: the
        second choice of an approval or a move whose first one `breaks` a co-resident) marks those instances
        `cluster.protected`: no slowdown tolerated, no room, no compute left on their GPUs."""
        models = await self.models()
        options = await self.options(t, cluster)
        if max_replicas:
            options.max_replicas = max(options.max_replicas, max_replicas)
        gpu_type = cluster_gpu_type(cluster, "")
        if options.gpu_sharing == selection_pb2.GPU_SHARING_INTERFERENCE and cluster.instances and gpu_type:
            uses = await read_task_uses(self.store, gpu_type, models or default_models(), exclude=t.id)
            cluster = with_planned_busy(with_tolerances(cluster, tolerances_of(uses)), planned_busy_shares(uses))
            ids = set(protect)
            if ids:
                keys_ = {i.id: i.key for i in cluster.instances if i.id in ids}
                try:
                    profs = await read_used_profiles(self.store, gpu_type, models or default_models(), keys_.values())
                except (NotFound, InvalidSpec) as e:  # protected by their tolerance alone
                    log.warning("task %s: no profiles to protect instances %s: %s", t.id, sorted(ids), e)
                    profs = {}
                cluster = protected(cluster, ids, {iid: profs[k].max_output_tokens_per_s for iid, k in keys_.items()
                                                   if k in profs})
        slo = t.slo if rate_rps is None else replace(t.slo, arrival_rate_rps=rate_rps)
        return selector_pb2.SelectVariantRequest(
            slo=convert.slo_to_proto(slo),
            workflows=[convert.workflow_to_proto(w) for w in t.candidates if w.id in t.approved_workflow_ids],
            cluster=convert.cluster_to_proto(cluster), strategy=t.strategy,
            models=[convert.model_to_proto(m) for m in models], options=options)

    async def breaks(self, moved: TaskRecord, view: ClusterView, new: Sequence[Instance] = (),
                     released: Iterable[str] = ()) -> tuple[dict[str, tuple[float, float]], set[str]]:
        """The tasks a selection would push past their latency SLO by the live prediction (`predict.slo_breaks`:
        `moved`, the task with the selected variant, its stage map and planned rate, in its place or joining;
        `new` placed, `released` gone), and the instances those tasks use; nothing when no prediction can be made
        (no GPU type, no profiles). The selector admitted the variant under its sharing bound; this is the model the
        orchestrator keeps tasks' predictions with and the load follower acts on, so a plan it rejects would make the
        co-residents re-select in their turn."""
        gpu_type = cluster_gpu_type(view.cluster, "")
        if not gpu_type:
            return {}, set()
        tasks = await read_tolerating_tasks(self.store)
        instances = [rec.to_domain() for rec in view.instances.values()]
        used = profile_keys((*tasks, moved), (*instances, *new))
        try:
            profiles = await read_used_profiles(self.store, gpu_type, await self.models() or default_models(), used)
        except (NotFound, InvalidSpec) as e:
            log.warning("task %s: no profiles on GPU type %r to check its co-residents: %s", moved.id, gpu_type, e)
            return {}, set()
        only = self.predicted(tasks)
        try:
            kappa = await self.kappa(gpu_type)
            # Off the event loop, as `Predictions.refresh`'s: two predictions on the placement (0.4 s for 200 tasks).
            broken = await asyncio.to_thread(slo_breaks, tasks, instances, profiles, kappa, moved, new, released,
                                             only=only)
        except (ArithmeticError, ValueError) as e:  # a prediction that cannot be made must not block serving
            log.warning("task %s: the live prediction of its co-residents failed (%s); not checked", moved.id, e)
            return {}, set()
        theirs = {i for t in tasks if t.id in broken for m in (t.stage_instances, t.next_stage_instances)
                  for i in m.values()}
        return broken, theirs

    async def load_scale(self, t: TaskRecord, v: Variant, cluster: Cluster,
                         capacity_model: selection_pb2.CapacityModel | None, models: Sequence[Model]
                         ) -> dict[tuple[str, int, int], float] | None:
        """What turns `v`'s loads into the planned loads a commit records (`plan_commit`'s `load_scale`): under
        BUSY_TIME their busy-time equivalent at `v`'s workflow's mean request on the profiles the selector saw
        (`busy_load_scale`), which is how later selections read running loads; None otherwise (output
        tokens/s as selected), or when the profiles cannot be read (logged)."""
        if capacity_model != selection_pb2.CAPACITY_MODEL_BUSY_TIME:
            return None
        wf = next((w for w in t.candidates if w.id == v.workflow_id), None)
        if wf is None or not any(s.is_llm for s in wf.stages):
            return None
        used = {(a.model_id, a.tp, a.pp) for a in v.assignments if a.model_id}
        used |= {(n.model_id, n.tp, n.pp) for n in v.new_instances}
        gpu_type = cluster_gpu_type(cluster, "")
        if not used or not gpu_type:
            return None
        try:
            profiles = await read_used_profiles(self.store, gpu_type, models or default_models(), used)
        except (NotFound, InvalidSpec) as e:
            log.warning("task %s: no profiles on GPU type %r to record busy-time loads: %s", t.id, gpu_type, e)
            return None
        return busy_load_scale(wf, profiles.values())

    async def options(self, t: TaskRecord, cluster: Cluster) -> selection_pb2.SelectionOptions:
        """The approval's options (`t.options_json`) with what they leave unset taken from the settings:
        `utilization_cap` (DEFAULT_UTILIZATION_CAP, 0.85: headroom for the tail), `capacity_model`
        (DEFAULT_CAPACITY_MODEL, BUSY_TIME), `gpu_sharing` (DEFAULT_GPU_SHARING, INTERFERENCE), under
        INTERFERENCE `interference` (DEFAULT_INTERFERENCE, or when that is negative the kappa the profiler stored
        for the cluster's GPU type; 1 when none is) and `gpu_price_gb` (DEFAULT_GPU_PRICE_GB, or when that is
        negative one GPU's memory: `default_gpu_price`). Explicit options always win (an explicit gpu_price_gb 0:
        memory only, the paper's objective)."""
        s = self.settings
        o = convert.selection_options_from_json(t.options_json) if t.options_json else selection_pb2.SelectionOptions()
        if not o.utilization_cap:
            o.utilization_cap = s.default_utilization_cap
        if o.capacity_model == selection_pb2.CAPACITY_MODEL_UNSPECIFIED:
            o.capacity_model = cast(selection_pb2.CapacityModel, selection_pb2.CapacityModel.Value(
                f"CAPACITY_MODEL_{s.default_capacity_model}"))
        if o.gpu_sharing == selection_pb2.GPU_SHARING_UNSPECIFIED:
            o.gpu_sharing = cast(selection_pb2.GpuSharing, selection_pb2.GpuSharing.Value(
                f"GPU_SHARING_{s.default_gpu_sharing}"))
        if o.gpu_sharing == selection_pb2.GPU_SHARING_INTERFERENCE and not o.HasField("interference"):
            o.interference = await self.kappa(cluster_gpu_type(cluster, ""))
        if not o.HasField("gpu_price_gb"):
            o.gpu_price_gb = default_gpu_price(s.default_gpu_price_gb, cluster)
        return o

    async def kappa(self, gpu_type: str) -> float:
        """The interference kappa a selection uses unless its options set one: DEFAULT_INTERFERENCE, or when that
        is negative the kappa the profiler stored for `gpu_type` (1 when none is, or the type is unknown)."""
        if self.settings.default_interference >= 0:
            return self.settings.default_interference
        return await InterferenceStore(self.store).kappa(gpu_type) if gpu_type else DEFAULT_INTERFERENCE

    def predicted(self, tasks: Iterable[TaskRecord]) -> frozenset[str]:
        """The tasks whose latency the orchestrator predicts on the placement: ACTIVE ones selected under GPU
        sharing (those under IGNORE keep the selection's figures)."""
        return frozenset(t.id for t in tasks if t.state is TaskState.ACTIVE and self.shares_gpus(t))

    def shares_gpus(self, t: TaskRecord) -> bool:
        """Whether `t` was selected under the GPU-sharing model (its options' gpu_sharing, else the default)."""
        o = convert.selection_options_from_json(t.options_json) if t.options_json else selection_pb2.SelectionOptions()
        if o.gpu_sharing == selection_pb2.GPU_SHARING_UNSPECIFIED:
            return self.settings.default_gpu_sharing == "INTERFERENCE"
        return o.gpu_sharing == selection_pb2.GPU_SHARING_INTERFERENCE
