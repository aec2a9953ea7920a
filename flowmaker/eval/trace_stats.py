"""Summary statistics of the two Azure LLM inference traces (2023), embedded so the product works without the files.

Numbers from `reference/traces/trace_summary_stats.csv` (computed over the full
public CSVs: AzureLLMInferenceTrace_code.csv, 8,819 rows; ..._conv.csv, 19,366 rows).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenStats:
    """Distribution summary of one token column."""

    minimum: int
    p10: float
    p25: float
    median: float
    mean: float
    p75: float
    p90: float
    p95: float
    p99: float
    maximum: int
    std: float


@dataclass(frozen=True, slots=True)
class TraceStats:
    """One trace: request count, rate, burstiness, and the two token columns."""

    kind: str  # "code" or "conv"
    n_requests: int
    duration_s: float
    mean_rate_rps: float
    interarrival_mean_s: float
    interarrival_median_s: float
    interarrival_cv: float  # std/mean of inter-arrival gaps: 1 = Poisson, >1 = bursty
    context: TokenStats
    generated: TokenStats


TRACE_STATS: dict[str, TraceStats] = {
    "code": TraceStats(
        kind="code", n_requests=8819, duration_s=3435.9, mean_rate_rps=2.567,
        interarrival_mean_s=0.3897, interarrival_median_s=0.0638, interarrival_cv=13.15,
        context=TokenStats(3, 147, 578, 1469, 2047.8, 2745, 5194, 7315, 7436, 7437, 1973.8),
        generated=TokenStats(6, 7, 9, 13, 27.9, 24, 55, 90, 252, 1899, 59.9),
    ),
    "conv": TraceStats(
        kind="conv", n_requests=19366, duration_s=3501.7, mean_rate_rps=5.53,
        interarrival_mean_s=0.1808, interarrival_median_s=0.1184, interarrival_cv=1.09,
        context=TokenStats(2, 207, 396, 1020, 1154.7, 1189, 2735, 4083, 4142, 14050, 1108.8),
        generated=TokenStats(7, 54, 85, 129, 211.1, 395, 424, 451, 601, 1000, 162.9),
    ),
}

TRACE_KINDS: tuple[str, ...] = ("code", "conv")
