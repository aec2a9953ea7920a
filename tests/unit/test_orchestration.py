"""The orchestrator's pure core: prompt filling and the parallel DAG schedule, task records and their state
machine, and commit planning (one guarded txn; a stale view loses) against the in-memory store."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import replace

import pytest

from flowmaker.domain import NewInstance, Slo, Stage, StageAssignment, StageKind, Variant, Workflow
from flowmaker.errors import FailedPrecondition, NoCapacity
from flowmaker.orchestration.cluster import read_live_cluster
from flowmaker.orchestration.commit import commit_ops, plan_commit, plan_release
from flowmaker.orchestration.dag import StageResult, execute, fill_prompt, final_stage
from flowmaker.orchestration.task import Healing, TaskRecord, TaskState, derive_state
from flowmaker.state import keys
from flowmaker.state.memory import MemoryStore
from flowmaker.state.records import GpuRecord, InstanceRecord, InstanceState, NodeRecord

WF = Workflow("w", (
    Stage("a", input_tokens=10, output_tokens=5, prompt_template="A: {input}"),
    Stage("t", kind=StageKind.TOOL, latency_s=0.05, prompt_template="T: {input}"),
    Stage("b", depends_on=("a", "t"), input_tokens=10, output_tokens=5, prompt_template="{a} | {t} | {missing}"),
))


def test_fill_prompt_and_final_stage() -> None:
    assert fill_prompt(WF.stages[2], "q", {"a": "x", "t": "y"}) == "x | y | {missing}"
    assert fill_prompt(Stage("s", depends_on=("a",), input_tokens=1, output_tokens=1), "q", {"a": "x"}) == "q\n\nx"
    assert fill_prompt(Stage("s", input_tokens=1, output_tokens=1, prompt_template="{input} {oops"), "q", {}) \
        == "q {oops"
    assert final_stage(WF).id == "b"


async def test_execute_runs_independent_stages_in_parallel() -> None:
    running: set[str] = set()
    overlap: list[set[str]] = []

    async def run(stage: Stage, prompt: str) -> StageResult:
        running.add(stage.id)
        overlap.append(set(running))
        await asyncio.sleep(0.05)
        running.discard(stage.id)
        return StageResult(stage.id, f"<{prompt}>")

    t0 = time.monotonic()
    ex = await execute(WF, "q", run)
    assert {"a", "t"} in overlap  # both ran at once
    assert ex.output == "<<A: q> | <T: q> | {missing}>"
    assert [s.stage_id for s in ex.stages][-1] == "b"
    assert time.monotonic() - t0 < 0.14  # two levels of 50 ms, not three


async def test_execute_failure_propagates_and_cancels() -> None:
    async def run(stage: Stage, prompt: str) -> StageResult:
        if stage.id == "a":
            raise NoCapacity("boom")
        await asyncio.sleep(1)
        return StageResult(stage.id, "")

    with pytest.raises(NoCapacity):
        await asyncio.wait_for(execute(WF, "q", run), 0.5)


def _task(state: TaskState = TaskState.ACTIVE) -> TaskRecord:
    return TaskRecord("t1", "d", Slo(0.1, 1.0, 1.0), candidates=(WF,), state=state,
                      stage_instances={"a": "i1", "b": "i1"})


def test_task_json_roundtrip_and_state_machine() -> None:
    v = Variant("w", (StageAssignment("a", "m", 1, 1, False, new_key="new-0", gpu_ids=("g0",)),),
                (NewInstance("new-0", "m", 1, 1, "n0", ("g0",), 5.0, 3.0),), (("i0", 2.0),), 1.0, 0.5, 5.0, 5.0, 1)
    t = TaskRecord("t1", "d", Slo(0.1, 1.0, 1.0), candidates=(WF,), variant=v, observed_latencies_s=(0.1, 0.2))
    assert TaskRecord.from_json(t.to_json()) == t
    assert t.workflow == WF
    with pytest.raises(FailedPrecondition):
        _task(TaskState.ACTIVE).moved(TaskState.AWAITING_APPROVAL, 0.0)
    with pytest.raises(FailedPrecondition):
        _task(TaskState.FAILED).moved(TaskState.SELECTING, 0.0)
    assert _task(TaskState.FAILED).moved(TaskState.DELETING, 0.0).state is TaskState.DELETING
    # Healing re-selects an ACTIVE task and sends a failed healing deploy back to SELECTING.
    assert _task(TaskState.ACTIVE).moved(TaskState.SELECTING, 0.0).state is TaskState.SELECTING
    assert _task(TaskState.DEPLOYING).moved(TaskState.SELECTING, 0.0).state is TaskState.SELECTING
    healing = replace(t, healing=Healing("RESELECTING", "instance i0 is gone", 12.5, 2, 20.0),
                      options_json='{"allow_reuse": false}')
    assert TaskRecord.from_json(healing.to_json()) == healing


def test_derive_state() -> None:
    assert derive_state(_task(), {"i1": "READY"})[0] is TaskState.ACTIVE
    st, f = derive_state(_task(), {"i1": "FAILED"})
    assert st is TaskState.DEGRADED and f is not None and "i1 is FAILED" in f.message
    assert derive_state(_task(), {"i1": None})[0] is TaskState.DEGRADED
    slow = _task()
    for _ in range(5):
        slow = slow.with_observation(2.0, 0.0, 10)
    assert derive_state(slow, {"i1": "READY"})[0] is TaskState.DEGRADED
    assert derive_state(_task(TaskState.FAILED), {"i1": "FAILED"})[0] is TaskState.FAILED
    # A task being healed reads DEGRADED, whatever its stored state, and says what is being done.
    for stored in (TaskState.ACTIVE, TaskState.SELECTING, TaskState.DEPLOYING):
        h = replace(_task(stored), healing=Healing("WAITING_FOR_CAPACITY", "no node", 1.0, 3))
        st, f = derive_state(h, {"i1": "READY"})
        assert st is TaskState.DEGRADED and f is not None and f.reason == "TASK_HEALING"
        assert "WAITING_FOR_CAPACITY" in f.message and "attempt 3" in f.message


async def _seed(store: MemoryStore) -> None:
    await store.put(keys.node("n0"), NodeRecord("n0", "A6000", 1).to_json())
    await store.put(keys.gpu("n0", "g0"), GpuRecord("g0", "n0", "A6000", 10.0, 0.0).to_json())
    await store.put(keys.instance("i0"), InstanceRecord("i0", "m", 1, 1, "n0", ("g0",), 2.0, InstanceState.READY,
                                                        "http://x").to_json())
    for tid in ("t1", "t2"):
        await store.put(keys.task(tid), TaskRecord(tid, "d", Slo(0.1, 1.0, 1.0)).to_json())


def _variant(mem: float) -> Variant:
    return Variant("w", (StageAssignment("a", "m", 1, 1, False, new_key="new-0", gpu_ids=("g0",)),
                         StageAssignment("b", "m", 1, 1, True, instance_id="i0")),
                   (NewInstance("new-0", "m", 1, 1, "n0", ("g0",), mem, 3.0),), (("i0", 2.0),), 1.0, 0.5, mem, mem, 1)


async def test_commit_one_txn_and_stale_view_loses() -> None:
    store = MemoryStore()
    await _seed(store)
    view = await read_live_cluster(store)  # both approvals select on this same view
    ops = []
    for tid, iid in (("t1", "new-a"), ("t2", "new-b")):
        plan = plan_commit(tid, _variant(6.0), [iid])
        assert plan.stage_instances == {"a": iid, "b": "i0"}
        kv = await store.get(keys.task(tid))
        assert kv is not None
        ops.append(commit_ops(plan, view, kv, TaskRecord.from_json(kv.value), 0.0))
    first = await store.txn(*ops[0])
    second = await store.txn(*ops[1])
    assert first.succeeded and not second.succeeded
    assert keys.gpu("n0", "g0") in second.failed and keys.instance("i0") in second.failed
    g = GpuRecord.from_json((await store.get(keys.gpu("n0", "g0"))).value)  # type: ignore[union-attr]
    assert g.memory_used_gb == 6.0
    new = InstanceRecord.from_json((await store.get(keys.instance("new-a"))).value)  # type: ignore[union-attr]
    assert new.state is InstanceState.PENDING and new.memory_reserved
    live = await read_live_cluster(store)
    assert {i.id: i.load_output_tokens_per_s for i in live.cluster.instances} == {"i0": 2.0, "new-a": 3.0}
    assert await store.get(keys.instance("new-b")) is None

    # On the fresh view the same plan no longer fits the GPU: refused before any write.
    kv = await store.get(keys.task("t2"))
    assert kv is not None
    with pytest.raises(NoCapacity):
        commit_ops(plan_commit("t2", _variant(6.0), ["new-b"]), live, kv, TaskRecord.from_json(kv.value), 0.0)

    t1 = TaskRecord.from_json((await store.get(keys.task("t1"))).value)  # type: ignore[union-attr]
    t1 = TaskRecord(t1.id, t1.description, t1.slo, stage_instances={"a": "new-a", "b": "i0"})
    refs = [keys.parse_reuse(kv.key) for kv in (await store.get_prefix(keys.REUSE)).items]
    acts = plan_release(t1, dict(live.instances), refs)
    assert [(a.instance_id, a.stop) for a in acts] == [("i0", True), ("new-a", True)]
    acts = plan_release(t1, dict(live.instances), [*refs, ("i0", "other")])
    assert [(a.instance_id, a.stop) for a in acts] == [("i0", False), ("new-a", True)]


def test_failure_keeps_the_error_class_and_shows_as_its_grpc_status() -> None:
    """A stored Failure maps back to the same gRPC code as the exception it came from, including a
    subclass defined outside flowmaker.errors (the deployer's EngineStartError is an Unavailable)."""
    from google.rpc import code_pb2, error_details_pb2

    from flowmaker import convert
    from flowmaker.errors import InvalidSpec, Unavailable
    from flowmaker.orchestration.task import Failure

    class EngineDown(Unavailable):
        reason = "ENGINE_START_FAILED"

    assert Failure.of(EngineDown("no engine")) == Failure("Unavailable", "ENGINE_START_FAILED", "no engine")
    assert Failure.of(InvalidSpec("bad", field="x")).error == "InvalidSpec"
    assert Failure.of(RuntimeError("boom")) == Failure("FlowMakerError", "INTERNAL", "RuntimeError: boom")
    assert isinstance(Failure("NoCapacity", "NO_LATENCY", "m").to_error(), NoCapacity)
    assert type(Failure("NotAnError", "R", "m").to_error()).__name__ == "FlowMakerError"

    t = TaskRecord("t1", "d", Slo(0.5, 2.0)).moved(TaskState.SELECTING, 1.0).moved(
        TaskState.FAILED, 2.0, failure=Failure("NoCapacity", "NO_MODEL_MEETS_ACCURACY", "no feasible variant"))
    m = convert.task_to_proto(t, etag=7)
    assert m.failure.code == code_pb2.RESOURCE_EXHAUSTED and m.etag == "7"
    info = error_details_pb2.ErrorInfo()
    assert m.failure.details[0].Unpack(info) and info.reason == "NO_MODEL_MEETS_ACCURACY"
    assert convert.task_state_from_proto(m.state) is TaskState.FAILED and convert.task_state_from_proto(0) is None


def test_profile_records_parse_in_either_spelling() -> None:
    """One reader for profile records (selector and deployer alike): snake_case or proto lowerCamel."""
    from flowmaker.domain import ProfileSource
    from flowmaker.orchestration.cluster import profile_from_record
    from flowmaker.state.store import KeyValue

    key = keys.profile("A6000", "m/1", 2, 1, "MEASURED")
    snake = {"memory_gb_per_gpu": 9.0, "fixed_s": 0.1, "prefill_s_per_token": 1e-4, "decode_s_per_token": 0.02,
             "max_output_tokens_per_s": 400.0}
    camel = {"memoryGbPerGpu": 9.0, "fixedS": 0.1, "prefillSPerToken": 1e-4, "decodeSPerToken": 0.02,
             "maxOutputTokensPerS": 400.0, "source": "PROFILE_SOURCE_MEASURED"}
    a, b = (profile_from_record(KeyValue(key, v, 1, 1)) for v in (snake, camel))
    assert a is not None and a == b
    assert (a.model_id, a.tp, a.pp, a.gpu_type, a.source) == ("m/1", 2, 1, "A6000", ProfileSource.MEASURED)
    assert profile_from_record(KeyValue(key, {"fixed_s": "x"}, 1, 1)) is None


def test_load_rule_is_max_of_planned_and_fresh_observed() -> None:
    from flowmaker.orchestration.cluster import effective_load, fresh_observed_load

    assert effective_load(182.0, None) == 182.0  # nothing measured: the plan
    assert effective_load(182.0, 1672.0) == 1672.0  # traffic above plan counts
    assert effective_load(300.0, 40.0) == 300.0  # promised capacity stays held before traffic arrives
    assert effective_load(-1.0, None) == 0.0
    rec = InstanceRecord("i0", "m", 1, 1, "n0", ("g0",), 2.0, InstanceState.READY,
                         observed_load_output_tokens_per_s=50.0, observed_load_at=1000.0)
    assert fresh_observed_load(rec, now=1010.0, max_age_s=15.0) == 50.0
    assert fresh_observed_load(rec, now=998.0, max_age_s=15.0) == 50.0  # a little clock skew: still fresh
    assert fresh_observed_load(rec, now=1015.5, max_age_s=15.0) is None  # too old: scrapes stopped
    assert fresh_observed_load(rec, now=1010.0, max_age_s=0.0) is None  # 0 = plan only
    never = InstanceRecord("i1", "m", 1, 1, "n0", ("g0",), 2.0, InstanceState.READY)
    assert fresh_observed_load(never, now=1.0) is None
    # Old records (no observed fields) still parse, with the defaults.
    old = {k: v for k, v in rec.to_json().items() if not k.startswith("observed_")}
    assert InstanceRecord.from_json(old).observed_load_at == 0.0


async def test_live_cluster_uses_observed_load_but_commits_add_to_the_plan() -> None:
    store = MemoryStore()
    await _seed(store)
    now = time.time()
    kv = await store.get(keys.instance("i0"))
    assert kv is not None
    busy = InstanceRecord.from_json(kv.value)
    busy = InstanceRecord.from_json({**busy.to_json(), "observed_load_output_tokens_per_s": 9.0,
                                     "observed_load_peak_output_tokens_per_s": 12.0, "observed_load_at": now})
    await store.put(keys.instance("i0"), busy.to_json())
    await store.put(keys.reuse("i0", "t0"), {"instance_id": "i0", "task_id": "t0", "load_output_tokens_per_s": 1.5})

    view = await read_live_cluster(store, now=now + 1)
    assert {i.id: i.load_output_tokens_per_s for i in view.cluster.instances} == {"i0": 9.0}
    assert view.planned_loads == {"i0": 1.5} and view.observed_loads == {"i0": 9.0}
    assert view.instances["i0"].load_output_tokens_per_s == 1.5  # the record keeps the plan
    # Stale observation, or observations switched off: back to the plan.
    stale = await read_live_cluster(store, now=now + 60)
    assert stale.cluster.instances[0].load_output_tokens_per_s == 1.5 and stale.observed_loads == {}
    off = await read_live_cluster(store, now=now + 1, observed_max_age_s=0)
    assert off.cluster.instances[0].load_output_tokens_per_s == 1.5
    # Observed below plan: the plan holds.
    await store.put(keys.reuse("i0", "t0"), {"instance_id": "i0", "task_id": "t0", "load_output_tokens_per_s": 20.0})
    assert (await read_live_cluster(store, now=now + 1)).cluster.instances[0].load_output_tokens_per_s == 20.0

    # A commit reusing i0 adds its planned 2.0 to the PLANNED 20.0, not to the effective load.
    view = await read_live_cluster(store, now=now + 1)
    plan = plan_commit("t1", _variant(6.0), ["new-a"])
    tkv = await store.get(keys.task("t1"))
    assert tkv is not None
    assert (await store.txn(*commit_ops(plan, view, tkv, TaskRecord.from_json(tkv.value), 0.0))).succeeded
    rec = InstanceRecord.from_json((await store.get(keys.instance("i0"))).value)  # type: ignore[union-attr]
    assert rec.load_output_tokens_per_s == 22.0
    assert rec.observed_load_output_tokens_per_s == 9.0  # the measurement is carried, not folded in


def test_selector_skips_an_instance_busy_by_measurement() -> None:
    """The point of the rule: an instance that fits by plan but is busy by measurement is not reused."""
    from flowmaker.domain import Cluster, Gpu, Instance, Model, Profile, SelectionRequest
    from flowmaker.selection import select

    prof = Profile("m", 1, 1, 4.0, 0.01, 1e-4, 0.01, 100.0)
    model = Model("m", 0.9, 1.0, 1.0)
    wf = Workflow("w", (Stage("s", StageKind.LLM, (), 10, 10, 1),))  # 1 rps x 10 output tokens = 10 tok/s
    gpus = (Gpu("g0", "n0", 24.0, 4.0), Gpu("g1", "n0", 24.0, 0.0))

    def chosen(load: float) -> Variant:
        cluster = Cluster(gpus, (Instance("i0", "m", 1, 1, ("g0",), load),))
        res = select(SelectionRequest(Slo(0.5, 5.0, 1.0), (wf,), (model,), (prof,), cluster))
        assert res.variant is not None
        return res.variant

    assert [iid for iid, _ in chosen(5.0).reuse] == ["i0"]  # by plan: 5 + 10 <= 100, reuse
    busy = chosen(95.0)  # by measurement: 95 + 10 > 100, a new instance instead
    assert busy.reuse == () and len(busy.new_instances) == 1


def test_instance_shows_planned_and_observed_load() -> None:
    from flowmaker.convert import instance_record_to_proto

    rec = InstanceRecord("i1", "m", 1, 1, "node0", ("node0-gpu0",), 10.0, state=InstanceState.READY,
                         load_output_tokens_per_s=50.0)
    never = instance_record_to_proto(rec)
    assert never.load_output_tokens_per_s == 50.0 and not never.HasField("observed_time")
    seen = instance_record_to_proto(dataclasses.replace(rec, observed_load_output_tokens_per_s=180.0,
                                                        observed_load_at=1_700_000_000.5))
    assert seen.observed_load_output_tokens_per_s == 180.0
    assert seen.observed_time.seconds == 1_700_000_000
