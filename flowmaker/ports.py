"""Free TCP ports for processes that are told their port up front rather than binding port 0 (etcd, engines, the
local stack's services)."""

from __future__ import annotations

import random
import socket
from collections.abc import Collection

# `free_port` draws from [PORT_FLOOR, the kernel's first ephemeral port) when that range holds PORT_RANGE_MIN ports.
PORT_FLOOR = 20_000
PORT_RANGE_MIN = 1_000
PORT_TRIES = 64


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free on `host` right now (for processes told their port up front rather than binding port 0), not one
    of `avoid`.

    Drawn at random below the kernel's ephemeral range where it can: a port that bind(0) hands out lies in that range,
    and so does the local port of every outgoing connection, so any process's next connection could take it before the
    server told to use it binds it (two test suites side by side make thousands). Below the range only another
    `free_port` caller can. Falls back to bind(0) when the range cannot be read or is too low, or no draw is free.

    Nothing holds the port once this returns, so a second call may return it again until it is bound: whoever hands
    out several ports before starting their servers passes the ones it gave (`free_ports`, `LocalStack`)."""
    low = _ephemeral_low()
    if low is not None and low - PORT_FLOOR >= PORT_RANGE_MIN:
        draw = random.SystemRandom()
        for _ in range(PORT_TRIES):
            port = draw.randrange(PORT_FLOOR, low)
            if port in avoid:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:  # without SO_REUSEADDR: a port still in TIME_WAIT is passed over too
                    s.bind((host, port))
                except OSError:
                    continue
            return port
    for _ in range(PORT_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError(f"no free port on {host} outside the {len(avoid)} given")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n different ports, each free on `host` right now (`free_port`)."""
    got: list[int] = []
    while len(got) < n:
        got.append(free_port(host, avoid=got))
    return got


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), or None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
