"""Pure parts of keeping plans current: the prediction re-derived on the whole placement (flowmaker.orchestration
.predict) is the engine load model on the tasks' planned calls, and rises for a task already there; the
burst meter (exact densest window, against a brute force); the drift rule's burst-aware rates, scale-in hysteresis
and prediction drift."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    StageAssignment,
    StageKind,
    Variant,
    Workflow,
)
from flowmaker.engine.loaded import Arrivals, Call, InstanceLoad, Loaded, placement_latencies
from flowmaker.orchestration.adapt import ArrivalMeter, LoadPolicy, TaskLoad, demand, drifted, peak_window_count
from flowmaker.orchestration.cluster import protected
from flowmaker.orchestration.predict import placement_key, predict_on_placement, slo_breaks
from flowmaker.orchestration.task import Reselection, TaskRecord, TaskState, selected_prediction
from flowmaker.selection.registry import select
from flowmaker.sharing import occupancy

A_MODEL, B_MODEL = "m-small", "m-better"
PA = Profile(A_MODEL, 1, 1, memory_gb_per_gpu=2.0, fixed_s=0.02, prefill_s_per_token=0.0002,
             decode_s_per_token=0.002, max_output_tokens_per_s=400.0)
PB = Profile(B_MODEL, 1, 1, memory_gb_per_gpu=3.0, fixed_s=0.03, prefill_s_per_token=0.0003,
             decode_s_per_token=0.003, max_output_tokens_per_s=300.0)
PROFILES = {PA.key: PA, PB.key: PB}
MODELS = (Model(A_MODEL, 0.2, 1.0, 1.0), Model(B_MODEL, 0.4, 3.0, 3.0))
WF = Workflow("w", (Stage("ask", input_tokens=100, output_tokens=20),
                    Stage("look", kind=StageKind.TOOL, latency_s=0.1, depends_on=("ask",)),
                    Stage("say", input_tokens=50, output_tokens=10, depends_on=("look",))))
KAPPA = 0.7


def _alone(p: Profile, s: Stage) -> float:
    return s.calls_per_request * p.call_latency_s(s.input_tokens, s.output_tokens)


def _task(tid: str, v: Variant, stage_instances: dict[str, str], rate: float, slo_s: float = 5.0) -> TaskRecord:
    return TaskRecord(tid, "d", Slo(0.1, slo_s, rate), candidates=(WF,), state=TaskState.ACTIVE, variant=v,
                      stage_instances=stage_instances, **selected_prediction(v))


def _running_a(rate: float) -> tuple[TaskRecord, Instance]:
    """Task A: both LLM stages on one running instance a0 of PA on GPU g0, planned at `rate`."""
    load = rate * (20 + 10)
    v = Variant("w", (StageAssignment("ask", A_MODEL, 1, 1, False, new_key="new-0", gpu_ids=("g0",),
                                      latency_s=_alone(PA, WF.stages[0])),
                      StageAssignment("say", A_MODEL, 1, 1, False, new_key="new-0", gpu_ids=("g0",),
                                      latency_s=_alone(PA, WF.stages[2]))),
                (), (), latency_s=_alone(PA, WF.stages[0]) + 0.1 + _alone(PA, WF.stages[2]), accuracy=0.2, cost=0.0,
                new_memory_gb=2.0, new_gpus=1)
    return _task("A", v, {"ask": "a0", "say": "a0"}, rate), Instance("a0", A_MODEL, 1, 1, ("g0",), load)


def _calls(task: str, rate: float, *stages: str, share: float = 1.0, say: float = 1.0) -> tuple[Arrivals, ...]:
    """Arrivals at an instance of PA/PB: each named stage of WF (they run one after another) at rate x share. A
    task's requests arrive as Poisson; "say" comes after "ask" (through the tool stage), as variable as `say` (the
    index of dispersion of ask's departures)."""
    by_id = {s.id: s for s in WF.stages}
    return tuple(Arrivals(rate * share, (Call((task, s), by_id[s].input_tokens, by_id[s].output_tokens),),
                          say if s == "say" else 1.0) for s in stages)


