"""A SelectVariant request compiled into flat arrays that every strategy searches.

Everything here follows spec/selection.md literally; the strategies only differ
in which assignments they look at. A "choice" for a workflow is, per LLM stage
in the spec's topological order, either ("R", i) — reuse running instance i —
or ("N", j) — the j-th new instance of this variant, opened (with its profile)
by the first stage that uses it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from flowmaker.domain import (
    GpuSharing,
    Infeasibility,
    Instance,
    NewInstance,
    Profile,
    SelectionRequest,
    SelectionResult,
    StageAssignment,
    Variant,
    Workflow,
    priced_memory_gb,
)
from flowmaker.selection.placement import (
    NodeGpus,
    dyadic_units,
    free_units,
    gb_units,
    place_least_busy,
    place_units,
)
from flowmaker.selection.sharing_bound import ShareState
from flowmaker.sharing import add_offered, busy_share, gpu_totals, multiplier, occupancy, speed_factor

# Relative tolerance for comparing costs and latencies (spec: answers equal within 1e-9).
REL_TOL = 1e-12
# Capacity / latency comparisons tolerate float noise from sums.
EPS = 1e-9
_MARGIN = 1e-7  # `Problem.sharing_factors_fast`: how clearly a float check must pass to stand for the exact one

REUSE = "R"
NEW = "N"
Choice = tuple[str, int]
# GPU sharing, in floats: per GPU compute and busy totals, per reused instance id its compute and busy share, per
# new slot the (compute, busy) share of each replica (`Problem.sharing_fast_state`).
FastState = tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float], list[tuple[float, float]]]


def leq(a: float, b: float) -> bool:
    """a <= b up to float noise (absolute + relative)."""
    t = abs(b)
    return a <= b + EPS * (t if t > 1.0 else 1.0)  # = leq_limit(b), inline: leq is called on hot paths


def leq_limit(b: float) -> float:
    """The largest a that `leq(a, b)` admits: hot loops compare against it once computed (the same test, bit for
    bit, without a call per comparison)."""
    return b + EPS * max(1.0, abs(b))


@dataclass(slots=True)
class PWorkflow:
    """One workflow, compiled: stage arrays indexed by position in `wf.stages`."""

    index: int
    wf: Workflow
    topo: tuple[int, ...]  # all stages, spec topological order
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    llm: tuple[int, ...]  # LLM stage indices in topo order: the decision points
    tool_lat: tuple[float, ...]  # latency of TOOL stages (0 for LLM)
    load: tuple[float, ...]  # output tokens/s a stage puts on its instance
    lat_new: tuple[tuple[float, ...], ...]  # [stage][profile] stage latency
    lat_reuse: tuple[tuple[float, ...], ...]  # [stage][reusable instance] stage latency
    # `Problem.longest_path`'s walk, derived once: per stage in `topo`, (stage, its one predecessor or -1, its
    # predecessors when several). The searches evaluate paths hundreds of thousands of times a request.
    path_plan: tuple[tuple[int, int, tuple[int, ...]], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.path_plan = tuple((s, self.preds[s][0] if len(self.preds[s]) == 1 else -1,
                                self.preds[s] if len(self.preds[s]) > 1 else ()) for s in self.topo)


class Problem:
    """The request, compiled once; strategies share it."""

    def __init__(self, req: SelectionRequest) -> None:
        self.req = req
        self.alpha = req.slo.min_accuracy
        self.lam = req.slo.max_latency_s
        self.rho = req.slo.arrival_rate_rps
        self.u = req.options.utilization_cap
        self.models = {m.id: m for m in req.models}
        # A (model, tp, pp) is deployable iff it has a profile; profiles of unknown models are unusable.
        # With the replicas extension (options.max_replicas R > 1) every profile p becomes R "group
        # profiles" (p, r), r = 1..R, next to each other: a new instance of one is a group of r replicas
        # (r times the memory and capacity, the same latency, placed replica by replica). The strategies
        # search them as profiles; only placement looks at `p_reps`.
        base = tuple(p for p in req.profiles if p.model_id in self.models)
        reps_max = max(1, req.options.max_replicas)
        self.profiles: tuple[Profile, ...] = tuple(p for p in base for _ in range(reps_max))
        self.p_reps: tuple[int, ...] = tuple(r for _ in base for r in range(1, reps_max + 1))
        # Running instances are single instances: their key maps to the r = 1 entry.
        self.prof_by_key = {p.key: i for i, p in reversed(list(enumerate(self.profiles)))}
        self.p_acc = tuple(self.models[p.model_id].accuracy for p in self.profiles)
        # The memory a group holds (the response's new_memory_gb), and what the objective charges for it: under the
        # priced-GPUs extension every GPU it runs on costs gpu_price_gb more (0: the same figure, the base
        # contract). Every strategy and bound takes the objective's M from p_mem alone, so it stays additive.
        self.p_gb = tuple(r * p.total_memory_gb for p, r in zip(self.profiles, self.p_reps, strict=True))
        price = req.options.gpu_price_gb
        self.p_mem = self.p_gb if not price else tuple(
            priced_memory_gb(p.memory_gb_per_gpu, r * p.tp * p.pp, price)
            for p, r in zip(self.profiles, self.p_reps, strict=True))
        self.p_cap = tuple(r * self.u * p.max_output_tokens_per_s
                           for p, r in zip(self.profiles, self.p_reps, strict=True))
        self.p_k = tuple(p.tp * p.pp for p in self.profiles)  # GPUs of ONE replica (what placement needs)
        self.p_gpus = tuple(r * k for r, k in zip(self.p_reps, self.p_k, strict=True))  # of the whole group
        self.p_ok = tuple(a >= self.alpha for a in self.p_acc)
        # Reuse candidates: running instances whose (model, tp, pp) has a profile and model is known.
        self.reusable: tuple[Instance, ...] = ()
        if req.options.allow_reuse:
            self.reusable = tuple(i for i in req.cluster.instances if i.key in self.prof_by_key)
        self.r_prof = tuple(self.prof_by_key[i.key] for i in self.reusable)
        self.r_load0 = tuple(i.load_output_tokens_per_s for i in self.reusable)
        self.layout = NodeGpus.of(req.cluster.gpus)
        # Free memory in the spec's integer unit (1e-6 GB): its ties are exact whatever the search did before.
        self.free0 = free_units(req.cluster.gpus)
        self.p_need = tuple(gb_units(p.memory_gb_per_gpu) for p in self.profiles)  # per GPU, in units
        # GPU sharing (docs/selection-spec.md, "Extension: GPU sharing"; model in flowmaker.sharing): per running
        # instance its compute share rho0 (load / capacity; capacity restated under BUSY_TIME) and busy share
        # (measured, else rho0), per GPU their exact sums.
        self.sharing = req.options.gpu_sharing is GpuSharing.INTERFERENCE
        self.kappa = Fraction(req.options.interference)
        self.u_frac = Fraction(self.u)
        self.budget = self.u_frac * (1 + Fraction(EPS))  # the capacity checks' tolerance
        unit = {p.key: p.max_output_tokens_per_s for p in req.profiles}
        self.run_rho0 = {i.id: busy_share(i.load_output_tokens_per_s, unit[i.key]) if i.key in unit else 0.0
                         for i in req.cluster.instances}
        self.run_busy0 = {i.id: i.busy_share if i.busy_share > 0 else min(1.0, self.run_rho0[i.id])
                          for i in req.cluster.instances}
        self.rho0 = gpu_totals((i.gpu_ids, self.run_rho0[i.id]) for i in req.cluster.instances)
        self.occ0 = gpu_totals((i.gpu_ids, self.run_busy0[i.id]) for i in req.cluster.instances)
        # Load-aware placement's occupancy O_g = B0_g + u x (new instances placed on g), as ints of one common
        # unit (`placement.dyadic_units`): exact, and far cheaper to compare and update than Fractions.
        scale = dyadic_units([*self.occ0.values(), self.u_frac])
        self.u_units = int(self.u_frac * scale)
        self.occ_units = {g.id: int(self.occ0.get(g.id, _ZERO) * scale) for g in req.cluster.gpus}
        self.on_gpu: dict[str, list[Instance]] = {}
        for i in req.cluster.instances:
            for g in i.gpu_ids:
                self.on_gpu.setdefault(g, []).append(i)
        self.r_unit = tuple(self.profiles[rp].max_output_tokens_per_s for rp in self.r_prof)
        self.workflows = tuple(self._compile(i, w) for i, w in enumerate(req.workflows))
        self._bound_views: dict[int, PWorkflow] = {}
        # GPU sharing: the alone floor's models found to hold an integer point, and its LPs' floors
        # (`sharing_alone.walk_floor`)
        self.alone_points: dict[tuple[object, ...], PWorkflow] = {}
        self.alone_lps: dict[tuple[object, ...], tuple[float, PWorkflow]] = {}
        # GPU sharing: per running instance (rho0, b0, m0) of Feasibility 5.4 (m0 None: infinite)
        self._m0: dict[str, tuple[Fraction, Fraction, Fraction | None]] = {}
        self._fast0: tuple[dict[str, float], dict[str, float]] | None = None  # GPU sharing: rho0, occ0 as floats
        self._fs_last: tuple[int, list[Choice], list[int], FastState] | None = None  # `sharing_fast_state`'s last

    def _compile(self, index: int, wf: Workflow) -> PWorkflow:
        pos = {s.id: i for i, s in enumerate(wf.stages)}
        preds = tuple(tuple(pos[d] for d in s.depends_on) for s in wf.stages)
        succ: list[list[int]] = [[] for _ in wf.stages]
        for i, ps in enumerate(preds):
            for p in ps:
                succ[p].append(i)
        topo = wf.topo_order()
        llm = tuple(i for i in topo if wf.stages[i].is_llm)
        tool_lat = tuple(0.0 if s.is_llm else s.latency_s for s in wf.stages)
        load = tuple(self.rho * s.calls_per_request * s.output_tokens if s.is_llm else 0.0 for s in wf.stages)
        lat_new = tuple(
            tuple(s.calls_per_request * p.call_latency_s(s.input_tokens, s.output_tokens) for p in self.profiles)
            if s.is_llm else () for s in wf.stages)
        lat_reuse = tuple(tuple(lat_new[i][rp] for rp in self.r_prof) if s.is_llm else ()
                          for i, s in enumerate(wf.stages))
        return PWorkflow(index, wf, topo, preds, tuple(tuple(x) for x in succ), llm, tool_lat, load,
                         lat_new, lat_reuse)

    def bound_view(self, pw: PWorkflow) -> PWorkflow:
        """GPU sharing: `pw` with each LLM stage's latency per option raised to a lower bound of its slowed latency
        in any variant (Feasibility 5.2), infinite where no variant can keep the option within the compute cap;
        `pw` itself without sharing. For bounds only (branch and bound, Pareto walks): every true evaluation
        (`check`, `sharing_factors`, `stage_latencies`) takes `pw`.

        Why it is a lower bound: in any variant an instance x's co-residents on a GPU g carry at least g's running
        busy share B0_g (shares only grow; a reused instance's own share is taken out), and a new instance lands on
        GPUs whose initial free memory fits it, k of them on one node, so its f is at least 1 + kappa x the least,
        over nodes, k-th smallest B0 among those GPUs; its compute share is at least the stage's own load over its
        capacity (per replica). m = f (1 - rho) / (1 - rho f) grows in both f and rho. Floats with a 1e-9 margin:
        an option is only ruled out well beyond the cap, and a multiplier is only lowered."""
        if not self.sharing:
            return pw
        cached = self._bound_views.get(pw.index)
        if cached is not None:
            return cached
        state = self.share_state(self.free0, *self._fast_totals())
        lat_new = list(pw.lat_new)
        lat_reuse = list(pw.lat_reuse)
        for s in pw.llm:
            ld = pw.load[s]
            lat_new[s] = tuple(self.new_latency_lb(state, pw, s, pi) for pi in range(len(self.profiles)))
            lat_reuse[s] = tuple(
                state.instance_lb(inst.gpu_ids, self.run_busy0[inst.id],
                                  busy_share(self.r_load0[r] + ld, self.r_unit[r]),
                                  busy_share(ld, self.r_unit[r]), pw.lat_reuse[s][r])
                for r, inst in enumerate(self.reusable))
        view = PWorkflow(pw.index, pw.wf, pw.topo, pw.preds, pw.succs, pw.llm, pw.tool_lat, pw.load,
                         tuple(lat_new), tuple(lat_reuse))
        self._bound_views[pw.index] = view
        return view

    def _fast_totals(self) -> tuple[dict[str, float], dict[str, float]]:
        """GPU sharing: the running instances' compute and busy totals per GPU, as floats."""
        if self._fast0 is None:
            self._fast0 = ({g: float(x) for g, x in self.rho0.items()}, {g: float(x) for g, x in self.occ0.items()})
        return self._fast0

    def share_state(self, free: Mapping[str, int], comp: Mapping[str, float], busy: Mapping[str, float]) -> ShareState:
        from flowmaker.selection.sharing_alone import barred

        return ShareState(self.layout.gpus_by_node, free, comp, busy, float(self.kappa), self.u, barred(self))

    def new_latency_lb(self, state: ShareState, pw: PWorkflow, s: int, pi: int) -> float:
        """GPU sharing: a lower bound of stage s's slowed latency on a new instance of profile pi opened from
        `state` (`flowmaker.selection.sharing_bound`); INF when none can keep within the compute budget."""
        rho = busy_share(pw.load[s] / self.p_reps[pi], self.profiles[pi].max_output_tokens_per_s)
        least = state.new_busy_lb(self.p_k[pi], self.p_need[pi], rho)
        if least == INF:
            return INF
        return pw.lat_new[s][pi] * state.multiplier_lb(1.0 + state.kappa * least, rho)

    # ---- evaluation of one complete choice (the reference used by exhaustive and to build answers) ----

    def stage_latencies(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int],
                        factors: Sequence[float] | None = None) -> list[float]:
        """Stage latencies; `factors` (GPU sharing) multiplies each LLM stage's, in `pw.llm` order."""
        lat = list(pw.tool_lat)
        for j, (s, (kind, ref)) in enumerate(zip(pw.llm, choice, strict=True)):
            lat[s] = pw.lat_reuse[s][ref] if kind == REUSE else pw.lat_new[s][slot_prof[ref]]
            if factors is not None:
                lat[s] *= factors[j]
        return lat

    def place_new(self, free: dict[str, int], occ: dict[str, int], pi: int
                  ) -> tuple[str, tuple[str, ...]] | None:
        """Place ONE instance of profile pi on the state (free memory in units, occupancy as `occ_units`) and update both; the
        base contract's LeastLoaded, or the load-aware one under GPU sharing (a new instance of the variant
        occupies u of each of its GPUs: its final share is not known when it is placed)."""
        mpg = self.p_need[pi]
        if self.sharing:
            pl = place_least_busy(self.layout, free, occ, self.p_k[pi], mpg)
        else:
            pl = place_units(self.layout, free, self.p_k[pi], mpg)
        if pl is None:
            return None
        for g in pl[1]:
            free[g] -= mpg
            if self.sharing:
                occ[g] += self.u_units
        return pl

    def _on_gpus(self, gpu_ids: Iterable[str]) -> Iterator[Instance]:
        """The running instances on any of these GPUs, each once."""
        seen: set[str] = set()
        for g in gpu_ids:
            for inst in self.on_gpu.get(g, ()):
                if inst.id not in seen:
                    seen.add(inst.id)
                    yield inst

    def _tally(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int]
               ) -> tuple[list[float], list[float], dict[int, float], dict[int, float]]:
        """What a (prefix of a) choice puts where: per new slot its load and offered call-seconds per second
        (latency alone x arrival rate), per reused instance the same."""
        slot_load = [0.0] * len(slot_prof)
        slot_n = [0.0] * len(slot_prof)
        r_add: dict[int, float] = {}
        r_n: dict[int, float] = {}
        for s, (kind, ref) in zip(pw.llm[:len(choice)], choice, strict=True):
            if kind == REUSE:
                r_add[ref] = r_add.get(ref, 0.0) + pw.load[s]
                r_n[ref] = r_n.get(ref, 0.0) + self.rho * pw.lat_reuse[s][ref]
            else:
                slot_load[ref] += pw.load[s]
                slot_n[ref] += self.rho * pw.lat_new[s][slot_prof[ref]]
        return slot_load, slot_n, r_add, r_n

    def sharing_fast_state(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int],
                           places: Sequence[tuple[str, tuple[str, ...]]]) -> FastState:
        """What a (prefix of a) choice puts on the GPUs, in floats (within 1e-12 relative of the exact shares):
        per GPU its compute and busy totals, per reused instance id its compute and busy share, per slot the
        (compute, busy) share of each of its replicas. The last answer is kept: the branch and bound asks twice per
        prefix (`sharing_factors_fast`, then `sharing_bound.completion_bound`), and placement is a function of the
        choice, so (workflow, choice, slots) identify it."""
        last = self._fs_last
        if last is not None and last[0] == pw.index and last[1] == choice and last[2] == slot_prof:
            return last[3]
        out = self._fast_state(pw, choice, slot_prof, places)
        self._fs_last = (pw.index, list(choice), list(slot_prof), out)
        return out

    def _fast_state(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int],
                    places: Sequence[tuple[str, tuple[str, ...]]]) -> FastState:
        first = self.slot_offsets(slot_prof)
        slot_load, slot_n, r_add, r_n = self._tally(pw, choice, slot_prof)
        comp0, busy0 = self._fast_totals()
        comp = dict(comp0)
        busy = dict(busy0)
        r_rho: dict[str, float] = {}
        r_busy: dict[str, float] = {}
        for ref, add in r_add.items():
            inst = self.reusable[ref]
            r_rho[inst.id] = rf = busy_share(self.r_load0[ref] + add, self.r_unit[ref])
            r_busy[inst.id] = bf = add_offered(self.run_busy0[inst.id], r_n[ref])
            d_rho, d_busy = rf - self.run_rho0[inst.id], bf - self.run_busy0[inst.id]
            for g in inst.gpu_ids:
                comp[g] = comp.get(g, 0.0) + d_rho
                busy[g] = busy.get(g, 0.0) + d_busy
        rep: list[tuple[float, float]] = []
        for j, pi in enumerate(slot_prof):
            reps = self.p_reps[pi]
            rf = busy_share(slot_load[j] / reps, self.profiles[pi].max_output_tokens_per_s)
            bf = occupancy(slot_n[j] / reps)
            rep.append((rf, bf))
            for i in range(reps):
                for g in places[first[j] + i][1]:
                    comp[g] = comp.get(g, 0.0) + rf
                    busy[g] = busy.get(g, 0.0) + bf
        return comp, busy, r_rho, r_busy, rep

    def sharing_factors_fast(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int],
                             places: Sequence[tuple[str, tuple[str, ...]]]) -> list[float] | bool | None:
        """`sharing_factors` in floats, for the branch and bound's checks: the multipliers (within 1e-12 relative of
        the exact ones) when every check of Feasibility 5 passes with a relative margin of 1e-7 (so the exact
        arithmetic passes too); False when one fails by that margin (so the exact one fails too); else None:
        unsure, ask `sharing_factors`."""
        first = self.slot_offsets(slot_prof)
        comp, busy, r_rho, r_busy, rep = self.sharing_fast_state(pw, choice, slot_prof, places)
        busy0 = self._fast_totals()[1]
        r_add = {ref for kind, ref in choice if kind == REUSE}
        lo = self.u * (1 + EPS) * (1 - _MARGIN)  # clearly within the budget
        hi = self.u * (1 + EPS) * (1 + _MARGIN)  # clearly beyond it
        unsure = False
        touched = {g for ref in r_add for g in self.reusable[ref].gpu_ids}
        touched.update(g for _, gids in places for g in gids)
        for g in touched:
            x = comp.get(g, 0.0)
            if not x <= lo:
                if x > hi:
                    return False
                unsure = True
        kappa = float(self.kappa)

        def factor(gids: Sequence[str], own: float, totals: dict[str, float]) -> float:
            worst = 0.0
            for g in gids:
                x = totals.get(g, 0.0) - own
                if x > worst:
                    worst = x
            return 1.0 + kappa * worst

        for inst in self._on_gpus(touched):
            rho0, b0 = self.run_rho0[inst.id], self.run_busy0[inst.id]
            f0 = factor(inst.gpu_ids, b0, busy0)
            x0 = rho0 * f0
            rho1, b1 = r_rho.get(inst.id, rho0), r_busy.get(inst.id, b0)
            if x0 < 1.0 - _MARGIN and inst.id not in r_rho and _same_worst(inst.gpu_ids, touched, busy, busy0, b0):
                continue  # its most crowded GPU is one the variant leaves alone: exactly as slow as before (finite)
            f1 = factor(inst.gpu_ids, b1, busy)
            x1 = rho1 * f1
            if x1 > 1.0 + _MARGIN:
                return False  # m1 infinite: it can no longer keep up
            if abs(x0 - 1.0) <= _MARGIN or not x1 < 1.0 - _MARGIN:
                unsure = True
                continue
            m1 = f1 * (1 - rho0) / (1 - x1)
            if x0 > 1.0:  # m0 infinite: not made slower
                continue
            m0 = f0 * (1 - rho0) / (1 - x0)
            if m1 < m0 * (1 - _MARGIN):
                continue
            slower = m1 > m0 * (1 + _MARGIN)  # clearly made slower: its checks apply
            for v, cap in ((x1, self.u * (1 + EPS)),
                           (m1, inst.max_slowdown * (1 + EPS) if inst.max_slowdown > 0 else INF)):
                if not v <= cap * (1 - _MARGIN):
                    if slower and v > cap * (1 + _MARGIN):
                        return False
                    unsure = True
        out: list[float] = []
        done: dict[tuple[str, int], float] = {}
        for kind, ref in choice:
            if (kind, ref) in done:
                out.append(done[kind, ref])
                continue
            if kind == REUSE:
                inst = self.reusable[ref]
                pairs = [(inst.gpu_ids, r_rho[inst.id], r_busy[inst.id])]
            else:
                pairs = [(places[first[ref] + i][1], *rep[ref]) for i in range(self.p_reps[slot_prof[ref]])]
            m = 1.0
            for gids, rho, own in pairs:
                f = factor(gids, own, busy)
                x = rho * f
                if not (x <= lo and x < 1.0 - _MARGIN):
                    if x > hi or x > 1.0 + _MARGIN:
                        return False
                    unsure = True
                    continue
                m = max(m, f * (1 - rho) / (1 - x))
            done[kind, ref] = m
            out.append(m)
        return None if unsure else out

    def sharing_factors(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int],
                        places: Sequence[tuple[str, tuple[str, ...]]]) -> list[float] | None:
        """GPU sharing (Feasibility 5): per LLM stage (in `pw.llm` order) its latency multiplier, or None when the
        variant breaks a GPU's compute budget, leaves an instance unable to keep up once slowed, or slows a
        running co-resident past what it tolerates. Identity without sharing."""
        if not self.sharing:
            return [1.0] * len(choice)
        # `choice` may be a prefix (the first stages in topological order): every share only grows as stages
        # are added, so a prefix that fails fails every completion (the branch and bound prunes with it).
        first = self.slot_offsets(slot_prof)
        slot_load, slot_n, r_add, r_n = self._tally(pw, choice, slot_prof)
        comp = dict(self.rho0)  # compute shares per GPU
        busy = dict(self.occ0)  # busy shares per GPU
        r_rho: dict[str, Fraction] = {}
        r_busy: dict[str, Fraction] = {}
        for ref, add in r_add.items():
            inst = self.reusable[ref]
            r_rho[inst.id] = rf = _frac(busy_share(self.r_load0[ref] + add, self.r_unit[ref]))
            r_busy[inst.id] = bf = _frac(add_offered(self.run_busy0[inst.id], r_n[ref]))
            d_rho, d_busy = rf - _frac(self.run_rho0[inst.id]), bf - _frac(self.run_busy0[inst.id])
            for g in inst.gpu_ids:
                comp[g] = comp.get(g, _ZERO) + d_rho
                busy[g] = busy.get(g, _ZERO) + d_busy
        rep: list[tuple[Fraction, Fraction]] = []  # per slot: (compute, busy) share of each replica
        for j, pi in enumerate(slot_prof):
            reps = self.p_reps[pi]
            rf = _frac(busy_share(slot_load[j] / reps, self.profiles[pi].max_output_tokens_per_s))
            bf = _frac(occupancy(slot_n[j] / reps))
            rep.append((rf, bf))
            for i in range(reps):
                for g in places[first[j] + i][1]:
                    comp[g] = comp.get(g, _ZERO) + rf
                    busy[g] = busy.get(g, _ZERO) + bf
        touched = {g for ref in r_add for g in self.reusable[ref].gpu_ids}
        touched.update(g for _, gids in places for g in gids)
        if any(comp.get(g, _ZERO) > self.budget for g in touched):  # 5.1 compute budget
            return None

        def mult(gids: Sequence[str], rho: Fraction, own_busy: Fraction) -> Fraction | None:
            """5.2: the latency multiplier of an instance, None when slowed it cannot stay within the cap."""
            f = speed_factor(gids, own_busy, busy, self.kappa)
            if rho * f > self.budget:
                return None
            return multiplier(f, rho)

        # 5.4: running co-residents on the GPUs the variant uses (reused ones too): none slowed into overload
        # or past what its tasks tolerate, unless it is not made slower.
        for inst in self._on_gpus(touched):
            got = self._m0.get(inst.id)
            if got is None:  # the variant-independent part, once per request
                rho0, b0 = _frac(self.run_rho0[inst.id]), _frac(self.run_busy0[inst.id])
                f0 = speed_factor(inst.gpu_ids, b0, self.occ0, self.kappa)
                got = self._m0[inst.id] = (rho0, b0, None if rho0 * f0 >= 1 else f0 * (1 - rho0) / (1 - rho0 * f0))
            rho0, b0, m0 = got
            rho1, b1 = r_rho.get(inst.id, rho0), r_busy.get(inst.id, b0)
            f1 = speed_factor(inst.gpu_ids, b1, busy, self.kappa)
            m1 = None if rho1 * f1 >= 1 else f1 * (1 - rho0) / (1 - rho1 * f1)
            if m1 is not None and (m0 is None or m1 <= m0):
                continue  # not made slower
            if m1 is None or rho1 * f1 > self.budget:
                return None
            if inst.max_slowdown > 0 and m1 > Fraction(inst.max_slowdown) * (1 + Fraction(EPS)):
                return None

        out: list[float] = []
        done: dict[tuple[str, int], float] = {}  # one multiplier per instance, however many stages it serves
        for kind, ref in choice:
            if (kind, ref) in done:
                out.append(done[kind, ref])
                continue
            if kind == REUSE:
                inst = self.reusable[ref]
                m = mult(inst.gpu_ids, r_rho[inst.id], r_busy[inst.id])
                if m is None:
                    return None
            else:
                ms = [mult(places[first[ref] + i][1], *rep[ref]) for i in range(self.p_reps[slot_prof[ref]])]
                if any(x is None for x in ms):
                    return None
                m = max(x for x in ms if x is not None)
            done[kind, ref] = float(m)
            out.append(done[kind, ref])
        return out

    @staticmethod
    def longest_path(pw: PWorkflow, lat: Sequence[float]) -> float:
        """L of the stage latencies `lat`: each stage finishes at its latest predecessor's finish (0 for a root)
        plus its own latency, in topological order (the same sums, bit for bit, as a max over every stage's
        predecessors: a max over one value is that value)."""
        fin = [0.0] * len(lat)
        for s, p, ps in pw.path_plan:
            if p >= 0:
                fin[s] = fin[p] + lat[s]
            elif ps:
                fin[s] = max([fin[q] for q in ps]) + lat[s]
            else:
                fin[s] = 0.0 + lat[s]
        return max(fin)

    def build_variant(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int],
                      placements: Sequence[tuple[str, tuple[str, ...]]]) -> Variant:
        """Assemble the response object for a feasible choice. `placements` holds one entry per new
        instance in placement order: a slot (group) of r replicas takes r consecutive entries."""
        lat = self.stage_latencies(pw, choice, slot_prof, self.sharing_factors(pw, choice, slot_prof, placements))
        L = self.longest_path(pw, lat)
        first = self.slot_offsets(slot_prof)
        slot_load = [0.0] * len(slot_prof)
        reuse_load: dict[int, float] = {}
        assigns: list[StageAssignment] = []
        accs: list[float] = []
        for s, (kind, ref) in zip(pw.llm, choice, strict=True):
            st = pw.wf.stages[s]
            if kind == REUSE:
                inst = self.reusable[ref]
                reuse_load[ref] = reuse_load.get(ref, 0.0) + pw.load[s]
                accs.append(self.models[inst.model_id].accuracy)
                assigns.append(StageAssignment(st.id, inst.model_id, inst.tp, inst.pp, True, instance_id=inst.id,
                                               gpu_ids=inst.gpu_ids, latency_s=lat[s],
                                               load_output_tokens_per_s=pw.load[s]))
            else:
                pi = slot_prof[ref]
                p = self.profiles[pi]
                slot_load[ref] += pw.load[s]
                accs.append(self.p_acc[pi])
                keys = tuple(f"new-{first[ref] + i}" for i in range(self.p_reps[pi]))
                assigns.append(StageAssignment(st.id, p.model_id, p.tp, p.pp, False, new_key=keys[0],
                                               gpu_ids=placements[first[ref]][1], latency_s=lat[s],
                                               load_output_tokens_per_s=pw.load[s],
                                               replica_keys=keys if len(keys) > 1 else ()))
        news = []
        for j, pi in enumerate(slot_prof):
            p, reps = self.profiles[pi], self.p_reps[pi]
            for i in range(reps):  # each replica is planned at an equal share of the group's load
                node, gids = placements[first[j] + i]
                news.append(NewInstance(f"new-{first[j] + i}", p.model_id, p.tp, p.pp, node, gids,
                                        p.memory_gb_per_gpu, slot_load[j] / reps))
        mem = sum(self.p_mem[pi] for pi in slot_prof)
        return Variant(
            workflow_id=pw.wf.id, assignments=tuple(assigns), new_instances=tuple(news),
            reuse=tuple((self.reusable[i].id, ld) for i, ld in sorted(reuse_load.items())),
            latency_s=L, accuracy=min(accs), cost=mem * L, new_memory_gb=sum(self.p_gb[pi] for pi in slot_prof),
            new_gpus=sum(self.p_gpus[pi] for pi in slot_prof))

    def slot_offsets(self, slot_prof: Sequence[int]) -> list[int]:
        """Index of each slot's first replica among the new instances (placement order)."""
        out, n = [], 0
        for pi in slot_prof:
            out.append(n)
            n += self.p_reps[pi]
        return out

    def check(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int]
              ) -> tuple[int, list[tuple[str, tuple[str, ...]]]]:
        """Check one complete choice from scratch, constraints in the spec's order.

        Returns (first failed constraint: 1 accuracy, 2 latency, 3 capacity,
        4 placement; 5 = feasible) and the placements of the new instances.
        """
        for kind, ref in choice:
            pi = self.r_prof[ref] if kind == REUSE else slot_prof[ref]
            if not self.p_ok[pi]:
                return 1, []
        lat = self.stage_latencies(pw, choice, slot_prof)
        if not leq(self.longest_path(pw, lat), self.lam):
            return 2, []
        slot_load = [0.0] * len(slot_prof)
        r_load: dict[int, float] = {}
        for s, (kind, ref) in zip(pw.llm, choice, strict=True):
            if kind == REUSE:
                r_load[ref] = r_load.get(ref, self.r_load0[ref]) + pw.load[s]
            else:
                slot_load[ref] += pw.load[s]
        for j, pi in enumerate(slot_prof):
            if not leq(slot_load[j], self.p_cap[pi]):
                return 3, []
        for i, ld in r_load.items():  # every reused instance, even when this variant adds no load
            if not leq(ld, self.p_cap[self.r_prof[i]]):
                return 3, []
        free = dict(self.free0)
        occ = dict(self.occ_units)
        places: list[tuple[str, tuple[str, ...]]] = []
        for pi in slot_prof:
            for _ in range(self.p_reps[pi]):  # a group places its replicas one after another
                pl = self.place_new(free, occ, pi)
                if pl is None:
                    return 4, []
                places.append(pl)
        if self.sharing:  # 5. GPU sharing: compute budget, then latency with co-residents' slowdown
            factors = self.sharing_factors(pw, choice, slot_prof, places)
            if factors is None or not leq(self.longest_path(pw, self.stage_latencies(pw, choice, slot_prof,
                                                                                      factors)), self.lam):
                return 4, []
        return 5, places

    def score(self, pw: PWorkflow, choice: Sequence[Choice], slot_prof: Sequence[int],
              places: Sequence[tuple[str, tuple[str, ...]]] = ()) -> tuple[float, float, int]:
        """(cost, latency, new GPUs) of a complete choice: the key the spec's tie-breaks order by. Under GPU
        sharing the latency depends on the placement: pass the `places` that `check` returned."""
        factors = self.sharing_factors(pw, choice, slot_prof, places) if self.sharing else None
        if factors is None and self.sharing:
            return INF, INF, sum(self.p_gpus[p] for p in slot_prof)
        lat = self.longest_path(pw, self.stage_latencies(pw, choice, slot_prof, factors))
        return sum(self.p_mem[p] for p in slot_prof) * lat, lat, sum(self.p_gpus[p] for p in slot_prof)

    def result(self, strategy: str, best_at: tuple[PWorkflow, Sequence[Choice], Sequence[int],
                                                    Sequence[tuple[str, tuple[str, ...]]]],
               started: float, evaluated: int, timed_out: bool = False, *, optimal: bool = False,
               lower_bound: float = 0.0) -> SelectionResult:
        """The answer for a found variant; `optimal` when the strategy proved it least-cost (the lower
        bound is then its cost), else `lower_bound` is what it proved."""
        pw, choice, slots, places = best_at
        v = self.build_variant(pw, choice, slots, places)
        return SelectionResult(strategy=strategy, variant=v,
                               variants_evaluated=evaluated, search_space_size=self.total_space(),
                               elapsed_s=time.perf_counter() - started, timed_out=timed_out, optimal=optimal,
                               lower_bound=v.cost if optimal else min(max(lower_bound, 0.0), v.cost))

    # ---- search-space size (the spec's space, accuracy ignored) ----

    def space_size(self, pw: PWorkflow, start: int = 0, open_slots: int = 0) -> int:
        """Number of variants of this workflow from LLM decision `start` on, with `open_slots`
        new instances already opened: each stage reuses (R ways), joins an open new instance,
        or opens a new one of any profile (P ways)."""
        R, P = len(self.reusable), len(self.profiles)
        counts = {open_slots: 1}
        for _ in range(start, len(pw.llm)):
            nxt: dict[int, int] = {}
            for k, c in counts.items():
                nxt[k] = nxt.get(k, 0) + c * (R + k)
                if P:
                    nxt[k + 1] = nxt.get(k + 1, 0) + c * P
            counts = nxt
        return sum(counts.values())

    def total_space(self) -> int:
        return sum(self.space_size(pw) for pw in self.workflows)


