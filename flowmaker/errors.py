"""The exception tree of FlowMaker: every error a user can cause, each with a stable reason.

The gRPC layer maps these to status codes in exactly one place
(`flowmaker.rpc.errors`); the pure core raises them without knowing about gRPC.
"""

from __future__ import annotations


class FlowMakerError(Exception):
    """Base of every expected error. `reason` is a stable UPPER_SNAKE identifier
    (it becomes `google.rpc.ErrorInfo.reason`); `field` names the offending input
    field when there is one (it becomes a `BadRequest.FieldViolation`)."""

    reason: str = "FLOWMAKER_ERROR"

    def __init__(self, message: str, *, field: str | None = None, reason: str | None = None,
                 metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if reason is not None:
            self.reason = reason
        self.metadata = dict(metadata or {})

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class InvalidSpec(FlowMakerError):
    """Bad input: maps to INVALID_ARGUMENT."""

    reason = "INVALID_SPEC"


class NotFound(FlowMakerError):
    """A named thing (model, task, instance, strategy) does not exist: NOT_FOUND."""

    reason = "NOT_FOUND"


class AlreadyExists(FlowMakerError):
    """Creating something whose id is taken: ALREADY_EXISTS."""

    reason = "ALREADY_EXISTS"


class Conflict(FlowMakerError):
    """A compare-and-set lost a race (etcd revision moved): ABORTED, safe to retry."""

    reason = "CONFLICT"


class FailedPrecondition(FlowMakerError):
    """The object is in the wrong state for this call (e.g. invoking a task
    that is not ACTIVE): FAILED_PRECONDITION."""

    reason = "FAILED_PRECONDITION"


class NoCapacity(FlowMakerError):
    """No GPU memory / no feasible variant for the request: RESOURCE_EXHAUSTED."""

    reason = "NO_CAPACITY"


class Unavailable(FlowMakerError):
    """A dependency (etcd, an engine, another service) cannot be reached: UNAVAILABLE."""

    reason = "UNAVAILABLE"


class DeadlineExceeded(FlowMakerError):
    """Work did not finish within its deadline or budget: DEADLINE_EXCEEDED."""

    reason = "DEADLINE_EXCEEDED"


class Unauthenticated(FlowMakerError):
    """No valid credentials (no client certificate, no or an unknown bearer token): UNAUTHENTICATED."""

    reason = "UNAUTHENTICATED"


class PermissionDenied(FlowMakerError):
    """Valid credentials, but not allowed to do this (another owner's task, a deployer write from a
    caller other than the orchestrator or the profiler): PERMISSION_DENIED."""

    reason = "PERMISSION_DENIED"
