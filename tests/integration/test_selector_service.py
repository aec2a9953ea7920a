"""The selector service on loopback over a real etcd: live cluster, loads from reuse mappings, stored
profiles (MEASURED preferred), analytic fallback, and bad requests answered INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest

from flowmaker import convert
from flowmaker.api.selector.v1 import selector_pb2, selector_pb2_grpc
from flowmaker.domain import Cluster, Profile, ProfileSource, Slo, Stage, Workflow
from flowmaker.errors import DeadlineExceeded, InvalidSpec
from flowmaker.rpc.channels import insecure_channel
from flowmaker.rpc.errors import call, field_violations
from flowmaker.state import keys
from flowmaker.state.records import GpuRecord, InstanceRecord, InstanceState, NodeRecord
from services.selector.servicer import add_servicers
from services.selector.settings import SelectorSettings

pytestmark = pytest.mark.integration

MODEL = "Llama-3.1-8B-Instruct"
WF = Workflow("wf", (Stage("answer", input_tokens=200, output_tokens=50, prompt_template="{input}"),))


async def seed(store: Any, *, load: float = 0.0) -> None:
    """One alive A6000 node with 2 GPUs and a READY 8B instance on gpu0 (22.4 GB used)."""
    await store.put(keys.node("n0"), NodeRecord("n0", "A6000", 2).to_json())
    await store.put(keys.gpu("n0", "n0-gpu0"), GpuRecord("n0-gpu0", "n0", "A6000", 48.0, 22.4).to_json())
    await store.put(keys.gpu("n0", "n0-gpu1"), GpuRecord("n0-gpu1", "n0", "A6000", 48.0, 0.0, 1).to_json())
    inst = InstanceRecord("i-8b", MODEL, 1, 1, "n0", ("n0-gpu0",), 22.4, InstanceState.READY, "http://x")
    await store.put(keys.instance("i-8b"), inst.to_json())
    if load:
        await store.put(keys.reuse("i-8b", "other-task"), {"task_id": "other-task", "instance_id": "i-8b",
                                                          "load_output_tokens_per_s": load})


@pytest.fixture
async def selector(etcd_store: Any, start_service: Any) -> Any:
    settings = SelectorSettings(host="127.0.0.1", port=0, grace_s=0.5)
    server = await start_service("selector", lambda s: add_servicers(s, settings, etcd_store), settings)
    channel = insecure_channel(server.address, default_timeout_s=10)
    yield selector_pb2_grpc.SelectorServiceStub(channel)
    await channel.close(None)


def request(rate: float, alpha: float = 0.2, lam: float = 10.0) -> selector_pb2.SelectVariantRequest:
    # No models, no profiles, no cluster: the service reads them live.
    return selector_pb2.SelectVariantRequest(slo=convert.slo_to_proto(Slo(alpha, lam, rate)),
                                             workflows=[convert.workflow_to_proto(WF)])


async def test_live_cluster_is_read_and_running_instance_reused(etcd_store: Any, selector: Any) -> None:
    await seed(etcd_store)
    res = convert.selection_result_from_proto(await call(selector.SelectVariant(request(rate=1.0))))
    assert res.feasible and res.variant is not None
    (a,) = res.variant.assignments
    assert a.reused and a.instance_id == "i-8b"
    assert res.variant.cost == 0.0 and res.variant.new_instances == ()
    assert res.variant.reuse == (("i-8b", 50.0),)


async def test_load_from_reuse_mappings_blocks_reuse(etcd_store: Any, selector: Any) -> None:
    # The analytic 8B tp1 profile sustains ~471 tok/s; 450 already used + 50 more does not fit.
    await seed(etcd_store, load=450.0)
    res = convert.selection_result_from_proto(await call(selector.SelectVariant(request(rate=1.0))))
    assert res.variant is not None
    assert not any(a.reused for a in res.variant.assignments)
    (new,) = res.variant.new_instances
    # gpu0 has 25.6 GB free, gpu1 48: LeastLoaded takes gpu1 first.
    assert new.gpu_ids[0] == "n0-gpu1"


async def test_measured_profile_preferred_over_analytic(etcd_store: Any, selector: Any) -> None:
    await seed(etcd_store)
    slow = Profile(MODEL, 1, 1, 22.4, fixed_s=5.0, prefill_s_per_token=0.0, decode_s_per_token=0.1,
                   max_output_tokens_per_s=500.0, gpu_type="A6000", source=ProfileSource.MEASURED)
    fast = Profile(MODEL, 1, 1, 22.4, fixed_s=0.01, prefill_s_per_token=0.0, decode_s_per_token=0.001,
                   max_output_tokens_per_s=500.0, gpu_type="A6000", source=ProfileSource.ANALYTIC)
    for p in (slow, fast):
        d = {k: getattr(p, k) for k in Profile.__dataclass_fields__}
        d["source"] = p.source.value
        await etcd_store.put(keys.profile("A6000", MODEL, 1, 1, p.source.value), d)
    res = convert.selection_result_from_proto(await call(selector.SelectVariant(request(rate=1.0, lam=100))))
    assert res.variant is not None
    (a,) = res.variant.assignments
    assert a.reused and a.instance_id == "i-8b"
    assert a.latency_s == pytest.approx(5.0 + 0.1 * 50)  # the MEASURED profile's numbers


async def test_no_gpus_is_infeasible_not_an_error(selector: Any) -> None:
    res = convert.selection_result_from_proto(await call(selector.SelectVariant(request(rate=1.0))))
    assert not res.feasible and res.reason is not None and res.reason.value == "NO_GPU_MEMORY"


async def test_bad_input_names_the_field(selector: Any) -> None:
    req = request(rate=1.0)
    req.workflows[0].stages[0].input_tokens = -5
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await selector.SelectVariant(req)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(ei.value)] == ["workflows[0].stages[0].input_tokens"]

    req = request(rate=1.0, alpha=1.5)
    with pytest.raises(InvalidSpec) as e2:
        await call(selector.SelectVariant(req))
    assert e2.value.field == "slo.min_accuracy"

    req = request(rate=1.0)
    req.strategy = "nope"
    with pytest.raises(InvalidSpec) as e3:  # a bad option value, not a missing resource
        await call(selector.SelectVariant(req))
    assert e3.value.reason == "UNKNOWN_STRATEGY"


def _start_process(module: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-m", module], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, env={**os.environ, "OTEL_TRACES_EXPORTER": "none", **env})
    assert p.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 0.2)[0]:
            line = p.stdout.readline()
            if line.startswith("FLOWMAKER_READY "):
                return p, json.loads(line.split(" ", 1)[1])["address"]
            if not line and p.poll() is not None:
                break
    p.kill()
    raise RuntimeError(f"{module} did not start (exit code {p.poll()})")


async def test_service_processes_start_serve_and_stop_on_sigterm(etcd: Any, etcd_store: Any,
                                                                 etcd_namespace: str) -> None:
    """`python -m services.selector` and `python -m services.orchestrator` as real processes."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    await seed(etcd_store)
    common = {"ETCD_ENDPOINTS": etcd.endpoint, "ETCD_NAMESPACE": etcd_namespace, "PORT": "0"}
    sel, sel_addr = _start_process("services.selector", {f"FLOWMAKER_SELECTOR_{k}": v for k, v in common.items()})
    orch, orch_addr = _start_process("services.orchestrator", {
        **{f"FLOWMAKER_ORCHESTRATOR_{k}": v for k, v in common.items()},
        "FLOWMAKER_ORCHESTRATOR_SELECTOR_ADDRESS": sel_addr})
    try:
        channel = insecure_channel(sel_addr, default_timeout_s=10)
        res = convert.selection_result_from_proto(
            await call(selector_pb2_grpc.SelectorServiceStub(channel).SelectVariant(request(rate=1.0))))
        assert res.variant is not None and res.variant.assignments[0].instance_id == "i-8b"
        await channel.close(None)
        channel = insecure_channel(orch_addr, default_timeout_s=10)
        r = await call(orchestrator_pb2_grpc.OrchestratorServiceStub(channel).DeployTask(
            orchestrator_pb2.DeployTaskRequest(description="Summarize customer support tickets",
                                               slo=convert.slo_to_proto(Slo(0.2, 10.0, 1.0)))))
        assert r.task.candidates and await etcd_store.get(keys.task(r.task.id)) is not None
        await channel.close(None)
    finally:
        for p in (orch, sel):
            p.send_signal(signal.SIGTERM)
        rcs = [p.wait(15) for p in (orch, sel)]
    assert rcs == [0, 0]


