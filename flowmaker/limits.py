"""The input-limits table: every bound a request must respect, checked at the edge before any work.

Pure (no gRPC, no etcd). `LIMITS` holds the numbers; `FIELD_RULES` binds them to the fields of the
API (by full protobuf field name), so the one server interceptor (`flowmaker.rpc.validate`) can
check a whole request in one walk and name the offending field with its full path, e.g.
`workflows[0].stages[0].calls_per_request`. Each violation is a `LimitExceeded` (INVALID_ARGUMENT,
reason LIMIT_EXCEEDED) whose metadata names the limit, so a client can tell which bound it hit.

Beyond the table, every request obeys three blanket rules (see `flowmaker.rpc.validate`): numbers
are finite, enum values are ones the API defines, and strings / repeated fields without a rule of
their own stay under `default_string_bytes` / `default_repeated`.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowmaker.errors import InvalidSpec


class LimitExceeded(InvalidSpec):
    """A value is outside a bound of the limits table (INVALID_ARGUMENT)."""

    reason = "LIMIT_EXCEEDED"


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds, one per name; the name is what an error reports (metadata `limit`)."""

    # Text
    description_bytes: int = 16_384  # a task description (DeployTask, GenerateWorkflows)
    input_bytes: int = 262_144  # the input of one Invoke
    prompt_template_bytes: int = 16_384
    hf_config_bytes: int = 262_144  # the text of a Hugging Face config.json
    hf_config_depth: int = 16  # nesting of that JSON (real configs nest 2-3 deep)
    default_string_bytes: int = 4_096  # any other string field
    # Identifiers: path-safe, so ids can name files, etcd keys and URLs as they are.
    id_chars: int = 128
    # Structure
    workflows_per_task: int = 16
    # A task's request, serialized: its record must fit one etcd value (etcd's --max-request-bytes is 1.5 MiB
    # by default, and the record grows by the selection later), so a bigger one is refused up front.
    task_bytes: int = 786_432
    stages_per_workflow: int = 64
    sample_inputs: int = 16
    models_per_request: int = 512
    profiles_per_request: int = 16_384
    gpus_per_cluster: int = 4_096
    instances_per_cluster: int = 4_096
    configs_per_request: int = 64  # (tp, pp) configs of one profiling request
    default_repeated: int = 1_024  # any other repeated field
    # Numbers
    calls_per_request: int = 16  # LLM calls one stage makes per request
    tokens_per_call: int = 131_072  # input or output tokens of one LLM call
    tool_latency_s: float = 300.0  # a TOOL stage's latency; never beyond the invoke timeout
    max_latency_s: float = 86_400.0  # an SLO's latency bound
    arrival_rate_rps: float = 1e6
    gpus_per_instance: int = 64  # tp, pp and tp*pp
    memory_gb: float = 65_536.0  # any GPU memory figure
    bayesopt_trials: int = 10_000  # SelectionOptions.max_trials
    replicas: int = 16  # SelectionOptions.max_replicas (domain.selection.MAX_REPLICAS)
    selection_time_budget_s: float = 60.0  # SelectionOptions.time_budget_s
    params_b: float = 100_000.0  # model size, billions of parameters
    # Model architecture (RegisterModel): what fits the analytic model with room to spare.
    arch_layers: int = 1_024
    arch_width: int = 1_048_576  # hidden, intermediate, head_dim
    arch_heads: int = 16_384  # heads, kv_heads
    arch_vocab: int = 16_777_216
    arch_ctx: int = 16_777_216
    arch_experts: int = 4_096
    arch_dtype_bytes: int = 8
    # Serving
    concurrent_calls_per_caller: int = 64  # RPCs of one caller running at once on one service (more wait)


LIMITS = Limits()

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ETAG_RE = re.compile(r"[0-9]{1,20}")
# A placeholder: a stage id without '.' (str.format reads '.' as attribute access), not all digits
# (positional arguments).
_PLACEHOLDER_RE = re.compile(r"(?![0-9]+$)[A-Za-z0-9_][A-Za-z0-9_-]*")


def _limit_error(message: str, field: str, limit: str, value: Any) -> LimitExceeded:
    return LimitExceeded(message, field=field, metadata={"limit": limit, "max": str(value)})


