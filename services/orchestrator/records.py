"""Task records in etcd, as every orchestrator role reads and writes them: get, compare-and-set update, fail.

Also what the roles share about them: the view a reader gets (`TaskView`), which failures say "not now"
(`is_transient`), and the span attribute names of the orchestrator's own steps.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace

from flowmaker import telemetry
from flowmaker.errors import Conflict, InvalidSpec, NotFound, Unavailable
from flowmaker.orchestration.task import Failure, TaskRecord, TaskState
from flowmaker.state import keys
from flowmaker.state.store import KeyValue, StateStore

log = logging.getLogger(__name__)

# Span attributes of the orchestrator's own steps (the shared ones, flowmaker.task/stage/instance/workflow
# and gen_ai.*, are in flowmaker.telemetry).
ATTR_ATTEMPT = "flowmaker.commit.attempt"  # 1-based select-and-commit attempt
ATTR_CONFLICT = "flowmaker.commit.conflict"  # the txn lost a race (or the view no longer fit): select again
ATTR_CONFLICT_KEYS = "flowmaker.commit.failed_keys"
ATTR_GENERATOR = "flowmaker.generator"  # "generator-service" (gRPC) or "templates" (in process)
ATTR_CANDIDATES = "flowmaker.candidates"  # the candidate workflow ids
ATTR_STRATEGY = "flowmaker.strategy"
ATTR_GPU_SHARING = "flowmaker.gpu_sharing"  # the selection's effective options.gpu_sharing (defaults applied)
ATTR_FEASIBLE = "flowmaker.feasible"
ATTR_REASON = "flowmaker.reason"
ATTR_NEW_INSTANCES = "flowmaker.new_instances"
ATTR_REUSED = "flowmaker.reused_instances"
ATTR_INSTANCES = "flowmaker.instances"  # a list: the instances a deploy starts/waits for, a release stopped
ATTR_MODEL = "flowmaker.model"
ATTR_NODE = "flowmaker.node"
ATTR_GPUS = "flowmaker.gpus"
ATTR_STAGE_KIND = "flowmaker.stage.kind"


def tracer() -> trace.Tracer:
    return telemetry.tracer()


# Failures that say "not now" rather than "not this": etcd or a service unreachable, or a node whose key is
# missing (its lease lapsed while etcd was down: it re-registers when etcd is back; one gone for good is the
# reconciler's REPLAN_DEPLOY after the grace). A worker hitting one leaves its task where it is, for the
# reconciler to carry on once the outage is over.
_TRANSIENT_REASONS = frozenset({"ETCD_UNAVAILABLE", "UNAVAILABLE", "NODE_LOST"})


def is_transient(e: BaseException) -> bool:
    return isinstance(e, Unavailable) and e.reason in _TRANSIENT_REASONS


@dataclass(frozen=True, slots=True)
class TaskView:
    """A task as read: the record, its etag, and the state/failure a reader sees (DEGRADED derived)."""

    task: TaskRecord
    etag: int
    state: TaskState
    failure: Failure | None
    observed_rate_rps: float = 0.0  # model-time arrivals/s over the orchestrator's window (0: not measured)


class TaskStore:
    """The task records under `keys.task`: every write is a compare-and-set on the record's etag."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    async def get(self, task_id: str) -> tuple[KeyValue, TaskRecord]:
        if not task_id:
            raise InvalidSpec("must not be empty", field="task_id")
        kv = await self.store.get(keys.task(task_id))
        if kv is None:
            raise NotFound(f"no task {task_id!r}", field="task_id", reason="TASK_NOT_FOUND")
        return kv, TaskRecord.from_json(kv.value)

    async def update(self, task_id: str, fn: Callable[[TaskRecord], TaskRecord | None]) -> TaskRecord | None:
        """CAS loop: `fn` maps the current record to the new one (None = leave it)."""
        got = await self.update_rev(task_id, fn)
        return None if got is None else got[0]

    async def update_rev(self, task_id: str, fn: Callable[[TaskRecord], TaskRecord | None]
                         ) -> tuple[TaskRecord, int] | None:
        """`update`, with the etcd revision of the write (what a cache needs to order it against watch events)."""
        for _ in range(50):
            kv, t = await self.get(task_id)
            new = fn(t)
            if new is None:
                return None
            try:
                return new, await self.store.cas(kv.key, new.to_json(), etag=kv.mod_revision)
            except Conflict:
                await asyncio.sleep(random.uniform(0.001, 0.02))
        raise Conflict(f"task {task_id} kept changing; retry", field="task_id")

    async def fail(self, task_id: str, failure: Failure) -> TaskRecord | None:
        log.warning("task %s FAILED: %s %s", task_id, failure.reason, failure.message)

        def fn(t: TaskRecord) -> TaskRecord | None:
            if t.state in (TaskState.FAILED, TaskState.DELETING):
                return None
            return t.moved(TaskState.FAILED, time.time(), failure=failure)
        try:
            return await self.update(task_id, fn)
        except NotFound:
            return None

