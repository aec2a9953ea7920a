"""Fault injection against a real local stack: kill -9 and SIGSTOP on its processes, steady load, invariants.

Used by the self-healing tests (tests/e2e/test_self_healing.py) and by `flowmaker bench soak`. Everything
runs on loopback against a `LocalStack` (real etcd, the five services as processes, emulated engines),
with the launcher's supervisor restarting whatever is killed, as `flowmaker up` does.

Invariants (`check_invariants`), read from ONE etcd range over the whole key space, so from one revision:
- no GPU over-commit: every GPU's memory_used <= its total, and equals the sum over the instances holding
  memory on it;
- no orphan engine: every emulated engine process on the machine descends from the current deployer;
- (settled only) no leaked reservation: every instance holding memory is referenced by a task, and every
  reference names a task that exists.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from flowmaker import convert
from flowmaker.api.common.v1 import task_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.domain import Slo, Stage, Workflow
from flowmaker.launcher.procs import descendants
from flowmaker.launcher.stack import LocalStack
from flowmaker.state import keys
from flowmaker.state.records import PROFILING_OWNER_PREFIX, GpuRecord, InstanceRecord

ACTIVE = task_pb2.Task.STATE_ACTIVE
DEPLOYING = task_pb2.Task.STATE_DEPLOYING
FAILED = task_pb2.Task.STATE_FAILED
ONE_STAGE = Workflow("one", (Stage("answer", input_tokens=50, output_tokens=8, prompt_template="{input}"),))
SLO = Slo(min_accuracy=0.1, max_latency_s=30.0, arrival_rate_rps=0.5)
# An accuracy only a model other than SLO's cheapest meets: an approval with it starts a new instance (a real
# DEPLOYING step, with a Deploy call in flight) even when the SLO tasks' instances could be reused.
NEW_MODEL_SLO = Slo(min_accuracy=0.25, max_latency_s=30.0, arrival_rate_rps=0.5)
_ENGINE_MODULE = "flowmaker.engine.server"


# ---- etcd, read directly (JSON gateway: no client library, no event loop) ---------------------------

def etcd_snapshot(endpoint: str, prefix: str = keys.ROOT, timeout_s: float = 3.0,
                  pki_dir: Path | None = None) -> dict[str, Any]:
    """Every key under `prefix` at one revision, values decoded from JSON. `pki_dir`: a TLS stack's (etcd then
    takes only https with a client certificate of the stack's CA: the admin's)."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                       "range_end": base64.b64encode(end.encode()).decode()}).encode()
    ctx = None
    if pki_dir is not None:
        import ssl

        from flowmaker.rpc.tls import ADMIN, pki_files

        admin = pki_files(pki_dir, ADMIN)
        ctx = ssl.create_default_context(cafile=admin.ca)
        ctx.load_cert_chain(admin.cert, admin.key)
    scheme = "https" if ctx is not None else "http"
    req = urllib.request.Request(f"{scheme}://{endpoint}/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as r:
        resp = json.loads(r.read())
    out: dict[str, Any] = {}
    for kv in resp.get("kvs", []):
        k = base64.b64decode(kv["key"]).decode()
        with contextlib.suppress(ValueError):
            out[k] = json.loads(base64.b64decode(kv.get("value", "")).decode() or "null")
    return out


def check_invariants(stack: LocalStack, *, settled: bool = False) -> list[str]:
    """Violations of the invariants (module docstring); [] when all hold. etcd unreachable: not checked."""
    bad: list[str] = []
    try:
        snap = etcd_snapshot(stack.etcd_endpoint, pki_dir=stack.pki_dir)
    except OSError:
        return bad
    gpus = [GpuRecord.from_json(v) for k, v in snap.items() if k.startswith(keys.GPUS)]
    insts = [InstanceRecord.from_json(v) for k, v in snap.items() if k.startswith(keys.INSTANCES)]
    for g in gpus:
        held = sum(i.memory_gb_per_gpu for i in insts if i.memory_reserved and i.node == g.node and g.id in i.gpu_ids)
        if g.memory_used_gb > g.memory_total_gb + 1e-6:
            bad.append(f"GPU {g.id} over-committed: {g.memory_used_gb:g} > {g.memory_total_gb:g} GB")
        if abs(held - g.memory_used_gb) > 1e-3:
            bad.append(f"GPU {g.id} accounting: {g.memory_used_gb:g} GB used, instances hold {held:g} GB")
    bad += orphan_engines(stack)
    if settled:
        tasks = {v.get("id", "") for k, v in snap.items() if k.startswith(keys.TASKS) and isinstance(v, dict)}
        refs = [keys.parse_reuse(k) for k in snap if k.startswith(keys.REUSE)]
        for iid, tid in refs:
            if tid not in tasks and not tid.startswith(PROFILING_OWNER_PREFIX):
                bad.append(f"reference of {iid} to task {tid}, which does not exist")
        referenced = {iid for iid, _ in refs}
        for i in insts:
            if i.memory_reserved and i.id not in referenced:
                bad.append(f"instance {i.id} ({i.state.value}) holds memory and no task references it")
    return bad


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def engine_pids() -> list[int]:
    """Every emulated engine process on this machine (of any stack)."""
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and _ENGINE_MODULE in _cmdline(int(d.name)) and "setpriv" not in _cmdline(int(d.name))]