def preview(text: str, n: int = 64) -> str:
    """A short, printable rendering of user text for error messages (ids may be huge or hostile)."""
    s = text if len(text) <= n else text[:n] + f"...({len(text)} chars)"
    return repr(s)


def check_id(value: str, field: str, limits: Limits = LIMITS) -> None:
    """Ids name etcd keys, log files and URLs: letters, digits, '.', '_', '-', starting with a letter
    or digit (so never '.', '..' or a path), at most `id_chars` characters. Empty is the caller's
    business (often "unset")."""
    if not value:
        return
    if len(value) > limits.id_chars:
        raise _limit_error(f"at most {limits.id_chars} characters (limit id_chars), got {len(value)}",
                           field, "id_chars", limits.id_chars)
    if not _ID_RE.fullmatch(value):
        raise InvalidSpec(f"{preview(value)} is not a valid id: use letters, digits, '.', '_' and '-', "
                          "starting with a letter or digit", field=field, reason="INVALID_ID")


def check_etag(value: str, field: str = "etag") -> None:
    """An etag is the decimal etcd revision the server handed out; anything else is malformed."""
    if value and not _ETAG_RE.fullmatch(value):
        raise InvalidSpec(f"malformed etag {preview(value, 24)}: pass the etag a previous response returned",
                          field=field, reason="INVALID_ETAG")


def check_bytes(value: str, field: str, limit: str, limits: Limits = LIMITS) -> None:
    cap = int(getattr(limits, limit))
    n = len(value.encode("utf-8", "surrogatepass")) if len(value) * 4 > cap else len(value)
    if n > cap:
        raise _limit_error(f"at most {cap} bytes (limit {limit}), got {n}", field, limit, cap)


def check_count(n: int, field: str, limit: str, limits: Limits = LIMITS) -> None:
    cap = int(getattr(limits, limit))
    if n > cap:
        raise _limit_error(f"at most {cap} entries (limit {limit}), got {n}", field, limit, cap)


def check_range(value: float, field: str, limit: str, limits: Limits = LIMITS, *, lo: float = 0.0,
                scale: float = 1.0) -> None:
    """`lo <= value <= scale * limits.<limit>`; the finite check is the caller's (every number is)."""
    cap = getattr(limits, limit) * scale
    if value > cap:
        raise _limit_error(f"must be <= {cap:g} (limit {limit}), got {value:g}", field, limit, cap)
    if value < lo:
        raise InvalidSpec(f"must be >= {lo:g}, got {value:g}", field=field)


_FORMATTER = string.Formatter()


def check_prompt_template(template: str, field: str, limits: Limits = LIMITS) -> None:
    """A prompt template is plain text with `{input}` / `{<stage id>}` substitutions: no format specs
    (`{input:>100000000}` would allocate 100 MB), no conversions, no attribute or index access.
    `{{` and `}}` are literal braces. Which stage ids may appear is the workflow's check."""
    check_bytes(template, field, "prompt_template_bytes", limits)
    try:
        parts = list(_FORMATTER.parse(template))
    except ValueError as e:
        raise InvalidSpec(f"not a valid template ({e}); write literal braces as '{{{{' and '}}}}'",
                          field=field, reason="INVALID_TEMPLATE") from None
    for _, name, spec, conv in parts:
        if name is None:
            continue
        if spec or conv:
            raise InvalidSpec(f"'{{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}': only plain "
                              "{input} or {<stage id>} substitutions are allowed (no format spec or conversion)",
                              field=field, reason="INVALID_TEMPLATE")
        if not _PLACEHOLDER_RE.fullmatch(name):
            raise InvalidSpec(f"'{{{preview(name, 32)[1:-1]}}}': only plain {{input}} or {{<stage id>}} "
                              "substitutions are allowed (no attribute or index access)",
                              field=field, reason="INVALID_TEMPLATE")


def template_fields(template: str) -> list[str]:
    """The substitution names of a template that passed `check_prompt_template`."""
    return [name for _, name, _, _ in _FORMATTER.parse(template) if name is not None]


def render_template(template: str, values: Mapping[str, str]) -> str:
    """Substitute `{name}` from `values` (missing names render empty). No str.format: only plain
    names are looked up, so a template can never reach attributes or allocate by a format spec."""
    out: list[str] = []
    for literal, name, _, _ in _FORMATTER.parse(template):
        out.append(literal)
        if name is not None:
            out.append(values.get(name, ""))
    return "".join(out)


