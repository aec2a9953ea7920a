"""How bursty each replayed trace segment is (`python scripts/segment_bursts.py [--traces DIR] [--seeds 0-7]`).

`flowmaker bench serving` replays one segment per (trace, seed) at four time scales; every policy plans before the
segment's traffic arrives, from the rates it has seen so far. A segment whose requests bunch into a short window
(a flash crowd) overloads any plan sized for its mean rate, and favours whichever policy deployed the most capacity
by accident. This prints, per trace and seed, the scored requests of the declared experiment at 25% load and the
largest share of them that arrives within any window of WINDOW_FRACTION of the run (and that window's rate over
the run's mean rate), as JSON and a table. Time scaling does not change either figure. Asserts nothing. Real
traces from --traces (e.g. ../shared/reference/traces); without it the synthetic ones.
"""

from __future__ import annotations

import argparse
import bisect
import json

from flowmaker.bench.serving import bench_cluster
from flowmaker.eval.experiment import load_experiment
from flowmaker.eval.traces import build_request_segment_workload, get_trace

WINDOW_FRACTION = 1 / 18  # about 20 s of the 361 s runs at 25% load
LOAD = 0.25


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=None, help="folder with the Azure 2023 trace CSVs (default: synthetic)")
    ap.add_argument("--seeds", default="0-7", help="a seed or a range, e.g. 0-7")
    args = ap.parse_args()
    exp = load_experiment(None)
    _, gpu, profiles, _, by_id = bench_cluster(exp.gpu_type, exp.gpus)
    rows = []
    for kind in ("code", "conv"):
        tasks = exp.tasks_for(kind, profiles, by_id, gpu)
        for seed in _seeds(args.seeds):
            trace = get_trace(kind, args.traces, seed)
            rates = [(t.name, t.nominal_rate_rps * LOAD) for t in tasks]
            wl = build_request_segment_workload(rates, trace, LOAD, seed, exp.segment_requests,
                                                exp.deploy_span_fraction, exp.monitor_window_fraction)
            ts = sorted(a.time_s for a in wl.arrivals)
            w = wl.duration_s * WINDOW_FRACTION
            peak = max((bisect.bisect_right(ts, t + w) - i for i, t in enumerate(ts)), default=0)
            n = len(ts)
            rows.append({"trace": kind, "seed": seed, "requests": n, "peak_share": round(peak / n, 3) if n else 0.0,
                         "peak_over_mean_rate": round(peak / n / WINDOW_FRACTION, 2) if n else 0.0})
    print(json.dumps({"window_fraction": WINDOW_FRACTION, "load": LOAD, "rows": rows}, indent=1))
    print(f"\n{'trace':6} {'seed':>4} {'requests':>8} {'peak share':>10} {'peak / mean rate':>16}")
    for r in rows:
        print(f"{r['trace']:6} {r['seed']:>4} {r['requests']:>8} {r['peak_share']:>10.2f} {r['peak_over_mean_rate']:>16.1f}")


if __name__ == "__main__":
    main()
