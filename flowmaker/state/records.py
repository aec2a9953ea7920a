"""The JSON records stored under the node, GPU and instance keys, and the live cluster view built from them.

The deployer writes these; the selector and orchestrator read them. Field names are
the domain's (snake_case), so a record maps 1:1 onto `flowmaker.domain` objects.
Unknown fields are ignored on read, so adding one (with a default) is compatible.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from flowmaker.domain import Cluster, Gpu, Instance
from flowmaker.state import keys
from flowmaker.state.store import StateStore


class InstanceState(enum.Enum):
    """Mirrors flowmaker.common.v1.Instance.State."""

    PENDING = "PENDING"  # memory reserved (e.g. by a selection commit); engine not started yet
    STARTING = "STARTING"  # engine process launching / not yet healthy
    READY = "READY"  # engine answers /health; endpoint is usable
    DRAINING = "DRAINING"  # release in progress: no new work, engine being stopped
    FAILED = "FAILED"  # could not start or exited; `reason` says why; its memory is already freed
    # Its node's lease expired for longer than the reconciler's grace: presumed dead, its tasks re-selected.
    # Memory stays counted on the node's GPUs (out of the live view anyway) until the node's agent comes
    # back and stops it (`NodeAgent._reconcile`).
    LOST = "LOST"


# States whose GPU memory counts as used and which a selection may reuse (DRAINING: neither).
LIVE_STATES = (InstanceState.PENDING, InstanceState.STARTING, InstanceState.READY)
MEMORY_DIGITS = 6  # GB amounts are rounded to 1 kB, so add-then-subtract returns to exactly 0


def new_instance_id(model_id: str) -> str:
    """A fresh instance id: the model's slug and 8 random hex digits (`llama-3-2-1b-instruct-1a2b3c4d`)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model_id.lower()).strip("-")[:40].strip("-") or "instance"
    return f"{slug}-{uuid.uuid4().hex[:8]}"


# Reuse references whose "task" id starts with this belong to profiling jobs (services/profiler), not tasks:
# the profiler releases them itself, so the orchestrator's reconciler never takes them for leaks.
PROFILING_OWNER_PREFIX = "profiling-"
# The task id the reconciler releases an unreferenced instance with: it names no task, so the deployer stops
# the instance only if no reference is left when it looks (a concurrent reuse commit keeps it alive).
ORPHAN_GC_TASK_ID = "reconciler-orphan-gc"


def reuse_value(instance_id: str, task_id: str, load: float = 0.0) -> dict[str, Any]:
    """The record under keys.reuse(instance, task): the load (output tokens/s) this task puts on the instance."""
    return {"instance_id": instance_id, "task_id": task_id, "load_output_tokens_per_s": load}


def reuse_load(value: Any) -> float:
    """The load a reuse record declares; 0 for anything unreadable (one bad record must not break reads)."""
    if isinstance(value, dict):
        try:
            return max(0.0, float(value.get("load_output_tokens_per_s", 0.0)))
        except (TypeError, ValueError):
            return 0.0
    return 0.0


def _from(cls: Any, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


# ---- engine API keys, sealed ------------------------------------------------------------------------
# AES-256-GCM under SHA-256(the secret file's text), the instance id as associated data (a sealed key cannot be
# moved to another record), and a nonce derived from (id, key), so equal records encode to equal bytes.
_SEALED_PREFIX = "v1:"
_engine_key_aead: Any = None
_engine_key_mac = b""


def configure_engine_key_sealing(secret_file: str | None) -> None:
    """Seal engine API keys in instance records with the secret in `secret_file` (None: store them as given).
    The deployer and the orchestrator are configured with the same file (`engine_key_secret_file`)."""
    global _engine_key_aead, _engine_key_mac
    if not secret_file:
        _engine_key_aead, _engine_key_mac = None, b""
        return
    import hashlib

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    with open(secret_file, "rb") as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"engine key secret file {secret_file} is empty")
    _engine_key_aead = AESGCM(hashlib.sha256(b"flowmaker engine-key seal\0" + secret).digest())
    _engine_key_mac = hashlib.sha256(b"flowmaker engine-key nonce\0" + secret).digest()


def seal_engine_key(instance_id: str, api_key: str) -> str:
    import base64
    import hashlib
    import hmac

    assert _engine_key_aead is not None, "configure_engine_key_sealing first"
    nonce = hmac.new(_engine_key_mac, instance_id.encode() + b"\0" + api_key.encode(), hashlib.sha256).digest()[:12]
    ct = _engine_key_aead.encrypt(nonce, api_key.encode(), instance_id.encode())
    return _SEALED_PREFIX + base64.urlsafe_b64encode(nonce + ct).decode()


