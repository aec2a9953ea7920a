"""Discrete-event cluster simulator: instances as engine performance models, requests flowing through workflow DAGs."""

from flowmaker.sim.cluster import (
    Route,
    Router,
    SimInstance,
    SimResult,
    TaskDeployment,
    TaskMetrics,
    check_memory,
    simulate,
)

__all__ = ["Route", "Router", "SimInstance", "SimResult", "TaskDeployment", "TaskMetrics", "check_memory", "simulate"]
