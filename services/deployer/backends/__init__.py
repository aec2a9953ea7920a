"""Registry of engine backends: `get_backend(name)`; an unknown name is a clear error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowmaker.errors import NotFound
from services.deployer.backends.base import (
    EngineBackend,
    EngineProcess,
    EngineSpec,
    EngineStartError,
    parse_trtllm_iteration_stats,
    parse_vllm_prometheus,
)
from services.deployer.backends.emulated import EmulatedBackend
from services.deployer.backends.trtllm import TrtllmBackend
from services.deployer.backends.vllm import VllmBackend

BACKENDS: dict[str, Callable[..., EngineBackend]] = {
    "emulated": EmulatedBackend,
    "trtllm": TrtllmBackend,
    "vllm": VllmBackend,
}


def get_backend(name: str, **options: Any) -> EngineBackend:
    """A backend instance by name; `options` go to its constructor (e.g. gpu_memory_utilization=0.85)."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise NotFound(f"unknown engine backend {name!r}; known: {sorted(BACKENDS)}", field="backend",
                       reason="UNKNOWN_BACKEND") from None
    return factory(**options)


__all__ = [
    "BACKENDS", "EmulatedBackend", "EngineBackend", "EngineProcess", "EngineSpec", "EngineStartError",
    "TrtllmBackend", "VllmBackend", "get_backend", "parse_trtllm_iteration_stats", "parse_vllm_prometheus",
]
