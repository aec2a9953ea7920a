"""Sampling parameters of a request (OpenAI's names and ranges), checked once for every hop: the gateway reads
them from an OpenAI body, the orchestrator from `InvokeRequest.sampling`, the emulated engine from the body the
orchestrator sends it. Pure: no gRPC, no HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowmaker.errors import InvalidSpec

# name -> (low, high), both inclusive: OpenAI's ranges (vLLM's too, but top_p 0, which it refuses and the
# emulated engine treats as greedy).
RANGES: dict[str, tuple[float, float]] = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0),
                                          "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
SEED_RANGE = (-(2**63), 2**63 - 1)  # an int64 (InvokeRequest.sampling.seed)
MAX_STOP = 4  # OpenAI's limit on `stop` sequences
MAX_STOP_CHARS = 200


@dataclass(frozen=True, slots=True)
class Sampling:
    """None / empty = unset: the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def check(self, prefix: str = "") -> Sampling:
        """Itself, or InvalidSpec naming the field (`prefix` + name, e.g. "sampling.temperature")."""
        for name, (lo, hi) in RANGES.items():
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or not lo <= v <= hi):
                raise InvalidSpec(f"must be a number from {lo:g} to {hi:g}, got {v!r}", field=prefix + name)
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidSpec(f"must be a 64-bit integer, got {self.seed}", field=prefix + "seed")
        if len(self.stop) > MAX_STOP:
            raise InvalidSpec(f"at most {MAX_STOP} stop sequences, got {len(self.stop)}", field=prefix + "stop")
        for i, s in enumerate(self.stop):
            if not s or len(s) > MAX_STOP_CHARS:
                raise InvalidSpec(f"a stop sequence is 1 to {MAX_STOP_CHARS} characters, got {len(s)}",
                                  field=f"{prefix}stop[{i}]")
        return self

    @property
    def is_set(self) -> bool:
        return self != Sampling()

    @property
    def greedy(self) -> bool:
        """Whether sampling is deterministic without a seed: temperature 0 (or top_p 0)."""
        return self.temperature == 0.0 or self.top_p == 0.0

    def body(self) -> dict[str, Any]:
        """The OpenAI request fields of what is set (to merge into a /v1/chat/completions body)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in (*RANGES, "seed")
                               if getattr(self, name) is not None}
        if self.stop:
            out["stop"] = list(self.stop)
        return out

    @staticmethod
    def from_openai(body: Mapping[str, Any]) -> Sampling:
        """The sampling fields of an OpenAI request body, type- and range-checked: InvalidSpec naming the
        parameter (`stop` may be a string or a list of strings; null = unset)."""
        vals: dict[str, Any] = {}
        for name in RANGES:
            v = body.get(name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise InvalidSpec(f"must be a number, got {_show(v)}", field=name)
            lo, hi = RANGES[name]
            if not lo <= v <= hi:  # before float(): an integer of 400 digits does not convert
                raise InvalidSpec(f"must be a number from {lo:g} to {hi:g}, got {_show(v)}", field=name)
            vals[name] = float(v)
        seed = body.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise InvalidSpec(f"must be an integer, got {_show(seed)}", field="seed")
            vals["seed"] = seed
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop] if stop else []
        if stop is not None:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise InvalidSpec(f"must be a string or a list of strings, got {_show(stop)}", field="stop")
            vals["stop"] = tuple(stop)
        return Sampling(**vals).check()

    def cut(self, text: str) -> tuple[str, bool]:
        """`text` ended before the first stop sequence in it, and whether one was found."""
        at = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return (text[:at], True) if at >= 0 else (text, False)


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
