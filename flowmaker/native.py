"""Optional compiled builds of the selector's hottest pure-Python modules, and the import hook that uses them.

`exact`'s chain walk spends most of its time in depth-first searches (`flowmaker.selection.binpack`'s class search,
`flowmaker.selection.patterns`' knapsacks and exact cover; under GPU sharing `flowmaker.selection.order_search`, the
searches of a multiset's assignments, and `flowmaker.selection.sharing_bound`, the branch and bound's bounds): plain
Python, integer and float arithmetic in tight loops. mypyc (shipped with mypy, a dev dependency) compiles those
modules, unchanged, to C extensions; measured on 175 recorded chain_clones class searches the class search runs 2.9x
faster with bit-identical results (floats are C doubles either way, in the same order), and 31 chain_clones proven in
0.6-2 s under sharing take 20% less time in all with the sharing modules compiled. So:

* `build()` (`make native`, part of `make setup`) compiles `NATIVE_MODULES` into `build/native/` and writes a
  manifest with each module's source hash;
* `install()` (called when `flowmaker.selection` is imported) puts a finder in front of the normal import: a
  module in the manifest whose source still has the recorded hash is loaded from its extension; anything else
  (no build, an unreadable manifest, a source edited since, a build for another interpreter, an extension that does
  not load, `FLOWMAKER_NATIVE=0`) imports from its `.py` as always.

Nothing depends on the build: without a C compiler the selector is the same code, slower. `status()` says which
modules run compiled; the selector bench prints it beside its figures.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

NATIVE_MODULES = ("flowmaker.selection.binpack", "flowmaker.selection.patterns", "flowmaker.selection.order_search",
                  "flowmaker.selection.sharing_bound")
_ROOT = Path(__file__).resolve().parent.parent  # the directory that holds the `flowmaker` package
_MANIFEST = "manifest.json"


def native_dir() -> Path:
    """Where builds go and are looked for: $FLOWMAKER_NATIVE_DIR, else `build/native` beside the package."""
    return Path(os.environ.get("FLOWMAKER_NATIVE_DIR") or _ROOT / "build" / "native")


def _source(module: str) -> Path:
    return _ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _abi() -> str:
    """The interpreter an extension was built for (its tag in the file name)."""
    return importlib.machinery.EXTENSION_SUFFIXES[0]


class _Finder:
    """Loads the modules of a matching manifest (and mypyc's support libraries) from their extensions (a meta path
    finder: `find_spec` is all the import system asks of one)."""

    def __init__(self, where: Path, files: dict[str, str]) -> None:
        self.where = where
        self.files = files  # module name -> extension file, relative to `where`

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        rel = self.files.get(fullname)
        if rel is None:
            return None
        so = str(self.where / rel)
        return importlib.util.spec_from_file_location(fullname, so,
                                                      loader=importlib.machinery.ExtensionFileLoader(fullname, so))


_installed: list[str] = []  # the modules the installed finder serves compiled


def install() -> list[str]:
    """Put the finder in place once (idempotent); returns the modules that will load compiled."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return list(_installed)
    if os.environ.get("FLOWMAKER_NATIVE", "1") == "0":
        return []
    where = native_dir()
    files: dict[str, str] = {}
    try:
        manifest = json.loads((where / _MANIFEST).read_text())
        if manifest.get("abi") != _abi():
            return []
        for module, entry in manifest.get("modules", {}).items():
            src = _source(module)
            # served compiled only while its source is the one compiled (no stale extension after an edit)
            if module in NATIVE_MODULES and src.exists() and _digest(src) == entry["sha256"] \
                    and (where / entry["file"]).exists():
                files[module] = entry["file"]
        if files:
            files.update({m: f for m, f in manifest.get("support", {}).items() if (where / f).exists()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []  # not built, or a manifest this code cannot read: pure Python
    if not files:
        return []
    finder = _Finder(where, files)
    sys.meta_path.insert(0, finder)
    compiled = [m for m in files if m in NATIVE_MODULES]
    try:  # loaded now, so that an extension this interpreter cannot load falls back here, not in a caller's import
        for module in compiled:
            importlib.import_module(module)
    except ImportError as exc:
        sys.meta_path.remove(finder)
        for module in files:
            sys.modules.pop(module, None)
        warnings.warn(f"flowmaker.native: the build in {where} does not load ({exc}); running as pure Python",
                      RuntimeWarning, stacklevel=2)
        return []
    _installed[:] = compiled
    return list(_installed)


def status() -> dict[str, str]:
    """Each of `NATIVE_MODULES` -> "compiled" when it was loaded from its extension, else "python"."""
    out = {}
    for module in NATIVE_MODULES:
        mod = sys.modules.get(module)
        origin = getattr(getattr(mod, "__spec__", None), "origin", "") or ""
        out[module] = "compiled" if origin.endswith(_abi()) else "python"
    return out


def build(where: Path | None = None) -> dict[str, str]:
    """Compile `NATIVE_MODULES` with mypyc into `where` (default `native_dir()`) and write its manifest.

    Runs mypyc in a child process (setuptools exits on error) from the package root, so that module names follow
    the package layout. Raises RuntimeError with mypyc's output when it fails. Returns module -> extension file."""
    import shutil  # (here, not at import: `flowmaker.selection` imports this module on every start)
    import subprocess
    import tempfile

    where = where or native_dir()
    sources = [str(_source(m).relative_to(_ROOT)) for m in NATIVE_MODULES]
    with tempfile.TemporaryDirectory(prefix="flowmaker-native-") as tmp:
        lib = Path(tmp) / "lib"
        script = (
            "import sys\n"
            "from setuptools import setup\n"
            "from mypyc.build import mypycify\n"
            f"setup(name='flowmaker-native', py_modules=[], ext_modules=mypycify({sources!r}, opt_level='3', target_dir={tmp + '/c'!r}),\n"
            f"      script_args=['-q', 'build_ext', '--build-lib', {str(lib)!r}, '--build-temp', {tmp + '/tmp'!r}])\n"
        )
        proc = subprocess.run([sys.executable, "-c", script], cwd=_ROOT, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"mypyc failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
        built = {p.relative_to(lib).as_posix(): p for p in lib.rglob("*" + _abi())}
        if where.exists():
            shutil.rmtree(where)
        where.mkdir(parents=True)
        modules: dict[str, dict[str, str]] = {}
        support: dict[str, str] = {}
        for rel, path in built.items():
            dest = where / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
            name = rel[: -len(_abi())].replace("/", ".")
            if name in NATIVE_MODULES:
                modules[name] = {"file": rel, "sha256": _digest(_source(name))}
            else:
                support[name] = rel
        missing = [m for m in NATIVE_MODULES if m not in modules]
        if missing:
            raise RuntimeError(f"mypyc built no extension for {', '.join(missing)}")
        (where / _MANIFEST).write_text(json.dumps({"abi": _abi(), "modules": modules, "support": support}, indent=1))
    return {m: e["file"] for m, e in modules.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flowmaker.native [build|status]`: build exits 0 with a note when no compiler is available
    (the selector then runs as pure Python), so that `make setup` never fails on it."""
    args = list(sys.argv[1:] if argv is None else argv) or ["status"]
    if args[0] == "build":
        try:
            got = build()
        except (RuntimeError, OSError, ImportError) as exc:
            print(f"native build skipped, the selector runs as pure Python: {exc}", file=sys.stderr)
            return 0
        print("compiled: " + ", ".join(sorted(got)) + f" -> {native_dir()}")
        return 0
    if args[0] == "status":
        install()
        for module in NATIVE_MODULES:
            __import__(module)
        print(json.dumps(status()))
        return 0
    print("usage: python -m flowmaker.native [build|status]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    from flowmaker import native as _module  # the package's copy, whose finder `flowmaker.selection` sees

    sys.exit(_module.main())
