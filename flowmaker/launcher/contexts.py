"""Contexts, as kubectl has them: named ways to reach a stack (addresses, CA, client certificate, token file),
kept in one 0600 JSON file, one of them current.

The file is `FLOWMAKER_CONFIG`, by default `config.json` beside the `flowmaker up` state file
(`~/.flowmaker/config.json`), so a test or a user that moves the state file moves the contexts with it. Its
shape::

    {"current": "local",
     "contexts": {"local": {"orchestrator": "127.0.0.1:50055", "deployer": "...", "profiler": "...",
                            "gateway": "http://127.0.0.1:8000/v1", "tls_ca": "/abs/ca.pem",
                            "tls_cert": "/abs/admin.pem", "tls_key": "/abs/admin.key",
                            "token_file": "/abs/tokens.json"}}}

It holds addresses and file paths, never a token itself. Pure file handling: no gRPC, so the CLI reads it
without loading grpc. How a context ranks against flags and the environment: `flowmaker.launcher.client`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

# The services a context may name an address for (the CLI's clients), and the gateway's base URL.
SERVICES = ("orchestrator", "deployer", "profiler")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # a name that is safe in a shell and a file


class ContextError(ValueError):
    """A context that cannot be used or stored; `field` names the option or variable at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message, self.field = message, field


@dataclass(frozen=True, slots=True)
class Context:
    """How to reach one stack. Empty = not set (the environment, the state file or the default applies)."""

    orchestrator: str = ""  # host:port; a comma-separated list of replicas is passed on as it is
    deployer: str = ""
    profiler: str = ""
    gateway: str = ""  # the OpenAI-compatible base URL (informational: printed by `context list`)
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token_file: str = ""

    def address(self, service: str) -> str:
        return str(getattr(self, service, "") or "")

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Context:
        known = {f.name for f in fields(Context)}
        return Context(**{k: str(v) for k, v in d.items() if k in known and isinstance(v, str)})

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v}


@dataclass
class Contexts:
    """The contents of the contexts file: every context by name, and the current one's name ("" = none)."""

    current: str = ""
    contexts: dict[str, Context] | None = None

    def __post_init__(self) -> None:
        if self.contexts is None:
            self.contexts = {}

    @property
    def all(self) -> dict[str, Context]:
        assert self.contexts is not None
        return self.contexts

    def get(self, name: str) -> Context | None:
        return self.all.get(name)


def default_path(state_file: Path) -> Path:
    """The contexts file when FLOWMAKER_CONFIG is not set: `config.json` beside the state file."""
    return state_file.parent / "config.json"


def load(path: Path) -> Contexts:
    """The contexts in `path`; none when it does not exist. ContextError for a file that is not ours to read."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Contexts()
    except OSError as e:
        raise ContextError(f"cannot read the contexts file {path}: {e.strerror or e}", "FLOWMAKER_CONFIG") from None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ContextError(f"the contexts file {path} is not JSON: {e}", "FLOWMAKER_CONFIG") from None
    if not isinstance(raw, dict):
        raise ContextError(f"the contexts file {path} is not a JSON object", "FLOWMAKER_CONFIG")
    items = raw.get("contexts")
    if not isinstance(items, dict):
        items = {}
    ctxs = {str(k): Context.from_json(v) for k, v in items.items() if isinstance(v, dict)}
    cur = raw.get("current") if isinstance(raw.get("current"), str) else ""
    return Contexts(cur if cur in ctxs else "", ctxs)


def save(path: Path, c: Contexts) -> None:
    """Write atomically, 0600 (its directory created 0700): the file names a token file and a key."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a leftover .tmp keeps its old mode through O_CREAT
        json.dump({"current": c.current, "contexts": {n: x.to_json() for n, x in sorted(c.all.items())}}, f,
                  indent=2)
        f.write("\n")
    tmp.replace(path)


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise ContextError(f"a context name is 1-63 letters, digits, '.', '_' or '-', starting with a letter or "
                           f"digit; got {name!r}", "NAME")
    return name


def upsert(path: Path, name: str, ctx: Context, *, make_current: bool | None = None) -> Contexts:
    """Add or replace context `name`; current when `make_current`, or (None) when no context is current yet."""
    c = load(path)
    c.all[check_name(name)] = ctx
    if make_current or (make_current is None and not c.current):
        c.current = name
    save(path, c)
    return c


def active(path: Path, name: str = "") -> tuple[str, Context] | None:
    """The context to use: `name` when given (ContextError when unknown), else the current one, else None."""
    c = load(path)
    if name:
        ctx = c.get(name)
        if ctx is None:
            known = ", ".join(sorted(c.all)) or "none"
            raise ContextError(f"no context {name!r} in {path} (known: {known}); add it with `flowmaker context "
                               "add`", "--context")
        return name, ctx
    if c.current:
        return c.current, c.all[c.current]
    return None
