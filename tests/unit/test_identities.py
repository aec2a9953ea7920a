"""One identity namespace: a user token cannot take the name of a suite service or of the admin."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowmaker.rpc.auth import load_tokens, token_digest, write_tokens
from flowmaker.rpc.tls import ADMIN, SERVICES


@pytest.mark.parametrize("name", [*SERVICES, ADMIN])
def test_a_user_may_not_be_named_after_the_suite(tmp_path: Path, name: str) -> None:
    f = tmp_path / "tokens.json"
    write_tokens(f, {"root-token": {"user": ADMIN, "admin": True}, "user-token": {"user": name}})
    with pytest.raises(ValueError, match="reserved for the suite"):
        load_tokens(str(f))


def test_ordinary_users_and_the_admin_load(tmp_path: Path) -> None:
    f = tmp_path / "tokens.json"
    write_tokens(f, {"root-token": {"user": ADMIN, "admin": True}, "a": {"user": "alice"},
                     "a2": {"user": "alice"}, "ops": {"user": "ops", "admin": True}})
    got = load_tokens(str(f))
    assert got[token_digest("root-token")].admin and got[token_digest("root-token")].name == ADMIN
    assert got[token_digest("a")] == got[token_digest("a2")] and not got[token_digest("a")].admin
    assert got[token_digest("ops")].admin
    assert oct(f.stat().st_mode & 0o777) == "0o600"
