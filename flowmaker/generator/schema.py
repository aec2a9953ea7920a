"""The JSON contract between FlowMaker and an LLM that proposes workflows: schema, parsing with field-named
errors, conversion to domain Workflows, and the structural key used to drop duplicates. Pure code."""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flowmaker.cancel import checkpoint
from flowmaker.domain import Stage, StageKind, Workflow
from flowmaker.errors import InvalidSpec
from flowmaker.limits import check_prompt_template

STAGE_FIELDS = ("id", "kind", "depends_on", "input_tokens", "output_tokens", "calls_per_request", "latency_s",
                "role", "prompt_template")
CANDIDATE_FIELDS = ("id", "rationale", "stages")
# Stage ids become str.format field names in downstream prompt templates, hence identifiers.
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def candidates_schema(max_candidates: int) -> dict[str, Any]:
    """The JSON schema of an answer: `{"candidates": [...]}` with at most `max_candidates`
    workflows. Every property is required and no other is allowed, as the strict
    structured-output modes of OpenAI-compatible servers demand."""
    stage = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": _IDENT.pattern,
                   "description": "unique within the workflow; other stages' prompt templates refer to it as {id}"},
            "kind": {"type": "string", "enum": ["LLM", "TOOL"],
                     "description": "LLM: a model call; TOOL: a non-LLM step such as retrieval or code execution"},
            "depends_on": {"type": "array", "items": {"type": "string"},
                           "description": "ids of the stages whose outputs this stage needs; no cycles"},
            "input_tokens": {"type": "integer", "minimum": 0,
                             "description": "prompt tokens per call (> 0 for LLM stages, 0 for TOOL stages)"},
            "output_tokens": {"type": "integer", "minimum": 0,
                              "description": "generated tokens per call (> 0 for LLM stages, 0 for TOOL stages)"},
            "calls_per_request": {"type": "integer", "minimum": 1,
                                  "description": "calls per user request, e.g. 3 for self-consistency sampling"},
            "latency_s": {"type": "number", "minimum": 0,
                          "description": "seconds a TOOL stage takes; 0 for LLM stages"},
            "role": {"type": "string", "description": "short human-readable role, e.g. 'summariser'"},
            "prompt_template": {"type": "string",
                                "description": "Python str.format template using only {input} and {<id>} of "
                                               "stages in depends_on; double literal braces"},
        },
        "required": list(STAGE_FIELDS),
        "additionalProperties": False,
    }
    candidate = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": _WF_ID.pattern, "description": "short kebab-case name"},
            "rationale": {"type": "string", "description": "one line shown to the user: the trade-off it makes"},
            "stages": {"type": "array", "minItems": 1, "items": stage},
        },
        "required": list(CANDIDATE_FIELDS),
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"candidates": {"type": "array", "minItems": 1, "maxItems": max_candidates,
                                      "items": candidate}},
        "required": ["candidates"],
        "additionalProperties": False,
    }


def workflow_to_json(wf: Workflow) -> dict[str, Any]:
    """A workflow in the answer format (used for the prompt's example and for display)."""
    return {
        "id": wf.id,
        "rationale": wf.rationale,
        "stages": [{"id": s.id, "kind": s.kind.value, "depends_on": list(s.depends_on),
                    "input_tokens": s.input_tokens, "output_tokens": s.output_tokens,
                    "calls_per_request": s.calls_per_request, "latency_s": s.latency_s,
                    "role": s.role, "prompt_template": s.prompt_template} for s in wf.stages],
    }


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    """What one answer yielded: the valid workflows, and a message per problem (field-named)."""

    workflows: tuple[Workflow, ...]
    errors: tuple[str, ...]


def _strip_fences(text: str) -> str:
    # Some models wrap JSON in a Markdown code fence even when asked for JSON only.
    t = text.strip()
    if t.startswith("```"):
        t = t.split("\n", 1)[1] if "\n" in t else ""
        if t.rstrip().endswith("```"):
            t = t.rstrip()[:-3]
    return t.strip()


def _unknown(obj: Mapping[str, Any], allowed: Iterable[str], path: str) -> None:
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise InvalidSpec(f"unknown field(s) {extra}; allowed: {list(allowed)}", field=path)


