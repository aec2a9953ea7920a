"""Engine backends against real processes: the emulated engine, and stand-ins for trtllm-serve and vllm."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest

from flowmaker.domain import Profile
from flowmaker.errors import NotFound
from flowmaker.ports import free_port
from services.deployer.backends import (
    EngineProcess,
    EngineSpec,
    EngineStartError,
    TrtllmBackend,
    VllmBackend,
    get_backend,
)

pytestmark = pytest.mark.integration

STANDINS = Path(__file__).resolve().parents[1] / "standins"
PROFILE = Profile("qwen-7b", 2, 1, 20.0, fixed_s=0.01, prefill_s_per_token=1e-4, decode_s_per_token=0.01,
                  max_output_tokens_per_s=2000.0)
BACKENDS = ["emulated", "trtllm", "vllm"]




def spec(backend: str, *, tp: int = 2, extra: tuple[str, ...] = ()) -> EngineSpec:
    return EngineSpec(instance_id=f"inst-{backend}", model_id="qwen-7b", hf_id="Qwen/Qwen2.5-7B-Instruct", tp=tp,
                      pp=1, gpu_indices=(3, 5)[:tp], host="127.0.0.1",
                      port=0 if backend == "emulated" else free_port(), profile=PROFILE,
                      extra_args=extra + (("--time-scale", "10") if backend == "emulated" else ()))


def engine_env(**more: str) -> dict[str, str]:
    return {"PATH": f"{STANDINS}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "FLOWMAKER_STANDIN_TIME_SCALE": "10",
            "FLOWMAKER_STANDIN_PROFILE_JSON": json.dumps({"fixed_s": 0.01, "prefill_s_per_token": 1e-4,
                                                          "decode_s_per_token": 0.01,
                                                          "max_output_tokens_per_s": 2000.0}), **more}


def gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
async def procs():  # type: ignore[no-untyped-def]
    started: list[EngineProcess] = []
    yield started
    for p in started:
        await p.stop(grace_s=2)


@pytest.mark.parametrize("name", BACKENDS)
async def test_lifecycle_serve_scrape_stop(name: str, procs: list[EngineProcess]) -> None:
    backend = get_backend(name)
    s = spec(name)
    exits: list[int] = []
    p = EngineProcess(backend, s, env=engine_env(), on_exit=lambda _p, rc: exits.append(rc))
    procs.append(p)
    await p.start()
    await p.wait_healthy(timeout_s=30)
    assert p.is_alive and p.port > 0
    model = backend.served_model_name(s)
    async with aiohttp.ClientSession() as http:
        async with http.get(p.base_url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [model]
        body = {"model": model, "messages": [{"role": "user", "content": "hello engine"}], "max_tokens": 12}
        async with http.post(p.base_url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            resp = await r.json()
        assert resp["usage"] == {"prompt_tokens": 2, "completion_tokens": 12, "total_tokens": 14}
        body = {"model": model, "prompt": "stream me", "max_tokens": 6, "stream": True}
        async with http.post(p.base_url + "/v1/completions", json=body) as r:
            lines = [ln.decode().strip() async for ln in r.content if ln.strip()]
        assert lines[-1] == "data: [DONE]"
        assert len("".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]).split()) == 6
    m = await p.scrape_metrics()
    assert m["running"] == 0 and m["waiting"] == 0 and m["kv_usage"] == 0
    if name != "trtllm":  # trtllm-serve's iteration stats carry no token counters
        assert m["generation_tokens_total"] == 18 and m["prompt_tokens_total"] == 4
        assert m["requests_finished_total"] == 2
    pid = p.pid
    assert pid is not None
    rc = await p.stop(grace_s=5)
    assert rc == 0  # SIGTERM is a clean shutdown
    assert not p.is_alive and gone(pid)
    await asyncio.sleep(0.1)
    assert exits == []  # a requested stop is not a crash


@pytest.mark.parametrize("name", BACKENDS)
async def test_kill_9_is_reported_by_the_crash_watcher(name: str, procs: list[EngineProcess]) -> None:
    crashed: asyncio.Queue[tuple[str, int]] = asyncio.Queue()

    async def on_exit(proc: EngineProcess, rc: int) -> None:
        await crashed.put((proc.spec.instance_id, rc))

    p = EngineProcess(get_backend(name), spec(name), env=engine_env(), on_exit=on_exit)
    procs.append(p)
    await p.start()
    await p.wait_healthy(timeout_s=30)
    assert p.pid is not None
    os.kill(p.pid, 9)
    iid, rc = await asyncio.wait_for(crashed.get(), 10)
    assert iid == f"inst-{name}" and rc == -9
    assert not p.is_alive and p.returncode == -9


async def test_crash_after_requests_is_reported(procs: list[EngineProcess]) -> None:
    crashed: asyncio.Queue[int] = asyncio.Queue()
    p = EngineProcess(get_backend("emulated"), spec("emulated", extra=("--crash-after", "1")),
                      on_exit=lambda _p, rc: crashed.put_nowait(rc))
    procs.append(p)
    await p.start()
    await p.wait_healthy(timeout_s=30)
    async with aiohttp.ClientSession() as http, http.post(p.base_url + "/v1/completions",
                                                          json={"prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 200
    assert await asyncio.wait_for(crashed.get(), 10) == 17


@pytest.mark.parametrize("name", ["trtllm", "vllm"])
async def test_never_healthy_times_out_and_leaves_nothing(name: str, procs: list[EngineProcess]) -> None:
    exits: list[int] = []
    p = EngineProcess(get_backend(name), spec(name), env=engine_env(FLOWMAKER_STANDIN_STARTUP_DELAY_S="1000"),
                      on_exit=lambda _p, rc: exits.append(rc))
    procs.append(p)
    await p.start()
    pid = p.pid
    assert pid is not None
    with pytest.raises(EngineStartError) as ei:
        await p.wait_healthy(timeout_s=1.0)
    assert ei.value.reason == "ENGINE_START_TIMEOUT"
    assert "did not become healthy within 1s" in str(ei.value)
    assert not p.is_alive and gone(pid)
    assert exits == []


@pytest.mark.parametrize("name", ["trtllm", "vllm"])
async def test_wrong_gpu_env_fails_start_with_the_engine_message(name: str, procs: list[EngineProcess]) -> None:
    p = EngineProcess(get_backend(name), spec(name, tp=2), env=engine_env(CUDA_VISIBLE_DEVICES="0"))
    procs.append(p)
    await p.start()
    with pytest.raises(EngineStartError) as ei:
        await p.wait_healthy(timeout_s=30)
    assert "exited with code 1" in str(ei.value) and "CUDA_VISIBLE_DEVICES" in str(ei.value)


@pytest.mark.parametrize("name", ["trtllm", "vllm"])
async def test_standins_reject_unknown_flags_like_argparse(name: str, procs: list[EngineProcess]) -> None:
    p = EngineProcess(get_backend(name), spec(name, extra=("--no-such-flag", "1")), env=engine_env())
    procs.append(p)
    await p.start()
    with pytest.raises(EngineStartError) as ei:
        await p.wait_healthy(timeout_s=30)
    assert "exited with code 2" in str(ei.value) and "--no-such-flag" in str(ei.value)


async def test_missing_executable_is_a_clear_error() -> None:
    p = EngineProcess(TrtllmBackend(executable="trtllm-serve-not-installed"), spec("trtllm"))
    with pytest.raises(EngineStartError, match="trtllm-serve-not-installed"):
        await p.start()


def test_commands_and_env_follow_the_placement() -> None:
    s = spec("trtllm")
    cmd = TrtllmBackend(kv_cache_free_gpu_memory_fraction=0.85).build_command(s)
    assert cmd[:2] == ["trtllm-serve", "Qwen/Qwen2.5-7B-Instruct"]
    for flag, val in [("--tp_size", "2"), ("--pp_size", "1"), ("--kv_cache_free_gpu_memory_fraction", "0.85"),
                      ("--backend", "pytorch"), ("--port", str(s.port)), ("--host", "127.0.0.1")]:
        assert cmd[cmd.index(flag) + 1] == val
    assert TrtllmBackend().build_env(s) == {"CUDA_VISIBLE_DEVICES": "3,5"}
    cmd = VllmBackend(gpu_memory_utilization=0.8).build_command(s)
    assert cmd[:3] == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]
    for flag, val in [("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "1"),
                      ("--gpu-memory-utilization", "0.8"), ("--served-model-name", "qwen-7b")]:
        assert cmd[cmd.index(flag) + 1] == val


def test_registry_and_spec_validation() -> None:
    with pytest.raises(NotFound, match="unknown engine backend 'sglang'") as ei:
        get_backend("sglang")
    assert ei.value.field == "backend"
    from flowmaker.errors import InvalidSpec
    bad = EngineSpec("i", "m", "", 2, 1, (0,), "127.0.0.1", 8000, PROFILE)
    with pytest.raises(InvalidSpec) as e2:
        bad.validate()
    assert e2.value.field == "spec.gpu_indices"
    with pytest.raises(InvalidSpec) as e3:
        EngineProcess(get_backend("vllm"), EngineSpec("i", "m", "", 1, 1, (0,), "127.0.0.1", 0, PROFILE))
    assert e3.value.field == "spec.port"


async def test_trtllm_behind_the_key_proxy(procs: list[EngineProcess]) -> None:
    """trtllm-serve has no --api-key: with a per-instance key it listens on loopback behind
    flowmaker.engine.keyproxy, which refuses /v1 without the key (401, as vLLM) and relays the rest,
    streams included. The engine itself never gets the key, and a stop takes both processes down."""
    s = spec("trtllm")
    p = EngineProcess(get_backend("trtllm"), s, env=engine_env(), api_key="inst-key-123")
    procs.append(p)
    await p.start()
    await p.wait_healthy(timeout_s=30)
    assert p.port == s.port
    pid = p.pid
    assert pid is not None
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1
    engine_pid = int(children[0])
    engine_env_vars = Path(f"/proc/{engine_pid}/environ").read_bytes().split(b"\0")
    assert not any(b"inst-key-123" in v for v in engine_env_vars)  # the key stays with the proxy
    engine_cmd = Path(f"/proc/{engine_pid}/cmdline").read_bytes().split(b"\0")
    assert engine_cmd[engine_cmd.index(b"--host") + 1] == b"127.0.0.1"  # loopback only
    assert engine_cmd[engine_cmd.index(b"--port") + 1] != str(s.port).encode()
    model = get_backend("trtllm").served_model_name(s)
    key = {"Authorization": "Bearer inst-key-123"}
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "inst-key-123"}):
            async with http.get(p.base_url + "/v1/models", headers=headers) as r:
                assert r.status == 401 and await r.json() == {"error": "Unauthorized"}
        async with http.get(p.base_url + "/v1/models", headers=key) as r:
            assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == [model]
        body = {"model": model, "prompt": "stream me", "max_tokens": 6, "stream": True}
        async with http.post(p.base_url + "/v1/completions", json=body, headers=key) as r:
            assert r.status == 200
            lines = [ln.decode().strip() async for ln in r.content if ln.strip()]
        assert lines[-1] == "data: [DONE]"
        assert len("".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]).split()) == 6
        async with http.post(p.base_url + "/v1/completions", json=body) as r:
            assert r.status == 401
    m = await p.scrape_metrics()  # /metrics is not under /v1: the deployer scrapes it without the key
    assert m["running"] == 0
    await p.stop(grace_s=2)
    assert gone(pid) and not Path(f"/proc/{engine_pid}").exists()
