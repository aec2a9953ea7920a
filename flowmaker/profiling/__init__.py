"""Profiles of (model, GPU type, tp, pp): the analytic roofline estimate and fitting of measured sweeps."""

from flowmaker.profiling.analytic import (
    ConfigExcluded,
    ProfileBreakdown,
    analytic_profile,
    config_set,
    exclusion_reason,
    explain_profile,
    profiles_for,
)
from flowmaker.profiling.fit import LatencySample, ThroughputSample, fit_profile

__all__ = [
    "ConfigExcluded", "LatencySample", "ProfileBreakdown", "ThroughputSample", "analytic_profile", "config_set",
    "exclusion_reason", "explain_profile", "fit_profile", "profiles_for",
]
