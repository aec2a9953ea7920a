"""The LLM-backed generator against a real emulated engine process serving scripted chat answers
(`python -m flowmaker.engine.server --script`): valid answers, malformed JSON, cyclic DAGs, unknown
fields, answers that stay invalid, timeouts, HTTP errors and an unreachable endpoint."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flowmaker.errors import FailedPrecondition, InvalidSpec, Unavailable
from flowmaker.generator import GeneratorSettings, TemplateGenerator, make_generator
from flowmaker.generator.llm import LlmGenerator, chat_completions_url

pytestmark = pytest.mark.integration

MODEL = "planner-llm"
DESC = "Answer questions about our product manuals"


def stage(id: str, kind: str = "LLM", deps: tuple[str, ...] = (), inp: int = 300, out: int = 80,
          prompt: str | None = None, **extra: Any) -> dict[str, Any]:
    d = {"id": id, "kind": kind, "depends_on": list(deps), "input_tokens": inp if kind == "LLM" else 0,
         "output_tokens": out if kind == "LLM" else 0, "calls_per_request": 1,
         "latency_s": 0.0 if kind == "LLM" else 0.05, "role": id,
         "prompt_template": prompt if prompt is not None else "{input}" + "".join(f" {{{d}}}" for d in deps)}
    d.update(extra)
    return d


def cand(id: str, *stages: dict[str, Any], rationale: str = "a trade-off") -> dict[str, Any]:
    return {"id": id, "rationale": rationale, "stages": list(stages)}


def answer(*cands: dict[str, Any]) -> str:
    return json.dumps({"candidates": list(cands)})


VALID = answer(
    cand("rag", stage("retrieve", "TOOL"), stage("answer", deps=("retrieve",)), rationale="search then read"),
    cand("direct", stage("answer", inp=500, out=100), rationale="one call,\n cheapest"),
)
CYCLIC = answer(cand("loop", stage("a", deps=("b",)), stage("b", deps=("a",))))


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start `python -m flowmaker.engine.server --script` with the given entries; returns its base URL."""
    procs: list[subprocess.Popen[str]] = []

    def start(*entries: str | dict[str, Any]) -> str:
        script = [e if isinstance(e, dict) else {"content": e, "delay_s": 0.0} for e in entries]
        path = tmp_path / f"script{len(procs)}.json"
        path.write_text(json.dumps(script))
        p = subprocess.Popen([sys.executable, "-m", "flowmaker.engine.server", "--model", MODEL, "--port", "0",
                              "--script", str(path)], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ready, _, _ = select.select([p.stdout], [], [], 0.2)
            if ready:
                line = p.stdout.readline()
                if line.startswith("LISTENING "):
                    return f"http://127.0.0.1:{int(line.split()[1])}"
                if not line and p.poll() is not None:
                    break
        raise RuntimeError(f"engine did not start (exit code {p.poll()})")

    yield start
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def settings(url: str, **kw: Any) -> GeneratorSettings:
    return GeneratorSettings(llm_base_url=url, llm_model=MODEL, **{"llm_timeout_s": 5.0, **kw})


async def test_valid_answer(engine: Callable[..., str]) -> None:
    dup = cand("rag-again", stage("search", "TOOL"), stage("read", deps=("search",), prompt="{search} {input}"))
    url = engine(answer(*json.loads(VALID)["candidates"], dup))
    async with LlmGenerator(settings(url)) as gen:
        res = await gen.generate_with_attempts(f"  {DESC} ", max_candidates=3)
    # the third candidate has the first one's structure under other names: dropped as a duplicate
    assert [w.id for w in res.workflows] == ["rag", "direct"]
    rag, direct = res.workflows
    assert [s.id for s in rag.stages] == ["retrieve", "answer"] and rag.stages[1].depends_on == ("retrieve",)
    assert rag.stages[0].latency_s == 0.05 and rag.stages[1].input_tokens == 300
    assert all(w.description == DESC for w in res.workflows)
    assert direct.rationale == "one call, cheapest"  # one line, whatever the model wrote
    assert len(res.attempts) == 1 and res.attempts[0].outcome == "ok" and res.attempts[0].feedback == ""
    # the engine counted the prompt (system + user message) and the answer
    assert (res.attempts[0].input_tokens or 0) > 100 and (res.attempts[0].output_tokens or 0) > 10


async def test_max_candidates_caps_the_answer(engine: Callable[..., str]) -> None:
    url = engine(VALID)
    gen = make_generator(settings(url))
    try:
        assert isinstance(gen, LlmGenerator)
        wfs = await gen.generate(DESC, max_candidates=1)
    finally:
        await gen.close()
    assert [w.id for w in wfs] == ["rag"]


@pytest.mark.parametrize(("bad", "expect"), [
    ('{"candidates": [ {"id": "x", ', "not valid JSON"),
    (CYCLIC, "cycle"),
    (answer(cand("x", stage("answer", temperature=0.7))), "unknown field(s) ['temperature']"),
    (answer(cand("x", stage("answer", prompt="{input} {retrieve}"))), "placeholders ['retrieve']"),
    (answer(cand("x", stage("answer", inp=0))), "candidates[0].stages[0].input_tokens"),
    ('["not", "an", "object"]', "must be a JSON object"),
], ids=["malformed-json", "cyclic-dag", "unknown-field", "bad-placeholder", "zero-tokens", "not-object"])
async def test_invalid_then_valid_retries_with_feedback(engine: Callable[..., str], bad: str, expect: str) -> None:
    url = engine(bad, VALID)
    async with LlmGenerator(settings(url)) as gen:
        res = await gen.generate_with_attempts(DESC)
    assert [w.id for w in res.workflows] == ["rag", "direct"]
    first, second = res.attempts
    assert first.outcome == "invalid" and expect in " ".join(first.errors)
    assert second.outcome == "ok" and expect in second.feedback
    # The engine counts every prompt word it receives: the retry carried the bad answer and the feedback.
    assert second.input_tokens is not None and first.input_tokens is not None
    assert second.input_tokens >= first.input_tokens + len(second.feedback.split())


async def test_partially_valid_answer_keeps_the_good_candidate(engine: Callable[..., str]) -> None:
    mixed = answer(cand("good", stage("answer")), json.loads(CYCLIC)["candidates"][0])
    url = engine(mixed, VALID)
    async with LlmGenerator(settings(url)) as gen:
        res = await gen.generate_with_attempts(DESC)
    assert [w.id for w in res.workflows] == ["good", "rag", "direct"]
    assert "1 candidate(s) were fine" in res.attempts[1].feedback


async def test_always_invalid_is_a_clear_error(engine: Callable[..., str]) -> None:
    url = engine("nope", CYCLIC, '{"candidates": []}', VALID)
    async with LlmGenerator(settings(url, llm_max_attempts=3)) as gen:
        with pytest.raises(FailedPrecondition) as e:
            await gen.generate(DESC)
        err = e.value
        assert err.reason == "GENERATOR_UNUSABLE_ANSWERS"
        assert "after 3 attempt(s)" in err.message and "non-empty list" in err.message
        assert err.metadata["attempts"] == "3" and err.metadata["model"] == MODEL
        # exactly three requests were made: the fourth scripted answer is still there
        assert [w.id for w in await gen.generate(DESC)] == ["rag", "direct"]


async def test_timeout_is_a_clear_error(engine: Callable[..., str]) -> None:
    url = engine({"content": VALID, "delay_s": 3.0})
    async with LlmGenerator(settings(url, llm_timeout_s=0.3, llm_max_attempts=1)) as gen:
        t0 = time.monotonic()
        with pytest.raises(Unavailable) as e:
            await gen.generate(DESC)
    assert time.monotonic() - t0 < 2.0
    assert e.value.reason == "GENERATOR_TIMEOUT" and "timed out after 0.3 s" in e.value.message


async def test_timeout_then_answer(engine: Callable[..., str]) -> None:
    url = engine({"content": VALID, "delay_s": 3.0}, VALID)
    async with LlmGenerator(settings(url, llm_timeout_s=0.5, llm_max_attempts=2)) as gen:
        res = await gen.generate_with_attempts(DESC)
    assert [a.outcome for a in res.attempts] == ["timeout", "ok"] and len(res.workflows) == 2


async def test_server_error_is_retried_and_client_error_is_not(engine: Callable[..., str]) -> None:
    url = engine({"content": "overloaded", "delay_s": 0.0, "status": 503}, VALID,
                 {"content": "response_format not supported", "delay_s": 0.0, "status": 400}, VALID)
    async with LlmGenerator(settings(url)) as gen:
        res = await gen.generate_with_attempts(DESC)
        assert [a.outcome for a in res.attempts] == ["unreachable", "ok"]
        with pytest.raises(FailedPrecondition) as e:
            await gen.generate(DESC)
    assert e.value.reason == "GENERATOR_REJECTED" and "HTTP 400" in e.value.message
    assert "response_format not supported" in e.value.message


async def test_unreachable_endpoint() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with LlmGenerator(settings(f"http://127.0.0.1:{port}/v1", llm_max_attempts=2)) as gen:
        with pytest.raises(Unavailable) as e:
            await gen.generate(DESC)
    assert e.value.reason == "GENERATOR_UNREACHABLE" and "2 attempt(s)" in e.value.message


async def test_fenced_json_is_accepted(engine: Callable[..., str]) -> None:
    url = engine(f"```json\n{VALID}\n```")
    async with LlmGenerator(settings(url)) as gen:
        assert len(await gen.generate(DESC)) == 2


async def test_factory_and_settings() -> None:
    assert isinstance(make_generator(GeneratorSettings(llm_base_url="")), TemplateGenerator)
    wfs = await make_generator(GeneratorSettings(llm_base_url="")).generate("Translate emails to French", 2)
    assert len(wfs) == 2
    with pytest.raises(InvalidSpec) as e:
        make_generator(GeneratorSettings(llm_base_url="http://127.0.0.1:1", llm_model=""))
    assert e.value.field == "FLOWMAKER_GENERATOR_LLM_MODEL"
    with pytest.raises(InvalidSpec) as e:
        make_generator(GeneratorSettings(llm_base_url="127.0.0.1:1", llm_model="m"))
    assert e.value.field == "FLOWMAKER_GENERATOR_LLM_BASE_URL"
    assert chat_completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("https://h/v1/") == "https://h/v1/chat/completions"


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWMAKER_GENERATOR_LLM_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("FLOWMAKER_GENERATOR_LLM_MODEL", "m")
    monkeypatch.setenv("FLOWMAKER_GENERATOR_LLM_MAX_ATTEMPTS", "5")
    s = GeneratorSettings()
    assert (s.llm_base_url, s.llm_model, s.llm_max_attempts) == ("http://127.0.0.1:9", "m", 5)
    monkeypatch.setenv("FLOWMAKER_GENERATOR_LLM_MAX_ATTEMPTS", "0")
    with pytest.raises(ValueError, match="llm_max_attempts"):
        GeneratorSettings()
