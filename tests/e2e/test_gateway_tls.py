"""The gateway on a stack as `flowmaker up` runs it by default: mTLS between the services and bearer tokens
at the orchestrator. The official `openai` client's API key is the caller's FlowMaker token: it sees and calls
its own tasks, a wrong token is 401, someone else's task 403. Skip with FLOWMAKER_SKIP_E2E=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowmaker.launcher import LocalStack, StackConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("FLOWMAKER_SKIP_E2E") == "1", reason="FLOWMAKER_SKIP_E2E=1"),
]
openai = pytest.importorskip("openai")

ALICE = "alice-token-0123456789"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    from flowmaker.rpc.auth import write_tokens

    work = tmp_path_factory.mktemp("tls-stack")
    (work / "pki").mkdir()
    write_tokens(work / "pki" / "tokens.json", {ALICE: {"user": "alice", "admin": False}})  # the admin is added
    cfg = StackConfig(time_scale=50.0, log_level="WARNING", work_dir=work, keep_work_dir=True, tls=True,
                      startup_timeout_s=120.0)
    if not os.path.exists(cfg.etcd_bin):
        pytest.skip(f"etcd not installed at {cfg.etcd_bin}")
    s = LocalStack(cfg)
    s.start()
    state = work / "stack.json"
    state.write_text(json.dumps({**s.state(), "ready": True}))  # as `flowmaker up` writes it (our pid: alive)
    try:
        yield s, state
    finally:
        s.stop()


def cli(state: Path, *args: str, token: str = "") -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWMAKER_")}
    env.update({"FLOWMAKER_STATE_FILE": str(state), **({"FLOWMAKER_TOKEN": token} if token else {})})
    p = subprocess.run([sys.executable, "-m", "flowmaker.cli.main", *args, "--json"], capture_output=True,
                       text=True, env=env, timeout=180, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_the_callers_token_is_the_identity(stack: tuple[LocalStack, Path]) -> None:
    s, state = stack
    from flowmaker.launcher.stack import admin_token as read_admin_token

    assert s.pki_dir is not None
    admin_token = read_admin_token(s.pki_dir)  # the state file holds the tokens file's path, not the token
    assert s.gateway_url
    desc = "Summarise a document (meeting notes, an article, a report) in a few paragraphs."
    admins = cli(state, "task", "deploy", desc, "--accuracy", "0.2", "--latency", "15", "--approve", "all")
    alices = cli(state, "task", "deploy", desc, "--accuracy", "0.2", "--latency", "15", "--approve", "all",
                 "--name", "alice-notes", token=ALICE)
    assert admins["state"] == alices["state"] == "STATE_ACTIVE"

    admin = openai.OpenAI(base_url=s.gateway_url, api_key=admin_token, max_retries=0)
    alice = openai.OpenAI(base_url=s.gateway_url, api_key=ALICE, max_retries=0)
    assert {admins["id"], alices["id"]} <= {m.id for m in admin.models.list().data}  # an admin sees all
    assert {m.id for m in alice.models.list().data} == {alices["id"]}  # a user only their own
    r = alice.chat.completions.create(model=alices["id"], messages=[{"role": "user", "content": "notes"}],
                                      max_tokens=4)
    assert r.choices[0].message.content
    # by name too: names resolve among the caller's own tasks (a name used to be tried as an id: 403)
    r = alice.chat.completions.create(model="alice-notes", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert r.model == alices["id"] and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.PermissionDeniedError) as pd:
        alice.chat.completions.create(model=admins["id"], messages=[{"role": "user", "content": "x"}])
    assert pd.value.status_code == 403
    with pytest.raises(openai.AuthenticationError) as un:
        openai.OpenAI(base_url=s.gateway_url, api_key="wrong", max_retries=0).models.list()
    assert un.value.status_code == 401
    # A key gRPC metadata cannot carry (the official client refuses to send one; raw bytes do): answered, 401.
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(s.gateway_url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nAuthorization: Bearer "
                     + "clé".encode() + b"\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 401 ")


def test_ready_over_tls(stack: tuple[LocalStack, Path]) -> None:
    """`/ready` asks the orchestrator's health over the suite's TLS, as a client with no certificate."""
    import urllib.request

    s, _ = stack
    assert s.gateway_url
    with urllib.request.urlopen(s.gateway_url.removesuffix("/v1") + "/ready", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["orchestrator"] == "SERVING"
