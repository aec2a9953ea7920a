"""The reconciler's decisions: compare desired state (each task's committed variant) with observed state
(instance records, node leases, reuse references) and say what to do. Pure: no I/O, time is passed in.

Level-triggered, as Kubernetes controllers are: `plan()` looks at one snapshot of etcd and the reconciler's
own short memory (`Memory`: what it started, since when a node or a reference looked lost), never at the
event that woke it, so running it twice on the same world gives the same actions and a missed event is
caught by the next periodic pass. The I/O that carries the actions out is services/orchestrator/reconciler.py.

Rules, per task state:
- ACTIVE: every instance of the variant must be READY on a live node.
  * FAILED on a live node -> RESTART it in place (same GPUs, same id, so every task sharing it heals at
    once), with exponential backoff, at most `max_restarts` within `restart_window_s`;
  * its node's lease gone for longer than `node_lost_grace_s` -> mark it LOST;
  * LOST (or on a node lost) but its engine still answers the reconciler's probe (`Memory.answering`: the
    node agent stalled or was cut off from etcd, the engine did not) -> keep routing to it, and MOVE_OFF_LOST:
    a make-before-break re-selection (the task stays ACTIVE on it until the new variant is READY; its memory
    is on a node out of the live cluster, so nothing counts it twice), retried every `lost_move_retry_s`;
  * LOST, gone, DRAINING, or out of restarts -> RESELECT the task against the live cluster.
  * all READY again and `healing` still set -> CLEAR it.
- DEPLOYING with an instance LOST (or on a node lost past the grace), whether or not a worker is on it (a
  worker may be blocked in a Deploy call to a stalled node for minutes) -> REPLAN it at once: the worker is
  cancelled, what the commit reserved is given back and the task is selected again against the live cluster.
- SELECTING / DEPLOYING / DELETING with no worker of this process on it (a crash, an etcd outage that
  ended the worker) -> RESUME the step; a healing SELECTING task waits for `healing.next_attempt_at`;
  a DEPLOYING task past `deploying_deadline_s` is rolled back (FAILED, or retried when healing).
- Leaks: a reuse reference naming no task (after `orphan_grace_s`) is DROPPED; a FAILED task still holding
  references has them RELEASED; an instance on a live node that no reference names for `orphan_grace_s` is
  STOPPED (its memory given back). Profiling jobs' references are the profiler's own and never touched.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field

from flowmaker.orchestration.task import TaskRecord, TaskState
from flowmaker.state.records import PROFILING_OWNER_PREFIX, InstanceRecord, InstanceState


@dataclass(frozen=True, slots=True)
class Policy:
    """The reconciler's knobs (OrchestratorSettings.reconcile_*)."""

    restart_backoff_s: float = 1.0  # before the 2nd restart of an instance; doubles each time
    restart_backoff_max_s: float = 30.0
    max_restarts: int = 3  # restarts in place within restart_window_s before the task is re-selected
    restart_window_s: float = 300.0
    node_lost_grace_s: float = 10.0  # a node key absent this long (after its lease TTL) is lost
    orphan_grace_s: float = 30.0  # an unreferenced instance / a reference to no task lives this long
    deploying_deadline_s: float = 600.0  # a DEPLOYING task this old (since its last update) is rolled back
    lost_answer_fresh_s: float = 10.0  # a LOST instance whose engine answered a probe this recently still serves
    lost_move_retry_s: float = 30.0  # between two make-before-break attempts to move a task off such an instance


@dataclass(frozen=True, slots=True)
class Observed:
    """One snapshot of what etcd says (alive nodes only in `nodes`)."""

    tasks: dict[str, TaskRecord]
    instances: dict[str, InstanceRecord]
    nodes: frozenset[str]
    refs: dict[str, frozenset[str]]  # instance id -> task ids referencing it


