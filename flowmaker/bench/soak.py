"""`flowmaker bench soak`: a seeded random schedule of faults under steady load, for minutes, on a real local stack.

By default the stack is the shipped configuration: mTLS between the services, bearer tokens, engine API keys and
the default lease, grace and liveness timings (`--fast` shortens the reconciler's, as the self-healing tests do).
Faults, drawn with a seeded RNG one after the other (the next only once the last has healed, or timed out),
every kind once per round in a shuffled order, so that a run long enough for one round covers them all:
- crashes: kill -9 of an engine, of the deployer, of the orchestrator (replica 1), of an orchestrator replica
  that does not lead, of etcd (the launcher's supervisor restarts the processes, as `flowmaker up` does);
- hangs: SIGSTOP of an engine (until its node agent kills it, at most `engine_stop_s`), of the deployer
  (`deployer_stop_s`, past its lease and the grace), of etcd (`etcd_stop_s`);
- faults aimed at an approval: a new task is approved and, once it is DEPLOYING, etcd is killed or stopped,
  the orchestrator killed, the deployer stopped, or the elected orchestrator replica killed (`orchestrator_leader`:
  the time until another replica holds the leader key is reported against the lease TTL); it must end ACTIVE (and
  is deleted afterwards).
Steady load runs throughout. Every second the invariants of `flowmaker.bench.faults` are checked (a violation
counts when it persists over two checks: a process between its parent's death and its own is no orphan yet); once the faults are over, the
settled invariants too (no leaked reservation or reference), given the reconciler's orphan grace to hold.

Reported: goodput (requests answered OK / sent), requests lost (answered with an error), time to heal per
fault, counted from the moment the fault began (until every task is ACTIVE again, not healing, an approved
task ACTIVE, and a probe request succeeds: p50 and max), and the invariant checks with any violation. JSON in
the output folder and a table.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from flowmaker.api.common.v1 import task_pb2
from flowmaker.bench.faults import (
    ACTIVE,
    DEPLOYING,
    FAILED,
    NEW_MODEL_SLO,
    Client,
    Load,
    Supervisor,
    check_invariants,
    engine_pid,
    etcd_stopped,
    kill_engine,
    kill_orchestrator,
    kill_service,
    leader_record,
    stopped,
    wait_new_leader,
    wait_task_state,
)
from flowmaker.launcher.stack import LocalStack, StackConfig

FAULTS = ("engine", "deployer", "orchestrator", "etcd_kill", "etcd_stop", "engine_stop", "deployer_stop",
          "etcd_kill_deploying", "etcd_stop_deploying", "orchestrator_kill_deploying", "deployer_stop_deploying",
          "orchestrator_replica", "orchestrator_leader")
FAST_ENV = {
    "FLOWMAKER_ORCHESTRATOR_RECONCILE_INTERVAL_S": "1",
    "FLOWMAKER_ORCHESTRATOR_RECONCILE_NODE_LOST_GRACE_S": "5",
    "FLOWMAKER_ORCHESTRATOR_RECONCILE_HEAL_BACKOFF_MAX_S": "3",
    "FLOWMAKER_DEPLOYER_LEASE_TTL_S": "5",
    "FLOWMAKER_DEPLOYER_RESYNC_INTERVAL_S": "2",
}


@dataclass
class SoakConfig:
    duration_s: float = 600.0
    seed: int = 1
    tasks: int = 3
    rate_rps: float = 3.0
    gap_s: tuple[float, float] = (10.0, 30.0)  # quiet time between a heal and the next fault
    heal_timeout_s: float = 120.0
    etcd_stop_s: float = 15.0
    deployer_stop_s: float = 35.0  # past the default lease (10 s) and grace (10 s): its instances go LOST
    engine_stop_s: float = 60.0  # the longest an engine stays stopped (its node agent should kill it first)
    time_scale: float = 20.0
    gpus: int = 4
    settle_timeout_s: float = 90.0  # after the last fault, for the settled invariants (no leak) to hold
    tls: bool = True  # the shipped configuration (`flowmaker up`): mTLS, tokens, engine API keys
    fast: bool = False  # the self-healing tests' shorter lease and grace times instead of the defaults
    faults: tuple[str, ...] = FAULTS
    orchestrators: int = 2  # replicas, as `flowmaker up` starts them (one elected to reconcile)
    leader_ttl_s: int = 5  # FLOWMAKER_ORCHESTRATOR_LEADER_LEASE_TTL_S (the default)


@dataclass
class FaultRecord:
    at_s: float  # since the soak started
    kind: str
    healed: bool
    heal_s: float
    detail: str = ""


@dataclass
class SoakResult:
    config: dict[str, Any]
    wall_s: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)
    goodput: float = 0.0
    lost: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    heal_p50_s: float = 0.0
    heal_max_s: float = 0.0
    lost_after: dict[str, int] = field(default_factory=dict)  # requests lost, by the last fault before them
    invariant_checks: int = 0
    violations: list[str] = field(default_factory=list)
    settled_violations: list[str] = field(default_factory=list)  # leaks left once the faults are over
    supervisor_events: list[str] = field(default_factory=list)


def _healed(c: Client, task_ids: list[str]) -> bool:
    try:
        for tid in task_ids:
            t = c.get(tid, timeout_s=3)
            if t.state != ACTIVE or t.HasField("healing"):
                return False
        c.invoke(task_ids[0], "probe", timeout_s=10)
        return True
    except grpc.RpcError:
        return False


def _get(c: Client, task_id: str) -> Any:
    try:
        return c.get(task_id, timeout_s=3)
    except grpc.RpcError:
        return None


def _inject(kind: str, cfg: SoakConfig, stack: LocalStack, c: Client, n: int) -> tuple[str, str]:
    """Carry one fault out; (detail, the id of a task approved for it or "")."""
    if kind == "orchestrator_replica":
        name, pid = kill_orchestrator(stack, leader=False)
        return (f"{name} (not the leader) pid {pid}" if pid else "no replica other than the leader"), ""
    if kind == "orchestrator_leader":
        # A task approved through the replicas while the leader is killed during its deploy: the new leader (within
        # the lease TTL) resumes the deploy, and the task must end ACTIVE.
        t = c.deploy(f"approved{n}", slo=NEW_MODEL_SLO)
        threading.Thread(target=lambda: _quiet(lambda: c.approve(t.id, timeout_s=120)), daemon=True).start()
        try:
            reached = wait_task_state(c, t.id, (DEPLOYING, ACTIVE, FAILED))
        except TimeoutError:
            reached = None
        lead = leader_record(stack)
        name, pid = kill_orchestrator(stack, leader=True)
        if not pid:
            return "no leader to kill", t.id
        new = wait_new_leader(stack, lead.get("pid") if lead else pid, timeout_s=4 * cfg.leader_ttl_s)
        when = "during its deploy" if reached == DEPLOYING else "(MISSED DEPLOYING: killed after it)"
        took = (f"new leader {new[0]} after {new[1]:.1f}s ({'within' if new[1] <= cfg.leader_ttl_s else 'PAST'} "
                f"the {cfg.leader_ttl_s}s TTL)" if new else "NO new leader")
        return f"leader {name} pid {pid} killed {when} of {t.id}; {took}", t.id
    if kind == "engine":
        return f"pid {kill_engine(stack)}", ""
    if kind == "etcd_stop":
        with etcd_stopped(stack):
            time.sleep(cfg.etcd_stop_s)
        return f"{cfg.etcd_stop_s:g}s", ""
    if kind == "engine_stop":
        pid = engine_pid(stack)
        if pid is None:
            return "no engine", ""
        t0 = time.monotonic()
        with stopped(pid):
            while time.monotonic() - t0 < cfg.engine_stop_s and _running(pid):
                time.sleep(0.2)
        killed = not _running(pid)
        return f"pid {pid} {'killed by its node agent' if killed else 'NOT killed'} after {time.monotonic() - t0:.1f}s", ""
    if kind == "deployer_stop":
        pid = stack.pid_of("deployer")
        if pid:
            with stopped(pid):
                time.sleep(cfg.deployer_stop_s)
        return f"pid {pid} for {cfg.deployer_stop_s:g}s", ""
    if kind == "deployer_stop_deploying":
        # The case: the node's agent is stopped while its lease still holds, so the approval's selection
        # places onto it and its Deploy call blocks. The approval must answer once the instance is LOST (lease +
        # grace), re-planned (with no other node: waiting for capacity, with the reason), and the task must end
        # ACTIVE once the node is back.
        t = c.deploy(f"approved{n}", slo=NEW_MODEL_SLO)  # a new instance: a Deploy call to the stopped node
        pid = stack.pid_of("deployer")
        if not pid:
            return "no deployer", t.id
        answered: list[float] = []
        t0 = time.monotonic()
        outcome: list[str] = []

        def approve() -> None:
            try:
                got = c.approve(t.id, timeout_s=120)
                outcome.append(f"{task_pb2.Task.State.Name(got.state)}"
                               + (f" ({got.healing.action}: {got.healing.detail[:100]})" if got.HasField("healing")
                                  else ""))
            except grpc.RpcError as e:
                outcome.append(f"{e.code().name}: {(e.details() or '')[:120]}")
            answered.append(time.monotonic() - t0)
        with stopped(pid):
            threading.Thread(target=approve, daemon=True).start()
            time.sleep(cfg.deployer_stop_s)
        how = f"answered after {answered[0]:.1f}s: {outcome[0]}" if answered else "did NOT answer during the stall"
        return f"deployer pid {pid} stopped {cfg.deployer_stop_s:g}s with the approval of {t.id} on it; it {how}", t.id
    if kind.endswith("_deploying"):
        t = c.deploy(f"approved{n}", slo=NEW_MODEL_SLO)  # a new instance: DEPLOYING lasts its engine's start
        th = threading.Thread(target=lambda: _quiet(lambda: c.approve(t.id, timeout_s=120)), daemon=True)
        th.start()
        try:
            if wait_task_state(c, t.id, (DEPLOYING, ACTIVE, FAILED)) != DEPLOYING:
                return "MISSED: the approval was past DEPLOYING before the fault", t.id
        except TimeoutError:
            return "MISSED: the approval never reached DEPLOYING", t.id
        if kind == "etcd_stop_deploying":
            with etcd_stopped(stack):
                time.sleep(cfg.etcd_stop_s)
            return f"etcd stopped {cfg.etcd_stop_s:g}s during the deploy of {t.id}", t.id
        name = "etcd" if kind.startswith("etcd") else "orchestrator"
        return f"{name} pid {kill_service(stack, name)} killed during the deploy of {t.id}", t.id
    return f"pid {kill_service(stack, 'etcd' if kind == 'etcd_kill' else kind)}", ""


def _quiet(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(grpc.RpcError):
        fn()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_soak(cfg: SoakConfig, out: Path, progress: Callable[[str], None] = lambda m: None) -> SoakResult:
    rng = random.Random(cfg.seed)
    res = SoakResult(config=asdict(cfg))
    with tempfile.TemporaryDirectory(prefix="flowmaker-soak-") as tmp:
        env = {**(FAST_ENV if cfg.fast else {}), "FLOWMAKER_ORCHESTRATOR_LEADER_LEASE_TTL_S": str(cfg.leader_ttl_s)}
        stack = LocalStack(StackConfig(gpus=cfg.gpus, time_scale=cfg.time_scale, log_level="WARNING", tls=cfg.tls,
                                       work_dir=Path(tmp) / "stack", keep_work_dir=True, extra_env=env,
                                       orchestrators=cfg.orchestrators))
        progress("starting the stack")
        stack.start()
        t0 = time.monotonic()
        stop = threading.Event()
        pending: dict[str, int] = {}
        fault_times: list[tuple[float, str]] = []  # (wall time of the fault, kind)
        try:
            with Supervisor(stack) as sup:
                c = Client(stack)
                task_ids = []
                for i in range(cfg.tasks):
                    t = c.approve(c.deploy(f"soak{i}").id)
                    if t.state != ACTIVE:
                        raise RuntimeError(f"task soak{i} did not deploy: {t.failure.message}")
                    task_ids.append(t.id)

                def checker() -> None:
                    while not stop.wait(1.0):
                        bad = set(check_invariants(stack))
                        res.invariant_checks += 1
                        for v in list(pending):
                            if v not in bad:
                                del pending[v]
                        for v in bad:
                            pending[v] = pending.get(v, 0) + 1
                            if pending[v] == 2:
                                res.violations.append(f"{time.monotonic() - t0:.0f}s: {v}")
                th = threading.Thread(target=checker, daemon=True)
                th.start()
                load = Load(c, task_ids, rate_rps=cfg.rate_rps).start()
                end = t0 + cfg.duration_s
                bag: list[str] = []
                while time.monotonic() < end:
                    quiet = rng.uniform(*cfg.gap_s)
                    if time.monotonic() + quiet >= end:
                        break
                    time.sleep(quiet)
                    if not bag:  # every kind once per round, in a seeded order: a run covers them all
                        bag = rng.sample(cfg.faults, len(cfg.faults))
                    kind = bag.pop()
                    at = time.monotonic() - t0
                    progress(f"{at:5.0f}s: {kind}")
                    t_fault = time.monotonic()  # heal time counts from the start of the fault
                    wall_fault = time.time()
                    detail, approved = _inject(kind, cfg, stack, c, len(res.faults))
                    healed = False
                    while time.monotonic() - t_fault < cfg.heal_timeout_s:
                        time.sleep(0.25)
                        if _healed(c, task_ids + ([approved] if approved else [])):
                            healed = True
                            break
                        if kind.startswith("orchestrator"):
                            c.reconnect()
                    heal = time.monotonic() - t_fault
                    if approved:
                        t_end = _get(c, approved)
                        if t_end is not None and t_end.state == FAILED:
                            detail += f"; the approved task FAILED: {t_end.failure.message[:120]}"
                        with contextlib.suppress(grpc.RpcError):
                            c.delete(approved)
                    res.faults.append(FaultRecord(round(at, 1), kind, healed, round(heal, 2), detail))
                    fault_times.append((wall_fault, kind))
                    progress(f"{at:5.0f}s: {kind} healed={healed} in {heal:.1f}s ({detail})")
                load.stop()
                stop.set()
                th.join(5)
                # Settled: no reservation or reference leaked by any fault (the approved tasks were deleted). A
                # reference to no task is dropped after the reconciler's orphan grace, so give it that long.
                progress("checking that nothing leaked (settled invariants)")
                settle_end = time.monotonic() + cfg.settle_timeout_s
                leaked = check_invariants(stack, settled=True)
                while leaked and time.monotonic() < settle_end:
                    time.sleep(1.0)
                    leaked = check_invariants(stack, settled=True)
                res.settled_violations = leaked
                res.supervisor_events = [e for _, e in sup.events]
                res.requests = dict(Counter(load.outcomes))
                sent = load.sent
                res.goodput = load.outcomes["OK"] / sent if sent else 0.0
                res.lost = sent - load.outcomes["OK"]
                for when, _tid, _msg in load.failures:
                    before = [k for ft, k in fault_times if ft <= when]
                    key = before[-1] if before else "none"
                    res.lost_after[key] = res.lost_after.get(key, 0) + 1
                c.close()
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                stack.stop()
    res.wall_s = round(time.monotonic() - t0, 1)
    heals = [f.heal_s for f in res.faults if f.healed]
    res.heal_p50_s = round(statistics.median(heals), 2) if heals else 0.0
    res.heal_max_s = round(max(heals), 2) if heals else 0.0
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(asdict(res), indent=2))
    return res


def render(res: SoakResult, console: Any) -> None:
    from rich.table import Table

    tab = Table(title=f"soak: {len(res.faults)} faults over {res.wall_s:.0f}s (seed {res.config['seed']})")
    for col in ("at", "fault", "healed", "time to heal", "detail"):
        tab.add_column(col)
    for f in res.faults:
        tab.add_row(f"{f.at_s:.0f}s", f.kind, "yes" if f.healed else "[red]NO[/red]", f"{f.heal_s:.1f}s", f.detail)
    console.print(tab)
    sent = sum(res.requests.values())
    console.print(f"requests: {sent} sent, {res.requests.get('OK', 0)} OK, {res.lost} lost "
                  f"({', '.join(f'{k} {v}' for k, v in sorted(res.requests.items()) if k != 'OK') or 'none'}); "
                  f"goodput {res.goodput:.4f}")
    if res.lost_after:
        console.print("lost, by the fault before them: " + ", ".join(f"{k} {v}" for k, v in sorted(res.lost_after.items())))
    console.print(f"time to heal: p50 {res.heal_p50_s:.1f}s, max {res.heal_max_s:.1f}s; invariant checks "
                  f"{res.invariant_checks}, violations {len(res.violations)}")
    console.print("settled at the end (no leaked reservation or reference): "
                  + ("yes" if not res.settled_violations else f"[red]NO[/red]: {res.settled_violations[:5]}"))
    for v in res.violations[:10]:
        console.print(f"  [red]violation[/red] {v}", markup=True)
