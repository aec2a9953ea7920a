"""The packaged model and GPU catalogs, config.json import, and the cluster builder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from flowmaker.catalog import (
    default_models,
    get_gpu_type,
    get_model,
    gpu_types,
    make_cluster,
    model_from_hf_config,
    params_from_arch,
)
from flowmaker.cli.catalog import register
from flowmaker.errors import InvalidSpec, NotFound

# Only this area's commands, so other areas' CLI modules cannot break these tests.
app = typer.Typer()
register(app)

REF = Path(__file__).resolve().parents[3] / "shared" / "reference"
DEFAULT_IDS = [
    "Llama-3.2-1B-Instruct", "Llama-3.2-3B-Instruct", "Llama-3.1-8B-Instruct", "Llama-3.1-70B-Instruct",
    "Qwen2.5-1.5B-Instruct", "Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct", "Qwen2.5-14B-Instruct",
    "Qwen2.5-32B-Instruct", "Qwen2.5-72B-Instruct", "Mistral-7B-Instruct-v0.3",
]

# Qwen2.5-7B-Instruct's config.json (the fields FlowMaker reads, values as published on Hugging Face).
QWEN7_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def test_default_models_are_the_eleven_in_order_with_accuracy_range() -> None:
    ms = default_models()
    assert [m.id for m in ms] == DEFAULT_IDS
    accs = {m.id: m.accuracy for m in ms}
    # The seed's 14.4%-48.0% span, exactly at both ends.
    assert accs["Llama-3.2-1B-Instruct"] == pytest.approx(0.1444)
    assert accs["Qwen2.5-72B-Instruct"] == pytest.approx(0.4798)
    assert min(accs.values()) == accs["Llama-3.2-1B-Instruct"] and max(accs.values()) == accs["Qwen2.5-72B-Instruct"]
    for m in ms:
        assert m.arch is not None and m.source.startswith("https://")


@pytest.mark.skipif(not (REF / "models.csv").exists(), reason="needs ../shared/reference")
def test_catalog_matches_reference_csv() -> None:
    ref = {r["name"]: r for r in csv.DictReader((REF / "models.csv").open())}
    for m in default_models():
        r = ref[m.id]
        assert m.accuracy == pytest.approx(float(r["leaderboard_avg"]) / 100)
        assert m.params_b == pytest.approx(float(r["params_b"]))
        assert m.arch is not None
        assert (m.arch.layers, m.arch.hidden, m.arch.heads, m.arch.kv_heads, m.arch.vocab) == (
            int(r["layers"]), int(r["hidden"]), int(r["heads"]), int(r["kv_heads"]), int(r["vocab"]))


def test_params_formula_reproduces_catalog_within_2_percent() -> None:
    for m in default_models():
        assert m.arch is not None
        total, active = params_from_arch(m.arch, attention_bias=m.family == "qwen")
        assert total / 1e9 == pytest.approx(m.params_b, rel=0.02), m.id
        assert active == total  # all dense


def test_get_model_by_id_or_hf_id_and_unknown_lists_known_names() -> None:
    assert get_model("qwen/qwen2.5-7b-instruct").id == "Qwen2.5-7B-Instruct"
    assert get_model("Llama-3.1-8B-Instruct").params_b == pytest.approx(8.03)
    with pytest.raises(NotFound) as ei:
        get_model("GPT-5")
    assert "Mistral-7B-Instruct-v0.3" in str(ei.value) and ei.value.field == "model"


def test_gpu_catalog_and_aliases() -> None:
    gs = gpu_types()
    assert set(gs) == {"A6000", "A100-80G", "H100", "H200", "L40S", "L4"}
    a6000 = gs["A6000"]
    assert (a6000.memory_gb, a6000.mem_bw_gbps, a6000.bf16_tflops) == (48, 768, 154.8)
    assert a6000.interconnect == "PCIe" and a6000.interconnect_gbps == 32  # PCIe 4.0 x16 per direction
    assert gs["H100"].interconnect == "NVLink" and gs["H100"].interconnect_gbps == 450
    for g in gs.values():
        assert g.price_per_hour > 0 and g.source
    for alias, name in [("RTX A6000", "A6000"), ("nvidia rtx a6000", "A6000"), ("A100 80GB", "A100-80G"),
                        ("a100-80gb", "A100-80G"), ("H100-SXM", "H100"), ("h200", "H200"), ("NVIDIA L4", "L4")]:
        assert get_gpu_type(alias).name == name, alias
    with pytest.raises(NotFound) as ei:
        get_gpu_type("V100")
    assert "A6000" in str(ei.value)


def test_model_from_hf_config_computes_params() -> None:
    m = model_from_hf_config(QWEN7_CONFIG, "my-qwen", 0.352)
    assert m.params_b == pytest.approx(7.616, rel=0.001)  # with Qwen2's q/k/v bias
    assert m.arch is not None and m.arch.head_dim == 128 and m.arch.kv_heads == 4
    assert m.accuracy == 0.352 and m.active_params_b == m.params_b
    # Mixtral-8x7B (MoE): 46.70B total, 12.88B active.
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
               "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    mx = model_from_hf_config(mixtral, "mixtral", 0.2382)
    assert mx.params_b == pytest.approx(46.703, rel=0.001) and mx.active_params_b == pytest.approx(12.88, rel=0.001)


@pytest.mark.parametrize(("change", "field"), [
    ({"num_hidden_layers": None}, "config.num_hidden_layers"),
    ({"hidden_size": 0}, "config.hidden_size"),
    ({"num_attention_heads": "28"}, "config.num_attention_heads"),
    ({"num_key_value_heads": 5}, "config.num_key_value_heads"),
    ({"torch_dtype": "int4"}, "config.torch_dtype"),
    ({"intermediate_size": 1.5}, "config.intermediate_size"),
])
def test_model_from_hf_config_bad_key_names_the_field(change: dict, field: str) -> None:
    cfg = {k: v for k, v in QWEN7_CONFIG.items() if not (k in change and change[k] is None)}
    cfg.update({k: v for k, v in change.items() if v is not None})
    with pytest.raises(InvalidSpec) as ei:
        model_from_hf_config(cfg, "x", 0.3)
    assert ei.value.field == field


def test_model_from_hf_config_bad_accuracy() -> None:
    with pytest.raises(InvalidSpec) as ei:
        model_from_hf_config(QWEN7_CONFIG, "x", 35.2)  # a percentage, not a fraction
    assert ei.value.field == "accuracy"


def test_make_cluster_ids_and_padding() -> None:
    c = make_cluster()
    assert [g.id for g in c.gpus] == [f"node0-gpu{i}" for i in range(8)]
    assert {g.node for g in c.gpus} == {"node0"} and all(g.memory_total_gb == 48 for g in c.gpus)
    big = make_cluster("H100", nodes=12, gpus_per_node=16)
    ids = [g.id for g in big.gpus]
    assert ids[0] == "node00-gpu00" and ids[-1] == "node11-gpu15"
    assert ids == sorted(ids)  # string order = numeric order
    assert big.gpus[0].gpu_type == "H100"
    with pytest.raises(InvalidSpec) as ei:
        make_cluster(nodes=0)
    assert ei.value.field == "nodes"


def test_cli_models_list_json() -> None:
    r = CliRunner().invoke(app, ["models", "list", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert [x["id"] for x in rows] == DEFAULT_IDS and rows[0]["arch"]["layers"] == 16
