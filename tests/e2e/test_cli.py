"""End to end: the `flowmaker` CLI as a subprocess against a whole local stack (real etcd, five service processes).

Skip with FLOWMAKER_SKIP_E2E=1 (it starts ~8 processes and takes about a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowmaker.launcher import LocalStack, StackConfig, free_port
from flowmaker.launcher.procs import is_same_alive

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]

EXTRACT = "Extract entities and fields from a document into JSON that follows a given schema."
SUMMARIZE = "Summarise a document (meeting notes, an article, a report) in a few paragraphs."


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    cfg = StackConfig(time_scale=50.0, log_level="WARNING", work_dir=tmp_path_factory.mktemp("stack"),
                      keep_work_dir=True, startup_timeout_s=120.0)
    if not os.path.exists(cfg.etcd_bin):
        pytest.skip(f"etcd not installed at {cfg.etcd_bin}")
    s = LocalStack(cfg)
    s.start()
    try:
        yield s
    finally:
        # Everything the stack started (services, their engines) must be gone afterwards: no orphans.
        # Only the stack's own processes: the test session's etcd (tests/conftest.py) also descends from
        # pytest and rightly outlives this stack.
        before = s.processes()
        assert before, "the stack reports no process"
        s.stop()
        left = [pid for pid, st in before if is_same_alive(pid, st)]
        assert not left, f"processes left running after stop: {left}"


def cli(*args: str, env_extra: dict[str, str] | None = None, timeout: float = 180.0,
        state_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    # Only what the test passes decides where the CLI connects (not the developer's own stack or env).
    env = {k: v for k, v in os.environ.items() if k not in ("FLOWMAKER_ORCHESTRATOR_ADDR", "FLOWMAKER_DEPLOYER_ADDR")}
    env.update({"FLOWMAKER_STATE_FILE": str(state_file or "/nonexistent/flowmaker-stack.json"), "COLUMNS": "200",
                **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def ok_json(p: subprocess.CompletedProcess[str]) -> Any:
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return json.loads(p.stdout)


def assert_one_line_error(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr + p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_unreachable_orchestrator_is_one_clear_line() -> None:
    p = cli("task", "list", "--orchestrator", f"127.0.0.1:{free_port()}")
    line = assert_one_line_error(p, "UNAVAILABLE", "cannot reach")
    assert line.startswith("error: ")


def test_round_trip(stack: LocalStack) -> None:
    orch = ["--orchestrator", stack.addresses["orchestrator"]]
    # deploy: candidates from the generator, waiting for approval
    t = ok_json(cli("task", "deploy", EXTRACT, "--accuracy", "0.15", "--latency", "6", "--rate", "0.5",
                    "--name", "extract", "--json", *orch))
    assert t["state"] == "STATE_AWAITING_APPROVAL"
    assert t["slo"]["min_accuracy"] == pytest.approx(0.15)
    ids = [w["id"] for w in t["candidates"]]
    assert ids, t
    task_id = t["id"]

    # approve one candidate: selected, deployed, ACTIVE
    t = ok_json(cli("task", "approve", task_id, ids[0], "--json", *orch))
    assert t["state"] == "STATE_ACTIVE", t
    assert t["approved_workflow_ids"] == [ids[0]]
    assert t["variant"]["workflow_id"] == ids[0]
    assert float(t.get("predicted_latency_s", t["variant"].get("latency_s", 0))) <= 6.0

    # invoke (unary and streamed)
    r = ok_json(cli("task", "invoke", task_id, "On 3 May 2024 Ana Lopez joined Acme Corp as CTO.", "--json", *orch))
    assert r["output"].strip()
    assert r["latency_s"] > 0
    assert {s["stage_id"] for s in r["stages"]} <= {s["id"] for w in t["candidates"] if w["id"] == ids[0]
                                                    for s in w["stages"]}
    p = cli("task", "invoke", task_id, "Bob founded Foo Inc in 1999.", "--stream", *orch)
    assert p.returncode == 0, p.stderr
    assert "done" in p.stdout

    # get / list / instances
    # Accounting is batched off the request path (observe_flush_interval_s): the count arrives within seconds.
    deadline = time.monotonic() + 10
    while True:
        g = ok_json(cli("task", "get", task_id, "--json", *orch))
        if int(g.get("requests_served", 0)) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert g["id"] == task_id and g["state"] in ("STATE_ACTIVE", "STATE_DEGRADED")
    assert int(g.get("requests_served", 0)) >= 2
    listed = ok_json(cli("task", "list", "--json", *orch))
    assert task_id in [x["id"] for x in listed["tasks"]]
    inst = ok_json(cli("instances", "--json", "--deployer", stack.addresses["deployer"]))
    mine = [i for i in inst["instances"] if task_id in i.get("task_ids", [])]
    assert mine, inst
    used = sum(g_.get("memory_used_gb", 0.0) for g_ in inst["gpus"])
    assert used > 0
    assert len(inst["gpus"]) == 8

    # human-readable forms render too
    p = cli("task", "get", task_id, *orch)
    assert p.returncode == 0 and task_id in p.stdout and "ACTIVE" in p.stdout, p.stdout + p.stderr

    # delete: the instances only this task used are stopped
    d = ok_json(cli("task", "delete", task_id, "--json", *orch))
    assert set(d.get("released_instance_ids", [])) == {i["id"] for i in mine if i.get("task_ids") == [task_id]}
    deadline = time.monotonic() + 30
    while True:
        inst = ok_json(cli("instances", "--json", "--deployer", stack.addresses["deployer"]))
        if not [i for i in inst["instances"] if task_id in i.get("task_ids", [])] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not [i for i in inst["instances"] if task_id in i.get("task_ids", [])]
    p = cli("task", "get", task_id, "--json", *orch)
    if p.returncode != 0:
        assert_one_line_error(p, "NOT_FOUND")
    else:
        assert json.loads(p.stdout)["state"] == "STATE_DELETING"


def test_deploy_with_approve_all(stack: LocalStack) -> None:
    t = ok_json(cli("task", "deploy", SUMMARIZE, "--accuracy", "0.2", "--latency", "15", "--rate", "0.5",
                    "--approve", "all", "--json", "--orchestrator", stack.addresses["orchestrator"]))
    assert t["state"] == "STATE_ACTIVE", t
    assert sorted(t["approved_workflow_ids"]) == sorted(w["id"] for w in t["candidates"])
    ok_json(cli("task", "delete", t["id"], "--json", "--orchestrator", stack.addresses["orchestrator"]))


def test_bad_accuracy_is_one_clear_line(stack: LocalStack) -> None:
    p = cli("task", "deploy", EXTRACT, "--accuracy", "45", "--latency", "6", "--rate", "0.5",
            "--orchestrator", stack.addresses["orchestrator"])
    line = assert_one_line_error(p, "INVALID_ARGUMENT", "min_accuracy")
    assert "45" in line


def test_unknown_task_is_not_found(stack: LocalStack) -> None:
    p = cli("task", "get", "no-such-task", "--orchestrator", stack.addresses["orchestrator"])
    assert_one_line_error(p, "NOT_FOUND")


def test_orchestrator_from_env_and_state_file(stack: LocalStack, tmp_path: Path) -> None:
    p = cli("task", "list", "--json", env_extra={"FLOWMAKER_ORCHESTRATOR_ADDR": stack.addresses["orchestrator"]})
    assert p.returncode == 0, p.stderr
    assert isinstance(json.loads(p.stdout).get("tasks", []), list)
    state = tmp_path / "stack.json"
    state.write_text(json.dumps({**stack.state(), "ready": True}))  # our own pid: a live `up`
    p = cli("task", "list", "--json", state_file=state)
    assert p.returncode == 0, p.stderr


def test_address_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowmaker.launcher.client import ClientSettings, resolve

    state = tmp_path / "stack.json"
    state.write_text(json.dumps({"pid": os.getpid(), "services": {"orchestrator": "127.0.0.1:1111"}}))
    s = ClientSettings(state_file=state)  # type: ignore[call-arg]
    assert resolve("orchestrator", None, s) == "127.0.0.1:1111"
    assert resolve("orchestrator", "h:2", s) == "h:2"
    monkeypatch.setenv("FLOWMAKER_ORCHESTRATOR_ADDR", "h:3")
    assert resolve("orchestrator", None, ClientSettings(state_file=state)) == "h:3"  # type: ignore[call-arg]
    # A state file whose `flowmaker up` is gone is ignored.
    state.write_text(json.dumps({"pid": 2**22 + 12345, "services": {"deployer": "127.0.0.1:1"}}))
    assert resolve("deployer", None, ClientSettings(state_file=state)) == "127.0.0.1:50054"  # type: ignore[call-arg]


def test_service_env_wires_peers_and_the_emulated_node(tmp_path: Path) -> None:
    from flowmaker.launcher.stack import service_env

    addrs = {"selector": "127.0.0.1:1", "orchestrator": "127.0.0.1:2", "deployer": "127.0.0.1:3"}
    cfg = StackConfig(gpus=4, gpu_type="H100", time_scale=7.0)
    orch = service_env("orchestrator", host="127.0.0.1", port=2, addrs=addrs, etcd_endpoint="127.0.0.1:9",
                       cfg=cfg, log_dir=tmp_path)
    assert orch["FLOWMAKER_ORCHESTRATOR_SELECTOR_ADDRESS"] == "127.0.0.1:1"
    assert orch["FLOWMAKER_ORCHESTRATOR_ETCD_ENDPOINTS"] == "127.0.0.1:9"
    assert orch["FLOWMAKER_ORCHESTRATOR_TOOL_TIME_SCALE"] == "7.0"
    assert "FLOWMAKER_ORCHESTRATOR_ORCHESTRATOR_ADDRESS" not in orch
    dep = service_env("deployer", host="127.0.0.1", port=3, addrs=addrs, etcd_endpoint="127.0.0.1:9", cfg=cfg,
                      log_dir=tmp_path)
    assert (dep["FLOWMAKER_DEPLOYER_GPU_COUNT"], dep["FLOWMAKER_DEPLOYER_GPU_TYPE"]) == ("4", "H100")
    assert dep["FLOWMAKER_DEPLOYER_ENGINE_TIME_SCALE"] == "7.0" and dep["FLOWMAKER_DEPLOYER_USE_NVML"] == "false"


def test_missing_etcd_is_a_clear_error(tmp_path: Path) -> None:
    from flowmaker.launcher import StackError

    s = LocalStack(StackConfig(etcd_bin=str(tmp_path / "no-etcd")))
    with pytest.raises(StackError, match="etcd binary not found"):
        s.start()
