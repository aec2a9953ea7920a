"""The emulated engine as a real process: OpenAI-compatible API, streaming, timing, metrics, script and crash modes."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowmaker.domain import Profile
from flowmaker.engine.server import CRASH_EXIT_CODE
from tests.integration.conftest import Engine

pytestmark = pytest.mark.integration

PROFILE = Profile("m1", 1, 1, 10.0, fixed_s=0.05, prefill_s_per_token=0.001, decode_s_per_token=0.02,
                  max_output_tokens_per_s=1000.0)


Starter = Callable[..., Awaitable[Engine]]


@pytest.fixture
def start_engine(start_engine_proc: Callable[..., Awaitable[Engine]]) -> Starter:
    """`await start_engine(*extra_flags, profile=PROFILE)`: an engine process (killed after the test)."""
    return lambda *extra, profile=PROFILE: start_engine_proc(profile, *extra)


async def post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def stream(url: str, body: Any) -> list[Any]:
    chunks: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: "):]
            chunks.append(data if data == "[DONE]" else json.loads(data))
    return chunks


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def test_chat_completion_follows_the_profile_latency(start_engine: Starter) -> None:
    eng = await start_engine()
    body = {"model": "m1", "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "one two three four"}], "max_tokens": 20}
    t0 = time.monotonic()
    status, resp = await post(eng.url + "/v1/chat/completions", body)
    elapsed = time.monotonic() - t0
    assert status == 200
    assert resp["object"] == "chat.completion" and resp["model"] == "m1"
    assert resp["usage"] == {"prompt_tokens": 6, "completion_tokens": 20, "total_tokens": 26}
    text = resp["choices"][0]["message"]["content"]
    assert len(text.split()) == 20 and resp["choices"][0]["finish_reason"] == "length"
    expected = PROFILE.call_latency_s(6, 20)  # 0.456 s
    assert expected - 0.01 <= elapsed < expected + 0.3


async def test_time_scale_runs_faster(start_engine: Starter) -> None:
    eng = await start_engine("--time-scale", "20")
    t0 = time.monotonic()
    status, resp = await post(eng.url + "/v1/completions", {"prompt": "a b c", "max_tokens": 200})
    elapsed = time.monotonic() - t0
    assert status == 200 and resp["usage"]["completion_tokens"] == 200
    assert PROFILE.call_latency_s(3, 200) / 20 - 0.01 <= elapsed < 1.0  # 4.05 model s -> ~0.2 wall s


async def test_streaming_chat_and_completion(start_engine: Starter) -> None:
    eng = await start_engine("--time-scale", "5")
    chunks = await stream(eng.url + "/v1/chat/completions",
                          {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
                           "stream": True})
    assert chunks[-1] == "[DONE]"
    body = chunks[:-1]
    assert body[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in body)
    assert len(text.split()) == 7
    assert body[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in body)  # OpenAI: no usage on a stream unless asked for
    assert sum(1 for c in body if c["choices"][0]["delta"].get("content")) == 7  # one chunk per token

    # stream_options.include_usage: `usage: null` on every chunk, then one more with empty choices and the usage
    chunks = await stream(eng.url + "/v1/chat/completions",
                          {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
                           "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]"
    body = chunks[:-1]
    assert body[-1]["choices"] == []
    assert body[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 7, "total_tokens": 8}
    assert all(c["usage"] is None for c in body[:-1])
    assert body[-2]["choices"][0]["finish_reason"] == "length"

    chunks = await stream(eng.url + "/v1/completions", {"prompt": "x y", "max_tokens": 5, "stream": True})
    assert chunks[-1] == "[DONE]"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert len(text.split()) == 5 and all(c["object"] == "text_completion" for c in chunks[:-1])


async def test_concurrent_requests_batch_and_metrics_count_them(start_engine: Starter) -> None:
    eng = await start_engine("--time-scale", "10")
    n, out = 12, 50
    t0 = time.monotonic()
    results = await asyncio.gather(*[post(eng.url + "/v1/completions", {"prompt": "p q r s", "max_tokens": out})
                                     for _ in range(n)])
    elapsed = time.monotonic() - t0
    assert all(s == 200 and r["usage"]["completion_tokens"] == out for s, r in results)
    # batched: far less than 12 sequential requests (12 * 1.05 model s / 10)
    assert elapsed < 0.6 * n * PROFILE.call_latency_s(4, out) / 10
    m = await metrics(eng.url)
    assert m['vllm:generation_tokens_total'] == n * out
    assert m['vllm:prompt_tokens_total'] == n * 4
    assert m['vllm:request_success_total'] == n
    assert m['vllm:num_requests_running'] == 0 and m['vllm:num_requests_waiting'] == 0
    assert m['vllm:e2e_request_latency_seconds_count'] == n
    assert m['vllm:e2e_request_latency_seconds_sum'] >= n * PROFILE.call_latency_s(4, out) - 1e-6


async def test_running_gauge_while_busy(start_engine: Starter) -> None:
    eng = await start_engine()
    task = asyncio.create_task(post(eng.url + "/v1/completions", {"prompt": "a", "max_tokens": 50}))
    await asyncio.sleep(0.3)
    m = await metrics(eng.url)
    assert m["vllm:num_requests_running"] == 1
    assert m["vllm:kv_cache_usage_perc"] > 0
    status, _ = await task
    assert status == 200


async def test_models_and_health(start_engine: Starter) -> None:
    eng = await start_engine()
    async with aiohttp.ClientSession() as s:
        async with s.get(eng.url + "/health") as r:
            assert r.status == 200
        async with s.get(eng.url + "/v1/models") as r:
            data = await r.json()
        async with s.get(eng.url + "/v1/models/m1") as r:
            assert r.status == 200
            card = await r.json()
        async with s.get(eng.url + "/v1/models/other") as r:
            assert r.status == 404
            missing = await r.json()
    assert [m["id"] for m in data["data"]] == ["m1"]
    assert card == data["data"][0] and card["object"] == "model"
    # `created` is a Unix timestamp (it used to be the engine's monotonic clock, e.g. 3111)
    assert abs(card["created"] - time.time()) < 3600
    assert missing["error"]["code"] == "model_not_found" and missing["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": []}, 400, "stream_options"),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/completions", [1, 2], 400, None),
])
async def test_bad_requests_name_the_field(start_engine: Starter, path: str, body: Any, status: int,
                                           param: str | None) -> None:
    eng = await start_engine()
    got, resp = await post(eng.url + path, body)
    assert got == status
    assert resp["error"]["param"] == param
    assert resp["error"]["type"] == "invalid_request_error" and resp["error"]["message"]


async def test_invalid_json_body(start_engine: Starter) -> None:
    eng = await start_engine()
    async with aiohttp.ClientSession() as s, s.post(eng.url + "/v1/completions", data=b"{nope") as r:
        assert r.status == 400
        assert "not valid JSON" in (await r.json())["error"]["message"]


async def test_script_mode_returns_canned_responses_in_order(start_engine: Starter, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps([
        {"content": '{"stages": [ broken json', "delay_s": 0.0},
        {"content": "slow answer", "delay_s": 2.0},
        {"content": "rate limited", "status": 429},
        {"content": "streamed text here"},
    ]))
    eng = await start_engine("--script", str(script))
    chat = {"messages": [{"role": "user", "content": "plan it"}], "max_tokens": 5}
    status, resp = await post(eng.url + "/v1/chat/completions", chat)
    assert status == 200 and resp["choices"][0]["message"]["content"] == '{"stages": [ broken json'
    assert resp["usage"]["completion_tokens"] == 4
    # the second one outlasts a short client timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
        with pytest.raises(TimeoutError):
            async with s.post(eng.url + "/v1/chat/completions", json=chat) as r:
                await r.read()
    status, resp = await post(eng.url + "/v1/chat/completions", chat)
    assert status == 429 and resp["error"]["message"] == "rate limited"
    chunks = await stream(eng.url + "/v1/chat/completions",
                          {**chat, "stream": True, "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-2]) == "streamed text here"
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 3
    status, resp = await post(eng.url + "/v1/chat/completions", chat)
    assert status == 500 and "script exhausted" in resp["error"]["message"]


async def test_crash_after_n_requests(start_engine: Starter) -> None:
    eng = await start_engine("--crash-after", "2", "--time-scale", "10")
    for _ in range(2):
        status, _ = await post(eng.url + "/v1/completions", {"prompt": "x", "max_tokens": 3})
        assert status == 200
    rc = await asyncio.wait_for(eng.proc.wait(), 5)
    assert rc == CRASH_EXIT_CODE
    with pytest.raises(aiohttp.ClientError):
        await post(eng.url + "/v1/completions", {"prompt": "x", "max_tokens": 3})


@pytest.mark.parametrize(("args", "msg"), [
    (["--profile-json", '{"fixed_s": 0}'], "profile_json.prefill_s_per_token"),
    (["--profile-json", '{"fixed_s":0,"prefill_s_per_token":0,"decode_s_per_token":-1,'
                        '"max_output_tokens_per_s":1}'], "decode_s_per_token"),
    ([], "--profile-json"),
    (["--bogus"], "unrecognized arguments"),
])
async def test_bad_flags_exit_2_naming_the_field(args: list[str], msg: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flowmaker.engine.server", "--model", "m1", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert msg in err.decode()


async def test_port_file(tmp_path: Path, start_engine: Starter) -> None:
    pf = tmp_path / "port"
    eng = await start_engine("--port-file", str(pf))
    assert int(pf.read_text()) == eng.port


async def test_cancelled_requests_leave_the_engine_within_a_second(start_engine: Starter) -> None:
    """200 streaming requests whose client goes away after the first token (and 50 non-streaming ones whose
    client gives up once the engine holds them) are dropped from the batch: 0 running and 0 waiting within 1 s,
    every one counted as cancelled, no more tokens."""
    eng = await start_engine()
    url = eng.url + "/v1/chat/completions"
    long = {"model": "m1", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def first_token_then_leave() -> None:
            async with s.post(url, json={**long, "stream": True}) as r:
                assert r.status == 200
                await r.content.readline()  # the first chunk: the request is in the batch
                r.close()  # the client goes away mid-stream

        async def wait_for_answer() -> None:
            async with s.post(url, json=long) as r:
                await r.read()

        # The non-streaming ones are given up only once the engine holds all of them: a client deadline that
        # fires before the server has read a request (a loaded machine: 246 of 250 counted) cancels nothing there.
        waiting = [asyncio.create_task(wait_for_answer()) for _ in range(50)]
        t0 = time.monotonic()
        while True:
            m = await metrics(eng.url)
            if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] >= 50:
                break
            assert time.monotonic() - t0 < 30.0, m
            await asyncio.sleep(0.02)
        await asyncio.gather(*(first_token_then_leave() for _ in range(200)))
        for t in waiting:
            t.cancel()  # the client gives up: its connection closes mid-request
        await asyncio.gather(*waiting, return_exceptions=True)
    t0 = time.monotonic()
    while True:
        m = await metrics(eng.url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            break
        assert time.monotonic() - t0 < 1.0, m
        await asyncio.sleep(0.05)
    assert m["flowmaker:request_cancelled_total"] == 250
    tokens = m["vllm:generation_tokens_total"]
    await asyncio.sleep(0.3)
    assert (await metrics(eng.url))["vllm:generation_tokens_total"] == tokens  # nothing more generated


async def test_sampling_parameters_shape_the_output(start_engine: Starter) -> None:
    """A seed makes the answer reproducible and differs from another seed's; temperature 0 is the greedy
    filler; a stop sequence ends the answer early with finish_reason "stop" and counts only the tokens kept."""
    eng = await start_engine()
    url = eng.url + "/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12}

    async def answer(**extra: Any) -> dict[str, Any]:
        status, r = await post(url, {**base, **extra})
        assert status == 200, r
        return r

    def text(r: dict[str, Any]) -> str:
        return str(r["choices"][0]["message"]["content"])

    greedy = await answer()
    assert text(await answer(temperature=0)) == text(greedy)
    a, b = await answer(seed=7, temperature=1.0), await answer(seed=7, temperature=1.0)
    assert text(a) == text(b) and len(text(a).split()) == 12
    assert text(await answer(seed=8, temperature=1.0)) != text(a)
    assert text(a) != text(greedy)
    stopped = await answer(stop=["fox"])
    assert text(stopped) == "the quick brown" and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 3
    assert greedy["choices"][0]["finish_reason"] == "length"
    chunks = await stream(url, {**base, "stream": True, "stop": "brown"})
    pieces = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c != "[DONE]" and c["choices"])
    assert pieces == "the quick"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c != "[DONE]"][-1] == "stop"


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop": ["ok", ""]}, "stop[1]"),
])
async def test_bad_sampling_parameters_are_400_naming_them(start_engine: Starter, body: dict[str, Any],
                                                           param: str) -> None:
    eng = await start_engine()
    got, resp = await post(eng.url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x"}], **body})
    assert got == 400, resp
    assert resp["error"]["param"] == param and resp["error"]["type"] == "invalid_request_error"
