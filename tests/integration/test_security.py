"""Hostile input against the running suite (real etcd, the five real gRPC servers on port 0): every
bad request is INVALID_ARGUMENT naming the full field path and the limit, nothing is stored, and the
regressions of issue 10 (path traversal, LLM key leak, poisoned registry) stay fixed."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from flowmaker.api.common.v1 import workflow_pb2
from flowmaker.api.deployer.v1 import deployer_pb2, deployer_pb2_grpc
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from flowmaker.api.profiler.v1 import profiler_pb2, profiler_pb2_grpc
from flowmaker.api.selector.v1 import selector_pb2, selector_pb2_grpc
from flowmaker.bench.fuzz import etcd_snapshot, fuzz_stack
from flowmaker.domain import Profile
from flowmaker.engine.server import EmulatedEngine
from flowmaker.errors import FailedPrecondition
from flowmaker.generator import GeneratorSettings
from flowmaker.generator.llm import LlmGenerator
from flowmaker.rpc.errors import error_info, field_violations
from services.profiler.registry import model_key

pytestmark = pytest.mark.integration

SLO = workflow_pb2.Slo(min_accuracy=0.1, max_latency_s=30.0, arrival_rate_rps=0.5)


class Suite:
    def __init__(self, addrs: dict[str, str], store: Any) -> None:
        self.store = store
        self.channels = {k: grpc.aio.insecure_channel(a) for k, a in addrs.items()}
        self.orch = orchestrator_pb2_grpc.OrchestratorServiceStub(self.channels["orchestrator"])
        self.deployer = deployer_pb2_grpc.DeployerServiceStub(self.channels["deployer"])
        self.profiler = profiler_pb2_grpc.ProfilerServiceStub(self.channels["profiler"])
        self.selector = selector_pb2_grpc.SelectorServiceStub(self.channels["selector"])


@pytest.fixture
async def suite(etcd_store: Any) -> AsyncIterator[Suite]:
    async with fuzz_stack(etcd_store) as addrs:
        s = Suite(addrs, etcd_store)
        yield s
        for ch in s.channels.values():
            await ch.close(None)


async def rejected(call: Any, field: str | None = None) -> grpc.aio.AioRpcError:
    """Await a call that must fail with INVALID_ARGUMENT naming `field` in a BadRequest violation."""
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call
    e = ei.value
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    if field is not None:
        assert [v.field for v in field_violations(e)] == [field], e.details()
    assert len(e.details() or "") <= 1024
    return e


def workflow(**stage_kw: Any) -> workflow_pb2.Workflow:
    st = workflow_pb2.Stage(id="a", input_tokens=10, output_tokens=5, prompt_template="{input}")
    for k, v in stage_kw.items():
        setattr(st, k, v)
    return workflow_pb2.Workflow(id="w", stages=[st])


async def test_undecodable_bytes_are_invalid_argument_on_every_service(suite: Suite) -> None:
    for svc, path in [("orchestrator", "/flowmaker.orchestrator.v1.OrchestratorService/DeployTask"),
                      ("generator", "/flowmaker.generator.v1.GeneratorService/GenerateWorkflows"),
                      ("profiler", "/flowmaker.profiler.v1.ProfilerService/RegisterModel"),
                      ("selector", "/flowmaker.selector.v1.SelectorService/SelectVariant"),
                      ("deployer", "/flowmaker.deployer.v1.DeployerService/Deploy")]:
        # field 1 (a string) holding bytes that are not UTF-8; then a truncated varint
        for raw in (b"\x0a\x02\xc3\x28", b"\x08\xff\xff"):
            e = await rejected(suite.channels[svc].unary_unary(path)(raw), "(request)")
            info = error_info(e)
            assert info is not None and info.reason == "UNDECODABLE_REQUEST", svc


async def test_field_paths_enums_and_finite_numbers(suite: Suite) -> None:
    await rejected(suite.orch.ListTasks(pb.ListTasksRequest(state=99)), "state")  # was INTERNAL
    await rejected(suite.orch.DeployTask(pb.DeployTaskRequest(description="d", slo=SLO, workflows=[
        workflow(kind=99)])), "workflows[0].stages[0].kind")
    await rejected(suite.orch.DeployTask(pb.DeployTaskRequest(description="d", slo=SLO, workflows=[
        workflow(kind=workflow_pb2.STAGE_KIND_TOOL, latency_s=math.inf)])), "workflows[0].stages[0].latency_s")
    await rejected(suite.orch.DeployTask(pb.DeployTaskRequest(description="d", slo=workflow_pb2.Slo(
        min_accuracy=0.1, max_latency_s=math.inf))), "slo.max_latency_s")
    await rejected(suite.orch.DeployTask(pb.DeployTaskRequest(description="d", slo=SLO, workflows=[
        workflow(prompt_template="{input:>100000000}")])), "workflows[0].stages[0].prompt_template")


async def test_limits_are_named(suite: Suite) -> None:
    cases = [
        (pb.DeployTaskRequest(description="d", slo=SLO, workflows=[workflow(calls_per_request=1_000_000)]),
         "workflows[0].stages[0].calls_per_request", "calls_per_request"),
        (pb.DeployTaskRequest(description="x" * (1 << 20), slo=SLO), "description", "description_bytes"),
        (pb.DeployTaskRequest(description="d", slo=SLO, workflows=[workflow_pb2.Workflow(id="w", stages=[
            workflow_pb2.Stage(id=f"s{i}", input_tokens=1, output_tokens=1) for i in range(10_000)])]),
         "workflows[0].stages", "stages_per_workflow"),
        (pb.DeployTaskRequest(description="d", slo=SLO, workflows=[workflow(output_tokens=2**31 - 1)]),
         "workflows[0].stages[0].output_tokens", "tokens_per_call"),
    ]
    for req, field, limit in cases:
        e = await rejected(suite.orch.DeployTask(req), field)
        info = error_info(e)
        assert info is not None and info.reason == "LIMIT_EXCEEDED" and info.metadata["limit"] == limit
        assert limit in (e.details() or "")
    # A megabyte of id: INVALID_ARGUMENT with a short message (it used to come back whole in NOT_FOUND,
    # which a default client reports as RESOURCE_EXHAUSTED).
    await rejected(suite.orch.GetTask(pb.GetTaskRequest(task_id="x" * (1 << 20))), "task_id")
    await rejected(suite.orch.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id="t", workflow_ids=["w"],
                                                                          etag="not-a-revision")), "etag")
    # bayesopt cannot be asked for unbounded work
    opts = {"max_trials": 2**31 - 1}
    from flowmaker.api.common.v1 import selection_pb2

    await rejected(suite.selector.SelectVariant(selector_pb2.SelectVariantRequest(
        slo=SLO, workflows=[workflow()], strategy="bayesopt", options=selection_pb2.SelectionOptions(**opts))),
        "options.max_trials")
    await rejected(suite.selector.SelectVariant(selector_pb2.SelectVariantRequest(
        slo=SLO, workflows=[workflow()], strategy="bayesopt",
        options=selection_pb2.SelectionOptions(time_budget_s=math.inf))), "options.time_budget_s")


async def test_path_traversal_in_request_id(suite: Suite, tmp_path: Path) -> None:
    before = await etcd_snapshot(suite.store)
    for rid in ("../../../../tmp/x", "../x", "a/b", ".."):
        await rejected(suite.deployer.Deploy(deployer_pb2.DeployRequest(
            model_id="Llama-3.2-1B-Instruct", tp=1, pp=1, gpu_ids=["n0-gpu0"], memory_gb_per_gpu=6.0,
            request_id=rid, no_wait=True)), "request_id")
    assert await etcd_snapshot(suite.store) == before


@pytest.mark.parametrize("config,field", [
    ({"hidden_size": 1e308}, "hf_config_json.hidden_size"),
    ({"vocab_size": 2**70}, "hf_config_json.vocab_size"),
    ({"num_hidden_layers": 10**9}, "hf_config_json.num_hidden_layers"),
])
async def test_poisoned_model_is_never_stored(suite: Suite, config: dict[str, Any], field: str) -> None:
    base = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "vocab_size": 1000}
    req = profiler_pb2.RegisterModelRequest(hf_config_json=json.dumps({**base, **config}), model_id="poison",
                                            accuracy=0.5)
    await rejected(suite.profiler.RegisterModel(req), field)
    assert await suite.store.get(model_key("poison")) is None
    listed = await suite.profiler.ListModels(profiler_pb2.ListModelsRequest())  # was INTERNAL for good
    assert "poison" not in [m.id for m in listed.models] and len(listed.models) >= 11


async def test_deeply_nested_hf_config_and_planted_record(suite: Suite) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    e = await rejected(suite.profiler.RegisterModel(profiler_pb2.RegisterModelRequest(
        hf_config_json=deep, model_id="deep", accuracy=0.5)), "hf_config_json")
    assert "hf_config_depth" in (e.details() or "")
    # A record an older version stored: ListModels skips it instead of failing every caller.
    await suite.store.put(model_key("planted"), {"id": "planted", "accuracy": 0.5, "params_b": 1e308,
                                                 "active_params_b": 1.0, "arch": None})
    listed = await suite.profiler.ListModels(profiler_pb2.ListModelsRequest())
    assert "planted" not in [m.id for m in listed.models] and len(listed.models) >= 11


async def test_rejected_calls_change_nothing(suite: Suite) -> None:
    before = await etcd_snapshot(suite.store)
    await rejected(suite.orch.DeployTask(pb.DeployTaskRequest(description="d", slo=SLO, workflows=[
        workflow(calls_per_request=10**6)])))
    await rejected(suite.deployer.Deploy(deployer_pb2.DeployRequest(model_id="Llama-3.2-1B-Instruct",
                                                                    memory_gb_per_gpu=math.nan)))
    assert await etcd_snapshot(suite.store) == before


async def test_tool_stage_bounded_by_the_invoke_timeout(etcd_store: Any) -> None:
    """A TOOL stage of the largest latency the limits allow cannot hold an Invoke past invoke_timeout_s when
    the caller sets no deadline (it used to sleep as long as latency_s said, forever for inf)."""
    async with fuzz_stack(etcd_store, invoke_timeout_s=1.0) as addrs:
        ch = grpc.aio.insecure_channel(addrs["orchestrator"])
        orch = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        wf = workflow_pb2.Workflow(id="w", stages=[
            workflow_pb2.Stage(id="a", input_tokens=10, output_tokens=2, prompt_template="{input}"),
            workflow_pb2.Stage(id="t", kind=workflow_pb2.STAGE_KIND_TOOL, depends_on=["a"], latency_s=300.0,
                               prompt_template="{a}")])
        slo = workflow_pb2.Slo(min_accuracy=0.1, max_latency_s=1000.0, arrival_rate_rps=0.1)
        t = (await orch.DeployTask(pb.DeployTaskRequest(description="d", slo=slo, workflows=[wf]))).task
        t = (await orch.ApproveWorkflows(pb.ApproveWorkflowsRequest(task_id=t.id, workflow_ids=["w"]),
                                         timeout=60)).task
        assert t.state == t.STATE_ACTIVE, t.failure.message
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await orch.Invoke(pb.InvokeRequest(task_id=t.id, input="x"))  # no client deadline
        # Cut off at the invoke timeout, or refused up front by the orchestrator's admission check when it
        # already knows the stages cannot finish in the time left: either way it returns, not after 300 s.
        code = ei.value.code()
        assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED), code
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            assert error_info(ei.value).reason == "INVOKE_TIMEOUT"  # type: ignore[union-attr]
        await orch.DeleteTask(pb.DeleteTaskRequest(task_id=t.id), timeout=60)
        await ch.close(None)


# ---- the LLM API key never leaks ------------------------------------------------------------------------

KEY = "sk-test-0123456789abcdefSECRET"


@pytest.fixture
async def echoing_endpoint() -> AsyncIterator[str]:
    """An OpenAI-compatible endpoint that refuses every request and echoes its headers back."""
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad request", "request_headers": dict(request.headers)}},
                                 status=400)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def test_upstream_error_body_is_scrubbed(echoing_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    s = GeneratorSettings(llm_base_url=echoing_endpoint, llm_model="m", llm_api_key=KEY, llm_timeout_s=5.0)
    async with LlmGenerator(s) as gen:
        with pytest.raises(FailedPrecondition) as ei:
            await gen.generate("summarise tickets", 2)
    text = str(ei.value) + json.dumps(ei.value.metadata)
    assert "bad request" in text and KEY not in text and KEY[:12] not in text
    assert KEY not in caplog.text


# ---- engine server -----------------------------------------------------------------------------------------

PROFILE = Profile("m", 1, 1, 5.0, 0.01, 0.0001, 0.01, 1000.0)


@pytest.fixture
async def engine_url() -> AsyncIterator[str]:
    engine = EmulatedEngine("m", PROFILE, time_scale=100.0, max_model_len=4096, api_key="inst-key")
    runner = web.AppRunner(engine.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_engine_refuses_absurd_requests(engine_url: str) -> None:
    auth = {"Authorization": "Bearer inst-key"}
    async with aiohttp.ClientSession() as http:
        async def post(body: Any, headers: dict[str, str] = auth, raw: str | None = None) -> int:
            async with http.post(engine_url + "/v1/completions", data=raw if raw is not None else json.dumps(body),
                                 headers={**headers, "Content-Type": "application/json"}) as r:
                await r.read()
                return r.status

        assert await post({"prompt": "hi", "max_tokens": 10**9}) == 400  # was a 500 MemoryError
        assert await post({"prompt": "hi", "max_tokens": 4000}, raw=None) == 200
        assert await post({}, raw="[" * 100_000 + "]" * 100_000) == 400  # was a 500 RecursionError
        assert await post({"prompt": "hi", "max_tokens": 2}, headers={}) == 401  # per-instance key required
        assert await post({"prompt": "hi", "max_tokens": 2}, headers={"Authorization": "Bearer nope"}) == 401
        async with http.get(engine_url + "/health") as r:  # probes stay open
            assert r.status == 200
