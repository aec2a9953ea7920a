"""Task records as stored in etcd (under `keys.task(id)`), their JSON form, and the task state machine.

A task moves AWAITING_APPROVAL -> SELECTING -> DEPLOYING -> ACTIVE (or FAILED), and DELETING at the end.
DEGRADED is never stored: it is derived when the task is read (`derive_state`) from the live state of its
instances, its observed latency and whether the reconciler is healing it (`healing`), so it can never go stale.
Healing moves a task ACTIVE -> SELECTING -> DEPLOYING -> ACTIVE again (re-selection against the live cluster);
a healing deploy that fails goes back to SELECTING (retried with backoff) instead of FAILED.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from flowmaker import errors
from flowmaker.domain import NewInstance, Slo, Stage, StageAssignment, StageKind, Variant, Workflow
from flowmaker.errors import FailedPrecondition, InvalidSpec

REPLICA_SEP = "#"


def replica_slot(stage_id: str, i: int) -> str:
    """The `stage_instances` key of a stage's i-th replica (0 = the stage id itself)."""
    return stage_id if i == 0 else f"{stage_id}{REPLICA_SEP}{i}"


def replicas_of(stage_instances: dict[str, str], stage_id: str) -> list[str]:
    """The instances serving a stage: one, or every replica of its group (the first is the primary)."""
    out: list[str] = []
    while (iid := stage_instances.get(replica_slot(stage_id, len(out)))) is not None:
        out.append(iid)
    return out


def selected_prediction(v: Variant) -> dict[str, Any]:
    """The prediction fields of a task record as a selection of `v` sets them (`TaskRecord` keyword arguments):
    the variant's latency and each LLM stage's assignment latency, not re-derived yet."""
    return {"predicted_latency_s": v.latency_s,
            "predicted_stage_latency_s": {a.stage_id: a.latency_s for a in v.assignments}, "predicted_at": 0.0}


class TaskState(enum.Enum):
    """Mirrors flowmaker.common.v1.Task.State (without the prefix)."""

    GENERATING = "GENERATING"  # the generator is producing candidates
    AWAITING_APPROVAL = "AWAITING_APPROVAL"  # candidates ready; waiting for ApproveWorkflows
    SELECTING = "SELECTING"  # the selector is choosing a variant
    DEPLOYING = "DEPLOYING"  # selection committed (memory reserved); new instances starting
    ACTIVE = "ACTIVE"  # serving
    DEGRADED = "DEGRADED"  # derived on read only: an instance failed or observed latency exceeds the SLO
    FAILED = "FAILED"  # cannot serve; `failure` says why; holds no resources
    DELETING = "DELETING"  # DeleteTask in progress: references being released


# Stored transitions the orchestrator may make; anything else is a bug or a race and is refused.
TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.GENERATING: frozenset({TaskState.AWAITING_APPROVAL, TaskState.FAILED, TaskState.DELETING}),
    TaskState.AWAITING_APPROVAL: frozenset({TaskState.SELECTING, TaskState.DELETING}),
    TaskState.SELECTING: frozenset({TaskState.DEPLOYING, TaskState.FAILED, TaskState.AWAITING_APPROVAL,
                                    TaskState.DELETING}),
    TaskState.DEPLOYING: frozenset({TaskState.ACTIVE, TaskState.FAILED, TaskState.DELETING, TaskState.SELECTING}),
    TaskState.ACTIVE: frozenset({TaskState.DELETING, TaskState.SELECTING}),
    TaskState.FAILED: frozenset({TaskState.DELETING}),
    TaskState.DELETING: frozenset(),
    TaskState.DEGRADED: frozenset(),
}

