"""Users and tokens managed live (issue 22 item 6) on real suites: the TLS suite of test_tls_auth (real etcd, the
five gRPC servers with their certificates) and two orchestrator replicas over one etcd. Nothing is restarted: a
user created, expired or revoked takes effect on every replica through its watch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb
from flowmaker.rpc.auth import write_tokens
from flowmaker.state import keys
from tests.integration import test_tls_auth as tls
from tests.integration.test_tls_auth import ONE, SLO, Secure, code_of

pki, secure = tls.pki, tls.secure  # its TLS suite, as fixtures of this module

pytestmark = pytest.mark.integration

OK, UNAUTH, DENIED = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


async def until_code(call: Callable[[], Awaitable[Any]], want: grpc.StatusCode, limit_s: float = 30.0) -> None:
    """Call until it answers `want` (a generous bound for a watch to arrive: not a timing assertion)."""
    end = asyncio.get_running_loop().time() + limit_s
    while (got := await code_of(call())) != want:
        assert asyncio.get_running_loop().time() < end, f"still {got}, never {want}"
        await asyncio.sleep(0.05)


def seconds(s: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(s * 1e9))
    return d


async def test_users_are_created_used_expired_and_revoked_live(secure: Secure, etcd_store: Any) -> None:
    root, r_md = secure.orch("root-token-0123456789")
    alice, a_md = secure.orch("alice-token-0123456789")
    stub, _ = secure.orch(None)

    # Only an admin manages users.
    assert await code_of(alice.CreateUser(pb.CreateUserRequest(name="mallory", admin=True), metadata=a_md)) == DENIED
    assert await code_of(alice.ListUsers(pb.ListUsersRequest(), metadata=a_md)) == DENIED
    assert await code_of(alice.Revoke(pb.RevokeRequest(target="alice"), metadata=a_md)) == DENIED
    # One namespace: no service's name, no non-admin "admin", nothing that looks like a live id; names are unique.
    for bad in ("selector", "admin", "u-1234", "t-1", "", "a b", "x" * 65):
        assert await code_of(root.CreateUser(pb.CreateUserRequest(name=bad), metadata=r_md)) == \
            grpc.StatusCode.INVALID_ARGUMENT, bad
    assert await code_of(root.CreateUser(pb.CreateUserRequest(name="carol", expires_in=seconds(-1)),
                                         metadata=r_md)) == grpc.StatusCode.INVALID_ARGUMENT

    made = await root.CreateUser(pb.CreateUserRequest(name="carol"), metadata=r_md)
    carol, uid, tok = bearer(made.token), made.user.id, made.token
    assert uid.startswith("u-") and made.user.name == "carol" and not made.user.admin
    assert await code_of(root.CreateUser(pb.CreateUserRequest(name="carol"), metadata=r_md)) == \
        grpc.StatusCode.ALREADY_EXISTS
    # Only the digest is stored.
    stored = await etcd_store.get_prefix(keys.TOKENS)
    assert stored.items and all(tok not in str(kv.key) + str(kv.value) for kv in stored.items)

    # The new token works at once, and what carol deploys is owned by her stable id, not her name.
    t = (await stub.DeployTask(pb.DeployTaskRequest(description="d", name="mine", slo=SLO, workflows=[ONE]),
                               metadata=carol)).task
    owner = await etcd_store.get(keys.owner(t.id))
    assert owner is not None and owner.value == {"owner": uid}
    assert [x.id for x in (await stub.ListTasks(pb.ListTasksRequest(), metadata=carol)).tasks] == [t.id]
    assert (await stub.GetTask(pb.GetTaskRequest(task_id="mine"), metadata=carol)).task.id == t.id
    assert await code_of(alice.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=a_md)) == DENIED
    assert await code_of(stub.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=carol)) == OK
    # ...and she is no admin.
    assert await code_of(stub.ListUsers(pb.ListUsersRequest(), metadata=carol)) == DENIED

    # A second token, one that expires, and one that expires soon.
    long = await root.CreateToken(pb.CreateTokenRequest(user="carol", expires_in=seconds(3600)), metadata=r_md)
    short = await root.CreateToken(pb.CreateTokenRequest(user=uid, expires_in=seconds(0.5)), metadata=r_md)
    assert long.token_id != short.token_id and long.token != tok
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=bearer(long.token))) == OK
    await until_code(lambda: stub.ListTasks(pb.ListTasksRequest(), metadata=bearer(short.token)), UNAUTH)
    (listed,) = [u for u in (await root.ListUsers(pb.ListUsersRequest(), metadata=r_md)).users if u.id == uid]
    by_id = {k.id: k for k in listed.tokens}
    assert set(by_id) == {made.token_id, long.token_id, short.token_id}
    assert by_id[short.token_id].expired and not by_id[long.token_id].expired
    assert by_id[long.token_id].HasField("expire_time") and not by_id[made.token_id].HasField("expire_time")
    assert tok not in str(listed) and long.token not in str(listed)
    assert await code_of(root.CreateToken(pb.CreateTokenRequest(user="nobody-here"), metadata=r_md)) == \
        grpc.StatusCode.NOT_FOUND

    # Revoking one token refuses it at once; the others still work.
    r = await root.Revoke(pb.RevokeRequest(target=long.token_id), metadata=r_md)
    assert list(r.revoked_token_ids) == [long.token_id] and not r.user_deleted
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=bearer(long.token))) == UNAUTH
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=carol)) == OK
    # Revoking the user refuses every token of hers; her task stays, the admin still sees it.
    r = await root.Revoke(pb.RevokeRequest(target="carol"), metadata=r_md)
    assert r.user_deleted and set(r.revoked_token_ids) == {made.token_id, short.token_id}
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=carol)) == UNAUTH
    assert await code_of(root.Revoke(pb.RevokeRequest(target="carol"), metadata=r_md)) == grpc.StatusCode.NOT_FOUND
    assert (await root.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=r_md)).task.id == t.id
    assert uid not in [u.id for u in (await root.ListUsers(pb.ListUsersRequest(), metadata=r_md)).users]
    # The name is free again, for a new user with a new id.
    again = await root.CreateUser(pb.CreateUserRequest(name="carol"), metadata=r_md)
    assert again.user.id != uid
    assert await code_of(stub.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=bearer(again.token))) == DENIED
    await root.DeleteTask(pb.DeleteTaskRequest(task_id=t.id), metadata=r_md)


async def test_a_user_made_through_one_replica_calls_the_other(etcd_store: Any, start_control_plane: Any,
                                                             tmp_path: Path) -> None:
    """Two orchestrator replicas over one etcd, bearer tokens on both (no TLS: the Kubernetes base). A user created
    through one is admitted by the other once its watch brings the token, is held to the per-user task quota
    there, and a revocation through the second is refused by the first."""
    write_tokens(tmp_path / "tokens.json", {"root-token-0123456789": {"user": "root", "admin": True}})
    settings = {"auth_tokens_file": str(tmp_path / "tokens.json"), "max_tasks_per_user": 1}
    (_, a), (_, b) = [await start_control_plane(etcd_store, **settings) for _ in range(2)]
    root = bearer("root-token-0123456789")

    made = await a.CreateUser(pb.CreateUserRequest(name="dave"), metadata=root)
    dave = bearer(made.token)
    await until_code(lambda: b.ListTasks(pb.ListTasksRequest(), metadata=dave), OK)
    t = (await b.DeployTask(pb.DeployTaskRequest(description="d", slo=SLO, workflows=[ONE]), metadata=dave)).task
    owner = await etcd_store.get(keys.owner(t.id))
    assert owner is not None and owner.value == {"owner": made.user.id}
    # The quota counts the stable id's tasks, whichever replica is asked.
    await until_code(lambda: a.DeployTask(pb.DeployTaskRequest(description="d2", slo=SLO, workflows=[ONE]),
                                          metadata=dave), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert (await a.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=dave)).task.id == t.id

    await b.Revoke(pb.RevokeRequest(target=made.user.id), metadata=root)
    await until_code(lambda: a.ListTasks(pb.ListTasksRequest(), metadata=dave), UNAUTH)
    assert await code_of(b.ListTasks(pb.ListTasksRequest(), metadata=dave)) == UNAUTH
    await a.DeleteTask(pb.DeleteTaskRequest(task_id=t.id), metadata=root)


async def flowmaker(*args: str, token: str, secure: Secure) -> tuple[int, str, str]:
    """The `flowmaker` CLI as a subprocess against the TLS suite (asynchronously: the suite runs in this loop)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWMAKER_")}
    env.update({"FLOWMAKER_STATE_FILE": "/nonexistent/stack.json", "FLOWMAKER_CONFIG": "/nonexistent/config.json",
                "FLOWMAKER_TOKEN": token, "COLUMNS": "200"})
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flowmaker.cli.main", "--tls-ca", str(secure.pki / "ca.pem"), *args,
        "--orchestrator", secure.addrs["orchestrator"], env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 120)
    return p.returncode or 0, out.decode(), err.decode()


