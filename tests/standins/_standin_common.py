"""Shared body of the stand-in engine executables: check the GPU env, then serve the emulated engine in-process.

Test knobs (environment, never read by the real tools):
  FLOWMAKER_STANDIN_PROFILE_JSON   Profile JSON for the timing model (default: a small fast one)
  FLOWMAKER_STANDIN_TIME_SCALE     model seconds per wall second (default 1)
  FLOWMAKER_STANDIN_STARTUP_DELAY_S  sleep before binding the port, like loading weights (default 0)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from aiohttp import web

from flowmaker.engine.server import EmulatedEngine, profile_from_json, serve

DEFAULT_PROFILE = {"fixed_s": 0.01, "prefill_s_per_token": 1e-5, "decode_s_per_token": 0.005,
                   "max_output_tokens_per_s": 2000.0}


def check_gpus(prog: str, tp: int, pp: int) -> None:
    """Fail like an engine that cannot see its GPUs (exit 1, message on stderr)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        sys.exit(f"{prog}: CUDA_VISIBLE_DEVICES is not set")
    devices = [d for d in cvd.split(",") if d.strip()]
    if len(devices) != tp * pp:
        sys.exit(f"{prog}: tp*pp = {tp * pp} GPUs requested but CUDA_VISIBLE_DEVICES={cvd!r} lists {len(devices)}")


class TrtllmIterStatsEngine(EmulatedEngine):
    """trtllm-serve answers /metrics with a JSON list of iteration stats, not Prometheus text."""

    async def metrics(self, request: web.Request) -> web.Response:
        self._wake.set()
        m = self.model
        max_blocks = 1000
        stats: list[dict[str, Any]] = [{
            "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"), "iter": m.steps,
            "numActiveRequests": m.running, "numQueuedRequests": m.waiting,
            "kvCacheStats": {"maxNumBlocks": max_blocks, "usedNumBlocks": round(m.kv_usage * max_blocks)},
        }]
        return web.json_response(stats)


def run(prog: str, served_name: str, host: str, port: int, tp: int, pp: int, trtllm_metrics: bool = False) -> None:
    check_gpus(prog, tp, pp)
    try:
        profile = profile_from_json(os.environ.get("FLOWMAKER_STANDIN_PROFILE_JSON") or json.dumps(DEFAULT_PROFILE))
    except ValueError as e:
        sys.exit(f"{prog}: FLOWMAKER_STANDIN_PROFILE_JSON: {e}")
    delay = float(os.environ.get("FLOWMAKER_STANDIN_STARTUP_DELAY_S", "0"))
    if delay:
        time.sleep(delay)
    cls = TrtllmIterStatsEngine if trtllm_metrics else EmulatedEngine
    engine = cls(served_name, profile, time_scale=float(os.environ.get("FLOWMAKER_STANDIN_TIME_SCALE", "1")))
    print(f"{prog} stand-in: serving {served_name!r} on {host}:{port} (tp={tp}, pp={pp})", flush=True)
    asyncio.run(serve(engine, host, port, announce=False))
