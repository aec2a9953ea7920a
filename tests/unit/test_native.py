"""`flowmaker.native`: the compiled class search and pattern route give the pure modules' results bit for bit, and a
module is used compiled only while its source is the one compiled. Each side runs in a fresh interpreter (a module is imported once per process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flowmaker import native

ROOT = Path(__file__).resolve().parents[2]
BUILT = (native.native_dir() / "manifest.json").exists()
needs_build = pytest.mark.skipif(not BUILT, reason="no native build here (`make native`; needs a C compiler)")
COMPILED = dict.fromkeys(native.NATIVE_MODULES, "compiled")
PURE = dict.fromkeys(native.NATIVE_MODULES, "python")
BINPACK = "flowmaker.selection.binpack"

# The same searches on both sides: the brute-force suite's small instances (clones, running instances, ties) and
# larger packings with several identical bins, every return value printed with repr (floats exactly).
_SCRIPT = r"""
import json, random, sys
sys.path.insert(0, sys.argv[1])
from flowmaker import native
from flowmaker.selection.binpack import _pack_exact, least_l_bins, least_l_classes, max_fill
from flowmaker.selection.chain import _least_l_patterns, _prices
from flowmaker.selection.patterns import enumerate_patterns, exact_cover, knapsack
from flowmaker.selection.problem import INF, NEW, REUSE
from test_selection_binpack import _instance
from test_selection_patterns import _classes, _larger

out = []
for seed in range(300):
    so, loads, bins = _instance(seed)
    room = {}
    for k, ref, _, base, cp in bins:
        room[(k, ref)] = room.get((k, ref), 0.0) + cp - base
    mu = _prices(so, loads, room) or {}
    for search in (least_l_bins, least_l_classes):
        for nodes in (3, 10**7):
            out.append(repr(search(so, loads, bins, mu, 0.5 * (seed % 2), INF, nodes)))
    rng = random.Random(seed)
    ws = sorted((rng.uniform(1.0, 9.0) for _ in range(rng.randint(1, 12))), reverse=True)
    cap = rng.uniform(9.0, 20.0)
    out.append(repr(_pack_exact(ws, rng.randint(1, 4), rng.uniform(0.0, 3.0), cap, lambda: True)))
    out.append(repr(max_fill(tuple(ws), cap)))
    vals = [rng.uniform(0.1, 5.0) for _ in ws]
    out.append(repr(knapsack(vals, ws, cap, 10**6)))
    rc = [rng.uniform(-3.0, 3.0) for _ in ws]
    pats = enumerate_patterns(rc, ws, cap, rng.uniform(-4.0, 1.0), 10**6, 1e18) or []
    out.append(repr(pats))
    out.append(repr(exact_cover(len(ws), pats, [i % 2 for i in range(len(pats))], [sum(ws[i] for i in p) for p in pats],
                                [0.0] * len(pats), [2, 2], 0.0, INF, 10**5, 1e18)))
for seed in range(40):
    so, loads, bins = _larger(seed)
    out.append(repr(_least_l_patterns(loads, so, _classes(bins), 0.0, INF, 1e18)))
print(json.dumps({"status": native.status(), "results": out}))
"""


# The GPU-sharing searches on both sides: every variant of each multiset of one or two new instances of the hard
# families' small chains and fans under sharing (`sharing_chain._enumerate`, all of them, then least first), and
# `exact`'s answers there (its branch and bound takes `sharing_bound.completion_bound` at every node).
_SHARING_SCRIPT = r"""
import dataclasses, itertools, json, sys, time
sys.path.insert(0, sys.argv[1])
from flowmaker import native
from flowmaker.bench.selector_hard import hard_instance
from flowmaker.domain import GpuSharing
from flowmaker.selection import chain, exact as ex, milp, sharing_chain
from flowmaker.selection.problem import INF, NEW, Problem
from flowmaker.selection.registry import select

out = []
for fam in ("chain_clones", "wide_fan", "fragmented"):
    for seed in range(12):
        req = hard_instance(fam, seed, "small").request
        req = dataclasses.replace(req, options=dataclasses.replace(req.options, gpu_sharing=GpuSharing.INTERFERENCE,
                                                                   time_budget_s=60.0))
        pb = Problem(req)
        for pw in pb.workflows:
            model = milp.RelaxedModel(pb, pw, ex.usable_profiles(pb))
            if not model.ok or (sharing_chain.fan_of(pw) is None and not chain.is_chain(pw)):
                continue
            profs = sorted({ref for s in pw.llm for k, ref, _ in model.opts[s] if k == NEW})
            for insts in [*((p,) for p in profs), *itertools.combinations_with_replacement(profs, 2)]:
                for strict in (None, True, False):
                    got = sharing_chain._enumerate(model, list(insts), INF, time.perf_counter() + 60, [10**6], strict,
                                                   most=10**6)
                    out.append(repr((insts, strict, got)))
        try:
            res = select(req, "exact")
            out.append(repr((res.optimal, res.variant, res.lower_bound)))
        except Exception as e:
            out.append(repr(type(e).__name__))
