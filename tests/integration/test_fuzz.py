"""Fuzzing every RPC of every service against the real suite (real etcd, five gRPC servers on port 0):
seeded random bytes, byte mutations of a valid request and structure-aware value changes
(flowmaker.bench.fuzz). No call may end UNKNOWN or INTERNAL or go unanswered for 5 s, every service
stays SERVING, and a rejected call leaves etcd as it was. `flowmaker bench fuzz` runs more cases."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from flowmaker.bench.fuzz import all_rpcs, etcd_snapshot, fuzz_stack, run_fuzz, seed_requests

pytestmark = pytest.mark.integration

PER_RPC = int(os.environ.get("FLOWMAKER_FUZZ_PER_RPC", "150"))  # ~35 s on a 2-core machine
SEED = int(os.environ.get("FLOWMAKER_FUZZ_SEED", "20261203"))


def test_every_rpc_has_a_seed() -> None:
    rpcs = all_rpcs()
    assert {r.service for r in rpcs} == {"generator", "profiler", "selector", "deployer", "orchestrator"}
    assert {r.path.rsplit("/", 1)[1] for r in rpcs} == set(seed_requests())
    assert len(rpcs) == 22


async def test_fuzz_every_rpc(etcd_store: Any) -> None:
    async with fuzz_stack(etcd_store) as addrs:
        report = await run_fuzz(addrs, per_rpc=PER_RPC, seed=SEED, timeout_s=5.0,
                                snapshot=lambda: etcd_snapshot(etcd_store))
    print(report.table())  # shown with -s, and in the failure output
    details = json.dumps(report.to_json(), indent=1)[:8000]
    assert report.calls == PER_RPC * len(all_rpcs())
    assert report.bad == 0, details
    assert report.hangs == [], details
    assert report.unhealthy == [], details
    assert report.etcd_changed == [], details
    # The fuzz reaches past the edge: some cases are valid enough to be answered by the services.
    assert report.codes["INVALID_ARGUMENT"] > 0 and report.codes["OK"] > 0 and report.codes["NOT_FOUND"] > 0
