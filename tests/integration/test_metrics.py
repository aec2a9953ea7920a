"""Prometheus metrics from the one server bootstrap: every RPC counted and timed by method and final status
(unary and streaming, success and a mapped error), the selection hook, and /metrics over HTTP."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from flowmaker import metrics
from flowmaker.api.selector.v1 import selector_pb2, selector_pb2_grpc
from flowmaker.rpc.channels import insecure_channel
from services.selector.servicer import add_servicers
from services.selector.settings import SelectorSettings

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "select_request.json"


def count(service: str, method: str, code: str) -> float:
    return REGISTRY.get_sample_value("flowmaker_rpc_requests_total",
                                     {"service": service, "method": method, "code": code}) or 0.0


async def test_rpcs_are_counted_by_method_and_code(start_service: Any) -> None:
    from google.protobuf import json_format

    s = SelectorSettings(host="127.0.0.1", port=0, live_state=False)
    running = await start_service("selector-metrics", lambda srv: add_servicers(srv, s, None), s)
    req = json_format.Parse(EXAMPLE.read_text(), selector_pb2.SelectVariantRequest())
    sel0 = REGISTRY.get_sample_value("flowmaker_selection_duration_seconds_count",
                                     {"strategy": "exact", "feasible": "true"}) or 0.0
    async with insecure_channel(running.address) as ch:
        stub = selector_pb2_grpc.SelectorServiceStub(ch)
        await stub.SelectVariant(req)
        await stub.SelectVariant(req)
        req.strategy = "no-such-strategy"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SelectVariant(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    method = "SelectorService/SelectVariant"
    assert count("selector-metrics", method, "OK") == 2
    assert count("selector-metrics", method, "INVALID_ARGUMENT") == 1  # the status the caller got
    hist = REGISTRY.get_sample_value("flowmaker_rpc_duration_seconds_count",
                                     {"service": "selector-metrics", "method": method, "code": "OK"})
    assert hist == 2
    await running.stop(0.5)
    assert count("selector-metrics", "Health/Watch", "CANCELLED") + count("selector-metrics", "Health/Watch",
                                                                         "OK") >= 1
    sel1 = REGISTRY.get_sample_value("flowmaker_selection_duration_seconds_count",
                                     {"strategy": "exact", "feasible": "true"})
    assert sel1 == sel0 + 2


def test_metrics_endpoint_and_instance_gauges() -> None:
    from types import SimpleNamespace

    port = metrics.serve_metrics(0, "127.0.0.1")
    rec = SimpleNamespace(id="i1", model_id="m", node="n0", load_output_tokens_per_s=100.0,
                          observed_load_output_tokens_per_s=150.0)
    metrics.set_instance_load([rec], capacity=lambda r: 1000.0, queue=lambda r: (3, 1))
    with metrics.time_reconcile("test"):
        pass
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'flowmaker_instance_headroom_output_tokens_per_second{instance="i1",model="m",node="n0"} 850.0' in text
    assert 'flowmaker_instance_load_output_tokens_per_second{instance="i1",kind="observed",model="m",node="n0"} ' \
           '150.0' in text
    assert 'flowmaker_instance_queue_requests{instance="i1",model="m",node="n0",state="waiting"} 1.0' in text
    assert 'flowmaker_reconcile_duration_seconds_count{service="test"} 1.0' in text
    metrics.set_instance_load([])  # a vanished instance leaves no stale series
    assert REGISTRY.get_sample_value("flowmaker_instance_load_output_tokens_per_second",
                                     {"instance": "i1", "model": "m", "node": "n0", "kind": "planned"}) is None