def _int(obj: Mapping[str, Any], key: str, path: str, default: int) -> int:
    v = obj.get(key, default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidSpec(f"must be an integer, got {v!r}", field=f"{path}.{key}")
    return v


def _str(obj: Mapping[str, Any], key: str, path: str, default: str = "") -> str:
    v = obj.get(key, default)
    if not isinstance(v, str):
        raise InvalidSpec(f"must be a string, got {v!r}", field=f"{path}.{key}")
    return v


def _stage(obj: Any, path: str) -> Stage:
    if not isinstance(obj, dict):
        raise InvalidSpec(f"must be an object, got {type(obj).__name__}", field=path)
    _unknown(obj, STAGE_FIELDS, path)
    sid = _str(obj, "id", path)
    if not _IDENT.match(sid):
        raise InvalidSpec(f"{sid!r} must be an identifier (letters, digits, _): prompt templates refer to it "
                          f"as {{{sid}}}", field=f"{path}.id")
    kind = _str(obj, "kind", path)
    if kind not in ("LLM", "TOOL"):
        raise InvalidSpec(f"must be 'LLM' or 'TOOL', got {kind!r}", field=f"{path}.kind")
    deps = obj.get("depends_on", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise InvalidSpec(f"must be a list of stage ids, got {deps!r}", field=f"{path}.depends_on")
    lat = obj.get("latency_s", 0.0)
    if isinstance(lat, bool) or not isinstance(lat, int | float):
        raise InvalidSpec(f"must be a number, got {lat!r}", field=f"{path}.latency_s")
    return Stage(id=sid, kind=StageKind(kind), depends_on=tuple(deps),
                 input_tokens=_int(obj, "input_tokens", path, 0), output_tokens=_int(obj, "output_tokens", path, 0),
                 calls_per_request=_int(obj, "calls_per_request", path, 1), latency_s=float(lat),
                 role=_str(obj, "role", path), prompt_template=_str(obj, "prompt_template", path))


def _check_templates(wf: Workflow, path: str) -> None:
    """Prompt templates must format with {input} and the outputs of the stage's dependencies:
    the orchestrator fills them exactly so."""
    for i, st in enumerate(wf.stages):
        f = f"{path}.stages[{i}].prompt_template"
        if st.is_llm and not st.prompt_template.strip():
            raise InvalidSpec(f"stage {st.id!r}: an LLM stage needs a prompt template", field=f)
        try:
            names = {n for _, n, _, _ in string.Formatter().parse(st.prompt_template) if n is not None}
        except ValueError as e:
            raise InvalidSpec(f"stage {st.id!r}: not a valid str.format template ({e}); double literal braces",
                              field=f) from None
        bad = sorted(n for n in names if n not in ("input", *st.depends_on))
        if bad:
            raise InvalidSpec(f"stage {st.id!r}: placeholders {bad} are neither {{input}} nor a stage in its "
                              f"depends_on {list(st.depends_on)}", field=f)
        check_prompt_template(st.prompt_template, f)  # plain {input}/{stage id} only, as the API requires


def workflow_from_json(obj: Any, path: str) -> Workflow:
    """One candidate object -> a validated Workflow; InvalidSpec names the field of the first problem."""
    if not isinstance(obj, dict):
        raise InvalidSpec(f"must be an object, got {type(obj).__name__}", field=path)
    _unknown(obj, CANDIDATE_FIELDS, path)
    wid = _str(obj, "id", path)
    if not _WF_ID.match(wid):
        raise InvalidSpec(f"{wid!r} must be a short name of letters, digits, '-', '_' or '.'", field=f"{path}.id")
    rationale = " ".join(_str(obj, "rationale", path).split())  # one line, whatever the model wrote
    stages = obj.get("stages")
    if not isinstance(stages, list):
        raise InvalidSpec(f"must be a list of stages, got {stages!r}", field=f"{path}.stages")
    wf = Workflow(id=wid, stages=tuple(_stage(s, f"{path}.stages[{i}]") for i, s in enumerate(stages)),
                  rationale=rationale)
    wf.validate(path)
    _check_templates(wf, path)
    return wf


def parse_answer(content: str, max_candidates: int) -> ParsedAnswer:
    """Parse one answer's text. Never raises for a bad answer: problems come back as
    messages (fed back to the model), next to the candidates that were fine."""
    try:
        doc = json.loads(_strip_fences(content))
    except json.JSONDecodeError as e:
        return ParsedAnswer((), (f"the answer is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",))
    if not isinstance(doc, dict):
        return ParsedAnswer((), (f"the answer must be a JSON object {{\"candidates\": [...]}}, "
                                 f"got {type(doc).__name__}",))
    extra = sorted(set(doc) - {"candidates"})
    cands = doc.get("candidates")
    if extra or not isinstance(cands, list) or not cands:
        why = f"unknown field(s) {extra}" if extra else "'candidates' must be a non-empty list"
        return ParsedAnswer((), (f"answer: {why}; the answer must be {{\"candidates\": [...]}}",))
    wfs: list[Workflow] = []
    errors: list[str] = []
    for i, c in enumerate(cands[:max_candidates]):
        checkpoint()  # runs in a worker (flowmaker.cancel.offload): stop when the caller has gone
        try:
            wfs.append(workflow_from_json(c, f"candidates[{i}]"))
        except InvalidSpec as e:
            errors.append(str(e))
    return ParsedAnswer(tuple(wfs), tuple(errors))


def structure_key(wf: Workflow) -> tuple[Any, ...]:
    """What the selector sees of a workflow: the DAG over stage positions in topological
    order, kinds, token counts, calls and tool latencies. Stage ids, roles and prompts
    do not change cost or latency, so two candidates with the same key are duplicates."""
    order = wf.topo_order()
    pos = {wf.stages[i].id: k for k, i in enumerate(order)}
    return tuple((s.kind.value, tuple(sorted(pos[d] for d in s.depends_on)), s.input_tokens, s.output_tokens,
                  s.calls_per_request, round(s.latency_s, 6)) for s in (wf.stages[i] for i in order))
