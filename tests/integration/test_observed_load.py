"""Observed load for real: etcd, the deployer's node agent, an emulated engine driven with concurrent completions."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from flowmaker.catalog import get_model
from flowmaker.domain import Profile, ProfileSource, SelectionRequest, Slo, Stage, StageKind, Variant, Workflow
from flowmaker.orchestration.cluster import read_live_cluster
from flowmaker.selection import select
from flowmaker.state import keys
from flowmaker.state.etcd import EtcdStore
from flowmaker.state.records import InstanceRecord, InstanceState, reuse_value
from services.deployer.node import DeployParams, LoadMeter, NodeAgent
from services.deployer.settings import DeployerSettings

pytestmark = pytest.mark.integration

MODEL = "Llama-3.2-1B-Instruct"
TIME_SCALE = 5.0  # model seconds per wall second: the observed rate must come out in MODEL seconds
CAPACITY = 200.0  # max_output_tokens_per_s of the stored profile (model seconds)
# decode 0.02 s/token * 200 tok/s: the engine is compute-bound (emits exactly CAPACITY) from 4 running requests.
PROFILE = Profile(MODEL, 1, 1, memory_gb_per_gpu=4.0, fixed_s=0.0, prefill_s_per_token=0.0, decode_s_per_token=0.02,
                  max_output_tokens_per_s=CAPACITY, gpu_type="A6000", source=ProfileSource.MEASURED)
PLANNED = 20.0  # what the tasks using the instance declared: far below what the traffic below produces


# ---- the meter alone (pure) -------------------------------------------------------------------


def test_meter_rate_is_in_model_seconds_and_smoothed_by_half_life() -> None:
    m = LoadMeter(time_scale=5.0, half_life_s=2.0, peak_window_s=10.0)
    assert m.add(0.0, 0.0) is None and not m.should_report(0.0, 0.1, 5.0)  # one reading: no rate yet
    assert m.add(1.0, 1000.0) == pytest.approx(200.0)  # 1000 tokens in 1 wall s at 5x = 200 per model s
    assert m.should_report(1.0, 0.1, 5.0)
    m.reported = (200.0, 1.0)
    # Traffic stops: after one half-life (two 1 s intervals at rate 0) the EWMA is at half.
    m.add(2.0, 1000.0)
    assert m.add(3.0, 1000.0) == pytest.approx(100.0)
    assert m.peak == pytest.approx(200.0)  # the busy interval is still within the window
    assert m.should_report(3.0, 0.1, 5.0)  # moved by 50 %
    m.reported = (100.0, 3.0)
    assert not m.should_report(4.0, 0.9, 5.0)  # below the dead band and not stale yet...
    assert m.should_report(8.0, 0.9, 5.0)  # ...but a non-zero value is refreshed before readers drop it
    # A missed scrape: one 2 s interval weighs as much as two 1 s ones (alpha from the interval's length).
    a, b = LoadMeter(1.0, 2.0), LoadMeter(1.0, 2.0)
    for x in (a, b):
        x.add(0.0, 0.0)
        x.add(1.0, 100.0)
    a.add(2.0, 100.0)
    a.add(3.0, 100.0)
    b.add(3.0, 100.0)
    assert a.rate == pytest.approx(b.rate)
    # The counter going back (a restarted engine) is not a negative rate.
    before = a.rate
    assert a.add(4.0, 0.0) == before
    assert before == pytest.approx(50.0)
    assert a.add(5.0, 150.0) == pytest.approx(50.0 + (1 - 0.5 ** 0.5) * (150.0 - 50.0))  # from the reset on
    # The peak forgets intervals older than its window.
    p = LoadMeter(1.0, 1.0, peak_window_s=3.0)
    p.add(0.0, 0.0)
    p.add(1.0, 500.0)
    for t in range(2, 7):
        p.add(float(t), 500.0)
    assert p.peak == 0.0
    # An idle instance that reported 0 is not rewritten just to stay fresh.
    z = LoadMeter(1.0, 1.0)
    z.add(0.0, 0.0)
    z.add(1.0, 0.0)
    z.reported = (0.0, 1.0)
    assert not z.should_report(100.0, 0.1, 5.0)


# ---- with etcd, the agent and a real engine ---------------------------------------------------


@dataclass
class Node:
    agent: NodeAgent
    store: EtcdStore


@pytest.fixture
async def node(etcd, etcd_namespace: str, etcd_store: EtcdStore) -> AsyncIterator[Node]:  # type: ignore[no-untyped-def]
    await etcd_store.put(keys.profile("A6000", MODEL, 1, 1, "MEASURED"),
                         {"memory_gb_per_gpu": PROFILE.memory_gb_per_gpu, "fixed_s": PROFILE.fixed_s,
                          "prefill_s_per_token": PROFILE.prefill_s_per_token,
                          "decode_s_per_token": PROFILE.decode_s_per_token,
                          "max_output_tokens_per_s": PROFILE.max_output_tokens_per_s, "source": "MEASURED"})
    settings = DeployerSettings(node="node0", host="127.0.0.1", port=0, etcd_endpoints=etcd.endpoint,
                                etcd_namespace=etcd_namespace, etcd_timeout_s=3.0, use_nvml=False, gpu_type="A6000",
                                gpu_count=2, lease_ttl_s=3, engine_time_scale=TIME_SCALE, engine_stop_grace_s=3.0,
                                engine_start_timeout_s=60.0, load_scrape_interval_s=0.5, load_half_life_s=1.0,
                                load_report_max_interval_s=1.0)
    store = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=3.0)
    agent = NodeAgent(store, settings)
    await agent.start()
    try:
        yield Node(agent, etcd_store)
    finally:
        await agent.shutdown()
        await store.close()


async def _record(store: EtcdStore, iid: str) -> InstanceRecord | None:
    kv = await store.get(keys.instance(iid))
    return None if kv is None else InstanceRecord.from_json(kv.value)


async def _eventually(check: Callable[[], Awaitable[Any]], timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


class Traffic:
    """`clients` closed-loop clients sending completions of `max_tokens` each; counts what came back."""

    def __init__(self, endpoint: str, clients: int = 12, max_tokens: int = 100) -> None:
        self.endpoint, self.clients, self.max_tokens = endpoint, clients, max_tokens
        self.done: list[tuple[float, int]] = []  # (wall monotonic time of completion, output tokens)
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Traffic:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._tasks = [asyncio.create_task(self._client(i * 0.05)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        assert self._http is not None
        await self._http.close()

    async def _client(self, delay_s: float) -> None:
        assert self._http is not None
        await asyncio.sleep(delay_s)  # staggered, so completions do not all land at once
        while True:
            async with self._http.post(self.endpoint + "/v1/completions", json={
                    "model": MODEL, "prompt": "go", "max_tokens": self.max_tokens}) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
            self.done.append((time.monotonic(), int(body["usage"]["completion_tokens"])))

    def rate(self, since: float, until: float) -> float:
        """Output tokens per MODEL second between the first and the last completion within [since, until]
        (wall monotonic): measured from completion to completion, so whole requests are never cut in two."""
        done = sorted((t, n) for t, n in self.done if since <= t <= until)
        assert len(done) >= 2 and done[-1][0] > done[0][0], done
        return sum(n for _, n in done[1:]) / (done[-1][0] - done[0][0]) / TIME_SCALE


def _select(view_cluster: Any) -> Variant:
    """One stage of 10 output tokens at 1 rps = 10 tok/s: fits the instance by plan (20 + 10 <= 200)."""
    wf = Workflow("w", (Stage("answer", StageKind.LLM, (), 10, 10, 1),))
    res = select(SelectionRequest(Slo(0.0, 10.0, 1.0), (wf,), (get_model(MODEL),), (PROFILE,), view_cluster))
    assert res.variant is not None, res.reason_detail
    return res.variant


async def _deploy(n: Node) -> InstanceRecord:
    rec = await n.agent.deploy(DeployParams(MODEL, task_id="task-a", request_id="inst-1"))
    assert rec.state is InstanceState.READY
    # The task's planned load, as a selection commit records it (the reuse key is what readers sum).
    await n.store.put(keys.reuse(rec.id, "task-a"), reuse_value(rec.id, "task-a", PLANNED))
    return rec


async def test_observed_load_matches_generated_tokens_and_changes_the_reuse_decision(node: Node) -> None:
    rec = await _deploy(node)
    idle = await read_live_cluster(node.store)
    assert idle.cluster.instances[0].load_output_tokens_per_s == PLANNED
    assert [iid for iid, _ in _select(idle.cluster).reuse] == [rec.id]  # fits by plan: reused

    async with Traffic(rec.endpoint) as traffic:
        start = time.monotonic()
        await asyncio.sleep(6.0)  # 6 half-lives after the start: the EWMA is within ~2 % of a steady rate
        got = await _record(node.store, rec.id)
        t1 = time.monotonic()
        actual = traffic.rate(start + 1.5, t1)  # after the ramp-up
        live = await read_live_cluster(node.store)
        busy_variant = _select(live.cluster)
    assert got is not None and got.state is InstanceState.READY
    observed = got.observed_load_output_tokens_per_s
    # Units: 12 clients saturate the engine, which then emits CAPACITY tokens per MODEL second
    # (TIME_SCALE x that per wall second). A rate in wall seconds would be ~5x off, a double-scaled one 1/5.
    assert 0.8 * CAPACITY <= actual <= 1.05 * CAPACITY, actual
    assert 0.8 * actual <= observed <= 1.2 * actual, (observed, actual)
    assert got.observed_load_peak_output_tokens_per_s >= 0.9 * observed
    # Rewritten at least every load_report_max_interval_s (1 s) while non-zero, plus one scrape interval.
    assert 0 <= time.time() - got.observed_load_at <= 2.0 + (time.monotonic() - t1)
    assert got.load_output_tokens_per_s == rec.load_output_tokens_per_s  # the planned field is not touched

    # read_live_cluster reports max(planned, observed); the selector no longer reuses the busy instance.
    inst = {i.id: i for i in live.cluster.instances}[rec.id]
    assert inst.load_output_tokens_per_s == pytest.approx(max(PLANNED, live.observed_loads[rec.id]))
    assert inst.load_output_tokens_per_s > 0.8 * CAPACITY
    assert live.planned_loads[rec.id] == PLANNED
    assert busy_variant.reuse == () and len(busy_variant.new_instances) == 1
    # Plan-only (what the product did before): the same cluster looked free enough to reuse.
    plan_only = await read_live_cluster(node.store, observed_max_age_s=0)
    assert [iid for iid, _ in _select(plan_only.cluster).reuse] == [rec.id]

    # Traffic gone: the measurement decays, the plan takes over again, and the instance is reusable.
    async def calm() -> bool:
        r = await _record(node.store, rec.id)
        return r is not None and r.observed_load_output_tokens_per_s < 5.0

    await _eventually(calm, timeout_s=20.0)
    after = await read_live_cluster(node.store)
    assert after.cluster.instances[0].load_output_tokens_per_s == PLANNED
    assert [iid for iid, _ in _select(after.cluster).reuse] == [rec.id]


async def test_failed_scrapes_keep_the_last_value_and_never_clobber_state(node: Node) -> None:
    rec = await _deploy(node)
    assert rec.engine_pid
    async with Traffic(rec.endpoint, clients=6):
        async def measured() -> InstanceRecord | None:
            r = await _record(node.store, rec.id)
            return r if r is not None and r.observed_load_output_tokens_per_s > 50 else None

        before: InstanceRecord = await _eventually(measured)
        # A frozen engine: /metrics times out, but the process has not exited.
        os.killpg(rec.engine_pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(2.5)  # 5 scrape intervals, every one failing
            frozen = await _record(node.store, rec.id)
            assert frozen is not None and frozen.state is InstanceState.READY  # not FAILED by the scraper
            last = frozen.observed_load_output_tokens_per_s
            assert last > 50 and frozen.observed_load_at >= before.observed_load_at
            await asyncio.sleep(1.5)
            still = await _record(node.store, rec.id)
            assert still is not None and (still.observed_load_output_tokens_per_s, still.observed_load_at) == (
                last, frozen.observed_load_at)  # nothing written while the scrapes fail
            # Readers let it age out: with a 1 s max age it no longer counts, the plan does.
            stale = await read_live_cluster(node.store, observed_max_age_s=1.0)
            assert stale.cluster.instances[0].load_output_tokens_per_s == PLANNED
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rec.engine_pid, signal.SIGCONT)

        # A concurrent state change (here: someone marks it DRAINING) is never undone by a load report.
        kv = await node.store.get(keys.instance(rec.id))
        assert kv is not None
        draining = InstanceRecord.from_json({**kv.value, "state": "DRAINING"})
        await node.store.cas(kv.key, draining.to_json(), etag=kv.mod_revision)
        await asyncio.sleep(2.0)  # 4 intervals of an engine busy again
        after = await _record(node.store, rec.id)
        assert after is not None and after.state is InstanceState.DRAINING
        assert after.observed_load_at == draining.observed_load_at


async def test_a_saturated_instance_is_not_reused_whatever_its_throughput_says(node: Node) -> None:
    """Overload shows as latency and queueing, never as throughput above capacity. With a profile that
    overstates capacity 10x (as an analytic estimate may), throughput alone leaves ample headroom; the
    measured saturation (requests taking several times a lone request's latency) takes the instance out
    of reuse, and it comes back once the overload is gone."""
    rec = await _deploy(node)
    optimistic = Profile(MODEL, 1, 1, memory_gb_per_gpu=4.0, fixed_s=0.0, prefill_s_per_token=0.0,
                         decode_s_per_token=0.02, max_output_tokens_per_s=10 * CAPACITY, gpu_type="A6000",
                         source=ProfileSource.MEASURED)

    def select_with(cluster: Any) -> Variant:
        wf = Workflow("w", (Stage("answer", StageKind.LLM, (), 10, 10, 1),))
        res = select(SelectionRequest(Slo(0.0, 60.0, 1.0), (wf,), (get_model(MODEL),), (optimistic,), cluster))
        assert res.variant is not None, res.reason_detail
        return res.variant

    async def saturated() -> InstanceRecord | None:
        r = await _record(node.store, rec.id)
        return r if r is not None and r.saturated else None

    async with Traffic(rec.endpoint, clients=48, max_tokens=100):
        got = await _eventually(saturated, timeout_s=20.0)
        live = await read_live_cluster(node.store)
        busy = select_with(live.cluster)
    assert got.observed_slowdown >= 4.0 or got.observed_queue >= 4.0, got
    assert got.observed_load_output_tokens_per_s < 10 * CAPACITY  # by throughput there is room left...
    assert busy.reuse == () and len(busy.new_instances) == 1  # ...but a full instance is offered to no one
    # Throughput only (the saturation flag ignored) would have reused it.
    import dataclasses

    unflagged = dataclasses.replace(live, instances={i: dataclasses.replace(r, saturated=False)
                                                     for i, r in live.instances.items()})
    from flowmaker.orchestration.cluster import with_loads
    assert [iid for iid, _ in select_with(with_loads(unflagged, live.planned_loads).cluster).reuse] == [rec.id]

    async def recovered() -> bool:
        r = await _record(node.store, rec.id)
        return r is not None and not r.saturated

    await _eventually(recovered, timeout_s=30.0)
    assert [iid for iid, _ in select_with((await read_live_cluster(node.store)).cluster).reuse] == [rec.id]