def json_depth(text: str) -> int:
    """The nesting depth of JSON text, counted without parsing it (so a 100,000-deep document costs
    one linear scan, not a RecursionError). Brackets inside strings do not count."""
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def check_json_text(text: str, field: str, *, bytes_limit: str, depth_limit: str, limits: Limits = LIMITS) -> None:
    check_bytes(text, field, bytes_limit, limits)
    cap = int(getattr(limits, depth_limit))
    d = json_depth(text)
    if d > cap:
        raise _limit_error(f"JSON nested {d} deep; at most {cap} (limit {depth_limit})", field, depth_limit, cap)


# ---- the rules bound to API fields ---------------------------------------------------------------
# Rule forms: ("id",) | ("etag",) | ("bytes", limit) | ("template",) | ("count", limit) |
# ("range", limit[, lo]) | ("json", bytes_limit, depth_limit). A repeated field may carry a count rule
# and, under the key "<field>[]", a rule for each element.

Rule = tuple[Any, ...]

_C = "flowmaker.common.v1."
_O = "flowmaker.orchestrator.v1."
_G = "flowmaker.generator.v1."
_D = "flowmaker.deployer.v1."
_P = "flowmaker.profiler.v1."

FIELD_RULES: dict[str, tuple[Rule, ...]] = {
    # workflow.proto
    _C + "Stage.id": (("id",),),
    _C + "Stage.depends_on": (("count", "stages_per_workflow"),),
    _C + "Stage.depends_on[]": (("id",),),
    _C + "Stage.input_tokens": (("range", "tokens_per_call"),),
    _C + "Stage.output_tokens": (("range", "tokens_per_call"),),
    _C + "Stage.calls_per_request": (("range", "calls_per_request"),),
    _C + "Stage.latency_s": (("range", "tool_latency_s"),),
    _C + "Stage.prompt_template": (("template",),),
    _C + "Workflow.id": (("id",),),
    _C + "Workflow.stages": (("count", "stages_per_workflow"),),
    _C + "Workflow.description": (("bytes", "description_bytes"),),
    _C + "Slo.max_latency_s": (("range", "max_latency_s"),),
    _C + "Slo.arrival_rate_rps": (("range", "arrival_rate_rps"),),
    _C + "TaskSpec.description": (("bytes", "description_bytes"),),
    _C + "TaskSpec.candidates": (("count", "workflows_per_task"),),
    # cluster.proto
    _C + "Model.id": (("id",),),
    _C + "Model.params_b": (("range", "params_b"),),
    _C + "Model.active_params_b": (("range", "params_b"),),
    _C + "ModelArch.layers": (("range", "arch_layers"),),
    _C + "ModelArch.hidden": (("range", "arch_width"),),
    _C + "ModelArch.intermediate": (("range", "arch_width"),),
    _C + "ModelArch.head_dim": (("range", "arch_width"),),
    _C + "ModelArch.heads": (("range", "arch_heads"),),
    _C + "ModelArch.kv_heads": (("range", "arch_heads"),),
    _C + "ModelArch.vocab": (("range", "arch_vocab"),),
    _C + "ModelArch.max_ctx": (("range", "arch_ctx"),),
    _C + "ModelArch.dtype_bytes": (("range", "arch_dtype_bytes"),),
    _C + "ModelArch.num_experts": (("range", "arch_experts"),),
    _C + "ModelArch.experts_per_tok": (("range", "arch_experts"),),
    _C + "Profile.model_id": (("id",),),
    _C + "Profile.tp": (("range", "gpus_per_instance"),),
    _C + "Profile.pp": (("range", "gpus_per_instance"),),
    _C + "Profile.memory_gb_per_gpu": (("range", "memory_gb"),),
    _C + "Gpu.memory_total_gb": (("range", "memory_gb"),),
    _C + "Gpu.memory_used_gb": (("range", "memory_gb"),),
    _C + "Instance.tp": (("range", "gpus_per_instance"),),
    _C + "Instance.pp": (("range", "gpus_per_instance"),),
    _C + "Cluster.gpus": (("count", "gpus_per_cluster"),),
    _C + "Cluster.instances": (("count", "instances_per_cluster"),),
    # selection.proto
    _C + "SelectionOptions.max_trials": (("range", "bayesopt_trials"),),
    _C + "SelectionOptions.max_replicas": (("range", "replicas"),),
    _C + "SelectionOptions.time_budget_s": (("range", "selection_time_budget_s"),),
    # selector.proto
    "flowmaker.selector.v1.SelectVariantRequest.workflows": (("count", "workflows_per_task"),),
    "flowmaker.selector.v1.SelectVariantRequest.models": (("count", "models_per_request"),),
    "flowmaker.selector.v1.SelectVariantRequest.profiles": (("count", "profiles_per_request"),),
    # orchestrator.proto
    _O + "DeployTaskRequest.description": (("bytes", "description_bytes"),),
    _O + "DeployTaskRequest.workflows": (("count", "workflows_per_task"),),
    _O + "DeployTaskRequest.max_workflows": (("range", "workflows_per_task"),),
    _O + "ApproveWorkflowsRequest.task_id": (("id",),),
    _O + "ApproveWorkflowsRequest.workflow_ids": (("count", "workflows_per_task"),),
    _O + "ApproveWorkflowsRequest.workflow_ids[]": (("id",),),
    _O + "ApproveWorkflowsRequest.strategy": (("id",),),
    _O + "ApproveWorkflowsRequest.etag": (("etag",),),
    _O + "GetTaskRequest.task_id": (("id",),),
    _O + "DeleteTaskRequest.task_id": (("id",),),
    _O + "InvokeRequest.task_id": (("id",),),
    _O + "InvokeRequest.input": (("bytes", "input_bytes"),),
    _O + "InvokeRequest.max_output_tokens": (("range", "tokens_per_call"),),
    _O + "InvokeStreamRequest.task_id": (("id",),),
    _O + "InvokeStreamRequest.input": (("bytes", "input_bytes"),),
    _O + "InvokeStreamRequest.max_output_tokens": (("range", "tokens_per_call"),),
    # generator.proto
    _G + "GenerateWorkflowsRequest.description": (("bytes", "description_bytes"),),
    _G + "GenerateWorkflowsRequest.max_workflows": (("range", "workflows_per_task"),),
    _G + "GenerateWorkflowsRequest.sample_inputs": (("count", "sample_inputs"),),
    _G + "GenerateWorkflowsRequest.sample_inputs[]": (("bytes", "description_bytes"),),
    # deployer.proto
    _D + "DeployRequest.model_id": (("id",),),
    _D + "DeployRequest.tp": (("range", "gpus_per_instance"),),
    _D + "DeployRequest.pp": (("range", "gpus_per_instance"),),
    _D + "DeployRequest.gpu_ids": (("count", "gpus_per_instance"),),
    _D + "DeployRequest.gpu_ids[]": (("id",),),
    _D + "DeployRequest.memory_gb_per_gpu": (("range", "memory_gb"),),
    _D + "DeployRequest.task_id": (("id",),),
    _D + "DeployRequest.engine": (("id",),),
    _D + "DeployRequest.request_id": (("id",),),
    _D + "ReleaseRequest.instance_id": (("id",),),
    _D + "ReleaseRequest.task_id": (("id",),),
    _D + "ListInstancesRequest.model_id": (("id",),),
    _D + "ListInstancesRequest.task_id": (("id",),),
    _D + "ListGpusRequest.node": (("id",),),
    # profiler.proto
    _P + "RegisterModelRequest.catalog_name": (("id",),),
    _P + "RegisterModelRequest.hf_config_json": (("json", "hf_config_bytes", "hf_config_depth"),),
    _P + "RegisterModelRequest.model_id": (("id",),),
    _P + "ParallelConfig.tp": (("range", "gpus_per_instance"),),
    _P + "ParallelConfig.pp": (("range", "gpus_per_instance"),),
    _P + "GetProfilesRequest.model_id": (("id",),),
    _P + "GetProfilesRequest.configs": (("count", "configs_per_request"),),
    _P + "ProfileModelRequest.model_id": (("id",),),
    _P + "ProfileModelRequest.configs": (("count", "configs_per_request"),),
    _P + "ProfileModelRequest.engine": (("id",),),
    _P + "GetProfilingJobRequest.job_id": (("id",),),
}


