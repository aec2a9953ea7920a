"""How long the orchestrator's live prediction takes as the placement grows (`python scripts/prediction_scale.py`).

`predict_on_placement` (every serving task's latency on the whole placement) and `slo_breaks` (two of them: before
and after one task's move) are pure Python that the orchestrator runs on each placement change and each approval or
re-selection under GPU sharing. Seeded placements of N tasks, each a two-LLM-stage workflow on an instance of its own
on one of G GPUs (so several share a GPU). Prints JSON and a table; asserts nothing.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import replace

from flowmaker.domain import Instance, Profile, Slo, Stage, StageAssignment, StageKind, Variant, Workflow
from flowmaker.orchestration.predict import predict_on_placement, slo_breaks
from flowmaker.orchestration.task import TaskRecord, TaskState, selected_prediction

MODEL = "m"
PROFILE = Profile(MODEL, 1, 1, memory_gb_per_gpu=3.0, fixed_s=0.03, prefill_s_per_token=0.0003,
                  decode_s_per_token=0.003, max_output_tokens_per_s=300.0)
WF = Workflow("w", (Stage("ask", input_tokens=100, output_tokens=20),
                    Stage("look", kind=StageKind.TOOL, latency_s=0.1, depends_on=("ask",)),
                    Stage("say", input_tokens=50, output_tokens=10, depends_on=("look",))))
KAPPA = 0.7
SIZES = ((7, 8), (50, 32), (200, 64))


def placement(tasks: int, gpus: int, seed: int = 0) -> tuple[list[TaskRecord], list[Instance]]:
    rng = random.Random(seed)
    recs, insts = [], []
    for i in range(tasks):
        gpu, iid = f"g{rng.randrange(gpus)}", f"i{i}"
        v = Variant("w", tuple(StageAssignment(s.id, MODEL, 1, 1, False, new_key="new-0", gpu_ids=(gpu,),
                                               latency_s=PROFILE.call_latency_s(s.input_tokens, s.output_tokens))
                               for s in WF.stages if s.is_llm),
                    (), (), latency_s=0.5, accuracy=0.4, cost=0.0, new_memory_gb=3.0, new_gpus=1)
        recs.append(TaskRecord(f"t{i}", "d", Slo(0.1, 5.0, 0.5), candidates=(WF,), state=TaskState.ACTIVE, variant=v,
                               stage_instances={"ask": iid, "say": iid}, **selected_prediction(v)))
        insts.append(Instance(iid, MODEL, 1, 1, (gpu,), 15.0))
    return recs, insts


def run() -> list[dict[str, float]]:
    rows = []
    for tasks, gpus in SIZES:
        recs, insts = placement(tasks, gpus)
        profiles = {PROFILE.key: PROFILE}
        t0 = time.perf_counter()
        predict_on_placement(recs, insts, profiles, KAPPA)
        t1 = time.perf_counter()
        slo_breaks(recs, insts, profiles, KAPPA, replace(recs[0], planned_rate_rps=2.0))
        t2 = time.perf_counter()
        rows.append({"tasks": tasks, "gpus": gpus, "predict_ms": round((t1 - t0) * 1e3, 1),
                     "slo_breaks_ms": round((t2 - t1) * 1e3, 1)})
    return rows


def main() -> None:
    rows = run()
    json.dump(rows, sys.stdout, indent=1)
    print("\n\n| tasks | GPUs | predict_on_placement ms | slo_breaks ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['tasks']} | {r['gpus']} | {r['predict_ms']} | {r['slo_breaks_ms']} |")


if __name__ == "__main__":
    main()