@dataclass
class Memory:
    """What the reconciler remembers between passes (in process; a restarted orchestrator starts afresh,
    which only delays a grace period)."""

    busy_tasks: set[str] = field(default_factory=set)  # tasks a worker of this process is on
    busy_instances: set[str] = field(default_factory=set)  # instances with a restart in flight
    restarts: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # instance -> times
    node_missing_since: dict[str, float] = field(default_factory=dict)
    unreferenced_since: dict[str, float] = field(default_factory=dict)  # instance -> first seen unreferenced
    dangling_since: dict[tuple[str, str], float] = field(default_factory=dict)  # (instance, task) -> first seen
    answering: dict[str, float] = field(default_factory=dict)  # instance on a missing node -> last probe answered

    def answers(self, iid: str, now: float, fresh_s: float) -> bool:
        at = self.answering.get(iid)
        return at is not None and now - at <= fresh_s

    def restarts_in_window(self, iid: str, now: float, window_s: float) -> list[float]:
        xs = [t for t in self.restarts.get(iid, ()) if now - t < window_s]
        if xs:
            self.restarts[iid] = xs
        else:
            self.restarts.pop(iid, None)
        return xs


class Kind(enum.Enum):
    RESTART = "RESTART"  # instance_id; task_ids = the ACTIVE tasks it serves
    MARK_LOST = "MARK_LOST"  # instance_id
    RESELECT = "RESELECT"  # task_id
    CLEAR_HEALING = "CLEAR_HEALING"  # task_id
    RESUME_SELECT = "RESUME_SELECT"  # task_id
    RESUME_DEPLOY = "RESUME_DEPLOY"  # task_id
    RESUME_DELETE = "RESUME_DELETE"  # task_id
    ROLLBACK_DEPLOY = "ROLLBACK_DEPLOY"  # task_id: DEPLOYING past its deadline
    RELEASE_TASK_REFS = "RELEASE_TASK_REFS"  # task_id: a FAILED task still holding references
    DROP_REF = "DROP_REF"  # instance_id + task_ids[0]: a reference to a task that does not exist
    STOP_ORPHAN = "STOP_ORPHAN"  # instance_id: no reference names it
    RESUME_SWITCH = "RESUME_SWITCH"  # task_id: a make-before-break switch to its next variant was cut short
    ABORT_SWITCH = "ABORT_SWITCH"  # task_id: ... and is past its deadline
    MOVE_OFF_LOST = "MOVE_OFF_LOST"  # task_id: make-before-break off a LOST instance that still answers
    REPLAN_DEPLOY = "REPLAN_DEPLOY"  # task_id: DEPLOYING onto an instance that is lost (a stalled or dead node)


@dataclass(frozen=True, slots=True)
class Action:
    kind: Kind
    task_id: str = ""
    instance_id: str = ""
    node: str = ""
    task_ids: tuple[str, ...] = ()
    detail: str = ""


def to_probe(obs: Observed) -> dict[str, str]:
    """Instance id -> engine endpoint of the instances whose engines the reconciler probes (`Memory.answering`):
    READY ones on a node out of the live cluster (a stalled agent, a lease lost to an etcd outage), and LOST ones
    wherever their node is. A node that comes back is in the live cluster before its agent has taken its instances
    back (LOST -> READY, at its next resync): an answer forgotten in between made the instance look dead, and its
    task was re-selected off an engine that never stopped serving (tests/e2e/test_liveness.py's stall test, now and
    then)."""
    return {iid: r.endpoint for iid, r in obs.instances.items() if r.endpoint and (
        r.state is InstanceState.LOST or (r.state is InstanceState.READY and r.node not in obs.nodes))}


def _restart_due(mem: Memory, iid: str, now: float, p: Policy) -> tuple[bool, bool]:
    """(may restart now, restarts exhausted)."""
    done = mem.restarts_in_window(iid, now, p.restart_window_s)
    if len(done) >= p.max_restarts:
        return False, True
    if not done:
        return True, False
    wait = min(p.restart_backoff_max_s, p.restart_backoff_s * 2 ** (len(done) - 1))
    return now - done[-1] >= wait, False


