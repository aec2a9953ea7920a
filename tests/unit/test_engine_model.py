"""Unit tests of the engine performance model (pure, virtual time)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmaker.domain import Profile
from flowmaker.engine import Completion, EngineModel

P = Profile("m", 1, 1, 10.0, fixed_s=0.05, prefill_s_per_token=0.0004, decode_s_per_token=0.02,
            max_output_tokens_per_s=1000.0)


def drain(m: EngineModel) -> list[Completion]:
    done: list[Completion] = []
    while (t := m.next_event_time()) is not None:
        done += m.advance(t)
    return done


@pytest.mark.parametrize(("n_in", "n_out", "t0"), [(0, 1, 0.0), (100, 50, 1.0), (3000, 700, 12.5), (1, 1, 3.3)])
def test_lone_request_latency_is_exact(n_in: int, n_out: int, t0: float) -> None:
    m = EngineModel(P)
    m.submit("a", n_in, n_out, t0)
    (c,) = drain(m)
    assert c.finish_time - t0 == pytest.approx(P.call_latency_s(n_in, n_out), abs=1e-9)
    assert c.first_token_time - t0 == pytest.approx(P.fixed_s + P.prefill_s_per_token * n_in
                                                    + P.decode_s_per_token, abs=1e-9)
    assert m.in_flight == 0 and m.tokens_emitted == n_out and m.prompt_tokens_processed == n_in


def test_throughput_saturates_at_max_tokens_per_s() -> None:
    prof = Profile("m", 1, 1, 10.0, 0.05, 1e-5, 0.02, 1000.0)
    m = EngineModel(prof, max_batch=64)
    for i in range(400):
        m.submit(f"r{i}", 100, 500, 0.0)
    done = drain(m)
    assert len(done) == 400
    makespan = max(c.finish_time for c in done)
    assert 400 * 500 / makespan == pytest.approx(1000.0, rel=0.02)


def test_latency_flat_below_capacity_and_grows_beyond() -> None:
    """The roofline: per-token time stays decode_s_per_token while b <= decode*max_tps (= 20 here)."""
    prof = Profile("m", 1, 1, 10.0, 0.0, 0.0, 0.02, 1000.0)
    for b, per_token in [(10, 0.02), (20, 0.02), (40, 0.04)]:
        m = EngineModel(prof)
        for i in range(b):
            m.submit(str(i), 0, 100, 0.0)
        done = drain(m)
        assert all(c.finish_time == pytest.approx(100 * per_token, abs=1e-9) for c in done)


def test_fifo_admission_with_batch_limit() -> None:
    m = EngineModel(P, max_batch=1)
    for i in range(5):
        m.submit(f"r{i}", 10, 5 + (4 - i), float(i) * 0.001)
    done = drain(m)
    assert [c.req_id for c in done] == [f"r{i}" for i in range(5)]
    finishes = [c.finish_time for c in done]
    assert finishes == sorted(finishes)


def test_kv_capacity_head_blocks_followers() -> None:
    m = EngineModel(P, kv_capacity_tokens=1000)
    m.submit("big1", 500, 100, 0.0)  # 600 reserved
    m.submit("big2", 500, 100, 0.0)  # does not fit beside big1 -> waits
    m.submit("small", 10, 10, 0.0)  # would fit, but FIFO: waits behind big2
    m.advance(0.06)
    assert m.running == 1 and m.waiting == 2 and m.kv_tokens_in_use == 600
    done = drain(m)
    order = [c.req_id for c in done]
    assert order.index("big1") < order.index("big2")
    big1 = next(c for c in done if c.req_id == "big1")
    small = next(c for c in done if c.req_id == "small")
    assert small.first_token_time > big1.finish_time
    assert m.kv_tokens_in_use == 0


def test_late_arrival_joins_at_next_step_boundary() -> None:
    prof = Profile("m", 1, 1, 10.0, 0.0, 0.001, 0.02, 1000.0)
    m = EngineModel(prof)
    m.submit("long", 0, 1000, 0.0)
    assert m.next_event_time() == pytest.approx(20.0)
    m.advance(0.5)
    m.submit("late", 100, 10, 0.51)  # steps end at 0.02*j: it joins the step starting at 0.52
    t = m.next_event_time()
    assert t is not None and t < 20.0  # the planned run was cut for the newcomer
    done = drain(m)
    late = next(c for c in done if c.req_id == "late")
    assert late.first_token_time == pytest.approx(0.52 + 0.1 + 0.02, abs=1e-9)
    assert late.finish_time == pytest.approx(0.52 + 0.1 + 10 * 0.02, abs=1e-9)
    long = next(c for c in done if c.req_id == "long")
    assert long.finish_time == pytest.approx(20.0 + 0.1, abs=1e-9)  # stalled once by the prefill


def test_emitted_and_next_step_time_for_streaming() -> None:
    m = EngineModel(Profile("m", 1, 1, 10.0, 0.0, 0.0, 0.1, 1000.0))
    m.submit("s", 0, 5, 0.0)
    seen = []
    while (t := m.next_step_time()) is not None:
        m.advance(t)
        seen.append((round(t, 9), m.emitted("s")))
    assert seen[:4] == [(0.1, 1), (0.2, 2), (0.3, 3), (0.4, 4)]
    assert m.completed == 1


@pytest.mark.parametrize(("call", "field"), [
    (lambda m: m.submit("x", 1, 0, 0.0), "out_tokens"),
    (lambda m: m.submit("x", -1, 3, 0.0), "in_tokens"),
    (lambda m: m.submit("x", 900, 200, 0.0), "in_tokens"),
])
def test_bad_submit_names_the_field(call, field) -> None:  # type: ignore[no-untyped-def]
    m = EngineModel(P, kv_capacity_tokens=1000)
    with pytest.raises(ValueError, match=field):
        call(m)


def test_time_never_goes_back_and_ids_are_unique() -> None:
    m = EngineModel(P)
    m.submit("a", 1, 1, 5.0)
    with pytest.raises(ValueError, match="req_id"):
        m.submit("a", 1, 1, 5.0)
    with pytest.raises(ValueError, match="now"):
        m.submit("b", 1, 1, 4.0)
    with pytest.raises(ValueError, match="to_time"):
        m.advance(1.0)


reqs = st.lists(st.tuples(st.floats(0, 5), st.integers(0, 300), st.integers(1, 60)), min_size=1, max_size=40)


def run_trace(trace: list[tuple[float, int, int]], max_batch: int, kv: int | None,
              step: float | None) -> list[Completion]:
    """Drive the model like a simulator; `step` = also advance on a fixed grid (must not change results)."""
    m = EngineModel(P, max_batch=max_batch, kv_capacity_tokens=kv)
    arrivals = sorted((t, i, n_in, n_out) for i, (t, n_in, n_out) in enumerate(trace))
    done: list[Completion] = []
    for t, i, n_in, n_out in arrivals:
        while (nxt := m.next_event_time()) is not None and nxt <= t:
            done += m.advance(nxt)
        if step:
            g = m.now
            while g + step < t:
                g += step
                done += m.advance(g)
        done += m.advance(t)
        m.submit(f"r{i}", n_in, n_out, t)
    done += drain(m)
    assert m.in_flight == 0 and m.kv_tokens_in_use == 0
    assert m.tokens_emitted == m.tokens_submitted == sum(n for _, _, n in trace)
    assert m.prompt_tokens_processed == sum(n for _, n, _ in trace)
    return done


@settings(max_examples=60, deadline=None)
@given(reqs, st.integers(1, 8), st.sampled_from([None, 400]))
def test_no_request_lost_tokens_conserved_and_never_faster_than_alone(
        trace: list[tuple[float, int, int]], max_batch: int, kv: int | None) -> None:
    done = run_trace(trace, max_batch, kv, None)
    assert sorted(c.req_id for c in done) == sorted(f"r{i}" for i in range(len(trace)))
    for c in done:
        t, n_in, n_out = trace[int(c.req_id[1:])]
        assert c.finish_time - t >= P.call_latency_s(n_in, n_out) - 1e-9
        assert t + P.fixed_s <= c.first_token_time <= c.finish_time


@settings(max_examples=30, deadline=None)
@given(reqs, st.integers(1, 8))
def test_deterministic_and_independent_of_how_time_is_advanced(
        trace: list[tuple[float, int, int]], max_batch: int) -> None:
    a = run_trace(trace, max_batch, None, None)
    b = run_trace(trace, max_batch, None, None)
    assert a == b
    c = run_trace(trace, max_batch, None, 0.037)
    assert sorted(x.req_id for x in a) == sorted(x.req_id for x in c)
    fa, fc = {x.req_id: x for x in a}, {x.req_id: x for x in c}
    for rid, x in fa.items():
        assert fc[rid].finish_time == pytest.approx(x.finish_time, abs=1e-6)
        assert fc[rid].first_token_time == pytest.approx(x.first_token_time, abs=1e-6)


def test_saturation_at_the_reference_shape_delivers_the_profile_capacity() -> None:
    """At the profile's own reference request (1024 in / 256 out) a saturated instance delivers
    max_output_tokens_per_s: prefill is paid once (as stalls), not also inside the decode rate."""
    from flowmaker.catalog import get_gpu_type, get_model
    from flowmaker.profiling.analytic import (
        KV_RESERVED_TOKENS,
        REF_OUTPUT_TOKENS,
        REF_PROMPT_TOKENS,
        analytic_profile,
    )
    for model, tp in (("Qwen2.5-7B-Instruct", 1), ("Llama-3.2-1B-Instruct", 1), ("Qwen2.5-14B-Instruct", 2)):
        prof = analytic_profile(get_model(model), get_gpu_type("A6000"), tp, 1)
        assert prof.decode_tokens_per_s > prof.max_output_tokens_per_s  # pure decode is faster
        m = EngineModel(prof, kv_capacity_tokens=KV_RESERVED_TOKENS)
        n = 400
        for i in range(n):
            m.submit(f"r{i}", REF_PROMPT_TOKENS, REF_OUTPUT_TOKENS, 0.0)
        done = drain(m)
        # steady state: between the first and the last quarter of completions (no ramp-up, no drain)
        ends = sorted(c.finish_time for c in done)
        a, b = ends[n // 4], ends[3 * n // 4]
        rate = (3 * n // 4 - n // 4) * REF_OUTPUT_TOKENS / (b - a)
        assert rate == pytest.approx(prof.max_output_tokens_per_s, rel=0.03), model


def test_short_prompts_saturate_at_the_pure_decode_rate() -> None:
    prof = Profile("m", 1, 1, 10.0, 0.0, 1e-4, 0.01, 500.0, decode_tokens_per_s=800.0)
    m = EngineModel(prof, max_batch=64)
    for i in range(640):
        m.submit(f"r{i}", 1, 400, 0.0)
    done = drain(m)
    makespan = max(c.finish_time for c in done)
    # 10 waves of 64: each wave 400 steps of 64/800 s, plus 64 x 0.1 ms of prefill
    assert makespan == pytest.approx(10 * (400 * 64 / 800 + 64 * 1e-4), rel=1e-9)


def test_speed_change_stretches_the_rest_of_the_work_only() -> None:
    """Hand-computed: 100 decode steps of 20 ms; at t=1.01 (mid-step 51, 10 ms left) speed halves:
    that 10 ms becomes 20 ms, the 49 steps left take 40 ms each -> 1.01 + 0.02 + 1.96 = 2.99."""
    prof = Profile("m", 1, 1, 10.0, 0.0, 0.0, 0.02, 1000.0)
    m = EngineModel(prof)
    m.submit("a", 0, 100, 0.0)
    assert m.set_speed(0.5, 1.01) == []
    assert m.emitted("a") == 50
    (c,) = drain(m)
    assert c.finish_time == pytest.approx(2.99, abs=1e-9)
    # back to full speed restores the profile's timing, prefill included, fixed_s never slowed
    p2 = Profile("m", 1, 1, 10.0, 0.5, 0.001, 0.02, 1000.0)
    m2 = EngineModel(p2)
    m2.set_speed(0.25, 0.0)
    m2.submit("b", 100, 10, 0.0)
    (c2,) = drain(m2)
    assert c2.finish_time == pytest.approx(0.5 + 4 * (0.1 + 10 * 0.02), abs=1e-9)
    assert m2.busy_s == pytest.approx(4 * (0.1 + 10 * 0.02), abs=1e-9)
    with pytest.raises(ValueError, match="speed"):
        m2.set_speed(0.0, 10.0)
    with pytest.raises(ValueError, match="speed"):
        m2.set_speed(1.5, 10.0)


@settings(max_examples=30, deadline=None)
@given(reqs, st.lists(st.tuples(st.floats(0, 8), st.sampled_from([0.25, 0.5, 1.0])), max_size=6))
def test_slower_is_never_faster_and_nothing_is_lost(trace: list[tuple[float, int, int]],
                                                    changes: list[tuple[float, float]]) -> None:
    """With speed changes at arbitrary times no request is lost, tokens are conserved, and no request
    finishes earlier than at full speed alone."""
    m = EngineModel(P)
    events = sorted([(t, 0, i) for i, (t, _, _) in enumerate(trace)] + [(t, 1, j) for j, (t, _) in enumerate(changes)])
    done: list[Completion] = []
    for t, kind, i in events:
        while (nxt := m.next_event_time()) is not None and nxt <= t:
            done += m.advance(nxt)
        if kind == 0:
            done += m.advance(t)
            m.submit(f"r{i}", trace[i][1], trace[i][2], t)
        else:
            done += m.set_speed(changes[i][1], t)
    done += drain(m)
    assert sorted(c.req_id for c in done) == sorted(f"r{i}" for i in range(len(trace)))
    assert m.tokens_emitted == sum(n for _, _, n in trace)
    for c in done:
        t, n_in, n_out = trace[int(c.req_id[1:])]
        assert c.finish_time - t >= P.call_latency_s(n_in, n_out) - 1e-9
