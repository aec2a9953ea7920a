"""Converters between the domain (flowmaker.domain) and the generated API (flowmaker.api): the only module seeing both.

Every domain type has a `<type>_to_proto` / `<type>_from_proto` pair, and `to_proto(obj)` /
`from_proto(msg)` dispatch on the type. `from_proto` applies the proto-side defaults that the
selection spec fixes (absent means the default, since proto3 cannot tell 0 from unset):

- `Stage.kind` UNSPECIFIED -> LLM; `Stage.calls_per_request` 0 -> 1;
- `SelectionOptions.utilization_cap` 0 -> 1.0; `allow_reuse` absent -> True (it is `optional bool`);
- `ModelArch.max_ctx` 0 -> 32768, `dtype_bytes` 0 -> 2; `Profile.source` UNSPECIFIED -> ANALYTIC;
- `SelectVariantRequest.strategy` "" -> "exact".

The JSON functions read and write the proto3 JSON mapping of SelectVariantRequest/-Response with
snake_case field names (the documented format of `flowmaker select`, see examples/README.md). The
reader also accepts the spec's plain enum spellings ("LLM" for "STAGE_KIND_LLM") and reports any
problem as InvalidSpec naming the field, e.g. `workflows[0].stages[1].input_tokens`.

The records the running suite keeps in etcd (tasks, instances, GPUs) and an invocation's result are
shown through `task_to_proto`, `instance_record_to_proto`, `gpu_record_to_proto`, `execution_to_proto`.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from google.protobuf import descriptor as _descriptor
from google.protobuf import json_format, timestamp_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2

from flowmaker.api.common.v1 import cluster_pb2, selection_pb2, task_pb2, workflow_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2
from flowmaker.api.selector.v1 import selector_pb2
from flowmaker.domain import (
    CapacityModel,
    Cluster,
    Gpu,
    GpuSharing,
    GpuType,
    Infeasibility,
    Instance,
    Model,
    ModelArch,
    NewInstance,
    Profile,
    ProfileSource,
    SelectionOptions,
    SelectionRequest,
    SelectionResult,
    Slo,
    Stage,
    StageAssignment,
    StageKind,
    TaskSpec,
    Variant,
    Workflow,
)
from flowmaker.errors import InvalidSpec
from flowmaker.orchestration.dag import Execution, StageResult
from flowmaker.orchestration.task import Failure, TaskRecord, TaskState
from flowmaker.sampling import Sampling
from flowmaker.state.records import GpuRecord, InstanceRecord, InstanceState

DEFAULT_STRATEGY = "exact"
_INT64_MAX = 2**63 - 1
_DEFAULT_MAX_CTX = 32768
_DEFAULT_DTYPE_BYTES = 2

_E = TypeVar("_E", bound=enum.Enum)
_M = TypeVar("_M", bound=Message)

# --------------------------------------------------------------------------- enums
# Domain enum values are the proto value names without the enum's prefix
# (StageKind.LLM <-> STAGE_KIND_LLM), so one pair of helpers serves every enum.


def _enum_prefix(enum_desc: _descriptor.EnumDescriptor) -> str:
    zero = enum_desc.values_by_number[0].name  # buf style: <PREFIX>UNSPECIFIED
    return zero[: -len("UNSPECIFIED")]


def _enum_to_proto(value: enum.Enum | None, enum_desc: _descriptor.EnumDescriptor) -> int:
    if value is None:
        return 0
    return int(enum_desc.values_by_name[_enum_prefix(enum_desc) + value.value].number)


def _enum_from_proto(number: int, enum_desc: _descriptor.EnumDescriptor, cls: type[_E], field: str) -> _E | None:
    """None for the zero (UNSPECIFIED) value; InvalidSpec for a number the domain does not know."""
    if number == 0:
        return None
    v = enum_desc.values_by_number.get(number)
    if v is None:
        raise InvalidSpec(f"unknown enum value {number}", field=field)
    return cls(v.name[len(_enum_prefix(enum_desc)):])


_STAGE_KIND = workflow_pb2.StageKind.DESCRIPTOR
_PROFILE_SOURCE = cluster_pb2.ProfileSource.DESCRIPTOR
_INFEASIBILITY = selection_pb2.Infeasibility.DESCRIPTOR
_CAPACITY_MODEL = selection_pb2.CapacityModel.DESCRIPTOR
_GPU_SHARING = selection_pb2.GpuSharing.DESCRIPTOR


def stage_kind_to_proto(kind: StageKind) -> workflow_pb2.StageKind:
    return cast(workflow_pb2.StageKind, _enum_to_proto(kind, _STAGE_KIND))


def stage_kind_from_proto(number: int, field: str = "kind") -> StageKind:
    return _enum_from_proto(number, _STAGE_KIND, StageKind, field) or StageKind.LLM


def profile_source_to_proto(source: ProfileSource) -> cluster_pb2.ProfileSource:
    return cast(cluster_pb2.ProfileSource, _enum_to_proto(source, _PROFILE_SOURCE))


def profile_source_from_proto(number: int, field: str = "source") -> ProfileSource:
    return _enum_from_proto(number, _PROFILE_SOURCE, ProfileSource, field) or ProfileSource.ANALYTIC


def infeasibility_to_proto(reason: Infeasibility | None) -> selection_pb2.Infeasibility:
    return cast(selection_pb2.Infeasibility, _enum_to_proto(reason, _INFEASIBILITY))


def infeasibility_from_proto(number: int) -> Infeasibility | None:
    return _enum_from_proto(number, _INFEASIBILITY, Infeasibility, "reason")


# --------------------------------------------------------------------------- workflow.proto


def stage_to_proto(s: Stage) -> workflow_pb2.Stage:
    return workflow_pb2.Stage(
        id=s.id, kind=stage_kind_to_proto(s.kind), depends_on=list(s.depends_on),
        input_tokens=s.input_tokens, output_tokens=s.output_tokens, calls_per_request=s.calls_per_request,
        latency_s=s.latency_s, role=s.role, prompt_template=s.prompt_template,
    )


def _p(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def stage_from_proto(m: workflow_pb2.Stage, path: str = "") -> Stage:
    """`path` (e.g. "workflows[0].stages[2]") prefixes the field named in any error."""
    return Stage(
        id=m.id, kind=stage_kind_from_proto(m.kind, _p(path, "kind")), depends_on=tuple(m.depends_on),
        input_tokens=m.input_tokens, output_tokens=m.output_tokens,
        calls_per_request=m.calls_per_request or 1,  # spec: default 1
        latency_s=m.latency_s, role=m.role, prompt_template=m.prompt_template,
    )


def workflow_to_proto(w: Workflow) -> workflow_pb2.Workflow:
    return workflow_pb2.Workflow(id=w.id, stages=[stage_to_proto(s) for s in w.stages],
                                 description=w.description, rationale=w.rationale)


def workflow_from_proto(m: workflow_pb2.Workflow, path: str = "") -> Workflow:
    return Workflow(id=m.id, stages=tuple(stage_from_proto(s, _p(path, f"stages[{i}]"))
                                          for i, s in enumerate(m.stages)),
                    description=m.description, rationale=m.rationale)


def slo_to_proto(s: Slo) -> workflow_pb2.Slo:
    return workflow_pb2.Slo(min_accuracy=s.min_accuracy, max_latency_s=s.max_latency_s,
                            arrival_rate_rps=s.arrival_rate_rps)


def slo_from_proto(m: workflow_pb2.Slo) -> Slo:
    return Slo(min_accuracy=m.min_accuracy, max_latency_s=m.max_latency_s, arrival_rate_rps=m.arrival_rate_rps)


def task_spec_to_proto(t: TaskSpec) -> workflow_pb2.TaskSpec:
    return workflow_pb2.TaskSpec(description=t.description, slo=slo_to_proto(t.slo), name=t.name,
                                 candidates=[workflow_to_proto(w) for w in t.candidates])


def task_spec_from_proto(m: workflow_pb2.TaskSpec) -> TaskSpec:
    return TaskSpec(description=m.description, slo=slo_from_proto(m.slo), name=m.name,
                    candidates=tuple(workflow_from_proto(w, f"candidates[{i}]") for i, w in enumerate(m.candidates)))


# --------------------------------------------------------------------------- cluster.proto


def model_arch_to_proto(a: ModelArch) -> cluster_pb2.ModelArch:
    return cluster_pb2.ModelArch(
        layers=a.layers, hidden=a.hidden, intermediate=a.intermediate, heads=a.heads, kv_heads=a.kv_heads,
        head_dim=a.head_dim, vocab=a.vocab, max_ctx=a.max_ctx, dtype_bytes=a.dtype_bytes,
        tie_word_embeddings=a.tie_word_embeddings, num_experts=a.num_experts, experts_per_tok=a.experts_per_tok,
    )


def model_arch_from_proto(m: cluster_pb2.ModelArch) -> ModelArch:
    return ModelArch(
        layers=m.layers, hidden=m.hidden, intermediate=m.intermediate, heads=m.heads, kv_heads=m.kv_heads,
        head_dim=m.head_dim, vocab=m.vocab, max_ctx=m.max_ctx or _DEFAULT_MAX_CTX,
        dtype_bytes=m.dtype_bytes or _DEFAULT_DTYPE_BYTES, tie_word_embeddings=m.tie_word_embeddings,
        num_experts=m.num_experts, experts_per_tok=m.experts_per_tok,
    )


def model_to_proto(x: Model) -> cluster_pb2.Model:
    m = cluster_pb2.Model(id=x.id, accuracy=x.accuracy, params_b=x.params_b, active_params_b=x.active_params_b,
                          hf_id=x.hf_id, family=x.family, source=x.source)
    if x.arch is not None:
        m.arch.CopyFrom(model_arch_to_proto(x.arch))
    return m


def model_from_proto(m: cluster_pb2.Model) -> Model:
    return Model(id=m.id, accuracy=m.accuracy, params_b=m.params_b, active_params_b=m.active_params_b,
                 arch=model_arch_from_proto(m.arch) if m.HasField("arch") else None,
                 hf_id=m.hf_id, family=m.family, source=m.source)


def gpu_type_to_proto(g: GpuType) -> cluster_pb2.GpuType:
    return cluster_pb2.GpuType(name=g.name, memory_gb=g.memory_gb, mem_bw_gbps=g.mem_bw_gbps,
                               bf16_tflops=g.bf16_tflops, interconnect_gbps=g.interconnect_gbps,
                               interconnect=g.interconnect, price_per_hour=g.price_per_hour, source=g.source)


def gpu_type_from_proto(m: cluster_pb2.GpuType) -> GpuType:
    return GpuType(name=m.name, memory_gb=m.memory_gb, mem_bw_gbps=m.mem_bw_gbps, bf16_tflops=m.bf16_tflops,
                   interconnect_gbps=m.interconnect_gbps, interconnect=m.interconnect,
                   price_per_hour=m.price_per_hour, source=m.source)


def profile_to_proto(p: Profile) -> cluster_pb2.Profile:
    return cluster_pb2.Profile(
        model_id=p.model_id, tp=p.tp, pp=p.pp, memory_gb_per_gpu=p.memory_gb_per_gpu, fixed_s=p.fixed_s,
        prefill_s_per_token=p.prefill_s_per_token, decode_s_per_token=p.decode_s_per_token,
        max_output_tokens_per_s=p.max_output_tokens_per_s, gpu_type=p.gpu_type,
        source=profile_source_to_proto(p.source), decode_tokens_per_s=p.decode_tokens_per_s,
    )


def profile_from_proto(m: cluster_pb2.Profile, path: str = "") -> Profile:
    return Profile(
        model_id=m.model_id, tp=m.tp, pp=m.pp, memory_gb_per_gpu=m.memory_gb_per_gpu, fixed_s=m.fixed_s,
        prefill_s_per_token=m.prefill_s_per_token, decode_s_per_token=m.decode_s_per_token,
        max_output_tokens_per_s=m.max_output_tokens_per_s, gpu_type=m.gpu_type,
        source=profile_source_from_proto(m.source, _p(path, "source")), decode_tokens_per_s=m.decode_tokens_per_s,
    )


def gpu_to_proto(g: Gpu) -> cluster_pb2.Gpu:
    return cluster_pb2.Gpu(id=g.id, node=g.node, memory_total_gb=g.memory_total_gb,
                           memory_used_gb=g.memory_used_gb, gpu_type=g.gpu_type)


def gpu_from_proto(m: cluster_pb2.Gpu) -> Gpu:
    return Gpu(id=m.id, node=m.node, memory_total_gb=m.memory_total_gb, memory_used_gb=m.memory_used_gb,
               gpu_type=m.gpu_type)


def instance_to_proto(i: Instance) -> cluster_pb2.Instance:
    """The domain Instance carries no lifecycle; the deployer fills state/node/engine itself."""
    return cluster_pb2.Instance(id=i.id, model_id=i.model_id, tp=i.tp, pp=i.pp, gpu_ids=list(i.gpu_ids),
                                load_output_tokens_per_s=i.load_output_tokens_per_s, endpoint=i.endpoint,
                                max_slowdown=i.max_slowdown, busy_share=i.busy_share)


def instance_from_proto(m: cluster_pb2.Instance) -> Instance:
    return Instance(id=m.id, model_id=m.model_id, tp=m.tp, pp=m.pp, gpu_ids=tuple(m.gpu_ids),
                    load_output_tokens_per_s=m.load_output_tokens_per_s, endpoint=m.endpoint,
                    max_slowdown=m.max_slowdown, busy_share=m.busy_share)


def cluster_to_proto(c: Cluster) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(gpus=[gpu_to_proto(g) for g in c.gpus],
                               instances=[instance_to_proto(i) for i in c.instances])


def cluster_from_proto(m: cluster_pb2.Cluster) -> Cluster:
    return Cluster(gpus=tuple(gpu_from_proto(g) for g in m.gpus),
                   instances=tuple(instance_from_proto(i) for i in m.instances))


# --------------------------------------------------------------------------- selection.proto


def selection_options_to_proto(o: SelectionOptions) -> selection_pb2.SelectionOptions:
    # allow_reuse is always written so that the JSON shows the effective value.
    return selection_pb2.SelectionOptions(utilization_cap=o.utilization_cap, allow_reuse=o.allow_reuse,
                                          time_budget_s=o.time_budget_s, max_trials=o.max_trials, seed=o.seed,
                                          max_replicas=o.max_replicas,
                                          capacity_model=cast(selection_pb2.CapacityModel,
                                                              _enum_to_proto(o.capacity_model, _CAPACITY_MODEL)),
                                          gpu_sharing=cast(selection_pb2.GpuSharing,
                                                           _enum_to_proto(o.gpu_sharing, _GPU_SHARING)),
                                          interference=o.interference, gpu_price_gb=o.gpu_price_gb)


def selection_options_from_proto(m: selection_pb2.SelectionOptions) -> SelectionOptions:
    return SelectionOptions(
        utilization_cap=m.utilization_cap or 1.0,  # spec: default 1
        allow_reuse=m.allow_reuse if m.HasField("allow_reuse") else True,  # spec: default true
        time_budget_s=m.time_budget_s, max_trials=m.max_trials, seed=m.seed,
        max_replicas=m.max_replicas or 1,  # 0 (absent) = the base contract
        capacity_model=_enum_from_proto(m.capacity_model, _CAPACITY_MODEL, CapacityModel, "options.capacity_model")
        or CapacityModel.OUTPUT_TOKENS,
        gpu_sharing=_enum_from_proto(m.gpu_sharing, _GPU_SHARING, GpuSharing, "options.gpu_sharing")
        or GpuSharing.IGNORE,
        interference=m.interference if m.HasField("interference") else 1.0,
        gpu_price_gb=m.gpu_price_gb if m.HasField("gpu_price_gb") else 0.0,  # absent = the base contract
    )


def new_instance_to_proto(n: NewInstance) -> selection_pb2.NewInstance:
    return selection_pb2.NewInstance(key=n.key, model_id=n.model_id, tp=n.tp, pp=n.pp, node=n.node,
                                     gpu_ids=list(n.gpu_ids), memory_gb_per_gpu=n.memory_gb_per_gpu,
                                     load_output_tokens_per_s=n.load_output_tokens_per_s)


def new_instance_from_proto(m: selection_pb2.NewInstance) -> NewInstance:
    return NewInstance(key=m.key, model_id=m.model_id, tp=m.tp, pp=m.pp, node=m.node, gpu_ids=tuple(m.gpu_ids),
                       memory_gb_per_gpu=m.memory_gb_per_gpu, load_output_tokens_per_s=m.load_output_tokens_per_s)


def stage_assignment_to_proto(a: StageAssignment) -> selection_pb2.StageAssignment:
    return selection_pb2.StageAssignment(
        stage_id=a.stage_id, model_id=a.model_id, tp=a.tp, pp=a.pp, reused=a.reused, instance_id=a.instance_id,
        new_key=a.new_key, gpu_ids=list(a.gpu_ids), latency_s=a.latency_s,
        load_output_tokens_per_s=a.load_output_tokens_per_s, replica_keys=list(a.replica_keys),
    )


def stage_assignment_from_proto(m: selection_pb2.StageAssignment) -> StageAssignment:
    return StageAssignment(
        stage_id=m.stage_id, model_id=m.model_id, tp=m.tp, pp=m.pp, reused=m.reused, instance_id=m.instance_id,
        new_key=m.new_key, gpu_ids=tuple(m.gpu_ids), latency_s=m.latency_s,
        load_output_tokens_per_s=m.load_output_tokens_per_s, replica_keys=tuple(m.replica_keys),
    )


def variant_to_proto(v: Variant) -> selection_pb2.Variant:
    return selection_pb2.Variant(
        workflow_id=v.workflow_id,
        assignments=[stage_assignment_to_proto(a) for a in v.assignments],
        new_instances=[new_instance_to_proto(n) for n in v.new_instances],
        reuse=[selection_pb2.ReusedInstance(instance_id=iid, load_output_tokens_per_s=load) for iid, load in v.reuse],
        latency_s=v.latency_s, accuracy=v.accuracy, cost=v.cost, new_memory_gb=v.new_memory_gb,
        new_gpus=v.new_gpus,
    )


def variant_from_proto(m: selection_pb2.Variant) -> Variant:
    return Variant(
        workflow_id=m.workflow_id,
        assignments=tuple(stage_assignment_from_proto(a) for a in m.assignments),
        new_instances=tuple(new_instance_from_proto(n) for n in m.new_instances),
        reuse=tuple((r.instance_id, r.load_output_tokens_per_s) for r in m.reuse),
        latency_s=m.latency_s, accuracy=m.accuracy, cost=m.cost, new_memory_gb=m.new_memory_gb,
        new_gpus=m.new_gpus,
    )


# --------------------------------------------------------------------------- selector.proto


def selection_request_to_proto(r: SelectionRequest, strategy: str = DEFAULT_STRATEGY
                               ) -> selector_pb2.SelectVariantRequest:
    return selector_pb2.SelectVariantRequest(
        slo=slo_to_proto(r.slo),
        workflows=[workflow_to_proto(w) for w in r.workflows],
        models=[model_to_proto(m) for m in r.models],
        profiles=[profile_to_proto(p) for p in r.profiles],
        cluster=cluster_to_proto(r.cluster),
        options=selection_options_to_proto(r.options),
        strategy=strategy,
    )


def select_variant_request_from_proto(m: selector_pb2.SelectVariantRequest) -> tuple[SelectionRequest, str]:
    """The domain request and the strategy name ("exact" when empty)."""
    if not m.HasField("slo"):
        raise InvalidSpec("is required", field="slo")
    req = SelectionRequest(
        slo=slo_from_proto(m.slo),
        workflows=tuple(workflow_from_proto(w, f"workflows[{i}]") for i, w in enumerate(m.workflows)),
        models=tuple(model_from_proto(x) for x in m.models),
        profiles=tuple(profile_from_proto(p, f"profiles[{i}]") for i, p in enumerate(m.profiles)),
        cluster=cluster_from_proto(m.cluster),
        options=selection_options_from_proto(m.options),
    )
    return req, m.strategy or DEFAULT_STRATEGY


def selection_request_from_proto(m: selector_pb2.SelectVariantRequest) -> SelectionRequest:
    return select_variant_request_from_proto(m)[0]


def selection_result_to_proto(r: SelectionResult) -> selector_pb2.SelectVariantResponse:
    m = selector_pb2.SelectVariantResponse(
        feasible=r.variant is not None, reason=infeasibility_to_proto(r.reason), reason_detail=r.reason_detail,
        strategy=r.strategy, variants_evaluated=min(r.variants_evaluated, _INT64_MAX),
        # The variant space can exceed int64 (it grows as profiles^stages); saturate rather than fail.
        search_space_size=min(r.search_space_size, _INT64_MAX),
        elapsed_s=r.elapsed_s, timed_out=r.timed_out, optimal=r.optimal, lower_bound=r.lower_bound,
    )
    if r.variant is not None:
        m.variant.CopyFrom(variant_to_proto(r.variant))
    return m


def selection_result_from_proto(m: selector_pb2.SelectVariantResponse) -> SelectionResult:
    has_variant = m.HasField("variant")
    if m.feasible != has_variant:
        raise InvalidSpec(f"feasible={m.feasible} but variant is {'set' if has_variant else 'absent'}",
                          field="variant")
    return SelectionResult(
        strategy=m.strategy, variant=variant_from_proto(m.variant) if has_variant else None,
        reason=infeasibility_from_proto(m.reason), reason_detail=m.reason_detail,
        variants_evaluated=m.variants_evaluated, search_space_size=m.search_space_size,
        elapsed_s=m.elapsed_s, timed_out=m.timed_out, optimal=m.optimal, lower_bound=m.lower_bound,
    )


# --------------------------------------------------------------------------- generic dispatch

_TO_PROTO: dict[type, Callable[[Any], Any]] = {
    Stage: stage_to_proto, Workflow: workflow_to_proto, Slo: slo_to_proto, TaskSpec: task_spec_to_proto,
    ModelArch: model_arch_to_proto, Model: model_to_proto, GpuType: gpu_type_to_proto, Profile: profile_to_proto,
    Gpu: gpu_to_proto, Instance: instance_to_proto, Cluster: cluster_to_proto,
    SelectionOptions: selection_options_to_proto, NewInstance: new_instance_to_proto,
    StageAssignment: stage_assignment_to_proto, Variant: variant_to_proto,
    SelectionRequest: selection_request_to_proto, SelectionResult: selection_result_to_proto,
    StageKind: stage_kind_to_proto, ProfileSource: profile_source_to_proto, Infeasibility: infeasibility_to_proto,
}

_FROM_PROTO: dict[str, Callable[[Any], Any]] = {
    "flowmaker.common.v1.Stage": stage_from_proto,
    "flowmaker.common.v1.Workflow": workflow_from_proto,
    "flowmaker.common.v1.Slo": slo_from_proto,
    "flowmaker.common.v1.TaskSpec": task_spec_from_proto,
    "flowmaker.common.v1.ModelArch": model_arch_from_proto,
    "flowmaker.common.v1.Model": model_from_proto,
    "flowmaker.common.v1.GpuType": gpu_type_from_proto,
    "flowmaker.common.v1.Profile": profile_from_proto,
    "flowmaker.common.v1.Gpu": gpu_from_proto,
    "flowmaker.common.v1.Instance": instance_from_proto,
    "flowmaker.common.v1.Cluster": cluster_from_proto,
    "flowmaker.common.v1.SelectionOptions": selection_options_from_proto,
    "flowmaker.common.v1.NewInstance": new_instance_from_proto,
    "flowmaker.common.v1.StageAssignment": stage_assignment_from_proto,
    "flowmaker.common.v1.Variant": variant_from_proto,
    "flowmaker.selector.v1.SelectVariantRequest": selection_request_from_proto,
    "flowmaker.selector.v1.SelectVariantResponse": selection_result_from_proto,
}


def to_proto(obj: Any) -> Any:
    """The message (or enum number) for any domain object; SelectionRequest gets strategy "exact"."""
    fn = _TO_PROTO.get(type(obj))
    if fn is None:
        raise TypeError(f"no protobuf form for {type(obj).__name__}")
    return fn(obj)


def from_proto(msg: Message) -> Any:
    """The domain object for any message `to_proto` produces (SelectVariantRequest -> SelectionRequest)."""
    fn = _FROM_PROTO.get(msg.DESCRIPTOR.full_name)
    if fn is None:
        raise TypeError(f"no domain form for {msg.DESCRIPTOR.full_name}")
    return fn(msg)


# --------------------------------------------------------------------------- JSON

_INT_RANGES = {
    _descriptor.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    _descriptor.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _descriptor.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _descriptor.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    _descriptor.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    _descriptor.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    _descriptor.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _descriptor.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _descriptor.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    _descriptor.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_TYPES = (_descriptor.FieldDescriptor.TYPE_DOUBLE, _descriptor.FieldDescriptor.TYPE_FLOAT)
_JSON_FLOAT_WORDS = ("NaN", "Infinity", "-Infinity")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _check_scalar(v: Any, fd: _descriptor.FieldDescriptor, path: str) -> Any:
    """Check one JSON scalar against a field; return it with plain enum names rewritten."""
    t = fd.type
    if t == _descriptor.FieldDescriptor.TYPE_ENUM:
        ed = fd.enum_type
        assert ed is not None  # TYPE_ENUM fields always have one
        if isinstance(v, str):
            if v in ed.values_by_name:
                return v
            full = _enum_prefix(ed) + v.upper()  # the spec's spelling: "LLM" -> "STAGE_KIND_LLM"
            if full in ed.values_by_name and v.upper() != "UNSPECIFIED":
                return full
        elif isinstance(v, int) and not isinstance(v, bool) and v in ed.values_by_number:
            return v
        allowed = [x.name[len(_enum_prefix(ed)):] for x in ed.values if x.number != 0]
        raise InvalidSpec(f"must be one of {allowed}, got {json.dumps(v)}", field=path)
    if t == _descriptor.FieldDescriptor.TYPE_BOOL:
        if not isinstance(v, bool):
            raise InvalidSpec(f"must be true or false, got {_type_name(v)}", field=path)
        return v
    if t in (_descriptor.FieldDescriptor.TYPE_STRING, _descriptor.FieldDescriptor.TYPE_BYTES):
        if not isinstance(v, str):
            raise InvalidSpec(f"must be a string, got {_type_name(v)}", field=path)
        return v
    if t in _FLOAT_TYPES:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise InvalidSpec(f"must be a number, got {_type_name(v)}", field=path)
        if isinstance(v, str) and v not in _JSON_FLOAT_WORDS:
            try:
                float(v)
            except ValueError:
                raise InvalidSpec(f"must be a number, got {json.dumps(v)}", field=path) from None
        return v
    if t in _INT_RANGES:
        n: int | None = None
        if isinstance(v, int) and not isinstance(v, bool):
            n = v
        elif isinstance(v, float) and math.isfinite(v) and v.is_integer():
            n = int(v)
        elif isinstance(v, str):  # proto3 JSON writes 64-bit integers as strings
            try:
                n = int(v)
            except ValueError:
                n = None
        if n is None:
            raise InvalidSpec(f"must be an integer, got {json.dumps(v)}", field=path)
        lo, hi = _INT_RANGES[t]
        if not lo <= n <= hi:
            raise InvalidSpec(f"integer {n} out of range [{lo}, {hi}]", field=path)
        return v
    return v  # pragma: no cover - no other scalar types in our protos


def _check_value(v: Any, fd: _descriptor.FieldDescriptor, path: str) -> Any:
    if fd.message_type is not None:
        if fd.message_type.full_name.startswith("google.protobuf."):
            return v  # well-known types have their own JSON forms; json_format checks them
        if not isinstance(v, dict):
            raise InvalidSpec(f"must be an object, got {_type_name(v)}", field=path)
        return _check_message(v, fd.message_type, path)
    return _check_scalar(v, fd, path)


def _check_message(obj: dict[str, Any], desc: _descriptor.Descriptor, path: str) -> dict[str, Any]:
    """Walk a JSON object against a message descriptor: unknown fields and wrong types become
    InvalidSpec naming the field; plain enum spellings are rewritten. json_format would catch most
    of these too, but its messages do not always carry the field path."""
    by_name: dict[str, _descriptor.FieldDescriptor] = {}
    for f in desc.fields:
        by_name[f.name] = f
        by_name[f.json_name] = f
    out: dict[str, Any] = {}
    for key, v in obj.items():
        fd = by_name.get(key)
        fpath = _join(path, key)
        if fd is None:
            known = ", ".join(f.name for f in desc.fields)
            raise InvalidSpec(f"unknown field {key!r}; known fields: {known}", field=fpath)
        if v is None:  # proto3 JSON: null means the default
            continue
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            if not isinstance(v, dict):
                raise InvalidSpec(f"must be an object, got {_type_name(v)}", field=fpath)
            vfd = fd.message_type.fields_by_name["value"]
            out[key] = {k: _check_value(x, vfd, f"{fpath}[{json.dumps(k)}]") for k, x in v.items()}
        elif fd.is_repeated:
            if not isinstance(v, list):
                raise InvalidSpec(f"must be an array, got {_type_name(v)}", field=fpath)
            out[key] = [_check_value(x, fd, f"{fpath}[{i}]") for i, x in enumerate(v)]
        else:
            out[key] = _check_value(v, fd, fpath)
    return out


def _parse_json(text: str | bytes, message: _M) -> _M:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidSpec(f"not valid JSON: {e}", field="(request)") from None
    if not isinstance(obj, dict):
        raise InvalidSpec(f"must be a JSON object, got {_type_name(obj)}", field="(request)")
    obj = _check_message(obj, cast(_descriptor.Descriptor, message.DESCRIPTOR), "")
    try:
        json_format.ParseDict(obj, message)
    except json_format.ParseError as e:  # what the walk above does not cover (e.g. bad timestamps)
        raise InvalidSpec(str(e), field="(request)") from None
    return message


def _in_field_order(obj: Any, desc: _descriptor.Descriptor) -> Any:
    """Reorder a MessageToDict result by field number (json_format puts set fields before defaults),
    so the JSON reads in the order of the .proto file."""
    if not isinstance(obj, dict):
        return obj
    out: dict[str, Any] = {}
    for f in desc.fields:
        if f.name not in obj:
            continue
        v = obj[f.name]
        sub = f.message_type
        if sub is not None and not sub.GetOptions().map_entry and not sub.full_name.startswith("google.protobuf."):
            v = [_in_field_order(x, sub) for x in v] if isinstance(v, list) else _in_field_order(v, sub)
        out[f.name] = v
    return out


def _to_json(msg: Message, *, print_defaults: bool) -> str:
    d = json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                  always_print_fields_with_no_presence=print_defaults)
    return json.dumps(_in_field_order(d, cast(_descriptor.Descriptor, msg.DESCRIPTOR)), indent=2) + "\n"


def select_variant_request_from_json(text: str | bytes, *, validate: bool = True) -> tuple[SelectionRequest, str]:
    """Parse a SelectVariant request (proto3 JSON, snake_case) into the domain request and strategy name.

    Applies the spec's defaults and, unless validate=False, SelectionRequest.validate(); every
    problem raises InvalidSpec naming the field.
    """
    msg = _parse_json(text, selector_pb2.SelectVariantRequest())
    req, strategy = select_variant_request_from_proto(msg)
    if validate:
        req.validate()
    return req, strategy


def selection_request_from_json(text: str | bytes, *, validate: bool = True) -> SelectionRequest:
    """Like select_variant_request_from_json, without the strategy name."""
    return select_variant_request_from_json(text, validate=validate)[0]


def selection_request_to_json(r: SelectionRequest, strategy: str = DEFAULT_STRATEGY) -> str:
    """The request as proto3 JSON with snake_case names (fields at their default omitted)."""
    return _to_json(selection_request_to_proto(r, strategy), print_defaults=False)


def selection_result_to_json(r: SelectionResult) -> str:
    """The SelectVariant response as proto3 JSON with snake_case names; every scalar field is printed
    (int64 counts are strings, as the proto3 JSON mapping requires); `variant` only when feasible."""
    return _to_json(selection_result_to_proto(r), print_defaults=True)


def selection_options_to_json(m: selection_pb2.SelectionOptions) -> str:
    """Approval options as stored in a task record (proto3 JSON), so a resumed selection uses them."""
    return json.dumps(json_format.MessageToDict(m, preserving_proto_field_name=True))


def selection_options_from_json(text: str) -> selection_pb2.SelectionOptions:
    return _parse_json(text, selection_pb2.SelectionOptions())


def selection_result_from_json(text: str | bytes) -> SelectionResult:
    """Parse a SelectVariant response written by selection_result_to_json (or the server)."""
    return selection_result_from_proto(_parse_json(text, selector_pb2.SelectVariantResponse()))


# ---- records of the running suite: tasks, instances, GPUs, invocations ---------------------------
# Output only: the services show these; nothing parses them back into records. `flowmaker.rpc.errors`
# is imported inside the functions: it loads grpc, which the offline users of this module never need.


def _timestamp(unix_s: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(unix_s * 1e9))
    return ts


_INSTANCE_STATES = {
    InstanceState.PENDING: cluster_pb2.Instance.STATE_PENDING,
    InstanceState.STARTING: cluster_pb2.Instance.STATE_STARTING,
    InstanceState.READY: cluster_pb2.Instance.STATE_READY,
    InstanceState.DRAINING: cluster_pb2.Instance.STATE_DRAINING,
    InstanceState.FAILED: cluster_pb2.Instance.STATE_FAILED,
    InstanceState.LOST: cluster_pb2.Instance.STATE_LOST,
}


def instance_record_to_proto(rec: InstanceRecord, task_ids: Sequence[str] = (), node_alive: bool = True
                             ) -> cluster_pb2.Instance:
    """An instance record as the API shows it. An instance whose node lost its lease is shown
    LOST (NODE_LOST) even though its record still says otherwise: nothing backs it any more."""
    from flowmaker.rpc.errors import DOMAIN

    state, reason, message = rec.state, rec.failure_reason, rec.reason
    if not node_alive and state not in (InstanceState.FAILED, InstanceState.LOST):
        state, reason, message = InstanceState.LOST, "NODE_LOST", f"node {rec.node} is not alive (lease expired)"
    m = cluster_pb2.Instance(
        id=rec.id, model_id=rec.model_id, tp=rec.tp, pp=rec.pp, gpu_ids=list(rec.gpu_ids),
        load_output_tokens_per_s=rec.load_output_tokens_per_s,
        # A LOST record keeps its endpoint for routing while the engine answers; the API shows none.
        endpoint=rec.endpoint if node_alive and state is not InstanceState.LOST else "",
        state=_INSTANCE_STATES[state], node=rec.node, engine=rec.engine, task_ids=list(task_ids))
    if rec.created_at:
        m.create_time.CopyFrom(_timestamp(rec.created_at))
    if rec.observed_load_at:
        m.observed_load_output_tokens_per_s = rec.observed_load_output_tokens_per_s
        m.observed_time.CopyFrom(_timestamp(rec.observed_load_at))
        m.observed_queue = rec.observed_queue
        m.observed_latency_s = rec.observed_latency_s
        m.observed_slowdown = rec.observed_slowdown
        m.saturated = rec.saturated
    if rec.unresponsive_since and state is InstanceState.READY:
        m.unresponsive_time.CopyFrom(_timestamp(rec.unresponsive_since))
    if state in (InstanceState.FAILED, InstanceState.LOST):
        # Not an error of any call: the instance's own status, so it is UNAVAILABLE with the reason.
        info = error_details_pb2.ErrorInfo(reason=reason or "FAILED", domain=DOMAIN, metadata={"instance_id": rec.id})
        st = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message)
        st.details.add().Pack(info)
        m.failure.CopyFrom(st)
    return m


def gpu_record_to_proto(g: GpuRecord) -> cluster_pb2.Gpu:
    return cluster_pb2.Gpu(id=g.id, node=g.node, memory_total_gb=g.memory_total_gb, memory_used_gb=g.memory_used_gb,
                           gpu_type=g.gpu_type)


def task_state_to_proto(s: TaskState) -> task_pb2.Task.State:
    return task_pb2.Task.State.Value("STATE_" + s.value)  # type: ignore[return-value]


def task_state_from_proto(n: int) -> TaskState | None:
    """None for STATE_UNSPECIFIED (e.g. "any state" in ListTasks)."""
    if n == 0:
        return None
    v = task_pb2.Task.State.DESCRIPTOR.values_by_number.get(n)
    if v is None:
        raise InvalidSpec(f"unknown enum value {n}", field="state", reason="INVALID_ENUM")
    return TaskState(v.name.removeprefix("STATE_"))


def failure_to_status_proto(f: Failure) -> status_pb2.Status:
    """A task's failure as the google.rpc.Status the error map would send for it."""
    from flowmaker.rpc.errors import to_status_proto

    return to_status_proto(f.to_error())


