import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROFILE_SOURCE_UNSPECIFIED: _ClassVar[ProfileSource]
    PROFILE_SOURCE_ANALYTIC: _ClassVar[ProfileSource]
    PROFILE_SOURCE_MEASURED: _ClassVar[ProfileSource]
PROFILE_SOURCE_UNSPECIFIED: ProfileSource
PROFILE_SOURCE_ANALYTIC: ProfileSource
PROFILE_SOURCE_MEASURED: ProfileSource

class ModelArch(_message.Message):
    __slots__ = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "max_ctx", "dtype_bytes", "tie_word_embeddings", "num_experts", "experts_per_tok")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    MAX_CTX_FIELD_NUMBER: _ClassVar[int]
    DTYPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIE_WORD_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_ctx: int
    dtype_bytes: int
    tie_word_embeddings: bool
    num_experts: int
    experts_per_tok: int
    def __init__(self, layers: _Optional[int] = ..., hidden: _Optional[int] = ..., intermediate: _Optional[int] = ..., heads: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab: _Optional[int] = ..., max_ctx: _Optional[int] = ..., dtype_bytes: _Optional[int] = ..., tie_word_embeddings: _Optional[bool] = ..., num_experts: _Optional[int] = ..., experts_per_tok: _Optional[int] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "accuracy", "params_b", "active_params_b", "arch", "hf_id", "family", "source")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    PARAMS_B_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PARAMS_B_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    HF_ID_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    accuracy: float
    params_b: float
    active_params_b: float
    arch: ModelArch
    hf_id: str
    family: str
    source: str
    def __init__(self, id: _Optional[str] = ..., accuracy: _Optional[float] = ..., params_b: _Optional[float] = ..., active_params_b: _Optional[float] = ..., arch: _Optional[_Union[ModelArch, _Mapping]] = ..., hf_id: _Optional[str] = ..., family: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class GpuType(_message.Message):
    __slots__ = ("name", "memory_gb", "mem_bw_gbps", "bf16_tflops", "interconnect_gbps", "interconnect", "price_per_hour", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    MEM_BW_GBPS_FIELD_NUMBER: _ClassVar[int]
    BF16_TFLOPS_FIELD_NUMBER: _ClassVar[int]
    INTERCONNECT_GBPS_FIELD_NUMBER: _ClassVar[int]
    INTERCONNECT_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    memory_gb: float
    mem_bw_gbps: float
    bf16_tflops: float
    interconnect_gbps: float
    interconnect: str
    price_per_hour: float
    source: str
    def __init__(self, name: _Optional[str] = ..., memory_gb: _Optional[float] = ..., mem_bw_gbps: _Optional[float] = ..., bf16_tflops: _Optional[float] = ..., interconnect_gbps: _Optional[float] = ..., interconnect: _Optional[str] = ..., price_per_hour: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("model_id", "tp", "pp", "memory_gb_per_gpu", "fixed_s", "prefill_s_per_token", "decode_s_per_token", "max_output_tokens_per_s", "gpu_type", "source", "decode_tokens_per_s")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GB_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    FIXED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tp: int
    pp: int
    memory_gb_per_gpu: float
    fixed_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    max_output_tokens_per_s: float
    gpu_type: str
    source: ProfileSource
    decode_tokens_per_s: float
    def __init__(self, model_id: _Optional[str] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., memory_gb_per_gpu: _Optional[float] = ..., fixed_s: _Optional[float] = ..., prefill_s_per_token: _Optional[float] = ..., decode_s_per_token: _Optional[float] = ..., max_output_tokens_per_s: _Optional[float] = ..., gpu_type: _Optional[str] = ..., source: _Optional[_Union[ProfileSource, str]] = ..., decode_tokens_per_s: _Optional[float] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("id", "node", "memory_total_gb", "memory_used_gb", "gpu_type")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_GB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_GB_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    id: str
    node: str
    memory_total_gb: float
    memory_used_gb: float
    gpu_type: str
    def __init__(self, id: _Optional[str] = ..., node: _Optional[str] = ..., memory_total_gb: _Optional[float] = ..., memory_used_gb: _Optional[float] = ..., gpu_type: _Optional[str] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("id", "model_id", "tp", "pp", "gpu_ids", "load_output_tokens_per_s", "endpoint", "state", "node", "engine", "task_ids", "create_time", "failure", "observed_load_output_tokens_per_s", "observed_time", "observed_queue", "observed_latency_s", "observed_slowdown", "saturated", "max_slowdown", "busy_share", "unresponsive_time")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Instance.State]
        STATE_PENDING: _ClassVar[Instance.State]
        STATE_STARTING: _ClassVar[Instance.State]
        STATE_READY: _ClassVar[Instance.State]
        STATE_DRAINING: _ClassVar[Instance.State]
        STATE_FAILED: _ClassVar[Instance.State]
        STATE_LOST: _ClassVar[Instance.State]
    STATE_UNSPECIFIED: Instance.State
    STATE_PENDING: Instance.State
    STATE_STARTING: Instance.State
    STATE_READY: Instance.State
    STATE_DRAINING: Instance.State
    STATE_FAILED: Instance.State
    STATE_LOST: Instance.State
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_LOAD_OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_TIME_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_QUEUE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    SATURATED_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    BUSY_SHARE_FIELD_NUMBER: _ClassVar[int]
    UNRESPONSIVE_TIME_FIELD_NUMBER: _ClassVar[int]
    id: str
    model_id: str
    tp: int
    pp: int
    gpu_ids: _containers.RepeatedScalarFieldContainer[str]
    load_output_tokens_per_s: float
    endpoint: str
    state: Instance.State
    node: str
    engine: str
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    create_time: _timestamp_pb2.Timestamp
    failure: _status_pb2.Status
    observed_load_output_tokens_per_s: float
    observed_time: _timestamp_pb2.Timestamp
    observed_queue: float
    observed_latency_s: float
    observed_slowdown: float
    saturated: bool
    max_slowdown: float
    busy_share: float
    unresponsive_time: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., model_id: _Optional[str] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., gpu_ids: _Optional[_Iterable[str]] = ..., load_output_tokens_per_s: _Optional[float] = ..., endpoint: _Optional[str] = ..., state: _Optional[_Union[Instance.State, str]] = ..., node: _Optional[str] = ..., engine: _Optional[str] = ..., task_ids: _Optional[_Iterable[str]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., failure: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., observed_load_output_tokens_per_s: _Optional[float] = ..., observed_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., observed_queue: _Optional[float] = ..., observed_latency_s: _Optional[float] = ..., observed_slowdown: _Optional[float] = ..., saturated: _Optional[bool] = ..., max_slowdown: _Optional[float] = ..., busy_share: _Optional[float] = ..., unresponsive_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Cluster(_message.Message):
    __slots__ = ("gpus", "instances")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ...) -> None: ...
