from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_KIND_UNSPECIFIED: _ClassVar[StageKind]
    STAGE_KIND_LLM: _ClassVar[StageKind]
    STAGE_KIND_TOOL: _ClassVar[StageKind]
STAGE_KIND_UNSPECIFIED: StageKind
STAGE_KIND_LLM: StageKind
STAGE_KIND_TOOL: StageKind

class Stage(_message.Message):
    __slots__ = ("id", "kind", "depends_on", "input_tokens", "output_tokens", "calls_per_request", "latency_s", "role", "prompt_template")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEPENDS_ON_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CALLS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: StageKind
    depends_on: _containers.RepeatedScalarFieldContainer[str]
    input_tokens: int
    output_tokens: int
    calls_per_request: int
    latency_s: float
    role: str
    prompt_template: str
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[_Union[StageKind, str]] = ..., depends_on: _Optional[_Iterable[str]] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., calls_per_request: _Optional[int] = ..., latency_s: _Optional[float] = ..., role: _Optional[str] = ..., prompt_template: _Optional[str] = ...) -> None: ...

class Workflow(_message.Message):
    __slots__ = ("id", "stages", "description", "rationale")
    ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    RATIONALE_FIELD_NUMBER: _ClassVar[int]
    id: str
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    description: str
    rationale: str
    def __init__(self, id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ..., description: _Optional[str] = ..., rationale: _Optional[str] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("min_accuracy", "max_latency_s", "arrival_rate_rps")
    MIN_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    MAX_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_RPS_FIELD_NUMBER: _ClassVar[int]
    min_accuracy: float
    max_latency_s: float
    arrival_rate_rps: float
    def __init__(self, min_accuracy: _Optional[float] = ..., max_latency_s: _Optional[float] = ..., arrival_rate_rps: _Optional[float] = ...) -> None: ...

class TaskSpec(_message.Message):
    __slots__ = ("description", "slo", "name", "candidates")
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    description: str
    slo: Slo
    name: str
    candidates: _containers.RepeatedCompositeFieldContainer[Workflow]
    def __init__(self, description: _Optional[str] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., name: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[Workflow, _Mapping]]] = ...) -> None: ...