def plan(obs: Observed, mem: Memory, now: float, p: Policy) -> list[Action]:
    """The actions that move the observed world toward the desired one (see the module docstring).
    Updates `mem`'s timers (node_missing_since, unreferenced_since, dangling_since) as a side effect."""
    actions: list[Action] = []
    # -- timers over nodes and references
    known_nodes = {r.node for r in obs.instances.values()}
    for n in known_nodes - obs.nodes:
        mem.node_missing_since.setdefault(n, now)
    for n in list(mem.node_missing_since):
        if n in obs.nodes or n not in known_nodes:
            del mem.node_missing_since[n]

    def node_lost(node: str) -> bool:
        since = mem.node_missing_since.get(node)
        return since is not None and now - since >= p.node_lost_grace_s

    # -- instances whose node is lost: LOST (memory stays with the dead node; it reconciles on return)
    for iid, rec in sorted(obs.instances.items()):
        if rec.state in (InstanceState.PENDING, InstanceState.STARTING, InstanceState.READY) and node_lost(rec.node):
            actions.append(Action(Kind.MARK_LOST, instance_id=iid, node=rec.node,
                                  detail=f"node {rec.node} has been gone for {now - mem.node_missing_since[rec.node]:.0f}s"))

    # -- tasks
    restart: dict[str, list[str]] = defaultdict(list)
    for tid, t in sorted(obs.tasks.items()):
        if t.state is TaskState.DEPLOYING:
            lost = [(iid, r.node) for iid in t.instance_ids if (r := obs.instances.get(iid)) is not None
                    and (r.state is InstanceState.LOST or node_lost(r.node))]
            if lost:
                actions.append(Action(Kind.REPLAN_DEPLOY, task_id=tid, instance_id=lost[0][0],
                                      detail=f"instance {lost[0][0]} is lost with node {lost[0][1]} while deploying"))
                continue
        if tid in mem.busy_tasks:
            continue
        if t.state is TaskState.ACTIVE and t.next_variant is not None:
            started = t.last_reselection.at if t.last_reselection else t.update_time
            kind = Kind.ABORT_SWITCH if now - started >= p.deploying_deadline_s else Kind.RESUME_SWITCH
            actions.append(Action(kind, task_id=tid, detail=f"switch started {now - started:.0f}s ago"))
        if t.state is TaskState.ACTIVE:
            reselect = ""
            healthy = True
            serving_lost: list[str] = []
            for iid in t.instance_ids:
                found = obs.instances.get(iid)
                if found is None:
                    reselect, healthy = f"instance {iid} is gone", False
                    break
                rec = found
                if rec.state is InstanceState.READY and rec.node in obs.nodes:
                    continue
                healthy = False
                if rec.state is InstanceState.LOST or node_lost(rec.node):
                    if rec.state in (InstanceState.LOST, InstanceState.READY) and \
                            mem.answers(iid, now, p.lost_answer_fresh_s):
                        serving_lost.append(iid)
                        continue
                    reselect = f"instance {iid} is lost with node {rec.node}"
                    break
                if rec.node not in obs.nodes:
                    continue  # the node may be back within the grace: wait
                if rec.state is InstanceState.DRAINING:
                    reselect = f"instance {iid} is being released"
                    break
                if rec.state is InstanceState.FAILED:
                    if iid in mem.busy_instances:
                        continue
                    due, exhausted = _restart_due(mem, iid, now, p)
                    if exhausted:
                        reselect = (f"instance {iid} failed {p.max_restarts} time(s) within "
                                    f"{p.restart_window_s:g}s: {(rec.reason or rec.failure_reason).splitlines()[0] if (rec.reason or rec.failure_reason) else 'no reason'}")
                        break
                    if due:
                        restart[iid].append(tid)
                # PENDING / STARTING: a deployer is on it
            if not reselect and serving_lost and t.next_variant is None and now - (
                    t.last_reselection.at if t.last_reselection else 0.0) >= p.lost_move_retry_s:
                iid = serving_lost[0]
                actions.append(Action(Kind.MOVE_OFF_LOST, task_id=tid, instance_id=iid,
                                      detail=f"instance {iid} is lost with node {obs.instances[iid].node} "
                                             f"but its engine still answers"))
            if reselect:
                actions.append(Action(Kind.RESELECT, task_id=tid, detail=reselect))
                for iid in list(restart):
                    if tid in restart[iid]:
                        restart[iid].remove(tid)
            elif healthy and t.healing is not None:
                actions.append(Action(Kind.CLEAR_HEALING, task_id=tid))
        elif t.state is TaskState.SELECTING:
            if t.healing is None or t.healing.next_attempt_at <= now:
                actions.append(Action(Kind.RESUME_SELECT, task_id=tid))
        elif t.state is TaskState.DEPLOYING:
            if now - t.update_time >= p.deploying_deadline_s:
                actions.append(Action(Kind.ROLLBACK_DEPLOY, task_id=tid,
                                      detail=f"DEPLOYING for {now - t.update_time:.0f}s, past the "
                                             f"{p.deploying_deadline_s:g}s deadline"))
            else:
                actions.append(Action(Kind.RESUME_DEPLOY, task_id=tid))
        elif t.state is TaskState.DELETING:
            actions.append(Action(Kind.RESUME_DELETE, task_id=tid))
        elif t.state is TaskState.FAILED and any(tid in ts for ts in obs.refs.values()):
            actions.append(Action(Kind.RELEASE_TASK_REFS, task_id=tid, detail="a FAILED task holds references"))
    for iid, tids in sorted(restart.items()):
        if tids:
            rec = obs.instances[iid]
            actions.append(Action(Kind.RESTART, instance_id=iid, node=rec.node, task_ids=tuple(sorted(tids)),
                                  detail=f"instance {iid} {rec.state.value}"
                                         + (f" ({rec.failure_reason})" if rec.failure_reason else "")))

    # -- leaks: references to no task, instances no reference names
    def uses(t: TaskRecord, iid: str) -> bool:
        # A task in the middle of a step may hold references it does not list yet (or any more): only
        # a settled task's stray references are leaks.
        return (t.state not in (TaskState.ACTIVE, TaskState.FAILED) or t.id in mem.busy_tasks
                or t.next_variant is not None or iid in t.instance_ids)

    dangling = {(iid, tid) for iid, tids in obs.refs.items() for tid in tids
                if not tid.startswith(PROFILING_OWNER_PREFIX)
                and (tid not in obs.tasks or (obs.tasks[tid].state is TaskState.ACTIVE
                                              and not uses(obs.tasks[tid], iid)))}
    for k in list(mem.dangling_since):
        if k not in dangling:
            del mem.dangling_since[k]
    for iid, tid in sorted(dangling):
        since = mem.dangling_since.setdefault((iid, tid), now)
        ref_of = obs.instances.get(iid)
        if now - since >= p.orphan_grace_s and (ref_of is None or ref_of.node in obs.nodes):
            actions.append(Action(Kind.DROP_REF, instance_id=iid, node=ref_of.node if ref_of else "", task_ids=(tid,),
                                  detail=f"reference of {iid} to task {tid}, which does not use it"))
    unreferenced = {iid for iid in obs.instances if not obs.refs.get(iid)}
    for iid in list(mem.unreferenced_since):
        if iid not in unreferenced:
            del mem.unreferenced_since[iid]
    for iid in sorted(unreferenced):
        since = mem.unreferenced_since.setdefault(iid, now)
        rec = obs.instances[iid]
        if now - since >= p.orphan_grace_s and rec.node in obs.nodes and rec.state is not InstanceState.DRAINING:
            actions.append(Action(Kind.STOP_ORPHAN, instance_id=iid, node=rec.node,
                                  detail=f"{rec.state.value} instance {iid} has had no reference for {now - since:.0f}s"))
    return actions