def _solve(loads: Callable[[dict[str, float]], dict[str, InstanceLoad]], say_from: dict[str, tuple[str, ...]],
           kappa: float, **kw: Any) -> dict[str, Loaded]:
    """placement_latencies with each task's "say" as variable as the departures of the instances its "ask" runs
    on (their mean; task -> those instances), re-solved until the dispersions settle."""
    disp = {t: 1.0 for t in say_from}
    for _ in range(50):
        got = placement_latencies(loads(disp), kappa, **kw)
        new = {t: statistics.fmean(got[i].clustering for i in iids) for t, iids in say_from.items()}
        if all(abs(new[t] - disp[t]) <= 1e-9 * new[t] for t in new):
            return got
        disp = new
    raise AssertionError("the dispersions did not settle")


def test_prediction_is_the_engine_load_model_on_the_planned_calls_and_rises_for_the_task_already_there() -> None:
    rate_a, rate_b = 3.0, 4.0
    a, a0 = _running_a(rate_a)
    # Alone on its GPU: both its stages' calls on a0 at A's planned rate, the tool stage's 0.1 s between them.
    # "say" gets ask's departures, clustered by a0's prompt stalls: as variable as a0's departures.
    alone = _solve(lambda d: {"a0": InstanceLoad(PA, ("g0",), _calls("A", rate_a, "ask", "say", say=d["A"]))},
                   {"A": ("a0",)}, KAPPA)
    assert alone["a0"].clustering > 1.2
    (got,) = predict_on_placement([a], [a0], PROFILES, KAPPA).values()
    want = {s: alone["a0"].latency_s[("A", s)] for s in ("ask", "say")}
    assert got.stage_latency_s == pytest.approx(want, rel=1e-6)
    assert got.latency_s == pytest.approx(want["ask"] + 0.1 + want["say"])
    # Queueing at its own load: above its latency alone.
    assert got.stage_latency_s["ask"] > 1.2 * _alone(PA, WF.stages[0])
    # B needs the better model: the selector (exact, GPU sharing) places a new instance beside a0 on the one GPU,
    # seeing a0 as the orchestrator shows it (planned busy share, planned load).
    n_a = rate_a * (_alone(PA, WF.stages[0]) + _alone(PA, WF.stages[2]))
    req = SelectionRequest(Slo(0.3, 5.0, rate_b), (WF,), MODELS, (PA, PB),
                           Cluster((Gpu("g0", "n0", 48.0, 2.0, "A6000"),),
                                   (replace(a0, busy_share=occupancy(n_a)),)),
                           SelectionOptions(gpu_sharing=GpuSharing.INTERFERENCE, interference=KAPPA))
    res = select(req, "exact")
    v = res.variant
    assert v is not None and [n.gpu_ids for n in v.new_instances] == [("g0",)] and not v.reuse
    b0 = Instance("b0", B_MODEL, 1, 1, ("g0",), v.new_instances[0].load_output_tokens_per_s)
    b = _task("B", v, {"ask": "b0", "say": "b0"}, rate_b)
    preds = predict_on_placement([a, b], [a0, b0], PROFILES, KAPPA)
    # Both solved together: each slowed to 1 / (1 + kappa) while the other is busy, f = 1 / its mean speed.
    both = _solve(lambda d: {"a0": InstanceLoad(PA, ("g0",), _calls("A", rate_a, "ask", "say", say=d["A"])),
                             "b0": InstanceLoad(PB, ("g0",), _calls("B", rate_b, "ask", "say", say=d["B"]))},
                  {"A": ("a0",), "B": ("b0",)}, KAPPA)
    share = both["b0"].busy_share
    assert both["a0"].f == pytest.approx(1 / (1 - share + share / (1 + KAPPA)), abs=1e-8)
    for tid, iid in (("A", "a0"), ("B", "b0")):
        lat = {s: both[iid].latency_s[(tid, s)] for s in ("ask", "say")}
        assert preds[tid].stage_latency_s == pytest.approx(lat, rel=1e-6)
        assert preds[tid].latency_s == pytest.approx(sum(lat.values()) + 0.1)
    assert preds["A"].latency_s > 1.05 * got.latency_s and preds["A"].differs(a)
    # B's prediction is the model's, not the selection's figure (the variant keeps that one).
    assert preds["B"].differs(b)
    # The key moves with the placement, not with a task's prediction.
    k = placement_key([a, b], [a0, b0])
    assert placement_key([a.with_prediction(9.0, {}, 1.0), b], [a0, b0]) == k
    assert placement_key([a], [a0]) != k and placement_key([a, b], [a0, replace(b0, gpu_ids=("g1",))]) != k


