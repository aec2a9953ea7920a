"""Client side of the CLI: where the services are and how to prove who we are (flag, env, `flowmaker up`'s state
file), stubs, error lines.

Address resolution, first match wins: the command's `--orchestrator` / `--deployer` /
`--profiler` option; `FLOWMAKER_ORCHESTRATOR_ADDR` / `FLOWMAKER_DEPLOYER_ADDR` /
`FLOWMAKER_PROFILER_ADDR`; the context (`flowmaker --context NAME`, FLOWMAKER_CONTEXT, else the current one of
`flowmaker context use`; `flowmaker.launcher.contexts`); the state file a running `flowmaker up` writes
(`FLOWMAKER_STATE_FILE`, default `~/.flowmaker/stack.json`); the default port of the service on
127.0.0.1 (`flowmaker.settings.DEFAULT_PORTS`).

Credentials (`credentials`), so that the CLI reaches any stack (`flowmaker up`, compose, Kubernetes), not only
the one it started:

- TLS: `FLOWMAKER_TLS_CA` (the stack's CA), with `FLOWMAKER_TLS_CERT` / `FLOWMAKER_TLS_KEY` (a client
  certificate of that CA, e.g. the pki's `admin.pem` / `admin.key`; every service but the orchestrator demands
  one); the top-level `flowmaker --tls-ca/--tls-cert/--tls-key` options set them; else the context's. Given,
  they are used for every address. Else the state file's files, for the addresses of the stack it describes; else plaintext.
- token (the orchestrator's bearer token; sent over TLS only): `FLOWMAKER_TOKEN`; else `FLOWMAKER_TOKEN_FILE`
  (`flowmaker --token-file`; else the context's): a file holding the token, or a `tokens.json` (`{token: {user, admin}}`) whose
  admin token (or only token) is taken; else the admin token in the `tokens.json` the state file points to.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf import json_format
from google.protobuf.message import Message
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from flowmaker.errors import FlowMakerError
from flowmaker.launcher.stack import read_state
from flowmaker.rpc.channels import channel
from flowmaker.rpc.errors import code_of, error_info, from_rpc_error
from flowmaker.rpc.tls import TlsFiles
from flowmaker.settings import DEFAULT_PORTS

T = TypeVar("T")


class ClientSettings(BaseSettings):
    """What the CLI reads from the environment (prefix FLOWMAKER_)."""

    model_config = SettingsConfigDict(env_prefix="FLOWMAKER_", extra="ignore")

    orchestrator_addr: str = Field("", description="host:port of the orchestrator the client commands talk to.")
    deployer_addr: str = Field("", description="host:port of the deployer `flowmaker instances` asks.")
    profiler_addr: str = Field("", description="host:port of the profiler (model registration).")
    state_file: Path = Field(Path.home() / ".flowmaker" / "stack.json",
                             description="Where `flowmaker up` records its endpoints and pid (read by the clients, "
                                         "`flowmaker down`).")
    call_timeout_s: float = Field(300.0, gt=0, description="Deadline of each CLI call (deploys can take minutes).")
    token: str = Field("", description="Bearer token for the orchestrator (FLOWMAKER_TOKEN); default: "
                                       "FLOWMAKER_TOKEN_FILE's, else the admin token of the running `flowmaker up` "
                                       "stack, when it runs with TLS.")
    token_file: str = Field("", description="File with the bearer token (FLOWMAKER_TOKEN_FILE): the token alone, or "
                                            "a tokens.json whose admin (or only) token is used.")
    tls_ca: str = Field("", description="PEM CA of the stack's certificates (FLOWMAKER_TLS_CA): TLS to every "
                                        "service, whatever the state file says.")
    tls_cert: str = Field("", description="PEM client certificate signed by that CA (FLOWMAKER_TLS_CERT; with "
                                          "FLOWMAKER_TLS_KEY), e.g. the stack's admin.pem.")
    tls_key: str = Field("", description="PEM key of FLOWMAKER_TLS_CERT (FLOWMAKER_TLS_KEY).")
    config: Path | None = Field(None, description="The contexts file (FLOWMAKER_CONFIG); default: config.json "
                                                  "beside the state file (~/.flowmaker/config.json).")
    context: str = Field("", description="The context to use (FLOWMAKER_CONTEXT, `flowmaker --context`); default: "
                                         "the current one (`flowmaker context use`).")

    @property
    def config_file(self) -> Path:
        from flowmaker.launcher.contexts import default_path

        return self.config or default_path(self.state_file)


def settings() -> ClientSettings:
    """The environment's settings, what they leave empty filled from the context (FLOWMAKER_CONTEXT, else the
    current one): flags (which set the environment) and variables win over a context, a context over the state
    file. A contexts file or context that cannot be used is ignored here (`flowmaker --context` reports it)."""
    from flowmaker.launcher.contexts import ContextError, active

    s = ClientSettings()  # type: ignore[call-arg]
    try:
        found = active(s.config_file, s.context)
    except ContextError:
        return s
    if found is not None:
        ctx = found[1]
        for mine, theirs in (("orchestrator_addr", ctx.orchestrator), ("deployer_addr", ctx.deployer),
                             ("profiler_addr", ctx.profiler), ("token_file", ctx.token_file)):
            if not getattr(s, mine) and theirs:
                setattr(s, mine, theirs)
        # TLS files go together: a context's CA is not mixed with a certificate from the environment.
        if not (s.tls_ca or s.tls_cert or s.tls_key):
            s.tls_ca, s.tls_cert, s.tls_key = ctx.tls_ca, ctx.tls_cert, ctx.tls_key
    return s


def resolve(service: str, flag: str | None, s: ClientSettings | None = None) -> str:
    """The address of `service` by the rules in the module docstring."""
    if flag:
        return flag
    s = s or settings()
    env = getattr(s, f"{service}_addr", "")
    if env:
        return str(env)
    state = read_state(s.state_file)
    if state and service in state.get("services", {}):
        return str(state["services"][service])
    return f"127.0.0.1:{DEFAULT_PORTS[service]}"


class RpcFailure(Exception):
    """A failed call, ready to print as one line: code, reason, field, message."""

    def __init__(self, code: str, reason: str, message: str, field: str | None = None, target: str = "") -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.field, self.target = code, reason, message, field, target

    def line(self) -> str:
        where = f" {self.field}:" if self.field else ""
        reason = f" {self.reason}" if self.reason and self.reason != self.code else ""
        return f"error: {self.code}{reason}:{where} {self.message}"


def failure_of(e: BaseException, target: str = "") -> RpcFailure:
    """RpcFailure for a gRPC error (with ErrorInfo / BadRequest details when the server sent them) or a
    FlowMakerError raised locally."""
    if isinstance(e, grpc.RpcError):
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        typed = from_rpc_error(e)  # the one reading of the status details (field, message)
        message, field = typed.message, typed.field
        info = error_info(e)
        reason = info.reason if info and info.reason else code.name
        if code == grpc.StatusCode.UNAVAILABLE and info is None:
            # No rich status: the connection itself failed (nothing listening, or a TLS handshake refused), not
            # the service.
            message = (f"cannot reach {target or 'the service'} ({message}); is a stack running there (`flowmaker "
                       "up`, or the address in --orchestrator/--deployer/--profiler or FLOWMAKER_<SVC>_ADDR)? A TLS "
                       "stack also needs its CA, and for every service but the orchestrator a client certificate: "
                       "FLOWMAKER_TLS_CA/_CERT/_KEY (flowmaker --tls-ca/--tls-cert/--tls-key)")
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and info is None:
            message = f"no answer from {target or 'the service'} within the deadline"
        return RpcFailure(code.name, reason, " ".join(message.split()), field, target)
    if isinstance(e, FlowMakerError):  # raised on this side (e.g. a deadline already passed): same code names
        return RpcFailure(code_of(e).name, e.reason, " ".join(e.message.split()), e.field, target)
    return RpcFailure("ERROR", type(e).__name__, str(e), None, target)


async def call(aw: Awaitable[T], target: str = "") -> T:
    """Await a client call; a failure becomes RpcFailure."""
    try:
        return await aw
    except (grpc.RpcError, FlowMakerError) as e:
        raise failure_of(e, target) from None


def to_json(msg: Message) -> dict[str, Any]:
    """Proto3 JSON of a message, with the proto field names (snake_case, as in the .proto files)."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