SERVING_STATES = (TaskState.ACTIVE, TaskState.DEGRADED)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a task FAILED (or is DEGRADED): `error` names the FlowMakerError class that gives the gRPC
    code (e.g. "NoCapacity"), `reason` the stable ErrorInfo reason, `message` the human text."""

    error: str
    reason: str
    message: str

    @staticmethod
    def of(e: BaseException) -> Failure:
        """How an exception is stored: its nearest class of the error tree (`flowmaker.errors`) by name, so
        a subclass defined elsewhere (e.g. the deployer's EngineStartError) keeps its parent's gRPC code."""
        if isinstance(e, errors.FlowMakerError):
            name = next(c.__name__ for c in type(e).__mro__ if c.__module__ == errors.__name__)
            return Failure(name, e.reason, e.message)
        return Failure("FlowMakerError", "INTERNAL", f"{type(e).__name__}: {e}")

    def to_error(self) -> errors.FlowMakerError:
        """The exception this failure stands for (unknown names: the base FlowMakerError)."""
        cls = getattr(errors, self.error, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.FlowMakerError)):
            cls = errors.FlowMakerError
        return cls(self.message, reason=self.reason)


class HealAction(enum.Enum):
    RESTARTING_INSTANCE = "RESTARTING_INSTANCE"  # an engine is restarted in place (same GPUs)
    RESELECTING = "RESELECTING"  # a new variant is selected against the live cluster and deployed
    WAITING_FOR_CAPACITY = "WAITING_FOR_CAPACITY"  # re-selection found nothing feasible yet; retried


@dataclass(frozen=True, slots=True)
class Healing:
    """What the reconciler is doing to a task that stopped serving, why, and since when."""

    action: str
    detail: str
    since: float
    attempts: int = 0
    next_attempt_at: float = 0.0  # unix time; 0 = now

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "detail": self.detail, "since": self.since, "attempts": self.attempts,
                "next_attempt_at": self.next_attempt_at}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Healing:
        return Healing(str(d.get("action", "")), str(d.get("detail", "")), float(d.get("since", 0.0)),
                       int(d.get("attempts", 0)), float(d.get("next_attempt_at", 0.0)))


@dataclass(frozen=True, slots=True)
class Reselection:
    """A re-selection for load: when, why, for which rate, and how it ended (IN_PROGRESS, DONE, FAILED)."""

    at: float
    reason: str
    rate_rps: float
    outcome: str = "IN_PROGRESS"
    # The task's reuse shares (instance id -> output tokens/s) before the switch: an aborted switch puts back
    # the shares of the instances both variants use.
    previous_shares: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "reason": self.reason, "rate_rps": self.rate_rps, "outcome": self.outcome,
                "previous_shares": dict(self.previous_shares)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Reselection:
        return Reselection(float(d.get("at", 0.0)), str(d.get("reason", "")), float(d.get("rate_rps", 0.0)),
                           str(d.get("outcome", "")),
                           {str(k): float(v) for k, v in (d.get("previous_shares") or {}).items()})


@dataclass(frozen=True, slots=True)
class DeployedInstance:
    """A new instance the task's commit reserved (PENDING) and asked a deployer to start."""

    instance_id: str
    new_key: str
    model_id: str
    tp: int
    pp: int
    node: str
    gpu_ids: tuple[str, ...]
    memory_gb_per_gpu: float
    load_output_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class TaskRecord:
    id: str
    description: str
    slo: Slo
    name: str = ""
    candidates: tuple[Workflow, ...] = ()
    approved_workflow_ids: tuple[str, ...] = ()
    state: TaskState = TaskState.AWAITING_APPROVAL
    strategy: str = ""
    variant: Variant | None = None
    # LLM stage id -> instance id; a stage on a replica group (selection's max_replicas) has its other
    # replicas under "<stage id>#1", "#2", ... (`replicas_of`); '#' is outside the id charset.
    stage_instances: dict[str, str] = field(default_factory=dict)
    new_instances: tuple[DeployedInstance, ...] = ()  # what the commit reserved for this task
    # The predicted latency (model s): the selection's, then re-derived on the current placement whenever it
    # changes (flowmaker.orchestration.predict), with each LLM stage's and when it was last derived (0 = the
    # selection's own figures, not re-derived yet).
    predicted_latency_s: float = 0.0
    predicted_stage_latency_s: dict[str, float] = field(default_factory=dict)
    predicted_at: float = 0.0
    observed_latencies_s: tuple[float, ...] = ()  # most recent Invoke latencies (bounded window)
    requests_served: int = 0
    failure: Failure | None = None
    create_time: float = 0.0
    update_time: float = 0.0
    healing: Healing | None = None
    # The approval's SelectionOptions as proto3 JSON ("" = none): a selection resumed after a crash or an
    # etcd outage, or a re-selection while healing, uses what the user approved with.
    options_json: str = ""
    # The arrival rate the current variant was selected for (0 = slo.arrival_rate_rps): re-selection for
    # load moves it to the observed rate.
    planned_rate_rps: float = 0.0
    last_reselection: Reselection | None = None
    # Make-before-break: the variant being deployed to replace the current one (None = no switch under way).
    # Requests keep going to `stage_instances` until it serves; then it becomes the variant.
    next_variant: Variant | None = None
    next_stage_instances: dict[str, str] = field(default_factory=dict)
    next_new_instances: tuple[DeployedInstance, ...] = ()

    @property
    def workflow(self) -> Workflow | None:
        """The chosen workflow (its stages and prompt templates), once a variant is selected."""
        if self.variant is None:
            return None
        for w in self.candidates:
            if w.id == self.variant.workflow_id:
                return w
        return None

    @property
    def plan_rate_rps(self) -> float:
        """The rate the current variant was planned for."""
        return self.planned_rate_rps or self.slo.arrival_rate_rps

    @property
    def instance_ids(self) -> tuple[str, ...]:
        """Every instance the task references (reused and new), sorted."""
        return tuple(sorted(set(self.stage_instances.values())))

    def observed_p(self, q: float) -> float:
        xs = sorted(self.observed_latencies_s)
        if not xs:
            return 0.0
        if len(xs) == 1:
            return xs[0]
        return statistics.quantiles(xs, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))]

    def moved(self, state: TaskState, now: float, **changes: Any) -> TaskRecord:
        """This task in `state` (FailedPrecondition if the state machine does not allow it)."""
        if state is not self.state and state not in TRANSITIONS[self.state]:
            raise FailedPrecondition(f"task {self.id} is {self.state.value}; cannot become {state.value}",
                                     field="task_id", metadata={"state": self.state.value})
        return replace(self, state=state, update_time=now, **changes)

    def with_prediction(self, latency_s: float, stage_latency_s: dict[str, float], now: float) -> TaskRecord:
        """This task with a re-derived prediction (flowmaker.orchestration.predict)."""
        return replace(self, predicted_latency_s=latency_s, predicted_stage_latency_s=dict(stage_latency_s),
                       predicted_at=now)

    def with_observation(self, latency_s: float, now: float, window: int) -> TaskRecord:
        obs = (*self.observed_latencies_s, latency_s)[-window:]
        return replace(self, observed_latencies_s=obs, requests_served=self.requests_served + 1, update_time=now)

    # ---- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "name": self.name, "description": self.description, "slo": _slo_to(self.slo),
            "candidates": [workflow_to_json(w) for w in self.candidates],
            "approved_workflow_ids": list(self.approved_workflow_ids), "state": self.state.value,
            "strategy": self.strategy, "variant": variant_to_json(self.variant) if self.variant else None,
            "stage_instances": dict(self.stage_instances),
            "new_instances": [_deployed_to(d) for d in self.new_instances],
            "predicted_latency_s": self.predicted_latency_s,
            "predicted_stage_latency_s": dict(self.predicted_stage_latency_s), "predicted_at": self.predicted_at,
            "observed_latencies_s": list(self.observed_latencies_s), "requests_served": self.requests_served,
            "failure": None if self.failure is None else {"error": self.failure.error, "reason": self.failure.reason,
                                                          "message": self.failure.message},
            "create_time": self.create_time, "update_time": self.update_time,
            "healing": None if self.healing is None else self.healing.to_json(),
            "options_json": self.options_json,
            "planned_rate_rps": self.planned_rate_rps,
            "last_reselection": None if self.last_reselection is None else self.last_reselection.to_json(),
            "next_variant": variant_to_json(self.next_variant) if self.next_variant else None,
            "next_stage_instances": dict(self.next_stage_instances),
            "next_new_instances": [_deployed_to(d) for d in self.next_new_instances],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> TaskRecord:
        if not isinstance(d, dict):
            raise InvalidSpec("task record must be a JSON object", field="task")
        f = d.get("failure")
        return TaskRecord(
            id=d["id"], name=d.get("name", ""), description=d.get("description", ""), slo=_slo_from(d["slo"]),
            candidates=tuple(workflow_from_json(w) for w in d.get("candidates", ())),
            approved_workflow_ids=tuple(d.get("approved_workflow_ids", ())),
            state=TaskState(d.get("state", "AWAITING_APPROVAL")), strategy=d.get("strategy", ""),
            variant=variant_from_json(d["variant"]) if d.get("variant") else None,
            stage_instances=dict(d.get("stage_instances", {})),
            new_instances=tuple(_deployed_from(x) for x in d.get("new_instances", ())),
            predicted_latency_s=float(d.get("predicted_latency_s", 0.0)),
            predicted_stage_latency_s={str(k): float(v) for k, v in (d.get("predicted_stage_latency_s") or {}).items()},
            predicted_at=float(d.get("predicted_at", 0.0)),
            observed_latencies_s=tuple(float(x) for x in d.get("observed_latencies_s", ())),
            requests_served=int(d.get("requests_served", 0)),
            failure=Failure(f["error"], f["reason"], f["message"]) if f else None,
            create_time=float(d.get("create_time", 0.0)), update_time=float(d.get("update_time", 0.0)),
            healing=Healing.from_json(d["healing"]) if d.get("healing") else None,
            options_json=str(d.get("options_json", "")),
            planned_rate_rps=float(d.get("planned_rate_rps", 0.0)),
            last_reselection=Reselection.from_json(d["last_reselection"]) if d.get("last_reselection") else None,
            next_variant=variant_from_json(d["next_variant"]) if d.get("next_variant") else None,
            next_stage_instances=dict(d.get("next_stage_instances", {})),
            next_new_instances=tuple(_deployed_from(x) for x in d.get("next_new_instances", ())),
        )


