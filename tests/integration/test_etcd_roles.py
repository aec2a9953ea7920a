"""etcd's own authentication against a REAL etcd (flowmaker.state.etcd_auth): one user and role per service.

An etcd of its own (auth changes the whole server, so never the session etcd), provisioned the way `flowmaker up`,
compose and Kubernetes do, with a short --auth-token-ttl so that expired tokens are part of every test. Probes:
a stolen service credential cannot read instance records / engine keys or rewrite owners, tasks or users; each
service's own operations still work; etcd enforces exactly the roles' data; provisioning is idempotent.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from flowmaker.errors import PermissionDenied, Unauthenticated, Unavailable
from flowmaker.state import keys
from flowmaker.state.etcd import EtcdCredentials, EtcdStore
from flowmaker.state.etcd_auth import (
    ROLES,
    ROOT_USER,
    allowed,
    ensure_secrets,
    password_file,
    provision,
    provision_from_dir,
    read_secret,
)
from flowmaker.state.records import (
    GpuRecord,
    InstanceRecord,
    InstanceState,
    NodeRecord,
    configure_engine_key_sealing,
    read_cluster,
)
from flowmaker.state.store import Compare, EventKind, Put
from tests.conftest import EtcdServer, start_etcd

pytestmark = pytest.mark.integration

NS = "/roles"  # provisioned for this namespace, as a stack with FLOWMAKER_<SVC>_ETCD_NAMESPACE would be
TOKEN_TTL_S = 2  # etcd's --auth-token-ttl: idle tokens expire within a test, so re-login is always exercised
ENGINE_KEY = "sk-engine-0123456789abcdef"


def _start_auth_etcd(base: Path) -> EtcdServer:
    return start_etcd(base, ("--auth-token-ttl", str(TOKEN_TTL_S), "--bcrypt-cost", "4"))


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, Path]]:
    """An etcd with auth provisioned for namespace NS; the password files in a 0700 dir."""
    base = tmp_path_factory.mktemp("etcd-roles")
    server = _start_auth_etcd(base)
    secrets_dir = base / "etcd-auth"
    try:
        report = asyncio.run(provision_from_dir(server.endpoint, secrets_dir, namespace=NS))
        assert "auth enable" in report.changes and not report.auth_was_enabled
        yield server, secrets_dir
    finally:
        server.stop()


@pytest.fixture
def sealing(tmp_path: Path) -> Iterator[None]:
    """This process seals engine keys as the deployer and the orchestrator do (reset afterwards)."""
    secret = tmp_path / "engine-keys.secret"
    secret.write_text("a-test-sealing-secret\n")
    configure_engine_key_sealing(str(secret))
    yield
    configure_engine_key_sealing(None)


def _creds(secrets_dir: Path, user: str) -> EtcdCredentials:
    return EtcdCredentials.from_file(user, str(password_file(secrets_dir, user)))


@pytest.fixture
async def stores(auth_etcd: tuple[EtcdServer, Path]) -> AsyncIterator[dict[str, EtcdStore]]:
    """One store per etcd user (root included) and one with no credentials at all."""
    server, secrets_dir = auth_etcd
    out = {u: EtcdStore(server.endpoint, namespace=NS, timeout_s=3.0, auth=_creds(secrets_dir, u))
           for u in (ROOT_USER, *ROLES)}
    out["anonymous"] = EtcdStore(server.endpoint, namespace=NS, timeout_s=3.0)
    yield out
    for s in out.values():
        await s.close()


def _instance(iid: str, api_key: str = ENGINE_KEY) -> InstanceRecord:
    return InstanceRecord(iid, "Llama-3.2-1B-Instruct", 1, 1, "node-a", ("g0",), 4.0, state=InstanceState.READY,
                          endpoint="http://127.0.0.1:1", api_key=api_key)


async def _seed(root: EtcdStore, tag: str) -> dict[str, str]:
    """What an attacker would want: an instance with its engine key, a task, its owner, a user and a token."""
    k = {"instance": keys.instance(f"i-{tag}"), "task": keys.task(f"t-{tag}"), "owner": keys.owner(f"t-{tag}"),
         "user": keys.user(f"u-{tag}"), "token": keys.token(f"d-{tag}")}
    await root.put(k["instance"], _instance(f"i-{tag}").to_json())
    await root.put(k["task"], {"id": f"t-{tag}", "state": "ACTIVE"})
    await root.put(k["owner"], {"user": "u-alice"})
    await root.put(k["user"], {"id": f"u-{tag}", "name": "alice", "admin": False})
    await root.put(k["token"], {"user_id": f"u-{tag}"})
    return k


# ---- stolen credentials ----------------------------------------------------------------------------

@pytest.mark.parametrize("thief", ["profiler", "selector", "deployer"])
async def test_stolen_service_credential_cannot_rewrite_owners_tasks_or_users(
        stores: dict[str, EtcdStore], thief: str) -> None:
    k = await _seed(stores[ROOT_USER], f"w-{thief}")
    s = stores[thief]
    for what in ("owner", "task", "user", "token"):
        with pytest.raises(PermissionDenied):
            await s.put(k[what], {"user": "mallory"})
        with pytest.raises(PermissionDenied):
            await s.delete(k[what])
    # ...nor in a transaction (the way a commit would try), nor by deleting a whole prefix
    with pytest.raises(PermissionDenied):
        await s.txn([Compare.present(k["owner"])], [Put(k["owner"], {"user": "mallory"})])
    with pytest.raises(PermissionDenied):
        await s.delete_prefix(keys.OWNERS)
    owner = await stores[ROOT_USER].get(k["owner"])
    assert owner is not None and owner.value == {"user": "u-alice"}


@pytest.mark.parametrize("thief", ["profiler", "gateway", "generator", "anonymous"])
async def test_stolen_credential_cannot_read_instances_or_engine_keys(
        stores: dict[str, EtcdStore], auth_etcd: tuple[EtcdServer, Path], thief: str) -> None:
    k = await _seed(stores[ROOT_USER], f"r-{thief}")
    if thief in ("gateway", "generator"):
        # They have no etcd user at all: whatever password they come with, etcd refuses to log them in.
        s = EtcdStore(auth_etcd[0].endpoint, namespace=NS, timeout_s=3.0, auth=EtcdCredentials(thief, "guess"))
    else:
        s = stores[thief]
    try:
        denied = Unauthenticated if thief != "profiler" else PermissionDenied
        with pytest.raises(denied):
            await s.get(k["instance"])
        with pytest.raises(denied):
            await s.get_prefix(keys.INSTANCES)
        with pytest.raises(denied):
            await s.get(k["owner"])
        with pytest.raises(denied):
            await s.get_prefix(keys.TOKENS)
        with pytest.raises(denied):
            await s.get_prefix("/")  # the whole key space
        with pytest.raises(denied):
            await s.put(k["owner"], {"user": "mallory"})
        if thief == "profiler":  # a watch would leak them as they change: refused as well
            with pytest.raises(PermissionDenied):
                async for _ in s.watch_prefix(keys.INSTANCES):
                    break
    finally:
        if thief in ("gateway", "generator"):
            await s.close()


async def test_engine_keys_are_sealed_for_every_reader_but_deployer_and_orchestrator(
        stores: dict[str, EtcdStore], tmp_path: Path) -> None:
    secret = tmp_path / "engine-keys.secret"
    secret.write_text("the-deployers-and-orchestrators-secret\n")
    configure_engine_key_sealing(str(secret))  # this process writes as the deployer does
    try:
        await stores["deployer"].put(keys.instance("i-sealed"), _instance("i-sealed").to_json())
        # The orchestrator (same secret) gets the key back to call the engine with.
        kv = await stores["orchestrator"].get(keys.instance("i-sealed"))
        assert kv is not None and InstanceRecord.from_json(kv.value).api_key == ENGINE_KEY
    finally:
        configure_engine_key_sealing(None)
    # The selector may read instance records (reuse needs them), but sees no key in them, not even raw.
    kv = await stores["selector"].get(keys.instance("i-sealed"))
    assert kv is not None
    raw = json.dumps(kv.value)
    assert ENGINE_KEY not in raw and kv.value["api_key"] == "" and kv.value["api_key_sealed"].startswith("v1:")
    assert InstanceRecord.from_json(kv.value).api_key == ""
    # A record the selector (no secret) rewrote keeps the sealed key for the others.
    assert InstanceRecord.from_json(kv.value).to_json()["api_key_sealed"] == kv.value["api_key_sealed"]
    # Another secret (another stack) cannot open it.
    other = tmp_path / "other.secret"
    other.write_text("another-secret\n")
    configure_engine_key_sealing(str(other))
    try:
        assert InstanceRecord.from_json(kv.value).api_key == ""
    finally:
        configure_engine_key_sealing(None)


# ---- what each service does still works -----------------------------------------------------------------

async def test_each_service_can_do_its_own_work(stores: dict[str, EtcdStore], sealing: None) -> None:
    dep, orch, prof, sel, adm = (stores[u] for u in ("deployer", "orchestrator", "profiler", "selector", "admin"))
    assert await dep.ping() > 0 and await sel.ping() > 0
    # deployer: its node record on a lease, its GPUs, an instance it starts, the lease kept alive and revoked
    lease = await dep.grant_lease(10)
    await dep.create(keys.node("node-a"), NodeRecord("node-a", "A6000", 2, "127.0.0.1:1").to_json(), lease=lease)
    for g in ("g0", "g1"):
        await dep.put(keys.gpu("node-a", g), GpuRecord(g, "node-a", 48.0, 0.0, "A6000").to_json())
    await dep.put(keys.instance("i-dep"), _instance("i-dep").to_json())
    assert await dep.refresh_lease(lease) > 0
    assert (await dep.get_prefix(keys.profiles_of_gpu_type("A6000"))).items == ()
    # orchestrator: a selection commit (GPU reserve + PENDING instance + reuse), a task, owner, name, user, token,
    # its leader key on a lease, and a watch over tasks that sees its own write
    gkv = await orch.get(keys.gpu("node-a", "g0"))
    assert gkv is not None
    res = await orch.txn([Compare.unchanged(gkv.key, gkv.mod_revision)],
                         [Put(gkv.key, GpuRecord("g0", "node-a", 48.0, 4.0, "A6000").to_json()),
                          Put(keys.instance("i-orch"), _instance("i-orch", "").to_json()),
                          Put(keys.reuse("i-orch", "t-1"), {"load": 1.0})])
    assert res.succeeded
    events: list[str] = []

    async def watch() -> None:
        async for ev in orch.watch_prefix(keys.TASKS):
            if ev.kind is EventKind.PUT:
                events.append(ev.key)
                return

    w = asyncio.create_task(watch())
    await asyncio.sleep(0.3)
    for key, value in ((keys.task("t-1"), {"id": "t-1"}), (keys.owner("t-1"), {"user": "u-1"}),
                       (keys.task_name("u-1", "mine"), {"task_id": "t-1"}), (keys.user("u-1"), {"id": "u-1"}),
                       (keys.user_name("bob"), {"user_id": "u-1"}), (keys.token("d-1"), {"user_id": "u-1"})):
        await orch.put(key, value)
    await asyncio.wait_for(w, 5.0)
    assert events == [keys.task("t-1")]
    olease = await orch.grant_lease(5)
    await orch.create(keys.ORCHESTRATOR_LEADER, {"replica": "orchestrator"}, lease=olease)
    await orch.revoke_lease(olease)
    assert await orch.get(keys.ORCHESTRATOR_LEADER) is None
    # the orchestrator reads the deployer's node and the instance's engine key (sealed in etcd, opened for it)
    assert await orch.get(keys.node("node-a")) is not None
    ikv = await orch.get(keys.instance("i-dep"))
    assert ikv is not None and InstanceRecord.from_json(ikv.value).api_key == ENGINE_KEY
    # profiler: profiles, models, jobs; reads the nodes' GPU type
    await prof.put(keys.profile("A6000", "m", 1, 1, "analytic"), {"latency_s": 1.0})
    await prof.put(keys.model("m"), {"id": "m"})
    await prof.put(keys.profiling_job("j-1"), {"id": "j-1"})
    assert keys.node("node-a") in (await prof.get_prefix(keys.NODES)).by_key()
    # selector: the live cluster (nodes, GPUs, instances, reuse) and profiles, read-only
    view = await read_cluster(sel)
    assert {g.id for g in view.cluster.gpus} == {"g0", "g1"} and {i.id for i in view.cluster.instances} >= {"i-dep"}
    assert len((await sel.get_prefix(keys.profiles_of_gpu_type("A6000"))).items) == 1
    assert len((await sel.get_prefix(keys.REUSE)).items) == 1
    # admin (the operator's CLI): e.g. `profiles measure-interference` stores kappa
    await adm.put(keys.interference("A6000"), {"kappa": 1.0})
    assert await sel.get(keys.interference("A6000")) is not None
    await dep.revoke_lease(lease)
    assert await dep.get(keys.node("node-a")) is None


async def test_a_store_logs_in_again_after_its_token_expires(stores: dict[str, EtcdStore]) -> None:
    """Simple tokens die after --auth-token-ttl idle seconds (and with an etcd restart): the store gets a new one
    and the call goes through, watches included."""
    orch = stores["orchestrator"]
    await orch.put(keys.task("t-idle"), {"n": 1})
    await asyncio.sleep(TOKEN_TTL_S + 2.5)
    kv = await orch.get(keys.task("t-idle"))
    assert kv is not None and kv.value == {"n": 1}
    await asyncio.sleep(TOKEN_TTL_S + 2.5)
    seen: list[object] = []

    async def watch() -> None:
        async for ev in orch.watch_prefix(keys.task("t-idle")):
            seen.append(ev.value)
            return

    w = asyncio.create_task(watch())
    await asyncio.sleep(0.3)
    await stores[ROOT_USER].put(keys.task("t-idle"), {"n": 2})
    await asyncio.wait_for(w, 5.0)
    assert seen == [{"n": 2}]


# ---- etcd enforces exactly the roles' data ---------------------------------------------------------------

PREFIXES = (keys.NODES, keys.GPUS, keys.INSTANCES, keys.TASKS, keys.REUSE, keys.PROFILES, keys.MODELS,
            keys.PROFILING_JOBS, keys.OWNERS, keys.INTERFERENCE, keys.ORCHESTRATORS, keys.TASK_NAMES, keys.USERS,
            keys.USER_NAMES, keys.TOKENS)


async def test_etcd_enforces_exactly_the_declared_roles(stores: dict[str, EtcdStore]) -> None:
    mismatches = []
    for user, role in ROLES.items():
        s = stores[user]
        for prefix in PREFIXES:
            key = prefix + "probe"
            for write in (False, True):
                try:
                    if write:
                        await s.put(key, {"probe": user})
                    else:
                        await s.get(key)
                    got = True
                except PermissionDenied:
                    got = False
                if got != allowed(role, key, write=write):
                    mismatches.append((user, prefix, "write" if write else "read", got))
    assert mismatches == []


def test_only_the_right_roles_write_or_read_what_matters() -> None:
    """The roles' data itself, stated independently of it: who may write owners, tasks, users, nodes."""
    writers = {p: sorted(u for u, r in ROLES.items() if allowed(r, p + "x", write=True)) for p in PREFIXES}
    readers = {p: sorted(u for u, r in ROLES.items() if allowed(r, p + "x", write=False)) for p in PREFIXES}
    for p in (keys.OWNERS, keys.TASKS, keys.USERS, keys.USER_NAMES, keys.TOKENS, keys.TASK_NAMES,
              keys.ORCHESTRATORS):
        assert writers[p] == ["admin", "orchestrator"], p
    assert writers[keys.NODES] == ["admin", "deployer"]
    assert writers[keys.INSTANCES] == ["admin", "deployer", "orchestrator"]
    assert writers[keys.PROFILES] == writers[keys.MODELS] == ["admin", "profiler"]
    assert "selector" not in {u for w in writers.values() for u in w}
    assert readers[keys.INSTANCES] == ["admin", "deployer", "orchestrator", "selector"]  # the selector: sealed keys
    assert readers[keys.TOKENS] == readers[keys.OWNERS] == ["admin", "orchestrator"]
    assert "generator" not in ROLES and "gateway" not in ROLES