@dataclass(frozen=True, slots=True)
class ServerOnlyTls(TlsFiles):
    """TLS trusting `ca` with no client certificate: enough for the orchestrator, which takes a bearer token
    (every other service demands a certificate and refuses the handshake)."""

    def read(self) -> tuple[bytes, bytes, bytes]:
        # grpc.ssl_channel_credentials takes None for "no key pair".
        return Path(self.ca).read_bytes(), None, None  # type: ignore[return-value]


def _readable(path: str, name: str) -> str:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise RpcFailure("INVALID_ARGUMENT", "", f"cannot read {path}: {e.strerror or e}", name) from None
    return path


def token_from_file(path: str, name: str = "FLOWMAKER_TOKEN_FILE") -> str:
    """The bearer token in `path`: the file's content, or for a tokens.json (`{token: {user, admin}}`) its admin
    token, or its only one. RpcFailure INVALID_ARGUMENT naming `name` when there is none."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RpcFailure("INVALID_ARGUMENT", "", f"cannot read {path}: {e}", name) from None
    try:
        tokens = json.loads(text)
    except ValueError:
        tokens = None
    if isinstance(tokens, dict):
        admins = [t for t, who in tokens.items() if isinstance(who, dict) and who.get("admin")]
        if admins or len(tokens) == 1:
            return str((admins or list(tokens))[0])
        raise RpcFailure("INVALID_ARGUMENT", "", f"{path} is a tokens file with {len(tokens)} token(s) and no admin "
                         "one: put your own token alone in a file, or in FLOWMAKER_TOKEN", name)
    token = text.strip()
    if not token or len(token.split()) != 1:
        raise RpcFailure("INVALID_ARGUMENT", "", f"{path} holds no token (expected the token alone, or a "
                         "tokens.json)", name)
    return token


def credentials(addresses: Iterable[str] = (), s: ClientSettings | None = None) -> tuple[TlsFiles | None, str]:
    """(TLS files or None for plaintext, bearer token) for talking to `addresses`, by the rules in the module
    docstring. RpcFailure INVALID_ARGUMENT naming the variable for a setting that cannot be used."""
    s = s or settings()
    token = s.token
    if not token and s.token_file:
        token = token_from_file(s.token_file)
    if s.tls_ca or s.tls_cert or s.tls_key:
        if bool(s.tls_cert) != bool(s.tls_key):
            missing = "FLOWMAKER_TLS_KEY" if s.tls_cert else "FLOWMAKER_TLS_CERT"
            raise RpcFailure("INVALID_ARGUMENT", "", "a client certificate needs its key: FLOWMAKER_TLS_CERT and "
                             "FLOWMAKER_TLS_KEY go together", missing)
        if not s.tls_ca:
            raise RpcFailure("INVALID_ARGUMENT", "", "the stack's CA is needed with a client certificate",
                             "FLOWMAKER_TLS_CA")
        ca = _readable(s.tls_ca, "FLOWMAKER_TLS_CA")
        if not s.tls_cert:
            return ServerOnlyTls(ca, "", ""), token
        return TlsFiles(ca, _readable(s.tls_cert, "FLOWMAKER_TLS_CERT"), _readable(s.tls_key, "FLOWMAKER_TLS_KEY")), token
    state = read_state(s.state_file) or {}
    tls = state.get("tls")
    ours = set(state.get("services", {}).values())
    if not isinstance(tls, dict) or not ours.intersection(a for a in addresses if a):
        return None, token
    if not token:
        if tls.get("tokens_file"):
            with contextlib.suppress(RpcFailure):  # unreadable: no token, and the orchestrator says UNAUTHENTICATED
                token = token_from_file(str(tls["tokens_file"]), "tokens_file")
        token = token or str(tls.get("token", ""))  # a state file of an older `flowmaker up`
    return TlsFiles(tls["ca"], tls["cert"], tls["key"]), token


@dataclass
class Stubs:
    """aio channels and stubs of the services the CLI talks to; close() when done. With `tls` (default True:
    what `credentials` says: the FLOWMAKER_TLS_* files, else the running stack's state file), channels are TLS
    and the orchestrator's calls carry the bearer `token`. Settings that cannot be used raise RpcFailure."""

    orchestrator_addr: str = ""
    deployer_addr: str = ""
    profiler_addr: str = ""
    timeout_s: float = 300.0
    tls: TlsFiles | bool | None = True  # True = from the state file
    token: str = ""
    tracing: bool = True  # OpenTelemetry's client interceptors (a CLI exporting no trace skips loading them)

    def __post_init__(self) -> None:
        self._channels: list[grpc.aio.Channel] = []
        if self.tls is True:
            self.tls, tok = credentials((self.orchestrator_addr, self.deployer_addr, self.profiler_addr))
            self.token = self.token or tok

    def _channel(self, addr: str, token: str = "") -> grpc.aio.Channel:
        files = self.tls if isinstance(self.tls, TlsFiles) else None
        ch = channel(addr, default_timeout_s=self.timeout_s, tls=files, token=token if files else "",
                     tracing=self.tracing)
        self._channels.append(ch)
        return ch

    def orchestrator(self) -> Any:
        from flowmaker.api.orchestrator.v1 import orchestrator_pb2_grpc

        return orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel(self.orchestrator_addr, self.token))

    def deployer(self) -> Any:
        from flowmaker.api.deployer.v1 import deployer_pb2_grpc

        return deployer_pb2_grpc.DeployerServiceStub(self._channel(self.deployer_addr))

    def profiler(self) -> Any:
        from flowmaker.api.profiler.v1 import profiler_pb2_grpc

        return profiler_pb2_grpc.ProfilerServiceStub(self._channel(self.profiler_addr))

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close(None)
        self._channels.clear()
