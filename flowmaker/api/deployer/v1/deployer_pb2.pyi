from flowmaker.api.common.v1 import cluster_pb2 as _cluster_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeployRequest(_message.Message):
    __slots__ = ("model_id", "tp", "pp", "gpu_ids", "memory_gb_per_gpu", "task_id", "engine", "request_id", "no_wait")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GB_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tp: int
    pp: int
    gpu_ids: _containers.RepeatedScalarFieldContainer[str]
    memory_gb_per_gpu: float
    task_id: str
    engine: str
    request_id: str
    no_wait: bool
    def __init__(self, model_id: _Optional[str] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., gpu_ids: _Optional[_Iterable[str]] = ..., memory_gb_per_gpu: _Optional[float] = ..., task_id: _Optional[str] = ..., engine: _Optional[str] = ..., request_id: _Optional[str] = ..., no_wait: _Optional[bool] = ...) -> None: ...

class DeployResponse(_message.Message):
    __slots__ = ("instance", "engine_api_key")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_API_KEY_FIELD_NUMBER: _ClassVar[int]
    instance: _cluster_pb2.Instance
    engine_api_key: str
    def __init__(self, instance: _Optional[_Union[_cluster_pb2.Instance, _Mapping]] = ..., engine_api_key: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("instance_id", "task_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    task_id: str
    def __init__(self, instance_id: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("instance", "stopped")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    instance: _cluster_pb2.Instance
    stopped: bool
    def __init__(self, instance: _Optional[_Union[_cluster_pb2.Instance, _Mapping]] = ..., stopped: _Optional[bool] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("model_id", "task_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    task_id: str
    def __init__(self, model_id: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.Instance]
    def __init__(self, instances: _Optional[_Iterable[_Union[_cluster_pb2.Instance, _Mapping]]] = ...) -> None: ...

class ListGpusRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class ListGpusResponse(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.Gpu]
    def __init__(self, gpus: _Optional[_Iterable[_Union[_cluster_pb2.Gpu, _Mapping]]] = ...) -> None: ...
