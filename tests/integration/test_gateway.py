"""The gateway's credentials and error mapping, with the official `openai` client, against a real gRPC server
on loopback that plays the orchestrator (a bearer-token check as the orchestrator's auth will do, and the
statuses a busy or unavailable orchestrator answers). The whole path through a real stack is
tests/e2e/test_front_door.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from aiohttp import web

from flowmaker import telemetry
from flowmaker.api.common.v1 import task_pb2, workflow_pb2
from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc
from services.gateway.app import TRACE_HEADER, Gateway, parse_chat

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")

TOKEN = "s3cret"


def _task(task_id: str) -> task_pb2.Task:
    wf = workflow_pb2.Workflow(id="w", stages=[workflow_pb2.Stage(id="answer", kind=workflow_pb2.STAGE_KIND_LLM,
                                                                  input_tokens=10, output_tokens=5)])
    t = task_pb2.Task(id=task_id, name=task_id, description=f"task {task_id}", state=task_pb2.Task.STATE_ACTIVE,
                      candidates=[wf])
    t.variant.workflow_id = "w"
    return t


class FakeOrchestrator(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """Answers like the orchestrator, behind a bearer-token check; records the metadata it saw."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.stream_cancelled = asyncio.Event()

    async def _auth(self, context: grpc.aio.ServicerContext) -> None:
        md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        self.seen.append(md)
        if md.get("authorization") != f"Bearer {TOKEN}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def ListTasks(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._auth(context)
        return pb.ListTasksResponse(tasks=[_task("t1")])

    async def GetTask(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._auth(context)
        if request.task_id == "busy":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests in flight")
        if request.task_id == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "etcd unavailable")
        if request.task_id != "t1":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no task {request.task_id!r}")
        return pb.GetTaskResponse(task=_task("t1"))

    async def InvokeStream(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._auth(context)
        try:
            for _ in range(2000):  # far longer than the test: only a cancellation ends it early
                yield pb.InvokeStreamResponse(delta="tok ", stage_id="answer")
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.stream_cancelled.set()
            raise

    async def Invoke(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._auth(context)
        return pb.InvokeResponse(output=f"echo: {request.input}", request_id="r1", latency_s=0.01, stages=[
            pb.StageOutput(stage_id="answer", model_id="m", instance_id="i", output="x", input_tokens=7,
                           output_tokens=3)])


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, FakeOrchestrator]]:
    telemetry.setup_tracing("flowmaker-test")  # as the gateway's __main__ does: real trace ids
    fake = FakeOrchestrator()
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gw = Gateway(f"127.0.0.1:{port}", timeout_s=10)
    runner = web.AppRunner(gw.app(), handler_cancellation=True)  # as services/gateway/__main__.py
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{http_port}/v1", fake
    await runner.cleanup()
    await gw.close()
    await server.stop(0)


async def test_bearer_token_is_passed_on_as_grpc_metadata(gateway: tuple[str, FakeOrchestrator]) -> None:
    url, fake = gateway
    c = openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0)
    assert [m.id for m in (await c.models.list()).data] == ["t1"]
    raw = await c.chat.completions.with_raw_response.create(model="t1", messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    r = raw.parse()
    assert r.choices[0].message.content == "echo: hi"  # the last user message is the task's input
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 3)
    assert len(raw.headers[TRACE_HEADER]) == 32 and int(raw.headers[TRACE_HEADER], 16) != 0 and raw.headers["x-flowmaker-request-id"] == "r1"
    assert fake.seen and all(md.get("authorization") == f"Bearer {TOKEN}" for md in fake.seen)
    assert all("traceparent" in md for md in fake.seen)  # the trace continues into the orchestrator

    bad = openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        await bad.models.list()
    assert e.value.status_code == 401 and e.value.type == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        await bad.chat.completions.create(model="t1", messages=[{"role": "user", "content": "hi"}])


async def test_grpc_statuses_become_openai_errors(gateway: tuple[str, FakeOrchestrator]) -> None:
    url, _ = gateway
    c = openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.RateLimitError) as rl:
        await c.chat.completions.create(model="busy", messages=msgs)  # type: ignore[arg-type]
    assert rl.value.status_code == 429 and rl.value.type == "rate_limit_error"
    with pytest.raises(openai.InternalServerError) as un:
        await c.chat.completions.create(model="down", messages=msgs)  # type: ignore[arg-type]
    assert un.value.status_code == 503 and un.value.type == "server_error"
    with pytest.raises(openai.NotFoundError) as nf:
        await c.chat.completions.create(model="nope", messages=msgs)  # type: ignore[arg-type]
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        await c.chat.completions.create(model="t1", messages=[{"role": "assistant", "content": "no user"}])
    assert br.value.param == "messages"


@pytest.mark.parametrize(("body", "param"), [
    ([], None), ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "t", "messages": "hi"}, "messages"),
    ({"model": "t", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "t", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"model": "t", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"model": "t", "messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ({"model": "t", "messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": 1},
     "stream_options"),
])
def test_parse_chat_names_the_parameter(body: Any, param: str | None) -> None:
    from services.gateway.app import ApiError

    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_parse_chat_reads_parts_and_usage_option() -> None:
    r = parse_chat({"model": "t", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 9,
                    "messages": [{"role": "user", "content": "old"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}]})
    assert (r.text, r.max_output_tokens, r.stream, r.include_usage) == ("a\nb", 9, True, True)
    assert not parse_chat({"model": "t", "messages": [{"role": "user", "content": "x"}],
                           "stream_options": {"include_usage": True}}).include_usage  # not streamed: always usage


async def test_tls_to_the_orchestrator_with_the_suite_ca(tmp_path: Any) -> None:
    """With `tls_ca_file` the gateway verifies a TLS-only orchestrator against the CA and presents no client
    certificate (the bearer token is the identity there)."""
    from flowmaker.rpc.tls import ensure_pki, pki_files, server_credentials

    ensure_pki(tmp_path, ("orchestrator",))
    files = pki_files(tmp_path, "orchestrator")
    fake = FakeOrchestrator()
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(fake, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(files, require_client_cert=False))
    await server.start()
    plain = Gateway(f"127.0.0.1:{port}", timeout_s=5)
    gw = Gateway(f"127.0.0.1:{port}", timeout_s=5, ca_file=files.ca)
    runners = []
    try:
        urls = []
        for g in (gw, plain):
            runner = web.AppRunner(g.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1")  # type: ignore[union-attr]
        ok = openai.AsyncOpenAI(base_url=urls[0], api_key=TOKEN, max_retries=0)
        assert [m.id for m in (await ok.models.list()).data] == ["t1"]
        with pytest.raises(openai.InternalServerError) as e:  # plaintext to a TLS-only listener: unavailable
            await openai.AsyncOpenAI(base_url=urls[1], api_key=TOKEN, max_retries=0).models.list()
        assert e.value.status_code == 503
    finally:
        for r in runners:
            await r.cleanup()
        await gw.close()
        await plain.close()
        await server.stop(0)


async def test_a_client_that_goes_away_cancels_the_workflow_run(gateway: tuple[str, FakeOrchestrator]) -> None:
    import aiohttp

    url, fake = gateway
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url + "/chat/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                               json={"model": "t1", "stream": True, "messages": [{"role": "user", "content": "x"}]})
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ") and b'"tok ' in line
            if seen >= 3:
                break
        resp.close()  # the client disconnects mid-stream
    await asyncio.wait_for(fake.stream_cancelled.wait(), 30)  # the orchestrator's InvokeStream was cancelled
