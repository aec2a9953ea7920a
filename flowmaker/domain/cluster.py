"""Models, GPU types, per-config profiles, and the cluster (GPUs + running instances)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from flowmaker.errors import InvalidSpec


@dataclass(frozen=True, slots=True)
class ModelArch:
    """Architecture facts from a Hugging Face config.json (what the roofline needs)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_ctx: int = 32768
    dtype_bytes: int = 2  # bf16/fp16
    tie_word_embeddings: bool = False
    num_experts: int = 0  # 0 = dense
    experts_per_tok: int = 0


@dataclass(frozen=True, slots=True)
class Model:
    """A model the selector may choose. `accuracy` is on the same 0..1 scale as the SLO."""

    id: str
    accuracy: float
    params_b: float
    active_params_b: float
    arch: ModelArch | None = None
    hf_id: str = ""
    family: str = ""
    source: str = ""  # where accuracy/architecture came from (URLs)

    def validate(self, path: str = "model") -> Model:
        if not self.id:
            raise InvalidSpec("must not be empty", field=f"{path}.id")
        if not 0.0 <= self.accuracy <= 1.0:
            raise InvalidSpec(f"model {self.id!r}: accuracy must be within [0, 1], got {self.accuracy}",
                              field=f"{path}.accuracy")
        if not self.params_b > 0:
            raise InvalidSpec(f"model {self.id!r}: must be > 0", field=f"{path}.params_b")
        if not 0 < self.active_params_b <= self.params_b * (1 + 1e-9):
            raise InvalidSpec(f"model {self.id!r}: must be in (0, params_b]", field=f"{path}.active_params_b")
        return self


@dataclass(frozen=True, slots=True)
class GpuType:
    """A GPU model from the catalog (datasheet numbers, on-demand price)."""

    name: str  # short name used everywhere: "A6000", "A100-80G", "H100", "H200", "L40S", "L4"
    memory_gb: float
    mem_bw_gbps: float  # HBM/GDDR bandwidth, GB/s
    bf16_tflops: float  # dense
    interconnect_gbps: float  # per-direction GPU-GPU bandwidth used for TP/PP traffic, GB/s
    interconnect: str  # "NVLink", "PCIe", ...
    price_per_hour: float  # USD per GPU-hour
    source: str = ""

    @property
    def price_per_gb_second(self) -> float:
        """Price of one GB of this GPU's memory for one second (cost model of the simulator)."""
        return self.price_per_hour / 3600.0 / self.memory_gb


class ProfileSource(enum.Enum):
    """How a profile was obtained."""

    ANALYTIC = "ANALYTIC"  # roofline estimate, instant
    MEASURED = "MEASURED"  # fitted from a sweep against a running engine; preferred


