"""The analytic roofline: config set, exclusions, monotonic sanity, and published measurements."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import typer
from typer.testing import CliRunner

from flowmaker.catalog import default_models, get_gpu_type, get_model, model_from_hf_config
from flowmaker.cli.catalog import register
from flowmaker.domain import GpuType, Model, ProfileSource
from flowmaker.errors import InvalidSpec
from flowmaker.profiling.analytic import (
    KV_RESERVED_TOKENS,
    RUNTIME_OVERHEAD_GB,
    SERVER_OVERHEAD_S,
    ConfigExcluded,
    analytic_profile,
    config_set,
    exclusion_reason,
    explain_profile,
    profiles_for,
)

# Only this area's commands, so other areas' CLI modules cannot break these tests.
app = typer.Typer()
register(app)

A6000 = get_gpu_type("A6000")
A100 = get_gpu_type("A100-80G")
H100 = get_gpu_type("H100")


def test_config_set_on_8_gpus_is_the_10_pairs() -> None:
    cs = config_set(8)
    assert len(cs) == 10
    assert set(cs) == {(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)}
    assert config_set(1) == [(1, 1)]
    assert set(config_set(6)) == {(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)}
    with pytest.raises(InvalidSpec):
        config_set(0)


def test_profile_fields_and_validation() -> None:
    p = analytic_profile(get_model("Llama-3.1-8B-Instruct"), A6000, 2, 1)
    assert (p.model_id, p.tp, p.pp, p.gpu_type, p.source) == ("Llama-3.1-8B-Instruct", 2, 1, "A6000",
                                                              ProfileSource.ANALYTIC)
    assert p.validate() is p
    assert p.fixed_s > SERVER_OVERHEAD_S and p.max_output_tokens_per_s > 0


def test_memory_formula_by_hand() -> None:
    # Llama-3.1-70B tp=4 pp=2 on A6000: heaviest stage / tp + KV reservation + runtime overhead.
    m = get_model("Llama-3.1-70B-Instruct")
    b = explain_profile(m, A6000, 4, 2)
    emb = 128256 * 8192  # untied: embedding on stage 0, LM head (+ final norm) on stage 1
    stage = (70.554e9 - 2 * emb - 8192) / 2 + emb + 8192
    weights_gb = stage * 2 / 4 / 1e9
    assert weights_gb == pytest.approx(70.554e9 * 2 / 8 / 1e9, rel=1e-6)  # balanced: embedding = LM head
    kv_per_tok_gpu = 2 * (80 / 2) * (8 // 4) * 128 * 2
    assert b.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert b.memory_gb_per_gpu == pytest.approx(weights_gb + KV_RESERVED_TOKENS * kv_per_tok_gpu / 1e9
                                                + RUNTIME_OVERHEAD_GB)
    # decode weight streaming: every stage in turn reads its weights (not the embedding table, a lookup)
    assert b.decode_weights_s == pytest.approx((70.554e9 - emb) * 2 / 4 / (768e9 * 0.70))
    # A tied embedding is a second copy on the last stage once pp > 1: Llama-3.2-1B at pp=8.
    small = explain_profile(get_model("Llama-3.2-1B-Instruct"), A6000, 1, 8)
    emb1 = 128256 * 2048
    assert small.weights_gb_per_gpu == pytest.approx(((1.236e9 - emb1 - 2048) / 8 + emb1 + 2048) * 2 / 1e9)


def test_exclusions_with_reasons() -> None:
    q7 = get_model("Qwen2.5-7B-Instruct")  # 28 heads, 4 kv heads, 28 layers
    assert "num_attention_heads=28" in (exclusion_reason(q7, A6000, 8, 1) or "")
    assert "num_hidden_layers=28" in (exclusion_reason(q7, A6000, 1, 8) or "")
    with pytest.raises(ConfigExcluded) as ei:
        analytic_profile(q7, A6000, 8, 1)
    assert isinstance(ei.value, InvalidSpec) and ei.value.reason == "CONFIG_EXCLUDED"
    # kv_heads < tp: KV heads are replicated (vLLM's rule), each GPU holds one.
    q3 = get_model("Qwen2.5-3B-Instruct")  # 16 heads, 2 kv heads
    b = explain_profile(q3, A6000, 8, 1)
    assert b.excluded == "" and b.kv_heads_per_gpu == 1
    q15 = get_model("Qwen2.5-1.5B-Instruct")  # 12 heads, 2 kv heads
    assert "not divisible by tp=8" in (exclusion_reason(q15, A6000, 8, 1) or "")
    assert exclusion_reason(q15, A6000, 4, 1) is None
    # Qwen2.5-72B (145 GB of weights) needs 4 A6000s or more.
    q72 = get_model("Qwen2.5-72B-Instruct")
    assert "does not fit" in (exclusion_reason(q72, A6000, 2, 1) or "")
    assert exclusion_reason(q72, A6000, 4, 1) is None


def test_qwen72b_on_a6000_only_configs_that_fit() -> None:
    ps = profiles_for([get_model("Qwen2.5-72B-Instruct")], A6000, max_gpus=8)
    assert {(p.tp, p.pp) for p in ps} == {(4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)}
    assert all(p.memory_gb_per_gpu <= 0.95 * 48 for p in ps)


def test_every_default_model_has_a_profile_on_8_a6000() -> None:
    ps = profiles_for(default_models(), A6000)
    assert {p.model_id for p in ps} == {m.id for m in default_models()}
    for p in ps:
        p.validate()


def test_bigger_model_is_slower() -> None:
    # Dense models of one family, same config: more parameters -> slower decode and prefill, more memory.
    qwen = [get_model(f"Qwen2.5-{s}-Instruct") for s in ("1.5B", "3B", "7B", "14B", "32B")]
    ps = [analytic_profile(m, get_gpu_type("H200"), 1, 1) for m in qwen]
    for a, b in itertools.pairwise(ps):
        assert b.decode_s_per_token > a.decode_s_per_token
        assert b.prefill_s_per_token > a.prefill_s_per_token
        assert b.memory_gb_per_gpu > a.memory_gb_per_gpu
        assert b.max_output_tokens_per_s < a.max_output_tokens_per_s


def test_higher_tp_faster_decode_until_communication_dominates() -> None:
    big = get_model("Llama-3.1-70B-Instruct")
    dec = [explain_profile(big, A6000, tp, 1).decode_s_per_token for tp in (1, 2, 4, 8)]
    assert dec[0] > dec[1] > dec[2] > dec[3]  # weight streaming dominates a 70B model
    on_nvlink = [analytic_profile(big, H100, tp, 1).decode_s_per_token for tp in (4, 8)]
    assert on_nvlink[0] > on_nvlink[1]
    # A 1B model on PCIe: the 2(tp-1) all-reduce hops per layer outgrow the weight savings at tp=8.
    small = get_model("Llama-3.2-1B-Instruct")
    sb = [explain_profile(small, A6000, tp, 1) for tp in (1, 2, 4, 8)]
    assert sb[1].decode_s_per_token < sb[0].decode_s_per_token
    assert sb[3].decode_s_per_token > sb[2].decode_s_per_token
    assert sb[3].decode_tp_comm_s > sb[3].decode_weights_s


def test_pp_gives_no_single_request_speedup_but_less_memory() -> None:
    m = get_model("Llama-3.1-8B-Instruct")
    p1 = analytic_profile(m, A6000, 1, 1)
    p2 = analytic_profile(m, A6000, 1, 2)
    assert p2.decode_s_per_token >= p1.decode_s_per_token
    assert p2.prefill_s_per_token >= p1.prefill_s_per_token
    assert p2.memory_gb_per_gpu < p1.memory_gb_per_gpu


def test_memory_per_gpu_falls_with_gpu_count() -> None:
    m = get_model("Llama-3.1-70B-Instruct")
    by_n: dict[int, list[float]] = {}
    for tp, pp in config_set(8):
        by_n.setdefault(tp * pp, []).append(explain_profile(m, A6000, tp, pp).memory_gb_per_gpu)
    assert max(by_n[1]) > max(by_n[2]) > max(by_n[4]) > max(by_n[8])
    for tp in (1, 2, 4):  # along pp at fixed tp, and along tp at fixed pp
        assert explain_profile(m, A6000, tp, 1).memory_gb_per_gpu > explain_profile(m, A6000, tp, 2).memory_gb_per_gpu
        assert explain_profile(m, A6000, 1, tp).memory_gb_per_gpu > explain_profile(m, A6000, 2, tp).memory_gb_per_gpu


def test_model_without_arch_is_a_clear_error() -> None:
    bare = Model(id="bare", accuracy=0.3, params_b=7, active_params_b=7)
    with pytest.raises(InvalidSpec) as ei:
        analytic_profile(bare, A6000, 1, 1)
    assert ei.value.field == "model.arch"
    with pytest.raises(InvalidSpec) as ei2:
        explain_profile(get_model("Llama-3.1-8B-Instruct"), A6000, 0, 1)
    assert ei2.value.field == "tp"


# ---------------------------------------------------------------------------------------------
# Published measurements. The roofline must land within BAND of each (relative error).
# Llama-2 architectures are built from their config.json values (7B: 32 layers, hidden 4096, 11008,
# 32 heads, MHA; 13B: 40 layers, 5120, 13824, 40 heads, MHA; 70B: 80 layers, 8192, 28672, 64 heads,
# 8 KV heads; vocab 32000), which also exercises model_from_hf_config.
# ---------------------------------------------------------------------------------------------
BAND = 0.35


def _llama2(layers: int, hidden: int, inter: int, heads: int, kv: int, name: str) -> Model:
    return model_from_hf_config({"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": inter,
                                 "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": 32000,
                                 "max_position_embeddings": 4096, "torch_dtype": "float16"}, name, 0.1)


LLAMA2_7B = _llama2(32, 4096, 11008, 32, 32, "Llama-2-7b")
LLAMA2_13B = _llama2(40, 5120, 13824, 40, 40, "Llama-2-13b")
LLAMA2_70B = _llama2(80, 8192, 28672, 64, 8, "Llama-2-70b")
# Source [3] ran on an A100 40GB (SXM): 1555 GB/s, same compute as the 80GB part.
A100_40G = GpuType("A100-40G", memory_gb=40, mem_bw_gbps=1555, bf16_tflops=312, interconnect_gbps=300,
                   interconnect="NVLink", price_per_hour=1.0)

LMDEPLOY = ("[1] lmdeploy, 'Benchmark on A100 (FP16)', static inference, batch 1, 8x A100-80G: "
            "https://github.com/InternLM/lmdeploy/blob/main/docs/en/benchmark/a100_fp16.md")
NEMO = ("[2] NVIDIA NeMo Framework (TensorRT-LLM) Llama-2 inference performance, batch 1, 128 in / 20 out: "
        "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/llama.html")
VLLM_SWEEP = ("[3] J. Musgrave, 'vLLM throughput-latency sweep on NVIDIA A100' (vLLM 0.23.0, BF16, concurrency 1, "
              "1024 in / 128 out, ~75 tok/s decode): https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on")


@pytest.mark.parametrize(("source", "model", "gpu", "tp", "measured_s"), [
    # lmdeploy: 1 prompt token, 128 output tokens -> out tok/s = 1 / decode time per token.
    (LMDEPLOY, LLAMA2_7B, A100, 1, 1 / 100.02),
    (LMDEPLOY, LLAMA2_13B, A100, 1, 1 / 57.49),
    (LMDEPLOY, LLAMA2_70B, A100, 4, 1 / 33.94),
    (VLLM_SWEEP, get_model("Llama-3.1-8B-Instruct"), A100_40G, 1, 1 / 75),
])
def test_single_request_decode_matches_published(source: str, model: Model, gpu: GpuType, tp: int,
                                                 measured_s: float) -> None:
    pred = analytic_profile(model, gpu, tp, 1).decode_s_per_token
    assert abs(pred / measured_s - 1) <= BAND, f"{source}: predicted {pred * 1e3:.2f} ms vs {measured_s * 1e3:.2f} ms"


@pytest.mark.parametrize(("model", "tp", "measured_s"), [
    # lmdeploy first-token latency for a 2048-token prompt (engine only, no HTTP server).
    (LLAMA2_7B, 1, 0.139),
    (LLAMA2_13B, 1, 0.242),
    (LLAMA2_70B, 4, 0.402),
])
def test_first_token_latency_matches_published(model: Model, tp: int, measured_s: float) -> None:
    p = analytic_profile(model, A100, tp, 1)
    pred = p.fixed_s - SERVER_OVERHEAD_S + 2048 * p.prefill_s_per_token
    assert abs(pred / measured_s - 1) <= BAND, f"{LMDEPLOY}: predicted {pred:.3f} s vs {measured_s:.3f} s"


@pytest.mark.parametrize(("gpu", "measured_s"), [(A100, 0.2340), (H100, 0.1538)])
def test_end_to_end_latency_matches_nemo(gpu: GpuType, measured_s: float) -> None:
    pred = analytic_profile(LLAMA2_7B, gpu, 1, 1).call_latency_s(128, 20)
    assert abs(pred / measured_s - 1) <= BAND, f"{NEMO}: predicted {pred:.3f} s vs {measured_s:.3f} s on {gpu.name}"


def test_cli_profiles_show_json_lists_only_fitting_configs() -> None:
    r = CliRunner().invoke(app, ["profiles", "show", "Qwen2.5-72B-Instruct", "--gpu", "RTX A6000", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert {(p["tp"], p["pp"]) for p in doc["profiles"]} == {(4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)}
    assert {(e["tp"], e["pp"]) for e in doc["excluded"]} == {(1, 1), (2, 1), (1, 2)}
    assert all("does not fit" in e["reason"] for e in doc["excluded"])
    assert all(math.isfinite(p["decode_s_per_token"]) for p in doc["profiles"])
    assert len(doc["breakdown"]) == 10 and "kv_bytes_per_token" in doc["breakdown"][0]


def test_cli_profiles_show_table_and_errors() -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["profiles", "show", "Qwen2.5-7B-Instruct", "--gpu", "A6000", "--gpus-per-node", "4"])
    assert r.exit_code == 0, r.output
    assert "Excluded" not in r.output  # tp=8 and pp=8 are not in a 4-GPU node's config set
    bad = runner.invoke(app, ["profiles", "show", "nope", "--gpu", "A6000"])
    assert bad.exit_code == 1 and "unknown model" in bad.output  # a value FlowMaker rejects (docs/cli.md)
    bad_gpu = runner.invoke(app, ["profiles", "show", "Qwen2.5-7B-Instruct", "--gpu", "V100"])
    assert bad_gpu.exit_code == 1 and "unknown GPU type" in bad_gpu.output