def test_prediction_replicas_overload_unknown_and_who_is_predicted() -> None:
    a, a0 = _running_a(1.0)
    # A replica group: each replica gets half of the stage's calls; the stage takes its slowest replica's latency.
    # Replica a1 shares g1 with z, which no task plans: busy min(1, load / capacity) = 0.5, as the selector sees it.
    grouped = replace(a, stage_instances={"ask": "a0", "ask#1": "a1", "say": "a0"})
    a1 = Instance("a1", A_MODEL, 1, 1, ("g1",), a0.load_output_tokens_per_s)
    other = Instance("z", B_MODEL, 1, 1, ("g1",), 150.0)
    p = predict_on_placement([grouped], [a0, a1, other], PROFILES, 1.0)["A"]
    # "say" gets the departures of both of ask's replicas, as variable as their mean.
    want = _solve(lambda d: {"a0": InstanceLoad(PA, ("g0",), _calls("A", 1.0, "ask", share=0.5)
                                                + _calls("A", 1.0, "say", say=d["A"])),
                             "a1": InstanceLoad(PA, ("g1",), _calls("A", 1.0, "ask", share=0.5))},
                  {"A": ("a0", "a1")}, 1.0, fixed_busy={"z": (("g1",), 0.5)})
    assert want["a1"].f == pytest.approx(1 / (0.5 + 0.5 / 2)) and want["a0"].f == 1.0
    assert p.stage_latency_s["ask"] == pytest.approx(want["a1"].latency_s[("A", "ask")], rel=1e-6)
    assert want["a1"].latency_s[("A", "ask")] > want["a0"].latency_s[("A", "ask")]
    assert p.stage_latency_s["say"] == pytest.approx(want["a0"].latency_s[("A", "say")], rel=1e-6)
    # Parallel stages of one request on one instance arrive together: each waits for the other's prompt.
    par = Workflow("p", (Stage("x", input_tokens=100, output_tokens=20), Stage("y", input_tokens=100, output_tokens=20)))
    vp = Variant("p", tuple(StageAssignment(s, A_MODEL, 1, 1, False, new_key="new-0", gpu_ids=("g0",), latency_s=0.1)
                            for s in ("x", "y")), (), (), latency_s=0.1, accuracy=0.2, cost=0.0, new_memory_gb=2.0,
                 new_gpus=1)
    tp = replace(_task("P", vp, {"x": "a0", "y": "a0"}, 2.0), candidates=(par,))
    together = placement_latencies({"a0": InstanceLoad(PA, ("g0",), (Arrivals(2.0, (
        Call(("P", "x"), 100, 20), Call(("P", "y"), 100, 20))),))}, 1.0)["a0"].latency_s
    assert predict_on_placement([tp], [a0], PROFILES, 1.0)["P"].stage_latency_s == {"x": together[("P", "x")],
                                                                                    "y": together[("P", "y")]}
    # An instance that can no longer keep up at the planned rate: infinite.
    hot, _ = _running_a(12.0)
    inf = predict_on_placement([hot], [a0], PROFILES, 1.0)["A"]
    assert math.isinf(inf.latency_s) and inf.differs(hot)
    # An instance not on the placement (gone, or its node lost), or a profile unknown: no prediction.
    assert predict_on_placement([a], [], PROFILES, 1.0) == {}
    assert predict_on_placement([a], [a0], {}, 1.0) == {}
    # Only ACTIVE tasks (of `only`) are predicted; a DEPLOYING one sends its planned calls all the same.
    deploying = replace(a, id="D", state=TaskState.DEPLOYING, stage_instances={"ask": "z", "say": "z"})
    got = predict_on_placement([a, deploying], [a0, replace(other, gpu_ids=("g0",))], PROFILES, 1.0)
    assert set(got) == {"A"} and got["A"].latency_s > predict_on_placement([a], [a0], PROFILES, 1.0)["A"].latency_s
    assert predict_on_placement([a], [a0], PROFILES, 1.0, only=frozenset()) == {}



def _on_b(gpu: str, iid: str) -> Variant:
    """Both of WF's LLM stages on one new instance `iid` of PB on `gpu`."""
    return Variant("w", tuple(StageAssignment(s.id, B_MODEL, 1, 1, False, new_key="new-0", gpu_ids=(gpu,),
                                              latency_s=_alone(PB, s)) for s in WF.stages if s.is_llm),
                   (), (), latency_s=0.5, accuracy=0.4, cost=0.0, new_memory_gb=3.0, new_gpus=1)