async def test_the_user_commands(secure: Secure) -> None:
    """`flowmaker user create|token|list|revoke`, --json and tables: the token once, then never again."""
    root = "root-token-0123456789"
    rc, out, err = await flowmaker("user", "create", "erin", "--expires-in", "1d", "--json", token=root, secure=secure)
    assert rc == 0, err
    made = json.loads(out)
    erin, uid = made["token"], made["user"]["id"]
    assert made["user"]["name"] == "erin" and made["user"]["tokens"][0]["expire_time"]
    stub, _ = secure.orch(None)
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=bearer(erin))) == OK
    rc, out, err = await flowmaker("user", "token", "erin", "--json", token=root, secure=secure)
    assert rc == 0, err
    second = json.loads(out)
    rc, out, err = await flowmaker("user", "token", uid, "--expires-in", "1h", token=root, secure=secure)
    assert rc == 0 and "shown only now" in out, err
    third = out.strip().splitlines()[-1]  # the token, alone on the last line
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=bearer(third))) == OK
    rc, out, err = await flowmaker("user", "list", "--json", token=root, secure=secure)
    assert rc == 0, err
    (listed,) = [u for u in json.loads(out)["users"] if u["id"] == uid]
    assert len(listed["tokens"]) == 3 and {made["token_id"], second["token_id"]} <= {t["id"] for t in listed["tokens"]}
    assert erin not in out and second["token"] not in out and third not in out
    rc, out, err = await flowmaker("user", "list", token=root, secure=secure)
    assert rc == 0 and "erin" in out and uid in out and erin not in out, err
    # A non-admin is refused, in one line.
    rc, out, err = await flowmaker("user", "create", "frank", token=erin, secure=secure)
    assert rc != 0 and "PERMISSION_DENIED" in err and "Traceback" not in err
    rc, out, err = await flowmaker("user", "create", "gina", "--expires-in", "soon", token=root, secure=secure)
    assert rc != 0 and "INVALID_ARGUMENT" in err and "--expires-in" in err
    rc, out, err = await flowmaker("user", "revoke", second["token_id"], "--json", token=root, secure=secure)
    assert rc == 0 and json.loads(out)["revoked_token_ids"] == [second["token_id"]], err
    rc, out, err = await flowmaker("user", "revoke", "erin", token=root, secure=secure)
    assert rc == 0 and made["token_id"] in out, err
    for tok in (erin, third):
        assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=bearer(tok))) == UNAUTH


