"""The GPU-sharing search's shortcuts against the exact arithmetic they stand for (flowmaker.selection.problem,
flowmaker.selection.sharing_bound, flowmaker.selection.placement): integer occupancy places exactly as the
rationals do, the float checks never contradict the exact ones, and the per-prefix completion bound never
exceeds a feasible completion. The answers themselves are checked against the spec's brute force in
test_gpu_sharing."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gpu_sharing import brute_force, shared_requests, under_sharing

from flowmaker.domain import (
    Cluster,
    Gpu,
    GpuSharing,
    Instance,
    Model,
    Profile,
    SelectionOptions,
    SelectionRequest,
    Slo,
    Stage,
    StageKind,
    Workflow,
)
from flowmaker.selection import select
from flowmaker.selection.placement import NodeGpus, dyadic_units, place_least_busy
from flowmaker.selection.problem import NEW, REUSE, Choice, Problem, PWorkflow
from flowmaker.selection.sharing_bound import completion_bound

EXAMPLES = int(os.environ.get("FLOWMAKER_PROPERTY_EXAMPLES", "300")) // 5


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.7, 1 / 3, 0.05]), max_size=3), min_size=8,
                max_size=8),
       st.lists(st.sampled_from([10, 20, 30]), min_size=8, max_size=8),
       st.integers(0, 3), st.sampled_from([0.5, 0.7, 1.0]), st.integers(1, 4), st.sampled_from([5, 10, 20]))
def test_integer_occupancy_places_as_the_exact_rationals(shares: list[list[float]], free: list[int], placed: int,
                                                         u: float, k: int, need: int) -> None:
    """Shares summed as doubles (0.1 + 0.2 against 0.3: ties that only exact sums keep), plus u per new instance."""
    ids = [f"n{i // 4}-g{i % 4}" for i in range(8)]
    layout = NodeGpus(("n0", "n1"), (tuple(ids[:4]), tuple(ids[4:])))
    occ = {g: sum((Fraction(x) for x in xs), Fraction(0)) for g, xs in zip(ids, shares, strict=True)}
    scale = dyadic_units([*occ.values(), Fraction(u)])
    units = {g: int(v * scale) for g, v in occ.items()}
    free_u = dict(zip(ids, free, strict=True))
    for _ in range(placed + 1):
        want = place_least_busy(layout, free_u, occ, k, need)
        assert place_least_busy(layout, free_u, units, k, need) == want
        if want is None:
            return
        for g in want[1]:
            free_u[g] -= need
            occ[g] += Fraction(u)
            units[g] += int(Fraction(u) * scale)


def _choices(pb: Problem, pw: PWorkflow) -> Iterator[tuple[list[Choice], list[int]]]:
    """Every choice of the spec's space for this workflow (reuse, join a slot, open any profile), with its slots."""
    def go(j: int, choice: list[Choice], slots: list[int]) -> Iterator[tuple[list[Choice], list[int]]]:
        if j == len(pw.llm):
            yield list(choice), list(slots)
            return
        for r in range(len(pb.reusable)):
            yield from go(j + 1, [*choice, (REUSE, r)], slots)
        for k in range(len(slots)):
            yield from go(j + 1, [*choice, (NEW, k)], slots)
        for pi in range(len(pb.profiles)):
            yield from go(j + 1, [*choice, (NEW, len(slots))], [*slots, pi])

    yield from go(0, [], [])


def _placed(pb: Problem, slots: list[int]) -> list[tuple[str, tuple[str, ...]]] | None:
    free, occ = dict(pb.free0), dict(pb.occ_units)
    out = []
    for pi in slots:
        for _ in range(pb.p_reps[pi]):
            pl = pb.place_new(free, occ, pi)
            if pl is None:
                return None
            out.append(pl)
    return out


def _prefix(pb: Problem, choice: list[Choice], slots: list[int], j: int) -> tuple[list[Choice], list[int]]:
    """The first j stages of a choice and the slots they open."""
    head = choice[:j]
    return head, slots[:len({ref for kind, ref in head if kind == NEW})]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(under_sharing(shared_requests()))
def test_float_checks_never_contradict_the_exact_ones(req: SelectionRequest) -> None:
    pb = Problem(req)
    for pw in pb.workflows:
        for n, (choice, slots) in enumerate(_choices(pb, pw)):
            if n > 400:
                break
            places = _placed(pb, slots)
            if places is None:
                continue
            for j in range(1, len(choice) + 1):
                head, hs = _prefix(pb, choice, slots, j)
                hp = places[:sum(pb.p_reps[pi] for pi in hs)]
                fast = pb.sharing_factors_fast(pw, head, hs, hp)
                exact = pb.sharing_factors(pw, head, hs, hp)
                if fast is False:
                    assert exact is None
                elif isinstance(fast, list):
                    assert exact is not None
                    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(fast, exact, strict=True))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(under_sharing(shared_requests()))
