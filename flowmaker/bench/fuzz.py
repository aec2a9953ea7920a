"""Fuzzing every RPC of every service: seeded random bytes, byte mutations and structure-aware value changes.

`run_fuzz(stack, per_rpc, seed)` sends `per_rpc` hostile requests to each RPC of the five services, one
at a time, and records per call the status code, whether it hung (no answer within `timeout_s`), and
— for every rejected call — whether etcd changed. Every `health_every` calls each service's health
check must answer SERVING. The acceptance bar (tests/integration/test_fuzz.py, `flowmaker bench fuzz`):
no UNKNOWN, no INTERNAL, no hang, health SERVING throughout, etcd unchanged after rejected calls.

`fuzz_stack(store)` starts the five services in process on 127.0.0.1:0, wired as their
`__main__`s wire them (emulated engines; the profiler has no engine backend, so no fuzz case can start
an engine process by accident).

The gateway's HTTP surface (`run_http_fuzz`, `http_fuzz_with_etcd`): `gateway_stack` adds bearer tokens at
the orchestrator and the gateway in front of it, and a user deploys a real task. Every route then gets
seeded cases, one request per fresh connection: structure-aware JSON changes (huge integers, lone
surrogates, deep nesting, NaN, wrong types, unsupported parameters), byte mutations, random bodies,
hostile Authorization headers (non-ASCII among them), paths and malformed HTTP framing. Most cases carry
the user's token and name the real task by id or name, so they reach the handlers and the workflow. The
bar: no 5xx but 503, every error in OpenAI's JSON shape, nothing unanswered, no traceback logged, /health
answering throughout. `flowmaker bench fuzz` runs both parts (`fuzz_with_etcd`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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
from google.protobuf import duration_pb2
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
        "CreateUser": o.CreateUserRequest(name="fz-user", expires_in=duration_pb2.Duration(seconds=60)),
        "CreateToken": o.CreateTokenRequest(user="no-such-user", expires_in=duration_pb2.Duration(seconds=60)),
        "ListUsers": o.ListUsersRequest(),
        "Revoke": o.RevokeRequest(target="no-such-user"),
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
    http: HttpFuzzReport | None = None  # the gateway's HTTP surface, when it was fuzzed too

    @property
    def bad(self) -> int:
        return self.codes.get("UNKNOWN", 0) + self.codes.get("INTERNAL", 0)

    @property
    def ok(self) -> bool:
        return not (self.bad or self.hangs or self.unhealthy or self.etcd_changed) and (
            self.http is None or self.http.ok)

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "per_rpc": self.per_rpc, "calls": self.calls, "codes": dict(self.codes),
                "internal_or_unknown": self.bad, "hangs": len(self.hangs), "unhealthy": self.unhealthy,
                "etcd_changed_after_rejection": len(self.etcd_changed), "elapsed_s": round(self.elapsed_s, 2),
                "by_rpc": {k: {"calls": v.calls, "codes": dict(v.codes), "max_s": round(v.max_s, 3)}
                           for k, v in self.by_rpc.items()},
                "failures": self.failures[:20], "hang_cases": self.hangs[:20], "etcd_changes": self.etcd_changed[:20],
                **({"gateway_http": self.http.to_json()} if self.http is not None else {})}

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
        if self.http is not None:
            lines += ["", self.http.table()]
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
                         progress: Callable[[str], None] | None = None, http_per_route: int | None = None
                         ) -> FuzzReport:
    """`flowmaker bench fuzz`: the stack on a fresh namespace of the etcd at `endpoint`; then the gateway's
    HTTP surface (`http_fuzz_with_etcd`, `http_per_route` cases per route, default `per_rpc`; 0 = not)."""
    import uuid

    from flowmaker.state.etcd import EtcdStore

    store = EtcdStore(endpoint, namespace=f"/fuzz-{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    try:
        async with fuzz_stack(store) as addrs:
            report = await run_fuzz(addrs, per_rpc=per_rpc, seed=seed, timeout_s=timeout_s,
                                    snapshot=lambda: etcd_snapshot(store), progress=progress)
    finally:
        with contextlib.suppress(Exception):
            await store.delete_prefix("/")
        await store.close()
    n = per_rpc if http_per_route is None else http_per_route
    if n > 0:
        # An answer may take an invoke's time, so the HTTP fuzz's bar for "unanswered" is at least 10 s.
        report.http = await http_fuzz_with_etcd(endpoint, per_route=n, seed=seed, timeout_s=max(10.0, timeout_s),
                                                progress=progress)
    return report


@contextlib.contextmanager
def temporary_etcd(etcd_bin: str = "etcd") -> Iterator[str]:
    """A throw-away etcd on free loopback ports with a temp data dir; yields its client endpoint."""
    import shutil
    import subprocess
    import tempfile
    import urllib.request

    from flowmaker.launcher.procs import exec_dying_with_parent
    from flowmaker.ports import free_ports

    exe = shutil.which(etcd_bin) or etcd_bin

    cport, pport = free_ports(2)
    with tempfile.TemporaryDirectory(prefix="flowmaker-fuzz-etcd-") as d:
        curl, purl = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
        # It dies with this process, even a SIGKILLed one (a hung fuzz run killed by its caller left its etcd behind).
        proc = subprocess.Popen(exec_dying_with_parent(
            [exe, "--name", "fuzz", "--data-dir", d + "/data", "--listen-client-urls", curl,
             "--advertise-client-urls", curl, "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
             "--initial-cluster", f"fuzz={purl}", "--log-level", "error", "--logger", "zap"]),
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


# ---- the gateway's HTTP surface ------------------------------------------------------------------------

FUZZ_USER = "fuzzer"
FUZZ_TOKEN = "fuzz-user-token-0123456789"  # the user's bearer token in a fuzzed stack's tokens file
FUZZ_ADMIN_TOKEN = "fuzz-admin-token-0123456789"
HTTP_ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model}",
               "GET /ready", "other")


@dataclass
class GatewayStack:
    """`gateway_stack`'s services: their gRPC addresses, and the gateway's base URL (no /v1) and port."""

    addresses: dict[str, str]
    url: str
    host: str
    port: int
    gateway: Any


@contextlib.asynccontextmanager
async def gateway_stack(store: Any, tokens: dict[str, dict[str, Any]], work_dir: str, *, call_timeout_s: float = 30.0,
                        header_timeout_s: float = 30.0, body_timeout_s: float = 30.0,
                        **stack_kw: Any) -> AsyncIterator[GatewayStack]:
    """`fuzz_stack` with bearer tokens at the orchestrator (`tokens`, written to `work_dir`/tokens.json: {token:
    {user, admin}}), and the gateway in process in front of it on 127.0.0.1:0, as `python -m services.gateway`
    runs it (`Gateway.runner`)."""
    from pathlib import Path

    from aiohttp import web

    from flowmaker.rpc.auth import write_tokens
    from services.gateway.app import Gateway

    path = Path(work_dir) / "tokens.json"
    write_tokens(path, tokens)
    async with fuzz_stack(store, tokens_file=str(path), **stack_kw) as addrs:
        gw = Gateway(addrs["orchestrator"], timeout_s=call_timeout_s, header_timeout_s=header_timeout_s,
                     body_timeout_s=body_timeout_s)
        runner = gw.runner(shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
            yield GatewayStack(addrs, f"http://127.0.0.1:{port}", "127.0.0.1", port, gw)
        finally:
            await runner.cleanup()
            await gw.close()


async def deploy_task(orchestrator_address: str, token: str, *, name: str, workflows: list[workflow_pb2.Workflow],
                      description: str = "answer questions", timeout_s: float = 120.0) -> Any:
    """DeployTask with these workflows, then ApproveWorkflows of all of them, as the token's user; the task
    (orchestrator proto) as the approval left it."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc

    md = [("authorization", f"Bearer {token}")]
    slo = workflow_pb2.Slo(min_accuracy=0.1, max_latency_s=60.0, arrival_rate_rps=0.2)
    async with grpc.aio.insecure_channel(orchestrator_address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        t = (await stub.DeployTask(orchestrator_pb2.DeployTaskRequest(description=description, name=name, slo=slo,
                                                                       workflows=workflows),
                                   metadata=md, timeout=timeout_s)).task
        return (await stub.ApproveWorkflows(orchestrator_pb2.ApproveWorkflowsRequest(
            task_id=t.id, workflow_ids=[w.id for w in workflows]), metadata=md, timeout=timeout_s)).task


@dataclass
class HttpFuzzReport:
    """What the gateway answered: statuses per route, and the cases that broke the bar (a 5xx other than 503,
    an error that is not OpenAI's JSON, no answer), tracebacks the gateway logged, /health failures.
    `reached`: answers from the gateway's handlers (they carry X-FlowMaker-Trace-Id), not its HTTP parser."""

    seed: int
    per_route: int
    calls: int = 0
    reached: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    by_route: dict[str, Counter[str]] = field(default_factory=dict)
    max_s: float = 0.0
    server_errors: list[dict[str, Any]] = field(default_factory=list)
    bad_shape: list[dict[str, Any]] = field(default_factory=list)
    unanswered: list[dict[str, Any]] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    tracebacks: int = 0
    elapsed_s: float = 0.0

    @property
    def fivexx(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.startswith("5"))

    @property
    def ok(self) -> bool:
        return not (self.server_errors or self.bad_shape or self.unanswered or self.unhealthy or self.tracebacks)

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "per_route": self.per_route, "calls": self.calls, "reached_handlers": self.reached,
                "statuses": dict(self.statuses), "5xx": self.fivexx, "server_errors": len(self.server_errors),
                "not_openai_errors": len(self.bad_shape), "unanswered": len(self.unanswered),
                "unhealthy": self.unhealthy, "tracebacks": self.tracebacks, "max_s": round(self.max_s, 3),
                "elapsed_s": round(self.elapsed_s, 2),
                "by_route": {k: dict(v) for k, v in self.by_route.items()},
                "server_error_cases": self.server_errors[:20], "not_openai_error_cases": self.bad_shape[:20],
                "unanswered_cases": self.unanswered[:20]}

    def table(self) -> str:
        codes = sorted(self.statuses)
        head = f"{'gateway route':<30} {'calls':>6} " + " ".join(f"{c:>5}" for c in codes)
        lines = [head, "-" * len(head)]
        for route, st in self.by_route.items():
            lines.append(f"{route:<30} {sum(st.values()):>6} " + " ".join(f"{st.get(c, 0):>5}" for c in codes))
        lines.append("-" * len(head))
        lines.append(f"{'total':<30} {self.calls:>6} " + " ".join(f"{self.statuses.get(c, 0):>5}" for c in codes))
        lines.append(f"gateway: 5xx: {self.fivexx} (failing: {len(self.server_errors)})   not OpenAI errors: "
                     f"{len(self.bad_shape)}   unanswered: {len(self.unanswered)}   tracebacks: {self.tracebacks}   "
                     f"/health failures: {len(self.unhealthy)}   reached handlers: {self.reached}/{self.calls}   "
                     f"wall: {self.elapsed_s:.1f} s")
        return "\n".join(lines)


