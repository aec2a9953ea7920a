"""The running suite on loopback: a real etcd, real gRPC servers on port 0 (deployer with emulated engine
processes, selector, orchestrator): deploy tasks sharing an instance, invoke, delete; concurrent approvals
that would over-commit a GPU; an engine killed -> DEGRADED; bad input -> INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from flowmaker import convert
from flowmaker.api.common.v1 import selection_pb2, task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.domain import Slo, Stage, StageKind, Workflow
from flowmaker.errors import FailedPrecondition, InvalidSpec, NotFound, Unavailable
from flowmaker.orchestration.task import TaskRecord, TaskState
from flowmaker.rpc.errors import call, field_violations
from flowmaker.state import keys
from flowmaker.state.records import GpuRecord, InstanceRecord, InstanceState
from services.deployer.node import NodeAgent
from services.deployer.servicer import service_hooks
from services.deployer.settings import DeployerSettings
from services.orchestrator.orchestrator import Orchestrator

pytestmark = pytest.mark.integration

TIME_SCALE = 20.0  # engines and TOOL stages run 20x faster than model time
ACTIVE, FAILED, DEGRADED = task_pb2.Task.STATE_ACTIVE, task_pb2.Task.STATE_FAILED, task_pb2.Task.STATE_DEGRADED

# A DAG: `draft` and `lookup` (a TOOL) are independent and run in parallel; `final` needs both.
DAG = Workflow("dag", (
    Stage("draft", input_tokens=60, output_tokens=12, prompt_template="Draft an answer to: {input}"),
    Stage("lookup", kind=StageKind.TOOL, latency_s=1.0, prompt_template="facts about {input}"),
    Stage("final", depends_on=("draft", "lookup"), input_tokens=120, output_tokens=8,
          prompt_template="Question: {input}\nDraft: {draft}\nFacts: {lookup}\nFinal answer:"),
))
ONE = Workflow("one", (Stage("answer", input_tokens=50, output_tokens=10, prompt_template="{input}"),))
SLO = Slo(min_accuracy=0.1, max_latency_s=30.0, arrival_rate_rps=0.5)


@dataclass
class Stack:
    store: Any
    agent: NodeAgent
    orch: orchestrator_pb2_grpc.OrchestratorServiceStub
    core: Orchestrator  # the orchestrator behind `orch`, for tests that stop it half way

    async def gpus(self) -> list[GpuRecord]:
        return [GpuRecord.from_json(kv.value) for kv in (await self.store.get_prefix(keys.GPUS)).items]

    async def instances(self) -> dict[str, InstanceRecord]:
        return {r.id: r for r in (InstanceRecord.from_json(kv.value)
                                  for kv in (await self.store.get_prefix(keys.INSTANCES)).items)}

    async def deploy(self, wf: Workflow, slo: Slo = SLO, name: str = "t") -> Any:
        r = await call(self.orch.DeployTask(pb.DeployTaskRequest(
            description=f"task {name}", name=name, slo=convert.slo_to_proto(slo),
            workflows=[convert.workflow_to_proto(wf)])))
        return r.task

    async def approve(self, task_id: str, wf_id: str, *, allow_reuse: bool = True) -> Any:
        opts = selection_pb2.SelectionOptions(allow_reuse=allow_reuse)
        r = await call(self.orch.ApproveWorkflows(pb.ApproveWorkflowsRequest(
            task_id=task_id, workflow_ids=[wf_id], options=opts), timeout=120))
        return r.task

    async def get(self, task_id: str) -> Any:
        return (await call(self.orch.GetTask(pb.GetTaskRequest(task_id=task_id)))).task


async def start_stack(store: Any, start_service: Any, start_control_plane: Any, *, gpu_count: int, gpu_memory_gb: float = 0.0,
                      backend: str = "emulated", heal: bool = True) -> AsyncIterator[Stack]:
    dset = DeployerSettings(host="127.0.0.1", port=0, grace_s=0.5, node="n0", gpu_type="A6000", gpu_count=gpu_count,
                            gpu_memory_gb=gpu_memory_gb, use_nvml=False, backend=backend,
                            engine_time_scale=TIME_SCALE, engine_start_timeout_s=30, engine_stop_grace_s=2,
                            lease_ttl_s=5)
    agent = NodeAgent(store, dset)

    add_deployer, deployer_ready = service_hooks(agent)

    await start_service("deployer", add_deployer, dset, on_ready=deployer_ready, on_shutdown=[agent.shutdown])
    # Without healing no replacement comes, so an Invoke does not wait for one: it fails at once. (Waiting, it would
    # answer 1 s before its 5 s deadline, which a loaded CI machine missed once: DEADLINE_EXCEEDED, not UNAVAILABLE.)
    core, stub = await start_control_plane(store, tool_time_scale=TIME_SCALE, reconcile_heal=heal,
                                           reconcile_interval_s=0.5, observe_flush_interval_s=0.2,
                                           **({} if heal else {"invoke_heal_wait_s": 0.0}))
    yield Stack(store, agent, stub, core)


@pytest.fixture
async def stack(etcd_store: Any, start_service: Any, start_control_plane: Any) -> AsyncIterator[Stack]:
    async for s in start_stack(etcd_store, start_service, start_control_plane, gpu_count=2):
        yield s


@pytest.fixture
async def stack_not_healing(etcd_store: Any, start_service: Any, start_control_plane: Any) -> AsyncIterator[Stack]:
    async for s in start_stack(etcd_store, start_service, start_control_plane, gpu_count=2, heal=False):
        yield s


@pytest.fixture
async def small_stack(etcd_store: Any, start_service: Any, start_control_plane: Any) -> AsyncIterator[Stack]:
    # One 8 GB GPU: room for exactly one Llama-3.2-1B instance (5.5 GB per the analytic profile).
    async for s in start_stack(etcd_store, start_service, start_control_plane, gpu_count=1, gpu_memory_gb=8.0):
        yield s


@pytest.fixture
async def two_small_gpus(etcd_store: Any, start_service: Any, start_control_plane: Any) -> AsyncIterator[Stack]:
    async for s in start_stack(etcd_store, start_service, start_control_plane, gpu_count=2, gpu_memory_gb=8.0):
        yield s


@pytest.fixture
async def broken_engines(etcd_store: Any, start_service: Any, start_control_plane: Any) -> AsyncIterator[Stack]:
    # The vllm backend with no `vllm` executable on PATH: every engine start fails.
    async for s in start_stack(etcd_store, start_service, start_control_plane, gpu_count=2, backend="vllm"):
        yield s


async def test_two_tasks_share_an_instance_invoke_and_delete(stack: Stack) -> None:
    a = await stack.deploy(DAG, name="alpha")
    assert a.state == task_pb2.Task.STATE_AWAITING_APPROVAL and [w.id for w in a.candidates] == ["dag"]
    a = await stack.approve(a.id, "dag")
    assert a.state == ACTIVE, a.failure.message
    assert set(a.stage_instances) == {"draft", "final"}  # TOOL stages take no instance
    assert a.predicted_latency_s > 0 and a.variant.workflow_id == "dag"
    new_ids = set(a.stage_instances.values())
    insts = await stack.instances()
    assert all(insts[i].state is InstanceState.READY for i in new_ids)

    b = await stack.approve((await stack.deploy(ONE, name="beta")).id, "one")
    assert b.state == ACTIVE, b.failure.message
    shared = b.stage_instances["answer"]
    assert shared in new_ids  # reused, nothing new started
    assert list(b.variant.new_instances) == [] and b.variant.reuse[0].instance_id == shared
    assert b.variant.cost == 0.0
    refs = {keys.parse_reuse(kv.key) for kv in (await stack.store.get_prefix(keys.REUSE)).items}
    assert (shared, a.id) in refs and (shared, b.id) in refs

    # Invoke both. The DAG's independent stages overlap; `final` starts after both.
    ra = await call(stack.orch.Invoke(pb.InvokeRequest(task_id=a.id, input="why is the sky blue?")))
    by = {s.stage_id: s for s in ra.stages}
    assert set(by) == {"draft", "lookup", "final"}
    assert by["lookup"].output == "facts about why is the sky blue?"  # emulated tool: pass-through
    assert len(by["draft"].output.split()) == 12 and by["draft"].instance_id in new_ids
    assert by["draft"].start_s < 0.02 and by["lookup"].start_s < 0.02  # parallel
    assert by["final"].start_s >= max(by["draft"].start_s + by["draft"].latency_s,
                                      by["lookup"].start_s + by["lookup"].latency_s) - 1e-3
    assert by["lookup"].latency_s >= 1.0 / TIME_SCALE
    assert ra.output == by["final"].output and len(ra.output.split()) == 8
    rb = await call(stack.orch.Invoke(pb.InvokeRequest(task_id=b.id, input="hello there", max_output_tokens=3)))
    assert len(rb.output.split()) == 3 and rb.stages[0].instance_id == shared

    # Streaming: deltas of each LLM stage, stage_done per stage, then done.
    chunks = [c async for c in stack.orch.InvokeStream(pb.InvokeStreamRequest(task_id=a.id, input="stream me"))]
    kinds = [c.WhichOneof("chunk") for c in chunks]
    assert kinds[-1] == "done" and kinds.count("stage_done") == 3 and "delta" in kinds
    final_text = "".join(c.delta for c in chunks if c.WhichOneof("chunk") == "delta" and c.stage_id == "final")
    assert final_text == chunks[-1].done.output

    # Request accounting is batched off the request path: it shows within a flush interval.
    deadline = time.monotonic() + 10
    while (ga := await stack.get(a.id)).requests_served < 2:
        assert time.monotonic() < deadline, "the served requests were never accounted"
        await asyncio.sleep(0.1)
    assert ga.requests_served == 2 and ga.observed_latency_p50_s > 0 and ga.state == ACTIVE
    assert ga.observed_latency_p95_s >= ga.observed_latency_p50_s

    # Delete alpha: the shared instance stays (beta uses it); alpha's other instance, if any, stops.
    da = await call(stack.orch.DeleteTask(pb.DeleteTaskRequest(task_id=a.id)))
    assert shared not in da.released_instance_ids
    assert set(da.released_instance_ids) == new_ids - {shared}
    insts = await stack.instances()
    assert insts[shared].state is InstanceState.READY
    with pytest.raises(NotFound):
        await stack.get(a.id)
    rb = await call(stack.orch.Invoke(pb.InvokeRequest(task_id=b.id, input="still served")))
    assert rb.output

    db = await call(stack.orch.DeleteTask(pb.DeleteTaskRequest(task_id=b.id)))
    assert list(db.released_instance_ids) == [shared]
    assert await stack.instances() == {}
    assert all(g.memory_used_gb == 0.0 for g in await stack.gpus())
    assert (await stack.store.get_prefix(keys.REUSE)).items == ()
    assert stack.agent.procs == {}  # every engine process stopped


async def test_concurrent_approvals_never_overcommit_a_gpu(small_stack: Stack) -> None:
    s = small_stack
    t1, t2 = [await s.deploy(ONE, name=n) for n in ("one", "two")]
    # No reuse: each approval wants a new instance, and only one fits on the GPU.
    r1, r2 = await asyncio.gather(s.approve(t1.id, "one", allow_reuse=False),
                                  s.approve(t2.id, "one", allow_reuse=False))
    states = sorted([r1.state, r2.state])
    assert states == sorted([ACTIVE, FAILED]), (r1.failure.message, r2.failure.message)
    failed = r1 if r1.state == FAILED else r2
    ok = r2 if failed is r1 else r1
    assert failed.failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] or "SELECTION_CONFLICT" in str(failed.failure)
    assert "NO_GPU_MEMORY" in str(failed.failure) or "SELECTION_CONFLICT" in str(failed.failure)
    (gpu,) = await s.gpus()
    assert gpu.memory_used_gb <= gpu.memory_total_gb
    insts = await s.instances()
    assert list(insts) == list(ok.stage_instances.values())
    assert gpu.memory_used_gb == pytest.approx(insts[ok.stage_instances["answer"]].memory_gb_per_gpu)
    # The failed task holds nothing.
    refs = {keys.parse_reuse(kv.key) for kv in (await s.store.get_prefix(keys.REUSE)).items}
    assert all(tid != failed.id for _, tid in refs)
    with pytest.raises(FailedPrecondition):
        await call(s.orch.Invoke(pb.InvokeRequest(task_id=failed.id, input="x")))
    # Deleting the FAILED task releases nothing; deleting the ACTIVE one frees the GPU.
    assert list((await call(s.orch.DeleteTask(pb.DeleteTaskRequest(task_id=failed.id)))).released_instance_ids) == []
    await call(s.orch.DeleteTask(pb.DeleteTaskRequest(task_id=ok.id)))
    (gpu,) = await s.gpus()
    assert gpu.memory_used_gb == 0.0


async def test_engine_killed_task_degraded_without_healing(stack_not_healing: Stack) -> None:
    stack = stack_not_healing
    t = await stack.approve((await stack.deploy(ONE, name="fragile")).id, "one")
    assert t.state == ACTIVE
    iid = t.stage_instances["answer"]
    proc = stack.agent.procs[iid]
    assert proc.pid is not None
    os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while (await stack.instances())[iid].state is not InstanceState.FAILED:
        assert time.monotonic() < deadline, "the deployer did not mark the killed engine FAILED"
        await asyncio.sleep(0.1)
    g = await stack.get(t.id)
    assert g.state == DEGRADED
    assert iid in g.failure.message and "FAILED" in g.failure.message
    with pytest.raises(Unavailable) as ei:
        await call(stack.orch.Invoke(pb.InvokeRequest(task_id=t.id, input="anyone?"), timeout=5))
    assert ei.value.reason == "INSTANCE_FAILED"
    listed = await call(stack.orch.ListTasks(pb.ListTasksRequest(state=DEGRADED)))
    assert [x.id for x in listed.tasks] == [t.id]
    # Memory of the failed instance is given back at once; deleting the task removes what is left.
    assert all(gp.memory_used_gb == 0.0 for gp in await stack.gpus())
    await call(stack.orch.DeleteTask(pb.DeleteTaskRequest(task_id=t.id)))
    assert await stack.instances() == {}


async def test_generated_candidates_and_bad_input(stack: Stack) -> None:
    r = await call(stack.orch.DeployTask(pb.DeployTaskRequest(
        description="Summarize long customer support tickets", slo=convert.slo_to_proto(SLO))))
    assert r.task.state == task_pb2.Task.STATE_AWAITING_APPROVAL and len(r.task.candidates) >= 1
    tid = r.task.id

    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stack.orch.DeployTask(pb.DeployTaskRequest(description="x", slo=convert.slo_to_proto(Slo(1.5, 1.0))))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(ei.value)] == ["slo.min_accuracy"]
    with pytest.raises(InvalidSpec) as e1:
        await call(stack.orch.DeployTask(pb.DeployTaskRequest(description="no slo")))
    assert e1.value.field == "slo"
    bad = convert.workflow_to_proto(ONE)
    bad.stages[0].output_tokens = 0
    with pytest.raises(InvalidSpec) as e2:
        await call(stack.orch.DeployTask(pb.DeployTaskRequest(description="d", slo=convert.slo_to_proto(SLO),
                                                              workflows=[bad])))
    assert e2.value.field == "workflows[0].stages[0].output_tokens"
    with pytest.raises(InvalidSpec) as e3:
        await call(stack.orch.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=tid, workflow_ids=["nope"])))
    assert e3.value.field == "workflow_ids[0]"
    with pytest.raises(InvalidSpec) as e4:
        await call(stack.orch.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=tid)))
    assert e4.value.field == "workflow_ids"
    with pytest.raises(NotFound):
        await call(stack.orch.GetTask(pb.GetTaskRequest(task_id="no-such-task")))
    # A strategy the selector does not know is the caller's mistake: INVALID_ARGUMENT to the caller, and
    # the task stays approvable (it used to end FAILED for good).
    with pytest.raises(InvalidSpec) as e5:
        await call(stack.orch.ApproveWorkflows(pb.ApproveWorkflowsRequest(
            task_id=tid, workflow_ids=[r.task.candidates[0].id], strategy="no-such-strategy")))
    assert e5.value.reason == "UNKNOWN_STRATEGY"
    assert (await stack.get(tid)).state == task_pb2.Task.STATE_AWAITING_APPROVAL
    with pytest.raises(FailedPrecondition):
        await call(stack.orch.Invoke(pb.InvokeRequest(task_id=tid, input="not yet approved")))
    # An SLO no model meets: FAILED with the selector's reason, nothing reserved.
    hard = await stack.deploy(ONE, Slo(0.99, 30.0, 1.0), name="hard")
    f = await stack.approve(hard.id, "one")
    assert f.state == FAILED and "NO_MODEL_MEETS_ACCURACY" in str(f.failure)
    assert await stack.instances() == {}
    with pytest.raises(FailedPrecondition):
        await stack.approve(hard.id, "one")


async def test_concurrent_approvals_reselect_onto_another_gpu(two_small_gpus: Stack) -> None:
    s = two_small_gpus
    t1, t2 = [await s.deploy(ONE, name=n) for n in ("one", "two")]
    r1, r2 = await asyncio.gather(s.approve(t1.id, "one", allow_reuse=False),
                                  s.approve(t2.id, "one", allow_reuse=False))
    assert r1.state == ACTIVE and r2.state == ACTIVE, (r1.failure.message, r2.failure.message)
    assert set(r1.stage_instances.values()).isdisjoint(r2.stage_instances.values())
    # Whoever lost the race selected again on the memory left: each GPU's accounting is the sum of
    # the instances on it, and never above its capacity.
    insts = await s.instances()
    assert len(insts) == 2
    for g in await s.gpus():
        on_it = sum(i.memory_gb_per_gpu for i in insts.values() if g.id in i.gpu_ids)
        assert g.memory_used_gb == pytest.approx(on_it) and g.memory_used_gb <= g.memory_total_gb
    for t in (r1, r2):
        await call(s.orch.DeleteTask(pb.DeleteTaskRequest(task_id=t.id)))
    assert all(g.memory_used_gb == 0.0 for g in await s.gpus())


async def test_deploy_failure_rolls_back_everything(broken_engines: Stack) -> None:
    s = broken_engines
    t = await s.approve((await s.deploy(DAG, name="doomed")).id, "dag")
    assert t.state == FAILED
    assert t.failure.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "deploying instance" in t.failure.message
    # Nothing reserved or referenced is left behind.
    assert await s.instances() == {}
    assert all(g.memory_used_gb == 0.0 for g in await s.gpus())
    assert (await s.store.get_prefix(keys.REUSE)).items == ()


async def test_commit_without_deploy_is_resumed_and_a_pending_reuse_waits_for_ready(stack_not_healing: Stack) -> None:
    """The orchestrator dies between the etcd commit and the Deploy calls: the task is DEPLOYING, its
    new instance PENDING (memory reserved, no engine). Meanwhile a second task reuses that PENDING
    instance: its approval must not report ACTIVE before the instance serves. A restarted
    orchestrator (`resume`) deploys what the first one committed: nothing accepted is lost."""
    stack = stack_not_healing
    a = await stack.deploy(ONE, name="cut")
    kv = await stack.store.get(keys.task(a.id))
    rec = TaskRecord.from_json(kv.value)
    await stack.store.cas(kv.key, rec.moved(TaskState.SELECTING, time.time(), approved_workflow_ids=("one",),
                                            strategy="exact").to_json(), etag=kv.mod_revision)
    plan = await stack.core._select_and_commit(a.id)  # commit only: "died" before Deploy
    assert plan is not None and len(plan.deploy) == 1
    (iid,) = [d.instance_id for d in plan.deploy]
    assert (await stack.get(a.id)).state == task_pb2.Task.STATE_DEPLOYING
    assert (await stack.instances())[iid].state is InstanceState.PENDING

    b = await stack.approve((await stack.deploy(ONE, name="rider")).id, "one")
    assert b.state == ACTIVE, b.failure.message
    assert b.stage_instances["answer"] == iid and list(b.variant.new_instances) == []
    assert (await stack.instances())[iid].state is InstanceState.READY  # started, not merely reserved
    assert (await stack.get(b.id)).state == ACTIVE

    stack.core.reconciler.heal = True  # what a restarted orchestrator does first: its reconciler resumes
    await stack.core.resume()
    deadline = time.monotonic() + 30
    while (await stack.get(a.id)).state != ACTIVE:
        assert time.monotonic() < deadline, "the committed task was not resumed"
        await asyncio.sleep(0.1)
    out = await call(stack.orch.Invoke(pb.InvokeRequest(task_id=a.id, input="back again")))
    assert out.stages[0].instance_id == iid
    for t in (a.id, b.id):
        await call(stack.orch.DeleteTask(pb.DeleteTaskRequest(task_id=t)))
    assert await stack.instances() == {}
    assert all(g.memory_used_gb == 0.0 for g in await stack.gpus())


async def test_max_tokens_clamped_to_the_models_context(stack: Stack) -> None:
    """Each engine call's max_tokens is clamped so that prompt + completion fit the model's context (the
    catalog's max_ctx, which the deployer also gives the emulated engine); a prompt that alone fills the
    context is INVALID_ARGUMENT naming `input` and the limit, not an engine error."""
    t = await stack.approve((await stack.deploy(ONE, name="ctx")).id, "one")
    assert t.state == ACTIVE, t.failure.message
    model_id = (await stack.instances())[t.stage_instances["answer"]].model_id
    from flowmaker.catalog import get_model
    arch = get_model(model_id).arch
    assert arch is not None
    ctx = arch.max_ctx
    # 3 tokens of room left: the stage asks for 10, the engine is asked for 3 (and would refuse 10).
    r = await call(stack.orch.Invoke(pb.InvokeRequest(task_id=t.id, input=" ".join(["w"] * (ctx - 3))),
                                     timeout=120))
    assert len(r.output.split()) == 3 and r.stages[0].input_tokens == ctx - 3
    with pytest.raises(InvalidSpec) as e:
        await call(stack.orch.Invoke(pb.InvokeRequest(task_id=t.id, input=" ".join(["w"] * ctx)), timeout=120))
    assert e.value.field == "input" and e.value.metadata.get("limit") == "context_tokens"
    assert str(ctx) in e.value.message


async def test_maximal_deploy_task_does_not_stall_health(etcd_store: Any, start_service: Any) -> None:
    """A DeployTask at the limits (16 workflows x 64 stages, each depending on every earlier one, templates
    filling the rest of `task_bytes`) is validated and converted in worker threads: the orchestrator's health
    check keeps answering within 1 s while it runs. One byte over `task_bytes` is INVALID_ARGUMENT (it was
    accepted, then failed as a retryable UNAVAILABLE when etcd refused the oversized record)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from flowmaker.rpc.channels import insecure_channel
    from services.orchestrator.clients import Clients
    from services.orchestrator.servicer import SERVICE_NAME
    from services.orchestrator.servicer import add_servicers as add_orchestrator
    from services.orchestrator.settings import OrchestratorSettings

    oset = OrchestratorSettings(host="127.0.0.1", port=0, grace_s=0.5, selector_address="127.0.0.1:1")
    clients = Clients(oset.selector_address, timeout_s=5)
    core = Orchestrator(oset, etcd_store, clients)

    async def close() -> None:
        await core.close()
        await clients.close()

    o = await start_service("orchestrator", lambda s: add_orchestrator(s, core), oset, on_shutdown=[close])
    from flowmaker.limits import LIMITS

    def request(template_bytes: int) -> pb.DeployTaskRequest:
        wfs = []
        for w in range(LIMITS.workflows_per_task):
            stages = []
            for i in range(LIMITS.stages_per_workflow):
                deps = tuple(f"s{j}" for j in range(i))
                text = "{input} " + " ".join("{" + d + "}" for d in deps) + " "
                stages.append(Stage(f"s{i}", input_tokens=100, output_tokens=10, depends_on=deps,
                                    prompt_template=text + "x" * max(0, template_bytes - len(text))))
            wfs.append(convert.workflow_to_proto(Workflow(f"w{w}", tuple(stages))))
        return pb.DeployTaskRequest(description="maximal", name="big", slo=convert.slo_to_proto(SLO), workflows=wfs)

    req = request(560)
    assert LIMITS.task_bytes * 0.9 < req.ByteSize() <= LIMITS.task_bytes
    too_big = request(620)
    assert too_big.ByteSize() > LIMITS.task_bytes

    async with insecure_channel(o.address, default_timeout_s=60) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        done = asyncio.Event()
        worst = 0.0
        checks = 0

        async def probe() -> None:
            nonlocal worst, checks
            while not done.is_set():
                t0 = time.monotonic()
                h = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
                assert h.status == health_pb2.HealthCheckResponse.SERVING
                worst, checks = max(worst, time.monotonic() - t0), checks + 1
                await asyncio.sleep(0.01)

        prober = asyncio.create_task(probe())
        try:
            for i in range(3):
                req.name = f"bg{i}"  # names are unique per owner; same length as "big", so the same size
                r = await call(stub.DeployTask(req, timeout=60))
                assert len(r.task.candidates) == 16 and len(r.task.candidates[0].stages) == 64
            with pytest.raises(InvalidSpec) as e:
                await call(stub.DeployTask(too_big, timeout=60))
            assert e.value.field == "workflows" and e.value.metadata.get("limit") == "task_bytes"
        finally:
            done.set()
            await prober
    assert checks >= 3 and worst < 1.0, f"a health check took {worst:.3f} s while a maximal DeployTask ran"
