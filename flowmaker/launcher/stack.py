"""Starts and stops a whole FlowMaker stack on loopback: etcd, then the five services, each a real subprocess.

Used by `flowmaker up`, `flowmaker demo` and the end-to-end tests. Synchronous on purpose: the
callers are a CLI and pytest, and a launcher that owns child processes is easiest to reason about
without an event loop.

Start-up:
1. a real etcd (`etcd_bin`) on two free loopback ports with a data dir under the work dir;
2. free loopback ports are picked for the five services up front, so every service can be told
   where its peers are before any of them runs; they then start in parallel (`python -m
   services.<svc>` with `FLOWMAKER_<SVC>_*` settings in the environment, see `service_env`);
3. ready = gRPC health `Check("")` answers SERVING for every service. A child that exits
   first, or a timeout, raises `StackError` with the tail of its log, and everything started so
   far is stopped.

Orchestrator replicas (`StackConfig.orchestrators`, `flowmaker up --orchestrators N`): each its own supervised
process on its own port (children `orchestrator`, `orchestrator-2`, ...); one of them is elected to act. Clients get
the list: `addresses["orchestrator"]` (and the state file's `services.orchestrator`) is "host:port,host:port",
which `flowmaker.rpc.channels.channel` balances round robin; `state()["orchestrators"]` lists them.

Stop (also on an error during start, on `with` exit, and at interpreter exit):
front-door services first (gateway, orchestrator replicas, selector, generator, profiler), then the deployer (its
shutdown stops its engines and revokes its etcd lease), then etcd. Each gets SIGTERM, then
SIGKILL after `stop_timeout_s`. Engines run in their own sessions, so the launcher also records
every descendant of each service before stopping it and kills whatever of them is still alive
afterwards (checked by pid *and* start time, so a reused pid is never hit): no orphan processes.
Children also get PR_SET_PDEATHSIG=SIGTERM, so they are told to stop even if the launcher itself
is SIGKILLed.

Ports: every service's gRPC port, the gateway's HTTP port and (with `StackConfig.metrics`) each service's Prometheus
port are picked free once and kept in the work dir's `ports.json`, so a restart keeps its addresses; `flowmaker up`
fixes the gateway's (`--gateway-port`, default `DEFAULT_GATEWAY_PORT`) so an OpenAI client's base URL never moves.

Credentials: the pki dir (CA and keys, `tokens.json`) is 0700 with its keys and tokens 0600; the state file
(`write_state`, 0600 in a 0700 directory) holds the *paths* of the client's TLS files and of `tokens.json`,
never a token or a key. With `StackConfig.etcd_auth` (`flowmaker up` unless --insecure), right after etcd is
healthy `flowmaker.state.etcd_auth` provisions a root user and one etcd user and role per service and enables
auth; the passwords are in `<work dir>/etcd-auth/` (0700, files 0600), and each service is given its user and the
path of its own password file (the deployer and the orchestrator also the engine-key sealing secret's).

Supervision (`supervise()`, called by `flowmaker up` every second): a child that exits is started again
with the same command, environment and port, after an exponential backoff (1 s, doubling to 30 s, reset
after a minute of uptime), the way a process supervisor would; the stack is never torn down for it. With
a work dir (`flowmaker up` keeps one by default) etcd data, logs and the chosen ports (`ports.json`)
persist, so `flowmaker down` + `up` brings back the same cluster state on the same addresses.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from flowmaker.errors import Unavailable
from flowmaker.launcher.procs import descendants, die_with_parent, identity, start_time
from flowmaker.ports import free_port
from flowmaker.rpc.tls import ADMIN, TOKENS_FILE, TlsFiles, ensure_pki, pki_files

# Start order; stop order is the reverse with the deployer held back until the others are gone.
SERVICES: tuple[str, ...] = ("deployer", "profiler", "generator", "selector", "orchestrator")

# `flowmaker up`'s gateway port unless --gateway-port says otherwise: fixed, so an OpenAI client's base URL
# (http://127.0.0.1:50080/v1) survives restarts. Beside the services' 50051-50055, and not vLLM's 8000.
DEFAULT_GATEWAY_PORT = 50080

ProgressFn = Callable[[str, str], None]  # (step, detail): "etcd", "starting" / "ready" / "stopping"...


class StackError(Unavailable):
    """The local stack could not start (a port, etcd or a service failed); the message says which and why."""

    reason = "STACK_START_FAILED"


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now (SO_REUSEADDR, as the services bind: TIME_WAIT is no obstacle)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind it: TIME_WAIT is no use
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def admin_token(pki_dir: Path) -> str:
    """The stack's admin bearer token (created at the first start, kept in the pki dir's tokens.json)."""
    from flowmaker.rpc.auth import ensure_admin_token

    return ensure_admin_token(pki_dir)


def _default_etcd_bin() -> str:
    return shutil.which("etcd") or "/usr/bin/etcd"


@dataclass
class StackConfig:
    """What to start. Defaults give the demo's cluster: one emulated node of 8 x A6000."""

    gpus: int = 8
    gpu_type: str = "A6000"
    node: str = "node0"
    # Emulated engines run their model clock this many times faster than wall time.
    time_scale: float = 1.0
    host: str = "127.0.0.1"
    etcd_bin: str = field(default_factory=_default_etcd_bin)
    # Where etcd data and the logs go; None = a fresh temp dir, removed on stop unless keep_work_dir.
    work_dir: Path | None = None
    keep_work_dir: bool = False
    startup_timeout_s: float = 90.0
    stop_timeout_s: float = 15.0
    log_level: str = "INFO"
    # Fixed service ports (e.g. {"orchestrator": 50055}); the others get free ports.
    ports: dict[str, int] = field(default_factory=dict)
    # Extra environment for every service (e.g. FLOWMAKER_ORCHESTRATOR_... overrides).
    extra_env: dict[str, str] = field(default_factory=dict)
    python: str = field(default_factory=lambda: sys.executable)
    # Which services to start (all five by default; a subset is for tests of one service).
    services: tuple[str, ...] = SERVICES
    # Orchestrator replicas, each a process of its own on its own port; one is elected to reconcile (`flowmaker up`
    # starts 2; library callers, tests among them, get one unless they ask).
    orchestrators: int = 1
    # The OpenAI-compatible HTTP gateway (`services.gateway`) in front of the orchestrator; its base URL
    # is `LocalStack.gateway_url` and the state file's "gateway".
    gateway: bool = True
    # The gateway's HTTP port: 0 = a free one, kept in the work dir's ports.json like the services' ports;
    # else exactly this one (a taken port is a StackError before anything starts). `flowmaker up`: --gateway-port.
    gateway_port: int = 0
    # Prometheus /metrics on every service (FLOWMAKER_<SVC>_METRICS_PORT), each on a port of its own picked
    # and kept like the gRPC ports; listed in `state()["metrics"]` with the gateway's. On under `flowmaker up`.
    metrics: bool = False
    # mTLS between the services + bearer tokens at the orchestrator (flowmaker.rpc.tls / .auth): a local
    # CA and per-service certificates in `<work dir>/pki`, an admin token in `<work dir>/pki/tokens.json`.
    # `flowmaker up` turns it on unless --insecure; plaintext here keeps library callers (tests, benches
    # that open their own channels) working as they are.
    tls: bool = False
    # etcd's own authentication (flowmaker.state.etcd_auth): after etcd starts, a root user, a role and a user per
    # service with key-prefix permissions are provisioned and auth is enabled; each service logs in as its own
    # user (password file 0600 in `<work dir>/etcd-auth`, 0700), and engine API keys are sealed in instance
    # records with a secret only the deployer and the orchestrator get. `flowmaker up` turns it on unless
    # --insecure.
    etcd_auth: bool = False
    # The user the deployer starts engines as (`DeployerSettings.engine_user`: needs root); "" = the deployer's.
    engine_user: str = ""


