"""One orchestrator replica, wired: the roles built over one store, and who acts.

Every replica serves every RPC: the router (`router`) answers Invoke from the watch-fed cache (`cache`), the
lifecycle commands (`lifecycle`) answer the rest. One replica at a time, elected through an etcd lease
(`flowmaker.state.election`), acts: it runs the reconciler (`reconciler`), which carries out the lifecycle
workers, the healing actions (`healing`) and the load follower (`follower`). A replica that loses the election
stops acting at once; the next leader's first reconciler pass resumes whatever was left half done. Everything
lives in etcd (task records under `keys.task`, plus the deployer's GPU, instance and reuse keys), so nothing is
handed over between leaders.

Nothing imports this module but the service's entry point, the servicer and tests: the roles know each other
only through what they are given here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from flowmaker import metrics
from flowmaker.api.common.v1 import selection_pb2
from flowmaker.api.selector.v1 import selector_pb2
from flowmaker.cancel import wait_for
from flowmaker.domain import Cluster, Slo, Workflow
from flowmaker.orchestration.adapt import ArrivalMeter, LoadPolicy, TaskLoad
from flowmaker.orchestration.commit import CommitPlan
from flowmaker.orchestration.dag import Execution
from flowmaker.orchestration.reconcile import Policy
from flowmaker.orchestration.task import TaskRecord
from flowmaker.state import keys
from flowmaker.state.election import Election
from flowmaker.state.store import KeyValue, StateStore
from services.orchestrator.cache import RoutingCache
from services.orchestrator.clients import Clients
from services.orchestrator.deployments import Deployers
from services.orchestrator.engines import EngineClient
from services.orchestrator.follower import LoadFollower
from services.orchestrator.healing import Healer
from services.orchestrator.lifecycle import Lifecycle
from services.orchestrator.predictions import Predictions
from services.orchestrator.reconciler import Reconciler
from services.orchestrator.records import TaskView
from services.orchestrator.replicas import ReplicaBoard
from services.orchestrator.router import OnEvent, Router
from services.orchestrator.selecting import Selections
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.users import TokenPruner, Users
from services.orchestrator.workers import Workers

log = logging.getLogger(__name__)

__all__ = ["OnEvent", "Orchestrator", "TaskView"]


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, store: StateStore, clients: Clients,
                 engines: EngineClient | None = None) -> None:
        s = self._settings = settings
        self._address = ""
        self._since = time.time()
        self.store = store
        self.clients = clients
        self.engines = engines or EngineClient(s.http_pool_size)
        self.replica_id = s.replica_id or f"{socket.gethostname()}-{os.getpid()}-{id(self) % 10000:04d}"
        self.arrivals = ArrivalMeter(s.load_window_s)
        self.cache = RoutingCache(store, resync_s=s.cache_resync_s)
        self.workers = Workers(on_done=self.cache.kick)
        self.router = Router(s, store, self.cache, self.engines, self.arrivals, answers=self._answers)
        self.deployers = Deployers(s, store, clients)
        self.selections = Selections(s, store, clients, self.router.contexts)
        # With replicas, each meters its share of the requests: the board adds them up for the load follower.
        self.board: ReplicaBoard | None = None
        if s.leader_election:
            self.board = ReplicaBoard(store, self.replica_id, self.arrivals, self.router.inflight,
                                      time_scale=s.tool_time_scale,
                                      interval_s=max(1.0, s.observe_flush_interval_s), ttl_s=s.leader_lease_ttl_s,
                                      identity=self._identity)
        self.lifecycle = Lifecycle(s, store, clients, workers=self.workers, deployers=self.deployers,
                                   selections=self.selections, cache=self.cache, arrivals=self.arrivals,
                                   is_leader=self.is_leader, loads=self.board.load if self.board else None)
        self.healer = Healer(s, store, clients, workers=self.workers, deployers=self.deployers,
                             lifecycle=self.lifecycle)
        self.follower = LoadFollower(s, store, deployers=self.deployers, selections=self.selections,
                                     cache=self.cache, inflight=self._inflight)
        self.reconciler = Reconciler(self.cache, Policy(
            restart_backoff_s=s.reconcile_restart_backoff_s, max_restarts=s.reconcile_max_restarts,
            restart_window_s=s.reconcile_restart_window_s, node_lost_grace_s=s.reconcile_node_lost_grace_s,
            orphan_grace_s=s.reconcile_orphan_grace_s, deploying_deadline_s=s.reconcile_deploying_deadline_s),
            workers=self.workers, lifecycle=self.lifecycle, healer=self.healer, follower=self.follower,
            engines=self.engines, interval_s=s.reconcile_interval_s, heal=s.reconcile_heal,
            load_policy=LoadPolicy(band=s.load_band, hold_down_s=s.load_hold_down_s) if s.follow_load else None,
            predictions=Predictions(store, self.selections))
        self.users = Users(store, self.cache)
        self.pruner = TokenPruner(self.users, interval_s=s.token_prune_interval_s, grace_s=s.token_prune_grace_s)
        self.election: Election | None = None
        if s.leader_election:
            self.election = Election(store, keys.ORCHESTRATOR_LEADER, self._identity(), ttl_s=s.leader_lease_ttl_s,
                                     on_elected=self._elected, on_deposed=self._deposed)
        self._started = False

    # ---- settings (one object, shared by every role) --------------------------------------------

    @property
    def settings(self) -> OrchestratorSettings:
        return self._settings

    @settings.setter
    def settings(self, value: OrchestratorSettings) -> None:
        self._settings = value
        for role in (self.router, self.deployers, self.selections, self.lifecycle, self.healer, self.follower):
            role.settings = value

    # ---- leadership ----------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        s = self._settings
        host = socket.gethostname() if s.host in ("0.0.0.0", "::", "") else s.host  # (a pod's name)
        return {"replica": self.replica_id, "address": self._address or s.advertise_address or f"{host}:{s.port}",
                "pid": os.getpid(), "since": self._since}

    def set_address(self, address: str) -> None:
        """The address this replica listens on, once known (port 0 in tests): shown as the leader's address."""
        if not self._settings.advertise_address and not address.startswith(("0.0.0.0:", "[::]:")):
            self._address = address
            if self.election is not None:
                self.election.value["address"] = address

    def is_leader(self) -> bool:
        return self.election is None or self.election.is_leader

    def leader(self) -> dict[str, Any] | None:
        """The current leader as this replica last saw it (its replica id and address); None when unknown."""
        if self.election is None:
            return self._identity()
        v = self.election.leader
        return v if isinstance(v, dict) else None

    async def _elected(self) -> None:
        metrics.set_leader("orchestrator", True)
        self.reconciler.start()
        self.pruner.start()

    async def _deposed(self) -> None:
        # Stop acting at once: the new leader's first pass resumes what our workers leave half done (every step
        # is idempotent and guarded by compare-and-set, so a worker overlapping the new leader's is harmless).
        metrics.set_leader("orchestrator", False)
        await self.reconciler.stop()
        await self.pruner.stop()
        await self.workers.cancel_all()

    def _inflight(self, iid: str) -> int:
        return self.router.inflight.get(iid, 0) + (self.board.inflight_elsewhere(iid) if self.board else 0)

    def _answers(self, iid: str) -> bool:
        return self.reconciler.answers(iid)

    # ---- start / stop --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the cache, the request accounting and, when elected (or with no election), the reconciler,
        whose first pass resumes what a previous leader left half done."""
        if self._started:
            return
        self._started = True
        self.cache.start()
        self.router.start()
        if self.board is not None:
            self.board.start()
        if self.election is None:
            self.reconciler.start()
            self.pruner.start()
        else:
            metrics.set_leader("orchestrator", False)
            self.election.start()

    async def resume(self) -> None:
        """Start, and wait (when etcd answers) for the cache's first listing and the election's first round."""
        await self.start()
        wait: list[Awaitable[Any]] = [self.cache.synced.wait()]
        if self.election is not None:
            wait.append(self.election.decided.wait())
        if self.board is not None:
            wait.append(self.board.published.wait())  # this replica's record, before it serves
        with contextlib.suppress(TimeoutError):
            await wait_for(asyncio.gather(*wait), self._settings.reconcile_interval_s + 5.0)

    async def close(self) -> None:
        if self.election is not None:
            await self.election.stop()  # the next replica takes over at once
        await self.reconciler.stop()
        await self.pruner.stop()
        if self.board is not None:
            await self.board.stop()
        await self.router.close()
        await self.workers.cancel_all()
        await self.cache.stop()
        await self.engines.close()

    # ---- the API as before the split (the servicer, benchmarks and tests call these) --------------

    async def invoke(self, task_id: str, text: str, *, max_output_tokens: int = 0,
                     on_event: OnEvent | None = None) -> Execution:
        return await self.router.invoke(task_id, text, max_output_tokens=max_output_tokens, on_event=on_event)

    async def deploy_task(self, description: str, slo: Slo | None, *, name: str = "", max_workflows: int = 0,
                          workflows: Sequence[Workflow] = ()) -> TaskView:
        return await self.lifecycle.deploy_task(description, slo, name=name, max_workflows=max_workflows,
                                                workflows=workflows)

    async def approve(self, task_id: str, workflow_ids: Sequence[str], *, strategy: str = "",
                      options: selection_pb2.SelectionOptions | None = None, etag: str = "") -> TaskView:
        return await self.lifecycle.approve(task_id, workflow_ids, strategy=strategy, options=options, etag=etag)

    async def delete(self, task_id: str) -> tuple[TaskRecord, list[str]]:
        return await self.lifecycle.delete(task_id)

    async def view(self, task_id: str) -> TaskView:
        return await self.lifecycle.view(task_id)

    async def list_tasks(self, state: Any = None) -> list[TaskView]:
        return await self.lifecycle.list_tasks(state)

    def observed_load(self, task_id: str, now: float) -> TaskLoad | None:
        return self.lifecycle.observed_load(task_id, now)

    def busy_tasks(self) -> set[str]:
        return self.workers.busy_tasks()

    async def _get(self, task_id: str) -> tuple[KeyValue, TaskRecord]:
        return await self.lifecycle.tasks.get(task_id)

    async def _select_and_commit(self, task_id: str) -> CommitPlan | None:
        return await self.lifecycle.select_and_commit(task_id)

    async def _selection_request(self, t: TaskRecord, cluster: Cluster, *, rate_rps: float | None = None,
                                 max_replicas: int = 0) -> selector_pb2.SelectVariantRequest:
        return await self.selections.request(t, cluster, rate_rps=rate_rps, max_replicas=max_replicas)
