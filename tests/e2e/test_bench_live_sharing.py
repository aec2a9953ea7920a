"""End to end: `flowmaker bench live-sharing` at a tiny scale (2 tasks on ONE emulated GPU, ~15 s of load).

Runs the CLI as a subprocess (it starts and stops its own local stack), then checks the JSON report: its fields,
that instances share a GPU (placement), that every shared stage has a positive predicted and measured latency,
and that nothing the bench started is left running. Bounded to < 90 s wall (about 25 s on 2 idle cores).
Skip with FLOWMAKER_SKIP_E2E=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowmaker.launcher import StackConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]

TASK_FIELDS = {"name", "state", "workflow_id", "rate_rps", "slo_latency_s", "predicted_latency_s", "selected_latency_s",
               "prediction_rederived", "ok", "measured",
               "latency_p50_s", "latency_p95_s", "p95_over_slo", "slo_met"}
STAGE_FIELDS = {"task", "stage_id", "instance_id", "model_id", "gpu_ids", "shared", "co_residents", "n",
                "predicted_latency_s", "selected_latency_s", "measured_mean_s", "ratio_measured_over_predicted",
                "ratio_measured_over_selected", "alone_nominal_s",
                "predicted_multiplier", "measured_multiplier", "multiplier_predicted_final"}
INSTANCE_FIELDS = {"instance_id", "gpu_ids", "shared", "busy_share_predicted", "busy_share_measured",
                   "gpu_slowdown_while_busy", "f_predicted_final", "f_with_measured_busy"}


def _stack_processes(work_dir: Path) -> list[int]:
    """Processes started by the stack in `work_dir` (the launcher marks them FLOWMAKER_STACK=<work dir>)."""
    marker = f"FLOWMAKER_STACK={work_dir}\0".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if marker in (d / "environ").read_bytes() + b"\0":
                out.append(int(d.name))
        except OSError:
            continue
    return out


def test_live_sharing_smoke(tmp_path: Path) -> None:
    if not os.path.exists(StackConfig().etcd_bin):
        pytest.skip("etcd not installed")
    out, work = tmp_path / "report.json", tmp_path / "stack"
    env = {**os.environ, "FLOWMAKER_STATE_FILE": "/nonexistent/flowmaker-stack.json", "COLUMNS": "200"}
    p = subprocess.run(
        [sys.executable, "-m", "flowmaker.cli.main", "bench", "live-sharing", "--tasks", "extract,chat",
         "--gpus", "1", "--time-scale", "2", "--duration", "15", "--warmup", "5", "--drain", "10",
         "--out", str(out), "--work-dir", str(work)],
        capture_output=True, text=True, env=env, timeout=85, check=False)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stdout + p.stderr
    assert "predicted (the orchestrator's current prediction" in p.stdout  # the human table

    res = json.loads(out.read_text())
    assert "error" not in res, res.get("error")
    assert {"config", "placement", "tasks", "stages", "instances", "summary", "wall_s"} <= set(res)

    # Two instances on one GPU: the placement shares it.
    pl = res["placement"]
    assert pl["sharing"] and pl["shared_gpus"], pl
    assert any(len(pl["by_gpu"][g]) >= 2 for g in pl["shared_gpus"]), pl

    assert [t["name"] for t in res["tasks"]] == ["extract", "chat"]
    for t in res["tasks"]:
        assert TASK_FIELDS <= set(t), t
        assert t["state"] == "ACTIVE" and t["ok"] > 0, t
        assert t["latency_p95_s"] > 0 and t["p95_over_slo"] > 0 and t["slo_latency_s"] > 0, t

    shared = [s for s in res["stages"] if s["shared"]]
    assert shared, res["stages"]
    # The first task was deployed before its co-resident: the product's prediction of it was re-derived on the
    # placement (read from the API) and is above the selection's, made when it had the GPU alone.
    first = res["tasks"][0]
    assert first["prediction_rederived"] and first["predicted_latency_s"] > first["selected_latency_s"], first
    assert all(s["predicted_latency_s"] >= s["selected_latency_s"] for s in shared if s["task"] == "extract")
    for s in shared:
        assert STAGE_FIELDS <= set(s), s
        assert s["co_residents"], s
        assert s["n"] > 0, s
        assert s["predicted_latency_s"] > 0 and s["measured_mean_s"] > 0, s
        assert s["ratio_measured_over_predicted"] > 0, s
        # the plan's simulated twin predicts every shared stage (a positive latency at load, >= alone)
        assert s["twin_predicted_s"] is not None and s["twin_predicted_s"] >= 0.99 * s["alone_nominal_s"], s
    for i in res["instances"]:
        assert INSTANCE_FIELDS <= set(i), i
    assert all(i["shared"] for i in res["instances"])
    assert res["summary"]["shared_stages"] == len(shared)
    assert not res["summary"]["twin_error"] and len(res["summary"]["shared_twin_ratios"]) == len(shared)
    # the selector's model re-evaluated on the final placement: one ratio per shared stage, counted consistently
    finals = res["summary"]["shared_final_ratios"]
    assert len(finals) == len(shared) and all(x is None or x > 0 for x in finals), finals
    assert res["summary"]["shared_final_within_25pct"] == sum(x is not None and abs(x - 1) <= 0.25 for x in finals)

    # Everything the bench started (etcd, services, engines) is gone.
    assert not _stack_processes(work), "processes of the bench's stack still running"