_DEEP = "\x00deep\x00"  # placeholder of a deeply nested value, spliced into the JSON text
_JSON_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2, 3, 2**31 - 1, 2**31, 2**53 + 1, 2**63, -(2**63), 10**400, 0.5, -0.0, 2.5, 1e308,
    math.nan, math.inf, "", "x", "\ud800", "a\udfffb", "é" * 500, "x" * 70_000, "\x00", "none", "auto", "text",
    "user", "../../etc/passwd", [], {}, [1], ["a", "b"], {"type": "json_object"}, {"a": {"b": 1}},
    [{"type": "function", "function": {"name": "f"}}], [{"type": "image_url", "image_url": {"url": "x"}}], _DEEP)
_OPENAI_KEYS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                "n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "logit_bias",
                "tools", "tool_choice", "functions", "response_format", "logprobs", "top_logprobs", "user",
                "suffix", "echo", "best_of", "modalities", "audio", "\ud800")
_BAD_AUTH: tuple[bytes, ...] = (
    "Bearer é".encode(), b"Bearer \xff\xfe", b"Bearer \xed\xa0\x80", b"", b"Bearer", b"Bearer ", b"Basic Zm9vOmJhcg==",
    b"Bearer wrong-token", b"Bearer " + b"t" * 7000, b"bearer " + FUZZ_TOKEN.encode(), b"Bearer \x01x",
    b"Bearer \x7f", b"Bearer a\tb")
