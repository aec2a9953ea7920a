"""Settings of the deployer node agent (env prefix FLOWMAKER_DEPLOYER_), and its GPU inventory (NVML or settings)."""

from __future__ import annotations

import logging
import os
import pwd
import socket
from dataclasses import dataclass

from pydantic import Field, field_validator

from flowmaker.settings import DEFAULT_PORTS, ServiceSettings, settings_config

log = logging.getLogger(__name__)


class DeployerSettings(ServiceSettings):
    model_config = settings_config("deployer")

    port: int = Field(default=DEFAULT_PORTS["deployer"], ge=0, le=65535, description="gRPC port; 0 = any free port.")
    node: str = Field(default_factory=socket.gethostname, min_length=1,
                      description="Node name: the node's etcd key and the prefix of its GPU ids.")
    advertise_host: str = Field(default="", description="Host other services use to reach this deployer; empty = `host`.")
    gpu_type: str = Field(default="A6000", description="GPU type when NVML finds no GPU (catalog name).")
    gpu_count: int = Field(default=8, ge=1, le=64, description="Number of GPUs when NVML finds no GPU.")
    gpu_memory_gb: float = Field(default=0.0, ge=0, description="Memory per GPU when NVML finds no GPU; 0 = the catalog's.")
    use_nvml: bool = Field(default=True, description="Take the inventory from NVML (nvidia-ml-py) when GPUs are present.")
    backend: str = Field(default="emulated", description="Engine backend: emulated, vllm or trtllm.")
    engine_host: str = Field(default="127.0.0.1", description="Address engines bind to.")
    engine_time_scale: float = Field(default=1.0, gt=0, description="Emulated engines run their model clock this much faster.")
    engine_start_timeout_s: float = Field(default=120.0, gt=0, description="How long an engine may take to answer /health.")
    engine_stop_grace_s: float = Field(default=10.0, ge=0, description="SIGTERM-to-SIGKILL grace when stopping an engine.")
    engine_log_dir: str = Field(default="", description="Directory for engine stdout logs; empty = not written.")
    engine_api_keys: bool = Field(default=False, description="Start each engine with its own random API key (its /v1 "
                                  "then requires it), recorded in the instance record and returned by Deploy; "
                                  "`flowmaker up` and compose turn it on with TLS.")
    # Least privilege: engines run arbitrary model code, so where the deployer is root they may run as another
    # user who cannot read the suite's keys, tokens and etcd passwords (0600, owned by the deployer's user).
    # Off by default: a venv under a 0700 home (pip install --user, pyenv) is not executable by anyone else.
    engine_user: str = Field(default="", description="User (name or uid) engines run as, with that user's "
                             "primary group and no supplementary groups; needs the deployer to run as root. "
                             "Empty = the deployer's own user.")
    lease_ttl_s: int = Field(default=10, ge=2, description="TTL of the node's etcd lease; refreshed every TTL/3.")
    commit_retries: int = Field(default=20, ge=1, description="Retries of a GPU-memory transaction that lost a race.")
    resync_interval_s: float = Field(default=5.0, ge=0, description="How often the agent reconciles its instance "
                                     "records with its engine processes and GPU accounting; 0 = only at start.")
    # Observed load (the selector's "current load", docs/state.md "Load"): every READY engine's /metrics is
    # scraped, its output-token rate smoothed and written into its instance record.
    load_scrape_interval_s: float = Field(default=2.0, ge=0, description="How often READY engines' /metrics are "
                                          "scraped for their output-token rate; 0 = never (load stays plan-only).")
    load_half_life_s: float = Field(default=5.0, gt=0, description="Half-life (wall seconds) of the EWMA smoothing "
                                    "the observed output-token rate: a step in traffic shows half after this long.")
    load_peak_window_s: float = Field(default=60.0, gt=0, description="The recorded peak is the highest per-scrape "
                                      "rate over this many recent wall seconds.")
    load_report_min_change: float = Field(default=0.1, ge=0, description="The record is rewritten when the smoothed "
                                          "rate moved by more than this fraction (and 1 tok/s) since the last write...")
    load_report_max_interval_s: float = Field(default=5.0, gt=0, description="...or, while it is non-zero, when the "
                                              "last write is this old; keep it well under the readers' "
                                              "observed_load_max_age_s (flowmaker.orchestration.cluster, 15 s).")
    # Liveness of READY engines: a crash is seen at once (the process exits); a hang is not, so each READY engine's
    # /health is probed, and its progress (requests in flight, tokens produced) read from the load scrape. A hung
    # engine is killed (FAILED, ENGINE_HUNG) and the orchestrator's reconciler restarts it in place.
    liveness_interval_s: float = Field(default=2.0, ge=0, description="How often each READY engine's /health is "
                                       "probed; 0 = never (hangs go unseen).")
    liveness_timeout_s: float = Field(default=3.0, gt=0, description="A probe that gets no 200 within this "
                                      "long fails.")
    liveness_failures: int = Field(default=3, ge=1, description="This many failed probes in a row make the "
                                   "engine hung: it is killed and restarted.")
    liveness_stall_s: float = Field(default=60.0, ge=0, description="Requests in flight while the engine produces "
                                    "no token for this long also make it hung; 0 = off.")
    saturation_queue: float = Field(default=4.0, gt=0, description="An instance whose smoothed queue of waiting "
                                    "requests reaches this is saturated: offered to no new task.")
    saturation_slowdown: float = Field(default=4.0, gt=1, description="...and so is one whose recent requests take "
                                       "this many times as long as a lone request of their size.")

    @field_validator("engine_user")
    @classmethod
    def _engine_user(cls, v: str) -> str:
        v = v.strip()
        if v:
            uid, _ = resolve_user(v)  # an unknown user is an error here, at startup, not at the first Deploy
            # Never silently run engines as the deployer's (root's) own user, nor fail at the first Deploy.
            if uid != os.geteuid() and os.geteuid() != 0:
                raise ValueError(f"engine_user {v!r} needs the deployer to run as root (it runs as uid "
                                 f"{os.geteuid()}); unset it to run engines as the deployer's own user")
        return v

    @property
    def engine_ids(self) -> tuple[int, int] | None:
        """(uid, gid) engines are started with, None = unchanged (the deployer's own user)."""
        if not self.engine_user:
            return None
        ids = resolve_user(self.engine_user)
        return None if ids[0] == os.geteuid() else ids

    @property
    def advertise_address_host(self) -> str:
        return self.advertise_host or self.host


