"""The gateway over a real orchestrator: the five services in process on the session's etcd, bearer tokens at the
orchestrator, emulated engines (flowmaker.bench.fuzz.gateway_stack), and the gateway as `python -m services.gateway`
runs it. With the official `openai` client and raw sockets: names resolve among the caller's own tasks,
`finish_reason` is "length" when a cap cut the answer, errors name OpenAI's parameters, `/v1/completions`,
`/ready`, model metadata in `/v1/models`, and a fuzz of the whole HTTP surface with real ids."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio

from flowmaker.api.common.v1 import workflow_pb2
from flowmaker.bench.fuzz import GatewayStack, deploy_task, gateway_stack, http_call, run_http_fuzz

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
openai = pytest.importorskip("openai")

ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-0123456789", "admin-token-0123456789"
FUZZ_PER_ROUTE = int(os.environ.get("FLOWMAKER_GATEWAY_FUZZ_PER_ROUTE", "150"))  # x 6 routes: seconds
ONE = workflow_pb2.Workflow(id="one", stages=[workflow_pb2.Stage(id="answer", input_tokens=20, output_tokens=12,
                                                                  prompt_template="{input}")])
TOOLED = workflow_pb2.Workflow(id="tooled", stages=[
    workflow_pb2.Stage(id="draft", input_tokens=20, output_tokens=6, prompt_template="{input}"),
    workflow_pb2.Stage(id="format", kind=workflow_pb2.STAGE_KIND_TOOL, depends_on=["draft"], latency_s=0.01,
                       prompt_template="FORMATTED: {draft}")])


@dataclass
class Stack:
    g: GatewayStack
    mine: Any  # alice's task "notes"
    tooled: Any  # alice's task "tooled": a TOOL final stage
    bobs: Any  # bob's task, also named "notes"
    clients: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.g.url + "/v1"

    def client(self, token: str) -> Any:
        c = openai.AsyncOpenAI(base_url=self.url, api_key=token, max_retries=0)
        self.clients.append(c)
        return c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(etcd_server: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    from flowmaker.state.etcd import EtcdStore

    store = EtcdStore(etcd_server.endpoint, namespace=f"/test-gw-{uuid.uuid4().hex[:10]}", timeout_s=5.0)
    tokens = {ALICE: {"user": "alice"}, BOB: {"user": "bob"}, ADMIN: {"user": "admin", "admin": True}}
    try:
        async with gateway_stack(store, tokens, str(tmp_path_factory.mktemp("gateway")), gpu_count=4) as g:
            orch = g.addresses["orchestrator"]
            mine = await deploy_task(orch, ALICE, name="notes", workflows=[ONE])
            tooled = await deploy_task(orch, ALICE, name="tooled", workflows=[TOOLED])
            bobs = await deploy_task(orch, BOB, name="notes", workflows=[ONE])
            for t in (mine, tooled, bobs):
                assert t.state == t.STATE_ACTIVE, t.failure.message
            s = Stack(g, mine, tooled, bobs)
            yield s
            for c in s.clients:
                await c.close()
    finally:
        await store.delete_prefix("/")
        await store.close()


MSG = [{"role": "user", "content": "Meeting notes: ship on Friday."}]


async def test_a_user_names_their_own_task(stack: Stack) -> None:
    """A non-admin naming their own task by name got 403 (the name was tried as a task id, which is not theirs).
    Names resolve among the caller's tasks: alice's and bob's "notes" are each their own."""
    alice, bob = stack.client(ALICE), stack.client(BOB)
    assert (await alice.chat.completions.create(model="notes", messages=MSG, max_tokens=2)).model == stack.mine.id
    assert (await bob.chat.completions.create(model="notes", messages=MSG, max_tokens=2)).model == stack.bobs.id
    assert (await alice.completions.create(model="tooled", prompt="x", max_tokens=2)).model == stack.tooled.id
    assert (await alice.models.retrieve("notes")).id == stack.mine.id
    with pytest.raises(openai.PermissionDeniedError):  # someone else's task, by id: still theirs only
        await alice.chat.completions.create(model=stack.bobs.id, messages=MSG)
    with pytest.raises(openai.NotFoundError) as nf:  # an admin sees both "notes": ambiguous, use an id
        await stack.client(ADMIN).chat.completions.create(model="notes", messages=MSG)
    assert nf.value.code == "model_not_found" and "ambiguous" in str(nf.value.message)