def service_env(svc: str, *, host: str, port: int, addrs: Mapping[str, str], etcd_endpoint: str,
                cfg: StackConfig, log_dir: Path, pki_dir: Path | None = None,
                metrics_port: int | None = None, etcd_auth_dir: Path | None = None) -> dict[str, str]:
    """The FLOWMAKER_<SVC>_* settings the launcher gives one service (read by services/<svc>/settings.py).
    `metrics_port`: serve Prometheus /metrics there (`ServiceSettings.metrics_port`); None = the service's default.
    `etcd_auth_dir`: etcd auth is on; the service's etcd user and the *path* of its password file (never the
    password), and to the deployer and the orchestrator the path of the engine-key sealing secret."""
    p = f"FLOWMAKER_{svc.upper()}_"
    env = {p + "HOST": host, p + "PORT": str(port), p + "ETCD_ENDPOINTS": etcd_endpoint, p + "LOG_LEVEL": cfg.log_level,
           p + "GRACE_S": "2"}
    if metrics_port is not None:
        env[p + "METRICS_PORT"] = str(metrics_port)
    if pki_dir is not None:  # this service's own certificate, and the CA every peer is checked against
        f = pki_files(pki_dir, svc)
        env.update({p + "TLS_CA_FILE": f.ca, p + "TLS_CERT_FILE": f.cert, p + "TLS_KEY_FILE": f.key,
                    p + "ETCD_TLS": "true"})
        if svc == "deployer":  # every engine's /v1 takes only its own key, which callers get from the deployer
            env[p + "ENGINE_API_KEYS"] = "true"
        if svc == "orchestrator":
            env[p + "AUTH_TOKENS_FILE"] = str(pki_dir / TOKENS_FILE)
    if etcd_auth_dir is not None:
        from flowmaker.state.etcd_auth import ROLES, engine_key_file, password_file

        if svc in ROLES:  # the generator (and the gateway) have no etcd user: they never touch etcd
            env.update({p + "ETCD_USER": svc, p + "ETCD_PASSWORD_FILE": str(password_file(etcd_auth_dir, svc))})
        if svc in ("deployer", "orchestrator"):
            env[p + "ENGINE_KEY_SECRET_FILE"] = str(engine_key_file(etcd_auth_dir))
    # How services find each other: every peer's address is given to every service as
    # FLOWMAKER_<SVC>_<PEER>_ADDRESS (e.g. FLOWMAKER_ORCHESTRATOR_SELECTOR_ADDRESS); a settings class
    # ignores the peers it does not declare. Deployers are found through their node records in etcd.
    for peer, addr in addrs.items():
        if peer != svc:
            env[f"{p}{peer.upper()}_ADDRESS"] = addr
    if svc == "orchestrator":
        env[p + "TOOL_TIME_SCALE"] = repr(cfg.time_scale)  # TOOL stages are emulated on the engines' clock
    if svc == "profiler":
        # The profiler converts the deployer's emulated engines' wall time back to model time.
        env[p + "ENGINE_TIME_SCALE"] = repr(cfg.time_scale)
    if svc == "deployer":
        env.update({p + "NODE": cfg.node, p + "GPU_TYPE": cfg.gpu_type, p + "GPU_COUNT": str(cfg.gpus),
                    p + "USE_NVML": "false", p + "BACKEND": "emulated", p + "ENGINE_HOST": host,
                    p + "ENGINE_TIME_SCALE": repr(cfg.time_scale), p + "ENGINE_STOP_GRACE_S": "3",
                    p + "ENGINE_LOG_DIR": str(log_dir / "engines")})
        if cfg.engine_user:
            env[p + "ENGINE_USER"] = cfg.engine_user
    return env


