"""The live user directory (services/orchestrator/users.py) over the in-memory store, with a clock the test moves:
stable ids, digests only, expiry and revocation as the auth policy sees them, the reserved names; and the CLI's
duration parser. The same over real etcd and gRPC: tests/integration/test_live_users.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowmaker.cli.users import parse_duration
from flowmaker.errors import AlreadyExists, InvalidSpec, NotFound, Unauthenticated
from flowmaker.rpc.auth import AuthPolicy, load_tokens, token_digest, write_tokens
from flowmaker.state import keys
from flowmaker.state.memory import MemoryStore
from services.orchestrator.cache import RoutingCache
from services.orchestrator.users import Users


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Ctx:
    """What AuthPolicy reads of a gRPC call: no client certificate, one bearer token."""

    def __init__(self, token: str) -> None:
        self.md = (("authorization", f"Bearer {token}"),)

    def auth_context(self) -> dict[str, Any]:
        return {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.md


@pytest.fixture
def users() -> tuple[Users, Clock, MemoryStore]:
    store, clock = MemoryStore(), Clock()
    return Users(store, RoutingCache(store), clock=clock), clock, store


async def test_a_live_user_has_a_stable_id_and_only_its_digest_is_stored(users: Any) -> None:
    u, _, store = users
    user, token, tid = await u.create_user("carol")
    assert user.id.startswith("u-") and user.name == "carol" and tid.startswith("t-")
    p = u.lookup(token_digest(token))
    assert p is not None and p.name == user.id and p.display == "carol" and p.shown == "carol" and not p.admin
    rec = await store.get(keys.token(token_digest(token)))
    assert rec is not None and token not in str(rec.value)
    assert u.lookup(token_digest("some other token")) is None
    with pytest.raises(AlreadyExists):
        await u.create_user("carol")
    # A policy with no tokens file still admits the live token, and refuses it once revoked.
    policy = AuthPolicy(frozenset(), live=u.lookup)
    assert policy.authenticate(Ctx(token), "/x/ListTasks").name == user.id
    await u.revoke("carol")
    with pytest.raises(Unauthenticated):
        policy.authenticate(Ctx(token), "/x/ListTasks")


async def test_expiry_and_token_revocation(users: Any) -> None:
    u, clock, _ = users
    user, first, _ = await u.create_user("dora", expires_in_s=60)
    _, second, second_id = await u.create_token(user.id)
    clock.now += 59
    assert u.lookup(token_digest(first)) is not None
    clock.now += 1
    assert u.lookup(token_digest(first)) is None  # expired: refused, still listed as expired
    assert u.lookup(token_digest(second)) is not None  # no expiry
    (listed,) = await u.list_users()
    assert len(listed.tokens) == 2 and sum(t.expired(clock.now) for t in listed.tokens) == 1
    _, deleted, ids = await u.revoke(second_id)
    assert ids == [second_id] and not deleted and u.lookup(token_digest(second)) is None
    with pytest.raises(NotFound):
        await u.revoke(second_id)
    with pytest.raises(NotFound):
        await u.create_token("nobody")


async def test_expired_tokens_are_pruned_only_after_the_grace(users: Any) -> None:
    u, clock, store = users
    user, first, first_id = await u.create_user("gail", expires_in_s=60)
    _, second, second_id = await u.create_token(user.id, expires_in_s=600)
    _, third, third_id = await u.create_token(user.id)  # never expires
    assert await u.prune_expired(grace_s=3600) == []
    clock.now += 60 + 3599  # the first expired 3599 s ago: still within the grace, still listed
    assert await u.prune_expired(grace_s=3600) == []
    (listed,) = await u.list_users()
    assert {t.id for t in listed.tokens} == {first_id, second_id, third_id}
    clock.now += 1
    assert await u.prune_expired(grace_s=3600) == [first_id]
    assert await store.get(keys.token(token_digest(first))) is None
    assert await store.get(keys.token(token_digest(second))) is not None
    (listed,) = await u.list_users()
    assert {t.id for t in listed.tokens} == {second_id, third_id}
    clock.now += 10 * 86400
    assert await u.prune_expired(grace_s=0) == [second_id]
    assert u.lookup(token_digest(third)) is not None and [t.id for t in (await u.list_users())[0].tokens] == [third_id]


@pytest.mark.parametrize("name", ["orchestrator", "selector", "admin", "u-abc", "t-abc", "", "-x", "a/b", "x" * 65])
async def test_reserved_and_malformed_names_are_refused(users: Any, name: str) -> None:
    u, _, _ = users
    with pytest.raises(InvalidSpec) as e:
        await u.create_user(name)
    assert e.value.field == "name"


async def test_an_admin_may_be_named_admin_and_bad_expiry_names_its_field(users: Any) -> None:
    u, _, _ = users
    user, token, _ = await u.create_user("admin", admin=True)
    p = u.lookup(token_digest(token))
    assert p is not None and p.admin and p.name == user.id
    with pytest.raises(InvalidSpec) as e:
        await u.create_user("eve", expires_in_s=-1)
    assert e.value.field == "expires_in"


def test_tokens_file_users_may_not_look_like_live_ids(tmp_path: Path) -> None:
    f = tmp_path / "tokens.json"
    write_tokens(f, {"t": {"user": "u-0123"}})
    with pytest.raises(ValueError, match="reserved for the ids of users created live"):
        load_tokens(str(f))


@pytest.mark.parametrize(("text", "s"), [("", 0), ("90", 90), ("90s", 90), ("30m", 1800), ("12h", 43200),
                                         ("7d", 604800), ("1d12h", 129600), ("2w", 1209600), ("0.5s", 0.5)])
def test_parse_duration(text: str, s: float) -> None:
    assert parse_duration(text) == s


@pytest.mark.parametrize("text", ["x", "1y", "-5s", "1h x"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
