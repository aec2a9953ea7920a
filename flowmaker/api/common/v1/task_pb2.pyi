import datetime

from flowmaker.api.common.v1 import selection_pb2 as _selection_pb2
from flowmaker.api.common.v1 import workflow_pb2 as _workflow_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Task(_message.Message):
    __slots__ = ("id", "name", "description", "slo", "candidates", "approved_workflow_ids", "variant", "strategy", "stage_instances", "predicted_latency_s", "observed_latency_p50_s", "observed_latency_p95_s", "requests_served", "state", "failure", "create_time", "update_time", "etag", "healing", "observed_arrival_rate_rps", "last_reselection", "next_stage_instances", "owner", "predicted_stage_latency_s", "predict_time")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Task.State]
        STATE_GENERATING: _ClassVar[Task.State]
        STATE_AWAITING_APPROVAL: _ClassVar[Task.State]
        STATE_SELECTING: _ClassVar[Task.State]
        STATE_DEPLOYING: _ClassVar[Task.State]
        STATE_ACTIVE: _ClassVar[Task.State]
        STATE_DEGRADED: _ClassVar[Task.State]
        STATE_FAILED: _ClassVar[Task.State]
        STATE_DELETING: _ClassVar[Task.State]
    STATE_UNSPECIFIED: Task.State
    STATE_GENERATING: Task.State
    STATE_AWAITING_APPROVAL: Task.State
    STATE_SELECTING: Task.State
    STATE_DEPLOYING: Task.State
    STATE_ACTIVE: Task.State
    STATE_DEGRADED: Task.State
    STATE_FAILED: Task.State
    STATE_DELETING: Task.State
    class StageInstancesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class NextStageInstancesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class PredictedStageLatencySEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    APPROVED_WORKFLOW_IDS_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STAGE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_LATENCY_P50_S_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_LATENCY_P95_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    HEALING_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ARRIVAL_RATE_RPS_FIELD_NUMBER: _ClassVar[int]
    LAST_RESELECTION_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STAGE_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    PREDICT_TIME_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    description: str
    slo: _workflow_pb2.Slo
    candidates: _containers.RepeatedCompositeFieldContainer[_workflow_pb2.Workflow]
    approved_workflow_ids: _containers.RepeatedScalarFieldContainer[str]
    variant: _selection_pb2.Variant
    strategy: str
    stage_instances: _containers.ScalarMap[str, str]
    predicted_latency_s: float
    observed_latency_p50_s: float
    observed_latency_p95_s: float
    requests_served: int
    state: Task.State
    failure: _status_pb2.Status
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    etag: str
    healing: Healing
    observed_arrival_rate_rps: float
    last_reselection: Reselection
    next_stage_instances: _containers.ScalarMap[str, str]
    owner: str
    predicted_stage_latency_s: _containers.ScalarMap[str, float]
    predict_time: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., description: _Optional[str] = ..., slo: _Optional[_Union[_workflow_pb2.Slo, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[_workflow_pb2.Workflow, _Mapping]]] = ..., approved_workflow_ids: _Optional[_Iterable[str]] = ..., variant: _Optional[_Union[_selection_pb2.Variant, _Mapping]] = ..., strategy: _Optional[str] = ..., stage_instances: _Optional[_Mapping[str, str]] = ..., predicted_latency_s: _Optional[float] = ..., observed_latency_p50_s: _Optional[float] = ..., observed_latency_p95_s: _Optional[float] = ..., requests_served: _Optional[int] = ..., state: _Optional[_Union[Task.State, str]] = ..., failure: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., etag: _Optional[str] = ..., healing: _Optional[_Union[Healing, _Mapping]] = ..., observed_arrival_rate_rps: _Optional[float] = ..., last_reselection: _Optional[_Union[Reselection, _Mapping]] = ..., next_stage_instances: _Optional[_Mapping[str, str]] = ..., owner: _Optional[str] = ..., predicted_stage_latency_s: _Optional[_Mapping[str, float]] = ..., predict_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Reselection(_message.Message):
    __slots__ = ("time", "reason", "planned_arrival_rate_rps", "outcome")
    TIME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLANNED_ARRIVAL_RATE_RPS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    time: _timestamp_pb2.Timestamp
    reason: str
    planned_arrival_rate_rps: float
    outcome: str
    def __init__(self, time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ..., planned_arrival_rate_rps: _Optional[float] = ..., outcome: _Optional[str] = ...) -> None: ...

class Healing(_message.Message):
    __slots__ = ("action", "detail", "since_time", "attempts", "next_attempt_time")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SINCE_TIME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ATTEMPT_TIME_FIELD_NUMBER: _ClassVar[int]
    action: str
    detail: str
    since_time: _timestamp_pb2.Timestamp
    attempts: int
    next_attempt_time: _timestamp_pb2.Timestamp
    def __init__(self, action: _Optional[str] = ..., detail: _Optional[str] = ..., since_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempts: _Optional[int] = ..., next_attempt_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
