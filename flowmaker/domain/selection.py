"""The SelectVariant request and result, exactly as `spec/selection.md` defines them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flowmaker.domain.cluster import Cluster, Model, Profile
from flowmaker.domain.workflow import Slo, Workflow
from flowmaker.errors import InvalidSpec


class CapacityModel(enum.Enum):
    """What an instance's capacity counts (docs/selection-spec.md)."""

    OUTPUT_TOKENS = "OUTPUT_TOKENS"  # the base contract
    BUSY_TIME = "BUSY_TIME"  # prefill + decode busy time at each workflow's mean request


class GpuSharing(enum.Enum):
    """How the selector treats instances placed on the same GPU (docs/selection-spec.md)."""

    IGNORE = "IGNORE"  # the base contract: every instance as if alone on its GPUs
    INTERFERENCE = "INTERFERENCE"  # busy shares per GPU, compute budget, latency inflation, load-aware placement


# Replicas per new instance the selection extension allows (docs/selection-spec.md).
MAX_REPLICAS = 16
MAX_GPU_PRICE_GB = 10_000.0  # options.gpu_price_gb: a GPU priced above 10 TB of memory is a typo, not a price


@dataclass(frozen=True, slots=True)
class SelectionOptions:
    utilization_cap: float = 1.0  # u in (0, 1]: an instance may run at most u * max_output_tokens_per_s
    allow_reuse: bool = True
    time_budget_s: float = 0.0  # 0 = the strategy's default (exhaustive / bayesopt stop here)
    max_trials: int = 0  # bayesopt: 0 = default (200)
    seed: int = 0  # bayesopt / randomised strategies
    max_replicas: int = 1  # replicas per new instance (docs/selection-spec.md extension); 1 = base contract
    capacity_model: CapacityModel = CapacityModel.OUTPUT_TOKENS
    gpu_sharing: GpuSharing = GpuSharing.IGNORE
    interference: float = 1.0  # kappa of the INTERFERENCE model (flowmaker.sharing)
    gpu_price_gb: float = 0.0  # priced GPUs (docs/selection-spec.md extension): each new GPU costs this much memory more

    def validate(self, path: str = "options") -> SelectionOptions:
        if not 0.0 < self.utilization_cap <= 1.0:
            raise InvalidSpec(f"must be within (0, 1], got {self.utilization_cap}", field=f"{path}.utilization_cap")
        if not self.time_budget_s >= 0:
            raise InvalidSpec("must be >= 0", field=f"{path}.time_budget_s")
        if self.max_trials < 0:
            raise InvalidSpec("must be >= 0", field=f"{path}.max_trials")
        if not 1 <= self.max_replicas <= MAX_REPLICAS:
            raise InvalidSpec(f"must be within [1, {MAX_REPLICAS}] (0 in the API means 1), got {self.max_replicas}",
                              field=f"{path}.max_replicas")
        if not 0.0 <= self.interference <= 4.0:
            raise InvalidSpec(f"must be within [0, 4], got {self.interference}", field=f"{path}.interference")
        if not 0.0 <= self.gpu_price_gb <= MAX_GPU_PRICE_GB:
            raise InvalidSpec(f"must be within [0, {MAX_GPU_PRICE_GB:g}] GB, got {self.gpu_price_gb}",
                              field=f"{path}.gpu_price_gb")
        return self


def priced_memory_gb(memory_gb_per_gpu: float, gpus: int, gpu_price_gb: float) -> float:
    """What the objective charges for an instance (or a group) on `gpus` GPUs: its memory, each GPU priced
    `gpu_price_gb` more (docs/selection-spec.md, priced GPUs; 0: the memory alone, the base contract)."""
    return gpus * (memory_gb_per_gpu + gpu_price_gb)


def default_gpu_price(setting: float, cluster: Cluster) -> float:
    """`options.gpu_price_gb` for a deployment setting: the setting when >= 0, else (negative: "one GPU") the
    memory of the cluster's largest GPU, so that a GPU an instance spans is charged as if its whole memory were
    taken (0 on a cluster without GPUs)."""
    if setting >= 0:
        return setting
    return min(MAX_GPU_PRICE_GB, max((g.memory_total_gb for g in cluster.gpus), default=0.0))


