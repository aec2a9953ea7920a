"""Discrete-event cluster simulator: instances as engine performance models, requests flowing through workflow DAGs."""

from flowmaker.sim.cluster import (
    COLOCATION_MODES,
    DEFAULT_COLOCATION,
    DEFAULT_KV_TOKENS,
    InstanceMetrics,
    Route,
    Router,
    SimInstance,
    SimResult,
    TaskDeployment,
    TaskMetrics,
    check_memory,
    colocation_factor,
    simulate,
)

__all__ = ["COLOCATION_MODES", "DEFAULT_COLOCATION", "DEFAULT_KV_TOKENS", "InstanceMetrics", "Route", "Router", "SimInstance", "SimResult", "TaskDeployment", "TaskMetrics", "check_memory", "colocation_factor",
           "simulate"]
