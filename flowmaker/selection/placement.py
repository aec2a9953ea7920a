"""LeastLoaded placement of one instance's shards on one node, exactly as the selection spec defines it.

Shared by the selector (during search), the deployer (when it really starts the
instance) and the simulator, so all three agree on which GPUs an instance gets.
Memory is compared in whole units of 1e-6 GB (docs/selection-spec.md, Feasibility 4): binary floats such as
7.1 GB drift by 1e-15 after a few sums, and the spec's ties between GPUs and nodes with equal free memory
must not depend on that.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from flowmaker.domain import Gpu

# Memory comparisons outside placement (commit, simulator) tolerate float noise from summing per-GPU figures.
EPS_GB = 1e-9
UNITS_PER_GB = 1_000_000  # the spec's memory unit: 1e-6 GB
_ZERO = Fraction(0)


def gb_units(gb: float) -> int:
    """A memory figure in the spec's integer unit (1e-6 GB): round(gb * 1e6), half to even."""
    return round(gb * UNITS_PER_GB)


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """GPUs grouped by node, in a fixed order, for repeated placement calls."""

    nodes: tuple[str, ...]  # sorted node ids
    gpus_by_node: tuple[tuple[str, ...], ...]  # per node, its GPU ids sorted

    @staticmethod
    def of(gpus: Iterable[Gpu]) -> NodeGpus:
        by: dict[str, list[str]] = {}
        for g in gpus:
            by.setdefault(g.node, []).append(g.id)
        nodes = tuple(sorted(by))
        return NodeGpus(nodes, tuple(tuple(sorted(by[n])) for n in nodes))


def place_units(layout: NodeGpus, free_u: Mapping[str, int], k: int, need_u: int
                ) -> tuple[str, tuple[str, ...]] | None:
    """LeastLoaded on free memory in units (exact): on each node the k GPUs with the most free memory (ties:
    smaller GPU id); among nodes where those k all have >= need_u, the node whose k-th chosen GPU has the most
    (ties: smaller node id). None when no node fits."""
    best: tuple[int, str, tuple[str, ...]] | None = None
    for node, ids in zip(layout.nodes, layout.gpus_by_node, strict=True):
        if len(ids) < k:
            continue
        # ids are sorted, and sorted() is stable, so equal free memory keeps the smaller id first.
        chosen = sorted(ids, key=lambda g: -free_u[g])[:k]
        kth = free_u[chosen[-1]]
        if kth < need_u:
            continue
        if best is None or kth > best[0]:  # strict: an equal k-th keeps the smaller node id
            best = (kth, node, tuple(chosen))
    if best is None:
        return None
    return best[1], best[2]


def place_least_loaded(layout: NodeGpus, free_gb: Mapping[str, float], k: int,
                       memory_gb_per_gpu: float) -> tuple[str, tuple[str, ...]] | None:
    """Choose (node, gpu_ids) for an instance needing k GPUs with `memory_gb_per_gpu` each, free memory given
    in GB (each figure rounded to the spec's unit; `place_units` for callers that keep units)."""
    return place_units(layout, {g: gb_units(v) for g, v in free_gb.items()}, k, gb_units(memory_gb_per_gpu))


def free_memory(gpus: Sequence[Gpu]) -> dict[str, float]:
    return {g.id: g.memory_total_gb - g.memory_used_gb for g in gpus}


def free_units(gpus: Sequence[Gpu]) -> dict[str, int]:
    """Free memory per GPU in the spec's unit: each figure rounded first, then subtracted exactly."""
    return {g.id: gb_units(g.memory_total_gb) - gb_units(g.memory_used_gb) for g in gpus}


def _least_busy(cand: list[str], busy: Mapping[str, Fraction], free_u: Mapping[str, int]) -> list[str]:
    """`cand` (ids ascending) sorted by (busy share, -free memory), stable: smaller id first on ties. By the
    doubles of the shares first (float(Fraction) rounds correctly, so it is monotone: a smaller double means a
    smaller share); the exact sort whenever two candidates have equal doubles but different shares."""
    fk = {g: float(busy.get(g, _ZERO)) for g in cand}
    out = sorted(cand, key=lambda g: (fk[g], -free_u[g]))
    for a, b in itertools.pairwise(out):
        if fk[a] == fk[b] and busy.get(a, _ZERO) != busy.get(b, _ZERO):
            return sorted(cand, key=lambda g: (busy.get(g, _ZERO), -free_u[g]))
    return out


def _least_busy_units(cand: list[str], busy: Mapping[str, int], free_u: Mapping[str, int]) -> list[str]:
    """`_least_busy` for busy shares as integers of a common unit (`dyadic_units`): compared exactly, directly."""
    return sorted(cand, key=lambda g: (busy.get(g, 0), -free_u[g]))


def dyadic_units(values: Iterable[Fraction]) -> int:
    """A scale 2**E that turns each of these rationals into an integer: sums of doubles have power-of-two
    denominators, so load-aware placement can compare shares as Python ints, exactly and fast."""
    e = 0
    for v in values:
        d = v.denominator
        if d & (d - 1):
            raise ValueError(f"not a dyadic rational: {v}")
        e = max(e, d.bit_length() - 1)
    return 1 << e


def place_least_busy(layout: NodeGpus, free_u: Mapping[str, int], busy: Mapping[str, Fraction] | Mapping[str, int],
                     k: int, need_u: int) -> tuple[str, tuple[str, ...]] | None:
    """Load-aware LeastLoaded (docs/selection-spec.md, "Extension: GPU sharing"), free memory in units.

    On each node the candidates are the GPUs where the memory fits; take the k of them with the least busy
    share (ties: more free memory, then smaller GPU id). Among nodes with k candidates, pick the node whose
    k-th chosen GPU is best by the same order (least busy, then most free memory; ties: smaller node id).
    With every busy share equal this is exactly `place_units`. None when no node fits. `busy` holds
    Fractions, or ints of one common unit (`dyadic_units`).
    """
    best: tuple[Fraction | int, int, str, tuple[str, ...]] | None = None
    order = _least_busy_units if busy and isinstance(next(iter(busy.values())), int) else _least_busy
    for node, ids in zip(layout.nodes, layout.gpus_by_node, strict=True):
        cand = [g for g in ids if free_u[g] >= need_u]
        if len(cand) < k:
            continue
        chosen = order(cand, busy, free_u)[:k]  # type: ignore[arg-type]
        kth = chosen[-1]
        key = (busy.get(kth, _ZERO), free_u[kth])
        if best is None or key[0] < best[0] or (key[0] == best[0] and key[1] > best[1]):
            best = (key[0], key[1], node, tuple(chosen))
    if best is None:
        return None
    return best[2], best[3]