def test_slo_breaks_names_the_co_residents_a_move_would_push_past_their_slo() -> None:
    a, a0 = _running_a(3.0)
    # B serves on its own GPU g1 at 1 req/s; the load follower moves it, at 4 req/s, to a new instance.
    b = _task("B", _on_b("g1", "b0"), {"ask": "b0", "say": "b0"}, 1.0)
    b0 = Instance("b0", B_MODEL, 1, 1, ("g1",), 30.0)
    a_alone = predict_on_placement([a, b], [a0, b0], PROFILES, KAPPA)["A"].latency_s

    def moved_to(gpu: str) -> tuple[TaskRecord, Instance]:
        rec = replace(b, variant=_on_b(gpu, "b1"), stage_instances={"ask": "b1", "say": "b1"}, planned_rate_rps=4.0)
        return rec, Instance("b1", B_MODEL, 1, 1, (gpu,), 120.0)

    rec, b1 = moved_to("g0")  # beside A's instance
    beside = predict_on_placement([a, rec], [a0, b1], PROFILES, KAPPA)["A"].latency_s
    assert beside > 1.05 * a_alone  # what the test rests on: B's calls slow A
    # A's SLO between the two: the move breaks it; B itself (the task moved) is never named.
    a_tight = replace(a, slo=replace(a.slo, max_latency_s=(a_alone + beside) / 2))
    got = slo_breaks([a_tight, b], [a0, b0], PROFILES, KAPPA, rec, [b1], ["b0"])
    assert set(got) == {"A"} and got["A"] == pytest.approx((a_alone, beside), rel=1e-9)
    b_before = predict_on_placement([a, b], [a0, b0], PROFILES, KAPPA)["B"].latency_s
    b_after = predict_on_placement([a, rec], [a0, b1], PROFILES, KAPPA)["B"].latency_s
    assert b_after > 1.05 * b_before
    b_slo = replace(b.slo, max_latency_s=(b_before + b_after) / 2)
    assert set(slo_breaks([a_tight, replace(b, slo=b_slo)], [a0, b0], PROFILES, KAPPA, replace(rec, slo=b_slo),
                          [b1], ["b0"])) == {"A"}
    # A task being deployed (not on the placement yet) joins it: the same verdict for A.
    assert slo_breaks([a_tight], [a0], PROFILES, KAPPA, rec, [b1]) == got
    # The old instance released: with b0 left in place (as a stranger with a planned load on g1) nothing changes
    # for A, on g0; put on g0, that stranger would count as busy beside A after the move.
    assert slo_breaks([a_tight, b], [a0, b0], PROFILES, KAPPA, rec, [b1]) == got
    # To an idle GPU: nothing breaks; an SLO that holds after the move too: nothing; A already past it: not counted.
    rec2, b2 = moved_to("g2")
    assert slo_breaks([a_tight, b], [a0, b0], PROFILES, KAPPA, rec2, [b2], ["b0"]) == {}
    loose = replace(a, slo=replace(a.slo, max_latency_s=1.01 * beside))
    assert slo_breaks([loose, b], [a0, b0], PROFILES, KAPPA, rec, [b1], ["b0"]) == {}
    past = replace(a, slo=replace(a.slo, max_latency_s=0.99 * a_alone))
    assert slo_breaks([past, b], [a0, b0], PROFILES, KAPPA, rec, [b1], ["b0"]) == {}
    # Only the tasks asked about: A left out, nothing named.
    assert slo_breaks([a_tight, b], [a0, b0], PROFILES, KAPPA, rec, [b1], ["b0"], only=frozenset({"B"})) == {}



