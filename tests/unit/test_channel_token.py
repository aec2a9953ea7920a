"""`channel(...)`'s per-call interceptors on every kind of call: the bearer token (`token=`) reaches the server over
TLS, next to the caller's own metadata, and is never sent in the clear; a streamed call gets the default deadline
like a unary one. Real gRPC servers on loopback (mTLS and plaintext)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from flowmaker.rpc import channels
from flowmaker.rpc.tls import TlsFiles, ensure_pki, pki_files, server_credentials

_UNARY = "/t.Echo/Unary"
_STREAM = "/t.Echo/Stream"


def _seen(context: grpc.aio.ServicerContext) -> bytes:
    md = dict(context.invocation_metadata() or ())
    return f"{md.get('authorization', '-')}|{md.get('x-extra', '-')}".encode()


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return _seen(context)


async def _stream(request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for _ in request_iterator:
        yield _seen(context)


async def _hang(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    await asyncio.sleep(30)


def _echo_server() -> grpc.aio.Server:
    srv = grpc.aio.server()
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream),
        "Hang": grpc.unary_stream_rpc_method_handler(_hang)}),))
    return srv


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    return ensure_pki(tmp_path / "pki", ["orchestrator", "cli"])


async def _calls(ch: grpc.aio.Channel) -> tuple[bytes, bytes, list[bytes]]:
    async with ch:
        plain = await ch.unary_unary(_UNARY)(b"x")
        extra = await ch.unary_unary(_UNARY)(b"x", metadata=(("x-extra", "1"),))

        async def two() -> AsyncIterator[bytes]:
            yield b"a"
            yield b"b"
        streamed = [m async for m in ch.stream_stream(_STREAM)(two())]
    return plain, extra, streamed


@contextlib.asynccontextmanager
async def _serving(tls: TlsFiles | None = None) -> AsyncIterator[str]:
    """The echo server on a loopback port (TLS with `tls`, else plaintext); yields its address."""
    srv = _echo_server()
    port = (srv.add_secure_port("127.0.0.1:0", server_credentials(tls, require_client_cert=False)) if tls
            else srv.add_insecure_port("127.0.0.1:0"))
    await srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


async def test_the_token_rides_every_call_over_tls(pki: Path) -> None:
    async with _serving(pki_files(pki, "orchestrator")) as addr:
        me = pki_files(pki, "cli")
        plain, extra, streamed = await _calls(channels.channel(addr, tls=me, token="tok-1", tracing=False,
                                                               tls_server_name="orchestrator"))
        assert plain == b"Bearer tok-1|-"
        assert extra == b"Bearer tok-1|1"  # the caller's metadata is kept beside it
        assert streamed == [b"Bearer tok-1|-"] * 2
        # Without a token, nothing is added.
        ch = channels.channel(addr, tls=me, tracing=False, tls_server_name="orchestrator")
        assert (await _calls(ch))[0] == b"-|-"


async def test_the_token_is_never_sent_in_the_clear() -> None:
    async with _serving() as addr:
        plain, extra, streamed = await _calls(channels.channel(addr, tls=False, token="tok-1", tracing=False))
        assert (plain, extra, streamed) == (b"-|-", b"-|1", [b"-|-"] * 2)


async def test_a_streamed_call_gets_the_default_deadline() -> None:
    async with _serving() as addr, channels.channel(addr, tls=False, tracing=False, default_timeout_s=0.5) as ch:
        t0 = time.monotonic()
        got: list[bytes] = []
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for m in ch.unary_stream("/t.Echo/Hang")(b"x"):
                got.append(m)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert got == [b"first"] and time.monotonic() - t0 < 5
