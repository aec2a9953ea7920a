"""LeastLoaded placement of one instance's shards on one node, exactly as the selection spec defines it.

Shared by the selector (during search), the deployer (when it really starts the
instance) and the simulator, so all three agree on which GPUs an instance gets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from flowmaker.domain import Gpu

# Memory comparisons tolerate float noise from summing many per-GPU figures.
EPS_GB = 1e-9
_ZERO = Fraction(0)


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


def place_least_loaded(layout: NodeGpus, free_gb: Mapping[str, float], k: int,
                       memory_gb_per_gpu: float) -> tuple[str, tuple[str, ...]] | None:
    """Choose (node, gpu_ids) for an instance needing k GPUs with `memory_gb_per_gpu` each.

    On each node take the k GPUs with the most free memory (ties: smaller GPU id);
    among nodes where those k all fit, pick the node whose k-th chosen GPU has the
    most free memory (ties: smaller node id). None when no node fits.
    """
    best: tuple[float, str, tuple[str, ...]] | None = None
    need = memory_gb_per_gpu - EPS_GB
    for node, ids in zip(layout.nodes, layout.gpus_by_node, strict=True):
        if len(ids) < k:
            continue
        # ids are sorted, and sorted() is stable, so equal free memory keeps the smaller id first.
        chosen = sorted(ids, key=lambda g: -free_gb[g])[:k]
        kth = free_gb[chosen[-1]]
        if kth < need:
            continue
        if best is None or kth > best[0]:  # strict: an equal k-th keeps the smaller node id
            best = (kth, node, tuple(chosen))
    if best is None:
        return None
    return best[1], best[2]


def free_memory(gpus: Sequence[Gpu]) -> dict[str, float]:
    return {g.id: g.memory_total_gb - g.memory_used_gb for g in gpus}


def place_least_busy(layout: NodeGpus, free_gb: Mapping[str, float], busy: Mapping[str, Fraction], k: int,
                     memory_gb_per_gpu: float) -> tuple[str, tuple[str, ...]] | None:
    """Load-aware LeastLoaded (docs/selection-spec.md, "Extension: GPU sharing").

    On each node the candidates are the GPUs where the memory fits; take the k of them with the least busy
    share (ties: more free memory, then smaller GPU id). Among nodes with k candidates, pick the node whose
    k-th chosen GPU is best by the same order (least busy, then most free memory; ties: smaller node id).
    With every busy share equal this is exactly `place_least_loaded`. None when no node fits.
    """
    need = memory_gb_per_gpu - EPS_GB
    best: tuple[Fraction, float, str, tuple[str, ...]] | None = None
    for node, ids in zip(layout.nodes, layout.gpus_by_node, strict=True):
        cand = [g for g in ids if free_gb[g] >= need]
        if len(cand) < k:
            continue
        chosen = sorted(cand, key=lambda g: (busy.get(g, _ZERO), -free_gb[g]))[:k]  # stable: smaller id first
        kth = chosen[-1]
        key = (busy.get(kth, _ZERO), free_gb[kth])
        if best is None or key[0] < best[0] or (key[0] == best[0] and key[1] > best[1]):
            best = (key[0], key[1], node, tuple(chosen))
    if best is None:
        return None
    return best[2], best[3]
