"""Task records -> flowmaker.common.v1.Task messages (the orchestrator's own conversions)."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from flowmaker import convert, errors
from flowmaker.api.common.v1 import task_pb2
from flowmaker.orchestration.task import Failure, TaskRecord, TaskState
from flowmaker.rpc.errors import to_status_proto

_ERRORS: dict[str, type[errors.FlowMakerError]] = {
    cls.__name__: cls for cls in (errors.InvalidSpec, errors.NotFound, errors.AlreadyExists, errors.Conflict,
                                  errors.FailedPrecondition, errors.NoCapacity, errors.Unavailable,
                                  errors.DeadlineExceeded)}


def failure_of(e: BaseException) -> Failure:
    """How an exception is stored in a task record."""
    if isinstance(e, errors.FlowMakerError):
        name = next((n for n, cls in _ERRORS.items() if isinstance(e, cls)), "FlowMakerError")
        return Failure(name, e.reason, e.message)
    return Failure("FlowMakerError", "INTERNAL", f"{type(e).__name__}: {e}")


def failure_error(f: Failure) -> errors.FlowMakerError:
    return _ERRORS.get(f.error, errors.FlowMakerError)(f.message, reason=f.reason)


def state_to_proto(s: TaskState) -> task_pb2.Task.State:
    return task_pb2.Task.State.Value("STATE_" + s.value)  # type: ignore[return-value]


def state_from_proto(n: int) -> TaskState | None:
    return None if n == 0 else TaskState(task_pb2.Task.State.Name(n).removeprefix("STATE_"))  # type: ignore[arg-type]


def _ts(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


def task_to_proto(t: TaskRecord, *, etag: int = 0, state: TaskState | None = None,
                  failure: Failure | None = None) -> task_pb2.Task:
    """The task as the API shows it; `state`/`failure` override the stored ones (derived DEGRADED)."""
    st = state or t.state
    f = failure if state is not None else t.failure
    m = task_pb2.Task(
        id=t.id, name=t.name, description=t.description, slo=convert.slo_to_proto(t.slo),
        candidates=[convert.workflow_to_proto(w) for w in t.candidates],
        approved_workflow_ids=list(t.approved_workflow_ids), strategy=t.strategy,
        stage_instances=dict(t.stage_instances), predicted_latency_s=t.predicted_latency_s,
        observed_latency_p50_s=t.observed_p(0.5), observed_latency_p95_s=t.observed_p(0.95),
        requests_served=t.requests_served, state=state_to_proto(st), etag=str(etag) if etag else "")
    if t.variant is not None:
        m.variant.CopyFrom(convert.variant_to_proto(t.variant))
    if f is not None:
        m.failure.CopyFrom(to_status_proto(failure_error(f)))
    if t.create_time:
        m.create_time.CopyFrom(_ts(t.create_time))
    if t.update_time:
        m.update_time.CopyFrom(_ts(t.update_time))
    return m
