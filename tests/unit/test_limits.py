"""The input-limits table and its pure checks: ids, templates, JSON depth, model numbers, secret scrubbing."""

from __future__ import annotations

import dataclasses
import os

import pytest

from flowmaker.catalog import get_model
from flowmaker.errors import InvalidSpec
from flowmaker.limits import (
    FIELD_RULES,
    LIMITS,
    LimitExceeded,
    check_etag,
    check_hf_config,
    check_id,
    check_model,
    check_prompt_template,
    json_depth,
    render_template,
)
from flowmaker.redact import REDACTED, scrub
from services.deployer.backends.base import engine_base_env, engine_log_path


@pytest.mark.parametrize("bad", ["../../tmp/x", "..", ".", "a/b", "a b", "", "-x", "é", "x" * 129])
def test_ids_are_path_safe(bad: str) -> None:
    if not bad:
        check_id(bad, "task_id")  # empty: "unset", the caller decides
        return
    with pytest.raises(InvalidSpec) as e:
        check_id(bad, "task_id")
    assert e.value.field == "task_id"
    assert len(str(e.value)) < 300  # a huge id is never echoed whole


def test_good_ids() -> None:
    for ok in ("Llama-3.2-1B-Instruct", "task-1a2b3c4d", "n0-gpu0", "prof-0123456789ab", "x" * 128):
        check_id(ok, "id")


def test_limit_errors_name_the_limit() -> None:
    with pytest.raises(LimitExceeded) as e:
        check_id("x" * 1_000_000, "task_id")
    assert e.value.metadata["limit"] == "id_chars" and "id_chars" in str(e.value)
    assert e.value.reason == "LIMIT_EXCEEDED"


@pytest.mark.parametrize("bad", ["{input:>100000000}", "{input!r}", "{input.__class__}", "{input[0]}", "{0}", "{}",
                                 "{", "}", "{draft.x}"])
