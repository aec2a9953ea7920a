"""Calibrate the GPU-sharing model (flowmaker/sharing.py) against the simulator: prints JSON and a table.

Two one-stage tasks (chat on Qwen2.5-7B tp1 = A, translate on Qwen2.5-3B tp1 = B), Poisson arrivals with token
counts drawn from the trace, 600 s each: A alone, B alone, then both on ONE emulated A6000 (dynamic co-location).
For each rate pair it reports the measured busy fractions against the model's `1 - exp(-N)` (N: call-seconds
offered per second at latency alone), and A's measured mean-latency slowdown beside B against the model's
`m = f (1 - rho) / (1 - rho f)`, f = 1 + kappa x b_B (kappa = 1, the simulator's processor sharing).

    .venv/bin/python scripts/calibrate_sharing.py [--traces ../shared/reference/traces] [--kind code] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from flowmaker.catalog import default_models, get_gpu_type, make_cluster
from flowmaker.eval.tasks import get_task
from flowmaker.eval.traces import Arrival, get_trace
from flowmaker.profiling.analytic import profiles_for
from flowmaker.sharing import occupancy, predicted_slowdown
from flowmaker.sim import Route, SimInstance, TaskDeployment, simulate

GPU = get_gpu_type("A6000")
MODELS = default_models()
BY_ID = {m.id: m for m in MODELS}
PROFILES = profiles_for(MODELS, GPU, max_gpus=8)
CLUSTER = make_cluster("A6000", nodes=1, gpus_per_node=8)
SPAN_S = 600.0
PAIRS = [(0.5, 0.5), (0.5, 2.0), (0.5, 5.0), (1.0, 1.0), (1.0, 4.0), (0.3, 8.0), (2.0, 2.0)]


def _prof(model: str) -> object:
    return next(p for p in PROFILES if p.model_id == model and p.tp == 1 and p.pp == 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=Path(__file__).resolve().parents[1] / ".." / "shared" /
                    "reference" / "traces")
    ap.add_argument("--kind", default="code")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trace = get_trace(args.kind, args.traces if args.traces.is_dir() else None, 0)
    toks = [(r.context_tokens, r.generated_tokens) for r in trace.requests]

    def arrivals(task: str, rate: float, seed: int) -> list[Arrival]:
        rnd, t, out = random.Random(seed), 0.0, []
        while (t := t + rnd.expovariate(rate)) <= SPAN_S:
            c, g = toks[rnd.randrange(len(toks))]
            out.append(Arrival(t, task, f"{task}-{len(out)}", c, g))
        return out

    specs = {"A": ("chat", "chat-direct", _prof("Qwen2.5-7B-Instruct")),
             "B": ("translate", "tr-direct", _prof("Qwen2.5-3B-Instruct"))}

    def run(which: dict[str, float]):  # type: ignore[no-untyped-def]
        insts, deps, arr = [], [], []
        for k, rate in which.items():
            task, wf_id, p = specs[k]
            insts.append(SimInstance(k, p, ("node0-gpu0",)))  # type: ignore[arg-type]
            t = get_task(task)
            wf = t.candidate(wf_id).instantiate(100, 100)
            deps.append(TaskDeployment(t, (Route(wf_id, tuple((s.id, k) for s in wf.llm_stages)),)))
            arr += arrivals(task, rate, 1 if k == "A" else 2)
        return simulate(insts, deps, arr, CLUSTER.gpus, BY_ID, GPU, duration_s=SPAN_S, colocation="dynamic",
                        keep_latencies=True)

    rows = []
    for ra, rb in PAIRS:
        a, b, both = run({"A": ra}), run({"B": rb}), run({"A": ra, "B": rb})
        ma, mb = a.per_instance[0], b.per_instance[0]
        la = statistics.mean(lat for _, lat, _ in a.latencies)
        lab = statistics.mean(lat for rid, lat, _ in both.latencies if rid.startswith("chat"))
        pred = predicted_slowdown([occupancy(mb.offered)], rho=ma.utilization)
        rows.append({"rate_a": ra, "rate_b": rb, "busy_a": ma.busy_fraction, "model_busy_a": occupancy(ma.offered),
                     "busy_b": mb.busy_fraction, "model_busy_b": occupancy(mb.offered), "rho_a": ma.utilization,
                     "slowdown_a": lab / la, "model_slowdown_a": pred})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"GPU sharing model vs the simulator ({args.kind} trace tokens, one A6000)")
    for c in ("A req/s", "B req/s", "busy A sim/model", "busy B sim/model", "rho A", "A slowdown sim", "model"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(f"{r['rate_a']:g}", f"{r['rate_b']:g}", f"{r['busy_a']:.2f} / {r['model_busy_a']:.2f}",
                  f"{r['busy_b']:.2f} / {r['model_busy_b']:.2f}", f"{r['rho_a']:.2f}", f"{r['slowdown_a']:.2f}",
                  "inf" if r["model_slowdown_a"] == float("inf") else f"{r['model_slowdown_a']:.2f}")
    Console(width=140).print(t)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
