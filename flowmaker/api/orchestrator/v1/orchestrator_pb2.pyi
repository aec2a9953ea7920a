import datetime

from flowmaker.api.common.v1 import selection_pb2 as _selection_pb2
from flowmaker.api.common.v1 import task_pb2 as _task_pb2
from flowmaker.api.common.v1 import workflow_pb2 as _workflow_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Token(_message.Message):
    __slots__ = ("id", "create_time", "expire_time", "expired")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    id: str
    create_time: _timestamp_pb2.Timestamp
    expire_time: _timestamp_pb2.Timestamp
    expired: bool
    def __init__(self, id: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expired: _Optional[bool] = ...) -> None: ...

class User(_message.Message):
    __slots__ = ("id", "name", "admin", "create_time", "tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    admin: bool
    create_time: _timestamp_pb2.Timestamp
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., admin: _Optional[bool] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class CreateUserRequest(_message.Message):
    __slots__ = ("name", "admin", "expires_in")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_FIELD_NUMBER: _ClassVar[int]
    name: str
    admin: bool
    expires_in: _duration_pb2.Duration
    def __init__(self, name: _Optional[str] = ..., admin: _Optional[bool] = ..., expires_in: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CreateUserResponse(_message.Message):
    __slots__ = ("user", "token", "token_id")
    USER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    user: User
    token: str
    token_id: str
    def __init__(self, user: _Optional[_Union[User, _Mapping]] = ..., token: _Optional[str] = ..., token_id: _Optional[str] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("user", "expires_in")
    USER_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_FIELD_NUMBER: _ClassVar[int]
    user: str
    expires_in: _duration_pb2.Duration
    def __init__(self, user: _Optional[str] = ..., expires_in: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CreateTokenResponse(_message.Message):
    __slots__ = ("user", "token", "token_id")
    USER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    user: User
    token: str
    token_id: str
    def __init__(self, user: _Optional[_Union[User, _Mapping]] = ..., token: _Optional[str] = ..., token_id: _Optional[str] = ...) -> None: ...

class ListUsersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListUsersResponse(_message.Message):
    __slots__ = ("users",)
    USERS_FIELD_NUMBER: _ClassVar[int]
    users: _containers.RepeatedCompositeFieldContainer[User]
    def __init__(self, users: _Optional[_Iterable[_Union[User, _Mapping]]] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: str
    def __init__(self, target: _Optional[str] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("user", "user_deleted", "revoked_token_ids")
    USER_FIELD_NUMBER: _ClassVar[int]
    USER_DELETED_FIELD_NUMBER: _ClassVar[int]
    REVOKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    user: User
    user_deleted: bool
    revoked_token_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, user: _Optional[_Union[User, _Mapping]] = ..., user_deleted: _Optional[bool] = ..., revoked_token_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeployTaskRequest(_message.Message):
    __slots__ = ("description", "name", "slo", "max_workflows", "workflows")
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKFLOWS_FIELD_NUMBER: _ClassVar[int]
    WORKFLOWS_FIELD_NUMBER: _ClassVar[int]
    description: str
    name: str
    slo: _workflow_pb2.Slo
    max_workflows: int
    workflows: _containers.RepeatedCompositeFieldContainer[_workflow_pb2.Workflow]
    def __init__(self, description: _Optional[str] = ..., name: _Optional[str] = ..., slo: _Optional[_Union[_workflow_pb2.Slo, _Mapping]] = ..., max_workflows: _Optional[int] = ..., workflows: _Optional[_Iterable[_Union[_workflow_pb2.Workflow, _Mapping]]] = ...) -> None: ...

class DeployTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _task_pb2.Task
    def __init__(self, task: _Optional[_Union[_task_pb2.Task, _Mapping]] = ...) -> None: ...

class ApproveWorkflowsRequest(_message.Message):
    __slots__ = ("task_id", "workflow_ids", "strategy", "options", "etag")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_IDS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    workflow_ids: _containers.RepeatedScalarFieldContainer[str]
    strategy: str
    options: _selection_pb2.SelectionOptions
    etag: str
    def __init__(self, task_id: _Optional[str] = ..., workflow_ids: _Optional[_Iterable[str]] = ..., strategy: _Optional[str] = ..., options: _Optional[_Union[_selection_pb2.SelectionOptions, _Mapping]] = ..., etag: _Optional[str] = ...) -> None: ...

class ApproveWorkflowsResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _task_pb2.Task
    def __init__(self, task: _Optional[_Union[_task_pb2.Task, _Mapping]] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class GetTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _task_pb2.Task
    def __init__(self, task: _Optional[_Union[_task_pb2.Task, _Mapping]] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _task_pb2.Task.State
    def __init__(self, state: _Optional[_Union[_task_pb2.Task.State, str]] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_task_pb2.Task]
    def __init__(self, tasks: _Optional[_Iterable[_Union[_task_pb2.Task, _Mapping]]] = ...) -> None: ...

class DeleteTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class DeleteTaskResponse(_message.Message):
    __slots__ = ("task", "released_instance_ids")
    TASK_FIELD_NUMBER: _ClassVar[int]
    RELEASED_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    task: _task_pb2.Task
    released_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task: _Optional[_Union[_task_pb2.Task, _Mapping]] = ..., released_instance_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StageOutput(_message.Message):
    __slots__ = ("stage_id", "instance_id", "model_id", "output", "input_tokens", "output_tokens", "start_s", "latency_s", "finish_reason")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    instance_id: str
    model_id: str
    output: str
    input_tokens: int
    output_tokens: int
    start_s: float
    latency_s: float
    finish_reason: str
    def __init__(self, stage_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., model_id: _Optional[str] = ..., output: _Optional[str] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., start_s: _Optional[float] = ..., latency_s: _Optional[float] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class InvokeRequest(_message.Message):
    __slots__ = ("task_id", "input", "max_output_tokens", "sampling")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    input: str
    max_output_tokens: int
    sampling: Sampling
    def __init__(self, task_id: _Optional[str] = ..., input: _Optional[str] = ..., max_output_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class InvokeResponse(_message.Message):
    __slots__ = ("output", "latency_s", "stages", "request_id", "task_id")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    output: str
    latency_s: float
    stages: _containers.RepeatedCompositeFieldContainer[StageOutput]
    request_id: str
    task_id: str
    def __init__(self, output: _Optional[str] = ..., latency_s: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageOutput, _Mapping]]] = ..., request_id: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class InvokeStreamRequest(_message.Message):
    __slots__ = ("task_id", "input", "max_output_tokens", "sampling")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    input: str
    max_output_tokens: int
    sampling: Sampling
    def __init__(self, task_id: _Optional[str] = ..., input: _Optional[str] = ..., max_output_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class InvokeStreamResponse(_message.Message):
    __slots__ = ("delta", "stage_done", "done", "stage_id")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    STAGE_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    delta: str
    stage_done: StageOutput
    done: InvokeResponse
    stage_id: str
    def __init__(self, delta: _Optional[str] = ..., stage_done: _Optional[_Union[StageOutput, _Mapping]] = ..., done: _Optional[_Union[InvokeResponse, _Mapping]] = ..., stage_id: _Optional[str] = ...) -> None: ...