_BAD_PATHS = ("%ED%A0%80", "%00", "%FF", "a" * 5000, "..%2F..%2Fetc%2Fpasswd", "\u00e9", "no-such-task", " ", "x%2Fy",
              "%C3%A9")


def _deep(rng: random.Random) -> str:
    d = rng.choice((33, 200, 1000, 5000, 20_000))
    return "[" * d + "]" * d if rng.random() < 0.5 else '{"a":' * d + "1" + "}" * d


def _json_text(rng: random.Random, obj: Any) -> bytes:
    text = json.dumps(obj)  # allow_nan: NaN/Infinity go out as such, lone surrogates as \\ud800
    return text.replace(json.dumps(_DEEP), _deep(rng)).encode()


def _mutate_json(rng: random.Random, seed: dict[str, Any]) -> Any:
    """A copy of `seed` with one to three changes: a value (anywhere) replaced, a key dropped or an OpenAI
    parameter added, with a hostile value; now and then the whole body."""
    body: Any = json.loads(json.dumps(seed))
    for _ in range(rng.choice((1, 1, 2, 3))):
        if not isinstance(body, dict) or rng.random() < 0.04:
            return rng.choice(_JSON_VALUES)
        slots: list[tuple[Any, Any]] = [(body, k) for k in body]
        for m in body.get("messages") or () if isinstance(body.get("messages"), list) else ():
            if isinstance(m, dict):
                slots += [(m, k) for k in m]
                if isinstance(m.get("content"), list):
                    slots += [(m["content"], i) for i in range(len(m["content"]))]
        op = rng.random()
        if op < 0.55 and slots:
            parent, key = rng.choice(slots)
            parent[key] = rng.choice(_JSON_VALUES)
        elif op < 0.7 and slots:
            parent, key = rng.choice(slots)
            if isinstance(parent, dict):
                del parent[key]
        else:
            body[rng.choice(_OPENAI_KEYS)] = rng.choice(_JSON_VALUES)
    return body