def unseal_engine_key(instance_id: str, sealed: str) -> str:
    """The engine key sealed in `sealed`, or "" when it cannot be opened (another secret, another record)."""
    import base64

    if _engine_key_aead is None or not sealed.startswith(_SEALED_PREFIX):
        return ""
    try:
        raw = base64.urlsafe_b64decode(sealed[len(_SEALED_PREFIX):])
        return str(_engine_key_aead.decrypt(raw[:12], raw[12:], instance_id.encode()).decode())
    except Exception:  # InvalidTag, bad base64: not ours to open
        return ""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """Under keys.node(); bound to the node's lease: present = the node is alive."""

    node: str
    gpu_type: str
    gpu_count: int
    endpoint: str = ""  # the node's deployer gRPC address (host:port)
    backend: str = ""  # engine backend name
    started_at: float = 0.0  # unix time the agent registered

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> NodeRecord:
        return _from(NodeRecord, data)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class GpuRecord:
    """Under keys.gpu(node, id). `memory_used_gb` is the sum over instances holding memory on it;
    every change to it goes through a transaction comparing this key's mod_revision."""

    id: str
    node: str
    gpu_type: str
    memory_total_gb: float
    memory_used_gb: float = 0.0
    index: int = 0  # device index on the node (CUDA_VISIBLE_DEVICES)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> GpuRecord:
        return _from(GpuRecord, data)  # type: ignore[no-any-return]

    def to_domain(self) -> Gpu:
        return Gpu(self.id, self.node, self.memory_total_gb, self.memory_used_gb, self.gpu_type)

    @property
    def memory_free_gb(self) -> float:
        return self.memory_total_gb - self.memory_used_gb

    def with_used(self, delta_gb: float) -> GpuRecord:
        """This GPU with `delta_gb` more (or, negative, less) memory used; never below 0."""
        return replace(self, memory_used_gb=round(max(0.0, self.memory_used_gb + delta_gb), MEMORY_DIGITS))


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """Under keys.instance(id)."""

    id: str
    model_id: str
    tp: int
    pp: int
    node: str
    gpu_ids: tuple[str, ...]
    memory_gb_per_gpu: float
    state: InstanceState = InstanceState.STARTING
    endpoint: str = ""  # base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:41234
    reason: str = ""  # why FAILED (human-readable)
    failure_reason: str = ""  # why FAILED (stable UPPER_SNAKE, e.g. ENGINE_EXITED, ENGINE_START_FAILED)
    load_output_tokens_per_s: float = 0.0  # PLANNED load: the sum of the reuse loads of the tasks using it
    engine: str = ""  # backend name ("emulated", "vllm", "trtllm")
    memory_reserved: bool = True  # False once its GPU memory has been given back (FAILED / released)
    created_at: float = 0.0  # unix time
    # The engine process (0 / "" before it starts): a restarted deployer on the same machine kills an
    # engine its previous life left running, once `flowmaker.launcher.procs.is_same_alive` confirms it.
    engine_pid: int = 0
    engine_identity: str = ""  # procs.identity(engine_pid): "<boot id>/<start time>"
    # The per-instance key the engine's /v1 API requires ("" = none): set by the deployer when it starts the
    # engine; the orchestrator sends it on every call. etcd is mTLS-only in a secure stack; the API never shows it.
    # With a sealing secret configured (`configure_engine_key_sealing`: the deployer and the orchestrator hold it)
    # it is stored only sealed, in `api_key_sealed`, so whoever else reads instance records sees ciphertext.
    api_key: str = ""
    api_key_sealed: str = ""
    # OBSERVED load, written by the node agent from the engine's /metrics (docs/state.md "Load"): output
    # tokens/s in MODEL seconds (the unit of Profile.max_output_tokens_per_s), EWMA-smoothed, and the highest
    # per-scrape rate of the recent window. `observed_load_at` is the unix time of that measurement (0 =
    # never measured); readers ignore an observation older than their max age.
    observed_load_output_tokens_per_s: float = 0.0
    observed_load_peak_output_tokens_per_s: float = 0.0
    observed_load_at: float = 0.0
    # MEASURED saturation from the same scrape (SaturationMeter in services/deployer/node.py): smoothed queue
    # of waiting requests, recent mean e2e latency (model s) and its ratio to a lone request's, and whether
    # the instance is full. A fresh `saturated` makes readers treat the instance as having no headroom.
    observed_queue: float = 0.0
    observed_latency_s: float = 0.0
    observed_slowdown: float = 0.0
    saturated: bool = False
    # MEASURED busy share from the same scrape (BusyMeter in services/deployer/node.py): the smoothed fraction of
    # the time the engine had a call in flight, in [0, 1] (0 = unknown: a backend that exports neither a busy-time
    # counter nor a running gauge). Written with the observed load, so `observed_load_at` is its freshness too;
    # readers put a fresh one into the selector's view (`Instance.busy_share`, flowmaker.sharing).
    observed_busy_share: float = 0.0
    # LIVENESS (LivenessMeter in services/deployer/node.py): the unix time since which the engine has not answered
    # its /health probe (0 = it answers). A READY instance with this set may be hung: routing prefers its
    # replicas, and the node agent kills and fails it once enough probes in a row have failed.
    unresponsive_since: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        d["gpu_ids"] = list(self.gpu_ids)
        if _engine_key_aead is not None and self.api_key:
            d["api_key_sealed"], d["api_key"] = seal_engine_key(self.id, self.api_key), ""
        return d

    @staticmethod
    def from_json(data: dict[str, Any]) -> InstanceRecord:
        d = dict(data)
        d["state"] = InstanceState(d.get("state", "STARTING"))
        d["gpu_ids"] = tuple(d.get("gpu_ids", ()))
        if _engine_key_aead is not None and d.get("api_key_sealed") and not d.get("api_key"):
            d["api_key"] = unseal_engine_key(str(d.get("id", "")), str(d["api_key_sealed"]))
        return _from(InstanceRecord, d)  # type: ignore[no-any-return]

    def to_domain(self) -> Instance:
        return Instance(self.id, self.model_id, self.tp, self.pp, self.gpu_ids, self.load_output_tokens_per_s,
                        self.endpoint)


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The live cluster as the selector sees it, plus what a commit must re-check.

    `etags` maps every GPU and instance key read to its mod_revision at `revision`:
    a selection commit adds `Compare.unchanged(key, etags[key])` for each GPU it places
    on and each instance it reuses, so a concurrent change aborts the commit.

    Loads (see `flowmaker.orchestration.cluster.read_live_cluster`): `cluster`'s instances carry the load
    the selector must assume (max of planned and fresh observed), while the `instances` records keep the
    PLANNED load (the sum of the reuse mappings), which is what a commit adds a task's planned load to.
    `planned_loads` / `observed_loads` show both inputs per instance id (observed: fresh ones only).
    """

    cluster: Cluster
    revision: int
    etags: dict[str, int] = field(default_factory=dict)
    gpus: dict[str, GpuRecord] = field(default_factory=dict)  # by GPU id
    instances: dict[str, InstanceRecord] = field(default_factory=dict)  # by instance id (alive only)
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    planned_loads: dict[str, float] = field(default_factory=dict)  # by instance id
    observed_loads: dict[str, float] = field(default_factory=dict)  # by instance id, fresh observations only


async def read_cluster(store: StateStore) -> ClusterView:
    """Alive nodes' GPUs and their PENDING/STARTING/READY instances. Three prefix reads; the GPU and
    instance etags are what matters for commits (a node dying between reads only makes the
    view conservative: its GPUs are left out)."""
    nodes_l = await store.get_prefix(keys.NODES)
    nodes = {}
    for kv in nodes_l.items:
        if isinstance(kv.value, dict):
            n = NodeRecord.from_json(kv.value)
            nodes[n.node] = n
    gpus_l = await store.get_prefix(keys.GPUS)
    inst_l = await store.get_prefix(keys.INSTANCES)
    etags: dict[str, int] = {}
    gpus: dict[str, GpuRecord] = {}
    for kv in gpus_l.items:
        g = GpuRecord.from_json(kv.value)
        if g.node in nodes:
            gpus[g.id] = g
            etags[kv.key] = kv.mod_revision
    instances: dict[str, InstanceRecord] = {}
    for kv in inst_l.items:
        i = InstanceRecord.from_json(kv.value)
        if i.node in nodes and i.state in LIVE_STATES:
            instances[i.id] = i
            etags[kv.key] = kv.mod_revision
    cluster = Cluster(tuple(g.to_domain() for g in sorted(gpus.values(), key=lambda g: g.id)),
                      tuple(i.to_domain() for i in sorted(instances.values(), key=lambda i: i.id)))
    return ClusterView(cluster, inst_l.revision, etags, gpus, instances, nodes)
