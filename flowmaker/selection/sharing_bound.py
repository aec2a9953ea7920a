"""GPU sharing: lower bounds of the slowed stage latencies from a search state (docs/selection-spec.md,
"Extension: GPU sharing", "What is exact").

Shares only grow as a variant gains stages, and free memory only shrinks, so whatever a partial variant has
already put on the GPUs bounds every completion of it from below:

* a stage that reuses a running instance, or joins a new instance the prefix opened, runs beside at least
  the co-residents' busy shares now on that instance's GPUs, at a compute share of at least the instance's
  load so far plus its own;
* a stage that opens a new instance of profile p lands on k = tp * pp GPUs of one node whose free memory
  fits p now and whose compute total leaves room for its own share (U_g + rho <= u: the compute budget
  of Feasibility 5.1 only grows), so it runs beside at least the k-th smallest busy total among those GPUs,
  at the least over nodes.

With `f = 1 + kappa x` that busy total and `rho` that compute share, its latency is at least its latency
alone times `f (1 - rho) / (1 - rho f)`, and the option is infeasible when `rho f` exceeds u (Feasibility
5.2). `Problem.bound_view` takes these bounds in the request's initial state (once per workflow); the branch
and bound takes them again after every prefix, where the GPUs that earlier stages filled raise them: the
bound that sees a cluster run out of idle GPUs. Floats with a 1e-9 margin, as `bound_view`: an option is
only ruled out well beyond the cap, and a multiplier is only lowered.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from flowmaker.sharing import busy_share

if TYPE_CHECKING:
    from flowmaker.selection.problem import Choice, Problem, PWorkflow

INF = math.inf
_MARGIN = 1e-9


class ShareState:
    """Per-GPU compute and busy totals (floats) and free memory (the spec's units) of one search state, and the GPUs
    that no new instance may use."""

    __slots__ = ("_by_need", "barred", "budget", "busy", "comp", "free", "kappa", "layout", "u")

    def __init__(self, layout: Sequence[Sequence[str]], free: Mapping[str, int], comp: Mapping[str, float],
                 busy: Mapping[str, float], kappa: float, u: float, barred: frozenset[str] = frozenset()) -> None:
        self.layout = layout
        self.barred = barred  # GPUs no new instance may use in any variant (`sharing_alone.barred`)
        self.free = free
        self.comp = comp
        self.busy = busy
        self.kappa = kappa
        self.u = u
        self.budget = u * (1 + _MARGIN) * (1 + _MARGIN)  # generous: the exact budget is u (1 + 1e-9)
        self._by_need: dict[int, list[list[tuple[float, float]]]] = {}

    def multiplier_lb(self, f: float, rho: float) -> float:
        """A lower bound of `f (1 - rho) / (1 - rho f)`; INF when `rho f` is clearly beyond the cap or 1."""
        x = rho * f
        if x >= 1 + _MARGIN or x > self.budget:
            return INF
        if x > 1 - 1e-6:
            return 1.0
        return max(1.0, f * (1 - rho) / (1 - x) * (1 - _MARGIN))

    def _nodes(self, need: int) -> list[list[tuple[float, float]]]:
        """Per node, (busy, compute) of its GPUs whose free memory fits `need`, least busy first."""
        got = self._by_need.get(need)
        if got is None:
            free, busy, comp = self.free, self.busy, self.comp
            got = []
            for ids in self.layout:
                cand = sorted((busy.get(g, 0.0), comp.get(g, 0.0)) for g in ids
                              if free[g] >= need and g not in self.barred)
                if cand:
                    got.append(cand)
            self._by_need[need] = got
        return got

    def new_busy_lb(self, k: int, need: int, rho: float) -> float:
        """Least co-resident busy total a new instance (k GPUs of `need` units, compute share `rho`) can run
        beside; INF when no node has k GPUs where it fits and its share stays within the budget."""
        lim = self.budget - rho
        least = INF
        for cand in self._nodes(need):
            if len(cand) < k:
                continue
            c = 0
            for b, u in cand:
                if b >= least:
                    break
                if u <= lim:
                    c += 1
                    if c == k:
                        least = b
                        break
        return least

    def crowding(self, gpu_ids: Iterable[str], own_busy: float) -> tuple[float, float]:
        """(the co-residents' busy total on the most crowded of these GPUs for an instance whose own busy share is
        `own_busy` now, the largest compute total among them)."""
        worst = 0.0
        top = 0.0
        for g in gpu_ids:
            x = self.busy.get(g, 0.0) - own_busy
            if x > worst:
                worst = x
            c = self.comp.get(g, 0.0)
            if c > top:
                top = c
        return worst, top

    def joined_lb(self, crowd: tuple[float, float], rho: float, add: float, base: float) -> float:
        """Latency bound of a stage (latency alone `base`) joining an instance of this `crowding` whose compute
        share becomes `rho` (the stage adds `add` on each of its GPUs); INF beyond the compute budget."""
        if crowd[1] > self.budget - add:
            return INF
        return base * self.multiplier_lb(1.0 + self.kappa * crowd[0], rho)

    def instance_lb(self, gpu_ids: Sequence[str], own_busy: float, rho: float, add: float, base: float) -> float:
        """`joined_lb` of an instance on these GPUs whose own busy share is `own_busy` now."""
        return self.joined_lb(self.crowding(gpu_ids, own_busy), rho, add, base)


def completion_bound(pb: Problem, pw: PWorkflow, choice: Sequence[Choice], slots: Sequence[int],
                     places: Sequence[tuple[str, tuple[str, ...]]], free: Mapping[str, int],
                     factors: Sequence[float], r_add: Sequence[float], slot_load: Sequence[float],
                     reuse_opts: Sequence[Sequence[int]], new_by_lat: Sequence[Sequence[int]],
                     new_by_mem: Sequence[Sequence[int]]) -> tuple[float, float]:
    """For a prefix `choice` (its first stages in topological order, with the prefix's multipliers `factors`
    and the search's current free memory and loads): (a lower bound of the slowed latency L_s of every
    completion, the least new memory every completion adds). INF latency: no completion is feasible.

    `reuse_opts` / `new_by_lat` list each stage's options by their `bound_view` latency, ascending (so a stage's
    scan stops once the static bound reaches the best dynamic one); `new_by_mem` by memory, ascending."""
    from flowmaker.selection.problem import EPS, REUSE, Problem, leq

    comp, busy, _, r_busy, rep = pb.sharing_fast_state(pw, choice, slots, places)
    state = pb.share_state(free, comp, busy)
    bview = pb.bound_view(pw)
    lat = list(pw.tool_lat)
    for s, (kind, ref), f in zip(pw.llm, choice, factors, strict=False):
        base = pw.lat_reuse[s][ref] if kind == REUSE else pw.lat_new[s][slots[ref]]
        lat[s] = base * max(1.0, f * (1 - _MARGIN))  # every multiplier is >= 1: exact ties stay exact ties
    first = pb.slot_offsets(slots)
    # What each instance in play runs beside: the same for every stage that may join it.
    # Per slot: (profile, the load it still has room for, replicas, capacity of one, what it runs beside).
    in_play = [(pi, pb.p_cap[pi] + EPS * max(1.0, pb.p_cap[pi]) - slot_load[k], pb.p_reps[pi],
                pb.profiles[pi].max_output_tokens_per_s, slot_load[k],
                state.crowding((g for i in range(pb.p_reps[pi]) for g in places[first[k] + i][1]), rep[k][1]))
               for k, pi in enumerate(slots)]
    reuse_crowd: dict[int, tuple[float, float]] = {}
    extra = 0.0
    for s in pw.llm[len(choice):]:
        ld = pw.load[s]
        best = INF
        for r in reuse_opts[s]:
            if bview.lat_reuse[s][r] >= best:
                break
            used = pb.r_load0[r] + r_add[r] + ld
            if not leq(used, pb.p_cap[pb.r_prof[r]]):
                continue
            crowd = reuse_crowd.get(r)
            if crowd is None:
                inst = pb.reusable[r]
                crowd = reuse_crowd[r] = state.crowding(inst.gpu_ids, r_busy.get(inst.id, pb.run_busy0[inst.id]))
            v = state.joined_lb(crowd, busy_share(used, pb.r_unit[r]), busy_share(ld, pb.r_unit[r]),
                                pw.lat_reuse[s][r])
            if v < best:
                best = v
        static = bview.lat_new[s]
        for pi, room, reps, cap, used, crowd in in_play:
            if static[pi] >= best or ld > room:  # no better than `best` even unslowed / no room
                continue
            v = state.joined_lb(crowd, busy_share((used + ld) / reps, cap), busy_share(ld / reps, cap),
                                pw.lat_new[s][pi])
            if v < best:
                best = v
        if best == INF:  # no instance in play can take it: it opens a new one, of the least memory that can
            for pi in new_by_mem[s]:
                if pb.p_mem[pi] <= extra or pb.new_latency_lb(state, pw, s, pi) < INF:
                    extra = max(extra, pb.p_mem[pi])
                    break
        for pi in new_by_lat[s]:
            if bview.lat_new[s][pi] >= best:
                break
            v = pb.new_latency_lb(state, pw, s, pi)
            if v < best:
                best = v
        if best == INF:
            return INF, extra
        lat[s] = best
    return Problem.longest_path(pw, lat), extra


def compute_share(pb: Problem, kind: str, ref: int, load: float) -> tuple[int, float]:
    """GPU sharing: (k, s) for a stage of this load on a new instance of profile `ref` (kind NEW) or on
    reusable instance `ref`: k the GPUs of one instance (replica), s the compute share it adds, summed over
    the replicas (each of r replicas carries load / r); s a little low, never high."""
    from flowmaker.selection.problem import REUSE

    if kind == REUSE:
        k, unit = len(pb.reusable[ref].gpu_ids), pb.r_unit[ref]
    else:
        k, unit = pb.p_k[ref], pb.profiles[ref].max_output_tokens_per_s
    return k, (busy_share(load, unit) * (1 - _MARGIN) if unit > 0.0 else INF)


def compute_room(pb: Problem, profs: Iterable[int], reus: Iterable[int]) -> tuple[list[float], dict[int, float]]:
    """GPU sharing: bounds of the compute shares a variant's stages add (`compute_share`), from the room
    `r_g = u (1 + 1e-9) - U0_g` (at least 0) that Feasibility 5.1 leaves each GPU a variant touches (shares only
    add), over the GPUs where one of these profiles' instances fits (free memory) or one of these reusable
    instances runs. An instance adds its share s to each of its k GPUs, all on one node; on a node whose rooms
    sorted are r_1 >= r_2 >= ..., at most j of them are among the j roomiest, so the instances' (k - j)^+ x s
    sum to at most r_{j+1} + r_{j+2} + ... Returns (per j >= 0, that bound summed over nodes; per k, a bound of
    the new k-GPU instances' shares alone: per node, min over j < k of (r_{j+1} + ...) / (k - j), summed).
    A little high, never low."""
    comp0 = pb._fast_totals()[0]
    budget = pb.u * (1 + 1e-9)

    def room(g: str) -> float:
        return max(0.0, budget - comp0.get(g, 0.0))

    need_k: dict[int, int] = {}
    for pi in profs:
        k = pb.p_k[pi]
        need_k[k] = min(need_k.get(k, pb.p_need[pi]), pb.p_need[pi])
    touch = {g for r in reus for g in pb.reusable[r].gpu_ids}
    if need_k:
        least = min(need_k.values())
        touch.update(g for g, f in pb.free0.items() if f >= least)
    top = max([*need_k, *(len(pb.reusable[r].gpu_ids) for r in reus), 1])
    by_j = [0.0] * top
    for gids in pb.layout.gpus_by_node:
        rs = sorted((room(g) for g in gids if g in touch), reverse=True)
        for j in range(top):
            by_j[j] += sum(rs[j:])
    per_k: dict[int, float] = {}
    for k, need in need_k.items():
        got = 0.0
        for gids in pb.layout.gpus_by_node:
            rs = sorted((room(g) for g in gids if pb.free0.get(g, 0) >= need), reverse=True)
            if len(rs) >= k:
                got += min(sum(rs[j:]) / (k - j) for j in range(k))
        per_k[k] = got * (1 + 1e-7) + 1e-9
    return [x * (1 + 1e-7) + 1e-9 for x in by_j], per_k