def test_the_completion_bound_never_exceeds_a_feasible_completion(req: SelectionRequest) -> None:
    pb = Problem(req)
    for pw in pb.workflows:
        bv = pb.bound_view(pw)
        n_st = len(pw.wf.stages)
        reuse_opts = [sorted(range(len(pb.reusable)), key=lambda r, s=s: bv.lat_reuse[s][r]) if s in pw.llm else []
                      for s in range(n_st)]
        by_lat = [sorted(range(len(pb.profiles)), key=lambda p, s=s: bv.lat_new[s][p]) if s in pw.llm else []
                  for s in range(n_st)]
        by_mem = [sorted(range(len(pb.profiles)), key=lambda p: pb.p_mem[p]) for _ in range(n_st)]
        for n, (choice, slots) in enumerate(_choices(pb, pw)):
            if n > 400:
                break
            level, places = pb.check(pw, choice, slots)
            if level != 5:
                continue
            _, lat, _ = pb.score(pw, choice, slots, places)
            mem = sum(pb.p_mem[pi] for pi in slots)
            for j in range(1, len(choice)):
                head, hs = _prefix(pb, choice, slots, j)
                hp = places[:sum(pb.p_reps[pi] for pi in hs)]
                factors = pb.sharing_factors(pw, head, hs, hp)
                assert factors is not None  # a prefix of a feasible variant passes every check
                free = dict(pb.free0)
                for need, (_, gids) in zip((pb.p_need[p] for p in hs for _ in range(pb.p_reps[p])), hp, strict=True):
                    for g in gids:
                        free[g] -= need
                r_add = [0.0] * len(pb.reusable)
                slot_load = [0.0] * len(hs)
                for s, (kind, ref) in zip(pw.llm, head, strict=False):
                    if kind == REUSE:
                        r_add[ref] += pw.load[s]
                    else:
                        slot_load[ref] += pw.load[s]
                L_lb, extra = completion_bound(pb, pw, head, hs, hp, free, factors, r_add, slot_load, reuse_opts,
                                               by_lat, by_mem)
                assert L_lb <= lat * (1 + 1e-9)
                assert sum(pb.p_mem[pi] for pi in hs) + extra <= mem * (1 + 1e-9) + 1e-12


def test_a_running_instance_on_idle_gpus_is_priced_at_its_own_latency() -> None:
    """Held out by the brute force: run1 (profile a) runs alone on y7 and y9, so s0 reuses it unslowed, while a
    new instance of a would land beside busier GPUs. The capacity-priced bounds once took every free instance of a
    at a new instance's bound, and `milp` (main's too, on a sibling of this request) claimed a costlier optimum."""
    stage = [Stage("s0", StageKind.LLM, (), 100, 50), Stage("s1", StageKind.LLM, ("s0",), 100, 100),
             Stage("s2", StageKind.LLM, ("s0",), 100, 100, 2)]
    profiles = (Profile("b", 1, 1, 20.0, 0.02, 0.0002, 0.02, 600.0), Profile("a", 2, 1, 8.0, 0.01, 6e-05, 0.006, 150.0),
                Profile("x", 1, 1, 15.0, 0.0, 0.0001, 0.01, 200.0))
    gpus = (Gpu("y9", "n0", 33.0, 8.0), Gpu("y8", "n0", 40.0, 15.0), Gpu("y7", "n0", 33.0, 8.0),
            Gpu("x9", "n1", 73.0, 48.0), Gpu("x8", "n1", 33.0, 8.0))
    running = (Instance("run0", "x", 1, 1, ("y8",), 20.0), Instance("run1", "a", 2, 1, ("y7", "y9"), 30.0),
               Instance("run2", "b", 1, 1, ("x9",), 60.0), Instance("run3", "a", 2, 1, ("x8", "x9"), 15.0),
               Instance("run4", "b", 1, 1, ("x9",), 150.0))
    req = SelectionRequest(Slo(0.0, 8.0, 0.5), (Workflow("w0", tuple(stage)),),
                           (Model("a", 0.3, 3.0, 3.0), Model("b", 0.4, 8.0, 8.0)), profiles, Cluster(gpus, running),
                           SelectionOptions(utilization_cap=0.6, gpu_sharing=GpuSharing.INTERFERENCE))
    want = brute_force(req).best
    assert want is not None and math.isclose(want[0], 97.91183673469388, rel_tol=1e-9)  # s1 reuses run4
    for name in ("exact", "exhaustive", "milp"):
        got = select(req, name).variant
        assert got is not None, name
        assert math.isclose(got.cost, want[0], rel_tol=1e-9) and math.isclose(got.latency_s, want[1], rel_tol=1e-9), \
            (name, got.cost, got.latency_s, want)