async def test_finish_reason_is_length_when_a_cap_cut_the_answer(stack: Stack) -> None:
    """finish_reason was always "stop". Now it is the engine's for the final stage: the emulated engine writes
    exactly max_tokens words, so "length"; a TOOL final stage ends when it is done: "stop"."""
    alice = stack.client(ALICE)
    r = await alice.chat.completions.create(model=stack.mine.id, messages=MSG, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 3
    chunks = [c async for c in await alice.chat.completions.create(model=stack.mine.id, messages=MSG, max_tokens=3,
                                                                   stream=True)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    c = await alice.completions.create(model=stack.mine.id, prompt="hello", max_tokens=3)
    assert c.choices[0].finish_reason == "length"
    t = await alice.chat.completions.create(model=stack.tooled.id, messages=MSG, max_tokens=3)
    assert t.choices[0].message.content.startswith("FORMATTED:") and t.choices[0].finish_reason == "stop"


async def test_completions_endpoint(stack: Stack) -> None:
    """`/v1/completions` (there was none): the prompt is the task's input, the same routing as chat."""
    alice = stack.client(ALICE)
    raw = await alice.completions.with_raw_response.create(model="notes", prompt="Summarise: ship Friday.",
                                                           max_tokens=4)
    c = raw.parse()
    assert c.object == "text_completion" and c.model == stack.mine.id and c.id.startswith("cmpl-")
    assert len(c.choices) == 1 and len(c.choices[0].text.split()) == 4
    assert c.usage is not None and c.usage.completion_tokens == 4 and c.usage.prompt_tokens > 0
    assert raw.headers["x-flowmaker-request-id"] and len(raw.headers["x-flowmaker-trace-id"]) == 32
    chunks = [ch async for ch in await alice.completions.create(
        model=stack.tooled.id, prompt="hello", max_tokens=2, stream=True, stream_options={"include_usage": True})]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices).startswith("FORMATTED:")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.object == "text_completion" for ch in chunks)
    with pytest.raises(openai.BadRequestError) as br:
        await alice.completions.create(model="notes", prompt="x", echo=True)
    assert br.value.param == "echo"