# ---- processes -----------------------------------------------------------------------------

_set_pdeathsig = die_with_parent(signal.SIGTERM)  # services get SIGTERM: they stop their engines cleanly


# Kept under their old names: the e2e tests (and anyone checking for orphans) import them from here.
_start_time = start_time
_descendants = descendants


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    address: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0  # monotonic
    restarts: int = 0
    exited_at: float = 0.0  # monotonic time its exit was first seen (0 = running)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _spawn(name: str, argv: list[str], env: Mapping[str, str], log_path: Path) -> _Child:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logf = open(log_path, "ab")
    try:
        proc = subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True,  # Ctrl-C in the terminal reaches the launcher only
                                preexec_fn=_set_pdeathsig)
    except OSError as e:
        logf.close()
        raise StackError(f"cannot run {argv[0]!r} for {name}: {e}", field=name) from None
    return _Child(name, proc, log_path, logf, argv=list(argv), env=dict(env), started_at=time.monotonic())


def _health_serving(address: str, timeout_s: float = 1.0, tls: TlsFiles | None = None) -> bool:
    import grpc  # imported here: the launcher module stays importable without starting grpc threads
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from flowmaker.rpc.tls import channel_credentials

    with (grpc.secure_channel(address, channel_credentials(tls)) if tls else grpc.insecure_channel(address)) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