def test_protected_instances_tolerate_no_slowdown_and_have_no_room_left() -> None:
    c = Cluster((Gpu("g0", "n0", 48.0),), (Instance("x", A_MODEL, 1, 1, ("g0",), 100.0, max_slowdown=1.5),
                                          Instance("y", A_MODEL, 1, 1, ("g0",), 500.0),
                                          Instance("z", A_MODEL, 1, 1, ("g0",), 10.0, max_slowdown=3.0)))
    got = {i.id: (i.max_slowdown, i.load_output_tokens_per_s)
           for i in protected(c, ["x", "y", "w"], {"x": 400.0, "y": 400.0}).instances}
    # at least its capacity (an overloaded one keeps its load); the others as they were
    assert got == {"x": (1.0, 400.0), "y": (1.0, 500.0), "z": (3.0, 10.0)}
    assert protected(c, ["z"], {}).instances[2].load_output_tokens_per_s == 10.0  # no capacity known: load kept
    # Its GPU shows no free memory; the others are as they were.
    assert [g.memory_used_gb for g in protected(c, ["x"], {}).gpus] == [48.0]
    # What the selector makes of it (GPU sharing, kappa 0: no slowdown seen, so a tolerance alone would not bind):
    # x on the least busy GPU takes the reuse, or the new instance beside it (LeastLoaded); protected, neither: the
    # new instance goes to the other GPU, beside y.
    wf = Workflow("w", (Stage("ask", input_tokens=50, output_tokens=10),))
    two = Cluster((Gpu("g0", "n0", 48.0, 2.0), Gpu("g1", "n0", 48.0, 2.0)),
                  (Instance("x", A_MODEL, 1, 1, ("g0",), 100.0, busy_share=0.36),
                   Instance("y", A_MODEL, 1, 1, ("g1",), 140.0, busy_share=0.39)))
    opts = SelectionOptions(gpu_sharing=GpuSharing.INTERFERENCE, interference=0.0)
    req = SelectionRequest(Slo(0.1, 3.5, 10.0), (wf,), MODELS, (PA,), two, opts)
    assert [a.instance_id for a in select(req, "exact").variant.assignments] == ["x"]  # reuse costs nothing
    alone = replace(req, options=replace(opts, allow_reuse=False))
    assert [n.gpu_ids for n in select(alone, "exact").variant.new_instances] == [("g0",)]
    for r in (req, alone):
        v = select(replace(r, cluster=protected(two, ["x"], {"x": PA.max_output_tokens_per_s})), "exact").variant
        assert v is not None and "x" not in {a.instance_id for a in v.assignments}
        assert all(n.gpu_ids == ("g1",) for n in v.new_instances)
    assert select(replace(alone, cluster=protected(two, ["x", "y"], {})), "exact").variant is None


# ---- the burst meter -------------------------------------------------------------------------------


def _brute_peak(times: list[float], w: float) -> int:
    return max((sum(1 for u in times if t <= u < t + w) for t in times), default=0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=40), st.integers(1, 20))
def test_peak_window_count_is_the_brute_force(ticks: list[int], w: int) -> None:
    times = [t / 4 for t in ticks]  # exact quarters: ties at the window's end are exact too
    got = peak_window_count(times, w / 4)
    assert got == _brute_peak(times, w / 4)
    # No window, wherever it starts, holds more (a window starting between arrivals included).
    for start in [x / 8 for x in range(-8 * w, 8 * 61)]:
        assert sum(1 for u in times if start <= u < start + w / 4) <= got


def test_meter_measures_the_densest_slo_long_window() -> None:
    m = ArrivalMeter(window_s=20.0)
    rng = random.Random(1)
    times = sorted(rng.uniform(0.0, 20.0) for _ in range(20)) + [12.0 + i * 0.05 for i in range(10)]
    times.sort()
    for t in times:
        m.arrived("t", t, burst_window_s=1.0)
    ld = m.load("t", 20.0, time_scale=2.0)
    assert ld is not None
    assert ld.rate_rps == pytest.approx(30 / (20.0 - times[0]) / 2)  # over the span watched
    assert ld.burst_rps == pytest.approx(_brute_peak(times, 1.0) / 1.0 / 2) and ld.burst_rps >= 10 / 2
    # No window given: no burst metered.
    m2 = ArrivalMeter(window_s=20.0)
    for t in times:
        m2.arrived("t", t)
    ld2 = m2.load("t", 20.0)
    assert ld2 is not None and ld2.burst_rps == 0.0


