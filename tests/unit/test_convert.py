"""Domain <-> protobuf <-> JSON conversion: round trips, spec defaults, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import timestamp_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmaker import convert
from flowmaker.api.common.v1 import selection_pb2, workflow_pb2
from flowmaker.api.selector.v1 import selector_pb2
from flowmaker.domain import (
    Cluster,
    Gpu,
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

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "select_request.json"

# ----------------------------------------------------------------------------- strategies
# Strings must be valid UTF-8 for protobuf (no lone surrogates); floats finite so that == holds.
text = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
ids = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12)
floats = st.floats(allow_nan=False, allow_infinity=False)
nonzero = floats.filter(lambda x: x != 0)  # proto3 cannot tell 0 from absent: 0 means "default"
i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
pos32 = st.integers(min_value=1, max_value=2**31 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
u63 = st.integers(min_value=0, max_value=2**63 - 1)
str_tuples = st.lists(text, max_size=3).map(tuple)

stages = st.builds(Stage, id=ids, kind=st.sampled_from(StageKind), depends_on=str_tuples, input_tokens=i32,
                   output_tokens=i32, calls_per_request=pos32, latency_s=floats, role=text, prompt_template=text)
workflows = st.builds(Workflow, id=ids, stages=st.lists(stages, max_size=3).map(tuple), description=text,
                      rationale=text)
slos = st.builds(Slo, min_accuracy=floats, max_latency_s=floats, arrival_rate_rps=floats)
task_specs = st.builds(TaskSpec, description=text, slo=slos, name=text,
                       candidates=st.lists(workflows, max_size=2).map(tuple))
archs = st.builds(ModelArch, layers=i32, hidden=i32, intermediate=i32, heads=i32, kv_heads=i32, head_dim=i32,
                  vocab=i32, max_ctx=pos32, dtype_bytes=pos32, tie_word_embeddings=st.booleans(),
                  num_experts=i32, experts_per_tok=i32)
models = st.builds(Model, id=ids, accuracy=floats, params_b=floats, active_params_b=floats,
                   arch=st.none() | archs, hf_id=text, family=text, source=text)
gpu_types = st.builds(GpuType, name=text, memory_gb=floats, mem_bw_gbps=floats, bf16_tflops=floats,
                      interconnect_gbps=floats, interconnect=text, price_per_hour=floats, source=text)
profiles = st.builds(Profile, model_id=text, tp=i32, pp=i32, memory_gb_per_gpu=floats, fixed_s=floats,
                     prefill_s_per_token=floats, decode_s_per_token=floats, max_output_tokens_per_s=floats,
                     gpu_type=text, source=st.sampled_from(ProfileSource))
gpus = st.builds(Gpu, id=ids, node=text, memory_total_gb=floats, memory_used_gb=floats, gpu_type=text)
instances = st.builds(Instance, id=ids, model_id=text, tp=i32, pp=i32, gpu_ids=str_tuples,
                      load_output_tokens_per_s=floats, endpoint=text)
clusters = st.builds(Cluster, gpus=st.lists(gpus, max_size=3).map(tuple),
                     instances=st.lists(instances, max_size=3).map(tuple))
options = st.builds(SelectionOptions, utilization_cap=nonzero, allow_reuse=st.booleans(), time_budget_s=floats,
                    max_trials=i32, seed=i64)
requests = st.builds(SelectionRequest, slo=slos, workflows=st.lists(workflows, max_size=2).map(tuple),
                     models=st.lists(models, max_size=2).map(tuple), profiles=st.lists(profiles, max_size=2).map(tuple),
                     cluster=clusters, options=options)
new_instances = st.builds(NewInstance, key=text, model_id=text, tp=i32, pp=i32, node=text, gpu_ids=str_tuples,
                          memory_gb_per_gpu=floats, load_output_tokens_per_s=floats)
assignments = st.builds(StageAssignment, stage_id=text, model_id=text, tp=i32, pp=i32, reused=st.booleans(),
                        instance_id=text, new_key=text, gpu_ids=str_tuples, latency_s=floats,
                        load_output_tokens_per_s=floats)
variants = st.builds(Variant, workflow_id=text, assignments=st.lists(assignments, max_size=3).map(tuple),
                     new_instances=st.lists(new_instances, max_size=3).map(tuple),
                     reuse=st.lists(st.tuples(text, floats), max_size=3).map(tuple), latency_s=floats,
                     accuracy=floats, cost=floats, new_memory_gb=floats, new_gpus=i32)
results = st.builds(SelectionResult, strategy=text, variant=st.none() | variants,
                    reason=st.none() | st.sampled_from(Infeasibility), reason_detail=text, variants_evaluated=u63,
                    search_space_size=u63, elapsed_s=floats, timed_out=st.booleans())

ALL = [stages, workflows, slos, task_specs, archs, models, gpu_types, profiles, gpus, instances, clusters, options,
       new_instances, assignments, variants, results, requests]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("strategy", ALL, ids=lambda s: repr(s)[:40])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_domain_proto_domain_round_trip(strategy: st.SearchStrategy[Any], data: st.DataObject) -> None:
    obj = data.draw(strategy)
    msg = convert.to_proto(obj)
    # Through the wire format too: what a gRPC peer receives must convert back identically.
    wire = type(msg).FromString(msg.SerializeToString())
    assert convert.from_proto(wire) == obj


@pytest.mark.parametrize("enum_cls", [StageKind, ProfileSource, Infeasibility])
def test_every_domain_enum_value_has_a_proto_value(enum_cls: Any) -> None:
    conv: Any = {StageKind: (convert.stage_kind_to_proto, convert.stage_kind_from_proto),
            ProfileSource: (convert.profile_source_to_proto, convert.profile_source_from_proto),
            Infeasibility: (convert.infeasibility_to_proto, convert.infeasibility_from_proto)}[enum_cls]
    for member in enum_cls:
        number = conv[0](member)
        assert number != 0, f"{member} maps to UNSPECIFIED"
        assert conv[1](number) is member


@settings(max_examples=30, deadline=None)
@given(r=requests, strategy=ids)
def test_request_json_round_trip(r: SelectionRequest, strategy: str) -> None:
    text_ = convert.selection_request_to_json(r, strategy)
    assert convert.select_variant_request_from_json(text_, validate=False) == (r, strategy)


@settings(max_examples=30, deadline=None)
@given(r=results)
def test_result_json_round_trip(r: SelectionResult) -> None:
    text_ = convert.selection_result_to_json(r)
    assert convert.selection_result_from_json(text_) == r
    d = json.loads(text_)
    assert d["feasible"] is (r.variant is not None)
    assert ("variant" in d) is (r.variant is not None)


def test_to_proto_rejects_non_domain_objects() -> None:
    with pytest.raises(TypeError):
        convert.to_proto(object())
    with pytest.raises(TypeError):
        convert.from_proto(timestamp_pb2.Timestamp())


# ----------------------------------------------------------------------------- the example and the spec defaults


def test_example_request_parses_into_the_documented_contents() -> None:
    req, strategy = convert.select_variant_request_from_json(EXAMPLE.read_text())
    assert strategy == "exact"
    assert req.slo == Slo(min_accuracy=0.30, max_latency_s=5.0, arrival_rate_rps=2.0)
    assert [w.id for w in req.workflows] == ["wf-direct", "wf-rag"]
    rag = req.workflows[1]
    assert [s.kind for s in rag.stages] == [StageKind.TOOL, StageKind.LLM]
    assert rag.stages[1].depends_on == ("retrieve",)
    assert rag.stages[0].latency_s == 0.15
    assert len(req.models) == 3 and len(req.profiles) == 5
    assert {p.model_id for p in req.profiles} == {m.id for m in req.models}
    assert len(req.cluster.gpus) == 8 and all(g.memory_total_gb == 48 for g in req.cluster.gpus)
    (inst,) = req.cluster.instances
    assert inst.gpu_ids == ("gpu-0",) and inst.load_output_tokens_per_s == 300
    assert req.options == SelectionOptions(utilization_cap=0.9, allow_reuse=True)


def _minimal(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "slo": {"min_accuracy": 0.3, "max_latency_s": 5},
        "workflows": [{"id": "w", "stages": [{"id": "a", "input_tokens": 10, "output_tokens": 5}]}],
        "models": [{"id": "m", "accuracy": 0.5, "params_b": 1, "active_params_b": 1}],
    }
    d.update(over)
    return d


def test_absent_fields_take_the_spec_defaults() -> None:
    req, strategy = convert.select_variant_request_from_json(json.dumps(_minimal()))
    assert strategy == "exact"
    stage = req.workflows[0].stages[0]
    assert stage.kind is StageKind.LLM and stage.calls_per_request == 1
    assert req.options.utilization_cap == 1.0 and req.options.allow_reuse is True
    assert req.slo.arrival_rate_rps == 0.0 and req.cluster == Cluster()
    # An options object present but without allow_reuse still means true; explicit false is kept.
    req, _ = convert.select_variant_request_from_json(json.dumps(_minimal(options={"utilization_cap": 0.5})))
    assert req.options.allow_reuse is True and req.options.utilization_cap == 0.5
    req, _ = convert.select_variant_request_from_json(json.dumps(_minimal(options={"allow_reuse": False})))
    assert req.options.allow_reuse is False and req.options.utilization_cap == 1.0


@pytest.mark.parametrize("spelling, kind", [("LLM", StageKind.LLM), ("TOOL", StageKind.TOOL),
                                            ("tool", StageKind.TOOL), ("STAGE_KIND_TOOL", StageKind.TOOL),
                                            (2, StageKind.TOOL)])
def test_stage_kind_accepts_plain_and_proto_spellings(spelling: Any, kind: StageKind) -> None:
    stage = {"id": "a", "kind": spelling, "input_tokens": 10, "output_tokens": 5, "latency_s": 0.1}
    d = _minimal(workflows=[{"id": "w", "stages": [stage, {"id": "b", "input_tokens": 1, "output_tokens": 1}]}])
    req = convert.selection_request_from_json(json.dumps(d))
    assert req.workflows[0].stages[0].kind is kind


def test_camel_case_names_are_accepted_too() -> None:
    # proto3 JSON parsers accept lowerCamelCase; ours must not reject what other clients write.
    d = _minimal(slo={"minAccuracy": 0.25, "maxLatencyS": 2})
    assert convert.selection_request_from_json(json.dumps(d)).slo == Slo(0.25, 2.0)


def test_gpu_price_round_trips_and_absent_is_the_base_contract() -> None:
    req, _ = convert.select_variant_request_from_json(json.dumps(_minimal(options={"gpu_price_gb": 48})))
    assert req.options.gpu_price_gb == 48.0
    assert convert.selection_options_from_proto(convert.selection_options_to_proto(req.options)) == req.options
    req, _ = convert.select_variant_request_from_json(json.dumps(_minimal()))
    assert req.options.gpu_price_gb == 0.0
    assert not convert.selection_options_from_json("{}").HasField("gpu_price_gb")  # absent: the caller's default
    assert convert.selection_options_from_json('{"gpu_price_gb": 0}').HasField("gpu_price_gb")  # explicit 0 kept


def test_null_means_default() -> None:
    d = _minimal(options=None, cluster={"gpus": None})
    req = convert.selection_request_from_json(json.dumps(d))
    assert req.options == SelectionOptions() and req.cluster == Cluster()


# ----------------------------------------------------------------------------- errors name the field


@pytest.mark.parametrize("doc, field, words", [
    (_minimal(bogus=1), "bogus", "unknown field"),
    (_minimal(slo={"min_accuracy": 0.3, "max_latency": 5}), "slo.max_latency", "unknown field"),
    (_minimal(workflows=[{"id": "w", "stages": [{"id": "a", "input_tokens": 1, "output_tokens": 1, "tokens": 3}]}]),
     "workflows[0].stages[0].tokens", "unknown field"),
    (_minimal(workflows=[{"id": "w", "stages": [{"id": "a", "input_tokens": "abc", "output_tokens": 1}]}]),
     "workflows[0].stages[0].input_tokens", "integer"),
    (_minimal(workflows=[{"id": "w", "stages": [{"id": "a", "input_tokens": 1.5, "output_tokens": 1}]}]),
     "workflows[0].stages[0].input_tokens", "integer"),
    (_minimal(workflows=[{"id": "w", "stages": [{"id": "a", "input_tokens": 2**40, "output_tokens": 1}]}]),
     "workflows[0].stages[0].input_tokens", "out of range"),
    (_minimal(workflows=[{"id": "w", "stages": [{"id": "a", "kind": "GPU", "input_tokens": 1, "output_tokens": 1}]}]),
     "workflows[0].stages[0].kind", "one of ['LLM', 'TOOL']"),
    (_minimal(workflows=[{"id": "w", "stages": [{"id": "a", "kind": "UNSPECIFIED"}]}]),
     "workflows[0].stages[0].kind", "one of"),
    (_minimal(slo=5), "slo", "must be an object"),
    (_minimal(slo={"min_accuracy": "high", "max_latency_s": 1}), "slo.min_accuracy", "must be a number"),
    (_minimal(slo={"min_accuracy": True, "max_latency_s": 1}), "slo.min_accuracy", "must be a number"),
    (_minimal(workflows={}), "workflows", "must be an array"),
    (_minimal(workflows=[{"id": 7, "stages": []}]), "workflows[0].id", "must be a string"),
    (_minimal(options={"allow_reuse": "yes"}), "options.allow_reuse", "true or false"),
    (_minimal(cluster={"instances": [{"id": "i", "gpu_ids": "gpu-0"}]}), "cluster.instances[0].gpu_ids",
     "must be an array"),
    (_minimal(strategy=3), "strategy", "must be a string"),
    # Well-formed JSON that the domain rejects: SelectionRequest.validate() names the field.
    (_minimal(workflows=[{"id": "w", "stages": [{"id": "a", "input_tokens": 0, "output_tokens": 1}]}]),
     "workflows[0].stages[0].input_tokens", "must be > 0"),
    (_minimal(slo={"min_accuracy": 30, "max_latency_s": 5}), "slo.min_accuracy", "fraction"),
    (_minimal(options={"gpu_price_gb": -1}), "options.gpu_price_gb", "must be within [0, 10000] GB"),
    (_minimal(options={"gpu_price_gb": 1e5}), "options.gpu_price_gb", "must be within [0, 10000] GB"),
    (_minimal(options={"gpu_price_gb": "NaN"}), "options.gpu_price_gb", "must be within [0, 10000] GB"),
])
def test_bad_request_json_names_the_field(doc: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(InvalidSpec) as ei:
        convert.selection_request_from_json(json.dumps(doc))
    assert ei.value.field == field
    assert words in ei.value.message
    assert field in str(ei.value)


@pytest.mark.parametrize("text_, words", [("{\"slo\": ", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
                                          ("", "not valid JSON")])
def test_malformed_json_is_invalid_spec(text_: str, words: str) -> None:
    with pytest.raises(InvalidSpec) as ei:
        convert.selection_request_from_json(text_)
    assert words in ei.value.message
    assert ei.value.field == "(request)"


def test_missing_slo_is_named() -> None:
    with pytest.raises(InvalidSpec) as ei:
        convert.selection_request_from_json(json.dumps({"workflows": []}))
    assert ei.value.field == "slo"


def test_result_with_inconsistent_feasible_flag_is_rejected() -> None:
    msg = selector_pb2.SelectVariantResponse(feasible=True)
    with pytest.raises(InvalidSpec) as ei:
        convert.selection_result_from_proto(msg)
    assert ei.value.field == "variant"


def test_unknown_enum_number_from_a_newer_peer_is_invalid_spec() -> None:
    # Proto3 enums are open: a newer server may send a number this build does not know.
    msg = workflow_pb2.Stage(id="a")
    msg.kind = 99  # type: ignore[assignment]
    with pytest.raises(InvalidSpec) as ei:
        convert.stage_from_proto(msg)
    assert ei.value.field == "kind"


def test_search_space_beyond_int64_saturates() -> None:
    r = SelectionResult(strategy="exhaustive", variant=None, reason=Infeasibility.NO_LATENCY,
                        search_space_size=10**30)
    assert convert.selection_result_to_proto(r).search_space_size == 2**63 - 1


def test_result_json_uses_spec_field_names() -> None:
    v = Variant(workflow_id="w", assignments=(StageAssignment("a", "m", 1, 1, reused=True, instance_id="i"),),
                new_instances=(), reuse=(("i", 10.0),), latency_s=1.0, accuracy=0.5, cost=0.0, new_memory_gb=0.0,
                new_gpus=0)
    d = json.loads(convert.selection_result_to_json(SelectionResult("exact", v, variants_evaluated=3)))
    assert list(d) == ["feasible", "variant", "reason", "reason_detail", "strategy", "variants_evaluated",
                       "search_space_size", "elapsed_s", "timed_out", "optimal", "lower_bound"]
    assert list(d["variant"]) == ["workflow_id", "assignments", "new_instances", "reuse", "latency_s", "accuracy",
                                  "cost", "new_memory_gb", "new_gpus"]
    assert d["variant"]["reuse"] == [{"instance_id": "i", "load_output_tokens_per_s": 10.0}]
    assert d["variants_evaluated"] == "3"  # proto3 JSON: int64 as a string
    assert d["reason"] == "INFEASIBILITY_UNSPECIFIED"
    assert selection_pb2.Infeasibility.Name(0) == d["reason"]


def _readme_json_blocks() -> list[str]:
    text_ = (EXAMPLE.parent / "README.md").read_text()
    return [b.split("```", 1)[0] for b in text_.split("```json\n")[1:]]


def test_readme_responses_parse_and_match_the_example_numbers() -> None:
    """The documented response shapes are valid responses, and their numbers follow from the example."""
    req = convert.selection_request_from_json(EXAMPLE.read_text())
    blocks = [convert.selection_result_from_json(b) for b in _readme_json_blocks()]
    reuse, fresh, infeasible = blocks
    assert infeasible.variant is None and infeasible.reason is Infeasibility.NO_LATENCY
    rag = next(w for w in req.workflows if w.id == "wf-rag")
    tool_s = rag.stage("retrieve").latency_s
    answer = rag.stage("answer")
    profiles = {p.key: p for p in req.profiles}
    for res, key in ((reuse, ("Qwen2.5-7B-Instruct", 1, 1)), (fresh, ("Qwen2.5-7B-Instruct", 2, 1))):
        assert res.variant is not None
        (a,) = res.variant.assignments
        p = profiles[key]
        assert a.latency_s == pytest.approx(p.call_latency_s(answer.input_tokens, answer.output_tokens))
        assert res.variant.latency_s == pytest.approx(a.latency_s + tool_s)
        assert a.load_output_tokens_per_s == pytest.approx(req.slo.arrival_rate_rps * answer.output_tokens)
        assert res.variant.cost == pytest.approx(res.variant.new_memory_gb * res.variant.latency_s)
    assert fresh.variant is not None and fresh.variant.new_memory_gb == profiles[("Qwen2.5-7B-Instruct", 2, 1)].total_memory_gb