async def test_unsupported_parameters_are_refused_through_the_client(stack: Stack) -> None:
    """`temperature=7`, `tools` and `response_format` used to be accepted and ignored."""
    alice = stack.client(ALICE)
    for kw, param in (({"temperature": 7}, "temperature"), ({"response_format": {"type": "json_object"}},
                                                            "response_format"),
                      ({"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]}, "tools")):
        with pytest.raises(openai.BadRequestError) as br:
            await alice.chat.completions.create(model=stack.mine.id, messages=MSG, **kw)  # type: ignore[arg-type]
        assert br.value.param == param and br.value.status_code == 400
    ok = await alice.chat.completions.create(model=stack.mine.id, messages=MSG, temperature=0.2, max_tokens=2,
                                             response_format={"type": "text"})
    assert ok.choices[0].message.content


async def test_errors_name_openai_parameters(stack: Stack) -> None:
    """Past the orchestrator's tokens_per_call limit its error names `max_output_tokens`; the caller set
    `max_tokens` (or `max_completion_tokens`), and that is the `param`."""
    alice = stack.client(ALICE)
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as br:
            await alice.chat.completions.create(model=stack.mine.id, messages=MSG,
                                                **{name: 1_000_000})  # type: ignore[arg-type]
        assert br.value.param == name and "max_output_tokens" not in str(br.value.message), br.value.message


async def test_ready_checks_the_orchestrator(stack: Stack) -> None:
    """`/ready`: 200 while the orchestrator answers its health check SERVING; 503 (OpenAI's shape) when it
    cannot be reached. There was no readiness endpoint (404)."""
    from aiohttp import web

    from services.gateway.app import Gateway

    status, _, body, _ = await http_call(stack.g.host, stack.g.port,
                                         b"GET /ready HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n", 10)
    assert status == 200 and json.loads(body) == {"status": "ready", "orchestrator": "SERVING"}
    from tests.conftest import free_port

    dead = Gateway(f"127.0.0.1:{free_port()}", timeout_s=3)  # nothing listens there
    runner = dead.runner()
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        status, _, body, _ = await http_call("127.0.0.1", port,
                                             b"GET /ready HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n", 15)
        assert status == 503, body
        assert json.loads(body)["error"]["code"] == "not_ready"
    finally:
        await runner.cleanup()
        await dead.close()


async def test_models_carry_metadata(stack: Stack) -> None:
    """`/v1/models` entries say what is known of a task: state, SLOs, the models serving it and its context
    length (the smallest context window among those models, from the catalog)."""
    from flowmaker.catalog import get_model

    cards = {m.id: m.model_dump() for m in (await stack.client(ALICE).models.list()).data}
    assert set(cards) == {stack.mine.id, stack.tooled.id}
    card = cards[stack.mine.id]
    assert card["name"] == "notes" and card["state"] == "ACTIVE" and card["workflow_id"] == "one"
    assert card["slo"] == {"min_accuracy": pytest.approx(0.1), "max_latency_s": 60.0, "arrival_rate_rps": 0.2}
    models = [a.model_id for a in stack.mine.variant.assignments]
    assert card["models"] == sorted(set(models)) and models
    ctx = [get_model(m).arch for m in models]
    assert card["context_length"] == min(a.max_ctx for a in ctx if a is not None)


async def test_fuzz_the_http_surface_with_real_ids(stack: Stack) -> None:
    """`flowmaker bench fuzz`'s gateway part, smaller: structure-aware JSON changes (huge integers, lone
    surrogates, deep nesting, NaN, wrong types), byte mutations, hostile Authorization headers (non-ASCII
    included), paths and HTTP framing, on every route, authenticated and naming real tasks. No 5xx (but 503),
    no answer that is not OpenAI's error JSON, nothing unanswered, no traceback, /health answering throughout."""
    report = await run_http_fuzz(stack.g.host, stack.g.port, token=ALICE, models=[stack.mine.id, "notes"],
                                 per_route=FUZZ_PER_ROUTE, seed=20261203, timeout_s=15.0)
    print(report.table())
    details = json.dumps(report.to_json(), indent=1)[:8000]
    assert report.ok, details
    assert report.fivexx - report.statuses.get("503", 0) == 0 and not report.unanswered, details
    assert report.reached > report.calls // 2, details  # most calls reach the handlers
    assert report.statuses["200"] > 0 and report.statuses["400"] > 0, details


async def test_sampling_parameters_reach_the_engines(stack: Stack) -> None:
    """Sampling parameters were validated and dropped. Now they reach every LLM call: the emulated engine
    answers the same for the same seed, differently for another, the greedy filler at temperature 0, and ends
    at a stop sequence (finish_reason "stop"). Over gRPC, one out of range is INVALID_ARGUMENT naming it."""
    import grpc

    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
    from flowmaker.rpc.errors import field_violations

    alice = stack.client(ALICE)

    async def text(**kw: Any) -> Any:
        r = await alice.chat.completions.create(model=stack.mine.id, messages=MSG, max_tokens=8, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    greedy = await text()
    assert await text(temperature=0) == greedy
    seeded = await text(temperature=1.0, seed=42)
    assert seeded == await text(temperature=1.0, seed=42) and seeded != greedy
    assert await text(temperature=1.0, seed=43) != seeded
    cut, why = await text(stop=["fox"])
    assert (cut, why) == ("the quick brown", "stop")
    chunks = [c async for c in await alice.chat.completions.create(
        model=stack.mine.id, messages=MSG, max_tokens=8, stream=True, temperature=1.0, seed=42)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == seeded[0]
    md = [("authorization", f"Bearer {ALICE}")]
    async with grpc.aio.insecure_channel(stack.g.addresses["orchestrator"]) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        for sampling, field_ in ((pb.Sampling(temperature=5), "sampling.temperature"),
                                 (pb.Sampling(top_p=-1), "sampling.top_p"),
                                 (pb.Sampling(stop=["a", "b", "c", "d", "e"]), "sampling.stop")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Invoke(pb.InvokeRequest(task_id=stack.mine.id, input="x", sampling=sampling),
                                  metadata=md, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in field_violations(e.value)] == [field_]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.InvokeStream(pb.InvokeStreamRequest(task_id=stack.mine.id, input="x",
                                                                    sampling=pb.Sampling(presence_penalty=9)),
                                             metadata=md, timeout=30):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