def orphan_engines(stack: LocalStack) -> list[str]:
    """This stack's engines (FLOWMAKER_STACK=<its work dir> in their environment) that do not descend from its
    current deployer: left behind by a deployer that died."""
    dep = stack.pid_of("deployer")
    ours = {pid for pid, _ in descendants(dep)} if dep else set()
    marker = f"FLOWMAKER_STACK={stack.work_dir}\0".encode()
    out = []
    for pid in engine_pids():
        if pid in ours:
            continue
        try:
            if marker not in Path(f"/proc/{pid}/environ").read_bytes() + b"\0":
                continue
        except OSError:
            continue
        out.append(f"orphan engine pid {pid}: {_cmdline(pid)[:120]}")
    return out


# ---- the stack's API, synchronously ---------------------------------------------------------------

@dataclass
class Client:
    stack: LocalStack
    channel: grpc.Channel = field(init=False)
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.reconnect()

    def reconnect(self) -> None:
        from flowmaker.rpc.channels import target_options

        # Every orchestrator replica ("a,b"): round robin, idempotent calls retried on UNAVAILABLE.
        addr, options = target_options(self.stack.addresses["orchestrator"], secure=self.stack.pki_dir is not None)
        if self.stack.pki_dir is None:
            self.channel = grpc.insecure_channel(addr, options=options)
        else:  # the shipped configuration: mTLS with the admin's certificate, and the admin's bearer token
            from flowmaker.launcher.stack import admin_token
            from flowmaker.rpc.tls import ADMIN, channel_credentials, pki_files

            creds = grpc.composite_channel_credentials(
                channel_credentials(pki_files(self.stack.pki_dir, ADMIN)),
                grpc.access_token_call_credentials(admin_token(self.stack.pki_dir)))
            self.channel = grpc.secure_channel(addr, creds, options=options)
        self.stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def deploy(self, name: str, wf: Workflow = ONE_STAGE, slo: Slo = SLO, timeout_s: float = 30) -> task_pb2.Task:
        r = self.stub.DeployTask(pb.DeployTaskRequest(description=f"task {name}", name=name,
                                                      slo=convert.slo_to_proto(slo),
                                                      workflows=[convert.workflow_to_proto(wf)]), timeout=timeout_s)
        return r.task

    def approve(self, task_id: str, wf_id: str = "one", timeout_s: float = 120) -> task_pb2.Task:
        return self.stub.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=task_id, workflow_ids=[wf_id]),
                                          timeout=timeout_s).task

    def get(self, task_id: str, timeout_s: float = 5) -> task_pb2.Task:
        return self.stub.GetTask(pb.GetTaskRequest(task_id=task_id), timeout=timeout_s).task

    def invoke(self, task_id: str, text: str = "hello", timeout_s: float = 30) -> pb.InvokeResponse:
        return self.stub.Invoke(pb.InvokeRequest(task_id=task_id, input=text), timeout=timeout_s)

    def delete(self, task_id: str, timeout_s: float = 60) -> None:
        self.stub.DeleteTask(pb.DeleteTaskRequest(task_id=task_id), timeout=timeout_s)

    def wait_state(self, task_id: str, states: tuple[int, ...], timeout_s: float) -> tuple[task_pb2.Task | None, float]:
        """(the task once in one of `states`, seconds waited); (last seen, waited) on timeout."""
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(grpc.RpcError):
                last = self.get(task_id)
                if last.state in states and not last.HasField("healing"):
                    return last, time.monotonic() - t0
            time.sleep(0.2)
        return last, time.monotonic() - t0