# ---- provisioning is idempotent ------------------------------------------------------------------------

async def test_provisioning_twice_changes_nothing_and_repairs_drift(auth_etcd: tuple[EtcdServer, Path]) -> None:
    server, secrets_dir = auth_etcd
    again = await provision_from_dir(server.endpoint, secrets_dir, namespace=NS)
    assert again.auth_was_enabled and again.changes == []
    # Drift: an extra permission on the selector's role, and a password that no longer matches the file.
    from aetcd import rpc as arpc

    from flowmaker.state.etcd_auth import _channel

    pw = ensure_secrets(secrets_dir)
    ch = await _channel(server.endpoint, None)
    try:
        auth = arpc.AuthStub(ch)
        tok = (await auth.Authenticate(arpc.AuthenticateRequest(name=ROOT_USER, password=pw[ROOT_USER]))).token
        md = (("token", tok),)
        k = (NS + keys.OWNERS).encode()
        await auth.RoleGrantPermission(arpc.AuthRoleGrantPermissionRequest(
            name="selector", perm=arpc.Permission(permType=2, key=k, range_end=k[:-1] + b"0")), metadata=md)
        await auth.UserChangePassword(arpc.AuthUserChangePasswordRequest(name="profiler", password="drifted"),
                                      metadata=md)
    finally:
        await ch.close()
    fixed = await provision(server.endpoint, root_password=pw[ROOT_USER], passwords=pw, namespace=NS)
    assert sorted(fixed.changes) == sorted(["user password profiler",
                                            f"role selector revoke READWRITE {NS}{keys.OWNERS}"])
    assert (await provision_from_dir(server.endpoint, secrets_dir, namespace=NS)).changes == []
    # The password files are private: 0600 in a 0700 directory.
    assert (secrets_dir.stat().st_mode & 0o777) == 0o700
    for u in (ROOT_USER, *ROLES):
        assert (password_file(secrets_dir, u).stat().st_mode & 0o777) == 0o600
        assert len(read_secret(password_file(secrets_dir, u))) >= 32


