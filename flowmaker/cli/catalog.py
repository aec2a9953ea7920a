"""`flowmaker models list` and `flowmaker profiles show`: the catalogs and the analytic profiles, offline."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from flowmaker.cli.output import console, fail_from

if TYPE_CHECKING:  # the catalog and the profile model load numpy: imported by the commands that use them
    from flowmaker.errors import FlowMakerError
    from flowmaker.profiling.analytic import ProfileBreakdown

models_app = typer.Typer(help="The model catalog.", no_args_is_help=True)
profiles_app = typer.Typer(help="Analytic (roofline) profiles of a model on a GPU type.", no_args_is_help=True)
gpus_app = typer.Typer(help="The GPU-type catalog.", no_args_is_help=True)


def _fail(e: FlowMakerError) -> typer.Exit:
    fail_from(e)  # prints the one error line and exits 1 (docs/cli.md, "Exit codes")


@models_app.command("list")
def models_list(as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
                ) -> None:
    """The default models with accuracy (Open LLM Leaderboard v2 average / 100) and architecture."""
    from flowmaker.catalog import default_models

    models = default_models()
    if as_json:
        rows = []
        for m in models:
            a = m.arch
            rows.append({"id": m.id, "hf_id": m.hf_id, "family": m.family, "accuracy": m.accuracy,
                         "params_b": m.params_b, "active_params_b": m.active_params_b,
                         "arch": None if a is None else {
                             "layers": a.layers, "hidden": a.hidden, "intermediate": a.intermediate,
                             "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "vocab": a.vocab,
                             "max_ctx": a.max_ctx, "dtype_bytes": a.dtype_bytes,
                             "tie_word_embeddings": a.tie_word_embeddings, "num_experts": a.num_experts,
                             "experts_per_tok": a.experts_per_tok},
                         "source": m.source})
        typer.echo(json.dumps(rows, indent=2))
        return
    t = Table(title="Default models (accuracy = Open LLM Leaderboard v2 average / 100)")
    t.add_column("model", no_wrap=True)
    for c in ("accuracy", "params (B)", "layers", "hidden", "heads", "kv heads", "max ctx"):
        t.add_column(c, justify="right")
    for m in models:
        a = m.arch
        assert a is not None  # the packaged catalog always carries the architecture
        t.add_row(m.id, f"{m.accuracy:.4f}", f"{m.params_b:.3f}", str(a.layers), str(a.hidden), str(a.heads),
                  str(a.kv_heads), str(a.max_ctx))
    console().print(t)


@gpus_app.command("list")
def gpus_list(as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
              ) -> None:
    """GPU types: memory, bandwidth, dense BF16 TFLOPS, interconnect used for TP/PP, price."""
    from flowmaker.catalog import gpu_types

    gs = list(gpu_types().values())
    if as_json:
        typer.echo(json.dumps([{"name": g.name, "memory_gb": g.memory_gb, "mem_bw_gbps": g.mem_bw_gbps,
                                "bf16_tflops": g.bf16_tflops, "interconnect": g.interconnect,
                                "interconnect_gbps": g.interconnect_gbps, "price_per_hour": g.price_per_hour,
                                "source": g.source} for g in gs], indent=2))
        return
    t = Table(title="GPU types (interconnect bandwidth per direction)")
    for c in ("GPU", "memory GB", "bandwidth GB/s", "BF16 TFLOPS", "interconnect", "link GB/s", "$/GPU-hour"):
        t.add_column(c, justify="left" if c in ("GPU", "interconnect") else "right")
    for g in gs:
        t.add_row(g.name, f"{g.memory_gb:g}", f"{g.mem_bw_gbps:g}", f"{g.bf16_tflops:g}", g.interconnect,
                  f"{g.interconnect_gbps:g}", f"{g.price_per_hour:.2f}")
    console().print(t)


@profiles_app.command("show")
def profiles_show(
    model: Annotated[str, typer.Argument(help="Model id from `flowmaker models list`.")],
    gpu: Annotated[str, typer.Option("--gpu", help="GPU type (A6000, A100-80G, H100, H200, L40S, L4).")] = "A6000",
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1,
                                               help="An instance lives on one node: tp*pp <= this.")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (with every intermediate number).")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="Also print the intermediate numbers.")] = False,
) -> None:
    """Analytic profile of MODEL for every (tp, pp) that fits one node; excluded configs with the reason."""
    from flowmaker.catalog import get_gpu_type, get_model
    from flowmaker.errors import FlowMakerError
    from flowmaker.profiling.analytic import config_set, explain_profile

    try:
        m = get_model(model)
        g = get_gpu_type(gpu)
        rows = [explain_profile(m, g, tp, pp) for tp, pp in config_set(gpus_per_node)]
    except FlowMakerError as e:
        raise _fail(e) from e
    ok = [b for b in rows if not b.excluded]
    bad = [b for b in rows if b.excluded]
    if as_json:
        typer.echo(json.dumps({
            "model_id": m.id, "gpu_type": g.name, "gpus_per_node": gpus_per_node,
            "profiles": [{"model_id": b.model_id, "tp": b.tp, "pp": b.pp, "memory_gb_per_gpu": b.memory_gb_per_gpu,
                          "fixed_s": b.fixed_s, "prefill_s_per_token": b.prefill_s_per_token,
                          "decode_s_per_token": b.decode_s_per_token,
                          "max_output_tokens_per_s": b.max_output_tokens_per_s, "gpu_type": b.gpu_type,
                          "source": "ANALYTIC"} for b in ok],
            "excluded": [{"tp": b.tp, "pp": b.pp, "reason": b.excluded} for b in bad],
            "breakdown": [b.as_dict() for b in rows],
        }, indent=2))
        return
    con = console()
    t = Table(title=f"{m.id} on {g.name} (analytic roofline; formulas in docs/profiles.md)")
    for c in ("tp", "pp", "GPUs", "mem/GPU GB", "fixed s", "prefill ms/tok", "decode ms/tok", "max out tok/s"):
        t.add_column(c, justify="right")
    for b in ok:
        t.add_row(str(b.tp), str(b.pp), str(b.tp * b.pp), f"{b.memory_gb_per_gpu:.1f}", f"{b.fixed_s:.4f}",
                  f"{b.prefill_s_per_token * 1e3:.4f}", f"{b.decode_s_per_token * 1e3:.2f}",
                  f"{b.max_output_tokens_per_s:.0f}")
    con.print(t)
    if bad:
        ex = Table(title="Excluded configs")
        ex.add_column("tp", justify="right")
        ex.add_column("pp", justify="right")
        ex.add_column("reason")
        for b in bad:
            ex.add_row(str(b.tp), str(b.pp), b.excluded)
        con.print(ex)
    if explain:
        for b in ok:
            con.print(_explain_table(b))


def _explain_table(b: ProfileBreakdown) -> Table:
    """One config's intermediate numbers, each next to the formula that produced it (docs/profiles.md)."""
    x = Table(title=f"tp={b.tp} pp={b.pp}: how the numbers come about", show_lines=False)
    x.add_column("quantity")
    x.add_column("value", justify="right")
    x.add_column("formula")
    rows = [
        ("weights/GPU", f"{b.weights_gb_per_gpu:.2f} GB", f"{b.params_b:.3f}e9 params x dtype / (tp*pp)"),
        ("KV bytes/token (model)", f"{b.kv_bytes_per_token}", "2 * layers * kv_heads * head_dim * dtype"),
        ("KV heads/GPU", f"{b.kv_heads_per_gpu}", "max(1, kv_heads / tp) (replicated when kv_heads < tp)"),
        ("KV reserved/GPU", f"{b.kv_reserved_gb_per_gpu:.2f} GB",
         "KV_RESERVED_TOKENS * 2*(layers/pp)*kv_heads_per_gpu*head_dim*dtype"),
        ("memory/GPU", f"{b.memory_gb_per_gpu:.2f} GB", f"weights + KV + {b.runtime_overhead_gb:g} GB runtime"),
        ("FLOPs/prompt token", f"{b.flops_per_prompt_token / 1e9:.2f} G", "2*active_params + attention"),
        ("prefill compute", f"{b.prefill_compute_s_per_token * 1e3:.4f} ms",
         f"FLOPs / (tp * {b.bf16_tflops:g} TFLOPS * MFU)"),
        ("prefill TP comm", f"{b.prefill_tp_comm_s_per_token * 1e3:.4f} ms",
         f"2*layers * 2(tp-1)/tp * hidden*dtype / ({b.interconnect_gbps:g} GB/s * eff)"),
        ("prefill PP hops", f"{b.prefill_pp_hop_s_per_token * 1e3:.4f} ms", "(pp-1) * hidden*dtype / link"),
        ("decode weights", f"{b.decode_weights_s * 1e3:.3f} ms",
         f"weights / tp / ({b.mem_bw_gbps:g} GB/s * eff)  (pp stages in turn)"),
        ("decode KV read", f"{b.decode_kv_s * 1e3:.3f} ms", f"pp * {b.decode_context_tokens} tok * KV/token/GPU / bw"),
        ("one all-reduce", f"{b.allreduce_s * 1e6:.1f} us",
         f"2(tp-1)*{b.hop_latency_s * 1e6:g} us + 2(tp-1)/tp * hidden*dtype / link"),
        ("decode TP comm", f"{b.decode_tp_comm_s * 1e3:.3f} ms", "2 * layers * all-reduce"),
        ("decode PP hops", f"{b.decode_pp_hop_s * 1e3:.3f} ms", "(pp-1) * (hop latency + hidden*dtype / link)"),
        ("decode step overhead", f"{b.decode_step_overhead_s * 1e3:.3f} ms", "DECODE_STEP_OVERHEAD_S"),
        ("fixed: server", f"{b.fixed_server_s * 1e3:.2f} ms", "SERVER_OVERHEAD_S"),
        ("fixed: weights pass", f"{b.fixed_weights_pass_s * 1e3:.2f} ms", "weights / tp / bw (prefill reads all once)"),
        ("fixed: comm latency", f"{b.fixed_comm_latency_s * 1e3:.3f} ms", "2*layers*all-reduce latency + (pp-1)*hop"),
        ("batch (sequences)", f"{b.batch}", "KV_RESERVED_TOKENS // (REF_PROMPT + REF_OUTPUT)"),
        ("stage step", f"{b.stage_step_s * 1e3:.2f} ms ({b.step_bound})",
         f"max(mem {b.stage_step_memory_s * 1e3:.2f}, compute {b.stage_step_compute_s * 1e3:.2f}) + comm + overhead"),
        ("decode tok/s at batch", f"{b.decode_tokens_per_s_at_batch:.0f}", "(batch/pp) / stage step"),
        ("prefill s/output tok", f"{b.prefill_s_per_output_token * 1e3:.4f} ms", "(REF_PROMPT/REF_OUTPUT) * prefill / pp"),
        ("max output tok/s", f"{b.max_output_tokens_per_s:.0f}", "1 / (1/decode tok/s + prefill s/output tok)"),
    ]
    for r in rows:
        x.add_row(*r)
    return x


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
    app.add_typer(gpus_app, name="gpus")
    app.add_typer(profiles_app, name="profiles")
