"""Fuzzing every RPC of every service: seeded random bytes, byte mutations and structure-aware value changes.

`run_fuzz(stack, per_rpc, seed)` sends `per_rpc` hostile requests to each RPC of the five services, one
at a time, and records per call the status code, whether it hung (no answer within `timeout_s`), and
— for every rejected call — whether etcd changed. Every `health_every` calls each service's health
check must answer SERVING. The acceptance bar (tests/integration/test_fuzz.py, `flowmaker bench fuzz`):
no UNKNOWN, no INTERNAL, no hang, health SERVING throughout, etcd unchanged after rejected calls.

`start_fuzz_stack(store)` starts the five services in process on 127.0.0.1:0, wired as their
`__main__`s wire them (emulated engines; the profiler has no engine backend, so no fuzz case can start
an engine process by accident).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor as _d
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flowmaker.api.common.v1 import selection_pb2, workflow_pb2
from flowmaker.api.deployer.v1 import deployer_pb2
from flowmaker.api.generator.v1 import generator_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2
from flowmaker.api.profiler.v1 import profiler_pb2
from flowmaker.api.selector.v1 import selector_pb2

SERVICE_FILES = {"generator": generator_pb2, "profiler": profiler_pb2, "selector": selector_pb2,
                 "deployer": deployer_pb2, "orchestrator": orchestrator_pb2}


@dataclass(frozen=True)
class Rpc:
    service: str  # short name: "orchestrator"
    path: str  # "/flowmaker.orchestrator.v1.OrchestratorService/DeployTask"
    request: type[Message]
    server_streaming: bool


def all_rpcs() -> list[Rpc]:
    """Every RPC the five services define, from their proto descriptors (none is left out by hand)."""
    from google.protobuf import symbol_database

    db = symbol_database.Default()
    out = []
    for short, mod in SERVICE_FILES.items():
        for svc in mod.DESCRIPTOR.services_by_name.values():
            for m in svc.methods:
                out.append(Rpc(short, f"/{svc.full_name}/{m.name}", db.GetSymbol(m.input_type.full_name),
                               m.server_streaming))
    return out


def _workflow() -> workflow_pb2.Workflow:
    return workflow_pb2.Workflow(id="wf", stages=[
        workflow_pb2.Stage(id="draft", input_tokens=50, output_tokens=10, prompt_template="Answer: {input}"),
        workflow_pb2.Stage(id="look", kind=workflow_pb2.STAGE_KIND_TOOL, latency_s=0.01, prompt_template="{input}"),
        workflow_pb2.Stage(id="final", depends_on=["draft", "look"], input_tokens=80, output_tokens=8,
                           calls_per_request=1, prompt_template="{draft} {look}")])


def seed_requests() -> dict[str, Message]:
    """One well-formed request per RPC, the starting point of the mutations. Ids name nothing that
    exists, so a seed that survives mutation is answered NOT_FOUND rather than starting engines."""
    slo = workflow_pb2.Slo(min_accuracy=0.1, max_latency_s=30.0, arrival_rate_rps=0.5)
    o, g, d, p, s = orchestrator_pb2, generator_pb2, deployer_pb2, profiler_pb2, selector_pb2
    return {
        "GenerateWorkflows": g.GenerateWorkflowsRequest(description="summarise tickets", slo=slo, max_workflows=2,
                                                        sample_inputs=["a ticket"]),
        "DeployTask": o.DeployTaskRequest(description="answer questions", name="fz", slo=slo, max_workflows=1,
                                          workflows=[_workflow()]),
        "ApproveWorkflows": o.ApproveWorkflowsRequest(task_id="no-such-task", workflow_ids=["wf"], strategy="exact",
                                                      options=selection_pb2.SelectionOptions(utilization_cap=0.9),
                                                      etag="12"),
        "GetTask": o.GetTaskRequest(task_id="no-such-task"),
        "ListTasks": o.ListTasksRequest(state="STATE_ACTIVE"),
        "DeleteTask": o.DeleteTaskRequest(task_id="no-such-task"),
        "Invoke": o.InvokeRequest(task_id="no-such-task", input="hello", max_output_tokens=4),
        "InvokeStream": o.InvokeStreamRequest(task_id="no-such-task", input="hello", max_output_tokens=4),
        "RegisterModel": p.RegisterModelRequest(
            hf_config_json=json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                       "num_attention_heads": 4, "vocab_size": 1000}),
            model_id="fz-never-valid-accuracy-missing"),
        "ListModels": p.ListModelsRequest(),
        "GetProfiles": p.GetProfilesRequest(model_id="no-such-model", gpu_type="A6000",
                                            configs=[p.ParallelConfig(tp=1, pp=1)]),
        "ProfileModel": p.ProfileModelRequest(model_id="no-such-model", gpu_type="A6000",
                                              configs=[p.ParallelConfig(tp=1, pp=1)], engine="emulated"),
        "GetProfilingJob": p.GetProfilingJobRequest(job_id="no-such-job"),
        "SelectVariant": s.SelectVariantRequest(slo=slo, workflows=[_workflow()], strategy="exact",
                                                options=selection_pb2.SelectionOptions(time_budget_s=1.0)),
        "Deploy": d.DeployRequest(model_id="no-such-model", tp=1, pp=1, gpu_ids=["n0-gpu0"], memory_gb_per_gpu=5.0,
                                  task_id="fz", engine="emulated", request_id="fz-req", no_wait=True),
        "Release": d.ReleaseRequest(instance_id="no-such-instance", task_id="fz"),
        "ListInstances": d.ListInstancesRequest(model_id="Llama-3.2-1B-Instruct"),
        "ListGpus": d.ListGpusRequest(node="n0"),
    }


# ---- mutations -------------------------------------------------------------------------------------

_STRINGS = ("", "x", "../../../../tmp/flowmaker-fuzz", "a/b", ".", "..", "\x00", " ", "{input:>100000000}",
            "{input.__class__}", "{0}", "{", "}", "é" * 3000, "x" * 70_000, "-", "STAGE_KIND_LLM", "9" * 25)
_INTS32 = (-1, 0, 1, 2, 64, 65, 1000, 1_000_000, 2**31 - 1, -(2**31))
_INTS64 = (*_INTS32, 2**62, 2**63 - 1, -(2**63))
_FLOATS = (math.nan, math.inf, -math.inf, 1e308, -1e308, -0.0, 5e-324, -1.0, 0.0, 1e9, 1e-6)
_ENUMS = (0, 1, 2, 5, 99, -1, 2**31 - 1)
_MAX_CASE_BYTES = 6 * 1024 * 1024
_INT32_TYPES = (_d.FieldDescriptor.TYPE_INT32, _d.FieldDescriptor.TYPE_SINT32, _d.FieldDescriptor.TYPE_SFIXED32)


def _slots(msg: Message, depth: int = 0) -> list[tuple[Message, Any]]:
    """Every (message, field descriptor) of `msg` and its sub-messages (first elements of repeated ones)."""
    out: list[tuple[Message, Any]] = []
    for fd in msg.DESCRIPTOR.fields:
        out.append((msg, fd))
        if fd.message_type is not None and depth < 6 and not fd.message_type.GetOptions().map_entry:
            if fd.is_repeated:
                sub = getattr(msg, fd.name)
                if len(sub):
                    out += _slots(sub[0], depth + 1)
            elif msg.HasField(fd.name):
                out += _slots(getattr(msg, fd.name), depth + 1)
    return out


def _scalar(rng: random.Random, fd: _d.FieldDescriptor) -> Any:
    t = fd.type
    if fd.enum_type is not None:
        return rng.choice(_ENUMS)
    if t in (_d.FieldDescriptor.TYPE_DOUBLE, _d.FieldDescriptor.TYPE_FLOAT):
        return rng.choice(_FLOATS)
    if t == _d.FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == _d.FieldDescriptor.TYPE_STRING:
        return rng.choice(_STRINGS)
    if t == _d.FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 16, 1000)))
    if t in _INT32_TYPES:
        return rng.choice(_INTS32)
    if t in (_d.FieldDescriptor.TYPE_UINT32, _d.FieldDescriptor.TYPE_FIXED32):
        return abs(rng.choice(_INTS32))
    if t in (_d.FieldDescriptor.TYPE_UINT64, _d.FieldDescriptor.TYPE_FIXED64):
        return abs(rng.choice(_INTS64))
    return rng.choice(_INTS64)


def mutate_value(rng: random.Random, seed: Message) -> Message:
    """A copy of `seed` with one field set to a hostile value (or a repeated field blown up)."""
    msg = type(seed)()
    msg.CopyFrom(seed)
    slots = _slots(msg)
    for _ in range(10 if slots else 0):
        parent, fd = rng.choice(slots)
        try:
            if fd.is_repeated:
                rep = getattr(parent, fd.name)
                if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                    continue
                if fd.message_type is not None:
                    if not len(rep):
                        rep.add()
                        return msg
                    first = type(rep[0])()
                    first.CopyFrom(rep[0])
                    # Up to ~6 MB: past the servers' 4 MiB receive limit, but never a message so large that
                    # building it here stalls this process (the services under test share its event loop).
                    n = min(rng.choice((2, 70, 2000, 20_000)), max(2, _MAX_CASE_BYTES // max(1, first.ByteSize())))
                    for _ in range(n):
                        rep.add().CopyFrom(first)
                    return msg
                if rng.random() < 0.3:
                    rep.extend([_scalar(rng, fd) for _ in range(rng.choice((2, 100, 5000)))])
                else:
                    rep.append(_scalar(rng, fd))
                return msg
            if fd.message_type is not None:
                if parent.HasField(fd.name) and rng.random() < 0.5:
                    parent.ClearField(fd.name)
                else:
                    getattr(parent, fd.name).SetInParent()
                return msg
            setattr(parent, fd.name, _scalar(rng, fd))
            return msg
        except (ValueError, TypeError):
            continue  # a value this field's type cannot hold client-side: pick another
    return msg


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2 and b:
            del b[pos:pos + rng.randint(1, 8)]
        elif op == 3:
            b[pos:pos] = rng.choice((b"\xff\xfe", b"\x0a\x05\xc3\x28\xa0\xa1\xff", b"\x80\x80\x80\x80\x80\x80",
                                     b"\x12\xff\xff\xff\xff\x0f"))
        else:
            b = b[:pos]
    return bytes(b)


def cases(rng: random.Random, seed: Message, n: int) -> Iterator[tuple[str, bytes]]:
    """(kind, payload): the seed once, then random bytes, byte mutations and value changes in turn."""
    data = seed.SerializeToString()
    yield "seed", data
    for i in range(n - 1):
        k = i % 3
        if k == 0:
            yield "random", rng.randbytes(rng.choice((0, 1, 3, 8, 32, 200)))
        elif k == 1:
            yield "bytes", mutate_bytes(rng, data)
        else:
            m = mutate_value(rng, seed)
            if rng.random() < 0.3 and m.ByteSize() < _MAX_CASE_BYTES // 8:
                m = mutate_value(rng, m)
            yield "value", m.SerializeToString()


# ---- the run --------------------------------------------------------------------------------------


@dataclass
class RpcStats:
    calls: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    max_s: float = 0.0


@dataclass
class FuzzReport:
    seed: int
    per_rpc: int
    calls: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    by_rpc: dict[str, RpcStats] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # UNKNOWN / INTERNAL, with the case
    hangs: list[dict[str, Any]] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    etcd_changed: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def bad(self) -> int:
        return self.codes.get("UNKNOWN", 0) + self.codes.get("INTERNAL", 0)

    @property
    def ok(self) -> bool:
        return not (self.bad or self.hangs or self.unhealthy or self.etcd_changed)

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "per_rpc": self.per_rpc, "calls": self.calls, "codes": dict(self.codes),
                "internal_or_unknown": self.bad, "hangs": len(self.hangs), "unhealthy": self.unhealthy,
                "etcd_changed_after_rejection": len(self.etcd_changed), "elapsed_s": round(self.elapsed_s, 2),
                "by_rpc": {k: {"calls": v.calls, "codes": dict(v.codes), "max_s": round(v.max_s, 3)}
                           for k, v in self.by_rpc.items()},
                "failures": self.failures[:20], "hang_cases": self.hangs[:20], "etcd_changes": self.etcd_changed[:20]}

    def table(self) -> str:
        codes = sorted(self.codes)
        head = f"{'rpc':<48} {'calls':>6} " + " ".join(f"{c[:12]:>12}" for c in codes) + f" {'max_s':>7}"
        lines = [head, "-" * len(head)]
        for name, st in self.by_rpc.items():
            lines.append(f"{name:<48} {st.calls:>6} " + " ".join(f"{st.codes.get(c, 0):>12}" for c in codes)
                         + f" {st.max_s:>7.3f}")
        lines.append("-" * len(head))
        lines.append(f"{'total':<48} {self.calls:>6} " + " ".join(f"{self.codes.get(c, 0):>12}" for c in codes))
        lines.append(f"INTERNAL/UNKNOWN: {self.bad}   hangs (> timeout): {len(self.hangs)}   "
                     f"health not SERVING: {len(self.unhealthy)}   etcd changed after a rejected call: "
                     f"{len(self.etcd_changed)}   wall: {self.elapsed_s:.1f} s")
        return "\n".join(lines)


Snapshot = Callable[[], Awaitable[Any]]


async def run_fuzz(addresses: dict[str, str], *, per_rpc: int = 200, seed: int = 0, timeout_s: float = 5.0,
                   health_every: int = 25, snapshot: Snapshot | None = None,
                   channel_factory: Callable[[str], grpc.aio.Channel] | None = None,
                   progress: Callable[[str], None] | None = None) -> FuzzReport:
    """Fuzz every RPC of the services at `addresses` (short name -> host:port)."""
    make = channel_factory or (lambda a: grpc.aio.insecure_channel(
        a, options=[("grpc.max_send_message_length", 16 * 1024 * 1024)]))
    channels = {svc: make(a) for svc, a in addresses.items()}
    report = FuzzReport(seed, per_rpc)
    seeds = seed_requests()
    t_start = time.monotonic()
    baseline = await snapshot() if snapshot else None
    try:
        for rpc in all_rpcs():
            ch = channels.get(rpc.service)
            if ch is None:
                continue
            rng = random.Random(f"{seed}:{rpc.path}")
            st = report.by_rpc.setdefault(rpc.path.rsplit(".", 1)[-1], RpcStats())
            if progress:
                progress(f"fuzzing {rpc.path}")
            method = rpc.path.rsplit("/", 1)[-1]
            for i, (kind, payload) in enumerate(cases(rng, seeds[method], per_rpc)):
                code, details, dt = await _call(ch, rpc, payload, timeout_s)
                st.calls += 1
                st.codes[code] += 1
                st.max_s = max(st.max_s, dt)
                report.calls += 1
                report.codes[code] += 1
                case = {"rpc": rpc.path, "kind": kind, "code": code, "details": details[:300],
                        "payload_hex": payload[:200].hex(), "payload_len": len(payload)}
                if code in ("UNKNOWN", "INTERNAL"):
                    report.failures.append(case)
                if code == "HANG":
                    report.hangs.append(case)
                if snapshot is not None:
                    now = await snapshot()
                    if code not in ("OK", "HANG") and now != baseline:
                        report.etcd_changed.append({**case, "diff": _diff(baseline, now)})
                    baseline = now
                if (i + 1) % health_every == 0:
                    report.unhealthy += await _health(channels, timeout_s)
        report.unhealthy += await _health(channels, timeout_s)
    finally:
        for ch in channels.values():
            await ch.close(None)
    report.elapsed_s = time.monotonic() - t_start
    return report


def _diff(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        added = sorted(set(b) - set(a))[:5]
        removed = sorted(set(a) - set(b))[:5]
        changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])[:5]
        return f"added {added} removed {removed} changed {changed}"
    return "changed"


async def _call(ch: grpc.aio.Channel, rpc: Rpc, payload: bytes, timeout_s: float) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        if rpc.server_streaming:
            stream = ch.unary_stream(rpc.path, None, None)(payload, timeout=timeout_s)
            async for _ in stream:
                pass
        else:
            await ch.unary_unary(rpc.path, None, None)(payload, timeout=timeout_s)
        return "OK", "", time.monotonic() - t0
    except grpc.aio.AioRpcError as e:
        dt = time.monotonic() - t0
        code = e.code().name
        # A client-side deadline (no status details from the server) is a hang: the server never answered.
        if code == "DEADLINE_EXCEEDED" and dt >= timeout_s * 0.95:
            code = "HANG"
        return code, e.details() or "", dt


async def _health(channels: dict[str, grpc.aio.Channel], timeout_s: float) -> list[str]:
    bad = []
    for svc, ch in channels.items():
        try:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                           timeout=timeout_s)
            if r.status != health_pb2.HealthCheckResponse.SERVING:
                bad.append(f"{svc}: {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}")
        except grpc.aio.AioRpcError as e:
            bad.append(f"{svc}: {e.code().name}")
    return bad


# ---- an in-process stack to fuzz ---------------------------------------------------------------------


async def etcd_snapshot(store: Any) -> dict[str, Any]:
    """What a rejected call must not change: every key, and the value of every key that nothing but
    a successful call writes (instances and nodes also carry measured load and heartbeats). Node
    liveness keys are left out: they are bound to the deployer's lease, not written by any call."""
    listing = await store.get_prefix("/")
    out: dict[str, Any] = {}
    for kv in listing.items:
        if "/nodes/" in kv.key:
            continue
        volatile = "/instances/" in kv.key or "/tasks/" in kv.key
        out[kv.key] = None if volatile else kv.value
    return out