# ---- the stack -----------------------------------------------------------------------------

class LocalStack:
    """etcd + the five services as subprocesses. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, config: StackConfig | None = None, *, progress: ProgressFn | None = None) -> None:
        self.config = config or StackConfig()
        self._progress = progress or (lambda step, detail: None)
        self._etcd: _Child | None = None
        self.etcd_endpoint = ""
        self._children: dict[str, _Child] = {}
        self.addresses: dict[str, str] = {}
        self.orchestrators: list[str] = []  # each replica's address ("orchestrator" in `addresses` lists them all)
        self.gateway_url = ""  # http://host:port/v1 once the gateway serves
        self.metrics: dict[str, str] = {}  # service (and "gateway") -> its Prometheus URL http://host:port/metrics
        self.pki_dir: Path | None = None  # with config.tls: the CA, certificates and tokens
        self.etcd_auth_dir: Path | None = None  # with config.etcd_auth: the etcd users' password files
        self._tmp: Path | None = None
        self.work_dir: Path | None = None
        self.started_at = 0.0
        self._stopped = False
        # Ports this stack has handed out or been given: none is drawn twice (`free_port` holds nothing, so two draws
        # before the servers bind could agree; measured: a CI run's orchestrator found its port taken).
        self._given: set[int] = {p for p in (*self.config.ports.values(), self.config.gateway_port) if p}

    # -- public ---------------------------------------------------------------------------

    @property
    def log_dir(self) -> Path:
        assert self.work_dir is not None
        return self.work_dir / "logs"

    def state(self) -> dict[str, Any]:
        """What `flowmaker up` writes to its state file (and prints as JSON): addresses and file paths, no secret."""
        return {"pid": os.getpid(), "etcd": self.etcd_endpoint, "services": dict(self.addresses),
                "work_dir": str(self.work_dir or ""), "gpus": self.config.gpus, "gpu_type": self.config.gpu_type,
                "node": self.config.node, "time_scale": self.config.time_scale, "gateway": self.gateway_url,
                "metrics": dict(self.metrics), "orchestrators": list(self.orchestrators),
                "pids": {n: c.proc.pid for n, c in self._children.items()},
                "tls": self.client_tls(),
                # etcd auth on: the directory of the etcd users' password files (0700; the files 0600), never one
                "etcd_auth_dir": str(self.etcd_auth_dir or "")}

    def client_tls(self) -> dict[str, str] | None:
        """What a client of this stack needs (the CLI reads it from the state file): the paths of the CA, the
        admin certificate and key, and of `tokens.json`, whose admin entry is the orchestrator's bearer token
        (read from that 0600 file, never copied here); None when plaintext."""
        if self.pki_dir is None:
            return None
        f = pki_files(self.pki_dir, ADMIN)
        return {"ca": f.ca, "cert": f.cert, "key": f.key, "tokens_file": str(self.pki_dir / TOKENS_FILE)}

    def start(self) -> LocalStack:
        cfg = self.config
        self._stopped = False
        if cfg.work_dir is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="flowmaker-stack-"))
            self.work_dir = self._tmp
        else:
            self.work_dir = private_dir(Path(cfg.work_dir))
        if cfg.gateway and "orchestrator" in cfg.services and cfg.gateway_port \
                and not port_free(cfg.host, cfg.gateway_port):
            raise StackError(f"the gateway's port {cfg.host}:{cfg.gateway_port} is in use (another stack, or another "
                             "program); choose another one, or 0 for any free port", field="gateway_port")
        atexit.register(self.stop)
        if cfg.tls:
            self.pki_dir = ensure_pki(self.work_dir / "pki", hosts=(cfg.host,))
            admin_token(self.pki_dir)  # created once, kept with the certificates (tokens.json, 0600)
        try:
            self._start_etcd()
            # An etcd data dir provisioned before (by an earlier start with etcd auth) has auth on for good: keep
            # giving the services their users, also when this start did not ask for it (`up --insecure` later).
            if cfg.etcd_auth or (self.work_dir / "etcd-auth" / "root.password").exists():
                self._provision_etcd_auth()
            self._start_services()
            if cfg.gateway and "orchestrator" in cfg.services:
                self._start_gateway()
        except BaseException:
            self.stop()
            raise
        self.started_at = time.monotonic()
        return self

    def stop(self) -> None:
        """Stop everything this launcher started (idempotent; safe after a failed start)."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        t = self.config.stop_timeout_s
        replicas = [n for n in self._children if n.startswith("orchestrator-")]
        front = [self._children[n] for n in ("gateway", *replicas, *reversed(SERVICES))
                 if n in self._children and n != "deployer"]
        back = [self._children[n] for n in ("deployer",) if n in self._children]
        for group in (front, back):
            if group:
                self._stop_group(group, t)
        if self._etcd is not None:
            self._stop_group([self._etcd], t)
        self._children.clear()
        self._etcd = None
        if self._tmp is not None and not self.config.keep_work_dir:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp = None

    def pid_of(self, name: str) -> int | None:
        """The pid of a running child ("etcd" or a service), None when it is not running."""
        c = self._etcd if name == "etcd" else self._children.get(name)
        return c.proc.pid if c is not None and c.proc.poll() is None else None

    def processes(self) -> list[tuple[int, str]]:
        """(pid, `procs.identity`) of every live process this stack started (etcd, services) and of their
        descendants (engines included): after `stop()`, `procs.is_same_alive` must be false for each."""
        roots = [c.proc.pid for c in [*([self._etcd] if self._etcd else []), *self._children.values()]]
        pids = roots + [pid for root in roots for pid, _ in descendants(root)]
        return [(pid, ident) for pid in pids if (ident := identity(pid))]

    def supervise(self, *, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                  healthy_after_s: float = 60.0) -> list[str]:
        """Start again every child that has exited, once its backoff has passed; returns one line per event
        (exit seen, restart) for the caller to print. Never raises for a child's death."""
        events: list[str] = []
        now = time.monotonic()
        for c in [*([self._etcd] if self._etcd else []), *self._children.values()]:
            if c.proc.poll() is None:
                if c.restarts and now - c.started_at > healthy_after_s:
                    c.restarts = 0  # it stayed up: the next crash starts from the shortest backoff
                continue
            if not c.exited_at:
                c.exited_at = now
                events.append(f"{c.name} exited with code {c.proc.returncode}; restarting it (log {c.log_path})")
            delay = min(backoff_max_s, backoff_s * 2 ** c.restarts)
            if now - c.exited_at < delay:
                continue
            c.log_file.close()
            fresh = _spawn(c.name, c.argv, c.env, c.log_path)
            fresh.address, fresh.restarts = c.address, c.restarts + 1
            if c is self._etcd:
                self._etcd = fresh
            else:
                self._children[c.name] = fresh
            events.append(f"{c.name} restarted (pid {fresh.proc.pid}, restart #{fresh.restarts})")
        return events

    def check_alive(self) -> None:
        """StackError naming the first child process that has exited (for `flowmaker up`'s watch loop)."""
        for c in [*([self._etcd] if self._etcd else []), *self._children.values()]:
            if c.proc.poll() is not None:
                raise StackError(f"{c.name} exited with code {c.proc.returncode}; last log lines:\n{c.log_tail()}",
                                 field=c.name)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- start ----------------------------------------------------------------------------

    def _port(self, name: str) -> int:
        """The port `name` had in this work dir last time (`ports.json`) when it is free now, else a free one;
        kept only where the work dir is (`keep_work_dir` or a given work dir)."""
        assert self.work_dir is not None
        path = self.work_dir / "ports.json"
        try:
            saved: dict[str, int] = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
        port = saved.get(name)
        if not isinstance(port, int) or port in self._given or not port_free(self.config.host, port):
            port = free_port(self.config.host, avoid=self._given)
        self._given.add(port)
        if self._tmp is None:
            saved[name] = port
            with contextlib.suppress(OSError):
                path.write_text(json.dumps(saved, indent=2))
        return port

    def _start_etcd(self) -> None:
        cfg = self.config
        if not os.path.exists(cfg.etcd_bin):
            raise StackError(f"etcd binary not found at {cfg.etcd_bin} (apt-get install etcd-server, or pass "
                             "--etcd-bin)", field="etcd_bin")
        self._progress("etcd", "starting")
        assert self.work_dir is not None
        cport, pport = self._port("etcd-client"), self._port("etcd-peer")
        scheme = "https" if self.pki_dir else "http"
        curl, purl = f"{scheme}://{cfg.host}:{cport}", f"http://{cfg.host}:{pport}"
        argv = [cfg.etcd_bin, "--name", "flowmaker", "--data-dir", str(self.work_dir / "etcd-data"),
                "--listen-client-urls", curl, "--advertise-client-urls", curl,
                "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
                "--initial-cluster", f"flowmaker={purl}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]
        ssl_ctx = None
        if self.pki_dir is not None:  # clients must present a certificate of the stack's CA (the services')
            f = pki_files(self.pki_dir, "etcd")
            argv += ["--cert-file", f.cert, "--key-file", f.key, "--trusted-ca-file", f.ca, "--client-cert-auth"]
            import ssl

            admin = pki_files(self.pki_dir, ADMIN)
            ssl_ctx = ssl.create_default_context(cafile=admin.ca)
            ssl_ctx.load_cert_chain(admin.cert, admin.key)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}  # stray ETCD_* would override flags
        self._etcd = _spawn("etcd", argv, env, self.log_dir / "etcd.log")
        self.etcd_endpoint = f"{cfg.host}:{cport}"
        deadline = time.monotonic() + min(cfg.startup_timeout_s, 30.0)
        while True:
            if self._etcd.proc.poll() is not None:
                raise StackError(f"etcd exited with code {self._etcd.proc.returncode} (port {cport} or {pport} taken, "
                                 f"or a bad data dir?); last log lines:\n{self._etcd.log_tail()}", field="etcd")
            try:
                with urllib.request.urlopen(curl + "/health", timeout=1, context=ssl_ctx) as r:
                    if b'"true"' in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"etcd did not become healthy on {self.etcd_endpoint} within "
                                 f"{deadline:.0f}s; last log lines:\n{self._etcd.log_tail()}", field="etcd")
            time.sleep(0.1)
        self._progress("etcd", f"ready on {self.etcd_endpoint}")

    def _provision_etcd_auth(self) -> None:
        """Users, roles and key-prefix permissions in the etcd just started, then auth on (idempotent: a restart
        with the same work dir finds them and changes nothing). Passwords: `<work dir>/etcd-auth/<user>.password`."""
        from flowmaker.state.etcd_auth import ProvisionError, provision_from_dir

        assert self.work_dir is not None
        self._progress("etcd", "provisioning users and roles")
        self.etcd_auth_dir = private_dir(self.work_dir / "etcd-auth", tighten=True)
        tls = pki_files(self.pki_dir, ADMIN) if self.pki_dir else None
        try:
            report = _run_async(provision_from_dir(self.etcd_endpoint, self.etcd_auth_dir, tls=tls, wait_s=10.0))
        except (ProvisionError, OSError) as e:
            raise StackError(f"etcd auth could not be provisioned: {e}", field="etcd") from None
        self._progress("etcd", f"auth on ({len(report.changes)} change(s)): one user and role per service")

    def _start_services(self) -> None:
        cfg = self.config
        unknown = set(cfg.services) - set(SERVICES)
        if unknown:
            raise StackError(f"unknown service(s) {sorted(unknown)}; known: {list(SERVICES)}", field="services")
        if cfg.orchestrators < 1:
            raise StackError(f"orchestrators must be >= 1, got {cfg.orchestrators}", field="orchestrators")
        for svc in SERVICES:
            port = cfg.ports.get(svc) or self._port(svc)
            self.addresses[svc] = f"{cfg.host}:{port}"
        # Replica 1 is `orchestrator` (its port, metrics port and log as with one replica); the others follow.
        replicas = ["orchestrator", *(f"orchestrator-{i}" for i in range(2, cfg.orchestrators + 1))]
        self.orchestrators = [self.addresses["orchestrator"],
                              *(f"{cfg.host}:{self._port(r)}" for r in replicas[1:])]
        self.addresses["orchestrator"] = ",".join(self.orchestrators)
        metrics_ports = {svc: self._port(f"{svc}-metrics") for svc in SERVICES if svc in cfg.services} \
            if cfg.metrics else {}
        if cfg.metrics and "orchestrator" in cfg.services:
            metrics_ports.update({r: self._port(f"{r}-metrics") for r in replicas[1:]})
        base_env = {**os.environ, "OTEL_TRACES_EXPORTER": os.environ.get("OTEL_TRACES_EXPORTER", "none"),
                    "PYTHONUNBUFFERED": "1",
                    # Marks every process of this stack (engines inherit it): orphan checks find them by it.
                    "FLOWMAKER_STACK": str(self.work_dir)}
        # The services must import this very checkout's packages (`services` is not installed as a
        # package when flowmaker is installed from a wheel; in a checkout it sits next to flowmaker/).
        root = str(Path(__file__).resolve().parents[2])
        (self.log_dir / "engines").mkdir(parents=True, exist_ok=True)  # the deployer appends engine logs there
        base_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        procs = [(svc, svc, self.addresses[svc]) for svc in SERVICES if svc in cfg.services and svc != "orchestrator"]
        if "orchestrator" in cfg.services:
            procs += [("orchestrator", name, addr) for name, addr in zip(replicas, self.orchestrators, strict=True)]
        for svc, name, address in procs:
            host, port_s = address.rsplit(":", 1)
            env = {**base_env,
                   **service_env(svc, host=host, port=int(port_s), addrs=self.addresses,
                                 etcd_endpoint=self.etcd_endpoint, cfg=cfg, log_dir=self.log_dir,
                                 pki_dir=self.pki_dir, metrics_port=metrics_ports.get(name),
                                 etcd_auth_dir=self.etcd_auth_dir),
                   **cfg.extra_env}
            if svc == "orchestrator":
                env["FLOWMAKER_ORCHESTRATOR_REPLICA_ID"] = name
                if name != "orchestrator":  # a fixed port in extra_env is replica 1's
                    env["FLOWMAKER_ORCHESTRATOR_PORT"] = port_s
                    if name in metrics_ports:
                        env["FLOWMAKER_ORCHESTRATOR_METRICS_PORT"] = str(metrics_ports[name])
            mport = env.get(f"FLOWMAKER_{svc.upper()}_METRICS_PORT", "")
            if mport.isdigit() and int(mport) > 0:  # a fixed port (ours, or extra_env's): known up front
                self.metrics[name] = f"http://{host}:{mport}/metrics"
            self._progress(name, "starting")
            child = _spawn(name, [cfg.python, "-m", f"services.{svc}"], env, self.log_dir / f"{name}.log")
            child.address = address
            self._children[name] = child
        waiting = dict(self._children)
        deadline = time.monotonic() + cfg.startup_timeout_s
        while waiting:
            for name, c in list(waiting.items()):
                if c.proc.poll() is not None:
                    raise StackError(f"{name} exited with code {c.proc.returncode} during start-up (is "
                                     f"{c.address} free?); last log lines of {c.log_path}:\n{c.log_tail()}",
                                     field=name)
                if _health_serving(c.address, tls=pki_files(self.pki_dir, ADMIN) if self.pki_dir else None):
                    del waiting[name]
                    self._progress(name, f"ready on {c.address}")
            if not waiting:
                break
            if time.monotonic() > deadline:
                names = ", ".join(sorted(waiting))
                tails = "\n".join(f"--- {n} ({c.log_path}):\n{c.log_tail(10)}" for n, c in waiting.items())
                raise StackError(f"not SERVING within {cfg.startup_timeout_s:g}s: {names}\n{tails}",
                                 field=sorted(waiting)[0])
            time.sleep(0.2)

    def _start_gateway(self) -> None:
        """The HTTP gateway on a free port, told the orchestrator's address; ready when GET /health answers."""
        cfg = self.config
        port = cfg.gateway_port or self._port("gateway")
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "OTEL_TRACES_EXPORTER": os.environ.get("OTEL_TRACES_EXPORTER", "none"),
               "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")) if p),
               "FLOWMAKER_GATEWAY_HOST": cfg.host, "FLOWMAKER_GATEWAY_PORT": str(port),
               "FLOWMAKER_GATEWAY_ORCHESTRATOR_ADDRESS": self.addresses["orchestrator"],
               "FLOWMAKER_GATEWAY_LOG_LEVEL": cfg.log_level, "FLOWMAKER_GATEWAY_GRACE_S": "2",
               **({"FLOWMAKER_GATEWAY_TLS_CA_FILE": str(self.pki_dir / "ca.pem")} if self.pki_dir else {}),
               **cfg.extra_env}
        orch = self._children.get("orchestrator")
        ca = orch.env.get("FLOWMAKER_ORCHESTRATOR_TLS_CA_FILE", "") if orch is not None else ""
        if ca:  # a TLS-only orchestrator: verify it against the suite's CA (the token stays the identity)
            env["FLOWMAKER_GATEWAY_TLS_CA_FILE"] = ca
        self._progress("gateway", "starting")
        child = _spawn("gateway", [cfg.python, "-m", "services.gateway"], env, self.log_dir / "gateway.log")
        child.address = f"{cfg.host}:{port}"
        self._children["gateway"] = child
        deadline = time.monotonic() + cfg.startup_timeout_s
        while True:
            if child.proc.poll() is not None:
                raise StackError(f"gateway exited with code {child.proc.returncode} during start-up; last log "
                                 f"lines of {child.log_path}:\n{child.log_tail()}", field="gateway")
            try:
                with urllib.request.urlopen(f"http://{child.address}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"gateway not answering on {child.address} within {cfg.startup_timeout_s:g}s; "
                                 f"last log lines:\n{child.log_tail(10)}", field="gateway")
            time.sleep(0.2)
        self.gateway_url = f"http://{child.address}/v1"
        self.metrics["gateway"] = f"http://{child.address}/metrics"  # the gateway serves them on its own port
        self._progress("gateway", f"ready on {self.gateway_url} (OpenAI-compatible)")

    # -- stop -----------------------------------------------------------------------------

    def _stop_group(self, group: list[_Child], timeout_s: float) -> None:
        for c in group:
            self._progress(c.name, "stopping")
        # Recorded before any signal: once a service is gone its engines are reparented and untraceable.
        orphans = [d for c in group for d in descendants(c.proc.pid)]
        for c in group:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in group:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
            c.log_file.close()
        for pid, started in orphans:
            if start_time(pid) == started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for c in group:
            self._progress(c.name, f"stopped (exit {c.proc.returncode})")