def test_drift_rule_plans_for_bursts_keeps_hysteresis_and_acts_on_the_prediction() -> None:
    p = LoadPolicy(band=2.0, hold_down_s=5.0, min_samples=5, burst_cap=3.0)
    t = TaskRecord("t", "d", Slo(0.1, 3.0, 1.0), state=TaskState.ACTIVE)
    # The demand: the burst rate when higher than the mean, at most burst_cap x the mean.
    assert demand(TaskLoad(1.0, 0.0, 0, 2.5), p) == 2.5
    assert demand(TaskLoad(1.0, 0.0, 0, 9.0), p) == 3.0
    assert demand(TaskLoad(1.0, 0.0, 0, 0.5), p) == 1.0
    # A mean within the band, bursts beyond it: scale out, planned at the burst rate.
    since: dict[str, float] = {}
    peaks: dict[str, float] = {}
    bursty = {"t": TaskLoad(1.5, 1.0, 50, 2.6)}
    assert drifted({"t": t}, bursty, since, 0.0, p, peaks=peaks) == []
    ((_, rate, why),) = drifted({"t": t}, bursty, since, 5.0, p, peaks=peaks)
    assert rate == pytest.approx(2.6) and "bursts need 2.6" in why
    # Planned at the burst rate, its own mean does not scale it back in (the demand is compared).
    out = replace(t, planned_rate_rps=2.6)
    assert drifted({"t": out}, {"t": TaskLoad(1.1, 1.0, 50, 2.2)}, since, 10.0, p, peaks=peaks) == []
    assert drifted({"t": out}, {"t": TaskLoad(1.1, 1.0, 50, 2.2)}, since, 30.0, p, peaks=peaks) == [] and not since
    # Scale-in hysteresis: never below the highest demand seen while the drift lasted, nor the declared rate.
    big = replace(t, planned_rate_rps=12.0, slo=Slo(0.1, 3.0, 0.5))
    drifted({"t": big}, {"t": TaskLoad(1.0, 1.0, 50, 5.5)}, since, 100.0, p, peaks=peaks)  # 5.5 < 12 / 2
    drifted({"t": big}, {"t": TaskLoad(0.5, 1.0, 50, 1.0)}, since, 105.0, p, peaks=peaks)
    ((_, rate, _),) = drifted({"t": big}, {"t": TaskLoad(0.4, 1.0, 50, 0.4)}, since, 110.0, p, peaks=peaks)
    assert rate == pytest.approx(3.0)  # 5.5 capped at 3 x 1.0 (the cap holds for the peak too)
    assert not peaks and not since
    # The same without memory: headroom over what is seen now only.
    drifted({"t": big}, {"t": TaskLoad(0.4, 1.0, 50, 0.4)}, since, 200.0, p)
    assert drifted({"t": big}, {"t": TaskLoad(0.4, 1.0, 50, 0.4)}, since, 210.0, p)[0][1] == pytest.approx(0.6)
    since.clear()
    # A prediction re-derived past the SLO is a drift, even before any traffic is metered: re-select at the rate
    # it is planned for (or needs, when more).
    crowded = replace(t, predicted_latency_s=3.5, planned_rate_rps=1.2)
    assert drifted({"t": crowded}, {}, since, 300.0, p) == []
    ((_, rate, why),) = drifted({"t": crowded}, {}, since, 305.0, p)
    assert rate == pytest.approx(1.2) and "predicted latency 3.5s" in why
    drifted({"t": crowded}, {"t": TaskLoad(1.4, 1.0, 50, 2.0)}, since, 400.0, p)
    assert drifted({"t": crowded}, {"t": TaskLoad(1.4, 1.0, 50, 2.0)}, since, 405.0, p)[0][1] == pytest.approx(2.0)
    assert drifted({"t": replace(crowded, predicted_latency_s=math.inf)}, {}, {}, 0.0,
                   replace(p, hold_down_s=0.0))[0][0] == "t"
    # Within the SLO (to 1e-9): nothing.
    assert drifted({"t": replace(crowded, predicted_latency_s=3.0 * (1 + 1e-12))}, {}, {}, 0.0,
                   replace(p, hold_down_s=0.0)) == []
    # Acted on once: after a re-selection that left the placement as it was (the prediction was not re-derived
    # since), the same prediction is not a drift again until `prediction_retry_factor` hold-downs have passed.
    since.clear()
    done = replace(crowded, predicted_at=290.0, last_reselection=Reselection(306.0, "predicted", 1.2, "DONE"))
    assert drifted({"t": done}, {}, since, 320.0, p) == [] and not since
    assert drifted({"t": done}, {}, since, 355.0, p) == []
    assert drifted({"t": done}, {}, since, 356.0, p) == [] and since  # 50 s = 10 hold-downs: seen again
    assert drifted({"t": done}, {}, since, 361.0, p)[0][0] == "t"
    # Re-derived after it (the placement moved since): a drift again at once, held down as usual.
    since.clear()
    moved = replace(done, predicted_at=310.0)
    assert drifted({"t": moved}, {}, since, 320.0, p) == []
    assert drifted({"t": moved}, {}, since, 325.0, p)[0][0] == "t"
