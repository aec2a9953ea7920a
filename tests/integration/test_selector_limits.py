"""The spec's input limits (docs/selection-spec.md, "Input limits") over the selector's gRPC API: an LLM stage with
no output tokens, or a GPU with infinite memory, is INVALID_ARGUMENT naming the field under every capacity
model and sharing mode (under BUSY_TIME the mean request would otherwise divide by zero)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from flowmaker import convert
from flowmaker.api.selector.v1 import selector_pb2, selector_pb2_grpc
from flowmaker.domain import CapacityModel, GpuSharing, SelectionOptions, Slo, Stage, Workflow
from flowmaker.rpc.channels import insecure_channel
from flowmaker.rpc.errors import field_violations
from services.selector.servicer import add_servicers
from services.selector.settings import SelectorSettings

pytestmark = pytest.mark.integration

WF = Workflow("wf", (Stage("plan", input_tokens=200, output_tokens=50, prompt_template="{input}"),
                     Stage("answer", depends_on=("plan",), input_tokens=300, output_tokens=80,
                           prompt_template="{input}")))


@pytest.fixture
async def selector(etcd_store: Any, start_service: Any) -> Any:
    settings = SelectorSettings(host="127.0.0.1", port=0, grace_s=0.5)
    server = await start_service("selector", lambda s: add_servicers(s, settings, etcd_store), settings)
    channel = insecure_channel(server.address, default_timeout_s=10)
    yield selector_pb2_grpc.SelectorServiceStub(channel)
    await channel.close(None)


@pytest.mark.parametrize("capacity", [CapacityModel.OUTPUT_TOKENS, CapacityModel.BUSY_TIME])
@pytest.mark.parametrize("sharing", [GpuSharing.IGNORE, GpuSharing.INTERFERENCE])
async def test_an_llm_stage_without_output_tokens_is_invalid_argument(selector: Any, capacity: CapacityModel,
                                                                      sharing: GpuSharing) -> None:
    req = selector_pb2.SelectVariantRequest(
        slo=convert.slo_to_proto(Slo(0.2, 10.0, 1.0)), workflows=[convert.workflow_to_proto(WF)],
        options=convert.selection_options_to_proto(SelectionOptions(capacity_model=capacity, gpu_sharing=sharing)))
    req.workflows[0].stages[1].output_tokens = 0
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await selector.SelectVariant(req)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(ei.value)] == ["workflows[0].stages[1].output_tokens"]