def _run_async(coro: Any) -> Any:
    """Run a coroutine to completion from this synchronous launcher, also when the caller has a loop running."""
    import asyncio
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def default_state_dir() -> Path:
    """FlowMaker's own directory, `~/.flowmaker` (the default state file's, `up.log`'s and work dir's)."""
    return Path.home() / ".flowmaker"


def private_dir(path: Path, *, tighten: bool = False) -> Path:
    """`path` as a directory, created (with any missing parent) readable by its owner only, 0700. `tighten`: an
    existing one is made 0700 too; only for FlowMaker's own directories (`~/.flowmaker` and what it creates
    there), never one the user named, which may be shared (`/tmp`)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode=0o700)
        os.chmod(p, 0o700)  # mkdir's mode is masked by the umask: say it exactly
    if tighten and not missing:
        os.chmod(path, 0o700)
    return path


def write_state(path: Path, state: Mapping[str, Any]) -> None:
    """Atomically write the `flowmaker up` state file: 0600, in a directory created 0700 (`~/.flowmaker`, the
    default, is made 0700 also when it exists). It holds addresses and file paths, not secrets."""
    private_dir(path.parent, tighten=path.parent == default_state_dir())
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a leftover .tmp keeps its old mode through O_CREAT
        f.write(json.dumps(state, indent=2))
    tmp.replace(path)


def read_state(path: Path) -> dict[str, Any] | None:
    """The state of a running `flowmaker up`, or None when there is none (or its process is gone)."""
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    pid = state.get("pid")
    if not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return state
