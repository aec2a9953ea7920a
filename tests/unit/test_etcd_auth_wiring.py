"""etcd auth without an etcd (flowmaker.state.etcd_auth, records' engine-key sealing, the launcher's wiring): the
password files, what `flowmaker up` tells each service, settings validation, error mapping, sealing."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from flowmaker.errors import PermissionDenied, Unauthenticated, Unavailable
from flowmaker.launcher.stack import StackConfig, service_env
from flowmaker.state.etcd_auth import (
    ENGINE_KEY_SECRET,
    ROLES,
    ROOT_USER,
    engine_key_file,
    ensure_secrets,
    password_file,
    permissions,
    prefix_range_end,
)
from flowmaker.state.records import InstanceRecord, configure_engine_key_sealing


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_secrets_are_private_random_and_kept(tmp_path: Path) -> None:
    d = tmp_path / "etcd-auth"
    first = ensure_secrets(d)
    assert set(first) == {ROOT_USER, *ROLES} and len(set(first.values())) == len(first)
    assert _mode(d) == 0o700
    for u in first:
        assert _mode(password_file(d, u)) == 0o600 and len(first[u]) >= 32
    assert _mode(d / ENGINE_KEY_SECRET) == 0o600
    assert ensure_secrets(d) == first  # kept across restarts: provisioning stays a no-op
    nested = ensure_secrets(tmp_path / "n", nested=True)
    assert password_file(tmp_path / "n", "selector", nested=True) == tmp_path / "n" / "selector" / "selector.password"
    assert password_file(tmp_path / "n", ROOT_USER, nested=True).parent.name == "root"
    assert engine_key_file(tmp_path / "n", nested=True).is_file() and set(nested) == set(first)


def test_up_gives_each_service_its_own_etcd_user_and_only_paths(tmp_path: Path) -> None:
    d = tmp_path / "etcd-auth"
    pw = ensure_secrets(d)
    for svc in ("generator", "profiler", "selector", "deployer", "orchestrator"):
        env = service_env(svc, host="127.0.0.1", port=1, addrs={}, etcd_endpoint="127.0.0.1:2", cfg=StackConfig(),
                          log_dir=tmp_path, etcd_auth_dir=d)
        p = f"FLOWMAKER_{svc.upper()}_"
        if svc == "generator":  # never touches etcd: no etcd user
            assert not any(k.startswith(p + "ETCD_USER") or "PASSWORD" in k for k in env)
        else:
            assert env[p + "ETCD_USER"] == svc and env[p + "ETCD_PASSWORD_FILE"] == str(password_file(d, svc))
        assert (p + "ENGINE_KEY_SECRET_FILE" in env) == (svc in ("deployer", "orchestrator"))
        assert not any(secret in v for v in env.values() for secret in pw.values())
    plain = service_env("selector", host="127.0.0.1", port=1, addrs={}, etcd_endpoint="e:1", cfg=StackConfig(),
                        log_dir=tmp_path)
    assert "FLOWMAKER_SELECTOR_ETCD_USER" not in plain  # without etcd auth: as before


def test_settings_take_the_user_with_its_password_file() -> None:
    from services.selector.settings import SelectorSettings

    s = SelectorSettings(etcd_user="selector", etcd_password_file="/x/selector.password")
    assert s.etcd_user == "selector" and "/x/selector.password" in json.dumps(s.model_dump(mode="json"))
    with pytest.raises(ValueError, match="etcd_password_file"):
        SelectorSettings(etcd_user="selector")
    with pytest.raises(ValueError, match="etcd_password_file"):
        SelectorSettings(etcd_password_file="/x/selector.password")


def test_etcd_refusals_are_not_retryable_unavailability() -> None:
    import aetcd.exceptions as aerr

    from flowmaker.state.etcd import _needs_login, _raise_mapped

    with pytest.raises(PermissionDenied):
        _raise_mapped(aerr.ClientError("etcdserver: permission denied"), "get /x")
    with pytest.raises(Unauthenticated):
        _raise_mapped(aerr.InvalidArgumentError("etcdserver: user name is empty"), "get /x")
    with pytest.raises(Unauthenticated):
        _raise_mapped(aerr.InvalidArgumentError("etcdserver: authentication failed, invalid user ID or password"),
                      "get /x")
    with pytest.raises(Unavailable):
        _raise_mapped(aerr.ConnectionFailedError("connection refused"), "get /x")
    assert _needs_login(aerr.UnauthenticatedError("etcdserver: invalid auth token"))
    assert _needs_login(aerr.InvalidArgumentError("etcdserver: revision of auth store is old"))
    assert not _needs_login(aerr.ClientError("etcdserver: permission denied"))


def test_permissions_are_prefix_ranges_under_the_namespace() -> None:
    assert prefix_range_end(b"/flowmaker/v1/nodes/") == b"/flowmaker/v1/nodes0"
    assert prefix_range_end(b"a\xff") == b"b" and prefix_range_end(b"\xff") == b"\0"
    perms = permissions(ROLES["selector"], "/ns/")
    assert (b"/ns/flowmaker/v1/nodes/", b"/ns/flowmaker/v1/nodes0", 0) in perms
    assert all(t == 0 for _, _, t in perms)  # READ only


def test_engine_keys_are_sealed_deterministically_and_bound_to_their_record(tmp_path: Path) -> None:
    rec = InstanceRecord("i-1", "m", 1, 1, "n", ("g0",), 1.0, api_key="sk-secret-key")
    assert rec.to_json()["api_key"] == "sk-secret-key"  # no secret configured: as before
    secret = tmp_path / "s"
    secret.write_text("the-secret\n")
    configure_engine_key_sealing(str(secret))
    try:
        d = rec.to_json()
        assert d["api_key"] == "" and d["api_key_sealed"].startswith("v1:") and "sk-secret-key" not in json.dumps(d)
        assert rec.to_json() == d  # equal records, equal bytes
        assert InstanceRecord.from_json(d).api_key == "sk-secret-key"
        moved = {**d, "id": "i-2"}  # a sealed key copied into another record does not open
        assert InstanceRecord.from_json(moved).api_key == ""
        assert InstanceRecord.from_json({**d, "api_key_sealed": "v1:garbage"}).api_key == ""
    finally:
        configure_engine_key_sealing(None)
    kept = InstanceRecord.from_json(d)  # a process without the secret keeps the sealed key as it is
    assert kept.api_key == "" and kept.to_json()["api_key_sealed"] == d["api_key_sealed"]