_REASON = {1: Infeasibility.NO_MODEL_MEETS_ACCURACY, 2: Infeasibility.NO_LATENCY,
           3: Infeasibility.NO_CAPACITY, 4: Infeasibility.NO_GPU_MEMORY}

_DETAIL = {
    1: "no LLM stage of any approved workflow can be served by a model with accuracy >= {alpha}",
    2: "no variant whose models meet accuracy >= {alpha} finishes within {lam} s",
    3: "every variant meeting accuracy and latency overloads an instance at {rho} req/s "
       "(utilization cap {u})",
    4: "every variant meeting accuracy, latency and capacity needs more GPU memory than is free",
}
_DETAIL_SHARING = ("every variant meeting accuracy, latency and capacity needs more GPU memory than is free, or "
                   "overloads a shared GPU (compute above {u}, or an instance that can no longer keep up once slowed), "
                   "or slows a running co-resident past what its tasks tolerate, or misses {lam} s once co-residents "
                   "slow it")


def infeasible_result(problem: Problem, strategy: str, level: int, started: float, evaluated: int,
                      timed_out: bool = False, *, optimal: bool = False) -> SelectionResult:
    """The answer when no feasible variant was found; `level` is the tightest failed constraint;
    `optimal` when the strategy proved that no feasible variant exists."""
    level = max(1, min(level, 4))
    text = _DETAIL_SHARING if level == 4 and problem.sharing else _DETAIL[level]
    detail = text.format(alpha=problem.alpha, lam=problem.lam, rho=problem.rho, u=problem.u)
    return SelectionResult(strategy=strategy, variant=None, reason=_REASON[level], reason_detail=detail,
                           variants_evaluated=evaluated, search_space_size=problem.total_space(),
                           elapsed_s=time.perf_counter() - started, timed_out=timed_out, optimal=optimal)