@dataclass(frozen=True, slots=True)
class SelectionRequest:
    slo: Slo
    workflows: tuple[Workflow, ...]
    models: tuple[Model, ...]
    profiles: tuple[Profile, ...]
    cluster: Cluster
    options: SelectionOptions = field(default_factory=SelectionOptions)

    def validate(self) -> SelectionRequest:
        """Check every field; raise InvalidSpec naming the first bad one."""
        self.slo.validate("slo")
        if not self.workflows:
            raise InvalidSpec("at least one approved workflow is required", field="workflows")
        wids: set[str] = set()
        for i, w in enumerate(self.workflows):
            w.validate(f"workflows[{i}]")
            if w.id in wids:
                raise InvalidSpec(f"duplicate workflow id {w.id!r}", field=f"workflows[{i}].id")
            wids.add(w.id)
        mids: set[str] = set()
        for i, m in enumerate(self.models):
            m.validate(f"models[{i}]")
            if m.id in mids:
                raise InvalidSpec(f"duplicate model id {m.id!r}", field=f"models[{i}].id")
            mids.add(m.id)
        keys: set[tuple[str, int, int]] = set()
        for i, p in enumerate(self.profiles):
            p.validate(f"profiles[{i}]")
            if p.key in keys:
                raise InvalidSpec(f"duplicate profile {p.key}", field=f"profiles[{i}]")
            keys.add(p.key)
        self.cluster.validate("cluster")
        self.options.validate("options")
        return self


class Infeasibility(enum.Enum):
    """Why no variant is feasible, tightest first: the first constraint of the
    spec's list (1 accuracy, 2 latency, 3 capacity, 4 placement) that every
    variant passing the earlier ones violates."""

    NO_MODEL_MEETS_ACCURACY = "NO_MODEL_MEETS_ACCURACY"
    NO_LATENCY = "NO_LATENCY"  # nothing meets lambda
    NO_CAPACITY = "NO_CAPACITY"  # every latency-feasible variant overloads an instance
    NO_GPU_MEMORY = "NO_GPU_MEMORY"  # every otherwise-feasible variant fails placement


@dataclass(frozen=True, slots=True)
class NewInstance:
    """An instance the variant must start. `key` ("new-0", "new-1", ...) is its
    name inside the variant, in placement order."""

    key: str
    model_id: str
    tp: int
    pp: int
    node: str
    gpu_ids: tuple[str, ...]
    memory_gb_per_gpu: float
    load_output_tokens_per_s: float  # what this variant's stages put on it

    @property
    def memory_gb(self) -> float:
        return self.memory_gb_per_gpu * self.tp * self.pp


@dataclass(frozen=True, slots=True)
class StageAssignment:
    """Which instance serves one LLM stage: `instance_id` of a running instance
    when reused, else `new_key` of a NewInstance of this variant."""

    stage_id: str
    model_id: str
    tp: int
    pp: int
    reused: bool
    instance_id: str = ""
    new_key: str = ""
    gpu_ids: tuple[str, ...] = ()
    latency_s: float = 0.0  # this stage's latency (calls included)
    load_output_tokens_per_s: float = 0.0
    replica_keys: tuple[str, ...] = ()  # a replica group: the new keys of all its replicas, new_key first


@dataclass(frozen=True, slots=True)
class Variant:
    workflow_id: str
    assignments: tuple[StageAssignment, ...]
    new_instances: tuple[NewInstance, ...]
    reuse: tuple[tuple[str, float], ...]  # (existing instance id, load this variant adds)
    latency_s: float
    accuracy: float  # min over the LLM stages' models (every stage must meet alpha)
    cost: float  # new GPU memory (GB) * latency (s)
    new_memory_gb: float
    new_gpus: int


@dataclass(frozen=True, slots=True)
class SelectionResult:
    strategy: str
    variant: Variant | None
    reason: Infeasibility | None = None
    reason_detail: str = ""
    variants_evaluated: int = 0
    search_space_size: int = 0
    elapsed_s: float = 0.0
    timed_out: bool = False
    # Whether the strategy proved its answer: the variant is a least-cost one, or no feasible variant
    # exists. `exact` proves it unless its time budget runs out; `exhaustive` when it enumerated everything.
    optimal: bool = False
    # A proven lower bound of the least cost (the variant's cost when optimal; 0 when nothing is proven).
    lower_bound: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.variant is not None

    @property
    def gap(self) -> float | None:
        """Proven relative optimality gap (cost - lower_bound) / cost in [0, 1]: 0 when optimal or free,
        None without a variant (1 when nothing above 0 is proven)."""
        if self.variant is None:
            return None
        if self.optimal:
            return 0.0
        c = self.variant.cost
        if c <= 0:
            return 0.0
        return (c - min(max(self.lower_bound, 0.0), c)) / c
