"""`flowmaker user create|token|list|revoke`: users and bearer tokens managed live at the orchestrator (admin only;
they take effect on every replica without a restart). The token is printed once, at creation."""

from __future__ import annotations

import re
from typing import Annotated, Any

import typer

from flowmaker.cli.stack import JsonOpt, OrchestratorOpt, _die, _emit, _orchestrator_call, out

user_app = typer.Typer(help="Create, list and revoke users and their bearer tokens (admin only).",
                       no_args_is_help=True)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")

ExpiresOpt = Annotated[str, typer.Option(
    "--expires-in", metavar="DURATION", help="The token's lifetime: 90s, 30m, 12h, 7d, 2w (a bare number: "
                                             "seconds); default: no expiry.")]


def parse_duration(text: str) -> float:
    """Seconds of "90s", "30m", "12h", "7d", "2w" or a bare number of seconds; "" = 0 (no expiry)."""
    total, pos, text = 0.0, 0, text.strip().lower()
    while pos < len(text):
        m = _DURATION.match(text, pos)
        if m is None:
            raise ValueError(f"not a duration: {text!r} (e.g. 90s, 30m, 12h, 7d, 1d12h)")
        total += float(m.group(1)) * _UNITS[m.group(2) or "s"]
        pos = m.end()
    return total


def _duration_proto(text: str) -> Any:
    from google.protobuf import duration_pb2

    try:
        s = parse_duration(text)
    except ValueError as e:
        _die(f"error: INVALID_ARGUMENT: --expires-in: {e}")
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(s * 1e9))
    return d


def _when(ts: Any) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts.seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _show_new(r: Any) -> None:
    exp = _when(r.user.tokens[-1].expire_time) if r.user.tokens and r.user.tokens[-1].HasField("expire_time") \
        else "never"
    out.print(f"user {r.user.name} (id {r.user.id}{', admin' if r.user.admin else ''}); token {r.token_id}, "
              f"expires {exp}")
    out.print("token (shown only now; keep it secret):", style="bold")
    out.print(r.token, markup=False, highlight=False, soft_wrap=True)


@user_app.command("create")
def user_create(name: Annotated[str, typer.Argument(help="The user's name (unique; not a service's, nor 'admin').")],
                admin: Annotated[bool, typer.Option("--admin", help="An admin: sees and manages every task and "
                                                                     "user.")] = False,
                expires_in: ExpiresOpt = "", orchestrator: OrchestratorOpt = None, as_json: JsonOpt = False) -> None:
    """Create a user with a stable id and its first bearer token, printed once."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb

    req = pb.CreateUserRequest(name=name, admin=admin, expires_in=_duration_proto(expires_in))
    _emit(_orchestrator_call(orchestrator, "CreateUser", req), as_json, _show_new)


@user_app.command("token")
def user_token(user: Annotated[str, typer.Argument(help="The user's name or id.")],
               expires_in: ExpiresOpt = "", orchestrator: OrchestratorOpt = None, as_json: JsonOpt = False) -> None:
    """Add a bearer token to a user (printed once)."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb

    req = pb.CreateTokenRequest(user=user, expires_in=_duration_proto(expires_in))
    _emit(_orchestrator_call(orchestrator, "CreateToken", req), as_json, _show_new)


@user_app.command("list")
def user_list(orchestrator: OrchestratorOpt = None, as_json: JsonOpt = False) -> None:
    """List the users created live and their tokens (ids and expiry; never the tokens)."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb

    def show(r: Any) -> None:
        from rich.table import Table

        t = Table(title=f"{len(r.users)} user(s)", title_justify="left")
        for c in ("name", "id", "admin", "created", "tokens"):
            t.add_column(c)
        for u in r.users:
            toks = ", ".join(f"{k.id} ({'EXPIRED' if k.expired else 'expires ' + _when(k.expire_time)})"
                             if k.HasField("expire_time") else k.id for k in u.tokens) or "-"
            t.add_row(u.name, u.id, "yes" if u.admin else "", _when(u.create_time), toks)
        out.print(t)

    _emit(_orchestrator_call(orchestrator, "ListUsers", pb.ListUsersRequest()), as_json, show)


@user_app.command("revoke")
def user_revoke(target: Annotated[str, typer.Argument(help="A token id (t-...): that token; a user's name or id: "
                                                           "the user and all its tokens.")],
                orchestrator: OrchestratorOpt = None, as_json: JsonOpt = False) -> None:
    """Revoke a token or a user: refused (UNAUTHENTICATED) on every replica at once; the user's tasks stay."""
    from flowmaker.api.orchestrator.v1 import orchestrator_pb2 as pb

    def show(r: Any) -> None:
        what = f"user {r.user.name} ({r.user.id}) and " if r.user_deleted else ""
        out.print(f"revoked {what}token(s): {', '.join(r.revoked_token_ids) or 'none'}")

    _emit(_orchestrator_call(orchestrator, "Revoke", pb.RevokeRequest(target=target)), as_json, show)


def register(app: typer.Typer) -> None:
    app.add_typer(user_app, name="user")