def better(cost: float, lat: float, gpus: int, best: tuple[float, float, int] | None) -> bool:
    """Lexicographic (cost, latency, new GPUs) with float tolerance: the spec's tie-breaks."""
    if best is None:
        return True
    bc, bl, bg = best
    tol_c = REL_TOL * max(abs(bc), 1e-300)
    if cost < bc - tol_c:
        return True
    if cost > bc + tol_c:
        return False
    tol_l = REL_TOL * max(abs(bl), 1e-300)
    if lat < bl - tol_l:
        return True
    if lat > bl + tol_l:
        return False
    return gpus < bg


INF = math.inf
_ZERO = Fraction(0)


def _same_worst(gpu_ids: Sequence[str], touched: set[str], busy: Mapping[str, float], busy0: Mapping[str, float],
                own: float) -> bool:
    """GPU sharing, floats: a running instance (not reused) whose co-residents' busy total is clearly highest
    (by 1e-9) on a GPU the variant does not touch has exactly its former speed factor, since the exact maximum is
    then that untouched GPU's unchanged total."""
    untouched = [busy0.get(g, 0.0) - own for g in gpu_ids if g not in touched]
    if not untouched:
        return False
    w = max(untouched)
    return all(busy.get(g, 0.0) - own < w - 1e-9 * max(1.0, abs(w)) for g in gpu_ids if g in touched)


def _frac(x: float) -> Fraction:
    return Fraction(x) if math.isfinite(x) else Fraction(10**9)
