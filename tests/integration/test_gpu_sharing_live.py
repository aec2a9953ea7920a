"""The live stack plans under GPU sharing by default (real etcd, a deployer with emulated engine processes, a selector
and an orchestrator on gRPC): a task approved without options is selected under INTERFERENCE / BUSY_TIME with the
kappa stored for the cluster's GPU type, explicit options win; an emulated engine under load gets a measured busy
share in its record and in the selector's view; each running instance in the selector's view carries the slowdown
its tasks tolerate (SLO / latency alone), the task being re-selected left out. The meter and the tolerance rule
(pure) are tested here too."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest

from flowmaker import convert
from flowmaker.api.common.v1 import selection_pb2, task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.api.selector.v1 import selector_pb2, selector_pb2_grpc
from flowmaker.domain import Profile, ProfileSource, Slo, Stage, StageAssignment, StageKind, Variant, Workflow
from flowmaker.engine.loaded import Arrivals, Call, InstanceLoad, placement_latencies
from flowmaker.orchestration.cluster import (
    alone_latency_s,
    planned_busy_shares,
    read_live_cluster,
    task_uses,
    tolerated_slowdowns,
)
from flowmaker.orchestration.task import Reselection, TaskRecord, TaskState
from flowmaker.rpc.channels import insecure_channel
from flowmaker.rpc.errors import call
from flowmaker.selection.busytime import busy_capacity
from flowmaker.sharing import occupancy
from flowmaker.state import keys
from flowmaker.state.etcd import EtcdStore
from flowmaker.state.interference import InterferenceRecord, InterferenceStore
from flowmaker.state.records import InstanceRecord, InstanceState, reuse_load
from services.deployer.node import BusyMeter, DeployParams, NodeAgent
from services.deployer.servicer import service_hooks
from services.deployer.settings import DeployerSettings
from services.orchestrator.clients import Clients
from services.orchestrator.orchestrator import Orchestrator
from services.orchestrator.servicer import add_servicers as add_orchestrator
from services.orchestrator.settings import OrchestratorSettings
from services.selector.servicer import SelectorServicer
from services.selector.settings import SelectorSettings

pytestmark = pytest.mark.integration

MODEL = "Llama-3.2-1B-Instruct"
ACTIVE = task_pb2.Task.STATE_ACTIVE
# A MEASURED profile cheaper (memory x latency) than any analytic one, so every selection below picks it, and
# whose latency is easy to compute by hand: a call of 50 prompt / 10 output tokens takes 0.02 + 0.01 + 0.02 =
# 0.05 s alone.
PROFILE = Profile(MODEL, 1, 1, memory_gb_per_gpu=2.0, fixed_s=0.02, prefill_s_per_token=0.0002,
                  decode_s_per_token=0.002, max_output_tokens_per_s=400.0, gpu_type="A6000",
                  source=ProfileSource.MEASURED)
ONE = Workflow("one", (Stage("answer", input_tokens=50, output_tokens=10, prompt_template="{input}"),))
ALONE_S = 0.02 + 0.0002 * 50 + 0.002 * 10
# Long prompts, short answers: a call keeps the instance busy 1000 x 0.0002 + 10 / 400 = 0.225 s (busy-time capacity
# 10 / 0.225 = 44 tok/s, a ninth of the profile's 400 at its reference request).
LONG = Workflow("long", (Stage("answer", input_tokens=1000, output_tokens=10, prompt_template="{input}"),))
LONG_ALONE_S = 0.02 + 0.0002 * 1000 + 0.002 * 10
KAPPA = 0.6  # what the "profiler" stored for A6000


async def _put_profile(store: Any, p: Profile) -> None:
    await store.put(keys.profile("A6000", p.model_id, p.tp, p.pp, "MEASURED"),
                    {"memory_gb_per_gpu": p.memory_gb_per_gpu, "fixed_s": p.fixed_s,
                     "prefill_s_per_token": p.prefill_s_per_token, "decode_s_per_token": p.decode_s_per_token,
                     "max_output_tokens_per_s": p.max_output_tokens_per_s, "source": "MEASURED"})


# ---- the pure parts ----------------------------------------------------------------------------------


def test_busy_meter_counter_gauge_and_unknown() -> None:
    # The emulated engine's counter: model seconds busy over model seconds (wall x time scale), smoothed.
    m = BusyMeter(time_scale=5.0, half_life_s=1.0)
    assert m.add(0.0, 0.0, 3.0) is None and not m.should_report(0.0, 0.05, 5.0)  # one reading: no interval yet
    assert m.add(1.0, 2.5, 3.0) == pytest.approx(0.5)  # 2.5 model s busy of 5
    assert m.should_report(1.0, 0.05, 5.0)
    m.reported = (0.5, 1.0)
    assert m.add(2.0, 2.5 + 5.0, 3.0) == pytest.approx(0.75)  # fully busy for one half-life: halfway to 1
    assert m.add(3.0, 7.5 + 50.0, 0.0) == pytest.approx(0.875)  # clamped to 1 (never above)
    assert m.add(4.0, 1.0, 0.0) == pytest.approx(0.875)  # the counter went back (a restart): no interval
    assert m.add(5.0, 1.0, 0.0) == pytest.approx(0.4375)  # idle from the reset on
    assert not BusyMeter().should_report(0.0, 0.05, 5.0)
    # A non-zero share is refreshed before readers find it stale; a small move alone is not worth a write.
    m.reported = (0.44, 5.0)
    assert not m.should_report(6.0, 0.05, 5.0) and m.should_report(10.0, 0.05, 5.0)
    # vLLM: no counter, the running gauge sampled at each scrape (fraction of scrapes that found calls running).
    g = BusyMeter(time_scale=1.0, half_life_s=1.0)
    assert g.add(0.0, None, 2.0) == 1.0
    assert g.add(1.0, None, 0.0) == pytest.approx(0.5)
    assert g.add(2.0, None, 0.0) == pytest.approx(0.25)
    # Neither: unknown.
    u = BusyMeter()
    assert u.add(0.0, None, None) is None and u.add(1.0, None, None) is None


def test_tolerated_slowdown_is_slo_over_latency_alone() -> None:
    dag = Workflow("dag", (
        Stage("a", input_tokens=50, output_tokens=10, calls_per_request=2),
        Stage("tool", kind=StageKind.TOOL, latency_s=1.0),
        Stage("b", depends_on=("a", "tool"), input_tokens=50, output_tokens=10),
    ))
    # Slowed latencies in the variant (as under INTERFERENCE) must not matter: alone is recomputed.
    v = Variant("dag", (StageAssignment("a", MODEL, 1, 1, True, "i1", latency_s=9.0),
                        StageAssignment("b", MODEL, 1, 1, True, "i2", latency_s=9.0)),
                (), (("i1", 1.0), ("i2", 1.0)), latency_s=18.0, accuracy=0.5, cost=0.0, new_memory_gb=0.0,
                new_gpus=0)
    profiles = {PROFILE.key: PROFILE}
    assert alone_latency_s(dag, v, profiles) == pytest.approx(max(2 * ALONE_S, 1.0) + ALONE_S)
    assert alone_latency_s(dag, v, {}) is None
    t1 = TaskRecord("t1", "d", Slo(0.1, 3.0, 1.0), candidates=(dag,), state=TaskState.ACTIVE, variant=v,
                    stage_instances={"a": "i1", "b": "i2"})
    one = Variant("one", (StageAssignment("answer", MODEL, 1, 1, True, "i2"),), (), (("i2", 1.0),), 0.2, 0.5,
                  0.0, 0.0, 0)
    t2 = TaskRecord("t2", "d", Slo(0.1, 1.0, 1.0), candidates=(ONE,), state=TaskState.ACTIVE, variant=one,
                    stage_instances={"answer": "i2"})
    t3 = TaskRecord("t3", "d", Slo(0.1, 0.04, 1.0), candidates=(ONE,), state=TaskState.ACTIVE, variant=one,
                    stage_instances={"answer": "i3"})  # misses its SLO even alone: nothing may slow it
    waiting = TaskRecord("t4", "d", Slo(0.1, 0.2, 1.0), candidates=(ONE,), state=TaskState.AWAITING_APPROVAL,
                         variant=one, stage_instances={"answer": "i4"})
    got = tolerated_slowdowns([t1, t2, t3, waiting], profiles)
    assert got == pytest.approx({"i1": 3.0 / (1.0 + ALONE_S), "i2": min(3.0 / (1.0 + ALONE_S), 1.0 / ALONE_S),
                                 "i3": 1.0})
    assert tolerated_slowdowns([t1, t2], profiles, exclude="t1") == pytest.approx({"i2": 1.0 / ALONE_S})


def test_planned_busy_share_counts_replicas_and_a_switchs_next_variant() -> None:
    profiles = {PROFILE.key: PROFILE}
    two = Variant("one", (StageAssignment("answer", MODEL, 1, 1, False, "", new_key="n0", replica_keys=("n0", "n1")),),
                  (), (), 0.05, 0.5, 0.0, 4.0, 2)
    one = Variant("one", (StageAssignment("answer", MODEL, 1, 1, True, "i3"),), (), (("i3", 1.0),), 0.05, 0.5, 0.0,
                  0.0, 0)
    # On two replicas at 4 req/s (planned after a re-selection), switching to one instance at 6 req/s.
    t = TaskRecord("t1", "d", Slo(0.1, 1.0, 1.0), candidates=(ONE,), state=TaskState.ACTIVE, variant=two,
                   stage_instances={"answer": "i1", "answer#1": "i2"}, planned_rate_rps=4.0, next_variant=one,
                   next_stage_instances={"answer": "i3"}, last_reselection=Reselection(0.0, "ramp", 6.0))
    uses = list(task_uses([t], profiles))
    assert [u.offered for u in uses] == [pytest.approx({"i1": 2 * ALONE_S, "i2": 2 * ALONE_S}),
                                         pytest.approx({"i3": 6 * ALONE_S})]
    assert all(u.alone_s == pytest.approx(ALONE_S) for u in uses)
    # A second task on i1 at its SLO's rate adds its call-seconds: occupancy of the sum.
    t2 = TaskRecord("t2", "d", Slo(0.1, 1.0, 0.5), candidates=(ONE,), state=TaskState.ACTIVE, variant=one,
                    stage_instances={"answer": "i1"})
    got = planned_busy_shares(task_uses([t, t2], profiles))
    assert got == pytest.approx({"i1": occupancy(2.5 * ALONE_S), "i2": occupancy(2 * ALONE_S),
                                 "i3": occupancy(6 * ALONE_S)})
    assert planned_busy_shares(task_uses([t, t2], profiles, exclude="t1")) == pytest.approx(
        {"i1": occupancy(0.5 * ALONE_S)})
    assert planned_busy_shares(task_uses([t], {})) == {}  # no profile: nothing known


# ---- the live stack ----------------------------------------------------------------------------------


class RecordingSelector(SelectorServicer):
    """The real selector, keeping every request it was sent (what the orchestrator plans with)."""

    def __init__(self, settings: SelectorSettings, store: Any) -> None:
        super().__init__(settings, store)
        self.requests: list[selector_pb2.SelectVariantRequest] = []

    async def SelectVariant(self, request: selector_pb2.SelectVariantRequest,
                            context: grpc.aio.ServicerContext) -> selector_pb2.SelectVariantResponse:
        self.requests.append(request)
        return await super().SelectVariant(request, context)


@dataclass
class Stack:
    store: Any
    agent: NodeAgent
    selector: RecordingSelector
    core: Orchestrator
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub

    async def deploy(self, name: str, slo: Slo, options: selection_pb2.SelectionOptions | None = None,
                     workflow: Workflow = ONE) -> Any:
        t = (await call(self.stub.DeployTask(pb.DeployTaskRequest(
            description=name, name=name, slo=convert.slo_to_proto(slo),
            workflows=[convert.workflow_to_proto(workflow)])))).task
        n = len(self.selector.requests)
        req = pb.ApproveWorkflowsRequest(task_id=t.id, workflow_ids=[workflow.id])
        if options is not None:
            req.options.CopyFrom(options)
        got = (await call(self.stub.ApproveWorkflows(req, timeout=60))).task
        assert got.state == ACTIVE, got.failure.message
        assert len(self.selector.requests) == n + 1
        return got

    def last_request(self) -> selector_pb2.SelectVariantRequest:
        return self.selector.requests[-1]


@contextlib.asynccontextmanager
async def _stack(etcd_store: Any, start_service: Any, *, gpus: int = 2, **orchestrator: Any) -> AsyncIterator[Stack]:
    """etcd, a deployer of `gpus` emulated A6000s, the (recording) selector and an orchestrator (`orchestrator`:
    settings beside the tests' defaults), each on gRPC."""
    await _put_profile(etcd_store, PROFILE)
    await InterferenceStore(etcd_store).put(InterferenceRecord.measured("A6000", KAPPA))
    dset = DeployerSettings(host="127.0.0.1", port=0, grace_s=0.5, node="n0", gpu_type="A6000", gpu_count=gpus,
                            use_nvml=False, engine_time_scale=20.0, engine_start_timeout_s=30, engine_stop_grace_s=2,
                            lease_ttl_s=5)
    agent = NodeAgent(etcd_store, dset)
    add_deployer, deployer_ready = service_hooks(agent)
    await start_service("deployer", add_deployer, dset, on_ready=deployer_ready, on_shutdown=[agent.shutdown])

    sset = SelectorSettings(host="127.0.0.1", port=0, grace_s=0.5)
    selector = RecordingSelector(sset, etcd_store)

    def add_selector(server: grpc.aio.Server) -> list[str]:
        selector_pb2_grpc.add_SelectorServiceServicer_to_server(selector, server)
        return [selector_pb2.DESCRIPTOR.services_by_name["SelectorService"].full_name]

    sel = await start_service("selector", add_selector, sset)
    oset = OrchestratorSettings(host="127.0.0.1", port=0, grace_s=0.5, selector_address=sel.address,
                                deploy_timeout_s=60, tool_time_scale=20.0, reconcile_interval_s=0.5,
                                # memory x latency, as PROFILE's premise says, unless a test asks for priced GPUs
                                **{"follow_load": False, "default_gpu_price_gb": 0.0, **orchestrator})
    clients = Clients(oset.selector_address, timeout_s=30)
    orch = Orchestrator(oset, etcd_store, clients)

    async def close() -> None:
        await orch.close()
        await clients.close()

    async def ready(_running: Any) -> None:
        await orch.resume()

    o = await start_service("orchestrator", lambda s: add_orchestrator(s, orch), oset, on_ready=ready,
                            on_shutdown=[close])
    channel = insecure_channel(o.address, default_timeout_s=60)
    try:
        yield Stack(etcd_store, agent, selector, orch, orchestrator_pb2_grpc.OrchestratorServiceStub(channel))
    finally:
        await channel.close(None)


@pytest.fixture
async def stack(etcd_store: Any, start_service: Any) -> AsyncIterator[Stack]:
    async with _stack(etcd_store, start_service) as s:
        yield s


async def test_defaults_reach_the_selector_and_explicit_options_win(etcd_store: Any, start_service: Any) -> None:
    product = OrchestratorSettings().default_gpu_price_gb
    async with _stack(etcd_store, start_service, default_gpu_price_gb=product) as stack:
        await _defaults_reach_the_selector(stack)


async def _defaults_reach_the_selector(stack: Stack) -> None:
    # No options at all: the orchestrator's defaults, with the kappa stored for the cluster's GPU type.
    a = await stack.deploy("plain", Slo(0.1, 3.5, 0.5))
    o = stack.last_request().options
    assert o.gpu_sharing == selection_pb2.GPU_SHARING_INTERFERENCE
    assert o.capacity_model == selection_pb2.CAPACITY_MODEL_BUSY_TIME
    assert o.HasField("interference") and o.interference == pytest.approx(KAPPA)
    assert o.utilization_cap == pytest.approx(OrchestratorSettings().default_utilization_cap) and o.utilization_cap < 1
    # priced GPUs: by default one GPU's memory (the stack's emulated GPUs have 48 GB)
    assert o.gpu_price_gb == max(g.memory_total_gb for g in stack.last_request().cluster.gpus) == 48.0
    assert a.variant.assignments[0].model_id == MODEL
    # Options that leave these unset get them too (and keep what they set).
    b = await stack.deploy("partial", Slo(0.1, 3.5, 0.5),
                           selection_pb2.SelectionOptions(allow_reuse=True, utilization_cap=0.9, interference=0.25,
                                                          gpu_price_gb=7.5))
    o = stack.last_request().options
    assert o.gpu_price_gb == 7.5
    assert (o.gpu_sharing, o.capacity_model) == (selection_pb2.GPU_SHARING_INTERFERENCE,
                                                 selection_pb2.CAPACITY_MODEL_BUSY_TIME)
    assert o.interference == pytest.approx(0.25) and o.utilization_cap == pytest.approx(0.9)
    # The paper's contract on request: explicit IGNORE / OUTPUT_TOKENS win, and no co-resident bound is sent.
    c = await stack.deploy("paper", Slo(0.1, 3.5, 0.5), selection_pb2.SelectionOptions(
        gpu_sharing=selection_pb2.GPU_SHARING_IGNORE, capacity_model=selection_pb2.CAPACITY_MODEL_OUTPUT_TOKENS,
        gpu_price_gb=0.0))
    req = stack.last_request()
    assert req.options.HasField("gpu_price_gb") and req.options.gpu_price_gb == 0.0  # memory only, as asked
    assert req.options.gpu_sharing == selection_pb2.GPU_SHARING_IGNORE
    assert req.options.capacity_model == selection_pb2.CAPACITY_MODEL_OUTPUT_TOKENS
    assert not req.options.HasField("interference")
    assert req.cluster.instances and all(i.max_slowdown == 0.0 for i in req.cluster.instances)
    # What was approved is stored as given: an operator switching the defaults changes later re-selections.
    kv = await stack.store.get(keys.task(a.id))
    assert TaskRecord.from_json(kv.value).options_json == ""
    kv = await stack.store.get(keys.task(c.id))
    assert "GPU_SHARING_IGNORE" in TaskRecord.from_json(kv.value).options_json
    # The operator's switch: with IGNORE as the default, a task without options gets the paper's contract.
    stack.core.settings = stack.core.settings.model_copy(update={"default_gpu_sharing": "IGNORE",
                                                                 "default_capacity_model": "OUTPUT_TOKENS",
                                                                 "default_utilization_cap": 1.0,
                                                                 "default_gpu_price_gb": 0.0})
    await stack.deploy("switched", Slo(0.1, 3.5, 0.5))
    o = stack.last_request().options
    assert (o.gpu_sharing, o.capacity_model) == (selection_pb2.GPU_SHARING_IGNORE,
                                                 selection_pb2.CAPACITY_MODEL_OUTPUT_TOKENS)
    assert o.utilization_cap == 1.0 and o.gpu_price_gb == 0.0
    assert b.state == ACTIVE


async def test_selector_view_carries_the_slowdown_tasks_tolerate(stack: Stack) -> None:
    a = await stack.deploy("first", Slo(0.1, 3.5, 0.5))  # tolerates 3.5 / 0.05 = 70x
    iid = a.stage_instances["answer"]
    assert list(a.variant.new_instances) and a.variant.assignments[0].model_id == MODEL
    # No task used the instance when `a` was selected: nothing bounds anything.
    assert all(i.max_slowdown == 0.0 for i in stack.last_request().cluster.instances)

    c = await stack.deploy("second", Slo(0.1, 7.0, 0.5))  # tolerates 140x; reuses a's instance
    req = stack.last_request()
    (inst,) = [i for i in req.cluster.instances if i.id == iid]
    assert inst.max_slowdown == pytest.approx(3.5 / ALONE_S)
    assert c.stage_instances["answer"] == iid  # reuse kept the first task within its tolerance
    # The selector's view carries the measured busy share when fresh (the engine is idle: 0 or close to it).
    rec = InstanceRecord.from_json((await stack.store.get(keys.instance(iid))).value)
    assert 0.0 <= inst.busy_share <= 1.0 and inst.busy_share == pytest.approx(
        rec.observed_busy_share if time.time() - rec.observed_load_at <= 15 else 0.0, abs=0.05)

    # The load follower's re-selection of `a` goes through the same request builder: `a` answers for itself
    # (the selector's latency check), so only the other task (`c`, 140x) bounds the instance.
    _, ta = await stack.core._get(a.id)
    view = await read_live_cluster(stack.store)
    follow = await stack.core._selection_request(ta, view.cluster, rate_rps=2.0, max_replicas=4)
    (inst,) = [i for i in follow.cluster.instances if i.id == iid]
    assert inst.max_slowdown == pytest.approx(7.0 / ALONE_S)
    assert follow.options.max_replicas == 4 and follow.slo.arrival_rate_rps == 2.0
    assert follow.options.gpu_sharing == selection_pb2.GPU_SHARING_INTERFERENCE


async def test_a_task_is_kept_off_an_instance_whose_task_would_miss_its_slo(stack: Stack) -> None:
    """The bound at work: a task whose SLO leaves 5 % over its latency alone shares its instance with no task that
    would slow it more; the same request without the bound (or a task asking for the paper's contract) reuses it."""
    a = await stack.deploy("tight", Slo(0.1, 1.05 * ALONE_S, 0.5))
    iid = a.stage_instances["answer"]
    heavy = Slo(0.1, 7.0, 20.0)  # 200 tok/s: the shared instance's queueing would grow ~3x
    c = await stack.deploy("heavy", heavy)
    req = stack.last_request()
    (inst,) = [i for i in req.cluster.instances if i.id == iid]
    assert inst.max_slowdown == pytest.approx(1.05)
    assert c.stage_instances["answer"] != iid and list(c.variant.new_instances)
    # The same request with the bound taken off: reuse is free, so the selector would have put it there.
    unbounded = selector_pb2.SelectVariantRequest()
    unbounded.CopyFrom(req)
    for i in unbounded.cluster.instances:
        i.max_slowdown = 0.0
    free = convert.selection_result_from_proto(await call(stack.core.clients.selector.SelectVariant(unbounded)))
    assert free.variant is not None and [r for r, _ in free.variant.reuse] == [iid]
    # The paper's contract ignores sharing altogether.
    d = await stack.deploy("paper", heavy, selection_pb2.SelectionOptions(gpu_sharing=selection_pb2.GPU_SHARING_IGNORE))
    assert d.stage_instances["answer"] == iid


# ---- the busy share measured: etcd, the node agent and a real engine ----------------------------------


TIME_SCALE = 5.0
BUSY_PROFILE = Profile(MODEL, 1, 1, memory_gb_per_gpu=4.0, fixed_s=0.0, prefill_s_per_token=0.0,
                       decode_s_per_token=0.02, max_output_tokens_per_s=200.0, gpu_type="A6000",
                       source=ProfileSource.MEASURED)


@pytest.fixture
async def agent(etcd: Any, etcd_namespace: str, etcd_store: EtcdStore) -> AsyncIterator[NodeAgent]:
    await _put_profile(etcd_store, BUSY_PROFILE)
    settings = DeployerSettings(node="node0", host="127.0.0.1", port=0, etcd_endpoints=etcd.endpoint,
                                etcd_namespace=etcd_namespace, etcd_timeout_s=3.0, use_nvml=False, gpu_type="A6000",
                                gpu_count=1, lease_ttl_s=3, engine_time_scale=TIME_SCALE, engine_stop_grace_s=3.0,
                                engine_start_timeout_s=60.0, load_scrape_interval_s=0.5, load_half_life_s=1.0,
                                load_report_max_interval_s=1.0)
    store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
    a = NodeAgent(store, settings)
    await a.start()
    try:
        yield a
    finally:
        await a.shutdown()
        await store.close()


async def _eventually(check: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def test_busy_share_is_measured_and_reaches_the_selectors_view(agent: NodeAgent, etcd_store: EtcdStore) -> None:
    rec = await agent.deploy(DeployParams(MODEL, task_id="task-a", request_id="inst-busy"))
    assert rec.state is InstanceState.READY

    async def record() -> InstanceRecord:
        kv = await etcd_store.get(keys.instance(rec.id))
        assert kv is not None
        return InstanceRecord.from_json(kv.value)

    async def client(http: aiohttp.ClientSession, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        while True:  # closed loop: a call of 100 tokens takes 2 model s (0.4 wall s) alone
            async with http.post(rec.endpoint + "/v1/completions",
                                 json={"model": MODEL, "prompt": "go", "max_tokens": 100}) as r:
                assert r.status == 200, await r.text()
                await r.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        clients = [asyncio.create_task(client(http, i * 0.05)) for i in range(4)]
        try:
            async def busy() -> InstanceRecord | None:
                r = await record()
                return r if r.observed_busy_share >= 0.8 else None

            got: InstanceRecord = await _eventually(busy, timeout_s=10.0)  # ~1 s half-life: 0.8 after ~3 s
            view = await read_live_cluster(etcd_store)
        finally:
            for t in clients:
                t.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    assert got.observed_busy_share <= 1.0 and got.observed_load_output_tokens_per_s > 0
    assert time.time() - got.observed_load_at <= 3.0  # written with the observed load's timestamp
    (inst,) = view.cluster.instances
    rec_now = view.instances[rec.id]
    assert inst.busy_share == pytest.approx(rec_now.observed_busy_share) and inst.busy_share >= 0.7
    # A stale observation is unknown (0) to readers, like the observed load.
    stale = await read_live_cluster(etcd_store, observed_max_age_s=1e-9)
    assert stale.cluster.instances[0].busy_share == 0.0

    # Idle again: the share decays (half-life 1 s) and is written down.
    async def calm() -> bool:
        return (await record()).observed_busy_share < 0.2

    await _eventually(calm, timeout_s=10.0)


# ---- planned figures before traffic arrives ----------------------------------------------------------


async def test_selector_sees_the_planned_busy_share_before_any_traffic(stack: Stack) -> None:
    """A freshly deployed instance has no measured busy share: the selector's view carries the one its tasks plan
    for (occupancy of rate x latency alone), not 0 (which the selector would replace by the compute share)."""
    a = await stack.deploy("first", Slo(0.1, 3.5, 2.0), workflow=LONG)
    iid = a.stage_instances["answer"]
    view = await read_live_cluster(stack.store)
    (raw,) = [i for i in view.cluster.instances if i.id == iid]
    assert raw.busy_share == 0.0  # nothing measured yet
    await stack.deploy("second", Slo(0.1, 3.5, 0.5))
    (inst,) = [i for i in stack.last_request().cluster.instances if i.id == iid]
    want = occupancy(2.0 * LONG_ALONE_S)
    assert want > 0.3 and inst.busy_share == pytest.approx(want)
    compute_share = inst.load_output_tokens_per_s / PROFILE.max_output_tokens_per_s
    assert inst.busy_share != pytest.approx(min(1.0, compute_share))


async def test_busy_time_commit_records_the_busy_time_equivalent_load(stack: Stack) -> None:
    """Under BUSY_TIME the planned load a commit records is the busy-time equivalent at the task's own workflow
    (what later selections read as load / max_output_tokens_per_s), not its output tokens/s; under OUTPUT_TOKENS
    it is the output tokens/s."""
    a = await stack.deploy("long", Slo(0.1, 3.5, 0.5), workflow=LONG)
    assert stack.last_request().options.capacity_model == selection_pb2.CAPACITY_MODEL_BUSY_TIME
    iid = a.stage_instances["answer"]
    tok_s = 0.5 * 10
    want = tok_s * PROFILE.max_output_tokens_per_s / busy_capacity(PROFILE, 1000.0, 10.0)
    assert want == pytest.approx(tok_s * 9.0) and want > tok_s
    assert reuse_load((await stack.store.get(keys.reuse(iid, a.id))).value) == pytest.approx(want)
    view = await read_live_cluster(stack.store)
    assert view.planned_loads[iid] == pytest.approx(want)
    # The paper's unit on request: output tokens/s as selected.
    b = await stack.deploy("tokens", Slo(0.1, 3.5, 0.5), selection_pb2.SelectionOptions(
        capacity_model=selection_pb2.CAPACITY_MODEL_OUTPUT_TOKENS), workflow=LONG)
    assert stack.last_request().options.capacity_model == selection_pb2.CAPACITY_MODEL_OUTPUT_TOKENS
    jid = b.stage_instances["answer"]
    assert reuse_load((await stack.store.get(keys.reuse(jid, b.id))).value) == pytest.approx(tok_s)


# ---- predictions kept current as the placement changes ------------------------------------------------


QWEN = "Qwen2.5-1.5B-Instruct"  # accuracy 0.18: what a task asking for 0.16 needs (Llama-3.2-1B has 0.14)
BETTER = Profile(QWEN, 1, 1, memory_gb_per_gpu=2.0, fixed_s=0.025, prefill_s_per_token=0.0002,
                 decode_s_per_token=0.002, max_output_tokens_per_s=1000.0, gpu_type="A6000",
                 source=ProfileSource.MEASURED)
BETTER_ALONE_S = 0.025 + 0.0002 * 50 + 0.002 * 10


async def _get(stack: Stack, task_id: str) -> Any:
    return (await call(stack.stub.GetTask(pb.GetTaskRequest(task_id=task_id)))).task


async def _share_one_gpu(stack: Stack, slo_a: Slo) -> tuple[Any, Any]:
    """Task A on Llama-3.2-1B, then task B needing the better model: on the one GPU, B's instance is A's
    co-resident."""
    a = await stack.deploy("first", slo_a)
    b = await stack.deploy("second", Slo(0.16, 3.5, 8.0))
    iid, jid = a.stage_instances["answer"], b.stage_instances["answer"]
    assert b.variant.assignments[0].model_id == QWEN and jid != iid and list(b.variant.new_instances)
    recs = {i: InstanceRecord.from_json((await stack.store.get(keys.instance(i))).value) for i in (iid, jid)}
    assert recs[iid].gpu_ids == recs[jid].gpu_ids
    return a, b


def _predicted(kappa: float, *, with_b: bool = True) -> tuple[float, float]:
    """(A's, B's) predicted latency with B's instance beside A's on one GPU (or A alone), by the engine load model on
    hand-built loads: A's calls at its planned 2 req/s, B's at 8 req/s, 50 prompt / 10 output tokens each."""
    loads = {"a": InstanceLoad(PROFILE, ("g",), (Arrivals(2.0, (Call("A", 50, 10),)),))}
    if with_b:
        loads["b"] = InstanceLoad(BETTER, ("g",), (Arrivals(8.0, (Call("B", 50, 10),)),))
    got = placement_latencies(loads, kappa)
    return got["a"].latency_s["A"], got["b"].latency_s["B"] if with_b else 0.0


def _threads_of(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[bool]:
    """Wrap `module.name` so that each call records whether it ran on the event loop's thread (the main one here)."""
    seen: list[bool] = []
    inner = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread() is threading.main_thread())
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return seen


async def test_a_tasks_prediction_rises_with_a_co_resident_and_falls_back_when_it_goes(
        etcd_store: Any, start_service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import services.orchestrator.predictions as predictions

    # The prediction is pure Python that grows with the placement: it runs off the loop that serves the front door.
    on_loop = _threads_of(monkeypatch, predictions, "predict_on_placement")
    await _put_profile(etcd_store, BETTER)
    async with _stack(etcd_store, start_service, gpus=1) as stack:
        a, b = await _share_one_gpu(stack, Slo(0.1, 3.5, 2.0))
        assert a.variant.latency_s == pytest.approx(ALONE_S)  # alone on its GPU when selected
        want, want_b = _predicted(KAPPA)
        alone, _ = _predicted(KAPPA, with_b=False)
        assert want > 1.05 * alone > 1.05 * ALONE_S

        def at(task_id: str, x: float) -> Callable[[], Awaitable[Any]]:
            async def check() -> Any:
                t = await _get(stack, task_id)
                return t if abs(t.predicted_latency_s - x) <= 1e-9 * x else None
            return check

        got = await _eventually(at(a.id, want), timeout_s=15.0)
        assert dict(got.predicted_stage_latency_s) == pytest.approx({"answer": want}, rel=1e-9)
        assert got.HasField("predict_time") and got.variant.latency_s == pytest.approx(ALONE_S)  # as selected
        # B's own figure on this placement, beside A's instance.
        tb = await _eventually(at(b.id, want_b), timeout_s=15.0)
        assert tb.predicted_latency_s > BETTER_ALONE_S

        await call(stack.stub.DeleteTask(pb.DeleteTaskRequest(task_id=b.id), timeout=60))

        back = await _eventually(at(a.id, alone), timeout_s=15.0)
        assert dict(back.predicted_stage_latency_s) == pytest.approx({"answer": alone}, rel=1e-9)
    assert on_loop and not any(on_loop)


async def test_a_prediction_past_the_slo_makes_the_load_follower_reselect(etcd_store: Any, start_service: Any) -> None:
    await _put_profile(etcd_store, BETTER)
    async with _stack(etcd_store, start_service, gpus=1, follow_load=True, load_hold_down_s=1.0) as stack:
        # Tolerates B beside it at KAPPA (1.24x its latency alone), not at 4 (1.36x: B is busy 0.22 of the time).
        a, _ = await _share_one_gpu(stack, Slo(0.1, 1.3 * ALONE_S, 2.0))
        iid = a.stage_instances["answer"]
        assert _predicted(4.0)[0] > 1.3 * ALONE_S > _predicted(KAPPA)[0]
        # The profiler measures the GPUs interfering far more than planned: A's prediction passes its SLO, and the
        # follower re-selects it with no traffic metered at all. Here it moves A onto B's instance (reuse: the
        # better model, no co-resident left on the GPU), whose prediction is within the SLO again.
        await InterferenceStore(stack.store).put(InterferenceRecord.measured("A6000", 4.0))

        async def reselected() -> Any:
            t = await _get(stack, a.id)
            r = t.last_reselection
            return t if t.HasField("last_reselection") and "predicted latency" in r.reason and \
                r.outcome != "IN_PROGRESS" else None

        got = await _eventually(reselected, timeout_s=30.0)
        assert got.last_reselection.outcome == "DONE", got.last_reselection.reason
        assert f"predicted latency {_predicted(4.0)[0]:.3g}s" in got.last_reselection.reason
        assert got.stage_instances["answer"] != iid and got.state == ACTIVE

        # Once the prediction follows the move: both tasks' calls on B's instance, 10 req/s on a model that decodes
        # 2 calls a step at no extra cost, alone on the GPU. (Read at once, the figure may still be the old
        # placement's.)
        moved = placement_latencies({"b": InstanceLoad(BETTER, ("g",), (
            Arrivals(8.0, (Call("B", 50, 10),)), Arrivals(2.0, (Call("A", 50, 10),))))}, 4.0)["b"].latency_s["A"]
        assert moved <= 1.3 * ALONE_S

        async def settled() -> Any:
            t = await _get(stack, a.id)
            return t if abs(t.predicted_latency_s - moved) <= 1e-9 * moved else None

        await _eventually(settled, timeout_s=15.0)


async def test_the_load_follower_keeps_a_task_where_it_is_when_its_move_would_break_a_co_residents_slo(
        etcd_store: Any, start_service: Any) -> None:
    """The selector admits a move under its sharing bound; the follower then predicts the placement it would make
    (`predict.slo_breaks`, the model it acts on afterwards) and keeps the task where it is when that puts a
    co-resident that meets its SLO past it. Here the two models disagree by construction: A is selected with a
    kappa of 0 of its own (its options), so the selector sees no interference in A's moves, while the prediction
    runs at the cluster's stored 0.6."""
    await _put_profile(etcd_store, BETTER)
    # B beside A (A at 2 req/s): what B is predicted at on the placement as it is.
    b_before = placement_latencies({"a": InstanceLoad(PROFILE, ("g",), (Arrivals(2.0, (Call("A", 50, 10),)),)),
                                    "b": InstanceLoad(BETTER, ("g",), (Arrivals(8.0, (Call("B", 50, 10),)),))},
                                   KAPPA)["b"].latency_s["B"]
    async with _stack(etcd_store, start_service, gpus=1) as stack:
        a = await stack.deploy("first", Slo(0.1, 3.5, 2.0), selection_pb2.SelectionOptions(
            gpu_sharing=selection_pb2.GPU_SHARING_INTERFERENCE, interference=0.0))
        # B tolerates 2% more than it gets beside A: any busy newcomer on the one GPU breaks it.
        b = await stack.deploy("second", Slo(0.16, 1.02 * b_before, 8.0))
        iid = a.stage_instances["answer"]
        assert b.stage_instances["answer"] != iid

        async def predicted_b() -> Any:
            t = await _get(stack, b.id)
            return t if abs(t.predicted_latency_s - b_before) <= 1e-9 * b_before else None

        await _eventually(predicted_b, timeout_s=15.0)  # B meets its SLO on the placement as it is
        # 30 req/s: more than A's instance can carry (0.035 s busy a call), so A must move, onto new instances
        # beside B's (the selector, at kappa 0, sees no harm in that).
        await stack.core.follower.reselect_for_load(a.id, 30.0, "a test asked")
        got = await _get(stack, a.id)
        r = got.last_reselection
        # The second selection, B's instance protected (no room, no compute left on the one GPU), finds nothing: the
        # task stays where it is.
        assert r.outcome == "FAILED" and "no feasible variant at 30 req/s that keeps" in r.reason, r.reason
        assert f"{b.id} ({b_before:.3g}s -> " in r.reason and "by the live prediction" in r.reason
        assert got.stage_instances["answer"] == iid and got.state == ACTIVE
        assert (await _get(stack, b.id)).stage_instances["answer"] == b.stage_instances["answer"]
        # Nothing was started for the move.
        ids = {keys.parse_instance(kv.key) for kv in (await stack.store.get_prefix(keys.INSTANCES)).items}
        assert ids == {iid, b.stage_instances["answer"]}


async def test_the_load_follower_moves_a_task_when_the_prediction_breaks_no_co_resident(
        etcd_store: Any, start_service: Any) -> None:
    """The check does not stand in the way of a move that harms no one: two GPUs, A (selected at kappa 0, as above)
    on one, B alone on the other with an SLO 2% above what it gets. At 26 req/s A no longer fits its instance and
    gets a new one away from B (LeastLoaded); B's prediction is unchanged, so the follower switches."""
    await _put_profile(etcd_store, BETTER)
    b_alone = placement_latencies({"b": InstanceLoad(BETTER, ("g",), (Arrivals(8.0, (Call("B", 50, 10),)),))},
                                  KAPPA)["b"].latency_s["B"]
    async with _stack(etcd_store, start_service, gpus=2) as stack:
        a = await stack.deploy("first", Slo(0.1, 3.5, 2.0), selection_pb2.SelectionOptions(
            gpu_sharing=selection_pb2.GPU_SHARING_INTERFERENCE, interference=0.0))
        b = await stack.deploy("second", Slo(0.16, 1.02 * b_alone, 8.0))
        iid, jid = a.stage_instances["answer"], b.stage_instances["answer"]
        recs = {i: InstanceRecord.from_json((await stack.store.get(keys.instance(i))).value) for i in (iid, jid)}
        assert set(recs[iid].gpu_ids).isdisjoint(recs[jid].gpu_ids)  # each alone on its GPU (LeastLoaded)

        async def predicted_b() -> Any:
            t = await _get(stack, b.id)
            return t if abs(t.predicted_latency_s - b_alone) <= 1e-9 * b_alone else None

        await _eventually(predicted_b, timeout_s=15.0)
        await stack.core.follower.reselect_for_load(a.id, 26.0, "a test asked")
        got = await _get(stack, a.id)
        assert got.last_reselection.outcome == "DONE", got.last_reselection.reason
        new_iid = got.stage_instances["answer"]
        assert new_iid not in (iid, jid) and got.state == ACTIVE
        new = InstanceRecord.from_json((await stack.store.get(keys.instance(new_iid))).value)
        assert set(new.gpu_ids).isdisjoint(recs[jid].gpu_ids)  # away from B
        tb = await _get(stack, b.id)
        assert tb.stage_instances["answer"] == jid
        # B's prediction on the new placement: as before, within its SLO.
        await _eventually(predicted_b, timeout_s=15.0)


async def test_an_approval_whose_plan_the_prediction_says_breaks_a_running_task_fails_and_starts_nothing(
        etcd_store: Any, start_service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An approval is checked as a move is: B runs alone on the one GPU with an SLO 2% above what it gets; C, selected
    at a kappa of 0 of its own (the selector sees no slowdown from a co-resident), would get an instance beside B's
    at 20 req/s, which the prediction (the cluster's kappa, 0.6) says pushes B past its SLO. Selected again with B's
    instance protected, nothing is left on the one GPU, so C fails naming B, and nothing is started."""
    import services.orchestrator.selecting as selecting

    on_loop = _threads_of(monkeypatch, selecting, "slo_breaks")  # the check runs off the event loop
    await _put_profile(etcd_store, BETTER)
    b_alone = placement_latencies({"b": InstanceLoad(BETTER, ("g",), (Arrivals(8.0, (Call("B", 50, 10),)),))},
                                  KAPPA)["b"].latency_s["B"]
    async with _stack(etcd_store, start_service, gpus=1) as stack:
        b = await stack.deploy("second", Slo(0.16, 1.02 * b_alone, 8.0))
        jid = b.stage_instances["answer"]

        async def predicted_b() -> Any:
            t = await _get(stack, b.id)
            return t if abs(t.predicted_latency_s - b_alone) <= 1e-9 * b_alone else None

        await _eventually(predicted_b, timeout_s=15.0)
        c = (await call(stack.stub.DeployTask(pb.DeployTaskRequest(
            description="third", name="third", slo=convert.slo_to_proto(Slo(0.1, 3.5, 20.0)),
            workflows=[convert.workflow_to_proto(ONE)])))).task
        req = pb.ApproveWorkflowsRequest(task_id=c.id, workflow_ids=[ONE.id])
        req.options.CopyFrom(selection_pb2.SelectionOptions(gpu_sharing=selection_pb2.GPU_SHARING_INTERFERENCE,
                                                            interference=0.0))
        got = (await call(stack.stub.ApproveWorkflows(req, timeout=60))).task
        assert got.state == task_pb2.Task.STATE_FAILED, got
        assert "by the live prediction" in got.failure.message and f"{b.id} ({b_alone:.3g}s -> " in \
            got.failure.message, got.failure.message
        # Selected twice (the second time with B's instance protected: no slowdown tolerated, full), committed never.
        assert sum(1 for r in stack.selector.requests if r.slo.arrival_rate_rps == 20.0) == 2
        protected = [i for i in stack.last_request().cluster.instances if i.id == jid]
        assert protected and protected[0].max_slowdown == 1.0
        assert protected[0].load_output_tokens_per_s >= BETTER.max_output_tokens_per_s
        ids = {keys.parse_instance(kv.key) for kv in (await stack.store.get_prefix(keys.INSTANCES)).items}
        assert ids == {jid}
        assert (await _get(stack, b.id)).state == ACTIVE
        assert len(on_loop) >= 2 and not any(on_loop)  # both plans checked, neither on the loop's thread


async def test_an_approval_whose_first_plan_breaks_a_running_task_is_placed_away_from_it(
        etcd_store: Any, start_service: Any) -> None:
    """Three GPUs, one busy instance each: E and A (Llama, 10 req/s, loose SLOs, no reuse) and B (the better model,
    8 req/s, an SLO 2% above its prediction), B the least busy. C (kappa 0 of its own, no reuse) first goes beside B
    (LeastLoaded), which the prediction says pushes B past its SLO; selected again with B's instance protected, it
    goes beside E or A, which tolerate it, and C is ACTIVE."""
    await _put_profile(etcd_store, BETTER)
    b_alone = placement_latencies({"b": InstanceLoad(BETTER, ("g",), (Arrivals(8.0, (Call("B", 50, 10),)),))},
                                  KAPPA)["b"].latency_s["B"]
    alone_only = selection_pb2.SelectionOptions(allow_reuse=False)
    async with _stack(etcd_store, start_service, gpus=3) as stack:
        # E and A busy 1 - exp(-10 x 0.05) = 0.39 of the time, B 1 - exp(-8 x 0.055) = 0.36; each GPU keeps compute
        # for C's 10 req/s (0.35 + 0.35 <= the 0.85 cap)
        e = await stack.deploy("busy1", Slo(0.1, 3.5, 10.0), alone_only)
        a = await stack.deploy("busy2", Slo(0.1, 3.5, 10.0), alone_only)
        b = await stack.deploy("tight", Slo(0.16, 1.02 * b_alone, 8.0))
        gpus = {}
        for t in (e, a, b):
            iid = t.stage_instances["answer"]
            gpus[t.id] = set(InstanceRecord.from_json((await stack.store.get(keys.instance(iid))).value).gpu_ids)
        assert len(set().union(*gpus.values())) == 3  # one GPU each

        async def predicted_b() -> Any:
            t = await _get(stack, b.id)
            return t if abs(t.predicted_latency_s - b_alone) <= 1e-9 * b_alone else None

        await _eventually(predicted_b, timeout_s=15.0)
        n = len(stack.selector.requests)
        c = (await call(stack.stub.DeployTask(pb.DeployTaskRequest(
            description="third", name="third", slo=convert.slo_to_proto(Slo(0.1, 3.5, 10.0)),
            workflows=[convert.workflow_to_proto(ONE)])))).task
        req = pb.ApproveWorkflowsRequest(task_id=c.id, workflow_ids=[ONE.id])
        req.options.CopyFrom(selection_pb2.SelectionOptions(gpu_sharing=selection_pb2.GPU_SHARING_INTERFERENCE,
                                                            interference=0.0, allow_reuse=False))
        got = (await call(stack.stub.ApproveWorkflows(req, timeout=60))).task
        assert got.state == ACTIVE, got.failure.message
        # Selected twice: first as the cluster is, then with B's instance protected (no slowdown, full).
        first, second = stack.selector.requests[n:]
        jid = b.stage_instances["answer"]
        plain = next(i for i in first.cluster.instances if i.id == jid)
        guarded = next(i for i in second.cluster.instances if i.id == jid)
        assert plain.max_slowdown > 1.0 and guarded.max_slowdown == 1.0
        assert guarded.load_output_tokens_per_s >= BETTER.max_output_tokens_per_s > plain.load_output_tokens_per_s
        # C runs away from B, beside E or A; B keeps its SLO by the prediction.
        mine = InstanceRecord.from_json((await stack.store.get(keys.instance(got.stage_instances["answer"]))).value)
        assert not set(mine.gpu_ids) & gpus[b.id] and set(mine.gpu_ids) & (gpus[e.id] | gpus[a.id])
        await _eventually(predicted_b, timeout_s=15.0)
        assert (await _get(stack, b.id)).predicted_latency_s <= 1.02 * b_alone
