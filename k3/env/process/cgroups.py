"""cgroup v1 helpers of the process tier: which controllers exist, freeze/thaw, kill every process of a
sandbox's cgroups, remove them."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

from ..base import SandboxError

CGROUP_ROOT = Path("/sys/fs/cgroup")
CG_PARENT = "k3sbx"
CG_REQUIRED = ("freezer", "memory", "pids")
CG_OPTIONAL = ("cpu", "cpuacct")


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _controllers() -> list[str]:
    return [c for c in CG_REQUIRED + CG_OPTIONAL if (CGROUP_ROOT / c / "cgroup.procs").exists()]


def _cg_procs(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _cg_freeze(d: Path, frozen: bool, timeout: float = 10.0) -> None:
    """Write FROZEN/THAWED to the freezer dir `d` and wait until the state is reached."""
    want = "FROZEN" if frozen else "THAWED"
    deadline, delay = time.monotonic() + timeout, 0.0002
    while True:
        _write(d / "freezer.state", want)
        if (d / "freezer.state").read_text().strip() == want:
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"cgroup freezer did not reach {want}")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _cg_kill_all(dirs: list[Path], timeout: float = 10.0) -> None:
    """SIGKILL every process in the sandbox's cgroups: freeze (no forks racing the kill), kill, thaw, wait."""
    fz = next((d for d in dirs if d.parent.parent.name == "freezer"), None)
    if fz is None or not fz.exists():
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            _cg_freeze(fz, True, timeout=2.0)
        except (SandboxError, OSError):
            pass
        procs = set(_cg_procs(fz))
        for d in dirs:
            procs.update(_cg_procs(d))
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            _cg_freeze(fz, False, timeout=2.0)
        except FileNotFoundError:
            return
        t_end = min(deadline, time.monotonic() + 1.0)
        while time.monotonic() < t_end and any(_cg_procs(d) for d in dirs):
            time.sleep(0.0005)
        if not any(_cg_procs(d) for d in dirs):
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"processes survive in {fz}")


def _cg_remove(dirs: list[Path], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    for d in dirs:
        while d.exists():
            try:
                d.rmdir()
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise SandboxError(f"cannot remove cgroup {d}: {e}") from e
                _cg_kill_all(dirs, timeout=1.0)
                time.sleep(0.005)