async def test_a_task_shows_its_owner_id_to_its_owner_and_to_no_other_user(secure: Secure) -> None:
    """Task.owner (output only) is the owner's stable id: a live user's "u-..." id, a tokens-file user's name; shown
    by `task get` and `task list` (--json and tables), never to another user, who cannot see the task at all."""
    root, r_md = secure.orch("root-token-0123456789")
    alice, a_md = secure.orch("alice-token-0123456789")
    made = await root.CreateUser(pb.CreateUserRequest(name="hana"), metadata=r_md)
    uid, hana = made.user.id, bearer(made.token)
    t = (await alice.DeployTask(pb.DeployTaskRequest(description="d", name="hanas", slo=SLO, workflows=[ONE]),
                                metadata=hana)).task
    assert t.owner == uid and uid.startswith("u-")
    mine = (await alice.DeployTask(pb.DeployTaskRequest(description="d", slo=SLO, workflows=[ONE]),
                                   metadata=a_md)).task
    assert mine.owner == "alice"
    try:
        assert (await alice.GetTask(pb.GetTaskRequest(task_id="hanas"), metadata=hana)).task.owner == uid
        assert [(x.id, x.owner) for x in (await alice.ListTasks(pb.ListTasksRequest(), metadata=hana)).tasks] == \
            [(t.id, uid)]
        # The admin sees every task with its owner.
        listed = {x.id: x.owner for x in (await root.ListTasks(pb.ListTasksRequest(), metadata=r_md)).tasks}
        assert listed[t.id] == uid and listed[mine.id] == "alice"

        rc, out, err = await flowmaker("task", "get", "hanas", "--json", token=made.token, secure=secure)
        assert rc == 0 and json.loads(out)["owner"] == uid, err
        rc, out, err = await flowmaker("task", "list", "--json", token=made.token, secure=secure)
        assert rc == 0 and [(x["id"], x["owner"]) for x in json.loads(out)["tasks"]] == [(t.id, uid)], err
        rc, out, err = await flowmaker("task", "get", t.id, token=made.token, secure=secure)
        assert rc == 0 and f"owner: {uid}" in out, err
        rc, out, err = await flowmaker("task", "list", token="root-token-0123456789", secure=secure)
        assert rc == 0 and uid in out and "alice" in out, err

        # Another user cannot see it: not by id, not in a listing; the CLI says so in one line.
        assert await code_of(alice.GetTask(pb.GetTaskRequest(task_id=t.id), metadata=a_md)) == DENIED
        rc, out, err = await flowmaker("task", "get", t.id, "--json", token="alice-token-0123456789", secure=secure)
        assert rc != 0 and "PERMISSION_DENIED" in err and uid not in out + err
        rc, out, err = await flowmaker("task", "list", "--json", token="alice-token-0123456789", secure=secure)
        assert rc == 0 and [(x["id"], x["owner"]) for x in json.loads(out)["tasks"]] == [(mine.id, "alice")], err
        # The deleted task still names its owner (read before its owner key goes with it).
        assert (await alice.DeleteTask(pb.DeleteTaskRequest(task_id=t.id), metadata=hana)).task.owner == uid
    finally:
        for task_id in (t.id, mine.id):
            with contextlib.suppress(grpc.RpcError):  # hana's is gone already unless an assertion failed first
                await root.DeleteTask(pb.DeleteTaskRequest(task_id=task_id), metadata=r_md)
        await root.Revoke(pb.RevokeRequest(target=uid), metadata=r_md)