@dataclass(frozen=True, slots=True)
class Profile:
    """Latency/throughput/memory of one deployable (model, tp, pp) on one GPU type.

    Stage latency = calls * (fixed_s + prefill_s_per_token*in + decode_s_per_token*out);
    an instance sustains at most max_output_tokens_per_s output tokens/s at the reference request
    (1024 prompt / 256 output tokens: that figure already pays for the prompts' prefill).
    `decode_tokens_per_s` is the pure-decode throughput (a full batch, prefill excluded), the rate the
    engine model decodes at; 0 means unknown (older profiles), and `pure_decode_tokens_per_s` then
    falls back to `max_output_tokens_per_s`.
    """

    model_id: str
    tp: int
    pp: int
    memory_gb_per_gpu: float
    fixed_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    max_output_tokens_per_s: float
    gpu_type: str = ""
    source: ProfileSource = ProfileSource.ANALYTIC
    decode_tokens_per_s: float = 0.0

    @property
    def pure_decode_tokens_per_s(self) -> float:
        """Output tokens/s of a full batch that only decodes (no prefill); see the class doc."""
        return self.decode_tokens_per_s if self.decode_tokens_per_s > 0 else self.max_output_tokens_per_s

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def total_memory_gb(self) -> float:
        return self.memory_gb_per_gpu * self.tp * self.pp

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.model_id, self.tp, self.pp)

    def call_latency_s(self, input_tokens: int, output_tokens: int) -> float:
        return self.fixed_s + self.prefill_s_per_token * input_tokens + self.decode_s_per_token * output_tokens

    def validate(self, path: str = "profile") -> Profile:
        name = f"{self.model_id} tp={self.tp} pp={self.pp}"
        if self.tp < 1 or self.pp < 1:
            raise InvalidSpec(f"profile {name}: tp and pp must be >= 1", field=f"{path}.tp")
        for f in ("memory_gb_per_gpu", "fixed_s", "prefill_s_per_token", "decode_s_per_token"):
            v = getattr(self, f)
            if not (v >= 0 and math.isfinite(v)):
                raise InvalidSpec(f"profile {name}: must be a finite number >= 0, got {v}", field=f"{path}.{f}")
        if not (self.max_output_tokens_per_s > 0 and math.isfinite(self.max_output_tokens_per_s)):
            raise InvalidSpec(f"profile {name}: must be > 0, got {self.max_output_tokens_per_s}",
                              field=f"{path}.max_output_tokens_per_s")
        if not (self.decode_tokens_per_s >= 0 and math.isfinite(self.decode_tokens_per_s)):
            raise InvalidSpec(f"profile {name}: must be a finite number >= 0 (0: unknown), got "
                              f"{self.decode_tokens_per_s}", field=f"{path}.decode_tokens_per_s")
        return self


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of the cluster. `memory_used_gb` already includes every running instance."""

    id: str
    node: str
    memory_total_gb: float
    memory_used_gb: float = 0.0
    gpu_type: str = ""

    @property
    def memory_free_gb(self) -> float:
        return self.memory_total_gb - self.memory_used_gb


@dataclass(frozen=True, slots=True)
class Instance:
    """A running model instance and its current load (output tokens/s)."""

    id: str
    model_id: str
    tp: int
    pp: int
    gpu_ids: tuple[str, ...]
    load_output_tokens_per_s: float = 0.0
    endpoint: str = ""
    # GPU sharing: the slowdown its tasks tolerate (>= 1; 0 = unbounded); see docs/selection-spec.md.
    max_slowdown: float = 0.0
    # GPU sharing: fraction of the time it has a call in flight (measured); 0 = unknown.
    busy_share: float = 0.0

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.model_id, self.tp, self.pp)


@dataclass(frozen=True, slots=True)
class Cluster:
    gpus: tuple[Gpu, ...] = ()
    instances: tuple[Instance, ...] = ()

    def validate(self, path: str = "cluster") -> Cluster:
        ids: set[str] = set()
        for i, g in enumerate(self.gpus):
            if not g.id:
                raise InvalidSpec("must not be empty", field=f"{path}.gpus[{i}].id")
            if g.id in ids:
                raise InvalidSpec(f"duplicate GPU id {g.id!r}", field=f"{path}.gpus[{i}].id")
            ids.add(g.id)
            if not g.node:
                raise InvalidSpec(f"GPU {g.id!r}: must not be empty", field=f"{path}.gpus[{i}].node")
            if not (g.memory_total_gb > 0 and math.isfinite(g.memory_total_gb)):  # placement counts it in units
                raise InvalidSpec(f"GPU {g.id!r}: must be a finite number > 0, got {g.memory_total_gb}",
                                  field=f"{path}.gpus[{i}].memory_total_gb")
            if not 0 <= g.memory_used_gb <= g.memory_total_gb * (1 + 1e-9):
                raise InvalidSpec(f"GPU {g.id!r}: must be within [0, memory_total_gb], got {g.memory_used_gb}",
                                  field=f"{path}.gpus[{i}].memory_used_gb")
        iids: set[str] = set()
        for i, inst in enumerate(self.instances):
            if not inst.id or inst.id in iids:
                raise InvalidSpec(f"instance id {inst.id!r} empty or duplicate", field=f"{path}.instances[{i}].id")
            iids.add(inst.id)
            for gid in inst.gpu_ids:
                if gid not in ids:
                    raise InvalidSpec(f"instance {inst.id!r} is on unknown GPU {gid!r}",
                                      field=f"{path}.instances[{i}].gpu_ids")
            if not inst.load_output_tokens_per_s >= 0:
                raise InvalidSpec(f"instance {inst.id!r}: must be >= 0",
                                  field=f"{path}.instances[{i}].load_output_tokens_per_s")
            if not 0.0 <= inst.busy_share <= 1.0:
                raise InvalidSpec(f"instance {inst.id!r}: must be within [0, 1], got {inst.busy_share}",
                                  field=f"{path}.instances[{i}].busy_share")
            if not (inst.max_slowdown == 0 or inst.max_slowdown >= 1) or not math.isfinite(inst.max_slowdown):
                raise InvalidSpec(f"instance {inst.id!r}: must be 0 (unbounded) or >= 1, got {inst.max_slowdown}",
                                  field=f"{path}.instances[{i}].max_slowdown")
        return self
