"""Frozen, typed domain objects shared by every part of FlowMaker; imports no gRPC and no etcd."""

from flowmaker.domain.cluster import Cluster, Gpu, GpuType, Instance, Model, ModelArch, Profile, ProfileSource
from flowmaker.domain.selection import (
    MAX_REPLICAS,
    CapacityModel,
    GpuSharing,
    Infeasibility,
    NewInstance,
    SelectionOptions,
    SelectionRequest,
    SelectionResult,
    StageAssignment,
    Variant,
    default_gpu_price,
    priced_memory_gb,
)
from flowmaker.domain.workflow import Slo, Stage, StageKind, TaskSpec, Workflow

__all__ = [
    "MAX_REPLICAS",
    "CapacityModel",
    "Cluster",
    "Gpu",
    "GpuSharing",
    "GpuType",
    "Infeasibility",
    "Instance",
    "Model",
    "ModelArch",
    "NewInstance",
    "Profile",
    "ProfileSource",
    "SelectionOptions",
    "SelectionRequest",
    "SelectionResult",
    "Slo",
    "Stage",
    "StageAssignment",
    "StageKind",
    "TaskSpec",
    "Variant",
    "Workflow",
    "default_gpu_price",
    "priced_memory_gb",
]
