"""Unit tests of the generator's JSON contract (flowmaker.generator.schema): schema, parsing, duplicates."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from flowmaker.domain import Workflow
from flowmaker.errors import InvalidSpec
from flowmaker.generator import families
from flowmaker.generator.llm import system_prompt
from flowmaker.generator.schema import (
    candidates_schema,
    parse_answer,
    structure_key,
    workflow_from_json,
    workflow_to_json,
)

ALL = [w for f in families() for w in f.candidates]


def test_schema_is_valid_and_accepts_every_template() -> None:
    schema = candidates_schema(3)
    jsonschema.Draft202012Validator.check_schema(schema)
    for w in ALL:
        jsonschema.validate({"candidates": [workflow_to_json(w)]}, schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema forbids what the parser rejects
        jsonschema.validate({"candidates": [workflow_to_json(ALL[0]) | {"extra": 1}]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"candidates": [workflow_to_json(w) for w in ALL[:4]]}, schema)


@pytest.mark.parametrize("wf", ALL, ids=lambda w: w.id)
def test_round_trip(wf: Workflow) -> None:
    back = workflow_from_json(json.loads(json.dumps(workflow_to_json(wf))), "c")
    assert back == dataclasses.replace(wf, description="")


def test_prompt_example_is_a_valid_answer() -> None:
    text = system_prompt(3)
    example = text.split("Example of one candidate:\n", 1)[1]
    parsed = parse_answer(json.dumps({"candidates": [json.loads(example)]}), 3)
    assert parsed.errors == () and len(parsed.workflows) == 1


def test_structure_key_ignores_names_not_shape() -> None:
    wf = next(w for w in ALL if len(w.stages) >= 2)
    renamed = Workflow(id="other", stages=tuple(
        dataclasses.replace(s, id=f"s_{s.id}", depends_on=tuple(f"s_{d}" for d in s.depends_on), role="r",
                            prompt_template="{input}") for s in wf.stages))
    assert structure_key(renamed) == structure_key(wf)
    bigger = dataclasses.replace(wf, stages=(dataclasses.replace(wf.stages[0], calls_per_request=2),
                                             *wf.stages[1:]))
    assert structure_key(bigger) != structure_key(wf)


@pytest.mark.parametrize(("obj", "field", "words"), [
    ({"id": "x", "rationale": "", "stages": "no"}, "c.stages", "must be a list"),
    ({"id": "bad id", "rationale": "", "stages": []}, "c.id", "short name"),
    ({"id": "x", "rationale": "", "stages": [{"id": "a-b", "kind": "LLM"}]}, "c.stages[0].id", "identifier"),
    ({"id": "x", "rationale": "", "stages": [{"id": "a", "kind": "GPU"}]}, "c.stages[0].kind", "'LLM' or 'TOOL'"),
    ({"id": "x", "rationale": "", "stages": [{"id": "a", "kind": "LLM", "input_tokens": "5"}]},
     "c.stages[0].input_tokens", "integer"),
    ({"id": "x", "rationale": "", "stages": [{"id": "a", "kind": "LLM", "input_tokens": 5, "output_tokens": 5,
                                               "prompt_template": "{input"}]},
     "c.stages[0].prompt_template", "not a valid str.format template"),
    ({"id": "x", "rationale": "", "stages": [{"id": "a", "kind": "LLM", "input_tokens": 5, "output_tokens": 5}]},
     "c.stages[0].prompt_template", "needs a prompt template"),
    ({"id": "x", "rationale": "", "stages": [{"id": "t", "kind": "TOOL", "latency_s": 0.1}]},
     "c.stages", "at least one LLM stage"),
])
def test_field_named_errors(obj: dict, field: str, words: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        workflow_from_json(obj, "c")
    assert e.value.field == field and words in e.value.message


def test_parse_answer_reports_every_bad_candidate_and_keeps_good_ones() -> None:
    good = workflow_to_json(ALL[0])
    text = json.dumps({"candidates": [{"id": "x"}, good, {"id": "y", "rationale": "", "stages": []}]})
    parsed = parse_answer(text, 3)
    assert [w.id for w in parsed.workflows] == [ALL[0].id]
    assert len(parsed.errors) == 2 and parsed.errors[1].startswith("candidates[2].stages")
    assert parse_answer(text, 1).errors == (parse_answer(text, 3).errors[0],)  # only the first max are read
    assert "unknown field(s) ['notes']" in parse_answer(json.dumps({"candidates": [good], "notes": 1}), 3).errors[0]
