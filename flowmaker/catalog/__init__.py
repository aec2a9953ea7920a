"""Model and GPU catalogs: the packaged CSV files, lookups by name, config.json import, cluster builder."""

from __future__ import annotations

import csv
import functools
import io
import math
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

from flowmaker.domain import Cluster, Gpu, GpuType, Model, ModelArch
from flowmaker.errors import InvalidSpec, NotFound

__all__ = [
    "default_models", "get_gpu_type", "get_model", "gpu_types", "make_cluster", "model_from_hf_config",
    "params_from_arch",
]


def _read_csv(name: str) -> list[dict[str, str]]:
    text = resources.files("flowmaker.catalog").joinpath(name).read_text(encoding="utf-8")
    return list(csv.DictReader(io.StringIO(text)))


def _bool(s: str) -> bool:
    return s.strip().lower() in ("true", "1", "yes")


@functools.lru_cache(maxsize=1)
def default_models() -> tuple[Model, ...]:
    """The 11 default models, in catalog order (accuracy = Open LLM Leaderboard v2 average / 100)."""
    out = []
    for i, r in enumerate(_read_csv("models.csv")):
        arch = ModelArch(
            layers=int(r["layers"]), hidden=int(r["hidden"]), intermediate=int(r["intermediate"]),
            heads=int(r["heads"]), kv_heads=int(r["kv_heads"]), head_dim=int(r["head_dim"]), vocab=int(r["vocab"]),
            max_ctx=int(r["max_ctx"]), dtype_bytes=int(r["dtype_bytes"]),
            tie_word_embeddings=_bool(r["tie_word_embeddings"]),
            num_experts=int(r["num_experts"]), experts_per_tok=int(r["experts_per_tok"]))
        m = Model(id=r["id"], accuracy=float(r["accuracy"]), params_b=float(r["params_b"]),
                  active_params_b=float(r["active_params_b"]), arch=arch, hf_id=r["hf_id"], family=r["family"],
                  source=r["source_urls"])
        out.append(m.validate(f"models.csv[{i}]"))
    return tuple(out)


def get_model(name: str) -> Model:
    """A default model by id, or by Hugging Face id (case-insensitive)."""
    key = name.strip().lower()
    for m in default_models():
        if key in (m.id.lower(), m.hf_id.lower()):
            return m
    known = ", ".join(m.id for m in default_models())
    raise NotFound(f"unknown model {name!r}; known models: {known}", field="model")


@functools.lru_cache(maxsize=1)
def _gpu_rows() -> tuple[tuple[GpuType, tuple[str, ...]], ...]:
    out = []
    for r in _read_csv("gpus.csv"):
        g = GpuType(name=r["name"], memory_gb=float(r["memory_gb"]), mem_bw_gbps=float(r["mem_bw_gbps"]),
                    bf16_tflops=float(r["bf16_tflops"]), interconnect_gbps=float(r["interconnect_gbps"]),
                    interconnect=r["interconnect"], price_per_hour=float(r["price_per_hour"]),
                    source=f"{r['spec_sources']} | price: {r['price_source']} {r['price_source_url']}")
        aliases = tuple(a for a in r["aliases"].split("|") if a.strip())
        out.append((g, aliases))
    return tuple(out)


def gpu_types() -> dict[str, GpuType]:
    """Every catalogued GPU type by its short name ("A6000", "A100-80G", "H100", "H200", "L40S", "L4")."""
    return {g.name: g for g, _ in _gpu_rows()}


def _norm_gpu(name: str) -> str:
    # "NVIDIA RTX A6000", "rtx-a6000" and "A6000" must all meet; so must "A100 80GB" and "a100-80g".
    s = re.sub(r"[\s_\-]+", "", name.strip().lower())
    s = s.removeprefix("nvidia")
    return s[:-1] if s.endswith("gb") else s


def get_gpu_type(name: str) -> GpuType:
    """A GPU type by short name or a common alias ("RTX A6000", "A100 80GB", "H100-SXM"...)."""
    key = _norm_gpu(name)
    for g, aliases in _gpu_rows():
        if key in {_norm_gpu(g.name), *(_norm_gpu(a) for a in aliases)}:
            return g
    raise NotFound(f"unknown GPU type {name!r}; known GPU types: {', '.join(gpu_types())}", field="gpu_type")


def params_from_arch(arch: ModelArch, attention_bias: bool = False) -> tuple[int, int]:
    """(total, active) parameter count of a Llama/Qwen/Mistral-style decoder from its architecture.

    Embeddings (+ an untied LM head), per layer q/k/v/o projections (+ q/k/v bias when
    `attention_bias`), a SwiGLU MLP (gate, up, down) per expert plus the router for MoE,
    two RMSNorms, and the final norm. Reproduces the reference models.csv to <0.1%.
    """
    h, hd = arch.hidden, arch.head_dim
    q, kv = arch.heads * hd, arch.kv_heads * hd
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if attention_bias else 0)
    mlp_one = 3 * h * arch.intermediate
    experts = max(arch.num_experts, 1)
    router = h * arch.num_experts if arch.num_experts else 0
    per_layer = attn + mlp_one * experts + router + 2 * h
    embed = arch.vocab * h * (1 if arch.tie_word_embeddings else 2)
    total = arch.layers * per_layer + h + embed
    idle_experts = (arch.num_experts - arch.experts_per_tok) if arch.num_experts else 0
    active = total - arch.layers * mlp_one * idle_experts
    return total, active


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2,
                # A float32 checkpoint is served in 16-bit (vLLM's dtype=auto casts fp32 to fp16).
                "float32": 2, "float": 2, "fp32": 2}