def resolve_user(user: str) -> tuple[int, int]:
    """(uid, primary gid) of a user name or numeric uid; ValueError naming engine_user when unknown. A uid
    with no passwd entry (containers often run as one) gets the group of the same number."""
    if user.isdigit():
        uid = int(user)
        if not 0 <= uid < 2**32 - 1:
            raise ValueError(f"engine_user {user!r}: not a valid uid")
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except KeyError:
            return uid, uid
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"engine_user {user!r}: no such user on this host") from None
    return pw.pw_uid, pw.pw_gid


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int  # CUDA device index on the node
    gpu_type: str
    memory_total_gb: float


def gpu_id(node: str, index: int, count: int) -> str:
    """'node0-gpu3', zero-padded once there are 10+ GPUs so string order is numeric order
    (placement breaks ties by GPU id), as `flowmaker.catalog.make_cluster` names them."""
    return f"{node}-gpu{index:0{len(str(count - 1))}d}"


def _nvml_inventory() -> list[GpuInfo] | None:
    """GPUs seen by NVML, or None when there is no NVML library, driver or GPU."""
    try:
        import pynvml  # the nvidia-ml-py package; imported lazily: absent on CPU-only hosts
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded: no usable GPU here
        log.info("NVML unavailable (%s); using the configured GPU inventory", e)
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(GpuInfo(i, _catalog_name(name), mem.total / 2**30))  # GiB: what datasheets call "GB"
        return out or None
    finally:
        pynvml.nvmlShutdown()


def _catalog_name(nvml_name: str) -> str:
    """'NVIDIA H200' / 'NVIDIA RTX A6000' -> the catalog's short name when known, else NVML's."""
    from flowmaker.catalog import get_gpu_type
    from flowmaker.errors import FlowMakerError

    for candidate in (nvml_name, nvml_name.removeprefix("NVIDIA ").strip()):
        try:
            return get_gpu_type(candidate).name
        except FlowMakerError:
            continue
    return nvml_name.removeprefix("NVIDIA ").strip()


def gpu_inventory(settings: DeployerSettings) -> list[GpuInfo]:
    """NVML's GPUs when present (and `use_nvml`), else `gpu_count` x `gpu_type` from settings."""
    if settings.use_nvml:
        found = _nvml_inventory()
        if found:
            log.info("NVML: %d GPU(s): %s", len(found), ", ".join(f"{g.gpu_type} {g.memory_total_gb:.0f}GB"
                                                                   for g in found))
            return found
    from flowmaker.catalog import get_gpu_type

    gt = get_gpu_type(settings.gpu_type)  # NotFound naming the field for an unknown type
    mem = settings.gpu_memory_gb or gt.memory_gb
    return [GpuInfo(i, gt.name, mem) for i in range(settings.gpu_count)]