@contextlib.asynccontextmanager
async def fuzz_stack(store: Any, *, host: str = "127.0.0.1", gpu_count: int = 2, pki: str | None = None,
                     tokens_file: str = "", invoke_timeout_s: float = 10.0) -> AsyncIterator[dict[str, str]]:
    """The five services in this process on `host`:0 (real gRPC servers, the given etcd store);
    yields their addresses by short name. With `pki` (a dir made by flowmaker.rpc.tls.ensure_pki) every
    service runs with its own certificate and the suite's auth policy, as `flowmaker up` runs them."""
    from flowmaker.generator import TemplateGenerator
    from flowmaker.rpc.channels import configure_client_tls
    from flowmaker.rpc.server import RunningServer, start_server
    from flowmaker.rpc.tls import pki_files
    from services.deployer.node import NodeAgent
    from services.deployer.servicer import service_hooks
    from services.deployer.settings import DeployerSettings
    from services.generator.servicer import add_servicers as add_generator
    from services.orchestrator.clients import Clients
    from services.orchestrator.orchestrator import Orchestrator
    from services.orchestrator.servicer import add_servicers as add_orchestrator
    from services.orchestrator.settings import OrchestratorSettings
    from services.profiler.app import build as build_profiler
    from services.profiler.servicer import add_servicers as add_profiler
    from services.profiler.settings import ProfilerSettings
    from services.selector.servicer import add_servicers as add_selector
    from services.selector.settings import SelectorSettings

    started: list[RunningServer] = []
    base: dict[str, Any] = {"host": host, "port": 0, "grace_s": 0.2}

    def common(svc: str) -> dict[str, Any]:
        if pki is None:
            return {**base, "auth_tokens_file": tokens_file if svc == "orchestrator" else ""}
        f = pki_files(pki, svc)
        return {**base, "tls_ca_file": f.ca, "tls_cert_file": f.cert, "tls_key_file": f.key,
                "auth_tokens_file": tokens_file if svc == "orchestrator" else ""}

    try:
        gen = TemplateGenerator()
        from flowmaker.settings import ServiceSettings

        started.append(await start_server("generator", lambda s: add_generator(s, gen),
                                          ServiceSettings(**common("generator"))))
        pset = ProfilerSettings(**common("profiler"), engine_backend="", deployer_address="", preload_catalog=True)
        papp = build_profiler(pset, store)
        started.append(await start_server("profiler", lambda s: add_profiler(s, papp.servicer), pset,
                                          on_ready=papp.start, on_shutdown=[papp.close]))
        sset = SelectorSettings(**common("selector"))
        started.append(await start_server("selector", lambda s: add_selector(s, sset, store), sset))
        dset = DeployerSettings(**common("deployer"), node="n0", gpu_type="A6000", gpu_count=gpu_count, use_nvml=False,
                                backend="emulated", engine_time_scale=50, engine_start_timeout_s=30,
                                engine_api_keys=pki is not None,
                                engine_stop_grace_s=2, lease_ttl_s=10)
        agent = NodeAgent(store, dset)
        add_dep, dep_ready = service_hooks(agent)
        started.append(await start_server("deployer", add_dep, dset, on_ready=dep_ready,
                                          on_shutdown=[agent.shutdown]))
        oset = OrchestratorSettings(**common("orchestrator"), selector_address=started[2].address,
                                    generator_address=started[0].address, deploy_timeout_s=30,
                                    invoke_timeout_s=invoke_timeout_s)
        # The orchestrator's channels (deployers' too, opened later) present its certificate, as its
        # __main__ arranges; the only other client here, the profiler, opens no channel in this stack.
        configure_client_tls(oset)
        clients = Clients(oset.selector_address, oset.generator_address, timeout_s=10)
        orch = Orchestrator(oset, store, clients)

        async def orch_ready(running: RunningServer) -> None:
            await orch.resume()

        async def orch_close() -> None:
            await orch.close()
            await clients.close()

        started.append(await start_server("orchestrator", lambda s: add_orchestrator(s, orch), oset,
                                          on_ready=orch_ready, on_shutdown=[orch_close]))
        yield {r.name: r.address for r in started}
    finally:
        for r in reversed(started):
            with contextlib.suppress(Exception):
                await r.stop(0.2)
        configure_client_tls(None)