async def test_provision_cli_is_idempotent(auth_etcd: tuple[EtcdServer, Path]) -> None:
    """`python -m flowmaker.state.etcd_auth provision` (compose's and Kubernetes' one-shot job), run on an etcd
    that is already provisioned: exit 0, nothing changed."""
    server, secrets_dir = auth_etcd
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "flowmaker.state.etcd_auth", "provision",
                                                   "--endpoints", server.endpoint, "--namespace", NS,
                                                   "--secrets-dir", str(secrets_dir), "--no-create", "--wait", "5"],
                                  capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "0 change(s)" in out.stdout


async def test_services_log_in_again_after_etcd_restarts(tmp_path: Path) -> None:
    """After an etcd kill -9 and restart (the supervisor restarting a killed etcd, the soak's etcd faults) a logged-in
    store carries on: its channel reconnects and its token still holds (etcd replays the Authenticate entries from
    its WAL) or is renewed once the call says it expired (test_a_store_logs_in_again_after_its_token_expires), its
    watches come back, and it is still held to its role."""
    server = _start_auth_etcd(tmp_path)
    stores: list[EtcdStore] = []
    try:
        await provision_from_dir(server.endpoint, tmp_path / "auth")
        orch = EtcdStore(server.endpoint, timeout_s=3.0, auth=_creds(tmp_path / "auth", "orchestrator"))
        stores.append(orch)
        await orch.put(keys.task("t-r"), {"n": 1})
        server.proc.kill()
        server.proc.wait()
        log = open(tmp_path / "etcd-2.log", "wb")
        server.proc = subprocess.Popen(server.proc.args, stdout=log, stderr=subprocess.STDOUT,  # type: ignore[arg-type]
                                       start_new_session=True)
        server.wait_healthy()
        kv = None
        for _ in range(20):  # the first calls may find the channel still reconnecting: Unavailable, retried
            try:
                kv = await orch.get(keys.task("t-r"))
                break
            except Unavailable:  # the channel still reconnecting
                await asyncio.sleep(0.5)
        assert kv is not None and kv.value == {"n": 1}
        seen: list[object] = []

        async def watch() -> None:
            async for ev in orch.watch_prefix(keys.task("t-r")):
                seen.append(ev.value)
                return

        w = asyncio.create_task(watch())
        await asyncio.sleep(0.3)
        await orch.put(keys.task("t-r"), {"n": 2})
        await asyncio.wait_for(w, 5.0)
        assert seen == [{"n": 2}]
        with pytest.raises(PermissionDenied):  # and it is still the orchestrator, nothing more
            await orch.put(keys.node("n-r"), {"node": "n-r"})
    finally:
        for s in stores:
            await s.close()
        server.stop()
