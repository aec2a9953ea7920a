"""How a client target becomes a gRPC target and service config (flowmaker.rpc.channels.target_options), and how the
load the orchestrator replicas measure adds up (flowmaker.orchestration.adapt.combined). Pure: no network."""

from __future__ import annotations

import json

from flowmaker.orchestration.adapt import TaskLoad, combined
from flowmaker.rpc.channels import target_options


def _config(options: list[tuple[str, object]]) -> dict[str, object]:
    return json.loads(str(dict(options)["grpc.service_config"]))


def test_an_address_list_is_balanced_round_robin_with_retries() -> None:
    target, options = target_options("127.0.0.1:50055, 127.0.0.1:50056", secure=True)
    assert target == "ipv4:127.0.0.1:50055,127.0.0.1:50056"
    opts = dict(options)
    assert opts["grpc.default_authority"] == "127.0.0.1:50055"
    assert opts["grpc.ssl_target_name_override"] == "127.0.0.1"  # every replica is checked against one name
    cfg = _config(options)
    assert cfg["loadBalancingConfig"] == [{"round_robin": {}}]
    [method] = cfg["methodConfig"]  # type: ignore[misc]
    names = {n["method"] for n in method["name"]}
    assert {"GetTask", "ListTasks", "Invoke", "InvokeStream", "DeleteTask"} == names  # not Deploy/Approve
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


def test_one_address_keeps_its_target_and_a_name_is_balanced() -> None:
    target, options = target_options("127.0.0.1:50055", secure=False)
    assert target == "127.0.0.1:50055" and "loadBalancingConfig" not in _config(options)
    assert "grpc.ssl_target_name_override" not in dict(options)
    target, options = target_options("orchestrator:50055", secure=True)  # a headless Service: every pod
    assert target == "orchestrator:50055" and _config(options)["loadBalancingConfig"] == [{"round_robin": {}}]
    assert "grpc.ssl_target_name_override" not in dict(options)  # checked against the name itself
    _, options = target_options("127.0.0.1:1,127.0.0.1:2", secure=True, tls_server_name="orchestrator")
    assert dict(options)["grpc.ssl_target_name_override"] == "orchestrator"


def test_replicas_loads_add_up() -> None:
    assert combined([]) is None
    total = combined([TaskLoad(1.5, 2.0, 10), TaskLoad(0.5, 3.0, 4)])
    assert total == TaskLoad(2.0, 3.0, 14)  # rates and samples add; the worst replica's latency quantile