# Whole-message bounds: (limit, the field that makes the message big), checked on the serialized size
# before the walk.
MESSAGE_RULES: Mapping[str, tuple[str, str]] = {
    _O + "DeployTaskRequest": ("task_bytes", "workflows"),
}


def check_message_bytes(n: int, field: str, limit: str, limits: Limits = LIMITS) -> None:
    cap = int(getattr(limits, limit))
    if n > cap:
        raise _limit_error(f"the request is {n} bytes, at most {cap} (limit {limit}); send fewer or smaller "
                           "workflows", field, limit, cap)


def apply_rule(rule: Rule, value: Any, field: str, limits: Limits = LIMITS) -> None:
    """Check one value against one rule of FIELD_RULES."""
    kind = rule[0]
    if kind == "id":
        check_id(value, field, limits)
    elif kind == "etag":
        check_etag(value, field)
    elif kind == "bytes":
        check_bytes(value, field, rule[1], limits)
    elif kind == "template":
        check_prompt_template(value, field, limits)
    elif kind == "count":
        check_count(len(value), field, rule[1], limits)
    elif kind == "range":
        check_range(value, field, rule[1], limits, lo=rule[2] if len(rule) > 2 else 0.0)
    elif kind == "json":
        check_json_text(value, field, bytes_limit=rule[1], depth_limit=rule[2], limits=limits)
    else:  # pragma: no cover - a typo in the table
        raise ValueError(f"unknown rule {rule!r}")


