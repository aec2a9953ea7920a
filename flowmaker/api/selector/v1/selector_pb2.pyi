from flowmaker.api.common.v1 import cluster_pb2 as _cluster_pb2
from flowmaker.api.common.v1 import selection_pb2 as _selection_pb2
from flowmaker.api.common.v1 import workflow_pb2 as _workflow_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectVariantRequest(_message.Message):
    __slots__ = ("slo", "workflows", "models", "profiles", "cluster", "options", "strategy")
    SLO_FIELD_NUMBER: _ClassVar[int]
    WORKFLOWS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    slo: _workflow_pb2.Slo
    workflows: _containers.RepeatedCompositeFieldContainer[_workflow_pb2.Workflow]
    models: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.Model]
    profiles: _containers.RepeatedCompositeFieldContainer[_cluster_pb2.Profile]
    cluster: _cluster_pb2.Cluster
    options: _selection_pb2.SelectionOptions
    strategy: str
    def __init__(self, slo: _Optional[_Union[_workflow_pb2.Slo, _Mapping]] = ..., workflows: _Optional[_Iterable[_Union[_workflow_pb2.Workflow, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[_cluster_pb2.Model, _Mapping]]] = ..., profiles: _Optional[_Iterable[_Union[_cluster_pb2.Profile, _Mapping]]] = ..., cluster: _Optional[_Union[_cluster_pb2.Cluster, _Mapping]] = ..., options: _Optional[_Union[_selection_pb2.SelectionOptions, _Mapping]] = ..., strategy: _Optional[str] = ...) -> None: ...

class SelectVariantResponse(_message.Message):
    __slots__ = ("feasible", "variant", "reason", "reason_detail", "strategy", "variants_evaluated", "search_space_size", "elapsed_s", "timed_out", "optimal", "lower_bound")
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REASON_DETAIL_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_EVALUATED_FIELD_NUMBER: _ClassVar[int]
    SEARCH_SPACE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    OPTIMAL_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_FIELD_NUMBER: _ClassVar[int]
    feasible: bool
    variant: _selection_pb2.Variant
    reason: _selection_pb2.Infeasibility
    reason_detail: str
    strategy: str
    variants_evaluated: int
    search_space_size: int
    elapsed_s: float
    timed_out: bool
    optimal: bool
    lower_bound: float
    def __init__(self, feasible: _Optional[bool] = ..., variant: _Optional[_Union[_selection_pb2.Variant, _Mapping]] = ..., reason: _Optional[_Union[_selection_pb2.Infeasibility, str]] = ..., reason_detail: _Optional[str] = ..., strategy: _Optional[str] = ..., variants_evaluated: _Optional[int] = ..., search_space_size: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., timed_out: _Optional[bool] = ..., optimal: _Optional[bool] = ..., lower_bound: _Optional[float] = ...) -> None: ...