def task_to_proto(t: TaskRecord, *, etag: int = 0, state: TaskState | None = None,
                  failure: Failure | None = None, observed_rate_rps: float = 0.0, owner: str = "") -> task_pb2.Task:
    """The task as the API shows it; `state`/`failure` override the stored ones (derived DEGRADED). `owner` is
    the owner's stable id, kept beside the record (`keys.owner`), not in it."""
    st = state or t.state
    f = failure if state is not None else t.failure
    m = task_pb2.Task(
        id=t.id, name=t.name, description=t.description, slo=slo_to_proto(t.slo),
        candidates=[workflow_to_proto(w) for w in t.candidates],
        approved_workflow_ids=list(t.approved_workflow_ids), strategy=t.strategy,
        stage_instances=dict(t.stage_instances), predicted_latency_s=t.predicted_latency_s,
        observed_latency_p50_s=t.observed_p(0.5), observed_latency_p95_s=t.observed_p(0.95),
        requests_served=t.requests_served, state=task_state_to_proto(st), etag=str(etag) if etag else "",
        owner=owner)
    if t.variant is not None:
        m.variant.CopyFrom(variant_to_proto(t.variant))
    if f is not None:
        m.failure.CopyFrom(failure_to_status_proto(f))
    if t.create_time:
        m.create_time.CopyFrom(_timestamp(t.create_time))
    if t.update_time:
        m.update_time.CopyFrom(_timestamp(t.update_time))
    m.observed_arrival_rate_rps = observed_rate_rps
    if t.last_reselection is not None:
        r = t.last_reselection
        m.last_reselection.CopyFrom(task_pb2.Reselection(time=_timestamp(r.at), reason=r.reason,
                                                         planned_arrival_rate_rps=r.rate_rps, outcome=r.outcome))
    m.next_stage_instances.update(t.next_stage_instances)
    m.predicted_stage_latency_s.update(t.predicted_stage_latency_s)
    if t.predicted_at:
        m.predict_time.CopyFrom(_timestamp(t.predicted_at))
    if t.healing is not None:
        h = t.healing
        m.healing.CopyFrom(task_pb2.Healing(action=h.action, detail=h.detail, since_time=_timestamp(h.since),
                                            attempts=h.attempts))
        if h.next_attempt_at:
            m.healing.next_attempt_time.CopyFrom(_timestamp(h.next_attempt_at))
    return m


