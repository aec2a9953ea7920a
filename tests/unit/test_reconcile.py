"""The reconciler's pure planner: which action each observed world calls for, and that it is level-triggered
(the same world gives the same actions; timers and budgets are the only memory)."""

from __future__ import annotations

from dataclasses import replace

from flowmaker.domain import Slo, Stage, Workflow
from flowmaker.orchestration.reconcile import Action, Kind, Memory, Observed, Policy, plan, to_probe
from flowmaker.orchestration.task import Healing, TaskRecord, TaskState
from flowmaker.state.records import InstanceRecord, InstanceState

WF = Workflow("w", (Stage("a", input_tokens=10, output_tokens=5),))
P = Policy(restart_backoff_s=1.0, max_restarts=3, restart_window_s=300, node_lost_grace_s=10,
           orphan_grace_s=30, deploying_deadline_s=600)


def _task(tid: str = "t1", state: TaskState = TaskState.ACTIVE, iid: str = "i1", **kw: object) -> TaskRecord:
    return TaskRecord(tid, "d", Slo(0.1, 10.0, 1.0), candidates=(WF,), state=state, stage_instances={"a": iid},
                      update_time=kw.pop("update_time", 100.0), **kw)  # type: ignore[arg-type]


def _inst(iid: str = "i1", state: InstanceState = InstanceState.READY, node: str = "n0") -> InstanceRecord:
    return InstanceRecord(iid, "m", 1, 1, node, (f"{node}-gpu0",), 5.0, state, memory_reserved=state in (
        InstanceState.PENDING, InstanceState.STARTING, InstanceState.READY))


def _obs(tasks: list[TaskRecord], insts: list[InstanceRecord], nodes: tuple[str, ...] = ("n0",),
         refs: dict[str, tuple[str, ...]] | None = None) -> Observed:
    if refs is None:
        refs = {}
        for t in tasks:
            for iid in t.instance_ids:
                refs.setdefault(iid, ())
                refs[iid] += (t.id,)
    return Observed({t.id: t for t in tasks}, {i.id: i for i in insts}, frozenset(nodes),
                    {i: frozenset(ts) for i, ts in refs.items()})


def _kinds(actions: list[Action]) -> list[tuple[Kind, str]]:
    return [(a.kind, a.task_id or a.instance_id) for a in actions]


def _set(actions: list[Action]) -> set[tuple[Kind, str]]:
    return set(_kinds(actions))


def test_healthy_world_needs_nothing_and_a_healed_task_is_cleared() -> None:
    mem = Memory()
    assert plan(_obs([_task()], [_inst()]), mem, 1000.0, P) == []
    healed = _task(healing=Healing("RESTARTING_INSTANCE", "x", 900.0, 1))
    assert _kinds(plan(_obs([healed], [_inst()]), mem, 1000.0, P)) == [(Kind.CLEAR_HEALING, "t1")]


def test_failed_instance_is_restarted_in_place_with_backoff_then_reselected() -> None:
    mem = Memory()
    # Two tasks share the failed instance: one restart serves both.
    world = _obs([_task("t1"), _task("t2")], [_inst(state=InstanceState.FAILED)])
    (a,) = plan(world, mem, 1000.0, P)
    assert a.kind is Kind.RESTART and a.instance_id == "i1" and a.task_ids == ("t1", "t2")
    # While a restart is in flight, nothing more.
    mem.busy_instances.add("i1")
    assert plan(world, mem, 1000.0, P) == []
    mem.busy_instances.clear()
    # It failed again: the 2nd restart waits restart_backoff_s, the 3rd twice that.
    mem.restarts["i1"].append(1000.0)
    assert plan(world, mem, 1000.5, P) == []
    assert _kinds(plan(world, mem, 1001.0, P)) == [(Kind.RESTART, "i1")]
    mem.restarts["i1"].append(1001.0)
    assert plan(world, mem, 1002.5, P) == []
    assert _kinds(plan(world, mem, 1003.0, P)) == [(Kind.RESTART, "i1")]
    mem.restarts["i1"].append(1003.0)
    # Out of restarts within the window: both tasks are re-selected, no more restarts.
    acts = plan(world, mem, 1010.0, P)
    assert _kinds(acts) == [(Kind.RESELECT, "t1"), (Kind.RESELECT, "t2")]
    assert "failed 3 time(s)" in acts[0].detail
    # The window slides: long after, restarts are allowed again.
    assert _kinds(plan(world, mem, 1400.0, P)) == [(Kind.RESTART, "i1")]


