"""`flowmaker bench throughput`: open-loop Invoke through each front door of a real TLS stack, per rate.

Starts the local stack as `flowmaker up` does (mTLS, bearer tokens, the gateway; emulated engines running
`time_scale` times faster than wall time, so that a call's model time is small next to the front door's own
cost), with one more, non-admin user in `tokens.json`. That user deploys a one-stage task; then, for each
rate, requests arrive open loop (evenly spaced, so the rate is exact) for `duration_s` through:

- `grpc-admin`: Invoke over gRPC/TLS with the admin token;
- `grpc-user`: Invoke with the non-admin token (the owner check on every call);
- `gateway`: POST /v1/chat/completions on the OpenAI-compatible gateway with the user's token.

Per path and rate it reports sent / ok / errors (by status), p50 / p99 of the client's latency, and for the
gRPC paths the engine call as the orchestrator timed it (`InvokeResponse.stages`), so the hop above the engine
is the difference. Prints JSON and a table; asserts nothing (figures, not tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PATHS = ("grpc-admin", "grpc-user", "gateway")
USER = "bench-user"


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    rates: tuple[float, ...] = (50.0, 150.0, 300.0)
    duration_s: float = 10.0
    time_scale: float = 200.0
    orchestrators: int = 1
    paths: tuple[str, ...] = PATHS
    max_tokens: int = 4


@dataclass
class _Obs:
    latencies: list[float] = field(default_factory=list)
    engine: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 2)


async def _open_loop(rate: float, duration_s: float, send: Any) -> _Obs:
    obs = _Obs()
    start = time.monotonic()
    tasks: list[asyncio.Task[None]] = []
    n = int(rate * duration_s)
    for k in range(n):
        delay = start + k / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        obs.sent += 1
        tasks.append(asyncio.create_task(send(obs)))
    await asyncio.wait(tasks, timeout=60.0)
    for t in tasks:
        if not t.done():
            t.cancel()
            obs.errors["unfinished after 60 s"] += 1
    return obs


async def _bench(stack: Any, cfg: ThroughputConfig, user_token: str, admin_token: str) -> list[dict[str, Any]]:
    import aiohttp
    import grpc

    from flowmaker.api.common.v1 import workflow_pb2
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
    from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc
    from flowmaker.rpc.channels import channel
    from flowmaker.rpc.tls import TlsFiles

    t = stack.client_tls()
    files = TlsFiles(t["ca"], t["cert"], t["key"])
    orch_addr = stack.addresses["orchestrator"]
    chans = []

    def orch(token: str) -> Any:
        ch = channel(orch_addr, tls=files, token=token, default_timeout_s=60.0, tracing=False)
        chans.append(ch)
        return orchestrator_pb2_grpc.OrchestratorServiceStub(ch)

    prof_ch = channel(stack.addresses["profiler"], tls=files, default_timeout_s=60.0, tracing=False)
    chans.append(prof_ch)
    with contextlib.suppress(grpc.aio.AioRpcError):  # ALREADY_EXISTS: the profiler preloads the catalog
        await profiler_pb2_grpc.ProfilerServiceStub(prof_ch).RegisterModel(
            profiler_pb2.RegisterModelRequest(catalog_name="Qwen2.5-1.5B-Instruct"))
    user, admin = orch(user_token), orch(admin_token)
    wf = workflow_pb2.Workflow(id="one", stages=[workflow_pb2.Stage(id="answer", input_tokens=32,
                                                                    output_tokens=cfg.max_tokens,
                                                                    prompt_template="{input}")])
    slo = workflow_pb2.Slo(min_accuracy=0.1, max_latency_s=30.0, arrival_rate_rps=1.0)
    task = (await user.DeployTask(pb.DeployTaskRequest(description="front-door throughput", slo=slo, workflows=[wf],
                                                       name=f"throughput-{secrets.token_hex(3)}"))).task
    await user.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=task.id, workflow_ids=["one"]), timeout=300.0)
    rows: list[dict[str, Any]] = []
    req = pb.InvokeRequest(task_id=task.id, input="hello " * 8, max_output_tokens=cfg.max_tokens)

    def grpc_send(stub: Any) -> Any:
        async def send(obs: _Obs) -> None:
            t0 = time.monotonic()
            try:
                r = await stub.Invoke(req)
                obs.latencies.append(time.monotonic() - t0)
                obs.engine.extend(s.latency_s for s in r.stages)
            except grpc.aio.AioRpcError as e:
                obs.errors[e.code().name] += 1
        return send

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as http:
        body = {"model": task.id, "max_tokens": cfg.max_tokens, "messages": [{"role": "user", "content": "hello"}]}
        headers = {"Authorization": f"Bearer {user_token}"}

        async def http_send(obs: _Obs) -> None:
            t0 = time.monotonic()
            try:
                async with http.post(stack.gateway_url + "/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    if r.status == 200:
                        obs.latencies.append(time.monotonic() - t0)
                    else:
                        obs.errors[f"HTTP {r.status}"] += 1
            except (TimeoutError, aiohttp.ClientError) as e:
                obs.errors[type(e).__name__] += 1

        senders = {"grpc-admin": grpc_send(admin), "grpc-user": grpc_send(user), "gateway": http_send}
        for send in senders.values():  # warm every path (connections, caches) before measuring
            await _open_loop(20.0, 1.0, send)
        for rate in cfg.rates:
            for path in cfg.paths:
                obs = await _open_loop(rate, cfg.duration_s, senders[path])
                p50, p99 = _q(obs.latencies, 0.5), _q(obs.latencies, 0.99)
                eng = statistics.median(obs.engine) if obs.engine else None
                rows.append({"path": path, "rate_rps": rate, "sent": obs.sent, "ok": len(obs.latencies),
                             "errors": dict(obs.errors), "p50_ms": _ms(p50), "p99_ms": _ms(p99),
                             "engine_call_p50_ms": _ms(eng),
                             "above_engine_p50_ms": _ms(p50 - eng) if p50 is not None and eng is not None else None})
    for ch in chans:
        await ch.close(None)
    return rows


def run_throughput(cfg: ThroughputConfig, out: Path) -> dict[str, Any]:
    """Start the stack, measure, stop it (whatever happens); write `<out>/throughput.json` and return it."""
    import os

    from flowmaker.launcher.stack import LocalStack, StackConfig
    from flowmaker.rpc.auth import ensure_admin_token, write_tokens
    from flowmaker.rpc.tls import TOKENS_FILE, ensure_pki

    work = Path(tempfile.mkdtemp(prefix="flowmaker-throughput-"))
    pki = ensure_pki(work / "pki", hosts=("127.0.0.1",))
    admin_token = ensure_admin_token(pki)
    user_token = secrets.token_urlsafe(24)
    tokens = json.loads((pki / TOKENS_FILE).read_text())
    write_tokens(pki / TOKENS_FILE, {**tokens, user_token: {"user": USER}})
    stack = LocalStack(StackConfig(gpus=2, time_scale=cfg.time_scale, work_dir=work, tls=True, gateway=True,
                                   orchestrators=cfg.orchestrators, log_level="WARNING"))
    t0 = time.monotonic()
    try:
        stack.start()
        rows = asyncio.run(_bench(stack, cfg, user_token, admin_token))
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    res = {"config": asdict(cfg), "rows": rows, "wall_s": round(time.monotonic() - t0, 1),
           "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(res, indent=1))
    res["json_path"] = str(out / "throughput.json")
    return res


def render(res: dict[str, Any]) -> str:
    lines = [f"{'path':<11} {'req/s':>6} {'sent':>6} {'ok':>6} {'p50 ms':>8} {'p99 ms':>8} {'engine p50':>10} "
             f"{'above eng':>9}  errors"]
    for r in res["rows"]:
        f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        lines.append(f"{r['path']:<11} {r['rate_rps']:>6g} {r['sent']:>6} {r['ok']:>6} {f(r['p50_ms']):>8} "
                     f"{f(r['p99_ms']):>8} {f(r['engine_call_p50_ms']):>10} {f(r['above_engine_p50_ms']):>9}  "
                     f"{r['errors'] or ''}")
    lines.append(f"load average {res['load_avg_1m']} on {res['cpus']} CPU(s); wall {res['wall_s']} s; "
                 f"JSON {res.get('json_path', '-')}")
    return "\n".join(lines)
