import datetime

from flowmaker.api.common.v1 import cluster_pb2 as _cluster_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterModelRequest(_message.Message):
    __slots__ = ("catalog_name", "hf_config_json", "model_id", "accuracy", "hf_id", "source")
    CATALOG_NAME_FIELD_NUMBER: _ClassVar[int]
    HF_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    HF_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    catalog_name: str
    hf_config_json: str
    model_id: str
    accuracy: float
    hf_id: str
    source: str
    def __init__(self, catalog_name: _Optional[str] = ..., hf_config_json: _Optional[str] = ..., model_id: _Optional[str] = ..., accuracy: _Optional[float] = ..., hf_id: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: _cluster_pb2.Model
    def __init__(self, model: _Optional[_Union[_cluster_pb2.Model, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.Model]
    def __init__(self, models: _Optional[_Iterable[_Union[_cluster_pb2.Model, _Mapping]]] = ...) -> None: ...

class ParallelConfig(_message.Message):
    __slots__ = ("tp", "pp")
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    tp: int
    pp: int
    def __init__(self, tp: _Optional[int] = ..., pp: _Optional[int] = ...) -> None: ...

class ProfileConfig(_message.Message):
    __slots__ = ("config", "profile", "state", "analytic", "measured", "progress", "job_id")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[ProfileConfig.State]
        STATE_ANALYTIC: _ClassVar[ProfileConfig.State]
        STATE_MEASURING: _ClassVar[ProfileConfig.State]
        STATE_MEASURED: _ClassVar[ProfileConfig.State]
        STATE_MEASURE_FAILED: _ClassVar[ProfileConfig.State]
    STATE_UNSPECIFIED: ProfileConfig.State
    STATE_ANALYTIC: ProfileConfig.State
    STATE_MEASURING: ProfileConfig.State
    STATE_MEASURED: ProfileConfig.State
    STATE_MEASURE_FAILED: ProfileConfig.State
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ANALYTIC_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    config: ParallelConfig
    profile: _cluster_pb2.Profile
    state: ProfileConfig.State
    analytic: _cluster_pb2.Profile
    measured: _cluster_pb2.Profile
    progress: float
    job_id: str
    def __init__(self, config: _Optional[_Union[ParallelConfig, _Mapping]] = ..., profile: _Optional[_Union[_cluster_pb2.Profile, _Mapping]] = ..., state: _Optional[_Union[ProfileConfig.State, str]] = ..., analytic: _Optional[_Union[_cluster_pb2.Profile, _Mapping]] = ..., measured: _Optional[_Union[_cluster_pb2.Profile, _Mapping]] = ..., progress: _Optional[float] = ..., job_id: _Optional[str] = ...) -> None: ...

class GetProfilesRequest(_message.Message):
    __slots__ = ("model_id", "gpu_type", "configs")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    gpu_type: str
    configs: _containers.RepeatedCompositeFieldContainer[ParallelConfig]
    def __init__(self, model_id: _Optional[str] = ..., gpu_type: _Optional[str] = ..., configs: _Optional[_Iterable[_Union[ParallelConfig, _Mapping]]] = ...) -> None: ...

class GetProfilesResponse(_message.Message):
    __slots__ = ("configs",)
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    configs: _containers.RepeatedCompositeFieldContainer[ProfileConfig]
    def __init__(self, configs: _Optional[_Iterable[_Union[ProfileConfig, _Mapping]]] = ...) -> None: ...

class ProfilingJob(_message.Message):
    __slots__ = ("id", "model_id", "gpu_type", "configs", "state", "configs_done", "configs_total", "failure", "create_time", "update_time")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[ProfilingJob.State]
        STATE_QUEUED: _ClassVar[ProfilingJob.State]
        STATE_RUNNING: _ClassVar[ProfilingJob.State]
        STATE_SUCCEEDED: _ClassVar[ProfilingJob.State]
        STATE_FAILED: _ClassVar[ProfilingJob.State]
    STATE_UNSPECIFIED: ProfilingJob.State
    STATE_QUEUED: ProfilingJob.State
    STATE_RUNNING: ProfilingJob.State
    STATE_SUCCEEDED: ProfilingJob.State
    STATE_FAILED: ProfilingJob.State
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_DONE_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    id: str
    model_id: str
    gpu_type: str
    configs: _containers.RepeatedCompositeFieldContainer[ParallelConfig]
    state: ProfilingJob.State
    configs_done: int
    configs_total: int
    failure: _status_pb2.Status
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., model_id: _Optional[str] = ..., gpu_type: _Optional[str] = ..., configs: _Optional[_Iterable[_Union[ParallelConfig, _Mapping]]] = ..., state: _Optional[_Union[ProfilingJob.State, str]] = ..., configs_done: _Optional[int] = ..., configs_total: _Optional[int] = ..., failure: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ProfileModelRequest(_message.Message):
    __slots__ = ("model_id", "gpu_type", "configs", "engine")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    gpu_type: str
    configs: _containers.RepeatedCompositeFieldContainer[ParallelConfig]
    engine: str
    def __init__(self, model_id: _Optional[str] = ..., gpu_type: _Optional[str] = ..., configs: _Optional[_Iterable[_Union[ParallelConfig, _Mapping]]] = ..., engine: _Optional[str] = ...) -> None: ...

class ProfileModelResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: ProfilingJob
    def __init__(self, job: _Optional[_Union[ProfilingJob, _Mapping]] = ...) -> None: ...

class GetProfilingJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetProfilingJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: ProfilingJob
    def __init__(self, job: _Optional[_Union[ProfilingJob, _Mapping]] = ...) -> None: ...