def stage_result_to_proto(r: StageResult) -> orchestrator_pb2.StageOutput:
    return orchestrator_pb2.StageOutput(stage_id=r.stage_id, instance_id=r.instance_id, model_id=r.model_id,
                                        output=r.output, input_tokens=r.input_tokens, output_tokens=r.output_tokens,
                                        start_s=r.start_s, latency_s=r.latency_s, finish_reason=r.finish_reason)


def execution_to_proto(ex: Execution, request_id: str) -> orchestrator_pb2.InvokeResponse:
    return orchestrator_pb2.InvokeResponse(output=ex.output, latency_s=ex.latency_s,
                                           stages=[stage_result_to_proto(s) for s in ex.stages], request_id=request_id)


def sampling_from_proto(m: orchestrator_pb2.Sampling, prefix: str = "sampling.") -> Sampling | None:
    """InvokeRequest.sampling as the domain's, checked (InvalidSpec naming e.g. "sampling.temperature"); None
    when nothing is set."""
    s = Sampling(**{f: getattr(m, f) for f in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                                               "seed") if m.HasField(f)}, stop=tuple(m.stop))
    return s.check(prefix) if s.is_set else None


def sampling_to_proto(s: Sampling | None) -> orchestrator_pb2.Sampling:
    return orchestrator_pb2.Sampling(**s.body()) if s is not None else orchestrator_pb2.Sampling()


# ---- live users (services/orchestrator/users.py): output only, never a token ----------------------


def user_to_proto(user: Any, *, now: float) -> orchestrator_pb2.User:
    """A `users.UserInfo` (duck-typed: convert does not import the services) with its tokens' ids and expiry."""
    out = orchestrator_pb2.User(id=user.id, name=user.name, admin=user.admin, create_time=_timestamp(user.create_time))
    for t in user.tokens:
        tok = out.tokens.add(id=t.id, create_time=_timestamp(t.create_time), expired=t.expired(now))
        if t.expire_time > 0:
            tok.expire_time.CopyFrom(_timestamp(t.expire_time))
    return out


def duration_s_from_proto(d: Any, field: str) -> float:
    """Seconds of an optional google.protobuf.Duration (unset = 0); negative: INVALID_ARGUMENT naming `field`."""
    s = float(d.seconds) + d.nanos / 1e9
    if s < 0:
        raise InvalidSpec(f"{field} must not be negative, got {s} s", field=field)
    return s
