"""Sandbox latencies and density, through the in-process `SandboxManager` (the path the REST server uses).

Median of --reps runs for: create, exec round trip (`true`), pause, resume, checkpoint after 1 MB / 64 MB /
1 GB of changed files, restore (a new sandbox from a snapshot), fork ×16; and, for the process tier, the
memory of 100 paused sandboxes (drop of MemAvailable). Reference: AgentENV (Firecracker, K3 report)
reports an incremental checkpoint of 133 ms and a resume of 49 ms.

    python benchmarks/sandbox.py --tier process --out sandbox_process.json
    python benchmarks/sandbox.py --tier vm --reps 3 --sizes 1,64 --out sandbox_vm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from k3.env import SandboxManager


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t)


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def run(tier: str, reps: int, sizes_mb: list[int], density: int, state_dir: Path) -> dict:
    m = SandboxManager(state_dir)
    res: dict[str, list[float]] = {}

    def rec(name, v):
        res.setdefault(name, []).append(v)

    try:
        ids = []
        for _ in range(reps):
            t = time.perf_counter()
            sid = m.create(tier=tier)["sandbox_id"]
            rec("create", 1000 * (time.perf_counter() - t))
            ids.append(sid)
        sid = ids[0]
        for _ in range(max(reps, 10)):
            rec("exec_true", _ms(lambda: m.exec(sid, ["true"])))
        for _ in range(max(reps, 10)):
            rec("pause", _ms(lambda: m.pause(sid)))
            rec("resume", _ms(lambda: m.resume(sid)))
        snap = None
        for mb in sizes_mb:
            for i in range(reps):
                r = m.exec(sid, f"head -c {mb * 1024 * 1024} /dev/urandom > /tmp/blob_{mb}_{i}", timeout=600)
                if r.exit_code != 0:
                    raise RuntimeError(f"writing {mb} MB failed: {r.stderr}")
                t = time.perf_counter()
                snap = m.checkpoint(sid)["snapshot_id"]
                rec(f"checkpoint_{mb}MB", 1000 * (time.perf_counter() - t))
                m.exec(sid, f"rm -f /tmp/blob_{mb}_{i}")
        if snap is None:
            snap = m.checkpoint(sid)["snapshot_id"]
        for _ in range(reps):
            t = time.perf_counter()
            child = m.restore(snap)["sandbox_id"]
            rec("restore", 1000 * (time.perf_counter() - t))
            m.kill(child)
        for _ in range(max(3, reps // 3)):
            t = time.perf_counter()
            kids = m.fork(sid, 16)["sandboxes"]
            rec("fork_x16", 1000 * (time.perf_counter() - t))
            for k in kids:
                m.kill(k["sandbox_id"])
        for s in ids:
            m.kill(s)
        out = {k: {"median_ms": statistics.median(v), "n": len(v)} for k, v in res.items()}
        if density and tier == "process":
            before = mem_available_mb()
            dens = []
            for _ in range(density):
                s = m.create(tier=tier)["sandbox_id"]
                m.pause(s)
                dens.append(s)
            time.sleep(1.0)
            used = before - mem_available_mb()
            out[f"density_{density}_paused"] = {"total_mb": used, "per_sandbox_mb": used / density}
            for s in dens:
                m.kill(s)
        return out
    finally:
        m.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", default="process", choices=["process", "vm"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sizes", default="1,64,1024", help="changed MB before each checkpoint")
    ap.add_argument("--density", type=int, default=100, help="paused sandboxes for the memory figure (process)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3-sbx-bench-") as d:
        out = run(a.tier, a.reps, [int(s) for s in a.sizes.split(",") if s], a.density, Path(d))
    print(f"{'operation':<26}{'median':>12}")
    for k, v in out.items():
        if "median_ms" in v:
            print(f"{k:<26}{v['median_ms']:>9.1f} ms  (n={v['n']})")
        else:
            print(f"{k:<26}{v['per_sandbox_mb']:>9.2f} MB per sandbox ({v['total_mb']:.0f} MB total)")
    if a.out:
        Path(a.out).write_text(json.dumps({"tier": a.tier, "results": out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
