"""Engine backends: how to launch one engine process (command + env) and the lifecycle of that process.

A backend is pure: `build_command(spec)` / `build_env(spec)` only compute what to run. `EngineProcess`
does the I/O: start the process in its own process group (engines such as vLLM fork workers, and a
stop must reach them all), wait for `/health`, stop (SIGTERM to the group, then SIGKILL), notice an
unexpected exit, and scrape `/metrics` into a few numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import quote

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from flowmaker.cancel import wait_for
from flowmaker.domain import Profile
from flowmaker.errors import InvalidSpec, Unavailable
from flowmaker.launcher.procs import exec_dying_with_parent
from flowmaker.limits import check_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything a backend needs to launch one instance. `gpu_indices` are the node-local
    CUDA indices of the placement (tp*pp of them); `port` 0 is allowed only for backends that
    announce their port (`EngineBackend.announces_port`)."""

    instance_id: str
    model_id: str
    hf_id: str
    tp: int
    pp: int
    gpu_indices: tuple[int, ...]
    host: str
    port: int
    profile: Profile
    extra_args: tuple[str, ...] = ()

    def validate(self) -> EngineSpec:
        if not self.instance_id:
            raise InvalidSpec("must not be empty", field="spec.instance_id")
        check_id(self.instance_id, "spec.instance_id")  # it names the log file and the process
        if not self.model_id:
            raise InvalidSpec("must not be empty", field="spec.model_id")
        if self.tp < 1 or self.pp < 1:
            raise InvalidSpec(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}", field="spec.tp")
        if len(self.gpu_indices) != self.tp * self.pp:
            raise InvalidSpec(f"needs tp*pp = {self.tp * self.pp} GPU indices, got {list(self.gpu_indices)}",
                              field="spec.gpu_indices")
        if len(set(self.gpu_indices)) != len(self.gpu_indices) or any(i < 0 for i in self.gpu_indices):
            raise InvalidSpec(f"GPU indices must be distinct and >= 0, got {list(self.gpu_indices)}",
                              field="spec.gpu_indices")
        if not 0 <= self.port <= 65535:
            raise InvalidSpec(f"must be within [0, 65535], got {self.port}", field="spec.port")
        return self


class EngineStartError(Unavailable):
    """The engine exited or never answered /health while starting."""

    reason = "ENGINE_START_FAILED"