async def test_the_leader_prunes_expired_tokens_after_a_grace(etcd_store: Any, start_control_plane: Any,
                                                             tmp_path: Path) -> None:
    """Expired tokens do not stay in etcd for ever: the leader deletes each one `token_prune_grace_s` after it
    expired. Within the grace ListUsers still shows it (expired); after it, its key is gone and ListUsers no longer
    lists it, while a token without expiry stays."""
    write_tokens(tmp_path / "tokens.json", {"root-token-0123456789": {"user": "root", "admin": True}})
    orch, stub = await start_control_plane(etcd_store, auth_tokens_file=str(tmp_path / "tokens.json"),
                                           token_prune_interval_s=0.2, token_prune_grace_s=1.5)
    root = bearer("root-token-0123456789")
    made = await stub.CreateUser(pb.CreateUserRequest(name="ivy"), metadata=root)
    loop = asyncio.get_running_loop()
    t0 = loop.time()  # before the token is made: it cannot be pruned before t0 + 1 s + 1.5 s
    short = await stub.CreateToken(pb.CreateTokenRequest(user="ivy", expires_in=seconds(1.0)), metadata=root)

    async def token_ids() -> dict[str, bool]:
        (u,) = [u for u in (await stub.ListUsers(pb.ListUsersRequest(), metadata=root)).users if u.name == "ivy"]
        return {t.id: t.expired for t in u.tokens}

    async def stored() -> set[str]:
        return {str(kv.value.get("token_id")) for kv in (await etcd_store.get_prefix(keys.TOKENS)).items}

    await until_code(lambda: stub.ListTasks(pb.ListTasksRequest(), metadata=bearer(short.token)), UNAUTH)
    # Expired, and still within its grace (1.5 s after its 1 s expiry): listed as expired, not yet pruned.
    if loop.time() - t0 < 2.0:
        assert (await token_ids()).get(short.token_id) is True
        assert short.token_id in await stored()
    end = t0 + 20.0
    while short.token_id in await stored():
        assert loop.time() < end, "the expired token was never pruned"
        await asyncio.sleep(0.1)
    assert loop.time() - t0 >= 2.45, "pruned before its grace was over"  # 1 s expiry + 1.5 s grace
    assert await token_ids() == {made.token_id: False}
    assert made.token_id in await stored()
    assert await code_of(stub.ListTasks(pb.ListTasksRequest(), metadata=bearer(made.token))) == OK
    assert orch.is_leader()
