"""Users and bearer tokens managed live: create, add a token, list, revoke, and the token lookup every replica's
auth policy consults (`flowmaker.rpc.auth.AuthPolicy.live`).

Records live in etcd (`keys.user`, `keys.user_name`, `keys.token`), tokens only as SHA-256 digests, and reach every
replica through its watch-fed cache (services/orchestrator/cache.py): a user created or revoked through one replica
takes effect on all of them within a watch's latency, without a restart. Expiry is checked on each lookup, so an
expired token is refused at once. No gRPC here: the servicer converts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowmaker.errors import AlreadyExists, Conflict, InvalidSpec, NotFound
from flowmaker.rpc.auth import LIVE_ID_PREFIX, Principal, reserved_name, token_digest, valid_live_name
from flowmaker.state import keys
from flowmaker.state.store import Compare, Put, StateStore
from services.orchestrator.cache import RoutingCache

log = logging.getLogger(__name__)

TOKEN_ID_PREFIX = "t-"
MAX_EXPIRES_IN_S = 10 * 365 * 86400.0


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: str
    create_time: float
    expire_time: float = 0.0  # 0 = never

    def expired(self, now: float) -> bool:
        return 0 < self.expire_time <= now


@dataclass(frozen=True, slots=True)
class UserInfo:
    id: str
    name: str
    admin: bool
    create_time: float
    tokens: tuple[TokenInfo, ...] = field(default=())


def _user(value: Any, tokens: tuple[TokenInfo, ...] = ()) -> UserInfo:
    return UserInfo(str(value.get("id", "")), str(value.get("name", "")), bool(value.get("admin", False)),
                    float(value.get("create_time", 0.0)), tokens)


def _token(value: Any) -> TokenInfo:
    return TokenInfo(str(value.get("token_id", "")), float(value.get("create_time", 0.0)),
                     float(value.get("expire_time", 0.0) or 0.0))


class Users:
    """The live user directory of one replica: commands write etcd (and this replica's cache at once); `lookup`
    reads only the cache (it runs on every authenticated call, synchronously)."""

    def __init__(self, store: StateStore, cache: RoutingCache, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.cache = cache
        self.clock = clock

    # ---- the auth policy's view ----------------------------------------------------------------

    def lookup(self, digest: str) -> Principal | None:
        """The principal of a live token, by digest; None when unknown, expired, or its user is gone."""
        rec = self.cache.token(digest)
        if not rec:
            return None
        if _token(rec).expired(self.clock()):
            return None
        user = self.cache.user(str(rec.get("user_id", "")))
        if not user:
            return None
        return Principal(str(user["id"]), admin=bool(user.get("admin", False)), display=str(user.get("name", "")))

    # ---- commands (admin only: the servicer checks) --------------------------------------------

    async def create_user(self, name: str, *, admin: bool = False, expires_in_s: float = 0.0
                          ) -> tuple[UserInfo, str, str]:
        """(the user, its first token, the token's id); ALREADY_EXISTS when the name is taken."""
        if not valid_live_name(name) or name.startswith(TOKEN_ID_PREFIX):
            raise InvalidSpec(f"name {name[:64]!r} must be 1-64 characters of [A-Za-z0-9._@-] starting with a letter "
                              f"or digit, and not start {LIVE_ID_PREFIX!r} or {TOKEN_ID_PREFIX!r}", field="name")
        why = reserved_name(name, admin=admin)
        if why:
            raise InvalidSpec(why, field="name", reason="RESERVED_NAME")
        now = self.clock()
        uid = LIVE_ID_PREFIX + secrets.token_hex(8)
        user = {"id": uid, "name": name, "admin": admin, "create_time": now}
        token, tid, trec = self._new_token(uid, expires_in_s, now, field_name="expires_in")
        res = await self.store.txn([Compare.absent(keys.user_name(name)), Compare.absent(keys.user(uid))],
                                   [Put(keys.user(uid), user), Put(keys.user_name(name), {"user_id": uid}),
                                    Put(keys.token(token_digest(token)), trec)])
        if not res.succeeded:
            raise AlreadyExists(f"a user named {name[:64]!r} exists already", field="name", reason="USER_EXISTS")
        self.cache.note_user(keys.user(uid), res.revision, user)
        self.cache.note_user(keys.token(token_digest(token)), res.revision, trec)
        return _user(user, (_token(trec),)), token, tid

    async def create_token(self, ref: str, *, expires_in_s: float = 0.0) -> tuple[UserInfo, str, str]:
        """A new token for the user `ref` names (name or id): (the user, the token, its id)."""
        kv, user = await self._find_user(ref, field_name="user")
        token, tid, trec = self._new_token(user.id, expires_in_s, self.clock(), field_name="expires_in")
        # The user must still be there when the token is written (a concurrent revoke wins).
        res = await self.store.txn([Compare.unchanged(keys.user(user.id), kv.mod_revision)],
                                   [Put(keys.token(token_digest(token)), trec)])
        if not res.succeeded:
            raise Conflict(f"user {ref[:64]!r} changed or was revoked meanwhile; try again", field="user")
        self.cache.note_user(keys.token(token_digest(token)), res.revision, trec)
        return user, token, tid

    async def list_users(self) -> list[UserInfo]:
        """Every live user with its tokens, by name (read from etcd: an admin's view is exact)."""
        users = await self.store.get_prefix(keys.USERS)
        toks = await self._tokens()
        return sorted((_user(kv.value, tuple(sorted((t for _, u, t in toks if u == str(kv.value.get("id"))),
                                                    key=lambda t: t.create_time)))
                       for kv in users.items if isinstance(kv.value, dict)), key=lambda u: u.name)

    async def revoke(self, target: str) -> tuple[UserInfo, bool, list[str]]:
        """Revoke the token with id `target`, or the user `target` names with all its tokens:
        (the user, whether the user was deleted, the revoked token ids)."""
        if not target:
            raise InvalidSpec("target must name a token id, a user name or a user id", field="target")
        toks = await self._tokens()
        if target.startswith(TOKEN_ID_PREFIX):
            hit = [(d, u, t) for d, u, t in toks if t.id == target]
            if not hit:
                raise NotFound(f"no token with id {target[:64]!r}", field="target", reason="TOKEN_NOT_FOUND")
            digest, uid, tok = hit[0]
            kv = await self.store.get(keys.user(uid))
            rev = (await self.store.txn([], deletes=[keys.token(digest)])).revision
            self.cache.note_user(keys.token(digest), rev, None)
            user = _user(kv.value) if kv is not None and isinstance(kv.value, dict) else UserInfo(uid, "", False, 0.0)
            return user, False, [tok.id]
        _, user = await self._find_user(target, field_name="target")
        mine = [(d, t) for d, u, t in toks if u == user.id]
        deletes = [keys.user(user.id), keys.user_name(user.name), *(keys.token(d) for d, _ in mine)]
        rev = (await self.store.txn([], deletes=deletes)).revision
        for k in deletes:
            if not k.startswith(keys.USER_NAMES):
                self.cache.note_user(k, rev, None)
        return user, True, [t.id for _, t in mine]

    async def prune_expired(self, grace_s: float) -> list[str]:
        """Delete the tokens that expired more than `grace_s` ago (until then `list_users` still shows them,
        marked expired); the ids deleted. Each delete is guarded by the token's mod_revision, so a replica
        racing this one (a leader being replaced) deletes each at most once and never a rewritten record."""
        now = self.clock()
        listing = await self.store.get_prefix(keys.TOKENS)
        pruned: list[str] = []
        for kv in listing.items:
            if not isinstance(kv.value, dict):
                continue
            tok = _token(kv.value)
            if not (tok.expire_time > 0 and tok.expire_time + grace_s <= now):
                continue
            res = await self.store.txn([Compare.unchanged(kv.key, kv.mod_revision)], deletes=[kv.key])
            if res.succeeded:
                self.cache.note_user(kv.key, res.revision, None)
                pruned.append(tok.id)
        return pruned

    # ---- helpers ---------------------------------------------------------------------------------

    def _new_token(self, uid: str, expires_in_s: float, now: float, *, field_name: str
                   ) -> tuple[str, str, dict[str, Any]]:
        if not (0 <= expires_in_s <= MAX_EXPIRES_IN_S):
            raise InvalidSpec(f"{field_name} must be 0 (no expiry) up to {MAX_EXPIRES_IN_S:.0f} s, got {expires_in_s}",
                              field=field_name)
        token = "fm-" + secrets.token_urlsafe(32)
        tid = TOKEN_ID_PREFIX + secrets.token_hex(6)
        return token, tid, {"token_id": tid, "user_id": uid, "create_time": now,
                            "expire_time": now + expires_in_s if expires_in_s > 0 else 0.0}

    async def _tokens(self) -> list[tuple[str, str, TokenInfo]]:
        """(digest, user id, token) of every live token, from etcd."""
        listing = await self.store.get_prefix(keys.TOKENS)
        return [(keys.parse_token(kv.key), str(kv.value.get("user_id", "")), _token(kv.value))
                for kv in listing.items if isinstance(kv.value, dict)]

    async def _find_user(self, ref: str, *, field_name: str) -> tuple[Any, UserInfo]:
        """(the user's KeyValue, the user) that `ref` names: a live user's id, else its name; NOT_FOUND else."""
        if not ref:
            raise InvalidSpec(f"{field_name} must name a user (its name or id)", field=field_name)
        uid = ref
        if not ref.startswith(LIVE_ID_PREFIX):
            nkv = await self.store.get(keys.user_name(ref))
            uid = str(nkv.value.get("user_id", "")) if nkv is not None and isinstance(nkv.value, dict) else ""
        kv = await self.store.get(keys.user(uid)) if uid else None
        if kv is None or not isinstance(kv.value, dict):
            raise NotFound(f"no live user {ref[:64]!r} (tokens-file users are managed in tokens.json)",
                           field=field_name, reason="USER_NOT_FOUND")
        return kv, _user(kv.value)


class TokenPruner:
    """On the leader only: every `interval_s`, `Users.prune_expired(grace_s)`, so that expired tokens do not stay
    in etcd (and in every replica's cache) for ever. An etcd outage only delays it to the next round."""

    def __init__(self, users: Users, *, interval_s: float, grace_s: float) -> None:
        self.users = users
        self.interval_s = interval_s
        self.grace_s = grace_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="token-pruner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                pruned = await self.users.prune_expired(self.grace_s)
                if pruned:
                    log.info("pruned %d token(s) expired more than %gs ago: %s", len(pruned), self.grace_s,
                             ", ".join(pruned))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd unavailable, permission: try again next round
                log.warning("pruning expired tokens failed: %s", e)
            await asyncio.sleep(self.interval_s)