def _cfg_int(cfg: Mapping[str, Any], key: str, default: int | None = None, *, positive: bool = True) -> int:
    if key not in cfg or cfg[key] is None:
        if default is None:
            raise InvalidSpec(f"config.json is missing {key!r}", field=f"config.{key}")
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and not v.is_integer()):
        raise InvalidSpec(f"config.json {key!r} must be an integer, got {v!r}", field=f"config.{key}")
    iv = int(v)
    if positive and iv <= 0:
        raise InvalidSpec(f"config.json {key!r} must be > 0, got {iv}", field=f"config.{key}")
    if not positive and iv < 0:
        raise InvalidSpec(f"config.json {key!r} must be >= 0, got {iv}", field=f"config.{key}")
    return iv


def model_from_hf_config(config: Mapping[str, Any], model_id: str, accuracy: float) -> Model:
    """Build a Model from a Hugging Face config.json (already parsed) and a leaderboard accuracy in [0, 1].

    Parameter counts are computed from the architecture (`params_from_arch`). Keys read:
    num_hidden_layers, hidden_size, intermediate_size, num_attention_heads (required);
    num_key_value_heads (default: heads), head_dim (default: hidden/heads), vocab_size,
    max_position_embeddings, torch_dtype, tie_word_embeddings, attention_bias (Qwen2 has
    q/k/v bias), num_local_experts / num_experts + num_experts_per_tok (MoE).
    """
    if not isinstance(config, Mapping):
        raise InvalidSpec(f"config must be a JSON object, got {type(config).__name__}", field="config")
    if not model_id or not model_id.strip():
        raise InvalidSpec("must not be empty", field="model_id")
    if isinstance(accuracy, bool) or not isinstance(accuracy, int | float) or not math.isfinite(accuracy) \
            or not 0.0 <= accuracy <= 1.0:
        raise InvalidSpec(f"accuracy must be a fraction within [0, 1] (leaderboard average / 100), got {accuracy!r}",
                          field="accuracy")
    layers = _cfg_int(config, "num_hidden_layers")
    hidden = _cfg_int(config, "hidden_size")
    intermediate = _cfg_int(config, "intermediate_size")
    heads = _cfg_int(config, "num_attention_heads")
    kv_heads = _cfg_int(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise InvalidSpec(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})",
                          field="config.num_key_value_heads")
    if "head_dim" in config and config["head_dim"] is not None:
        head_dim = _cfg_int(config, "head_dim")
    else:
        if hidden % heads:
            raise InvalidSpec(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                              "and config.json has no head_dim", field="config.head_dim")
        head_dim = hidden // heads
    vocab = _cfg_int(config, "vocab_size")
    max_ctx = _cfg_int(config, "max_position_embeddings", 32768)
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if not isinstance(dtype, str) or dtype.lower() not in _DTYPE_BYTES:
        raise InvalidSpec(f"unsupported torch_dtype {dtype!r}; expected one of {sorted(set(_DTYPE_BYTES))}",
                          field="config.torch_dtype")
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise InvalidSpec(f"tie_word_embeddings must be true or false, got {tie!r}", field="config.tie_word_embeddings")
    model_type = str(config.get("model_type", "")).lower()
    bias = config.get("attention_bias")
    if bias is None:
        bias = model_type.startswith("qwen2")  # Qwen2 configs omit the key but their q/k/v projections have bias
    experts_key = "num_local_experts" if "num_local_experts" in config else "num_experts"
    num_experts = _cfg_int(config, experts_key, 0, positive=False)
    experts_per_tok = _cfg_int(config, "num_experts_per_tok", 0, positive=False) if num_experts else 0
    if num_experts and not 0 < experts_per_tok <= num_experts:
        raise InvalidSpec(f"num_experts_per_tok must be in [1, {num_experts}], got {experts_per_tok}",
                          field="config.num_experts_per_tok")
    arch = ModelArch(layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, vocab=vocab, max_ctx=max_ctx, dtype_bytes=_DTYPE_BYTES[dtype.lower()],
                     tie_word_embeddings=tie, num_experts=num_experts, experts_per_tok=experts_per_tok)
    total, active = params_from_arch(arch, attention_bias=bool(bias))
    arch_names = config.get("architectures") or []
    family = model_type or (str(arch_names[0]) if arch_names else "")
    return Model(id=model_id.strip(), accuracy=float(accuracy), params_b=total / 1e9, active_params_b=active / 1e9,
                 arch=arch, hf_id=str(config.get("_name_or_path", "")), family=family,
                 source="config.json").validate()


def make_cluster(gpu_type: str = "A6000", nodes: int = 1, gpus_per_node: int = 8) -> Cluster:
    """An empty cluster of `nodes` x `gpus_per_node` GPUs of one type.

    Ids are "node0-gpu0"...; zero-padded once a count reaches 10 ("node03-gpu07") so that
    string order equals numeric order, which the placement tie-breaks rely on.
    """
    g = get_gpu_type(gpu_type)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise InvalidSpec(f"must be an integer >= 1, got {nodes!r}", field="nodes")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise InvalidSpec(f"must be an integer >= 1, got {gpus_per_node!r}", field="gpus_per_node")
    nw, gw = len(str(nodes - 1)), len(str(gpus_per_node - 1))
    gpus = []
    for n in range(nodes):
        node = f"node{n:0{nw}d}"
        for i in range(gpus_per_node):
            gpus.append(Gpu(id=f"{node}-gpu{i:0{gw}d}", node=node, memory_total_gb=g.memory_gb, gpu_type=g.name))
    return Cluster(gpus=tuple(gpus)).validate()
