"""SelectorService servicer: parse the request, fill in live cluster/profiles when left out, select, convert back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from flowmaker import convert, metrics
from flowmaker.api.selector.v1 import selector_pb2, selector_pb2_grpc
from flowmaker.cancel import offload
from flowmaker.catalog import default_models, get_gpu_type
from flowmaker.domain import Cluster, SelectionRequest
from flowmaker.errors import DeadlineExceeded
from flowmaker.orchestration.cluster import cluster_gpu_type, read_live_cluster, read_profiles
from flowmaker.profiling.analytic import profiles_for
from flowmaker.selection import get_strategy, select
from flowmaker.selection.exact import DEFAULT_BUDGET_S as DEFAULT_TIME_BUDGET_S
from flowmaker.state.store import StateStore
from services.selector.settings import SelectorSettings

log = logging.getLogger(__name__)


class SelectorServicer(selector_pb2_grpc.SelectorServiceServicer):
    """`store` None = no live state: a request without a cluster gets an empty one."""

    def __init__(self, settings: SelectorSettings, store: StateStore | None) -> None:
        self.settings = settings
        self.store = store

    async def SelectVariant(self, request: selector_pb2.SelectVariantRequest,
                            context: grpc.aio.ServicerContext) -> selector_pb2.SelectVariantResponse:
        # Converting a big request (many profiles, models, stages) is CPU work: off the event loop too.
        req, strategy = await offload(convert.select_variant_request_from_proto, request)
        get_strategy(strategy)  # an unknown name fails before any etcd read
        req = await self._complete(req, has_cluster=request.HasField("cluster"))
        req = with_deadline(req, context.time_remaining())
        # The strategies are CPU-bound; a worker thread keeps health checks and other RPCs answering.
        # Every strategy stops at the request's time budget, so the thread is free again by the deadline.
        result = await asyncio.to_thread(select, req, strategy)
        metrics.observe_selection(strategy, result.feasible, result.elapsed_s)
        log.info("SelectVariant %s: feasible=%s workflow=%s cost=%.3f latency=%.3fs optimal=%s lower_bound=%.3f "
                 "evaluated=%d in %.3fs", strategy, result.feasible,
                 result.variant.workflow_id if result.variant else "-",
                 result.variant.cost if result.variant else 0.0, result.variant.latency_s if result.variant else 0.0,
                 result.optimal, result.lower_bound, result.variants_evaluated, result.elapsed_s)
        return convert.selection_result_to_proto(result)

    async def _complete(self, req: SelectionRequest, *, has_cluster: bool) -> SelectionRequest:
        """Fill in what the request leaves out: models (the catalog's), cluster and profiles (live)."""
        live = self.store is not None and self.settings.live_state
        models = req.models or default_models()
        cluster = req.cluster
        if not has_cluster:
            cluster = (await read_live_cluster(self.store)).cluster if live and self.store else Cluster()
        profiles = req.profiles
        if not profiles:
            gpu_type = cluster_gpu_type(cluster, self.settings.default_gpu_type)
            if live and self.store is not None:
                profiles = await read_profiles(self.store, gpu_type, models,
                                               max_gpus=self.settings.max_gpus_per_instance)
            else:
                profiles = profiles_for(models, get_gpu_type(gpu_type), self.settings.max_gpus_per_instance)
        return SelectionRequest(req.slo, req.workflows, tuple(models), tuple(profiles), cluster, req.options)


# Part of the caller's remaining time kept for sending the answer back (at least DEADLINE_MARGIN_S).
DEADLINE_SHARE = 0.9
DEADLINE_MARGIN_S = 0.05


def with_deadline(req: SelectionRequest, remaining_s: float | None) -> SelectionRequest:
    """Bound the strategy's time budget by the call's deadline (none: unchanged), keeping a margin to
    send the answer; DeadlineExceeded when nothing is left."""
    if remaining_s is None:
        return req
    cap = min(remaining_s * DEADLINE_SHARE, remaining_s - DEADLINE_MARGIN_S)
    if cap <= 0:
        raise DeadlineExceeded("the SelectVariant deadline leaves no time to search",
                               reason="SELECTION_DEADLINE_EXCEEDED")
    budget = req.options.time_budget_s or DEFAULT_TIME_BUDGET_S
    if cap >= budget:
        return req
    return dataclasses.replace(req, options=dataclasses.replace(req.options, time_budget_s=cap))


def add_servicers(server: grpc.aio.Server, settings: SelectorSettings, store: StateStore | None) -> list[str]:
    selector_pb2_grpc.add_SelectorServiceServicer_to_server(SelectorServicer(settings, store), server)
    return [selector_pb2.DESCRIPTOR.services_by_name["SelectorService"].full_name]
