"""Keeping serving tasks' predicted latencies current, run by the reconciler on the elected leader: the I/O around
`flowmaker.orchestration.predict`.

Level-triggered like the rest of the reconciler: each pass compares the placement it observes (committed variants,
instances' GPUs and planned loads: `placement_key`) with the one it last predicted on; when it moved (a deploy
committed, a task deleted, a re-selection switched, an instance gone), every ACTIVE task selected under the GPU
sharing model gets its prediction re-derived and, when it changed, written to its record (compare-and-set). Tasks
selected under IGNORE (the paper-literal contract) keep the selection's figures.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from flowmaker.catalog import default_models
from flowmaker.errors import InvalidSpec, NotFound
from flowmaker.orchestration.cluster import cluster_gpu_type, read_live_cluster, read_used_profiles
from flowmaker.orchestration.predict import Prediction, placement_key, predict_on_placement, profile_keys
from flowmaker.orchestration.reconcile import Observed
from flowmaker.orchestration.task import TaskRecord, TaskState
from flowmaker.state.records import LIVE_STATES
from flowmaker.state.store import StateStore
from services.orchestrator.records import TaskStore
from services.orchestrator.selecting import Selections

log = logging.getLogger(__name__)


class Predictions:
    def __init__(self, store: StateStore, selections: Selections) -> None:
        self.store = store
        self.tasks = TaskStore(store)
        self.selections = selections
        self._last: tuple[object, ...] | None = None  # the placement (and kappa) last predicted on
        self._gpu_type = ""  # the cluster's, as last seen

    def forget(self) -> None:
        """Predict again on the next pass (a new leader, or after a failed pass)."""
        self._last = None

    async def refresh(self, obs: Observed) -> dict[str, TaskRecord]:
        """Re-derive on `obs` if its placement (or the GPU type's kappa) moved; the task records rewritten, by id."""
        placed = placement_key(obs.tasks.values(), (r.to_domain() for r in obs.instances.values()
                                                    if r.state in LIVE_STATES))
        kappa = await self.selections.kappa(self._gpu_type) if self._gpu_type else None
        key = (placed, kappa)
        if key == self._last:
            return {}
        view = await read_live_cluster(self.store)  # the alive nodes' instances with their planned loads
        instances = [rec.to_domain() for rec in view.instances.values()]
        tasks = list(obs.tasks.values())
        used = profile_keys(tasks, instances)
        gpu_type = cluster_gpu_type(view.cluster, "")
        if gpu_type != self._gpu_type:
            self._gpu_type = gpu_type
            kappa = await self.selections.kappa(gpu_type) if gpu_type else None
            key = (placed, kappa)
        if not used or kappa is None:
            self._last = key
            return {}
        try:
            profiles = await read_used_profiles(self.store, gpu_type, await self.selections.models()
                                                or default_models(), used)
        except (NotFound, InvalidSpec) as e:
            log.warning("no profiles on GPU type %r to re-derive predictions: %s", gpu_type, e)
            self._last = key
            return {}
        only = self.selections.predicted(tasks)
        # Off the event loop: the solution is pure Python and grows faster than the placement (measured: 21 ms for 50
        # tasks on 32 GPUs, 0.2 s for 200 on 64: scripts/prediction_scale.py), and this loop also serves the front door
        # and renews the leases.
        preds = await asyncio.to_thread(predict_on_placement, tasks, instances, profiles, kappa, only=only)
        out: dict[str, TaskRecord] = {}
        for tid, p in sorted(preds.items()):
            if not p.differs(obs.tasks[tid]):
                continue
            try:
                new = await self.tasks.update(tid, functools.partial(_apply, p=p, seen=obs.tasks[tid]))
            except NotFound:
                continue
            if new is not None:
                out[tid] = new
                log.info("task %s: predicted latency %.4gs on the current placement (SLO %gs; was %.4gs)", tid,
                         p.latency_s, new.slo.max_latency_s, obs.tasks[tid].predicted_latency_s)
        self._last = key
        return out


def _apply(t: TaskRecord, p: Prediction, seen: TaskRecord) -> TaskRecord | None:
    """`t` with the prediction made on `seen`, unless its variant moved since (the next pass predicts again)."""
    if t.state is not TaskState.ACTIVE or t.variant != seen.variant or t.stage_instances != seen.stage_instances:
        return None
    return t.with_prediction(p.latency_s, p.stage_latency_s, time.time())
