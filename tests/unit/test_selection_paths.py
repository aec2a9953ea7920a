"""The hot arithmetic of the searches, rewritten for speed, against its textbook form bit for bit: a search's
decisions compare these floats, so the rewrite may change no value (issue 24: the same answers at any speed)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from flowmaker.selection.problem import EPS, Problem, PWorkflow, leq, leq_limit


def _textbook_longest_path(preds: tuple[tuple[int, ...], ...], lat: list[float]) -> float:
    fin = [0.0] * len(lat)
    for s in range(len(lat)):  # the stages below are numbered in a topological order
        fin[s] = max((fin[p] for p in preds[s]), default=0.0) + lat[s]
    return max(fin)


@st.composite
def dags(draw: st.DrawFn) -> tuple[tuple[tuple[int, ...], ...], list[float]]:
    n = draw(st.integers(1, 12))
    preds = tuple(tuple(sorted(draw(st.sets(st.integers(0, s - 1), max_size=min(s, 4))))) if s else ()
                  for s in range(n))
    lat = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1e4, allow_nan=False), st.just(math.inf)),
                        min_size=n, max_size=n))
    return preds, lat


@settings(max_examples=400, deadline=None)
@given(dags())
def test_longest_path_equals_the_max_over_predecessors_bit_for_bit(g: tuple[tuple[tuple[int, ...], ...],
                                                                           list[float]]) -> None:
    preds, lat = g
    n = len(lat)
    succs = tuple(tuple(t for t in range(n) if s in preds[t]) for s in range(n))
    pw = PWorkflow(0, None, tuple(range(n)), preds, succs, (), (), (), (), ())  # type: ignore[arg-type]
    got = Problem.longest_path(pw, lat)
    want = _textbook_longest_path(preds, lat)
    assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


def test_a_chain_and_a_fan_take_their_plans() -> None:
    """A chain's stages each keep their one predecessor; a join keeps all of them."""
    pw = PWorkflow(0, None, (0, 1, 2, 3), ((), (0,), (0,), (1, 2)), ((1, 2), (3,), (3,), ()), (), (), (), (), ())  # type: ignore[arg-type]
    assert pw.path_plan == ((0, -1, ()), (1, 0, ()), (2, 0, ()), (3, -1, (1, 2)))
    assert Problem.longest_path(pw, [1.0, 2.0, 5.0, 0.5]) == 6.5


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True))
def test_leq_is_the_spec_tolerance_bit_for_bit(a: float, b: float) -> None:
    assert leq(a, b) == (a <= b + EPS * max(1.0, abs(b)))
    assert leq(a, b) == (a <= leq_limit(b))


def test_leq_at_the_edges() -> None:
    for b in (1.0, -1.0, 0.0, -0.0, 1.0 + 1e-16, 0.9999999999999999, math.inf, -math.inf):
        for a in (b, b + 1e-9, b + 2e-9, b - 1e-9, math.nan):
            assert leq(a, b) == (a <= b + EPS * max(1.0, abs(b)))