def derive_state(task: TaskRecord, instance_states: dict[str, str | None], *,
                 min_samples: int = 5) -> tuple[TaskState, Failure | None]:
    """The state a reader sees. `instance_states` maps each of the task's instance ids to its live state
    name ("READY", "FAILED", ...), or None when the instance or its node is gone. A stored ACTIVE task is
    DEGRADED when one of its instances is not READY, or when its median observed latency (over at least
    `min_samples` requests) exceeds the latency SLO. A task the reconciler is healing (stored ACTIVE,
    SELECTING or DEPLOYING with `healing` set) is DEGRADED, and its failure says what is being done."""
    if task.healing is not None and task.state in (TaskState.ACTIVE, TaskState.SELECTING, TaskState.DEPLOYING):
        h = task.healing
        return TaskState.DEGRADED, Failure("Unavailable", "TASK_HEALING",
                                           f"healing ({h.action}, attempt {h.attempts}): {h.detail}")
    if task.state is not TaskState.ACTIVE:
        return task.state, task.failure
    bad = sorted((iid, st) for iid, st in instance_states.items() if st != "READY")
    if bad:
        what = ", ".join(f"{iid} is {st or 'gone'}" for iid, st in bad)
        return TaskState.DEGRADED, Failure("Unavailable", "INSTANCE_FAILED", f"instance(s) not serving: {what}")
    if len(task.observed_latencies_s) >= min_samples and task.observed_p(0.5) > task.slo.max_latency_s:
        return TaskState.DEGRADED, Failure(
            "DeadlineExceeded", "LATENCY_SLO_EXCEEDED",
            f"observed p50 latency {task.observed_p(0.5):.3f}s exceeds the SLO {task.slo.max_latency_s:g}s")
    return TaskState.ACTIVE, None


