"""`flowmaker bench frontdoor` (also `python -m flowmaker.bench.frontdoor`): what the orchestrator's front door costs
per call once owners and listings come from its watch-fed cache, on a real etcd with many tasks.

Seeds `tasks` task records (AWAITING_APPROVAL, each with one candidate workflow) and their owner keys in a fresh
etcd namespace: one task is alice's, the rest bob's. Starts one orchestrator replica in this process (a real gRPC
server on loopback, bearer tokens over plaintext), then times, over gRPC:
- ListTasks as alice (1 task of hers among them): the cache's owner index, then a lookup by id;
- ListTasks as the admin (every task);
- GetTask as alice (the owner check from the cache; GetTask itself reads the record from etcd);
and, in process, for comparison, the listing as it was before the cache (a scan of every task record and of the
owner keys in etcd, then a filter). Prints JSON and a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from flowmaker.domain import Slo, Stage, Workflow
from flowmaker.orchestration.task import TaskRecord, TaskState


def _stats(samples: list[float]) -> dict[str, float]:
    xs = sorted(samples)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1000.0  # noqa: E731
    return {"calls": len(xs), "p50_ms": round(q(0.5), 3), "p95_ms": round(q(0.95), 3), "p99_ms": round(q(0.99), 3),
            "mean_ms": round(statistics.fmean(xs) * 1000.0, 3)}


async def _time(fn: Callable[[], Awaitable[Any]], calls: int) -> dict[str, float]:
    for _ in range(min(20, calls)):  # warm-up: channels, caches
        await fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return _stats(out)


def _start_etcd(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    from flowmaker.ports import free_ports

    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    c, p = free_ports(2)
    proc = subprocess.Popen([etcd, "--data-dir", str(work / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{c}",
                             "--advertise-client-urls", f"http://127.0.0.1:{c}",
                             "--listen-peer-urls", f"http://127.0.0.1:{p}", "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"127.0.0.1:{c}"


async def run(*, tasks: int = 1000, calls: int = 200, etcd_endpoint: str = "") -> dict[str, Any]:
    import grpc

    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
    from flowmaker.rpc.auth import write_tokens
    from flowmaker.rpc.server import RunningServer, start_server
    from flowmaker.state import keys
    from flowmaker.state.etcd import EtcdStore
    from services.orchestrator.clients import Clients
    from services.orchestrator.orchestrator import Orchestrator
    from services.orchestrator.servicer import add_servicers
    from services.orchestrator.settings import OrchestratorSettings

    work = Path(tempfile.mkdtemp(prefix="flowmaker-bench-frontdoor-"))
    proc = None
    if not etcd_endpoint:
        proc, etcd_endpoint = _start_etcd(work)
    store = EtcdStore(etcd_endpoint, namespace=f"/bench-frontdoor-{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    running: RunningServer | None = None
    channel = None
    try:
        for _ in range(100):
            with contextlib.suppress(Exception):
                await store.ping()
                break
            await asyncio.sleep(0.1)
        wf = Workflow("one", (Stage("answer", input_tokens=50, output_tokens=10, prompt_template="{input}"),))
        now = time.time()
        mine = ""
        sem = asyncio.Semaphore(32)

        async def seed(i: int) -> None:
            nonlocal mine
            tid = f"task-{i:05d}"
            rec = TaskRecord(tid, f"task {i}", Slo(0.1, 30.0, 0.5), name=tid, candidates=(wf,),
                             state=TaskState.AWAITING_APPROVAL, create_time=now + i * 1e-3, update_time=now)
            owner = "alice" if i == tasks // 2 else "bob"
            if owner == "alice":
                mine = tid
            async with sem:
                await store.put(keys.task(tid), rec.to_json())
                await store.put(keys.owner(tid), {"owner": owner})
        await asyncio.gather(*(seed(i) for i in range(tasks)))
        tokens = work / "tokens.json"
        write_tokens(tokens, {"alice-token": {"user": "alice"}, "admin-token": {"user": "admin", "admin": True}})
        oset = OrchestratorSettings(host="127.0.0.1", port=0, grace_s=0.2, selector_address="127.0.0.1:1",
                                    auth_tokens_file=str(tokens), reconcile_heal=False, follow_load=False)
        clients = Clients(oset.selector_address, timeout_s=5)
        orch = Orchestrator(oset, store, clients)

        async def ready(_r: RunningServer) -> None:
            await orch.resume()

        async def close() -> None:
            await orch.close()
            await clients.close()

        running = await start_server("orchestrator", lambda s: add_servicers(s, orch), oset, on_ready=ready,
                                     on_shutdown=[close])
        channel = grpc.aio.insecure_channel(running.address)
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        alice = (("authorization", "Bearer alice-token"),)
        admin = (("authorization", "Bearer admin-token"),)
        listed = await stub.ListTasks(pb.ListTasksRequest(), metadata=alice)
        assert [t.id for t in listed.tasks] == [mine], "alice must see exactly her task"
        every = await stub.ListTasks(pb.ListTasksRequest(), metadata=admin)
        assert len(every.tasks) == tasks

        async def scan() -> list[Any]:
            # The listing before the cache: every task record and every owner key from etcd, then a filter.
            owners = await store.get_prefix(keys.OWNERS)
            ids = {keys.parse_owner(kv.key) for kv in owners.items if kv.value.get("owner") == "alice"}
            return [v for v in await orch.lifecycle._list_from_store(None, None) if v.task.id in ids]

        results = {
            "list_tasks_user_1_of_n": await _time(lambda: stub.ListTasks(pb.ListTasksRequest(), metadata=alice),
                                                  calls),
            "list_tasks_admin_all": await _time(lambda: stub.ListTasks(pb.ListTasksRequest(), metadata=admin),
                                                max(10, calls // 10)),
            "get_task_user": await _time(lambda: stub.GetTask(pb.GetTaskRequest(task_id=mine), metadata=alice),
                                         calls),
            "list_before_cache_in_process": await _time(scan, max(5, calls // 20)),
        }
        return {"tasks": tasks, "etcd": etcd_endpoint, "results": results}
    finally:
        if channel is not None:
            await channel.close(None)
        if running is not None:
            await running.stop(0.2)
        with contextlib.suppress(Exception):
            await store.delete_prefix("/")
        await store.close()
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


WHAT = {"list_tasks_user_1_of_n": "ListTasks, a user with 1 task among all (gRPC, token)",
        "list_tasks_admin_all": "ListTasks, the admin: every task (gRPC)",
        "get_task_user": "GetTask, a user's own task (gRPC, token)",
        "list_before_cache_in_process": "the old listing: etcd scan + filter (in process)"}


def render(res: dict[str, Any]) -> str:
    lines = [f"front door with {res['tasks']} tasks in etcd",
             f"{'call':<58} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'calls':>6}"]
    for k, r in res["results"].items():
        lines.append(f"{WHAT.get(k, k):<58} {r['p50_ms']:>8.3f} {r['p95_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['calls']:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flowmaker.bench.frontdoor", description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--etcd", default="", help="host:port of an etcd to use (a fresh namespace); default: start one")
    ap.add_argument("--out", type=Path, default=Path("out/bench-frontdoor"))
    a = ap.parse_args(argv)
    res = asyncio.run(run(tasks=a.tasks, calls=a.calls, etcd_endpoint=a.etcd))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "frontdoor.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))
    print(render(res), file=sys.stderr)


if __name__ == "__main__":
    main()
