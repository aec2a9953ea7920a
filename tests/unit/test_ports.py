"""`flowmaker.ports.free_port`: ports drawn below the kernel's ephemeral range, never one in use."""

from __future__ import annotations

import random
import socket

import pytest

from flowmaker import ports


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = ports._ephemeral_low()
    if low is None or low - ports.PORT_FLOOR < ports.PORT_RANGE_MIN:
        pytest.skip("no room below this kernel's ephemeral range")
    got = [ports.free_port() for _ in range(20)]
    assert all(ports.PORT_FLOOR <= p < low for p in got)
    assert all(_bindable(p) for p in got)
    assert len(set(got)) > 1  # drawn, not one fixed port


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        spare = ports.free_port()  # a port free now, that the draw offers second
        draws = iter([taken, spare])
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_000)
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert ports.free_port() == spare


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.PORT_FLOOR + ports.PORT_RANGE_MIN - 1)
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: pytest.fail("drew a port"))
    p = ports.free_port()
    assert 0 < p < 65_536 and _bindable(p)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: None)  # no /proc (not Linux)
    assert 0 < ports.free_port() < 65_536


def test_a_port_to_avoid_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """`free_port` holds nothing, so two draws before any server binds may agree (a CI run's stack once gave one port
    to two of its processes): a port in `avoid` is passed over, by the draw and by the kernel's fallback alike."""
    first, second = ports.free_port(), ports.free_port()
    draws = iter([first, first, second])
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_000)
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
    assert ports.free_port(avoid=[first]) == second
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: None)  # the kernel picks; a port it offers twice is refused
    got = ports.free_port()
    assert ports.free_port(avoid={got}) != got


def test_free_ports_are_different_even_when_the_draw_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = ports.free_port(), ports.free_port()
    draws = iter([a, a, a, b])
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_000)
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, x, y: next(draws))
    assert ports.free_ports(2) == [a, b]


def test_a_stack_hands_out_each_port_once(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """`LocalStack` draws every service's port before any binds: a draw that repeats one it gave is drawn again, and a
    port fixed in its config is never drawn."""
    from pathlib import Path

    from flowmaker.launcher import LocalStack, StackConfig

    a, b, fixed = ports.free_ports(3)
    draws = iter([fixed, a, a, b])
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_000)
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, x, y: next(draws))
    stack = LocalStack(StackConfig(ports={"selector": fixed}))
    stack.work_dir = Path(str(tmp_path))
    assert [stack._port("deployer"), stack._port("profiler")] == [a, b]