# ---- steady load --------------------------------------------------------------------------------

@dataclass
class Load:
    """Requests at a steady rate to some tasks, from a thread; counts outcomes by gRPC code name."""

    client: Client
    task_ids: list[str]
    rate_rps: float = 2.0
    timeout_s: float = 30.0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[tuple[float, str, str]] = field(default_factory=list)  # (time, task, message)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        def one(tid: str) -> None:
            try:
                self.client.invoke(tid, "steady load", timeout_s=self.timeout_s)
                self.outcomes["OK"] += 1
            except grpc.RpcError as e:
                self.outcomes[e.code().name] += 1
                self.failures.append((time.time(), tid, (e.details() or "")[:200]))

        def loop() -> None:
            i = 0
            next_at = time.monotonic()
            while not self._stop.is_set():
                tid = self.task_ids[i % len(self.task_ids)]
                i += 1
                t = threading.Thread(target=one, args=(tid,), daemon=True)
                t.start()
                self._threads.append(t)
                next_at += 1.0 / self.rate_rps
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self, join_s: float = 40.0) -> None:
        self._stop.set()
        end = time.monotonic() + join_s
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())


# ---- faults -------------------------------------------------------------------------------------

def kill_engine(stack: LocalStack) -> int | None:
    """kill -9 one engine of this stack (the first by pid); its pid, or None when none runs."""
    pid = engine_pid(stack)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pid


def kill_service(stack: LocalStack, name: str) -> int | None:
    """kill -9 a service (or "etcd"); the launcher's supervisor restarts it."""
    pid = stack.pid_of(name)
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pid


def leader_record(stack: LocalStack) -> dict[str, Any] | None:
    """The elected orchestrator replica's key in etcd ({"replica", "address", "pid", "since"}); None when no
    replica leads (or etcd does not answer)."""
    try:
        found = etcd_snapshot(stack.etcd_endpoint, keys.ORCHESTRATOR_LEADER, pki_dir=stack.pki_dir)
    except OSError:
        return None
    v = found.get(keys.ORCHESTRATOR_LEADER)
    return v if isinstance(v, dict) and v.get("replica") else None


def orchestrator_leader(stack: LocalStack) -> str | None:
    """The child name ("orchestrator", "orchestrator-2", ...) of the elected orchestrator replica (the launcher
    names each replica's REPLICA_ID after its child); None when no replica leads."""
    v = leader_record(stack)
    return str(v["replica"]) if v else None