print(json.dumps({"status": native.status(), "results": out}))
"""


def _run(env_native: str, script: str = _SCRIPT) -> dict[str, object]:
    env = dict(os.environ, FLOWMAKER_NATIVE=env_native, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT / "tests" / "unit")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_build
def test_the_compiled_class_search_returns_the_pure_ones_results_bit_for_bit() -> None:
    compiled, pure = _run("1"), _run("0")
    assert compiled["status"] == COMPILED
    assert pure["status"] == PURE
    assert len(pure["results"]) == 300 * 9 + 40  # type: ignore[arg-type]
    assert compiled["results"] == pure["results"]


@needs_build
def test_the_compiled_sharing_searches_return_the_pure_ones_results_bit_for_bit() -> None:
    """`order_search` (the depth-first searches of a multiset's assignments under GPU sharing) and `sharing_bound`
    compiled: every variant they enumerate, in order, and `exact`'s answers are the pure modules' (floats by repr)."""
    compiled, pure = _run("1", _SHARING_SCRIPT), _run("0", _SHARING_SCRIPT)
    assert compiled["status"] == COMPILED
    assert pure["status"] == PURE
    found = [r for r in pure["results"] if r.startswith("((") and "[(" in r]  # type: ignore[union-attr]
    assert len(found) > 50, len(found)  # (multisets with variants: the searches ran)
    assert compiled["results"] == pure["results"]


def _status(native_dir: Path) -> dict[str, str]:
    env = dict(os.environ, FLOWMAKER_NATIVE_DIR=str(native_dir), PYTHONPATH=str(ROOT))
    env.pop("FLOWMAKER_NATIVE", None)
    proc = subprocess.run([sys.executable, "-m", "flowmaker.native", "status"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@needs_build
def test_a_build_of_another_source_is_not_used(tmp_path: Path) -> None:
    """An extension whose recorded source hash is not the source's now (the module was edited after the build) is
    ignored: the module imports from its .py. So is a build for another interpreter."""
    good = tmp_path / "good"
    shutil.copytree(native.native_dir(), good)
    assert _status(good) == COMPILED

    stale = tmp_path / "stale"
    shutil.copytree(native.native_dir(), stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    manifest["modules"]["flowmaker.selection.binpack"]["sha256"] = "0" * 64
    (stale / "manifest.json").write_text(json.dumps(manifest))
    assert _status(stale) == {**COMPILED, BINPACK: "python"}  # the other modules' builds still match

    other = tmp_path / "other"
    shutil.copytree(native.native_dir(), other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["abi"] = ".cpython-39-x86_64-linux-gnu.so"
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert _status(other) == PURE


@needs_build
def test_a_build_that_does_not_load_falls_back_to_pure_python(tmp_path: Path) -> None:
    """An extension with the right hash that this interpreter cannot load (a broken or foreign file): a warning, and
    the selector runs as pure Python instead of failing its import."""
    broken = tmp_path / "broken"
    shutil.copytree(native.native_dir(), broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / manifest["modules"]["flowmaker.selection.binpack"]["file"]).write_bytes(b"not an ELF file")
    env = dict(os.environ, FLOWMAKER_NATIVE_DIR=str(broken), PYTHONPATH=str(ROOT))
    env.pop("FLOWMAKER_NATIVE", None)
    code = ("from flowmaker import native; from flowmaker.selection import select; "
            "from flowmaker.selection.binpack import max_fill; print(native.status(), max_fill((3.0, 2.0), 4.0))")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{PURE} 3.0" in proc.stdout  # the whole build, not only the broken module (one support library)
    assert "does not load" in proc.stderr


def test_no_build_means_pure_python(tmp_path: Path) -> None:
    assert _status(tmp_path / "nothing-here") == PURE
    abi = native._abi()
    unreadable = ["not json", "[]", json.dumps({"abi": abi, "modules": {"flowmaker.selection.binpack": {}}}),
                  json.dumps({"abi": abi, "modules": []})]
    for i, text in enumerate(unreadable):  # a manifest this code cannot read: pure Python, not a failed import
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        (bad / "manifest.json").write_text(text)
        assert _status(bad) == PURE, text


def test_a_failed_build_is_reported_and_leaves_setup_going(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """No compiler (here: mypyc's child process fails): `build` raises with its output, and the command that
    `make setup` runs says so and exits 0, so the selector runs as pure Python."""
    monkeypatch.setenv("FLOWMAKER_NATIVE_DIR", str(tmp_path / "native"))
    monkeypatch.setattr(native.sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises((RuntimeError, OSError)):
        native.build()
    assert native.main(["build"]) == 0
    assert "native build skipped" in capsys.readouterr().err
    assert not (tmp_path / "native" / "manifest.json").exists()
