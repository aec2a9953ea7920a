"""The gateway's credentials, error mapping and hardening, with the official `openai` client and raw sockets,
against a real gRPC server on loopback that plays the orchestrator (a bearer-token check as the orchestrator's
auth will do, and the statuses a busy or unavailable orchestrator answers): malformed requests of every kind
are 4xx in OpenAI's error shape, a non-ASCII Authorization header is answered, slow headers and bodies are
cut off. The gateway over a real orchestrator is tests/integration/test_gateway_stack.py; the whole path
through a local stack of processes is tests/e2e/test_front_door.py."""

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
        self.calls: list[str] = []  # the RPCs, in order
        self.invoked: list[Any] = []  # the Invoke / InvokeStream requests

    async def _known(self, task_id: str, context: grpc.aio.ServicerContext) -> None:
        """As the orchestrator answers for a task id: t1 exists, the others are busy, down or unknown."""
        if task_id == "busy":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests in flight")
        if task_id == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "etcd unavailable")
        if task_id != "t1":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no task {task_id!r}")

    async def _auth(self, context: grpc.aio.ServicerContext) -> None:
        md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        self.seen.append(md)
        if md.get("authorization") != f"Bearer {TOKEN}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def ListTasks(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls.append("ListTasks")
        await self._auth(context)
        return pb.ListTasksResponse(tasks=[_task("t1")])

    async def GetTask(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls.append("GetTask")
        await self._auth(context)
        await self._known(request.task_id, context)
        return pb.GetTaskResponse(task=_task("t1"))

    async def InvokeStream(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls.append("InvokeStream")
        self.invoked.append(request)
        await self._auth(context)
        await self._known(request.task_id, context)
        try:
            for _ in range(2000):  # far longer than the test: only a cancellation ends it early
                yield pb.InvokeStreamResponse(delta="tok ", stage_id="answer")
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.stream_cancelled.set()
            raise

    async def Invoke(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls.append("Invoke")
        self.invoked.append(request)
        await self._auth(context)
        await self._known(request.task_id, context)
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
    runner = gw.runner()  # as services/gateway/__main__.py runs it
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


# ---- hardening: every malformed request is answered, 4xx, in OpenAI's shape ---------------------------------

CHAT = b'{"model":"t1","messages":[{"role":"user","content":"hi"}]}'


async def raw_http(url: str, data: bytes, timeout_s: float = 5.0) -> tuple[int | None, bytes]:
    """One raw HTTP/1.1 exchange (what aiohttp's and openai's clients refuse to send); (status, body), status None
    when nothing came back within `timeout_s`."""
    from yarl import URL

    from flowmaker.bench.fuzz import http_call

    u = URL(url)
    status, _, body, _ = await http_call(u.host or "127.0.0.1", u.port or 80, data, timeout_s)
    return status, body


def post(path: str, body: bytes, *headers: bytes, auth: bytes = b"Bearer " + TOKEN.encode(),
         content_type: bytes = b"application/json") -> bytes:
    lines = [b"POST /v1" + path.encode() + b" HTTP/1.1", b"Host: gw", b"Connection: close",
             b"Authorization: " + auth, b"Content-Type: " + content_type, *headers,
             b"Content-Length: %d" % len(body)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def gateway_tracebacks(caplog: pytest.LogCaptureFixture) -> list[Any]:
    return [r for r in caplog.records if r.exc_info and r.name.startswith(("services.gateway", "aiohttp", "grpc"))]


def openai_error(body: bytes) -> dict[str, Any]:
    import json

    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    return dict(err)


@pytest.mark.parametrize("auth", ["Bearer é".encode(), b"Bearer \xff\xfe", "Bearer s3cret\u2028".encode(),
                                  b"Bearer \xed\xa0\x80"])
async def test_a_non_ascii_authorization_header_is_answered_401(gateway: tuple[str, FakeOrchestrator], auth: bytes,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """It used to go unanswered (gRPC refuses the metadata inside a task nobody awaited), leaking a traceback
    and memory per request. Now 401 at once, the header neither passed on nor echoed."""
    url, fake = gateway
    for path in ("/models", "/chat/completions"):
        req = post(path, CHAT, auth=auth) if path != "/models" else (
            b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nAuthorization: " + auth + b"\r\n\r\n")
        status, body = await raw_http(url, req)
        assert status == 401, (status, body)
        err = openai_error(body)
        assert err["type"] == "authentication_error" and auth[7:].decode(errors="replace") not in err["message"]
    assert not fake.seen  # nothing reached the orchestrator
    assert not gateway_tracebacks(caplog), "a traceback was logged"


@pytest.mark.parametrize(("body", "param", "extra"), [
    (b'{"model":"t1","max_tokens":2147483648,"messages":[{"role":"user","content":"x"}]}', "max_tokens", b""),
    (b'{"model":"t1","max_completion_tokens":1e400,"messages":[{"role":"user","content":"x"}]}',
     "max_completion_tokens", b""),
    (b'{"model":"t1","max_tokens":' + b"9" * 5000 + b',"messages":[]}', None, b""),
    (b'{"model":"t1","messages":[{"role":"user","content":"a\\ud800b"}]}', "messages[0].content", b""),
    (b'{"model":"\\udfff","messages":[{"role":"user","content":"x"}]}', "model", b""),
    (b'{"model":"t1","\\ud800":1,"messages":[{"role":"user","content":"x"}]}', "\ud800", b""),
    (b'{"model":"t1","user":' + b"[" * 5000 + b"]" * 5000 + b',"messages":[]}', None, b""),
    (b'{"model":"t1","user":' + b"[" * 100 + b"]" * 100 + b',"messages":[{"role":"user","content":"x"}]}',
     "user" + "[0]" * 31, b""),
    (b'{"model":"t1","temperature":NaN,"messages":[{"role":"user","content":"x"}]}', None, b""),
    (b"\xff\xfe\x00{", None, b""),
    (b"", None, b""),
    (b"[]", None, b""),
    (CHAT, None, b"Content-Encoding: gzip"),
])
async def test_malformed_bodies_are_400_naming_the_field(gateway: tuple[str, FakeOrchestrator], body: bytes,
                                                         param: str | None, extra: bytes) -> None:
    """max_tokens >= 2^31, lone surrogates, JSON nested 5,000 deep, NaN, a body that is not UTF-8 or does not
    decode as its Content-Encoding: 400 in OpenAI's shape (several of them used to be 500)."""
    url, _ = gateway
    status, out = await raw_http(url, post("/chat/completions", body, *([extra] if extra else [])))
    assert status == 400, (status, out)
    err = openai_error(out)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


async def test_a_body_over_the_size_limit_is_413(gateway: tuple[str, FakeOrchestrator]) -> None:
    url, _ = gateway
    big = b'{"model":"t1","messages":[{"role":"user","content":"' + b"x" * (1 << 20) + b'"}]}'
    status, out = await raw_http(url, post("/chat/completions", big))
    assert status == 413 and openai_error(out)["type"] == "invalid_request_error", out[:300]


async def test_a_charset_nobody_knows_is_not_a_500(gateway: tuple[str, FakeOrchestrator]) -> None:
    """The body is JSON, whose encoding JSON itself defines: a Content-Type charset is not looked up (it was,
    and `charset=foo` was 500)."""
    url, _ = gateway
    status, out = await raw_http(url, post("/chat/completions", CHAT, content_type=b"application/json; charset=foo"))
    assert status == 200, out


@pytest.mark.parametrize("req", [
    b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer \x7f\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nBad Header: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: -1\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32) + b"\r\n\r\n",
])
async def test_malformed_http_is_an_openai_error(gateway: tuple[str, FakeOrchestrator], req: bytes,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """What aiohttp's HTTP parser refuses is 400 in OpenAI's shape too (it was text/plain), without a traceback
    and without echoing the request's bytes (a header may hold a token)."""
    url, _ = gateway
    status, out = await raw_http(url, req)
    assert status == 400, (status, out)
    err = openai_error(out)
    assert err["type"] == "invalid_request_error" and "\\x7f" not in err["message"]
    assert not gateway_tracebacks(caplog), "a traceback was logged"


@pytest.mark.parametrize(("path", "method", "status"), [("/v1/nothing", "GET", 404), ("/v1/models", "DELETE", 405),
                                                        ("/v1/chat/completions", "GET", 405)])
async def test_unknown_routes_are_openai_errors(gateway: tuple[str, FakeOrchestrator], path: str, method: str,
                                                status: int) -> None:
    url, _ = gateway
    got, out = await raw_http(url, f"{method} {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n".encode())
    assert got == status and openai_error(out)["type"] == "invalid_request_error"


async def test_slow_headers_and_slow_bodies_are_cut_off() -> None:
    """Slow-header and slow-body connections used to be held open for good. A connection whose headers are not
    complete within header_timeout_s is closed; a body not in within body_timeout_s is 408, then closed."""
    import time

    fake = FakeOrchestrator()
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gw = Gateway(f"127.0.0.1:{port}", timeout_s=10, header_timeout_s=1.0, body_timeout_s=1.0)
    runner = gw.runner()
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        async def dribble(first: bytes, more: bytes) -> tuple[bytes, float]:
            """Send `first`, then `more` every 0.2 s (for up to 20 s) until the server closes; what it sent."""
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
            writer.write(first)

            async def keep_sending() -> None:
                while time.monotonic() - t0 < 20:
                    await asyncio.sleep(0.2)
                    writer.write(more)
                    await writer.drain()

            sender = asyncio.create_task(keep_sending())
            got = b""
            try:
                while chunk := await asyncio.wait_for(reader.read(65536), 20):
                    got += chunk
            except (ConnectionError, TimeoutError):
                pass
            finally:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
                writer.close()
            return got, time.monotonic() - t0

        got, took = await dribble(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n", b"X-Slow: 1\r\n")
        assert took < 5, took  # closed after ~1 s, though the client still sends header lines
        got, took = await dribble(post("/chat/completions", b"")[:-len(b"Content-Length: 0\r\n\r\n")]
                                  + b"Content-Length: 100000\r\n\r\n{", b" ")
        assert took < 8, took
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert openai_error(got.partition(b"\r\n\r\n")[2])["code"] == "request_timeout"
        assert not fake.seen  # neither reached the orchestrator
    finally:
        await runner.cleanup()
        await gw.close()
        await server.stop(0)


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": 7}, "temperature"), ({"temperature": -0.1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"presence_penalty": -3}, "presence_penalty"), ({"frequency_penalty": 2.5},
                                                                                 "frequency_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"logprobs": True}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [1]}, "stop"), ({"seed": 2**64}, "seed"),
    ({"logit_bias": {"1": 2}}, "logit_bias"), ({"n": 2}, "n"), ({"n": True}, "n"), ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"seed": "x"}, "seed"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
])
def test_unsupported_or_out_of_range_chat_parameters_are_400(body: dict[str, Any], param: str) -> None:
    """They used to be accepted and silently ignored."""
    from services.gateway.app import ApiError

    with pytest.raises(ApiError) as e:
        parse_chat({"model": "t", "messages": [{"role": "user", "content": "x"}], **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert param.split("[")[0] in e.value.message


def test_what_openai_accepts_within_range_is_accepted() -> None:
    r = parse_chat({"model": "t", "messages": [{"role": "user", "content": "x"}], "temperature": 2, "top_p": 0,
                    "n": None, "seed": 7, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                    "logprobs": False, "stop": None, "user": "u", "max_tokens": 2**31 - 1, "stream": None})
    assert r.max_output_tokens == 2**31 - 1 and not r.stream
    assert r.sampling is not None and (r.sampling.temperature, r.sampling.top_p, r.sampling.seed) == (2, 0, 7)
    s = parse_chat({"model": "t", "messages": [{"role": "user", "content": "x"}], "stop": "\n"}).sampling
    assert s is not None and s.stop == ("\n",)
    assert parse_chat({"model": "t", "messages": [{"role": "user", "content": "x"}]}).sampling is None


async def test_the_model_goes_to_invoke_with_its_sampling_and_no_lookup(gateway: tuple[str, FakeOrchestrator]
                                                                        ) -> None:
    """The gateway ran a GetTask before every Invoke (issue 20). Now a task id goes to Invoke as it is, with the
    sampling parameters; an unknown model is Invoke's own NOT_FOUND, as OpenAI's 404; a stream looks its task
    up once per TTL, not per request."""
    url, fake = gateway
    c = openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    for _ in range(3):
        r = await c.chat.completions.create(model="t1", messages=msgs, temperature=0.3, seed=11, stop=["x"],
                                            top_p=0.9, presence_penalty=1, frequency_penalty=-1)
        assert r.model == "t1" and r.choices[0].message.content == "echo: hi"
    assert fake.calls == ["Invoke"] * 3, fake.calls
    sent = fake.invoked[-1].sampling
    assert (sent.temperature, sent.top_p, sent.seed, list(sent.stop)) == (0.3, 0.9, 11, ["x"])
    assert (sent.presence_penalty, sent.frequency_penalty) == (1, -1)
    await c.chat.completions.create(model="t1", messages=msgs)
    assert not fake.invoked[-1].sampling.HasField("temperature")  # unset stays unset: the engine's default
    fake.calls.clear()
    with pytest.raises(openai.NotFoundError) as nf:
        await c.chat.completions.create(model="nope", messages=msgs)
    assert nf.value.code == "model_not_found" and nf.value.status_code == 404 and "nope" in nf.value.message
    assert fake.calls == ["Invoke", "ListTasks"], fake.calls  # Invoke's NOT_FOUND; then: not a name either
    fake.calls.clear()
    for _ in range(3):
        async with await c.chat.completions.create(model="t1", messages=msgs, stream=True, seed=5) as s:
            async for _chunk in s:
                break
    assert fake.calls.count("GetTask") == 1 and fake.calls.count("InvokeStream") == 3, fake.calls
    assert fake.invoked[-1].sampling.seed == 5


@pytest.mark.parametrize(("body", "param"), [
    ({}, "prompt"), ({"prompt": 3}, "prompt"), ({"prompt": [1, 2, 3]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "temperature": 9}, "temperature"),
])
def test_parse_completion_names_the_parameter(body: dict[str, Any], param: str) -> None:
    from services.gateway.app import ApiError, parse_completion

    with pytest.raises(ApiError) as e:
        parse_completion({"model": "t", **body})
    assert e.value.status == 400 and e.value.param == param
    ok = parse_completion({"model": "t", "prompt": ["the input"], "max_tokens": 5})
    assert (ok.text, ok.max_output_tokens, ok.input_param) == ("the input", 5, "prompt")


async def test_orchestrator_field_names_become_openai_parameter_names() -> None:
    """An orchestrator error naming `max_output_tokens` (its InvokeRequest field) names the parameter the caller
    set: `max_tokens`, or `max_completion_tokens`; `task_id` is `model`. (`param` was `max_output_tokens`.)"""
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status

    class Rejecting(FakeOrchestrator):
        async def Invoke(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
            br = error_details_pb2.BadRequest(field_violations=[error_details_pb2.BadRequest.FieldViolation(
                field="max_output_tokens", description="must be <= 131072")])
            st = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                   message="max_output_tokens: must be <= 131072, got 200000")
            st.details.add().Pack(br)
            await context.abort_with_status(rpc_status.to_status(st))

    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(Rejecting(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gw = Gateway(f"127.0.0.1:{port}", timeout_s=10)
    runner = gw.runner()
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # type: ignore[union-attr]
        c = openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0)
        for name in ("max_tokens", "max_completion_tokens"):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="t1", messages=[{"role": "user", "content": "x"}],
                                                **{name: 200000})  # type: ignore[arg-type]
            assert e.value.param == name and "max_output_tokens" not in str(e.value.message), e.value.message
            assert f"{name}: must be <= 131072" in str(e.value.message)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="t1", prompt="x", max_tokens=200000)
        assert e.value.param == "max_tokens"
    finally:
        await runner.cleanup()
        await gw.close()
        await server.stop(0)