def test_lost_node_waits_its_grace_then_marks_lost_and_reselects() -> None:
    mem = Memory()
    world = _obs([_task()], [_inst(node="n1")], nodes=("n0",))
    assert plan(world, mem, 1000.0, P) == []  # the node may come back (its lease was only just gone)
    assert plan(world, mem, 1009.0, P) == []
    acts = plan(world, mem, 1010.0, P)
    assert _kinds(acts) == [(Kind.MARK_LOST, "i1"), (Kind.RESELECT, "t1")]
    # The node is back within the grace: the timer resets.
    mem2 = Memory()
    plan(world, mem2, 1000.0, P)
    assert plan(_obs([_task()], [_inst(node="n1")], nodes=("n0", "n1")), mem2, 1005.0, P) == []
    assert plan(world, mem2, 1012.0, P) == []  # missing again: a fresh grace
    # A LOST (or gone, or DRAINING) instance re-selects at once.
    for inst in (_inst(state=InstanceState.LOST), _inst(state=InstanceState.DRAINING)):
        assert (Kind.RESELECT, "t1") in _kinds(plan(_obs([_task()], [inst]), Memory(), 1000.0, P))
    assert _kinds(plan(_obs([_task()], []), Memory(), 1000.0, P)) == [(Kind.RESELECT, "t1")]


def test_half_done_steps_are_resumed_unless_a_worker_is_on_them() -> None:
    tasks = [_task("s", TaskState.SELECTING), _task("d", TaskState.DEPLOYING, iid="i2", update_time=900.0),
             _task("x", TaskState.DELETING, iid="i3")]
    insts = [_inst("i1"), _inst("i2", InstanceState.PENDING), _inst("i3")]
    mem = Memory()
    assert _set(plan(_obs(tasks, insts), mem, 1000.0, P)) == {
        (Kind.RESUME_SELECT, "s"), (Kind.RESUME_DEPLOY, "d"), (Kind.RESUME_DELETE, "x")}
    mem.busy_tasks = {"s", "d", "x"}
    assert plan(_obs(tasks, insts), mem, 1000.0, P) == []
    # A DEPLOYING task past its deadline is rolled back instead.
    late = _obs([_task("d", TaskState.DEPLOYING, iid="i2", update_time=100.0)], [_inst("i2", InstanceState.PENDING)])
    assert _kinds(plan(late, Memory(), 100.0 + P.deploying_deadline_s, P)) == [(Kind.ROLLBACK_DEPLOY, "d")]
    # A healing task waiting for capacity is retried only once its next attempt is due.
    waiting = _task("s", TaskState.SELECTING, healing=Healing("WAITING_FOR_CAPACITY", "no node", 900.0, 2, 1005.0))
    assert plan(_obs([waiting], [_inst()]), Memory(), 1000.0, P) == []
    assert _kinds(plan(_obs([waiting], [_inst()]), Memory(), 1005.0, P)) == [(Kind.RESUME_SELECT, "s")]


def test_leaks_are_released_after_their_grace_and_profiling_references_are_left_alone() -> None:
    mem = Memory()
    insts = [_inst("used"), _inst("orphan"), _inst("dangling"), _inst("prof")]
    refs = {"used": ("t1",), "dangling": ("gone-task",), "prof": ("profiling-job-1",)}
    world = _obs([_task(iid="used")], insts, refs=refs)
    assert plan(world, mem, 1000.0, P) == []
    acts = plan(world, mem, 1000.0 + P.orphan_grace_s, P)
    assert _set(acts) == {(Kind.DROP_REF, "dangling"), (Kind.STOP_ORPHAN, "orphan")}
    # A FAILED task holding references gets them released (its rollback was cut short).
    failed = _task("f", TaskState.FAILED, iid="used")
    world2 = _obs([_task(iid="used"), failed], [_inst("used")], refs={"used": ("t1", "f")})
    assert _kinds(plan(world2, Memory(), 1000.0, P)) == [(Kind.RELEASE_TASK_REFS, "f")]
    # An orphan on a node that is not alive is left to that node's agent.
    away = _obs([], [_inst("o", node="n9")], nodes=("n0",), refs={})
    m3 = Memory()
    plan(away, m3, 0.0, P)
    assert all(a.kind is not Kind.STOP_ORPHAN for a in plan(away, m3, 1000.0, P))


