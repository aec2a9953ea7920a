from flowmaker.api.common.v1 import workflow_pb2 as _workflow_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateWorkflowsRequest(_message.Message):
    __slots__ = ("description", "slo", "max_workflows", "sample_inputs")
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKFLOWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INPUTS_FIELD_NUMBER: _ClassVar[int]
    description: str
    slo: _workflow_pb2.Slo
    max_workflows: int
    sample_inputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, description: _Optional[str] = ..., slo: _Optional[_Union[_workflow_pb2.Slo, _Mapping]] = ..., max_workflows: _Optional[int] = ..., sample_inputs: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateWorkflowsResponse(_message.Message):
    __slots__ = ("workflows",)
    WORKFLOWS_FIELD_NUMBER: _ClassVar[int]
    workflows: _containers.RepeatedCompositeFieldContainer[_workflow_pb2.Workflow]
    def __init__(self, workflows: _Optional[_Iterable[_Union[_workflow_pb2.Workflow, _Mapping]]] = ...) -> None: ...
