"""Measuring kappa end to end: two real emulated engine processes on one emulated GPU (`--gpu-ids`,
`--gpu-share-dir`: processor sharing, so kappa is about 1), the measurement of flowmaker.profiling.interference,
and the record stored in a real etcd and read back."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from flowmaker.profiling.interference import EMULATED_PLAN, launch_emulated_pair, measure_interference
from flowmaker.sharing import DEFAULT_INTERFERENCE
from flowmaker.state import keys
from flowmaker.state.interference import SOURCE_DEFAULT, SOURCE_MEASURED, InterferenceStore

pytestmark = pytest.mark.integration

SCALE = 10.0  # engine seconds per wall second: probes of 32 ms wall, B's calls of 128 ms
BUDGET_S = 40.0  # the whole test takes ~16 s; fail (not hang) well past it


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie is gone too (its parent has not reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


async def test_kappa_of_the_emulated_gpu_is_about_one_and_is_stored(etcd_store, tmp_path: Path) -> None:
    t0 = time.monotonic()
    share_dir = tmp_path / "gpu-share"
    store = InterferenceStore(etcd_store)
    before = await store.get("A6000")
    assert (before.source, before.kappa) == (SOURCE_DEFAULT, DEFAULT_INTERFERENCE)

    a, b = await launch_emulated_pair(str(share_dir), time_scale=SCALE)
    pids = [a.process.pid, b.process.pid]
    try:
        result = await asyncio.wait_for(measure_interference(a, b, "A6000", EMULATED_PLAN), BUDGET_S)
    finally:
        await a.close()
        await b.close()
    assert all(_gone(p) for p in pids), pids
    assert not [m for g in share_dir.iterdir() for m in g.iterdir()]  # no busy mark left behind

    # What was measured: the engines' own timing and B's busy-time counter, three levels with B really busy.
    assert (result.latency_source, result.share_source) == ("engine", "engine_busy_time")
    assert len(result.points) == 3 and all(p.co_share > 0.05 and p.a_calls >= 20 for p in result.points)
    assert result.b_idle_share == pytest.approx(0.0, abs=0.02)
    assert result.alone_s == pytest.approx(0.32, rel=0.1)  # 8 tokens x 40 ms, alone
    assert all(p.slowdown > 1.05 for p in result.points)
    print(f"kappa {result.kappa:.3f}: " + ", ".join(f"share {p.co_share:.3f} slowdown {p.slowdown:.3f}"
                                                    for p in result.points))
    assert 0.6 <= result.kappa <= 1.4, [p.to_json() for p in result.points]

    await store.put(result.record())
    got = await store.get("A6000")
    assert got.source == SOURCE_MEASURED and got.kappa == pytest.approx(result.kappa)
    assert 0.6 <= got.kappa <= 1.4
    assert [p["co_share"] for p in got.points] == [round(p.co_share, 6) for p in result.points]
    assert got.details["time_scale"] == SCALE and got.measured_at > 0
    kv = await etcd_store.get(keys.interference("A6000"))
    assert kv is not None and kv.value["kappa"] == pytest.approx(result.kappa)
    assert (await store.get("H100")).source == SOURCE_DEFAULT  # other GPU types keep the default
    assert time.monotonic() - t0 < BUDGET_S
