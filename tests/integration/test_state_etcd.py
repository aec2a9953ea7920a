"""StateStore against a real etcd (and the in-memory store against the same expectations)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from flowmaker.errors import AlreadyExists, Conflict, InvalidSpec, NotFound, Unavailable
from flowmaker.state import keys
from flowmaker.state.etcd import EtcdStore
from flowmaker.state.memory import MemoryStore
from flowmaker.state.records import GpuRecord, InstanceRecord, InstanceState, NodeRecord, read_cluster
from flowmaker.state.store import Compare, EventKind, LeaseKeeper, Put, StateStore, commit

pytestmark = pytest.mark.integration


@pytest.fixture(params=["etcd", "memory"])
async def store(request: pytest.FixtureRequest, etcd_namespace: str) -> AsyncIterator[StateStore]:
    """The same expectations hold for etcd and for the in-memory store used by unit tests."""
    if request.param == "memory":
        yield MemoryStore()
        return
    etcd = request.getfixturevalue("etcd")
    s = EtcdStore(etcd.endpoint, namespace=etcd_namespace, timeout_s=2.0)
    yield s
    await s.delete_prefix("/")
    await s.close()


async def test_put_get_and_etag(store: StateStore) -> None:
    k = keys.instance("i-1")
    assert await store.get(k) is None
    rev1 = await store.put(k, {"id": "i-1", "tp": 2})
    kv = await store.get(k)
    assert kv is not None and kv.value == {"id": "i-1", "tp": 2}
    assert kv.key == k and kv.etag == rev1 == kv.create_revision
    rev2 = await store.put(k, {"id": "i-1", "tp": 4})
    kv2 = await store.get(k)
    assert kv2 is not None and rev2 > rev1 and kv2.mod_revision == rev2 and kv2.create_revision == rev1


async def test_get_prefix_sorted_with_revision_and_no_sibling_leak(store: StateStore) -> None:
    await store.put(keys.gpu("n1", "g1"), {"v": 1})
    await store.put(keys.gpu("n1", "g0"), {"v": 0})
    last = await store.put(keys.gpu("n10", "g0"), {"v": 10})
    listing = await store.get_prefix(keys.gpus_of_node("n1"))
    assert [kv.key for kv in listing.items] == [keys.gpu("n1", "g0"), keys.gpu("n1", "g1")]
    assert listing.revision >= last


async def test_prefix_state_counts_and_the_newest_revision_without_siblings(store: StateStore) -> None:
    pre = keys.gpus_of_node("n1")
    empty = await store.prefix_state(pre)
    assert (empty.count, empty.max_mod_revision) == (0, 0) and empty.revision >= 1
    await store.put(keys.gpu("n1", "g0"), {"v": 0})
    newest = await store.put(keys.gpu("n1", "g1"), {"v": 1})
    await store.put(keys.gpu("n1", "g0"), {"v": 2})  # rewritten: now the newest
    g0 = await store.get(keys.gpu("n1", "g0"))
    assert g0 is not None and g0.mod_revision > newest
    await store.put(keys.gpu("n10", "g0"), {"v": 10})  # a sibling prefix: neither counted nor newest
    st = await store.prefix_state(pre)
    assert (st.count, st.max_mod_revision) == (2, g0.mod_revision)
    assert st.revision == (await store.get_prefix(pre)).revision
    await store.delete(keys.gpu("n1", "g0"))
    st = await store.prefix_state(pre)
    assert (st.count, st.max_mod_revision) == (1, newest)


async def test_create_conflicts_when_present(store: StateStore) -> None:
    k = keys.task("t1")
    await store.create(k, {"state": "NEW"})
    with pytest.raises(AlreadyExists):
        await store.create(k, {"state": "OTHER"})
    kv = await store.get(k)
    assert kv is not None and kv.value == {"state": "NEW"}


async def test_cas_on_mod_revision(store: StateStore) -> None:
    k = keys.gpu("n1", "g0")
    etag = await store.put(k, {"memory_used_gb": 0})
    new = await store.cas(k, {"memory_used_gb": 10}, etag=etag)
    with pytest.raises(Conflict) as ei:  # the stale etag loses
        await store.cas(k, {"memory_used_gb": 20}, etag=etag)
    assert ei.value.reason == "CONFLICT"
    kv = await store.get(k)
    assert kv is not None and kv.value == {"memory_used_gb": 10} and kv.etag == new
    with pytest.raises(Conflict):
        await store.delete(k, etag=etag)
    assert await store.delete(k, etag=new) is True
    with pytest.raises(NotFound):
        await store.cas(k, {"memory_used_gb": 1}, etag=new)


async def test_multi_key_txn_rechecks_every_key_read(store: StateStore) -> None:
    g0, g1, inst = keys.gpu("n1", "g0"), keys.gpu("n1", "g1"), keys.instance("new")
    await store.put(g0, {"used": 0})
    await store.put(g1, {"used": 0})
    view = (await store.get_prefix(keys.GPUS)).by_key()
    # A concurrent writer moves g1 after our read.
    await store.put(g1, {"used": 40})
    compares = [Compare.unchanged(g0, view[g0].etag), Compare.unchanged(g1, view[g1].etag), Compare.absent(inst)]
    puts = [Put(g0, {"used": 20}), Put(g1, {"used": 20}), Put(inst, {"gpus": ["g0", "g1"]})]
    res = await store.txn(compares, puts)
    assert not res.succeeded and res.failed == (g1,)
    # Nothing of the failed txn was applied.
    assert (await store.get(g0)).value == {"used": 0}  # type: ignore[union-attr]
    assert await store.get(inst) is None
    with pytest.raises(Conflict) as ei:
        await commit(store, compares, puts, what="selection")
    assert g1 in ei.value.metadata["keys"]
    # Re-read and commit: succeeds atomically, deleting in the same txn.
    view = (await store.get_prefix(keys.GPUS)).by_key()
    await store.put(keys.task("old"), {})
    rev = await commit(store, [Compare.unchanged(k, v.etag) for k, v in view.items()] + [Compare.absent(inst)],
                       puts, deletes=[keys.task("old")])
    assert (await store.get(inst)).mod_revision == rev  # type: ignore[union-attr]
    assert (await store.get(g1)).value == {"used": 20}  # type: ignore[union-attr]
    assert await store.get(keys.task("old")) is None
    # etcd refuses a txn touching one key twice; both stores say so before sending.
    with pytest.raises(InvalidSpec):
        await store.txn([], [Put(g0, 1)], deletes=[g0])
    # not_modified_since: holds for an untouched key, fails once it moves.
    assert (await store.txn([Compare.not_modified_since(g0, rev)])).succeeded
    await store.put(g0, {"used": 1})
    assert not (await store.txn([Compare.not_modified_since(g0, rev)])).succeeded


async def test_prefix_watch_from_listing_revision(store: StateStore) -> None:
    await store.put(keys.instance("a"), {"n": 1})
    listing = await store.get_prefix(keys.INSTANCES)
    # Written between the listing and the watch: must still be delivered (watch from revision+1).
    await store.put(keys.instance("b"), {"n": 2})
    await store.put(keys.task("unrelated"), {"n": 0})
    events = []

    async def consume() -> None:
        async for ev in store.watch_prefix(keys.INSTANCES, start_revision=listing.revision + 1):
            events.append(ev)
            if len(events) == 3:
                return

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    await store.put(keys.instance("a"), {"n": 3})
    await store.delete(keys.instance("b"))
    await asyncio.wait_for(task, 5)
    assert [(e.kind, e.key, e.value) for e in events] == [
        (EventKind.PUT, keys.instance("b"), {"n": 2}),
        (EventKind.PUT, keys.instance("a"), {"n": 3}),
        (EventKind.DELETE, keys.instance("b"), None),
    ]


async def test_lease_revoke_removes_bound_keys(store: StateStore) -> None:
    lid = await store.grant_lease(30)
    await store.put(keys.node("n1"), {"node": "n1"}, lease=lid)
    await store.put(keys.gpu("n1", "g0"), {"id": "g0"})
    assert (await store.get(keys.node("n1"))).lease == lid  # type: ignore[union-attr]
    assert await store.refresh_lease(lid) > 0
    await store.revoke_lease(lid)
    assert await store.get(keys.node("n1")) is None
    assert await store.get(keys.gpu("n1", "g0")) is not None  # not bound: stays
    assert await store.refresh_lease(lid) <= 0


async def test_lease_expiry_removes_keys_and_keeper_keeps_alive(etcd_store: EtcdStore) -> None:
    store = etcd_store
    kept = LeaseKeeper(store, ttl_s=2)
    await kept.start()
    lost = await store.grant_lease(2)  # nobody refreshes this one
    await store.put(keys.node("kept"), {"node": "kept"}, lease=kept.id)
    await store.put(keys.node("lost"), {"node": "lost"}, lease=lost)
    t0 = time.monotonic()
    while await store.get(keys.node("lost")) is not None:
        assert time.monotonic() - t0 < 8, "unrefreshed lease did not expire"
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)  # well past the 2 s TTL: the keeper's key must still be there
    assert await store.get(keys.node("kept")) is not None
    assert not kept.lost.is_set()
    await kept.stop(revoke=True)
    assert await store.get(keys.node("kept")) is None


async def test_keeper_reports_lost_lease(store: StateStore) -> None:
    called = asyncio.Event()

    async def on_lost() -> None:
        called.set()

    keeper = LeaseKeeper(store, ttl_s=2, on_lost=on_lost)
    await keeper.start()
    await store.revoke_lease(keeper.id)  # as if it expired during an outage
    await asyncio.wait_for(called.wait(), 5)
    assert keeper.lost.is_set()
    await keeper.stop()


async def test_unavailable_while_paused(etcd, etcd_store: EtcdStore) -> None:  # type: ignore[no-untyped-def]
    store = etcd_store
    await store.put(keys.node("x"), {"ok": True})
    etcd.pause()
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as ei:
        await store.get(keys.node("x"))
    assert time.monotonic() - t0 < 5  # bounded by the client deadline (2 s here), not hanging
    assert ei.value.reason == "ETCD_UNAVAILABLE"
    with pytest.raises(Unavailable):
        await store.txn([Compare.absent(keys.node("y"))], [Put(keys.node("y"), {})])
    etcd.resume()
    kv = await store.get(keys.node("x"))
    assert kv is not None and kv.value == {"ok": True}


async def test_unavailable_when_nothing_listens(unused_tcp_port: int) -> None:
    store = EtcdStore(f"127.0.0.1:{unused_tcp_port}", timeout_s=1.0)
    with pytest.raises(Unavailable):
        await store.put("/x", 1)
    await store.close()


async def test_read_cluster_only_alive_nodes(store: StateStore) -> None:
    lid = await store.grant_lease(30)
    await store.put(keys.node("alive"), NodeRecord("alive", "A6000", 1).to_json(), lease=lid)
    await store.put(keys.gpu("alive", "alive:0"), GpuRecord("alive:0", "alive", "A6000", 48.0, 16.0).to_json())
    await store.put(keys.gpu("dead", "dead:0"), GpuRecord("dead:0", "dead", "A6000", 48.0).to_json())
    ok = InstanceRecord("i1", "m", 1, 1, "alive", ("alive:0",), 16.0, InstanceState.READY, "http://x")
    failed = InstanceRecord("i2", "m", 1, 1, "alive", ("alive:0",), 16.0, InstanceState.FAILED)
    await store.put(keys.instance("i1"), ok.to_json())
    await store.put(keys.instance("i2"), failed.to_json())
    view = await read_cluster(store)
    assert [g.id for g in view.cluster.gpus] == ["alive:0"]
    assert [i.id for i in view.cluster.instances] == ["i1"]
    assert view.cluster.gpus[0].memory_free_gb == 32.0
    assert set(view.etags) == {keys.gpu("alive", "alive:0"), keys.instance("i1")}
    view.cluster.validate()
    assert InstanceRecord.from_json(ok.to_json()) == ok


def test_keys_escape_and_parse() -> None:
    k = keys.profile("A6000", "meta-llama/Llama-3.1-8B", 2, 1, "MEASURED")
    assert k == "/flowmaker/v1/profiles/A6000/meta-llama%2FLlama-3.1-8B/2x1/MEASURED"
    assert keys.parse_profile(k) == ("A6000", "meta-llama/Llama-3.1-8B", 2, 1, "MEASURED")
    assert keys.parse_gpu(keys.gpu("n/1", "g 0")) == ("n/1", "g 0")
    assert keys.parse_reuse(keys.reuse("i", "t")) == ("i", "t")
    with pytest.raises(InvalidSpec) as ei:
        keys.instance("")
    assert ei.value.field == "instance_id"


def test_profiler_keys_and_instance_record_compat() -> None:
    from urllib.parse import quote

    from flowmaker.state.records import new_instance_id, reuse_load, reuse_value

    # The profiler's keys, built here (they used to be concatenated in services/profiler): same strings.
    assert keys.profiles_of_model("A6000", "meta-llama/x") == keys.PROFILES + "A6000/meta-llama%2Fx/"
    assert keys.profile("A6000", "meta-llama/x", 2, 1, "ANALYTIC").startswith(keys.profiles_of_model("A6000",
                                                                                                      "meta-llama/x"))
    assert keys.model("a/b") == keys.MODELS + quote("a/b", safe="")
    assert keys.profiling_job("j 1") == keys.PROFILING_JOBS + "j%201"
    # Records written before engine_pid existed still parse (defaults), and the new fields round-trip.
    old = {"id": "i", "model_id": "m", "tp": 1, "pp": 1, "node": "n", "gpu_ids": ["g"], "memory_gb_per_gpu": 1.0,
           "state": "READY"}
    assert InstanceRecord.from_json(old).engine_pid == 0
    rec = InstanceRecord("i", "m", 1, 1, "n", ("g",), 1.0, engine_pid=42, engine_identity="boot/123")
    assert InstanceRecord.from_json(rec.to_json()) == rec
    # One form of the reuse record for the deployer and the orchestrator's commit.
    assert reuse_load(reuse_value("i", "t", 2.5)) == 2.5
    assert reuse_load({"load_output_tokens_per_s": "junk"}) == 0.0 and reuse_load(None) == 0.0
    a, b = new_instance_id("meta-llama/Llama-3.2-1B-Instruct"), new_instance_id("meta-llama/Llama-3.2-1B-Instruct")
    assert a != b and a.startswith("meta-llama-llama-3-2-1b-instruct-") and new_instance_id("///").startswith("instance-")