# ---- JSON codecs of the domain objects a task holds (pure: no protobuf) ------------------------


def _slo_to(s: Slo) -> dict[str, Any]:
    return {"min_accuracy": s.min_accuracy, "max_latency_s": s.max_latency_s, "arrival_rate_rps": s.arrival_rate_rps}


def _slo_from(d: dict[str, Any]) -> Slo:
    return Slo(float(d["min_accuracy"]), float(d["max_latency_s"]), float(d.get("arrival_rate_rps", 0.0)))


def workflow_to_json(w: Workflow) -> dict[str, Any]:
    return {"id": w.id, "description": w.description, "rationale": w.rationale,
            "stages": [{"id": s.id, "kind": s.kind.value, "depends_on": list(s.depends_on),
                        "input_tokens": s.input_tokens, "output_tokens": s.output_tokens,
                        "calls_per_request": s.calls_per_request, "latency_s": s.latency_s, "role": s.role,
                        "prompt_template": s.prompt_template} for s in w.stages]}


def workflow_from_json(d: dict[str, Any]) -> Workflow:
    return Workflow(d["id"], tuple(Stage(
        id=s["id"], kind=StageKind(s.get("kind", "LLM")), depends_on=tuple(s.get("depends_on", ())),
        input_tokens=int(s.get("input_tokens", 0)), output_tokens=int(s.get("output_tokens", 0)),
        calls_per_request=int(s.get("calls_per_request", 1)), latency_s=float(s.get("latency_s", 0.0)),
        role=s.get("role", ""), prompt_template=s.get("prompt_template", "")) for s in d["stages"]),
        description=d.get("description", ""), rationale=d.get("rationale", ""))


