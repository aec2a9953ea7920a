"""Following the load on the emulated cluster (real etcd, deployer with engine processes, selector, orchestrator):
a task declared at 0.2 req/s gets 8 req/s, is re-selected make-before-break onto more capacity with no request
lost, its latency comes back under the SLO, and the extra capacity goes when the load falls back; a task
deployed while an instance is saturated does not reuse it; a request that cannot meet its deadline is refused
at once. Pure parts (the meter and the drift rule) are tested here too."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from flowmaker import convert
from flowmaker.api.common.v1 import selection_pb2, task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.domain import Slo, Stage, Workflow
from flowmaker.errors import FlowMakerError, NoCapacity
from flowmaker.orchestration.adapt import ArrivalMeter, LoadPolicy, TaskLoad, drifted
from flowmaker.orchestration.task import Reselection, TaskRecord, TaskState
from flowmaker.rpc.errors import call
from flowmaker.state import keys
from flowmaker.state.records import GpuRecord, InstanceRecord
from services.deployer.node import NodeAgent
from services.deployer.servicer import service_hooks
from services.deployer.settings import DeployerSettings
from services.orchestrator.orchestrator import Orchestrator

pytestmark = pytest.mark.integration

# 200 output tokens a request: at 8 req/s, 1,600 tok/s. The accuracy target leaves Qwen2.5-3B as the smallest
# model (tp2 by the spec's cost, 1,862 tok/s by the analytic profile); the emulated engine measures it
# saturated well before that (latency stretched past 4x a lone request's), so a task sharing it must move.
WF = Workflow("gen", (Stage("answer", input_tokens=100, output_tokens=200, prompt_template="{input}"),))
SLO = Slo(min_accuracy=0.26, max_latency_s=8.0, arrival_rate_rps=0.2)
WINDOW_S, HOLD_S = 5.0, 6.0


# ---- the pure parts ----------------------------------------------------------------------------------


def test_arrival_meter_and_drift_rule() -> None:
    m = ArrivalMeter(window_s=10.0)
    assert m.load("t", 0.0) is None
    for i in range(40):  # 4 req/s wall for 10 s, at 2 model s per wall s: 2 req/s model
        m.arrived("t", i * 0.25)
        m.finished("t", i * 0.25 + 0.1, 0.5 + i / 100)
    ld = m.load("t", 10.0, time_scale=2.0)
    assert ld is not None and ld.rate_rps == pytest.approx(2.0, rel=0.05) and ld.samples == 40
    assert ld.latency_q_s == pytest.approx(2 * (0.5 + 37 / 100))  # p95 of 40: the 38th, in model seconds
    # A request still waiting counts with its age once that exceeds the completed ones' median: a hung instance
    # completes nothing, and its wait must show in the quantile.
    hung = ArrivalMeter(window_s=10.0)
    for i in range(20):
        hung.finished("t", i * 0.1 + 0.5, 0.5, hung.arrived("t", i * 0.1))
    for i in range(5):
        hung.arrived("t", 3.0 + i * 0.1)  # never answered
    hl = hung.load("t", 9.0)
    assert hl is not None and hl.samples == 25 and hl.latency_q_s == pytest.approx(6.0 - 0.1)

    p = LoadPolicy(band=2.0, hold_down_s=5.0, min_samples=5)
    t = TaskRecord("t", "d", Slo(0.1, 3.0, 1.0), state=TaskState.ACTIVE)
    since: dict[str, float] = {}
    up = {"t": TaskLoad(2.5, 1.0, 50)}
    assert drifted({"t": t}, up, since, 100.0, p) == []  # seen, held down
    ((tid, rate, why),) = drifted({"t": t}, up, since, 105.0, p)
    assert (tid, rate) == ("t", 2.5) and "> 2 x planned 1" in why
    # Within the band: nothing, and the timer resets.
    assert drifted({"t": t}, {"t": TaskLoad(1.5, 1.0, 50)}, since, 106.0, p) == [] and since == {}
    # Falling below planned / band scales back in, to at least the policy's floor, after scale_in_factor x the
    # hold-down (hysteresis: twice the hold-down by default), and with headroom over what is observed.
    low = {"t": TaskLoad(0.0, 0.0, 0)}
    fast_in = replace(p, scale_in_factor=1.0, floor_at_declared=False)
    drifted({"t": t}, low, since, 200.0, fast_in)
    assert drifted({"t": t}, low, since, 205.0, fast_in)[0][1] == p.min_rate_rps
    drifted({"t": t}, low, since, 220.0, replace(p, floor_at_declared=False))
    assert drifted({"t": t}, low, since, 225.0, replace(p, floor_at_declared=False)) == []  # waits longer
    assert drifted({"t": t}, low, since, 230.0, replace(p, floor_at_declared=False))[0][1] == p.min_rate_rps
    lull = {"t": TaskLoad(0.4, 0.0, 0)}
    drifted({"t": t}, lull, since, 250.0, fast_in)
    assert drifted({"t": t}, lull, since, 260.0, fast_in)[0][1] == pytest.approx(0.4 * p.scale_in_headroom)
    # By default a task planned at its declared rate is not scaled in below it; one scaled out for a burst
    # comes back to its declared rate, not below.
    since.clear()
    assert drifted({"t": t}, low, since, 270.0, p) == [] and drifted({"t": t}, low, since, 290.0, p) == []
    burst = replace(t, planned_rate_rps=3.0)
    drifted({"t": burst}, low, since, 300.0, p)
    assert drifted({"t": burst}, low, since, 305.0, p) == []  # the hysteresis: one hold-down is not enough
    assert drifted({"t": burst}, low, since, 310.0, p)[0][1] == 1.0
    since.clear()
    # The rate as planned but the latency breaks the SLO: ask for band x more.
    slow = {"t": TaskLoad(1.0, 4.0, 50)}
    drifted({"t": t}, slow, since, 320.0, p)
    assert drifted({"t": t}, slow, since, 325.0, p)[0][1] == 2.0
    # At most one re-selection per hold-down; none while switching or healing.
    recent = TaskRecord("t", "d", Slo(0.1, 3.0, 1.0), state=TaskState.ACTIVE,
                        last_reselection=Reselection(398.0, "x", 1.0, "DONE"))
    drifted({"t": recent}, up, since, 400.0, p)
    assert drifted({"t": recent}, up, since, 402.0, p) == []
    assert drifted({"t": recent}, up, since, 405.0, p) != []


# ---- on the emulated cluster -------------------------------------------------------------------------


class Stack:
    def __init__(self, store: Any, agent: NodeAgent, orch: Orchestrator, stub: Any) -> None:
        self.store, self.agent, self.orch, self.stub = store, agent, orch, stub

    async def gpus(self) -> list[GpuRecord]:
        return [GpuRecord.from_json(kv.value) for kv in (await self.store.get_prefix(keys.GPUS)).items]

    async def instances(self) -> dict[str, InstanceRecord]:
        return {r.id: r for r in (InstanceRecord.from_json(kv.value)
                                  for kv in (await self.store.get_prefix(keys.INSTANCES)).items)}

    async def deploy(self, name: str, slo: Slo = SLO, utilization_cap: float = 0.0) -> Any:
        t = (await call(self.stub.DeployTask(pb.DeployTaskRequest(
            description=name, name=name, slo=convert.slo_to_proto(slo), workflows=[convert.workflow_to_proto(WF)])))).task
        return (await call(self.stub.ApproveWorkflows(pb.ApproveWorkflowsRequest(
            task_id=t.id, workflow_ids=["gen"],
            options=selection_pb2.SelectionOptions(allow_reuse=True, utilization_cap=utilization_cap)),
            timeout=120))).task

    async def get(self, task_id: str) -> Any:
        return (await call(self.stub.GetTask(pb.GetTaskRequest(task_id=task_id)))).task


@pytest.fixture
async def stack(etcd_store: Any, start_service: Any, start_control_plane: Any) -> AsyncIterator[Stack]:
    dset = DeployerSettings(host="127.0.0.1", port=0, grace_s=0.5, node="n0", gpu_type="A6000", gpu_count=4,
                            use_nvml=False, engine_time_scale=1.0, engine_start_timeout_s=30, engine_stop_grace_s=2,
                            lease_ttl_s=5, load_scrape_interval_s=0.5, load_half_life_s=1.0,
                            load_report_max_interval_s=1.0)
    agent = NodeAgent(etcd_store, dset)
    add_deployer, deployer_ready = service_hooks(agent)
    await start_service("deployer", add_deployer, dset, on_ready=deployer_ready, on_shutdown=[agent.shutdown])
    orch, stub = await start_control_plane(etcd_store, reconcile_interval_s=0.5, observe_flush_interval_s=0.5,
                                           load_window_s=WINDOW_S, load_hold_down_s=HOLD_S, drain_timeout_s=20)
    yield Stack(etcd_store, agent, orch, stub)


class Driver:
    """Open-loop requests to a task at a rate that can be changed; every outcome and latency is kept."""

    def __init__(self, stub: Any, task_id: str) -> None:
        self.stub, self.task_id = stub, task_id
        self.rate = 0.0
        self.results: list[tuple[float, float, str]] = []  # (start wall time, latency s, "OK" or the error)
        self.served_by: Counter[str] = Counter()  # instance id -> requests its first stage served
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None

    async def _one(self) -> None:
        t0 = time.monotonic()
        try:
            r = await call(self.stub.Invoke(pb.InvokeRequest(task_id=self.task_id, input="ramp"), timeout=60))
            self.results.append((t0, time.monotonic() - t0, "OK"))
            self.served_by[r.stages[0].instance_id] += 1
        except FlowMakerError as e:
            self.results.append((t0, time.monotonic() - t0, f"{type(e).__name__} {e.reason}: {e}"))

    async def _run(self) -> None:
        nxt = time.monotonic()
        while True:
            if self.rate <= 0:
                await asyncio.sleep(0.05)
                nxt = time.monotonic()
                continue
            t = asyncio.create_task(self._one())
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            nxt += 1.0 / self.rate
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    def start(self) -> Driver:
        self._loop = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        assert self._loop is not None
        self._loop.cancel()
        await asyncio.gather(self._loop, return_exceptions=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def p95(self, since: float, until: float) -> float:
        xs = sorted(lat for t0, lat, ok in self.results if ok == "OK" and since <= t0 <= until)
        assert len(xs) >= 10, len(xs)
        return xs[min(len(xs) - 1, int(0.95 * len(xs)))]


async def _until(pred: Any, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not await pred():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


async def test_ramp_reselects_make_before_break_and_scales_back_in(stack: Stack) -> None:
    """Two tasks share one instance; one of them ramps 0.2 -> 8 req/s and is moved, make-before-break, to
    an instance of its own; when it falls back to 0.2 req/s it is moved back onto the shared one (reuse is
    free) and its own instance is released. Not one request is lost in either switch."""
    base = await stack.deploy("base")
    assert base.state == task_pb2.Task.STATE_ACTIVE, base.failure.message
    t = await stack.deploy("ramp")
    assert t.state == task_pb2.Task.STATE_ACTIVE, t.failure.message
    first = dict(t.stage_instances)
    assert first == dict(base.stage_instances) and list(t.variant.new_instances) == []  # shared
    first_gpus = t.variant.new_gpus
    drv = Driver(stack.stub, t.id).start()
    try:
        drv.rate = 0.2
        await asyncio.sleep(2)
        ramp_at = time.monotonic()
        drv.rate = 8.0

        async def switched() -> bool:
            g = await stack.get(t.id)
            return dict(g.stage_instances) != first and g.last_reselection.outcome == "DONE"
        took = await _until(switched, 60, "re-selected onto more capacity after the ramp")
        g = await stack.get(t.id)
        assert g.last_reselection.planned_arrival_rate_rps > 4.0, g.last_reselection
        assert g.variant.new_gpus + sum(1 for _ in g.variant.reuse) >= 1
        switched_at = time.monotonic()
        print(f"re-selected {took:.1f}s after the ramp: {g.last_reselection.reason}")
        # The task's reference to the shared instance is dropped once drained; base keeps it.
        shared = first["answer"]

        async def moved_off() -> bool:
            refs = {keys.parse_reuse(kv.key) for kv in (await stack.store.get_prefix(keys.REUSE)).items}
            return (shared, t.id) not in refs and (shared, base.id) in refs
        await _until(moved_off, 40, "the old variant's reference released")
        # p95 back under the SLO (requests started after the switch settled).
        await asyncio.sleep(8)
        p95 = drv.p95(switched_at + 2, time.monotonic())
        assert p95 < SLO.max_latency_s, p95
        used_high = sum(g2.memory_used_gb for g2 in await stack.gpus())

        # The load falls back: the extra capacity goes within the hold-down (+ the window to notice, a
        # deploy and a drain).
        drv.rate = 0.2
        down_at = time.monotonic()

        async def scaled_in() -> bool:
            g3 = await stack.get(t.id)
            return (g3.last_reselection.outcome == "DONE" and g3.last_reselection.planned_arrival_rate_rps < 1.0
                    and set(await stack.instances()) == {shared})
        took_down = await _until(scaled_in, WINDOW_S + HOLD_S + 40, "scaled back in")
        used_low = sum(g4.memory_used_gb for g4 in await stack.gpus())
        assert used_low < used_high, (used_low, used_high)
        print(f"scaled in {took_down:.1f}s after the drop; memory {used_high:.1f} -> {used_low:.1f} GB; "
              f"first variant used {first_gpus} GPU(s)")
    finally:
        await drv.stop()
    # No request lost in either switch.
    bad = [r for r in drv.results if r[2] != "OK"]
    assert not bad, bad[:5]
    assert len(drv.results) > 100
    assert time.monotonic() - ramp_at > 0 and down_at > ramp_at
    for gpu in await stack.gpus():
        assert gpu.memory_used_gb <= gpu.memory_total_gb


async def test_a_ramp_beyond_one_instance_scales_out_to_replicas_and_back_in(stack: Stack) -> None:
    """With a utilization cap of 0.5, 8 req/s (1,600 output tokens/s) is more than any one instance of the
    cheapest model may carry: the re-selection scales the stage out to a replica group (selection's
    max_replicas), requests are spread over the replicas, and when the load falls back one instance is
    left. Not one request is lost."""
    t = await stack.deploy("wide", utilization_cap=0.5)
    assert t.state == task_pb2.Task.STATE_ACTIVE, t.failure.message
    first = dict(t.stage_instances)
    assert list(first) == ["answer"]
    drv = Driver(stack.stub, t.id).start()
    try:
        drv.rate = 0.2
        await asyncio.sleep(2)
        drv.rate = 8.0

        async def scaled_out() -> bool:
            g = await stack.get(t.id)
            return "answer#1" in g.stage_instances and g.last_reselection.outcome == "DONE"
        took = await _until(scaled_out, 60, "scaled out to replicas after the ramp")
        g = await stack.get(t.id)
        group = [g.stage_instances[k] for k in sorted(g.stage_instances)]
        assert len(group) >= 2 and first["answer"] not in group, g.stage_instances
        assert g.variant.assignments[0].replica_keys, g.variant
        assert g.variant.new_gpus == len(group) * g.variant.assignments[0].tp * g.variant.assignments[0].pp
        print(f"scaled out {took:.1f}s after the ramp to {len(group)} replicas: {g.last_reselection.reason}")
        # Requests are spread over the replicas (least outstanding work).
        before = Counter(drv.served_by)
        await asyncio.sleep(6)
        spread = {i: drv.served_by[i] - before[i] for i in group}
        assert all(n > 0 for n in spread.values()), spread
        assert min(spread.values()) >= 0.25 * max(spread.values()), spread

        drv.rate = 0.2

        async def scaled_in() -> bool:
            g2 = await stack.get(t.id)
            return "answer#1" not in g2.stage_instances and g2.last_reselection.planned_arrival_rate_rps < 1.0 \
                and len(await stack.instances()) == 1
        took_down = await _until(scaled_in, WINDOW_S + HOLD_S + 40, "scaled back in to one instance")
        print(f"scaled in {took_down:.1f}s after the drop; spread over replicas {spread}")
    finally:
        await drv.stop()
    bad = [r for r in drv.results if r[2] != "OK"]
    assert not bad, bad[:5]
    for gpu in await stack.gpus():
        assert gpu.memory_used_gb <= gpu.memory_total_gb


async def test_saturated_instance_not_reused_and_unreachable_deadline_refused(stack: Stack) -> None:
    import aiohttp

    a = await stack.deploy("busy", Slo(0.26, 60.0, 0.2))
    assert a.state == task_pb2.Task.STATE_ACTIVE, a.failure.message
    iid = a.stage_instances["answer"]
    endpoint = (await stack.instances())[iid].endpoint
    stack.orch.reconciler.load_policy = None  # deploy-once here: the instance must stay where it is

    # Overload straight at the engine (another tenant, or many callers): 128 closed-loop clients stretch every
    # request to several times a lone one's latency, while the throughput stays at capacity.
    async def client(http: aiohttp.ClientSession) -> None:
        while True:
            async with http.post(endpoint + "/v1/completions", json={
                    "model": "Qwen2.5-3B-Instruct", "prompt": "go", "max_tokens": 200}) as r:
                await r.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as http:
        flood = [asyncio.create_task(client(http)) for _ in range(128)]
        try:
            async def saturated() -> bool:
                rec = (await stack.instances())[iid]
                return rec.saturated and rec.observed_latency_s > 1.0  # measured, with finished requests
            await _until(saturated, 60, "the overloaded instance measured saturated")
            # A second task that the instance could carry by plan is not given the saturated instance.
            b = await stack.deploy("newcomer", Slo(0.26, 60.0, 0.05))
            assert b.state == task_pb2.Task.STATE_ACTIVE, b.failure.message
            assert b.stage_instances["answer"] != iid and list(b.variant.reuse) == []
            # A request whose deadline is shorter than what the instance takes now is refused at once.
            t0 = time.monotonic()
            with pytest.raises(NoCapacity) as ei:
                await call(stack.stub.Invoke(pb.InvokeRequest(task_id=a.id, input="hurry"), timeout=0.5))
            assert ei.value.reason == "DEADLINE_UNREACHABLE" and "retry_after_s" in ei.value.metadata
            assert time.monotonic() - t0 < 0.5
        finally:
            for f in flood:
                f.cancel()
            await asyncio.gather(*flood, return_exceptions=True)


async def test_callers_that_give_up_cancel_their_engine_requests(stack: Stack) -> None:
    """Invoke calls whose deadline passes (and streams whose client goes away) are cancelled all the way to the
    engine: its batch empties (within a second when the machine is quiet), and it counts them as cancelled."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    t = await stack.deploy("impatient", Slo(0.26, 60.0, 0.2))
    assert t.state == task_pb2.Task.STATE_ACTIVE, t.failure.message
    endpoint = (await stack.instances())[t.stage_instances["answer"]].endpoint

    async def metrics() -> dict[str, float]:
        async with aiohttp.ClientSession() as s, s.get(endpoint + "/metrics") as r:
            text = await r.text()
        return {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}

    async def give_up() -> None:
        with pytest.raises(FlowMakerError):
            await call(stack.stub.Invoke(pb.InvokeRequest(task_id=t.id, input="too slow"), timeout=0.3))

    async def leave_stream() -> None:
        stream = stack.stub.InvokeStream(pb.InvokeStreamRequest(task_id=t.id, input="stream then leave"))
        async for _chunk in stream:
            break  # the first delta: the request is on the engine
        stream.cancel()

    async def settled(before: dict[str, float]) -> tuple[float, float, dict[str, float]]:
        """Wait for the engine's batch to empty; then (requests it finished, requests it cancelled) since `before`."""
        t0 = time.monotonic()
        while True:
            m = await metrics()
            if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
                break
            # Within a second on a quiet machine; CI at de2c217 saw 1.02 s while the 2 cores also ran benchmarks.
            assert time.monotonic() - t0 < 5.0, m
            await asyncio.sleep(0.05)
        return (m["vllm:request_success_total"] - before["vllm:request_success_total"],
                m["flowmaker:request_cancelled_total"] - before["flowmaker:request_cancelled_total"], m)

    # Invokes whose deadline passes. On a loaded machine a deadline of 0.3 s can pass before the orchestrator has
    # forwarded the call (then nothing reaches the engine: a CI-like run beside a test sweep saw 8 of 40 arrive), so
    # what is asserted is that those that arrived were cancelled there, not run to the end.
    before = await metrics()
    await asyncio.gather(*(give_up() for _ in range(40)))
    done, cancelled, m = await settled(before)
    assert cancelled >= 1 and done <= 5, m
    # Streams whose client leaves after the first delta: each is on the engine by then.
    before = m
    await asyncio.gather(*(leave_stream() for _ in range(40)))
    done, cancelled, m = await settled(before)
    assert cancelled >= 30 and done <= 10, m  # a few may have finished before their caller left
