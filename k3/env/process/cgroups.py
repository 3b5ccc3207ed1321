"""cgroup helpers of the process tier, for cgroup v1 (one hierarchy per controller) and cgroup v2 (the unified
hierarchy): which layout the host has, a sandbox's cgroup dirs and limits, freeze/thaw, kill every process of
a sandbox, remove its cgroups.

v1: `<controller>/k3sbx/<name>` for freezer, memory, pids (+ cpu, cpuacct when mounted). v2 (when the v1
controllers are not mounted and the unified root offers memory and pids): one dir `k3sbx/<name>` with
memory.max (+ memory.swap.max 0), pids.max, cpu.max where the cpu controller exists, and the core freezer
(cgroup.freeze) and cgroup.kill."""

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
CG2_REQUIRED = ("memory", "pids")
CG2_OPTIONAL = ("cpu",)


def cgroup_mode() -> tuple[str | None, str]:
    """("v1" | "v2", "") for the layout the tier uses, else (None, why not)."""
    missing = [c for c in CG_REQUIRED if not (CGROUP_ROOT / c / "cgroup.procs").exists()]
    if not missing:
        return "v1", ""
    ctl = CGROUP_ROOT / "cgroup.controllers"
    if not ctl.exists():
        return None, f"cgroup v1 controllers not mounted under {CGROUP_ROOT}: {', '.join(missing)}; no cgroup v2 either"
    have = set(ctl.read_text().split())
    lack = [c for c in CG2_REQUIRED if c not in have]
    if lack:
        return None, f"cgroup v2 at {CGROUP_ROOT} lacks the controllers {', '.join(lack)}"
    return "v2", ""


def _is_v2(d: Path) -> bool:
    return d.parent.parent == CGROUP_ROOT


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def cgroup_dirs(name: str) -> list[Path]:
    """The cgroup dirs of a sandbox called `name` on this host (not created here)."""
    if cgroup_mode()[0] == "v2":
        return [CGROUP_ROOT / CG_PARENT / name]
    return [CGROUP_ROOT / c / CG_PARENT / name for c in CG_REQUIRED + CG_OPTIONAL
            if (CGROUP_ROOT / c / "cgroup.procs").exists()]


def freezer_dir(dirs: list[Path]) -> Path | None:
    """The dir among a sandbox's cgroup dirs that freezes it (v1: the freezer hierarchy's; v2: its one dir)."""
    return next((d for d in dirs if _is_v2(d) or d.parent.parent.name == "freezer"), None)


def _enable_v2_controllers(parent: Path) -> None:
    """Make memory, pids (and cpu) available to the children of `parent` (k3sbx) and of the root above it."""
    for d in (CGROUP_ROOT, parent):
        have = set((d / "cgroup.controllers").read_text().split())
        on = set((d / "cgroup.subtree_control").read_text().split())
        want = [c for c in CG2_REQUIRED + CG2_OPTIONAL if c in have and c not in on]
        if want:
            try:
                _write(d / "cgroup.subtree_control", " ".join("+" + c for c in want))
            except OSError as e:
                if any(c in CG2_REQUIRED for c in want):
                    raise SandboxError(f"cannot enable the cgroup v2 controllers {want} in {d}: {e.strerror}") from e


def cg_setup(dirs: list[Path], memory_bytes: int, pids_max: int, cpus: float) -> None:
    """Create a sandbox's cgroup dirs with its limits: memory (no swap), pids, CPU quota (cpus ≤ 0: none)."""
    for d in dirs:
        if _is_v2(d):
            d.parent.mkdir(exist_ok=True)
            _enable_v2_controllers(d.parent)
            d.mkdir(exist_ok=True)
            _write(d / "memory.max", str(memory_bytes))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(pids_max))
            if (d / "cpu.max").exists():
                _write(d / "cpu.max", f"{max(1000, int(cpus * 100000))} 100000" if cpus > 0 else "max 100000")
            continue
        d.mkdir(parents=True, exist_ok=True)
        kind = d.parent.parent.name
        if kind == "memory":
            mem = str(memory_bytes)
            if (d / "memory.memsw.limit_in_bytes").exists():  # order matters: memsw >= memory always
                cur = int((d / "memory.limit_in_bytes").read_text())
                first, second = (("memory.limit_in_bytes", "memory.memsw.limit_in_bytes") if int(mem) <= cur
                                 else ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes"))
                _write(d / first, mem)
                _write(d / second, mem)
            else:
                _write(d / "memory.limit_in_bytes", mem)
        elif kind == "pids":
            _write(d / "pids.max", str(pids_max))
        elif kind == "cpu" and (d / "cpu.cfs_quota_us").exists():
            _write(d / "cpu.cfs_period_us", "100000")
            _write(d / "cpu.cfs_quota_us", str(max(1000, int(cpus * 100000)) if cpus > 0 else -1))


def _cg_procs(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _frozen_state(d: Path) -> str:
    if _is_v2(d):
        events = dict(line.split() for line in (d / "cgroup.events").read_text().splitlines() if line.strip())
        return "FROZEN" if events.get("frozen") == "1" else "THAWED"
    return (d / "freezer.state").read_text().strip()


def _cg_freeze(d: Path, frozen: bool, timeout: float = 10.0) -> None:
    """Freeze or thaw the freezer dir `d` (v1 freezer.state, v2 cgroup.freeze) and wait until it is so."""
    want = "FROZEN" if frozen else "THAWED"
    deadline, delay = time.monotonic() + timeout, 0.0002
    while True:
        if _is_v2(d):
            _write(d / "cgroup.freeze", "1" if frozen else "0")
        else:
            _write(d / "freezer.state", want)
        if _frozen_state(d) == want:
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"cgroup freezer did not reach {want}")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _cg_kill_all(dirs: list[Path], timeout: float = 10.0) -> None:
    """SIGKILL every process in the sandbox's cgroups: v2 cgroup.kill where the kernel has it, else freeze (no
    forks racing the kill), kill, thaw; then wait until they are gone."""
    fz = freezer_dir(dirs)
    if fz is None or not fz.exists():
        return
    deadline = time.monotonic() + timeout
    if _is_v2(fz) and (fz / "cgroup.kill").exists():
        _write(fz / "cgroup.kill", "1")
        while _cg_procs(fz):
            if time.monotonic() > deadline:
                raise SandboxError(f"processes survive in {fz}")
            time.sleep(0.0005)
        return
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
