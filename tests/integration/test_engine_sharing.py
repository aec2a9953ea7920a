"""Emulated engines on one emulated GPU share it for real, across processes (`--gpu-ids`, `--gpu-share-dir`).

Real engine subprocesses at a time scale, under open-loop load; the slowdown engine A measures beside a loaded
engine B is checked against the one model of GPU sharing, `flowmaker.sharing.predicted_slowdown`.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowmaker.domain import Profile
from flowmaker.engine.server import profile_to_json
from flowmaker.sharing import predicted_slowdown
from tests.integration.conftest import Engine

pytestmark = pytest.mark.integration

SCALE = 20.0  # model seconds per wall second
# No fixed delay and no prefill (GPU time only, all of it slowed by sharing); decoding is memory-bound up to
# 100 concurrent requests, so an engine's own calls overlap for free and a lone call takes 0.01 s per token.
PROFILE = Profile("m1", 1, 1, 10.0, fixed_s=0.0, prefill_s_per_token=0.0, decode_s_per_token=0.01,
                  max_output_tokens_per_s=10_000.0, decode_tokens_per_s=10_000.0)
A_TOKENS = 30  # A's calls: 0.3 model s alone (15 ms wall)
B_TOKENS = 200  # B's calls: 2 model s alone, long beside A's, as the model's "busy with probability s" assumes


Starter = Callable[..., Awaitable[Engine]]


@pytest.fixture
def start_engine(start_engine_proc: Callable[..., Awaitable[Engine]]) -> Starter:
    """`await start_engine(*extra_flags)`: an engine of PROFILE at SCALE (killed after the test)."""
    return lambda *extra: start_engine_proc(PROFILE, "--time-scale", str(SCALE), *extra)


async def metrics(http: aiohttp.ClientSession, eng: Engine | str) -> dict[str, float]:
    async with http.get((eng if isinstance(eng, str) else eng.url) + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def call(http: aiohttp.ClientSession, eng: Engine | str, tokens: int, model: str = "m1") -> None:
    url = eng if isinstance(eng, str) else eng.url
    async with http.post(url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": tokens}) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def open_loop(http: aiohttp.ClientSession, eng: Engine, tokens: int, gaps_model_s: list[float]) -> None:
    """Send a call after each gap (model seconds), never waiting for answers; return when all are answered."""
    calls: list[asyncio.Task[None]] = []
    t = time.monotonic()
    for gap in gaps_model_s:
        t += gap / SCALE
        await asyncio.sleep(max(0.0, t - time.monotonic()))
        calls.append(asyncio.create_task(call(http, eng, tokens)))
    await asyncio.gather(*calls)


def e2e(m: dict[str, float]) -> tuple[float, float]:
    # (the labelled histogram appears with its first observation)
    return m.get("vllm:e2e_request_latency_seconds_sum", 0.0), m.get("vllm:e2e_request_latency_seconds_count", 0.0)


def mean_between(before: dict[str, float], after: dict[str, float]) -> float:
    (s0, n0), (s1, n1) = e2e(before), e2e(after)
    assert n1 > n0
    return (s1 - s0) / (n1 - n0)


def poisson_gaps(rng: random.Random, rate: float, span: float) -> list[float]:
    gaps: list[float] = []
    t = 0.0
    while True:
        g = rng.expovariate(rate)
        t += g
        if t > span:
            return gaps
        gaps.append(g)


def share_flags(share: Path, *gpus: str) -> tuple[str, ...]:
    return ("--gpu-ids", ",".join(gpus), "--gpu-share-dir", str(share))


async def test_engines_on_one_gpu_slow_each_other_as_the_sharing_model_predicts(start_engine: Starter,
                                                                                tmp_path: Path) -> None:
    share = tmp_path / "share"
    a = await start_engine(*share_flags(share, "gpu0"))
    b = await start_engine(*share_flags(share, "gpu0"))
    rng = random.Random(7)
    async with aiohttp.ClientSession() as http:
        # A alone under its open-loop load (Poisson, 1 call per model second).
        m0 = await metrics(http, a)
        await open_loop(http, a, A_TOKENS, poisson_gaps(rng, 1.0, 30.0))
        m1 = await metrics(http, a)
        alone = mean_between(m0, m1)
        # (a call arriving mid-step joins the batch at the step's end: up to one step, 0.01 s, later)
        assert PROFILE.call_latency_s(1, A_TOKENS) <= alone < PROFILE.call_latency_s(1, A_TOKENS) + 0.01
        assert m1["flowmaker_engine_gpu_speed"] == 1.0

        # The same load on A while B, on the same GPU, takes a 2 s call every 4 model seconds.
        span = 120.0
        b0, t0 = await metrics(http, b), time.monotonic()
        load_b = asyncio.create_task(open_loop(http, b, B_TOKENS, [0.5] + [4.0] * int(span / 4.0 - 1)))
        await open_loop(http, a, A_TOKENS, poisson_gaps(rng, 1.0, span))
        m2 = await metrics(http, a)
        await load_b
        b1, t1 = await metrics(http, b), time.monotonic()
    shared = mean_between(m1, m2)
    s_b = (b1["flowmaker_engine_busy_seconds_total"] - b0["flowmaker_engine_busy_seconds_total"]) / ((t1 - t0) * SCALE)
    measured = shared / alone
    predicted = predicted_slowdown([s_b])
    print(f"alone {alone:.4f} s, shared {shared:.4f} s, B busy share {s_b:.3f}: "
          f"slowdown measured {measured:.3f}, predicted {predicted:.3f}")
    assert 0.3 < s_b < 0.9
    assert measured > 1.25  # clearly slowed: sharing is on
    assert measured == pytest.approx(predicted, rel=0.25)
    # B was slowed too: its calls took longer than alone.
    assert mean_between(b0, b1) > 1.05 * PROFILE.call_latency_s(1, B_TOKENS)


async def test_engines_on_different_gpus_do_not_slow_each_other(start_engine: Starter, tmp_path: Path) -> None:
    share = tmp_path / "share"
    a = await start_engine(*share_flags(share, "gpu0"))
    b = await start_engine(*share_flags(share, "gpu1"))
    async with aiohttp.ClientSession() as http:
        hog = asyncio.create_task(call(http, b, 100_000))  # B busy for 1000 model s
        await asyncio.sleep(0.2)
        assert (await metrics(http, b))["vllm:num_requests_running"] == 1
        m0 = await metrics(http, a)
        await open_loop(http, a, A_TOKENS, [0.5] * 20)
        m1 = await metrics(http, a)
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
    lone = PROFILE.call_latency_s(1, A_TOKENS)
    assert lone <= mean_between(m0, m1) < lone + 0.01  # (at most a step's wait to join the batch)
    assert m1["flowmaker_engine_gpu_speed"] == 1.0 and m1["flowmaker_engine_gpu_busy_neighbours"] == 0
    assert list(os.listdir(share / "gpu0")) == []  # A idle: no mark


async def test_a_killed_busy_engine_does_not_slow_its_neighbour(start_engine: Starter, tmp_path: Path) -> None:
    share = tmp_path / "share"
    a = await start_engine(*share_flags(share, "gpu0"))
    b = await start_engine(*share_flags(share, "gpu0"))
    lone = PROFILE.call_latency_s(1, A_TOKENS)
    async with aiohttp.ClientSession() as http:
        hog = asyncio.create_task(call(http, b, 100_000))
        await asyncio.sleep(0.2)
        m = await metrics(http, a)
        assert m["flowmaker_engine_gpu_busy_neighbours"] == 1 and m["flowmaker_engine_gpu_speed"] == 0.5
        await call(http, a, A_TOKENS)  # beside a busy B: half speed all along
        m0 = await metrics(http, a)
        assert e2e(m0) == pytest.approx((2 * lone, 1), rel=1e-6)

        b.proc.kill()  # SIGKILL while busy: its mark stays behind
        await b.proc.wait()
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
        assert len(os.listdir(share / "gpu0")) == 1  # B's stale mark
        m = await metrics(http, a)
        assert m["flowmaker_engine_gpu_busy_neighbours"] == 0 and m["flowmaker_engine_gpu_speed"] == 1.0
        await call(http, a, A_TOKENS)
        m1 = await metrics(http, a)
    assert mean_between(m0, m1) == pytest.approx(lone, rel=1e-6)
    assert os.listdir(share / "gpu0") == []  # A removed the stale mark (and its own when idle)


async def test_default_is_alone_and_the_flags_go_together(start_engine: Starter, tmp_path: Path) -> None:
    a = await start_engine()  # no flags: today's behaviour, at full speed
    async with aiohttp.ClientSession() as http:
        m = await metrics(http, a)
    assert m["flowmaker_engine_gpu_speed"] == 1.0 and m["flowmaker_engine_gpu_busy_neighbours"] == 0
    for bad in (("--gpu-ids", "gpu0"), ("--gpu-share-dir", str(tmp_path)),
                ("--gpu-ids", "../x", "--gpu-share-dir", str(tmp_path))):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flowmaker.engine.server", "--model", "m1", "--profile-json",
            profile_to_json(PROFILE), *bad, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 2, err
        assert b"--gpu-" in err


async def test_the_deployer_starts_its_emulated_engines_sharing_their_gpus(etcd, etcd_namespace: str) -> None:  # type: ignore[no-untyped-def]
    """A node's emulated engines get `--gpu-ids` (by CUDA index) and the node's one sharing directory, so two
    instances placed on one GPU slow each other and one on another GPU does not; shutdown removes the directory."""
    from flowmaker.state.etcd import EtcdStore
    from services.deployer.node import DeployParams, NodeAgent
    from services.deployer.settings import DeployerSettings

    settings = DeployerSettings(node="node0", host="127.0.0.1", port=0, etcd_endpoints=etcd.endpoint,
                                etcd_namespace=etcd_namespace, etcd_timeout_s=3.0, use_nvml=False, gpu_type="A6000",
                                gpu_count=2, lease_ttl_s=3, engine_time_scale=50.0, engine_stop_grace_s=3.0,
                                engine_start_timeout_s=60.0, load_scrape_interval_s=0, resync_interval_s=0)
    store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
    agent = NodeAgent(store, settings)
    model = "Llama-3.2-1B-Instruct"
    try:
        await agent.start()
        recs = [await agent.deploy(DeployParams(model_id=model, gpu_ids=(g,), request_id=f"share-{i}"))
                for i, g in enumerate(("node0-gpu0", "node0-gpu0", "node0-gpu1"))]
        args = [agent.procs[r.id].spec.extra_args for r in recs]
        share_dirs = {a[a.index("--gpu-share-dir") + 1] for a in args}
        assert [a[a.index("--gpu-ids") + 1] for a in args] == ["gpu0", "gpu0", "gpu1"]
        assert len(share_dirs) == 1
        share = Path(share_dirs.pop())
        assert share.is_dir() and (share.stat().st_mode & 0o077) == 0  # the node's own, private
        urls = [agent.procs[r.id].base_url for r in recs]
        async with aiohttp.ClientSession() as http:
            hog = asyncio.create_task(call(http, urls[0], 100_000, model))
            await asyncio.sleep(0.3)
            neighbours = [(await metrics(http, u))["flowmaker_engine_gpu_busy_neighbours"] for u in urls]
            hog.cancel()
            await asyncio.gather(hog, return_exceptions=True)
        assert neighbours == [0, 1, 0]
    finally:
        await agent.shutdown()
        await store.close()
    assert not share.exists()



async def test_a_killed_agents_share_dir_is_removed_by_the_next(tmp_path: Path) -> None:
    from flowmaker.engine.gpu_share import make_share_dir, process_start

    gone = await asyncio.create_subprocess_exec("sleep", "30")
    start = process_start(gone.pid)
    gone.kill()
    await gone.wait()
    dead = make_share_dir("node0", str(tmp_path))
    (Path(dead) / ".owner").write_text(f"{gone.pid} {start}")  # as if made by that (now killed) agent
    (Path(dead) / "gpu0").mkdir()
    making = tmp_path / "flowmaker-gpu-share-node0-making"  # no owner yet: being made, left alone
    making.mkdir()
    mine = make_share_dir("node0", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([Path(mine).name, making.name])
    assert make_share_dir("node/0", str(tmp_path)) != mine  # each agent its own; any node name
