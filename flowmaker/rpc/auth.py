"""Who may call what: the caller's principal (mTLS identity or bearer token) and each service's policy.

The server interceptor (`flowmaker.rpc.errors.ErrorInterceptor`) asks the service's `AuthPolicy` for
the principal of every call before the handler runs and binds it to `current_principal`:

- a verified client certificate names a suite identity (`orchestrator`, `profiler`, ..., `admin`);
- else `authorization: Bearer <token>` metadata names a user from the tokens file
  (`{"<token>": {"user": "alice", "admin": false}, ...}`, compared by SHA-256 digest) or, at the
  orchestrator, a user created live (`AuthPolicy.live`: services/orchestrator/users.py, fed by etcd);
- else the call is UNAUTHENTICATED (when the policy requires a principal).

`methods` restricts RPCs to identities (e.g. the deployer's Deploy/Release to the orchestrator and
the profiler): anyone else is PERMISSION_DENIED. Health checks are open to any caller the transport
admits. With no policy (plaintext, local debugging), every call runs as the anonymous admin.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowmaker.errors import PermissionDenied, Unauthenticated
from flowmaker.rpc.tls import ADMIN, SERVICES, TOKENS_FILE, peer_identity


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: `name` is a service identity, "admin", or a user's id (what owns tasks: the user's name for
    tokens-file users, a stable "u-..." id for users created live); `display` is a live user's name;
    `service` when it came from a suite certificate."""

    name: str
    admin: bool = False
    service: bool = False
    display: str = ""

    @property
    def shown(self) -> str:
        return self.display or self.name


ANONYMOUS_ADMIN = Principal("", admin=True)  # plaintext stacks: no identities at all
current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("current_principal",
                                                                              default=ANONYMOUS_ADMIN)

SUITE = frozenset((*SERVICES, ADMIN))
_OPEN_PREFIXES = ("/grpc.health.",)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


LIVE_ID_PREFIX = "u-"  # ids of users created live; no tokens-file user or live name may look like one
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def reserved_name(user: str, *, admin: bool) -> str | None:
    """Why `user` may not name a user, or None. One namespace: owners are compared by id, so a user named after
    a service, the admin, or a live user's id would own what they own (a non-admin "admin" once got every task
    the admin token deployed)."""
    if user in SERVICES or (user == ADMIN and not admin):
        return f"user {user[:64]!r} is reserved for the suite (its services and the admin)"
    if user.startswith(LIVE_ID_PREFIX):
        return f"user {user[:64]!r}: names starting {LIVE_ID_PREFIX!r} are reserved for the ids of users created live"
    return None


def valid_live_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def load_tokens(path: str) -> dict[str, Principal]:
    """The tokens file as {sha256(token): Principal}; the tokens themselves are not kept."""
    if not path:
        return {}
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a JSON object {{token: {{user, admin}}}}")
    out = {}
    for tok, who in raw.items():
        if not isinstance(who, dict) or not isinstance(who.get("user"), str) or not who["user"]:
            raise ValueError(f"{path}: every token needs a non-empty 'user'")
        user, admin = who["user"], bool(who.get("admin", False))
        why = reserved_name(user, admin=admin)
        if why:
            raise ValueError(f"{path}: {why}; give this token another user name")
        out[token_digest(tok)] = Principal(user, admin=admin)
    return out


def write_tokens(path: str | Path, tokens: Mapping[str, Mapping[str, Any]]) -> None:
    import os

    p = Path(path)
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(tokens), f, indent=2)
    os.replace(tmp, p)


def ensure_admin_token(pki_dir: str | Path) -> str:
    """The admin bearer token in `<pki_dir>/tokens.json`, created (random, file mode 0600) when there is none."""
    import secrets

    path = Path(pki_dir) / TOKENS_FILE
    try:
        tokens = json.loads(path.read_text())
    except (OSError, ValueError):
        tokens = {}
    for tok, who in tokens.items():
        if isinstance(who, dict) and who.get("admin"):
            return str(tok)
    tok = secrets.token_urlsafe(32)
    write_tokens(path, {**tokens, tok: {"user": ADMIN, "admin": True}})
    return tok