def wait_new_leader(stack: LocalStack, old_pid: int | None, timeout_s: float = 30.0) -> tuple[str, float] | None:
    """Wait until a replica other than the process `old_pid` holds the leader key: (its name, seconds waited);
    None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        v = leader_record(stack)
        if v is not None and v.get("pid") != old_pid:
            return str(v["replica"]), time.monotonic() - t0
        time.sleep(0.05)
    return None


def orchestrator_replicas(stack: LocalStack) -> list[str]:
    return [n for n in ("orchestrator", *(f"orchestrator-{i}" for i in range(2, 17))) if stack.pid_of(n)]


def kill_orchestrator(stack: LocalStack, *, leader: bool) -> tuple[str, int | None]:
    """kill -9 the leading orchestrator replica (`leader`), or one that does not lead; (its name, its pid)."""
    lead = orchestrator_leader(stack)
    names = orchestrator_replicas(stack)
    pick = lead if leader else next((n for n in names if n != lead), None)
    if pick is None or pick not in names:
        return "", None
    return pick, kill_service(stack, pick)


@contextlib.contextmanager
def etcd_stopped(stack: LocalStack) -> Iterator[None]:
    """SIGSTOP etcd for the duration of the block (SIGCONT afterwards, whatever happens)."""
    pid = stack.pid_of("etcd")
    assert pid, "etcd is not running"
    with stopped(pid):
        yield


def engine_pid(stack: LocalStack) -> int | None:
    """The pid of one engine of this stack (the first by pid), or None."""
    dep = stack.pid_of("deployer")
    pids = sorted(pid for pid, _ in descendants(dep) if _ENGINE_MODULE in _cmdline(pid)) if dep else []
    return pids[0] if pids else None


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP `pid` for the duration of the block (SIGCONT afterwards, whatever happens): a hang, not a crash."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def spawn_deployer(stack: LocalStack, node: str, log_path: Path, *, gpus: int = 2, gpu_memory_gb: float = 0.0,
                   extra_env: dict[str, str] | None = None, timeout_s: float = 60.0) -> subprocess.Popen[bytes]:
    """A second node for a plaintext stack: `python -m services.deployer` as `node` against the stack's etcd,
    returned once it serves (its FLOWMAKER_READY line). The caller stops it (`stop_process`)."""
    env = {**os.environ, "FLOWMAKER_DEPLOYER_NODE": node, "FLOWMAKER_DEPLOYER_PORT": "0",
           "FLOWMAKER_DEPLOYER_HOST": "127.0.0.1", "FLOWMAKER_DEPLOYER_ETCD_ENDPOINTS": stack.etcd_endpoint,
           "FLOWMAKER_DEPLOYER_USE_NVML": "false", "FLOWMAKER_DEPLOYER_GPU_COUNT": str(gpus),
           "FLOWMAKER_DEPLOYER_ENGINE_TIME_SCALE": repr(stack.config.time_scale), "FLOWMAKER_DEPLOYER_GRACE_S": "1",
           "OTEL_TRACES_EXPORTER": "none", **stack.config.extra_env, **(extra_env or {})}
    if gpu_memory_gb:
        env["FLOWMAKER_DEPLOYER_GPU_MEMORY_GB"] = repr(gpu_memory_gb)
    log = open(log_path, "wb")  # the child writes it for its whole life
    proc = subprocess.Popen([sys.executable, "-m", "services.deployer"], env=env, stdout=subprocess.PIPE,
                            stderr=log, start_new_session=True)
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(b"FLOWMAKER_READY "):
            # Keep draining its stdout so that it never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in iter(proc.stdout.readline, b"")],  # type: ignore[union-attr]
                             daemon=True).start()
            return proc
    stop_process(proc)
    raise RuntimeError(f"deployer {node} did not start; see {log_path}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGCONT (it may be stopped), SIGTERM, then SIGKILL after 10 s; the process group, engines included."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def wait_task_state(c: Client, task_id: str, states: tuple[int, ...], timeout_s: float = 30.0,
                    interval_s: float = 0.02) -> int:
    """Poll until the task's stored state is one of `states` (the fault is then aimed at that step)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(grpc.RpcError):
            st = c.get(task_id, timeout_s=2).state
            if st in states:
                return st
        time.sleep(interval_s)
    raise TimeoutError(f"task {task_id} did not reach {states} within {timeout_s}s")


class Supervisor:
    """Calls `stack.supervise()` every `interval_s` from a thread, as `flowmaker up` does."""

    def __init__(self, stack: LocalStack, interval_s: float = 0.5) -> None:
        self.stack = stack
        self.events: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._interval = interval_s

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for e in self.stack.supervise(backoff_s=0.5):
                self.events.append((time.time(), e))

    def __enter__(self) -> Supervisor:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(5)
