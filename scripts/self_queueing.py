"""How much one engine instance slows its OWN calls as its load grows (`python scripts/self_queueing.py [--traces DIR]`).

The GPU-sharing multiplier of the selection spec, m = f (1 - rho) / (1 - rho f), is 1 for an instance with no busy
co-resident, whatever its own compute share rho: it takes a profile's latency alone to hold up to the utilization
cap. The engine model (simulator and emulated node) does not: prefill is not chunked, so every admitted prompt
stalls the whole batch, and a call waits behind the prompts admitted before and during it. This measures that with
the engine model itself: a lone Qwen2.5-14B-Instruct tp4 on an A6000, Poisson arrivals of single calls whose (prompt,
output) tokens are drawn from each trace, at busy-time utilizations rho (prefill + decode at the full-batch rate,
the selector's busy-time capacity). Prints, per trace and rho, the mean latency over the mean latency alone (ratio of
means), the mean and 90th percentile of the per-call ratios, and M/M/1's 1 / (1 - rho), as JSON and a table. Asserts
nothing. Real traces from --traces (e.g. ../shared/reference/traces); without it the synthetic ones.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from flowmaker.catalog import default_models, get_gpu_type
from flowmaker.domain import Profile
from flowmaker.engine import Completion, EngineModel
from flowmaker.eval.traces import get_trace
from flowmaker.profiling.analytic import KV_RESERVED_TOKENS, MAX_BATCH, profiles_for

MODEL, TP = "Qwen2.5-14B-Instruct", 4
RHOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CALLS = 3000
MAX_IN, MAX_OUT = 8192, 2048  # the eval tasks' per-call limits (flowmaker.eval.tasks)


def _replay(prof: Profile, shapes: list[tuple[int, int]], rate: float, seed: int) -> list[tuple[float, float]]:
    """(latency, latency alone) of CALLS Poisson calls at `rate` per second on one engine."""
    rng = random.Random(seed)
    eng = EngineModel(prof, MAX_BATCH, KV_RESERVED_TOKENS)
    sub: dict[str, tuple[float, float]] = {}
    done: list[tuple[float, float]] = []

    def collect(cs: list[Completion]) -> None:
        for c in cs:
            t0, alone = sub.pop(c.req_id)
            done.append((c.finish_time - t0, alone))

    t = 0.0
    for k in range(CALLS):
        t += rng.expovariate(rate)
        i, o = rng.choice(shapes)
        collect(eng.advance(t))
        eng.submit(str(k), i, o, t)
        sub[str(k)] = (t, prof.call_latency_s(i, o))
    while (nt := eng.next_event_time()) is not None:
        collect(eng.advance(nt))
    return done


def run(traces: str | None, seed: int = 1) -> dict[str, list[dict[str, float]]]:
    prof = next(p for p in profiles_for(default_models(), get_gpu_type("A6000"), max_gpus=8)
                if p.model_id == MODEL and p.tp == TP and p.pp == 1)
    out: dict[str, list[dict[str, float]]] = {}
    for kind in ("code", "conv"):
        trace = get_trace(kind, traces, 0)
        shapes = [(min(r.context_tokens, MAX_IN), max(1, min(r.generated_tokens, MAX_OUT))) for r in trace.requests]
        busy = statistics.mean(i * prof.prefill_s_per_token + o / prof.pure_decode_tokens_per_s for i, o in shapes)
        rows = []
        for rho in RHOS:
            done = _replay(prof, shapes, rho / busy, seed)
            ratios = sorted(a / b for a, b in done)
            rows.append({"rho": rho, "ratio_of_means": sum(a for a, _ in done) / sum(b for _, b in done),
                         "mean_ratio": statistics.mean(ratios), "p90_ratio": ratios[int(0.9 * len(ratios))],
                         "mm1": 1 / (1 - rho)})
        out[kind] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=None, help="folder with the Azure 2023 trace CSVs (default: synthetic)")
    res = run(ap.parse_args().traces)
    print(json.dumps(res, indent=1))
    print("\n| trace | rho | latency / alone (ratio of means) | mean of ratios | p90 of ratios | M/M/1 |")
    print("|---|---|---|---|---|---|")
    for kind, rows in res.items():
        for r in rows:
            print(f"| {kind} | {r['rho']:.1f} | {r['ratio_of_means']:.2f} | {r['mean_ratio']:.2f} | "
                  f"{r['p90_ratio']:.2f} | {r['mm1']:.2f} |")


if __name__ == "__main__":
    main()
