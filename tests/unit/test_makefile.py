"""The Makefile a new user runs first: it says what it is doing, and `make etcd` waits for a busy apt."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make not installed")


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_first_setup_says_what_it_does_and_shows_pip_progress() -> None:
    # Under `make test` the parent's MAKEFLAGS/MAKELEVEL would make this a sub-make ("Entering directory").
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    p = subprocess.run([str(MAKE), "--no-print-directory", "-n", "-B", ".venv/.installed"], cwd=ROOT,
                       capture_output=True, text=True, check=True, env=env)
    lines = p.stdout.splitlines()
    assert lines[0].startswith("echo ") and "installing FlowMaker" in lines[0], lines  # printed before pip runs
    pips = [ln for ln in lines if " -m pip install" in ln]
    assert pips and all(" -q" not in ln and "--progress-bar on" in ln for ln in pips), pips


def test_make_etcd_waits_for_the_apt_lock(tmp_path: Path) -> None:
    """A fake apt-get whose first `update` fails like a held lock: make retries, then installs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "seq", "sleep", "id", "env", "echo", "cat", "touch"):
        real = shutil.which(tool)
        if real:
            (bin_dir / tool).symlink_to(real)
    calls = tmp_path / "calls"
    _script(bin_dir / "apt-get", f"""echo "$*" >> {calls}
case "$*" in
  *update*) if [ ! -e {tmp_path}/unlocked ]; then touch {tmp_path}/unlocked
      echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 4242 (apt-get)" >&2; exit 100; fi;;
esac
exit 0
""")
    _script(bin_dir / "sudo", 'exec "$@"\n')
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    p = subprocess.run([str(MAKE), "--no-print-directory", "-s", "etcd", "APT_RETRY_S=0"], cwd=ROOT, capture_output=True, text=True,
                       env=env, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "installing Debian's etcd-server" in p.stdout
    assert "apt is busy" in p.stdout
    made = calls.read_text().splitlines()
    assert [("install" if "install" in c else "update") for c in made] == ["update", "update", "install"], made
    assert made[-1].endswith("etcd-server")
    assert all("DPkg::Lock::Timeout=" in c for c in made), made  # dpkg's own lock is waited for too
    assert os.path.exists(tmp_path / "unlocked")
