"""The shared gRPC bootstrap on port 0: health, reflection, the error map (unary + streaming), deadlines, shutdown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from flowmaker.api.deployer.v1 import deployer_pb2, deployer_pb2_grpc
from flowmaker.errors import (
    AlreadyExists,
    Conflict,
    DeadlineExceeded,
    FailedPrecondition,
    FlowMakerError,
    InvalidSpec,
    NoCapacity,
    NotFound,
    Unavailable,
)
from flowmaker.rpc import errors as rpc_errors
from flowmaker.rpc.channels import deadline_s, insecure_channel
from flowmaker.rpc.server import RunningServer, serve
from flowmaker.settings import ServiceSettings

pytestmark = pytest.mark.integration

TEST_SERVICE = "flowmaker.test.v1.ErrorsService"
DEPLOYER = deployer_pb2.DESCRIPTOR.services_by_name["DeployerService"].full_name

# name -> (exception raised by the servicer, expected code)
CASES: dict[str, tuple[FlowMakerError, grpc.StatusCode]] = {
    "invalid": (InvalidSpec("must be >= 1, got 0", field="slo.max_latency_s"), grpc.StatusCode.INVALID_ARGUMENT),
    "notfound": (NotFound("no task 't9'", metadata={"task_id": "t9"}), grpc.StatusCode.NOT_FOUND),
    "exists": (AlreadyExists("task exists"), grpc.StatusCode.ALREADY_EXISTS),
    "conflict": (Conflict("etag moved"), grpc.StatusCode.ABORTED),
    "precondition": (FailedPrecondition("task not ACTIVE", reason="TASK_NOT_ACTIVE"),
                     grpc.StatusCode.FAILED_PRECONDITION),
    "nocap": (NoCapacity("no GPU has 40 GB free"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "unavailable": (Unavailable("etcd down", reason="ETCD_UNAVAILABLE"), grpc.StatusCode.UNAVAILABLE),
    "deadline": (DeadlineExceeded("took too long"), grpc.StatusCode.DEADLINE_EXCEEDED),
}


class _Errors:
    """A raw-bytes service: the request body names the case to raise."""

    def __init__(self) -> None:
        self.slow_started = asyncio.Event()
        self.slow_finished = False
        self.seen_deadline: float | None = None

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        name = request.decode()
        if name == "ok":
            return b"fine"
        if name == "boom":
            raise RuntimeError("secret internal detail /etc/passwd")
        if name == "slow":
            self.slow_started.set()
            await asyncio.sleep(0.5)
            self.slow_finished = True
            return b"finished"
        if name == "deadline-probe":
            self.seen_deadline = deadline_s(100.0)
            return b"ok"
        raise CASES[name][0]

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        name = request.decode()
        if name == "boom":
            raise RuntimeError("hidden")
        raise CASES[name][0]


def _add(servicer: _Errors):  # type: ignore[no-untyped-def]
    def add(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(TEST_SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
            "Stream": grpc.unary_stream_rpc_method_handler(servicer.stream),
        }),))
        # A real proto service too, so reflection can describe it.
        deployer_pb2_grpc.add_DeployerServiceServicer_to_server(deployer_pb2_grpc.DeployerServiceServicer(), server)
        return [TEST_SERVICE, DEPLOYER]
    return add


async def _unary(ch: grpc.aio.Channel, name: str, timeout: float | None = None) -> bytes:
    return await ch.unary_unary(f"/{TEST_SERVICE}/Unary", None, None)(name.encode(), timeout=timeout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(CASES))
async def test_error_map_unary(start_service, name: str) -> None:  # type: ignore[no-untyped-def]
    exc, code = CASES[name]
    srv = await start_service("errors", _add(_Errors()))
    async with insecure_channel(srv.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _unary(ch, name)
    e = ei.value
    assert e.code() == code
    info = rpc_errors.error_info(e)
    assert info is not None and info.reason == exc.reason and info.domain == "flowmaker.io"
    for k, v in exc.metadata.items():
        assert info.metadata[k] == v
    violations = rpc_errors.field_violations(e)
    if exc.field:
        assert [(v.field, v.description) for v in violations] == [(exc.field, exc.message)]
    else:
        assert violations == []
    # The client-side inverse gives back the same type, reason, field and message.
    back = rpc_errors.from_rpc_error(e)
    assert type(back) is type(exc)
    assert (back.reason, back.field, back.message, back.metadata) == (exc.reason, exc.field, exc.message,
                                                                      exc.metadata)


async def test_unexpected_error_is_internal_without_leaking(start_service, caplog) -> None:  # type: ignore[no-untyped-def]
    srv = await start_service("errors", _add(_Errors()))
    async with insecure_channel(srv.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _unary(ch, "boom")
        assert await _unary(ch, "ok") == b"fine"  # the server is still fine
    assert ei.value.code() == grpc.StatusCode.INTERNAL
    assert "passwd" not in (ei.value.details() or "") and "Traceback" not in (ei.value.details() or "")
    assert rpc_errors.error_info(ei.value).reason == "INTERNAL"  # type: ignore[union-attr]
    assert "secret internal detail" in caplog.text  # logged on the server side with its traceback
    back = rpc_errors.from_rpc_error(ei.value)
    assert type(back) is FlowMakerError and back.reason == "INTERNAL"


@pytest.mark.parametrize("name", ["nocap", "invalid", "boom"])
async def test_error_map_server_streaming(start_service, name: str) -> None:  # type: ignore[no-untyped-def]
    srv = await start_service("errors", _add(_Errors()))
    got: list[bytes] = []
    async with insecure_channel(srv.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for item in ch.unary_stream(f"/{TEST_SERVICE}/Stream", None, None)(name.encode()):
                got.append(item)
    assert got == [b"first"]
    expected = CASES[name][1] if name in CASES else grpc.StatusCode.INTERNAL
    assert ei.value.code() == expected
    assert rpc_errors.error_info(ei.value).reason == (CASES[name][0].reason if name in CASES else "INTERNAL")  # type: ignore[union-attr]


async def test_typed_call_helper(start_service) -> None:  # type: ignore[no-untyped-def]
    srv = await start_service("errors", _add(_Errors()))
    async with insecure_channel(srv.address) as ch:
        with pytest.raises(NoCapacity) as ei:
            await rpc_errors.call(_unary(ch, "nocap"))
    assert ei.value.reason == "NO_CAPACITY"


async def test_health_serving_only_after_ready_and_reflection(start_service, unused_tcp_port: int) -> None:  # type: ignore[no-untyped-def]
    ready = asyncio.Event()

    async def on_ready(running: RunningServer) -> None:
        assert running.port == unused_tcp_port
        await ready.wait()

    settings = ServiceSettings(host="127.0.0.1", port=unused_tcp_port)
    starting = asyncio.create_task(start_service("errors", _add(_Errors()), settings, on_ready=on_ready))
    async with insecure_channel(f"127.0.0.1:{unused_tcp_port}", default_timeout_s=2) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        statuses = []
        for _ in range(50):  # the port is bound before on_ready finishes
            try:
                statuses.append((await health.Check(health_pb2.HealthCheckRequest(service=""))).status)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING]
        ready.set()
        srv = await starting
        assert srv.port == unused_tcp_port
        for svc in ("", TEST_SERVICE, DEPLOYER):
            assert (await health.Check(health_pb2.HealthCheckRequest(service=svc))).status == \
                health_pb2.HealthCheckResponse.SERVING

        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=DEPLOYER)]
        answers = [r async for r in refl.ServerReflectionInfo(iter(reqs))]
    listed = {s.name for s in answers[0].list_services_response.service}
    assert {TEST_SERVICE, DEPLOYER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed
    fds = [descriptor_pb2.FileDescriptorProto.FromString(b)
           for b in answers[1].file_descriptor_response.file_descriptor_proto]
    methods = {m.name for f in fds for s in f.service if s.name == "DeployerService" for m in s.method}
    assert methods == {"Deploy", "Release", "ListInstances", "ListGpus"}


async def test_unimplemented_method_stays_unimplemented(start_service) -> None:  # type: ignore[no-untyped-def]
    srv = await start_service("errors", _add(_Errors()))
    async with insecure_channel(srv.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await deployer_pb2_grpc.DeployerServiceStub(ch).ListGpus(deployer_pb2.ListGpusRequest())
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_outgoing_calls_always_have_a_deadline(start_service) -> None:  # type: ignore[no-untyped-def]
    servicer = _Errors()
    srv = await start_service("errors", _add(servicer))
    async with insecure_channel(srv.address, default_timeout_s=0.2) as ch:
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _unary(ch, "slow")  # no timeout given: the channel's default applies
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 0.45
        assert isinstance(rpc_errors.from_rpc_error(ei.value), DeadlineExceeded)
        # Inside a handler, outgoing deadlines are capped by the incoming one.
        await _unary(ch, "deadline-probe", timeout=1.0)
    assert servicer.seen_deadline is not None and 0 < servicer.seen_deadline <= 1.05  # grpc rounds the timeout up


async def test_unavailable_target_maps_to_unavailable(unused_tcp_port: int) -> None:
    async with insecure_channel(f"127.0.0.1:{unused_tcp_port}", default_timeout_s=1) as ch:
        with pytest.raises(Unavailable):
            await rpc_errors.call(_unary(ch, "ok"))


async def test_serve_graceful_shutdown_finishes_inflight_then_runs_hooks() -> None:
    servicer = _Errors()
    stop = asyncio.Event()
    order: list[str] = []
    started: list[str] = []

    async def hook() -> None:
        # The handler must be done before hooks run (the client may learn of it later than the server).
        order.append("hook" if servicer.slow_finished else "hook-before-rpc-done")

    settings = ServiceSettings(host="127.0.0.1", port=0, grace_s=3.0)
    task = asyncio.create_task(serve("errors", _add(servicer), settings, on_shutdown=[hook], stop_event=stop,
                                     on_started=lambda r: started.append(r.address)))
    while not started:
        await asyncio.sleep(0.02)
    async with insecure_channel(started[0]) as ch:
        slow = asyncio.create_task(_unary(ch, "slow"))
        await servicer.slow_started.wait()
        stop.set()  # what SIGTERM does
        assert await slow == b"finished"  # in-flight RPC completes within the grace period
        await asyncio.wait_for(task, 5)
        with pytest.raises(grpc.aio.AioRpcError):  # new calls are refused
            await _unary(ch, "ok", timeout=0.5)
    assert order == ["hook"]