def test_plan_is_level_triggered() -> None:
    """Given the same world and memory, the same actions: nothing depends on which event woke the loop."""
    world = _obs([_task("a"), _task("b", iid="i2"), _task("c", TaskState.SELECTING, iid="i3")],
                 [_inst("i1", InstanceState.FAILED), _inst("i2", node="n1"), _inst("i3")], nodes=("n0",))
    m1, m2 = Memory(), Memory()
    plan(world, m1, 0.0, P)
    plan(world, m2, 0.0, P)
    assert plan(world, m1, 50.0, P) == plan(world, m2, 50.0, P)
    assert replace(world) == world


def test_deploying_onto_a_lost_instance_is_replanned_even_with_a_worker_on_it() -> None:
    mem = Memory(busy_tasks={"t1"})  # a worker blocked in a Deploy call to the stalled node
    deploying = _task(state=TaskState.DEPLOYING)
    assert plan(_obs([deploying], [_inst(state=InstanceState.PENDING)]), mem, 1000.0, P) == []
    (a,) = plan(_obs([deploying], [_inst(state=InstanceState.LOST)]), mem, 1000.0, P)
    assert a.kind is Kind.REPLAN_DEPLOY and a.task_id == "t1" and "i1" in a.detail
    # Its node gone past the grace (the instance not marked LOST yet): the same, beside the MARK_LOST.
    gone = _obs([deploying], [_inst(state=InstanceState.PENDING)], nodes=())
    plan(gone, mem, 1000.0, P)
    assert (Kind.REPLAN_DEPLOY, "t1") in _set(plan(gone, mem, 1011.0, P))


def test_lost_instance_that_still_answers_keeps_serving_and_is_moved_off_make_before_break() -> None:
    mem = Memory()
    lost = _inst(state=InstanceState.LOST)
    t = _task()
    # No probe answer: re-selected as before.
    assert _kinds(plan(_obs([t], [lost], nodes=()), mem, 1000.0, P)) == [(Kind.RESELECT, "t1")]
    # It answered within the freshness: no re-selection (the task stays ACTIVE on it); a make-before-break move.
    mem.answering["i1"] = 995.0
    assert _kinds(plan(_obs([t], [lost], nodes=()), mem, 1000.0, P)) == [(Kind.MOVE_OFF_LOST, "t1")]
    # ... at most every lost_move_retry_s (a failed attempt is noted as the task's last re-selection).
    from flowmaker.orchestration.task import Reselection

    tried = replace(t, last_reselection=Reselection(990.0, "x", 1.0, outcome="FAILED"))
    assert plan(_obs([tried], [lost], nodes=()), mem, 1000.0, P) == []
    # An answer older than the freshness no longer counts.
    assert _kinds(plan(_obs([t], [lost], nodes=()), mem, 995.0 + P.lost_answer_fresh_s + 1, P)) == [
        (Kind.RESELECT, "t1")]


def test_a_lost_instance_is_probed_until_its_agent_takes_it_back_even_once_its_node_is_live() -> None:
    """The node's record comes back before its agent's resync turns its LOST instances READY: they stay probed, so
    their answers still count and their tasks are not re-selected in between."""
    ep = {"endpoint": "http://127.0.0.1:1"}
    lost_back = replace(_inst("a", state=InstanceState.LOST), **ep)  # node n0 live again
    cut_off = replace(_inst("b", node="n1"), **ep)  # READY on a missing node
    fine = replace(_inst("c"), **ep)  # READY on a live node
    unknown = _inst("d", state=InstanceState.LOST)  # no endpoint: nothing to probe
    failed = replace(_inst("e", state=InstanceState.FAILED, node="n1"), **ep)
    obs = _obs([], [lost_back, cut_off, fine, unknown, failed])
    assert to_probe(obs) == {"a": ep["endpoint"], "b": ep["endpoint"]}
    # And what the plan makes of a recent answer there: the task keeps being served, moved off make-before-break.
    mem = Memory()
    mem.answering["i1"] = 995.0
    back = replace(_inst(state=InstanceState.LOST), **ep)
    assert "i1" in to_probe(_obs([_task()], [back]))
    assert _kinds(plan(_obs([_task()], [back]), mem, 1000.0, P)) == [(Kind.MOVE_OFF_LOST, "t1")]