def _raw(method: str, path: str | bytes, headers: list[tuple[bytes, bytes]], body: bytes | None = None) -> bytes:
    p = path.encode() if isinstance(path, str) else path
    lines = [method.encode() + b" " + p + b" HTTP/1.1", b"Host: fuzz", b"Connection: close",
             *(k + b": " + v for k, v in headers)]
    if body is not None:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def http_cases(rng: random.Random, route: str, n: int, token: str, models: list[str]) -> Iterator[tuple[str, bytes]]:
    """(kind, raw HTTP/1.1 request) for one route: the seed, then structure-aware JSON changes (POST routes),
    byte mutations, random bodies, hostile Authorization headers, paths and framing. Most cases carry the
    user's token and name a real task (by id or by name), so that they reach the handlers."""
    auth = (b"Authorization", b"Bearer " + token.encode())
    json_ct = (b"Content-Type", b"application/json")
    method, _, path = route.partition(" ")
    if route.endswith("chat/completions"):
        seed: dict[str, Any] | None = {"model": models[0], "max_tokens": 4, "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]}
    elif route.endswith("/completions"):
        seed = {"model": models[0], "prompt": "hello there", "max_tokens": 4}
    else:
        seed = None
    for i in range(n):
        k = "seed" if i == 0 else rng.choices(
            ("value", "bytes", "random", "header", "framing") if seed else ("header", "path", "framing", "valid"),
            (50, 15, 5, 15, 15) if seed else (30, 30, 20, 20))[0]
        headers = [auth, json_ct]
        if k == "header":
            bad = rng.choice(_BAD_AUTH)
            headers = [(b"Authorization", bad), json_ct] if bad else [json_ct]
            if rng.random() < 0.3:
                headers.append((b"Content-Type", rng.choice((b"application/json; charset=foo", b"text/plain",
                                                              b"application/json; charset=utf-16", b"\xff"))))
        if route == "other":
            m = rng.choice(("GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "FOO", "HEAD"))
            p = rng.choice(("/", "/v1", "/v2/models", "/v1/chat/completions", "/v1/completions", "/v1/models",
                            "/metrics", "/health", "/v1/embeddings", "/v1/" + rng.choice(_BAD_PATHS)))
            body = _json_text(rng, _mutate_json(rng, {"model": rng.choice(models)})) if m in ("POST", "PUT") else None
            yield k, (_framing(rng, auth) if k == "framing" else _raw(m, p, headers, body))
            continue
        if seed is None:  # GET routes
            if k == "framing":
                yield k, _framing(rng, auth)
                continue
            target = path
            if "{model}" in path:
                name = rng.choice(models) if k != "path" else rng.choice(_BAD_PATHS)
                target = path.replace("{model}", name)
            elif k == "path":
                target = path + rng.choice(("?x=%ff", "/extra", "?" + "a" * 3000, "%00"))
            yield k, _raw(method, target, headers)
            continue
        if k == "seed":
            body = _json_text(rng, seed)
        elif k == "value" or k == "header":
            b = _mutate_json(rng, {**seed, "model": rng.choice(models)}) if k == "value" else {
                **seed, "model": rng.choice(models)}
            body = _json_text(rng, b)
        elif k == "bytes":
            body = mutate_bytes(rng, _json_text(rng, {**seed, "model": rng.choice(models)}))
        elif k == "random":
            body = rng.randbytes(rng.choice((0, 1, 3, 8, 32, 200)))
        else:
            yield k, _framing(rng, auth, path, _json_text(rng, seed))
            continue
        yield k, _raw(method, path, headers, body)


def _framing(rng: random.Random, auth: tuple[bytes, bytes], path: str = "/v1/models", body: bytes = b"{}") -> bytes:
    """A request malformed at the HTTP level (what the gateway's HTTP parser answers), complete on the wire."""
    a = auth[0] + b": " + auth[1]
    p = path.encode()
    return rng.choice((
        b"POST " + p + b" HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n" + a + b"\r\n\r\n" + body,
        b"POST " + p + b" HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n" + a + b"\r\n\r\n" + body,
        b"POST " + p + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n" + a + b"\r\n\r\nzz\r\n" + body
        + b"\r\n0\r\n\r\n",
        b"POST " + p + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n" + a
        + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        b"POST " + p + b" HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n" % len(body) + a
        + b"\r\n\r\n" + body,
        b"POST " + p + b" HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 4\r\n" + a
        + b"\r\n\r\n\xff\xff\xff\xff",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32) + b"\r\n\r\n",
        b"GET " + p + b" HTTP/9.9\r\nHost: x\r\n" + a + b"\r\n\r\n",
        b"GET " + p + b" HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n" + a + b"\r\n\r\n",
        b"GET " + p + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + a + b"\r\n\r\n",
        b"GET " + p + b" HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n" + a + b"\r\n\r\n",
        b"GET " + p + b"\x00 HTTP/1.1\r\nHost: x\r\n" + a + b"\r\n\r\n",
        b"GET " + p + b" HTTP/1.1\r\nHost: x\r\n" + a + b"\r\n" + a + b"\r\n\r\n",
        b"GET " + p + b" HTTP/1.1\nHost: x\n" + a + b"\n\n",
    ))


async def http_call(host: str, port: int, raw: bytes, timeout_s: float) -> tuple[int | None, dict[str, str], bytes,
                                                                                   float]:
    """Send one request on a fresh connection; (status or None when nothing came back, headers, body, seconds).
    The body is whatever came before the server closed (Connection: close) or `timeout_s` passed."""
    t0 = time.monotonic()
    data = b""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(raw)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            with contextlib.suppress(ConnectionError):
                while not _complete(data) and (chunk := await reader.read(65536)):
                    data += chunk
    except TimeoutError:
        pass
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    dt = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2) if lines and lines[0].startswith(b"HTTP/") else []
    status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return status, headers, body, dt


def _complete(data: bytes) -> bool:
    """Whether `data` holds a whole response (by Content-Length, or a chunked body's last chunk), so that a
    connection the server keeps alive need not be waited out."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for ln in head.split(b"\r\n")[1:]:
        k, _, v = ln.partition(b":")
        k = k.strip().lower()
        if k == b"content-length" and v.strip().isdigit():
            return len(body) >= int(v.strip())
        if k == b"transfer-encoding" and b"chunked" in v.lower():
            return body.endswith(b"0\r\n\r\n")
    return False


def _dechunk(b: bytes) -> bytes:
    out = b""
    while b:
        size, _, rest = b.partition(b"\r\n")
        try:
            n = int(size.split(b";")[0], 16)
        except ValueError:
            break
        if n == 0:
            break
        out += rest[:n]
        b = rest[n + 2:]
    return out


def openai_error_shape(body: bytes) -> bool:
    """Whether `body` is OpenAI's error JSON: {"error": {"message": str, "type": str, "param", "code"}}."""
    try:
        e = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return (isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str)
            and "param" in e and "code" in e)