async def test_answers_are_proven_and_a_spent_budget_is_deadline_exceeded(etcd_store: Any, selector: Any) -> None:
    await seed(etcd_store)
    res = convert.selection_result_from_proto(await call(selector.SelectVariant(request(rate=1.0))))
    assert res.optimal and not res.timed_out and res.lower_bound == res.variant.cost == 0.0  # type: ignore[union-attr]
    req = request(rate=1.0)
    req.options.time_budget_s = 1e-9  # no time to find any variant
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await selector.SelectVariant(req)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(DeadlineExceeded) as e:
        await call(selector.SelectVariant(req))
    assert e.value.reason == "SELECTION_DEADLINE_EXCEEDED"


async def test_the_call_deadline_bounds_exact_on_a_hard_request(selector: Any) -> None:
    """A 15-stage chain that takes exact far longer than the call's deadline to prove: the answer still comes
    back in time, with the best variant found and a proven lower bound (or proven optimal on a fast machine)."""
    from flowmaker.bench.selector import adversarial_request

    req = convert.selection_request_to_proto(adversarial_request("chain15", 1))
    res = convert.selection_result_from_proto(await call(selector.SelectVariant(req, timeout=6.0)))
    assert res.variant is not None
    assert 0.0 <= res.lower_bound <= res.variant.cost * (1 + 1e-9)
    assert res.optimal or res.timed_out


def test_with_deadline_caps_the_budget_and_keeps_a_margin() -> None:
    from flowmaker.domain import SelectionOptions, SelectionRequest
    from services.selector.servicer import with_deadline

    req = SelectionRequest(Slo(0.2, 10.0, 1.0), (WF,), (), (), Cluster(), SelectionOptions(time_budget_s=5.0))
    assert with_deadline(req, None) is req
    assert with_deadline(req, 100.0) is req  # the budget is already shorter
    assert 0.0 < with_deadline(req, 2.0).options.time_budget_s < 2.0
    unbudgeted = SelectionRequest(Slo(0.2, 10.0, 1.0), (WF,), (), (), Cluster())
    assert 0.0 < with_deadline(unbudgeted, 1.0).options.time_budget_s < 1.0
    with pytest.raises(DeadlineExceeded):
        with_deadline(req, 0.01)