def variant_to_json(v: Variant) -> dict[str, Any]:
    return {
        "workflow_id": v.workflow_id,
        "assignments": [{"stage_id": a.stage_id, "model_id": a.model_id, "tp": a.tp, "pp": a.pp, "reused": a.reused,
                         "instance_id": a.instance_id, "new_key": a.new_key, "gpu_ids": list(a.gpu_ids),
                         "latency_s": a.latency_s, "load_output_tokens_per_s": a.load_output_tokens_per_s,
                         **({"replica_keys": list(a.replica_keys)} if a.replica_keys else {})}
                        for a in v.assignments],
        "new_instances": [{"key": n.key, "model_id": n.model_id, "tp": n.tp, "pp": n.pp, "node": n.node,
                           "gpu_ids": list(n.gpu_ids), "memory_gb_per_gpu": n.memory_gb_per_gpu,
                           "load_output_tokens_per_s": n.load_output_tokens_per_s} for n in v.new_instances],
        "reuse": [[iid, load] for iid, load in v.reuse],
        "latency_s": v.latency_s, "accuracy": v.accuracy, "cost": v.cost, "new_memory_gb": v.new_memory_gb,
        "new_gpus": v.new_gpus,
    }


def variant_from_json(d: dict[str, Any]) -> Variant:
    return Variant(
        workflow_id=d["workflow_id"],
        assignments=tuple(StageAssignment(
            a["stage_id"], a["model_id"], int(a["tp"]), int(a["pp"]), bool(a["reused"]), a.get("instance_id", ""),
            a.get("new_key", ""), tuple(a.get("gpu_ids", ())), float(a.get("latency_s", 0.0)),
            float(a.get("load_output_tokens_per_s", 0.0)), tuple(a.get("replica_keys", ())))
            for a in d.get("assignments", ())),
        new_instances=tuple(NewInstance(
            n["key"], n["model_id"], int(n["tp"]), int(n["pp"]), n["node"], tuple(n["gpu_ids"]),
            float(n["memory_gb_per_gpu"]), float(n["load_output_tokens_per_s"])) for n in d.get("new_instances", ())),
        reuse=tuple((str(iid), float(load)) for iid, load in d.get("reuse", ())),
        latency_s=float(d["latency_s"]), accuracy=float(d["accuracy"]), cost=float(d["cost"]),
        new_memory_gb=float(d["new_memory_gb"]), new_gpus=int(d["new_gpus"]),
    )


def _deployed_to(x: DeployedInstance) -> dict[str, Any]:
    return {"instance_id": x.instance_id, "new_key": x.new_key, "model_id": x.model_id, "tp": x.tp, "pp": x.pp,
            "node": x.node, "gpu_ids": list(x.gpu_ids), "memory_gb_per_gpu": x.memory_gb_per_gpu,
            "load_output_tokens_per_s": x.load_output_tokens_per_s}


def _deployed_from(d: dict[str, Any]) -> DeployedInstance:
    return DeployedInstance(d["instance_id"], d["new_key"], d["model_id"], int(d["tp"]), int(d["pp"]), d["node"],
                            tuple(d["gpu_ids"]), float(d["memory_gb_per_gpu"]), float(d["load_output_tokens_per_s"]))
