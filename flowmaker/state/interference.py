"""The GPU-sharing constant kappa per GPU type, in etcd beside the profiles (layout: docs/state.md).

In `flowmaker.sharing` an instance runs at speed 1 / (1 + kappa * (co-residents' busy share)); kappa
depends on the GPU (how well it overlaps co-residents' kernels), so the profiler measures it per GPU type
(`flowmaker profiles measure-interference`, `flowmaker.profiling.interference`) and stores it under
`keys.interference(gpu_type)` as the JSON of an `InterferenceRecord`. A GPU type nothing was measured on
reads as `sharing.DEFAULT_INTERFERENCE` with source DEFAULT; so does an unreadable record (logged), so that
one bad value never breaks a reader.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flowmaker.errors import InvalidSpec
from flowmaker.sharing import DEFAULT_INTERFERENCE, validate_interference
from flowmaker.state import keys
from flowmaker.state.store import StateStore

log = logging.getLogger(__name__)

SOURCE_DEFAULT = "DEFAULT"  # nothing measured: sharing.DEFAULT_INTERFERENCE (full processor sharing)
SOURCE_MEASURED = "MEASURED"
SOURCES = (SOURCE_DEFAULT, SOURCE_MEASURED)


@dataclass(frozen=True, slots=True)
class InterferenceRecord:
    """The value under `keys.interference(gpu_type)`.

    `points` are the measured load levels (`InterferencePoint.to_json`: co_share, alone_s, shared_s, ...);
    `details` the measurement's provenance (engines, time scale, where the shares came from). Readers ignore
    fields they do not know."""

    gpu_type: str
    kappa: float = DEFAULT_INTERFERENCE
    source: str = SOURCE_DEFAULT
    measured_at: float = 0.0  # Unix seconds; 0 for DEFAULT
    points: tuple[Mapping[str, Any], ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def default(gpu_type: str) -> InterferenceRecord:
        return InterferenceRecord(gpu_type)

    @staticmethod
    def measured(gpu_type: str, kappa: float, points: tuple[Mapping[str, Any], ...] = (),
                 details: Mapping[str, Any] | None = None, measured_at: float | None = None) -> InterferenceRecord:
        return InterferenceRecord(gpu_type, kappa, SOURCE_MEASURED, time.time() if measured_at is None else measured_at,
                                  points, dict(details or {})).validate()

    def validate(self) -> InterferenceRecord:
        if not isinstance(self.gpu_type, str) or not self.gpu_type:
            raise InvalidSpec(f"must be a non-empty string, got {self.gpu_type!r}", field="gpu_type")
        if isinstance(self.kappa, bool) or not isinstance(self.kappa, int | float):
            raise InvalidSpec(f"must be a number, got {self.kappa!r}", field="kappa")
        validate_interference(float(self.kappa), field="kappa")
        if self.source not in SOURCES:
            raise InvalidSpec(f"must be one of {list(SOURCES)}, got {self.source!r}", field="source")
        if (isinstance(self.measured_at, bool) or not isinstance(self.measured_at, int | float)
                or not math.isfinite(self.measured_at) or self.measured_at < 0):
            raise InvalidSpec(f"must be Unix seconds >= 0, got {self.measured_at!r}", field="measured_at")
        for i, p in enumerate(self.points):
            if not isinstance(p, Mapping):
                raise InvalidSpec(f"must be an object, got {type(p).__name__}", field=f"points[{i}]")
        if not isinstance(self.details, Mapping):
            raise InvalidSpec(f"must be an object, got {type(self.details).__name__}", field="details")
        return self

    def to_json(self) -> dict[str, Any]:
        return {"gpu_type": self.gpu_type, "kappa": float(self.kappa), "source": self.source,
                "measured_at": self.measured_at, "points": [dict(p) for p in self.points],
                "details": dict(self.details)}

    @staticmethod
    def from_json(data: Any) -> InterferenceRecord:
        """Parse a stored value; InvalidSpec naming the field when it is not a valid record."""
        if not isinstance(data, Mapping):
            raise InvalidSpec(f"must be a JSON object, got {type(data).__name__}", field="interference")
        points = data.get("points", [])
        if not isinstance(points, list):
            raise InvalidSpec(f"must be a list, got {type(points).__name__}", field="points")
        return InterferenceRecord(data.get("gpu_type", ""), data.get("kappa", DEFAULT_INTERFERENCE),
                                  data.get("source", SOURCE_MEASURED), data.get("measured_at", 0.0),
                                  tuple(points), data.get("details", {})).validate()


class InterferenceStore:
    """kappa per GPU type over a StateStore: `put` a measurement, `get` one GPU type's (DEFAULT when none)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    async def put(self, record: InterferenceRecord) -> int:
        """Store (replace) the GPU type's record; returns its new mod_revision."""
        record.validate()
        return await self.store.put(keys.interference(record.gpu_type), record.to_json())

    async def get(self, gpu_type: str) -> InterferenceRecord:
        """The stored record of `gpu_type`, or `InterferenceRecord.default(gpu_type)` (source DEFAULT) when
        nothing is stored or the stored value is unreadable (logged)."""
        kv = await self.store.get(keys.interference(gpu_type))
        if kv is None:
            return InterferenceRecord.default(gpu_type)
        return _parse_or_default(kv.key, kv.value, gpu_type)

    async def kappa(self, gpu_type: str) -> float:
        return float((await self.get(gpu_type)).kappa)

    async def all(self) -> dict[str, InterferenceRecord]:
        """Every stored record by GPU type (unreadable ones as DEFAULT)."""
        out = {}
        for kv in (await self.store.get_prefix(keys.INTERFERENCE)).items:
            g = keys.parse_interference(kv.key)
            out[g] = _parse_or_default(kv.key, kv.value, g)
        return out

    async def delete(self, gpu_type: str) -> bool:
        """Forget the GPU type's measurement (it reads as DEFAULT again)."""
        return await self.store.delete(keys.interference(gpu_type))


def _parse_or_default(key: str, value: Any, gpu_type: str) -> InterferenceRecord:
    try:
        rec = InterferenceRecord.from_json(value)
    except InvalidSpec as e:
        log.warning("%s: unreadable interference record (%s); using the default kappa %g", key, e,
                    DEFAULT_INTERFERENCE)
        return InterferenceRecord.default(gpu_type)
    if rec.gpu_type != gpu_type:
        log.warning("%s: record names GPU type %r; using the default kappa %g", key, rec.gpu_type,
                    DEFAULT_INTERFERENCE)
        return InterferenceRecord.default(gpu_type)
    return rec
