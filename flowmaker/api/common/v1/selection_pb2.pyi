from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GpuSharing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_SHARING_UNSPECIFIED: _ClassVar[GpuSharing]
    GPU_SHARING_IGNORE: _ClassVar[GpuSharing]
    GPU_SHARING_INTERFERENCE: _ClassVar[GpuSharing]

class CapacityModel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPACITY_MODEL_UNSPECIFIED: _ClassVar[CapacityModel]
    CAPACITY_MODEL_OUTPUT_TOKENS: _ClassVar[CapacityModel]
    CAPACITY_MODEL_BUSY_TIME: _ClassVar[CapacityModel]

class Infeasibility(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INFEASIBILITY_UNSPECIFIED: _ClassVar[Infeasibility]
    INFEASIBILITY_NO_MODEL_MEETS_ACCURACY: _ClassVar[Infeasibility]
    INFEASIBILITY_NO_LATENCY: _ClassVar[Infeasibility]
    INFEASIBILITY_NO_CAPACITY: _ClassVar[Infeasibility]
    INFEASIBILITY_NO_GPU_MEMORY: _ClassVar[Infeasibility]
GPU_SHARING_UNSPECIFIED: GpuSharing
GPU_SHARING_IGNORE: GpuSharing
GPU_SHARING_INTERFERENCE: GpuSharing
CAPACITY_MODEL_UNSPECIFIED: CapacityModel
CAPACITY_MODEL_OUTPUT_TOKENS: CapacityModel
CAPACITY_MODEL_BUSY_TIME: CapacityModel
INFEASIBILITY_UNSPECIFIED: Infeasibility
INFEASIBILITY_NO_MODEL_MEETS_ACCURACY: Infeasibility
INFEASIBILITY_NO_LATENCY: Infeasibility
INFEASIBILITY_NO_CAPACITY: Infeasibility
INFEASIBILITY_NO_GPU_MEMORY: Infeasibility

class SelectionOptions(_message.Message):
    __slots__ = ("utilization_cap", "allow_reuse", "time_budget_s", "max_trials", "seed", "max_replicas", "capacity_model", "gpu_sharing", "interference", "gpu_price_gb")
    UTILIZATION_CAP_FIELD_NUMBER: _ClassVar[int]
    ALLOW_REUSE_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    MAX_TRIALS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_SHARING_FIELD_NUMBER: _ClassVar[int]
    INTERFERENCE_FIELD_NUMBER: _ClassVar[int]
    GPU_PRICE_GB_FIELD_NUMBER: _ClassVar[int]
    utilization_cap: float
    allow_reuse: bool
    time_budget_s: float
    max_trials: int
    seed: int
    max_replicas: int
    capacity_model: CapacityModel
    gpu_sharing: GpuSharing
    interference: float
    gpu_price_gb: float
    def __init__(self, utilization_cap: _Optional[float] = ..., allow_reuse: _Optional[bool] = ..., time_budget_s: _Optional[float] = ..., max_trials: _Optional[int] = ..., seed: _Optional[int] = ..., max_replicas: _Optional[int] = ..., capacity_model: _Optional[_Union[CapacityModel, str]] = ..., gpu_sharing: _Optional[_Union[GpuSharing, str]] = ..., interference: _Optional[float] = ..., gpu_price_gb: _Optional[float] = ...) -> None: ...

class NewInstance(_message.Message):
    __slots__ = ("key", "model_id", "tp", "pp", "node", "gpu_ids", "memory_gb_per_gpu", "load_output_tokens_per_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GB_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    LOAD_OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    model_id: str
    tp: int
    pp: int
    node: str
    gpu_ids: _containers.RepeatedScalarFieldContainer[str]
    memory_gb_per_gpu: float
    load_output_tokens_per_s: float
    def __init__(self, key: _Optional[str] = ..., model_id: _Optional[str] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., node: _Optional[str] = ..., gpu_ids: _Optional[_Iterable[str]] = ..., memory_gb_per_gpu: _Optional[float] = ..., load_output_tokens_per_s: _Optional[float] = ...) -> None: ...

class StageAssignment(_message.Message):
    __slots__ = ("stage_id", "model_id", "tp", "pp", "reused", "instance_id", "new_key", "gpu_ids", "latency_s", "load_output_tokens_per_s", "replica_keys")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_KEY_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REPLICA_KEYS_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    model_id: str
    tp: int
    pp: int
    reused: bool
    instance_id: str
    new_key: str
    gpu_ids: _containers.RepeatedScalarFieldContainer[str]
    latency_s: float
    load_output_tokens_per_s: float
    replica_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stage_id: _Optional[str] = ..., model_id: _Optional[str] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., reused: _Optional[bool] = ..., instance_id: _Optional[str] = ..., new_key: _Optional[str] = ..., gpu_ids: _Optional[_Iterable[str]] = ..., latency_s: _Optional[float] = ..., load_output_tokens_per_s: _Optional[float] = ..., replica_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ReusedInstance(_message.Message):
    __slots__ = ("instance_id", "load_output_tokens_per_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    load_output_tokens_per_s: float
    def __init__(self, instance_id: _Optional[str] = ..., load_output_tokens_per_s: _Optional[float] = ...) -> None: ...

class Variant(_message.Message):
    __slots__ = ("workflow_id", "assignments", "new_instances", "reuse", "latency_s", "accuracy", "cost", "new_memory_gb", "new_gpus")
    WORKFLOW_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    NEW_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    NEW_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    NEW_GPUS_FIELD_NUMBER: _ClassVar[int]
    workflow_id: str
    assignments: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    new_instances: _containers.RepeatedCompositeFieldContainer[NewInstance]
    reuse: _containers.RepeatedCompositeFieldContainer[ReusedInstance]
    latency_s: float
    accuracy: float
    cost: float
    new_memory_gb: float
    new_gpus: int
    def __init__(self, workflow_id: _Optional[str] = ..., assignments: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ..., new_instances: _Optional[_Iterable[_Union[NewInstance, _Mapping]]] = ..., reuse: _Optional[_Iterable[_Union[ReusedInstance, _Mapping]]] = ..., latency_s: _Optional[float] = ..., accuracy: _Optional[float] = ..., cost: _Optional[float] = ..., new_memory_gb: _Optional[float] = ..., new_gpus: _Optional[int] = ...) -> None: ...
