"""Engine performance model of one LLM instance (shared by the emulated engine and the simulator)."""

from flowmaker.engine.model import Completion, EngineModel

__all__ = ["Completion", "EngineModel"]