class _Tracebacks(logging.Handler):
    """Counts the records with a traceback that the gateway (or aiohttp's server) logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.name.startswith(("services.gateway", "aiohttp")):
            self.count += 1


async def run_http_fuzz(host: str, port: int, *, token: str, models: list[str], per_route: int = 200, seed: int = 0,
                        timeout_s: float = 10.0, health_every: int = 25,
                        progress: Callable[[str], None] | None = None) -> HttpFuzzReport:
    """Fuzz the gateway at host:port: `per_route` cases for each of HTTP_ROUTES, one at a time on a fresh
    connection. `models`: ids and names of real tasks the token's user owns. Every `health_every` cases
    GET /health must answer 200."""
    report = HttpFuzzReport(seed, per_route)
    counter = _Tracebacks()
    root = logging.getLogger()
    root.addHandler(counter)
    t0 = time.monotonic()
    try:
        for route in HTTP_ROUTES:
            if progress:
                progress(f"fuzzing the gateway: {route}")
            rng = random.Random(f"{seed}:http:{route}")
            st = report.by_route.setdefault(route, Counter())
            for i, (kind, raw) in enumerate(http_cases(rng, route, per_route, token, models)):
                status, headers, body, dt = await http_call(host, port, raw, timeout_s)
                key = str(status) if status is not None else "none"
                report.calls += 1
                report.statuses[key] += 1
                st[key] += 1
                report.max_s = max(report.max_s, dt)
                report.reached += "x-flowmaker-trace-id" in headers
                case = {"route": route, "kind": kind, "status": status, "seconds": round(dt, 3),
                        "request": raw[:300].decode("latin-1"), "request_len": len(raw),
                        "response": body[:300].decode("latin-1")}
                if status is None:
                    report.unanswered.append(case)
                elif status >= 500 and status != 503:
                    report.server_errors.append(case)
                if status is not None and status >= 400 and not raw.startswith(b"HEAD ") \
                        and not openai_error_shape(body):
                    report.bad_shape.append(case)
                if (i + 1) % health_every == 0:
                    report.unhealthy += await _http_health(host, port, timeout_s)
        report.unhealthy += await _http_health(host, port, timeout_s)
    finally:
        root.removeHandler(counter)
    report.tracebacks = counter.count
    report.elapsed_s = time.monotonic() - t0
    return report


async def _http_health(host: str, port: int, timeout_s: float) -> list[str]:
    status, _, _, dt = await http_call(host, port, _raw("GET", "/health", []), timeout_s)
    return [] if status == 200 else [f"/health answered {status} after {dt:.1f} s"]


async def http_fuzz_with_etcd(endpoint: str, *, per_route: int, seed: int, timeout_s: float = 10.0,
                              progress: Callable[[str], None] | None = None) -> HttpFuzzReport:
    """The gateway's part of `flowmaker bench fuzz`: `gateway_stack` on a fresh namespace of the etcd at
    `endpoint`, with a task its user deployed; the fuzz runs with that user's token and the task's id and
    name. Body and header timeouts are shorter than `timeout_s`, so a request that stalls is answered (or
    its connection closed) before the fuzz counts it unanswered."""
    import tempfile
    import uuid

    from flowmaker.state.etcd import EtcdStore

    store = EtcdStore(endpoint, namespace=f"/fuzz-http-{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    tokens = {FUZZ_TOKEN: {"user": FUZZ_USER, "admin": False}, FUZZ_ADMIN_TOKEN: {"user": "admin", "admin": True}}
    try:
        with tempfile.TemporaryDirectory(prefix="flowmaker-fuzz-http-") as d:
            async with gateway_stack(store, tokens, d, call_timeout_s=timeout_s, header_timeout_s=timeout_s / 2,
                                     body_timeout_s=timeout_s / 2) as g:
                if progress:
                    progress("fuzzing the gateway: deploying a task")
                t = await deploy_task(g.addresses["orchestrator"], FUZZ_TOKEN, name="fz-http", workflows=[_workflow()])
                if t.state != t.STATE_ACTIVE:
                    raise RuntimeError(f"the gateway fuzz's task did not become ACTIVE: {t.failure.message}")
                return await run_http_fuzz(g.host, g.port, token=FUZZ_TOKEN, models=[t.id, t.name], per_route=per_route,
                                           seed=seed, timeout_s=timeout_s, progress=progress)
    finally:
        with contextlib.suppress(Exception):
            await store.delete_prefix("/")
        await store.close()