def test_prompt_templates_are_plain_substitutions(bad: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        check_prompt_template(bad, "workflows[0].stages[0].prompt_template")
    assert e.value.field == "workflows[0].stages[0].prompt_template"


def test_prompt_template_ok_and_render() -> None:
    t = "Q: {input}\nDraft: {draft}\n{{literal}}"
    check_prompt_template(t, "f")
    assert render_template(t, {"input": "why", "draft": "because"}) == "Q: why\nDraft: because\n{literal}"


def test_json_depth_is_linear_and_ignores_strings() -> None:
    assert json_depth('{"a": [1, {"b": "[[[["}]}') == 3
    assert json_depth("[" * 100_000 + "]" * 100_000) == 100_000


def test_etag() -> None:
    check_etag("12345", "etag")
    check_etag("", "etag")
    for bad in ("abc", "-1", "1.5", "9" * 30):
        with pytest.raises(InvalidSpec):
            check_etag(bad, "etag")


@pytest.mark.parametrize("key,value", [("hidden_size", 1e308), ("vocab_size", 2**70), ("num_hidden_layers", 10**9),
                                       ("hidden_size", float("inf")), ("vocab_size", 10**400)])
def test_hf_config_numbers_bounded(key: str, value: float) -> None:
    with pytest.raises(InvalidSpec) as e:
        check_hf_config({key: value})
    assert e.value.field == f"hf_config_json.{key}"


def test_model_bounded() -> None:
    m = get_model("Llama-3.2-1B-Instruct")
    check_model(m)
    assert m.arch is not None
    with pytest.raises(LimitExceeded):
        check_model(dataclasses.replace(m, arch=dataclasses.replace(m.arch, vocab=2**70)))
    with pytest.raises(InvalidSpec):
        check_model(dataclasses.replace(m, params_b=float("nan")))


def test_every_rule_names_a_real_field_and_limit() -> None:
    from google.protobuf import symbol_database

    import flowmaker.api.deployer.v1.deployer_pb2
    import flowmaker.api.generator.v1.generator_pb2
    import flowmaker.api.orchestrator.v1.orchestrator_pb2
    import flowmaker.api.profiler.v1.profiler_pb2
    import flowmaker.api.selector.v1.selector_pb2  # noqa: F401

    pool = symbol_database.Default().pool
    for name, rules in FIELD_RULES.items():
        msg, _, fname = name.removesuffix("[]").rpartition(".")
        assert pool.FindMessageTypeByName(msg).fields_by_name[fname] is not None, name
        for r in rules:
            for arg in r[1:]:
                if isinstance(arg, str):
                    assert hasattr(LIMITS, arg), (name, arg)


def test_scrub_removes_keys() -> None:
    body = ('{"error": "bad request", "echo": {"headers": {"Authorization": "Bearer sk-live-0123456789abcdef"}}, '
            '"api_key": "hunter22"} x-api-key: s3cr3t-value')
    out = scrub(body, ["sk-live-0123456789abcdef"])
    for secret in ("sk-live-0123456789abcdef", "hunter22", "s3cr3t-value"):
        assert secret not in out
    assert REDACTED in out and "bad request" in out


def test_engines_do_not_inherit_secrets() -> None:
    env = engine_base_env({"PATH": "/usr/bin", "FLOWMAKER_GENERATOR_LLM_API_KEY": "sk-x", "OPENAI_API_KEY": "k",
                           "HF_TOKEN": "hf", "SOME_SECRET": "s", "HOME": "/root",
                           # the suite's own settings name key files and endpoints: none of an engine's business
                           "FLOWMAKER_DEPLOYER_TLS_KEY": "/etc/flowmaker/deployer.key",
                           "FLOWMAKER_TLS_CA": "/etc/flowmaker/ca.pem", "FLOWMAKER_ETCD_ENDPOINTS": "127.0.0.1:2379",
                           "FLOWMAKER_TOKEN_FILE": "/root/.flowmaker/tokens.json", "AWS_ACCESS_KEY_ID": "a",
                           "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer x",
                           # what an engine does read stays
                           "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_LOGGING_LEVEL": "INFO", "LC_ALL": "C.UTF-8",
                           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                           "FLOWMAKER_ENGINE_GPU_SHARE_DIR": "/tmp/share", "FLOWMAKER_STACK": "/tmp/stack"})
    assert env == {"PATH": "/usr/bin", "HF_TOKEN": "hf", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1",
                   "VLLM_LOGGING_LEVEL": "INFO", "LC_ALL": "C.UTF-8",
                   "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                   "FLOWMAKER_ENGINE_GPU_SHARE_DIR": "/tmp/share", "FLOWMAKER_STACK": "/tmp/stack"}


@pytest.mark.parametrize("iid", ["../../tmp/x", "../..//../tmp/x", "..", ".hidden", "a/b"])
def test_engine_log_path_stays_in_dir(tmp_path: os.PathLike[str], iid: str) -> None:
    p = engine_log_path(str(tmp_path), iid)
    assert os.path.dirname(os.path.abspath(p)) == os.path.abspath(tmp_path)


async def test_caller_limiter_queues_a_burst_and_bounds_each_caller_separately() -> None:
    import asyncio
    import time

    from flowmaker.cancel import incoming_deadline
    from flowmaker.errors import DeadlineExceeded, NoCapacity
    from flowmaker.rpc.errors import CallerLimiter

    lim = CallerLimiter(2, queue=1)
    await lim.enter("a")
    await lim.enter("a")
    third = asyncio.create_task(lim.enter("a"))  # waits its turn
    await asyncio.sleep(0.01)
    assert not third.done()
    with pytest.raises(NoCapacity) as e:  # 2 running + 1 waiting: the next is refused at once
        await lim.enter("a")
    assert e.value.reason == "TOO_MANY_REQUESTS" and e.value.metadata["limit"] == "concurrent_calls_per_caller"
    await asyncio.wait_for(lim.enter("b"), 1)  # another caller is not affected
    lim.exit("a")
    await asyncio.wait_for(third, 1)  # a slot freed: the waiting one runs
    token = incoming_deadline.set(time.monotonic() + 0.05)
    try:
        with pytest.raises(DeadlineExceeded):  # no slot before its deadline
            await lim.enter("a")
    finally:
        incoming_deadline.reset(token)
    for c in ("a", "a", "b"):
        lim.exit(c)
    assert lim.in_flight == {}


async def test_offload_gives_up_at_the_deadline_and_stops_the_worker() -> None:
    import threading
    import time

    from flowmaker.cancel import checkpoint, incoming_deadline, offload
    from flowmaker.errors import DeadlineExceeded

    stopped = threading.Event()

    def busy() -> None:
        try:
            while True:  # CPU-bound work that checks in
                checkpoint()
                time.sleep(0.001)
        finally:
            stopped.set()

    token = incoming_deadline.set(time.monotonic() + 0.05)
    try:
        with pytest.raises(DeadlineExceeded):
            await offload(busy)
    finally:
        incoming_deadline.reset(token)
    assert stopped.wait(5)  # the worker thread was freed, not left spinning
    assert await offload(sum, [1, 2, 3]) == 6  # no deadline: runs to completion