class EngineBackend(ABC):
    """How to run one kind of engine. Subclasses set `name` and implement `build_command`."""

    name: ClassVar[str]
    # True when the engine prints `LISTENING <port>` once bound, so `spec.port` may be 0.
    announces_port: ClassVar[bool] = False
    # Whether the engine itself refuses /v1 calls without the per-instance key (from ENGINE_API_KEY_VARS).
    # One that cannot (trtllm-serve) is started behind `flowmaker.engine.keyproxy`, bound to loopback.
    checks_api_key: ClassVar[bool] = True
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str] = "/metrics"

    @abstractmethod
    def build_command(self, spec: EngineSpec) -> list[str]:
        """argv of the engine process."""

    def build_env(self, spec: EngineSpec) -> dict[str, str]:
        """Variables added to the inherited environment: the placement's GPUs."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices)}

    def served_model_name(self, spec: EngineSpec) -> str:
        """The `model` field clients must send in OpenAI requests to this engine."""
        return spec.model_id

    def parse_metrics(self, content_type: str, body: str) -> dict[str, float]:
        """Turn the engine's /metrics into {running, waiting, kv_usage, generation_tokens_total,
        prompt_tokens_total, requests_finished_total, e2e_latency_mean_s} (keys present when known)."""
        return parse_vllm_prometheus(body)


_PROM_KEYS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM < 0.10 name
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:request_success_total": "requests_finished_total",
}


def parse_vllm_prometheus(text: str) -> dict[str, float]:
    """Sum each known sample over its labels (e.g. several `finished_reason`s)."""
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    out: dict[str, float] = {}
    for sample, key in _PROM_KEYS.items():
        if sample in sums:
            out[key] = sums[sample]
    n = sums.get("vllm:e2e_request_latency_seconds_count", 0.0)
    if n > 0:
        out["e2e_latency_mean_s"] = sums["vllm:e2e_request_latency_seconds_sum"] / n
        out["e2e_latency_sum_s"] = sums["vllm:e2e_request_latency_seconds_sum"]
        out["e2e_latency_count"] = n
    return out


ExitCallback = Callable[["EngineProcess", int], Awaitable[None] | None]

# What an engine inherits from the deployer: only what a process, a GPU runtime or an inference engine reads
# (an allowlist, so that a new suite setting -- a TLS key path, an etcd endpoint, a token file -- never reaches
# an engine by default). Within it, credentials are still dropped by name, except the Hugging Face token of
# engines that download weights. The engine's own settings come on its command line and in `build_env`.
_ENGINE_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "LD_LIBRARY_PATH",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "XDG_CACHE_HOME",
    # The local stack's marker (its work dir): how `flowmaker down` and the fault tools find its engines.
    "FLOWMAKER_STACK",
})
_ENGINE_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "VLLM_",
                        "TLLM_", "TRTLLM_", "TORCH_", "PYTORCH_", "OTEL_", "FLOWMAKER_ENGINE_")
_SECRET_NAME = re.compile(r"(?i)(API_?KEY|SECRET|PASSWORD|TOKEN|CREDENTIAL|PRIVATE_?KEY|HEADERS)")
_ENGINE_NEEDS = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_TOKEN"})


# How long `EngineProcess.stop` waits for an engine's exit to be reported after SIGKILL (the kernel kills at once).
KILL_WAIT_S = 10.0
ENGINE_API_KEY_VARS = ("FLOWMAKER_ENGINE_API_KEY", "VLLM_API_KEY")  # emulated engine (and keyproxy), vLLM


def engine_base_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What an engine inherits of the deployer's environment: the allowlisted names, minus credentials."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items()
            if (k in _ENGINE_ENV_NAMES or k.startswith(_ENGINE_ENV_PREFIXES))
            and (k in _ENGINE_NEEDS or not _SECRET_NAME.search(k))}


def engine_log_path(log_dir: str, instance_id: str) -> str:
    """`<log_dir>/<instance id>.log`, never outside `log_dir` whatever the id holds ("../../tmp/x"):
    the id is percent-encoded into one path component and the result checked."""
    name = quote(instance_id, safe="") or "_"
    if name.startswith("."):
        name = "%2E" + name[1:]
    path = os.path.join(log_dir, name + ".log")
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(log_dir):
        raise InvalidSpec(f"instance id {instance_id[:64]!r} cannot name a log file", field="request_id")
    return path


class EngineProcess:
    """One running engine. `on_exit(proc, returncode)` is called when the process ends without
    `stop()` having been asked for: a crash (also during start)."""

    def __init__(self, backend: EngineBackend, spec: EngineSpec, *, env: Mapping[str, str] | None = None,
                 on_exit: ExitCallback | None = None, log_path: str | None = None, keep_lines: int = 200,
                 api_key: str = "", user: tuple[int, int] | None = None) -> None:
        spec.validate()
        if spec.port == 0 and not backend.announces_port:
            raise InvalidSpec(f"backend {backend.name!r} needs a concrete port", field="spec.port")
        self.backend = backend
        self.spec = spec
        self.port = spec.port
        self._env = dict(env or {})
        # The key the engine's /v1 API requires: in the environment (never on the command line, which any
        # local user can read), under the names the engines read it from.
        self.api_key = api_key
        if api_key:
            self._env.update({k: api_key for k in ENGINE_API_KEY_VARS})
        self._on_exit = on_exit
        # (uid, gid) to run as (`DeployerSettings.engine_user`), None = ours. The log file stays ours either
        # way: the engine only writes its stdout pipe, which this process copies into the file.
        self._user = user
        self._log_path = log_path
        self._lines: deque[str] = deque(maxlen=keep_lines)
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._port_known = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.exited = asyncio.Event()
        if self.port:
            self._port_known.set()

    # ---- state -------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    @property
    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def base_url(self) -> str:
        host = self.spec.host if self.spec.host not in ("0.0.0.0", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def last_output(self, lines: int = 20) -> str:
        return "\n".join(list(self._lines)[-lines:])

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("already started")
        argv = self.backend.build_command(self.spec)
        env = {**engine_base_env(), **self.backend.build_env(self.spec), **self._env}
        log.info("starting %s engine %s: %s", self.backend.name, self.spec.instance_id, " ".join(argv))
        if shutil.which(argv[0], path=env.get("PATH")) is None:  # the wrapper would only exit 127
            raise EngineStartError(f"cannot run {argv[0]!r} for {self.backend.name} engine {self.spec.instance_id}: "
                                   "no such executable (on PATH)", field="backend")
        if self.api_key and not self.backend.checks_api_key:
            # The engine listens on loopback only; the key check listens where the engine would have.
            argv = [sys.executable, "-m", "flowmaker.engine.keyproxy", "--host", self.spec.host,
                    "--port", str(self.spec.port), "--", *argv]
        as_user: dict[str, Any] = {}
        if self._user is not None:
            # Its own uid and primary group, none of ours (extra_groups=[] drops root's supplementary groups),
            # and a working directory it can enter: the deployer's may be a 0700 home.
            as_user = {"user": self._user[0], "group": self._user[1], "extra_groups": [], "cwd": "/"}
        try:
            # Its own session (a stop reaches its workers), but never an orphan: it dies with the deployer
            # (setpriv sets the parent-death signal after the uid change, which would otherwise clear it).
            self._proc = await asyncio.create_subprocess_exec(
                *exec_dying_with_parent(argv), env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, **as_user)
        except (FileNotFoundError, PermissionError) as e:
            raise EngineStartError(f"cannot run {argv[0]!r} for {self.backend.name} engine "
                                   f"{self.spec.instance_id}: {e}", field="backend") from None
        self._tasks = [asyncio.create_task(self._read_output()), asyncio.create_task(self._watch())]

    async def _read_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        logf = open(self._log_path, "a") if self._log_path else None
        try:
            async for raw in self._proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                self._lines.append(line)
                if logf:
                    logf.write(line + "\n")
                    logf.flush()
                if not self._port_known.is_set() and line.startswith("LISTENING "):
                    with contextlib.suppress(ValueError):
                        self.port = int(line.split()[1])
                        self._port_known.set()
        finally:
            if logf:
                logf.close()

    async def _watch(self) -> None:
        assert self._proc is not None
        rc = await self._proc.wait()
        self.exited.set()
        if self._stopping:
            return
        log.warning("%s engine %s exited unexpectedly with code %s", self.backend.name, self.spec.instance_id, rc)
        # The leader is gone; take any workers it left behind with it.
        self._kill_group(signal.SIGKILL)
        if self._on_exit is not None:
            res = self._on_exit(self, rc)
            if asyncio.iscoroutine(res):
                await res

    async def wait_healthy(self, timeout_s: float = 120.0, interval_s: float = 0.1) -> None:
        """Return once GET /health answers 200. If the process exits first, or the timeout
        passes, the process group is stopped and EngineStartError says why."""
        if self._proc is None:
            raise RuntimeError("not started")
        deadline = time.monotonic() + timeout_s
        what = f"{self.backend.name} engine {self.spec.instance_id}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
            while True:
                if self.exited.is_set() or self._proc.returncode is not None:
                    await self._drain_output()
                    raise EngineStartError(f"{what} exited with code {self._proc.returncode} before becoming "
                                           f"healthy; last output:\n{self.last_output()}")
                if self._port_known.is_set():
                    try:
                        async with http.get(self.base_url + self.backend.health_path) as r:
                            if r.status == 200:
                                return
                    except (aiohttp.ClientError, TimeoutError):
                        pass  # not listening yet
                if time.monotonic() >= deadline:
                    await self.stop(grace_s=2.0)
                    raise EngineStartError(f"{what} did not become healthy within {timeout_s:g}s "
                                           f"(GET {self.backend.health_path} on port {self.port}); stopped it; "
                                           f"last output:\n{self.last_output()}", reason="ENGINE_START_TIMEOUT")
                await asyncio.sleep(interval_s)

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; return the exit code."""
        if self._proc is None:
            return None
        self._stopping = True
        if self._proc.returncode is None:
            self._kill_group(signal.SIGTERM)
            try:
                await wait_for(self._proc.wait(), grace_s)
            except TimeoutError:
                log.warning("%s engine %s ignored SIGTERM for %ss; killing", self.backend.name,
                            self.spec.instance_id, grace_s)
        self._kill_group(signal.SIGKILL)  # stragglers (workers) even when the leader is gone
        try:
            # bounded: a shutdown must end even if the exit is never reported (a test run once hung for 10 minutes
            # in a deployer's shutdown, its child watcher still waiting on a pid)
            await wait_for(self._proc.wait(), KILL_WAIT_S)
        except TimeoutError:
            log.error("%s engine %s (pid %s) was not seen to exit %ss after SIGKILL; left behind", self.backend.name,
                      self.spec.instance_id, self._proc.pid, KILL_WAIT_S)
        await self._drain_output()
        for t in self._tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        return self._proc.returncode

    async def _drain_output(self) -> None:
        if self._tasks and not self._tasks[0].done():
            with contextlib.suppress(TimeoutError):
                await wait_for(asyncio.shield(self._tasks[0]), 1.0)

    def _kill_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        # start_new_session=True made the child a group leader: its pgid is its pid.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    # ---- observation -------------------------------------------------------------------

    async def fetch_metrics(self, timeout_s: float = 5.0) -> tuple[str, str]:
        """GET /metrics: (content type, body); Unavailable when it fails or answers other than 200."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
                async with http.get(self.base_url + self.backend.metrics_path) as r:
                    body = await r.text()
                    if r.status != 200:
                        raise Unavailable(f"{self.backend.name} engine {self.spec.instance_id}: /metrics "
                                          f"answered {r.status}")
                    return r.content_type, body
        except (aiohttp.ClientError, TimeoutError) as e:
            raise Unavailable(f"{self.backend.name} engine {self.spec.instance_id}: /metrics failed: {e}") from None

    async def probe(self, timeout_s: float = 3.0) -> str:
        """One liveness probe: GET the health path within `timeout_s`. "" when it answered 200, else why not
        (a stopped or wedged process still accepts the connection: only the timeout tells)."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
                async with http.get(self.base_url + self.backend.health_path) as r:
                    return "" if r.status == 200 else f"answered {r.status}"
        except TimeoutError:
            return f"no answer within {timeout_s:g}s"
        except aiohttp.ClientError as e:
            return f"{type(e).__name__}: {e}"

    async def scrape_metrics(self, timeout_s: float = 5.0) -> dict[str, float]:
        """GET /metrics and parse it with the backend's parser."""
        return self.backend.parse_metrics(*await self.fetch_metrics(timeout_s))


def parse_trtllm_iteration_stats(body: str) -> dict[str, float]:
    """trtllm-serve's /metrics is a JSON list of per-iteration stats; the last one is the newest."""
    try:
        stats = json.loads(body)
    except json.JSONDecodeError:
        return parse_vllm_prometheus(body)  # some builds expose Prometheus text instead
    if not isinstance(stats, list) or not stats:
        return {}
    last = stats[-1]
    out: dict[str, float] = {}
    if "numActiveRequests" in last:
        out["running"] = float(last["numActiveRequests"])
    if "numQueuedRequests" in last:
        out["waiting"] = float(last["numQueuedRequests"])
    kv = last.get("kvCacheStats") or {}
    if kv.get("maxNumBlocks"):
        out["kv_usage"] = float(kv.get("usedNumBlocks", 0)) / float(kv["maxNumBlocks"])
    return out