async def fuzz_with_etcd(endpoint: str, *, per_rpc: int, seed: int, timeout_s: float = 5.0,
                         progress: Callable[[str], None] | None = None) -> FuzzReport:
    """`flowmaker bench fuzz`: the stack on a fresh namespace of the etcd at `endpoint`."""
    import uuid

    from flowmaker.state.etcd import EtcdStore

    store = EtcdStore(endpoint, namespace=f"/fuzz-{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    try:
        async with fuzz_stack(store) as addrs:
            return await run_fuzz(addrs, per_rpc=per_rpc, seed=seed, timeout_s=timeout_s,
                                  snapshot=lambda: etcd_snapshot(store), progress=progress)
    finally:
        with contextlib.suppress(Exception):
            await store.delete_prefix("/")
        await store.close()


@contextlib.contextmanager
def temporary_etcd(etcd_bin: str = "etcd") -> Iterator[str]:
    """A throw-away etcd on free loopback ports with a temp data dir; yields its client endpoint."""
    import shutil
    import socket
    import subprocess
    import tempfile
    import urllib.request

    exe = shutil.which(etcd_bin) or etcd_bin

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    cport, pport = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="flowmaker-fuzz-etcd-") as d:
        curl, purl = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
        proc = subprocess.Popen([exe, "--name", "fuzz", "--data-dir", d + "/data", "--listen-client-urls", curl,
                                 "--advertise-client-urls", curl, "--listen-peer-urls", purl,
                                 "--initial-advertise-peer-urls", purl, "--initial-cluster", f"fuzz={purl}",
                                 "--log-level", "error", "--logger", "zap"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    with urllib.request.urlopen(curl + "/health", timeout=1) as r:
                        if b"true" in r.read():
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd ({exe}) did not start")
                time.sleep(0.1)
            yield f"127.0.0.1:{cport}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