@dataclass
class AuthPolicy:
    """One service's rules. `identities`: certificate names admitted at all (None = any verified one);
    `methods`: per RPC name (e.g. "Deploy"), the identities allowed; `tokens`: bearer tokens admitted;
    `live`: the tokens created live, by digest (the orchestrator's watch-fed user directory), consulted after
    `tokens`; it answers None for an unknown, expired or revoked token."""

    identities: frozenset[str] | None = SUITE
    methods: dict[str, frozenset[str]] = field(default_factory=dict)
    tokens: dict[str, Principal] = field(default_factory=dict)
    live: Callable[[str], Principal | None] | None = None

    def authenticate(self, context: Any, method: str) -> Principal:
        if method.startswith(_OPEN_PREFIXES):
            return ANONYMOUS_ADMIN
        name = method.rsplit("/", 1)[-1]
        ident = peer_identity(context)
        principal: Principal | None = None
        if ident is not None and (self.identities is None or ident in self.identities):
            principal = Principal(ident, admin=ident == ADMIN, service=ident in SERVICES)
        if principal is None and (self.tokens or self.live is not None):
            principal = self._from_token(context)
        if principal is None:
            if ident is not None:
                raise PermissionDenied(f"identity {ident[:64]!r} may not call this service", reason="IDENTITY_DENIED")
            raise Unauthenticated("this service needs a client certificate of the suite"
                                  + (" or an 'authorization: Bearer <token>' header"
                                     if self.tokens or self.live is not None else ""),
                                  reason="UNAUTHENTICATED")
        allowed = self.methods.get(name)
        if allowed is not None and principal.name not in allowed:
            raise PermissionDenied(f"{principal.name[:64]!r} may not call {name}; allowed: {sorted(allowed)}",
                                   reason="IDENTITY_DENIED")
        return principal

    def _from_token(self, context: Any) -> Principal | None:
        for key, value in context.invocation_metadata() or ():
            if key != "authorization" or not isinstance(value, str):
                continue
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise Unauthenticated("authorization must be 'Bearer <token>'")
            digest = token_digest(token.strip())
            for known, who in self.tokens.items():
                if hmac.compare_digest(known, digest):
                    return who
            live = self.live(digest) if self.live is not None else None
            if live is not None:
                return live
            raise Unauthenticated("unknown, expired or revoked bearer token")
        return None


_POLICIES: weakref.WeakKeyDictionary[Any, AuthPolicy] = weakref.WeakKeyDictionary()


def bind_policy(server: Any, policy: AuthPolicy) -> None:
    """Remember which policy guards `server` (flowmaker.rpc.server.start_server does, before the servicers are
    added), so a servicer can feed it: the orchestrator plugs its live users in as `policy.live`."""
    _POLICIES[server] = policy


def policy_of(server: Any) -> AuthPolicy | None:
    return _POLICIES.get(server)


def policy_for(service: str, tokens: dict[str, Principal] | None = None) -> AuthPolicy:
    """The suite's rules for one service (what `flowmaker up` and compose run):

    - deployer: suite identities only; Deploy and Release only from the orchestrator and the profiler
      (an instance shared by ACTIVE tasks cannot be stopped, nor GPU accounting bypassed, by anyone else);
    - profiler, selector, generator: suite identities only;
    - orchestrator: the public API: users (and the CLI, as an admin user) by bearer token. Its listener
      takes callers without certificates, and gRPC's server credentials then do not request one at all,
      so at the orchestrator the token is the only identity. Its servicer sets `live` (users created live).
    """
    if service == "deployer":
        writers = frozenset({"orchestrator", "profiler"})
        return AuthPolicy(SUITE, {"Deploy": writers, "Release": writers})
    if service == "orchestrator":
        return AuthPolicy(SUITE, tokens=dict(tokens or {}))
    return AuthPolicy(SUITE)
