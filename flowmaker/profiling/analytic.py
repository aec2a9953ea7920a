"""Analytic roofline profiles: latency, throughput and memory of (model, GPU type, tp, pp) without a GPU.

The formulas and every constant are documented in docs/profiles.md; `explain_profile`
returns each intermediate number so a reviewer can recompute a profile by hand. A
measured profile (flowmaker.profiling.fit) replaces this estimate when one exists.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from flowmaker.domain import GpuType, Model, ModelArch, Profile, ProfileSource
from flowmaker.errors import InvalidSpec

__all__ = [
    "COMM_BW_EFFICIENCY",
    "COMM_HOP_LATENCY_S",
    "DECODE_BW_EFFICIENCY",
    "DECODE_STEP_OVERHEAD_S",
    "KV_RESERVED_TOKENS",
    "MAX_BATCH",
    "MEMORY_FIT_FRACTION",
    "PREFILL_MFU",
    "REF_OUTPUT_TOKENS",
    "REF_PROMPT_TOKENS",
    "RUNTIME_OVERHEAD_GB",
    "SERVER_OVERHEAD_S",
    "ConfigExcluded",
    "ProfileBreakdown",
    "analytic_profile",
    "capacity_from_decode",
    "config_set",
    "exclusion_reason",
    "explain_profile",
    "profiles_for",
]

# ---- Efficiency constants (what fraction of the datasheet a real engine reaches) ----
# Prefill GEMMs reach ~60% of dense BF16 peak (lmdeploy's Llama-2-7B 2048-token first-token
# latency on A100 implies ~64%).
PREFILL_MFU = 0.60
# Decode GEMVs stream weights at ~70% of HBM/GDDR bandwidth (vLLM Llama-3.1-8B on A100-40GB
# reaches ~77%, lmdeploy Llama-2-70B TP=4 ~65%).
DECODE_BW_EFFICIENCY = 0.70
# NCCL all-reduce / send-recv reach ~70% of the per-direction link bandwidth.
COMM_BW_EFFICIENCY = 0.70
# Latency of one GPU-to-GPU hop, per interconnect kind. A ring all-reduce over tp GPUs takes
# 2(tp-1) hops, so its fixed cost grows with tp: on PCIe this is what stops small models from
# gaining from tp=8. A pipeline-stage boundary is one hop.
COMM_HOP_LATENCY_S = {"NVLink": 3e-6, "PCIe": 8e-6}
_COMM_HOP_LATENCY_DEFAULT_S = 8e-6  # an unknown interconnect is costed like PCIe

# ---- Overheads ----
SERVER_OVERHEAD_S = 0.010  # per call: HTTP, tokenize/detokenize, scheduling in an OpenAI-compatible server
DECODE_STEP_OVERHEAD_S = 0.0005  # per decode step: scheduler, sampling, kernel launches (CUDA graphs on)
RUNTIME_OVERHEAD_GB = 2.0  # per GPU: CUDA context, activation/logits workspace, CUDA graphs

# ---- Memory reservation and the reference workload ----
# Each instance reserves KV cache for this many tokens (about 25 concurrent requests of the
# reference shape); a fixed token budget keeps small models small, which the cost objective rewards.
KV_RESERVED_TOKENS = 32768
MEMORY_FIT_FRACTION = 0.95  # a config fits when memory_gb_per_gpu <= 95% of the GPU (fragmentation, driver)
REF_PROMPT_TOKENS = 1024  # reference request used for context length and the prefill share of throughput
REF_OUTPUT_TOKENS = 256
MAX_BATCH = 256  # vLLM's default max_num_seqs

GB = 1e9


class ConfigExcluded(InvalidSpec):
    """(model, GPU type, tp, pp) cannot run: heads/layers not divisible, or it does not fit in memory."""

    reason = "CONFIG_EXCLUDED"


@dataclass(frozen=True, slots=True)
class ProfileBreakdown:
    """Every intermediate number of one analytic profile (units in the names)."""

    model_id: str
    gpu_type: str
    tp: int
    pp: int
    excluded: str  # "" when the config runs, else the reason
    # inputs
    params_b: float
    active_params_b: float
    mem_bw_gbps: float
    bf16_tflops: float
    interconnect: str
    interconnect_gbps: float
    # memory
    weights_gb: float  # params * dtype_bytes
    weights_gb_per_gpu: float  # heaviest stage / tp (= weights / tp when pp = 1)
    kv_bytes_per_token: int  # 2 * layers * kv_heads * head_dim * dtype_bytes (whole model)
    kv_heads_per_gpu: int  # kv_heads / tp, at least 1 (replicated when kv_heads < tp)
    kv_bytes_per_token_per_gpu: float  # 2 * (layers/pp) * kv_heads_per_gpu * head_dim * dtype_bytes
    kv_reserved_gb_per_gpu: float  # KV_RESERVED_TOKENS * kv_bytes_per_token_per_gpu
    runtime_overhead_gb: float
    memory_gb_per_gpu: float
    memory_limit_gb: float  # MEMORY_FIT_FRACTION * GPU memory
    # prefill (per prompt token)
    flops_per_prompt_token: float  # 2*active_params + attention at half the reference prompt
    prefill_compute_s_per_token: float
    prefill_tp_comm_s_per_token: float
    prefill_pp_hop_s_per_token: float
    # decode (per output token, one request alone)
    decode_context_tokens: int
    decode_weights_s: float
    decode_kv_s: float
    hop_latency_s: float  # COMM_HOP_LATENCY_S of the interconnect
    allreduce_latency_s: float  # 2 * (tp-1) * hop_latency_s
    allreduce_s: float  # one all-reduce of one token's activations: latency + 2(tp-1)/tp * hidden*dtype / link
    decode_tp_comm_s: float  # 2 * layers * allreduce_s
    decode_pp_hop_s: float  # (pp-1) * one hop
    decode_step_overhead_s: float
    # fixed per call
    fixed_server_s: float
    fixed_weights_pass_s: float  # the prefill pass reads every weight once
    fixed_comm_latency_s: float
    # throughput with continuous batching
    batch: int  # concurrent sequences the KV reservation holds
    microbatch: float  # batch / pp sequences per pipeline stage
    stage_step_memory_s: float
    stage_step_compute_s: float
    stage_step_s: float
    step_bound: str  # "memory" or "compute"
    decode_tokens_per_s_at_batch: float
    prefill_s_per_output_token: float  # (REF_PROMPT/REF_OUTPUT) prompt tokens per output token, pipelined
    # the result
    fixed_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    max_output_tokens_per_s: float

    def profile(self) -> Profile:
        if self.excluded:
            raise ConfigExcluded(self.excluded, field="config")
        return Profile(model_id=self.model_id, tp=self.tp, pp=self.pp, memory_gb_per_gpu=self.memory_gb_per_gpu,
                       fixed_s=self.fixed_s, prefill_s_per_token=self.prefill_s_per_token,
                       decode_s_per_token=self.decode_s_per_token,
                       max_output_tokens_per_s=self.max_output_tokens_per_s, gpu_type=self.gpu_type,
                       source=ProfileSource.ANALYTIC,
                       decode_tokens_per_s=self.decode_tokens_per_s_at_batch).validate()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def config_set(max_gpus: int) -> list[tuple[int, int]]:
    """All (tp, pp) with tp and pp powers of two and tp*pp <= max_gpus, fewest GPUs first, then tp-heavy first.

    On an 8-GPU node that is exactly the 10 pairs (1,1) (2,1) (1,2) (4,1) (2,2) (1,4) (8,1) (4,2) (2,4) (1,8).
    """
    if isinstance(max_gpus, bool) or not isinstance(max_gpus, int) or max_gpus < 1:
        raise InvalidSpec(f"must be an integer >= 1, got {max_gpus!r}", field="max_gpus")
    pows = [1 << i for i in range(max_gpus.bit_length()) if (1 << i) <= max_gpus]
    pairs = [(tp, pp) for tp in pows for pp in pows if tp * pp <= max_gpus]
    return sorted(pairs, key=lambda c: (c[0] * c[1], c[1]))


def _arch(model: Model) -> ModelArch:
    if model.arch is None:
        raise InvalidSpec(f"model {model.id!r} has no architecture; register it from its config.json",
                          field="model.arch")
    return model.arch


def exclusion_reason(model: Model, gpu: GpuType, tp: int, pp: int) -> str | None:
    """Why (model, gpu, tp, pp) cannot run, or None when it can."""
    return explain_profile(model, gpu, tp, pp).excluded or None


def _structural_reason(a: ModelArch, tp: int, pp: int) -> str:
    if a.heads % tp:
        return f"num_attention_heads={a.heads} is not divisible by tp={tp}"
    # KV heads: split evenly when kv_heads >= tp; when kv_heads < tp each KV head is
    # replicated on tp/kv_heads GPUs (vLLM's rule), which needs tp to be a multiple of kv_heads.
    if a.kv_heads >= tp and a.kv_heads % tp:
        return f"num_key_value_heads={a.kv_heads} is not divisible by tp={tp}"
    if a.kv_heads < tp and tp % a.kv_heads:
        return f"tp={tp} is not a multiple of num_key_value_heads={a.kv_heads} (KV heads cannot be replicated evenly)"
    if a.layers % pp:
        return f"num_hidden_layers={a.layers} is not divisible by pp={pp}"
    return ""


def explain_profile(model: Model, gpu: GpuType, tp: int, pp: int) -> ProfileBreakdown:
    """The analytic profile of (model, gpu, tp, pp) with every intermediate number.

    Never raises for a config that cannot run: `excluded` carries the reason (the numbers are
    still computed where they make sense, so `profiles show` can say by how much it misses).
    """
    for name, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidSpec(f"must be an integer >= 1, got {v!r}", field=name)
    a = _arch(model)
    excluded = _structural_reason(a, tp, pp)
    n = tp * pp
    dt = a.dtype_bytes
    bw = gpu.mem_bw_gbps * GB * DECODE_BW_EFFICIENCY  # achieved bytes/s per GPU
    peak = gpu.bf16_tflops * 1e12 * PREFILL_MFU  # achieved FLOP/s per GPU
    link = gpu.interconnect_gbps * GB * COMM_BW_EFFICIENCY
    hop_lat = COMM_HOP_LATENCY_S.get(gpu.interconnect, _COMM_HOP_LATENCY_DEFAULT_S)
    ar_lat = 2 * (tp - 1) * hop_lat  # latency of one ring all-reduce
    act_bytes = a.hidden * dt  # one token's activation vector

    def allreduce(tokens: float) -> float:
        # Ring all-reduce: 2(tp-1) hops, each GPU sends and receives 2(tp-1)/tp of the message.
        if tp == 1:
            return 0.0
        return ar_lat + 2 * (tp - 1) / tp * tokens * act_bytes / link if link > 0 else math.inf

    def hop(tokens: float) -> float:
        if pp == 1:
            return 0.0
        return hop_lat + tokens * act_bytes / link if link > 0 else math.inf

    # ---- memory ----
    weights = model.params_b * 1e9 * dt
    # Heaviest pipeline stage: its share of the decoder layers plus the embedding table (first
    # stage) or LM head + final norm (last stage); a tied LM head is a second copy once pp > 1.
    # Vocab-parallel embeddings are split over tp like everything else.
    emb = a.vocab * a.hidden * dt
    head = 0 if a.tie_word_embeddings else emb
    layer_weights = max(weights - emb - head - a.hidden * dt, 0.0)
    if pp == 1:
        stage_max = weights
    else:
        stage_max = layer_weights / pp + max(emb, emb + a.hidden * dt)
    weights_gpu = stage_max / tp
    kv_tok = 2 * a.layers * a.kv_heads * a.head_dim * dt
    kv_heads_gpu = max(a.kv_heads // tp, 1)
    kv_tok_gpu = 2 * (a.layers / pp) * kv_heads_gpu * a.head_dim * dt
    kv_res_gpu = KV_RESERVED_TOKENS * kv_tok_gpu
    mem_gpu = (weights_gpu + kv_res_gpu) / GB + RUNTIME_OVERHEAD_GB
    limit = MEMORY_FIT_FRACTION * gpu.memory_gb
    if not excluded and mem_gpu > limit:
        excluded = (f"does not fit: needs {mem_gpu:.1f} GB per GPU (weights {weights_gpu / GB:.1f} + KV "
                    f"{kv_res_gpu / GB:.1f} + runtime {RUNTIME_OVERHEAD_GB:.1f}) > {limit:.1f} GB "
                    f"({MEMORY_FIT_FRACTION:.0%} of {gpu.memory_gb:g} GB {gpu.name})")

    # ---- weights actually read per decode step (MoE reads only the experts it routes to) ----
    # An untied input embedding is a lookup (one row per token), not streamed; a tied one is
    # streamed anyway as the LM head.
    streamed = weights - (0 if a.tie_word_embeddings else emb)

    def weights_read(batch: float) -> float:
        if not a.num_experts or model.params_b <= model.active_params_b:
            return streamed
        k, e = a.experts_per_tok, a.num_experts
        expert_total = (model.params_b - model.active_params_b) * e / (e - k) * 1e9 * dt
        return streamed - expert_total + expert_total * min(1.0, batch * k / e)

    # ---- prefill, per prompt token (a single request runs its stages one after another) ----
    attn_flops = 4 * a.layers * a.heads * a.head_dim * (REF_PROMPT_TOKENS / 2)  # QK^T and AV at mean position
    flops_prompt = 2 * model.active_params_b * 1e9 + attn_flops
    prefill_compute = flops_prompt / (tp * peak)
    prefill_tp = 2 * a.layers * (allreduce(1) - ar_lat) if tp > 1 else 0.0  # bandwidth part; latency is in fixed_s
    prefill_pp = (pp - 1) * (hop(1) - hop_lat) if pp > 1 else 0.0
    prefill = prefill_compute + prefill_tp + prefill_pp

    # ---- decode, per output token, one request alone: every stage streams its weights in turn ----
    ctx = REF_PROMPT_TOKENS + REF_OUTPUT_TOKENS // 2
    dec_weights = weights_read(1) / tp / bw  # the pp stages stream their shares one after another
    dec_kv = pp * ctx * kv_tok_gpu / bw
    ar1 = allreduce(1)
    dec_tp = 2 * a.layers * ar1
    dec_pp = (pp - 1) * hop(1)
    decode = dec_weights + dec_kv + dec_tp + dec_pp + DECODE_STEP_OVERHEAD_S

    # ---- fixed per call ----
    fixed_weights = weights_read(REF_PROMPT_TOKENS) / tp / bw  # even a 1-token prompt streams all weights once
    fixed_comm = 2 * a.layers * ar_lat + (pp - 1) * hop_lat
    fixed = SERVER_OVERHEAD_S + fixed_weights + fixed_comm

    # ---- throughput: continuous batching limited by the KV reservation ----
    batch = max(1, min(MAX_BATCH, KV_RESERVED_TOKENS // (REF_PROMPT_TOKENS + REF_OUTPUT_TOKENS)))
    m = batch / pp  # pp micro-batches keep every stage busy
    st_mem = (weights_read(m) * stage_max / weights / tp + m * ctx * kv_tok_gpu) / bw  # the slowest stage
    flops_decode = 2 * model.active_params_b * 1e9 + 4 * a.layers * a.heads * a.head_dim * ctx
    st_comp = m * flops_decode / (n * peak)
    stage = max(st_mem, st_comp) + 2 * (a.layers / pp) * allreduce(m) + hop(m) + DECODE_STEP_OVERHEAD_S
    dec_tput = m / stage
    prefill_per_out = (REF_PROMPT_TOKENS / REF_OUTPUT_TOKENS) * prefill / pp
    max_tput = capacity_from_decode(dec_tput, prefill, pp)

    return ProfileBreakdown(
        model_id=model.id, gpu_type=gpu.name, tp=tp, pp=pp, excluded=excluded,
        params_b=model.params_b, active_params_b=model.active_params_b, mem_bw_gbps=gpu.mem_bw_gbps,
        bf16_tflops=gpu.bf16_tflops, interconnect=gpu.interconnect, interconnect_gbps=gpu.interconnect_gbps,
        weights_gb=weights / GB, weights_gb_per_gpu=weights_gpu / GB, kv_bytes_per_token=kv_tok,
        kv_heads_per_gpu=kv_heads_gpu, kv_bytes_per_token_per_gpu=kv_tok_gpu, kv_reserved_gb_per_gpu=kv_res_gpu / GB,
        runtime_overhead_gb=RUNTIME_OVERHEAD_GB, memory_gb_per_gpu=mem_gpu, memory_limit_gb=limit,
        flops_per_prompt_token=flops_prompt, prefill_compute_s_per_token=prefill_compute,
        prefill_tp_comm_s_per_token=prefill_tp, prefill_pp_hop_s_per_token=prefill_pp,
        decode_context_tokens=ctx, decode_weights_s=dec_weights, decode_kv_s=dec_kv,
        hop_latency_s=hop_lat, allreduce_latency_s=ar_lat, allreduce_s=ar1,
        decode_tp_comm_s=dec_tp, decode_pp_hop_s=dec_pp, decode_step_overhead_s=DECODE_STEP_OVERHEAD_S,
        fixed_server_s=SERVER_OVERHEAD_S, fixed_weights_pass_s=fixed_weights, fixed_comm_latency_s=fixed_comm,
        batch=batch, microbatch=m, stage_step_memory_s=st_mem, stage_step_compute_s=st_comp, stage_step_s=stage,
        step_bound="memory" if st_mem >= st_comp else "compute", decode_tokens_per_s_at_batch=dec_tput,
        prefill_s_per_output_token=prefill_per_out,
        fixed_s=fixed, prefill_s_per_token=prefill, decode_s_per_token=decode, max_output_tokens_per_s=max_tput,
    )


def capacity_from_decode(decode_tokens_per_s: float, prefill_s_per_token: float, pp: int = 1) -> float:
    """Output tokens/s at the reference request: a full batch decoding at `decode_tokens_per_s` that also
    prefills REF_PROMPT_TOKENS / REF_OUTPUT_TOKENS prompt tokens per output token (pp stages pipeline them).

    The same rule for analytic and measured profiles, so `max_output_tokens_per_s` means one thing."""
    prefill_per_out = (REF_PROMPT_TOKENS / REF_OUTPUT_TOKENS) * prefill_s_per_token / pp
    return 1.0 / (1.0 / decode_tokens_per_s + prefill_per_out)


def analytic_profile(model: Model, gpu: GpuType, tp: int, pp: int) -> Profile:
    """The roofline profile of (model, gpu, tp, pp); raises ConfigExcluded (an InvalidSpec) naming the reason
    when the config cannot run."""
    b = explain_profile(model, gpu, tp, pp)
    if b.excluded:
        raise ConfigExcluded(f"{model.id} tp={tp} pp={pp} on {gpu.name}: {b.excluded}", field="config",
                             metadata={"model_id": model.id, "tp": str(tp), "pp": str(pp), "gpu_type": gpu.name})
    return b.profile()


def profiles_for(models: Iterable[Model], gpu: GpuType, max_gpus: int = 8) -> tuple[Profile, ...]:
    """Profiles of every config in `config_set(max_gpus)` that runs, for each model (models in order)."""
    out: list[Profile] = []
    configs = config_set(max_gpus)
    for m in models:
        for tp, pp in configs:
            b = explain_profile(m, gpu, tp, pp)
            if not b.excluded:
                out.append(b.profile())
    return tuple(out)