# ---- registered models ---------------------------------------------------------------------------
# config.json key -> (ModelArch field, limit). RegisterModel checks the raw config against these before
# any arithmetic on it, and the built Model again before it is stored, so a poisoned model (a width of
# 1e308, a vocabulary of 2**70) can never reach the registry.
HF_CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "num_hidden_layers": ("layers", "arch_layers"),
    "hidden_size": ("hidden", "arch_width"),
    "intermediate_size": ("intermediate", "arch_width"),
    "head_dim": ("head_dim", "arch_width"),
    "num_attention_heads": ("heads", "arch_heads"),
    "num_key_value_heads": ("kv_heads", "arch_heads"),
    "vocab_size": ("vocab", "arch_vocab"),
    "max_position_embeddings": ("max_ctx", "arch_ctx"),
    "num_local_experts": ("num_experts", "arch_experts"),
    "num_experts": ("num_experts", "arch_experts"),
    "num_experts_per_tok": ("experts_per_tok", "arch_experts"),
}


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if not isinstance(v, int) or abs(v) < 2**1000 else float("inf")


def check_hf_config(config: Mapping[str, Any], field: str = "hf_config_json", limits: Limits = LIMITS) -> None:
    """The numbers of a parsed config.json the architecture is built from, each within its limit."""
    for key, (_, limit) in HF_CONFIG_KEYS.items():
        v = _number(config.get(key))
        if v is None:
            continue
        if not math.isfinite(v):
            raise InvalidSpec(f"must be a finite number, got {str(config[key])[:40]}", field=f"{field}.{key}",
                              reason="NOT_FINITE")
        check_range(v, f"{field}.{key}", limit, limits, lo=-math.inf)


def check_model(model: Any, field: str = "model", limits: Limits = LIMITS) -> None:
    """A domain Model (duck-typed: id, accuracy, params_b, active_params_b, arch) within the table:
    what RegisterModel checks before storing anything."""
    check_id(model.id, f"{field}.id", limits)
    for name in ("accuracy", "params_b", "active_params_b"):
        v = getattr(model, name)
        if not math.isfinite(v):
            raise InvalidSpec(f"must be a finite number, got {v}", field=f"{field}.{name}", reason="NOT_FINITE")
    check_range(model.params_b, f"{field}.params_b", "params_b", limits)
    check_range(model.active_params_b, f"{field}.active_params_b", "params_b", limits)
    arch = model.arch
    if arch is None:
        return
    for attr, limit in {a: lim for a, lim in HF_CONFIG_KEYS.values()}.items():
        check_range(getattr(arch, attr), f"{field}.arch.{attr}", limit, limits)
    check_range(arch.dtype_bytes, f"{field}.arch.dtype_bytes", "arch_dtype_bytes", limits)
