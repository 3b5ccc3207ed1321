"""GPU time of a profiled training step by phase, by kernel and by the CPU op (with input shapes) that launched it.

Reads the Chrome trace that `train_throughput.py --profile --trace F` writes (plain or .gz). Each GPU event
(kernel, memcpy, memset) is tied to its launching runtime call by the correlation id, then to the innermost
CPU op that encloses that call on the same thread (the op with its shapes) and to the outermost one (in the
backward: the autograd node), and to the `phase:*` range that encloses it in time.
It also sums the GPU time by kind of work (`kind_of`: the vocabulary heads' GEMMs, other GEMMs, attention, KDA,
elementwise, other kernels, the optimizer) and lists where the GPU idles: every gap of more than --gap µs between
one GPU event's end and the next one's start, by phase and by the CPU op whose launch ended the gap (the op the GPU
waited for), with its count and total.
Usage: python benchmarks/probe/trace_breakdown.py trace.json.gz [--top 40] [--gap 10]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re


def load(path: str) -> list[dict]:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return json.load(f)["traceEvents"]


def enclosing(intervals: list[tuple[float, float, dict]], queries: list[tuple[float, int]]) -> dict[int, list[dict]]:
    """For each query (ts, key): the stack of intervals (outermost first) that contain ts. One sweep."""
    items = sorted([(s, 0, -(e - s), i) for i, (s, e, _) in enumerate(intervals)]
                   + [(ts, 1, 0, k) for ts, k in queries])
    stack: list[int] = []
    out = {}
    for ts, kind, _, ref in items:
        while stack and intervals[stack[-1]][1] <= ts:
            stack.pop()
        if kind == 0:
            stack.append(ref)
        else:
            out[ref] = [intervals[i][2] for i in stack]
    return out


def short(name: str) -> str:
    name = re.sub(r"<.*", "", name)
    return name[:70]


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
            "aten::linear", "aten::matmul")
KINDS = ("vocabulary head GEMMs", "other GEMMs", "attention", "KDA kernels", "elementwise kernels",
         "other kernels", "copies and fills", "optimizer")


def kind_of(kernel: str, phase: str, outer: str, inner: str) -> str:
    """The kind of work of one GPU event, from its kernel name, phase and launching ops (outer, inner): everything
    in the optimizer phase is "optimizer"; a GEMM (by its launching op or a cuBLAS / CUTLASS kernel name) under the
    fused linear + cross-entropy is a vocabulary head's."""
    if phase == "optimizer":
        return "optimizer"
    k = kernel.lower()
    if kernel.startswith("Memcpy") or kernel.startswith("Memset") or "fill" in k:
        return "copies and fills"
    if "flash" in k or "attention" in k:
        return "attention"
    gemm = inner in GEMM_OPS or any(s in k for s in ("nvjet", "cutlass", "gemm", "xmma"))
    if gemm:
        return "vocabulary head GEMMs" if "LinearCrossEntropy" in outer else "other GEMMs"
    if k.startswith("kda_"):
        return "KDA kernels"
    if "elementwise" in k:
        return "elementwise kernels"
    return "other kernels"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--gap", type=float, default=10.0, help="idle gaps listed: those longer than this many µs")
    args = ap.parse_args()
    ev = [e for e in load(args.trace) if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launch = {e["args"]["correlation"]: e for e in ev  # runtime or driver API (Triton, cuBLAS)
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    phases = sorted((e["ts"], e["ts"] + e["dur"], e["name"][6:]) for e in ev
                    if e.get("cat") == "user_annotation" and e["name"].startswith("phase:"))
    ops_by_tid: dict = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") == "cpu_op":
            ops_by_tid[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e))
    q_by_tid: dict = collections.defaultdict(list)
    for i, k in enumerate(gpu):
        r = launch.get(k.get("args", {}).get("correlation"))
        if r is not None:
            q_by_tid[r["tid"]].append((r["ts"], i))
    stacks: dict[int, list[dict]] = {}
    for tid, qs in q_by_tid.items():
        stacks.update(enclosing(ops_by_tid.get(tid, []), qs))
    starts = [p[0] for p in phases]

    def phase_of(i: int) -> str:
        r = launch.get(gpu[i].get("args", {}).get("correlation"))
        ts = r["ts"] if r else gpu[i]["ts"]
        j = bisect.bisect_right(starts, ts) - 1
        return phases[j][2] if j >= 0 and ts <= phases[j][1] else "(none)"

    by_phase = collections.Counter()
    by_kind = collections.defaultdict(lambda: [0.0, 0])
    by_kernel = collections.defaultdict(lambda: [0.0, 0])
    by_op = collections.defaultdict(lambda: [0.0, 0])
    for i, k in enumerate(gpu):
        ph, ms = phase_of(i), k["dur"] / 1e3
        by_phase[ph] += ms
        st = stacks.get(i, [])
        outer = short(st[0]["name"]) if st else "-"
        inner = st[-1] if st else None
        shapes = str(inner["args"].get("Input Dims", ""))[:80] if inner else ""
        kd = by_kind[kind_of(k["name"], ph, st[0]["name"] if st else "", inner["name"] if inner else "")]
        kd[0] += ms
        kd[1] += 1
        kk = by_kernel[(ph, short(k["name"]))]
        kk[0] += ms
        kk[1] += 1
        oo = by_op[(ph, outer, short(inner["name"]) if inner else "-", shapes, short(k["name"])[:40])]
        oo[0] += ms
        oo[1] += 1
    total = sum(by_phase.values())
    span = (max(k["ts"] + k["dur"] for k in gpu) - min(k["ts"] for k in gpu)) / 1e3
    print(f"GPU busy {total:.1f} ms over a {span:.1f} ms span, {len(gpu)} GPU events")
    for ph, ms in by_phase.most_common():
        print(f"  {ph:14s} {ms:8.1f} ms")
    print("\nby kind of work (ms, GPU events)")
    for kind in KINDS:
        if kind in by_kind:
            print(f"  {kind:22s} {by_kind[kind][0]:8.1f} {by_kind[kind][1]:6d}")
    print(f"\ntop kernels per phase (ms, calls)")
    for (ph, name), (ms, n) in sorted(by_kernel.items(), key=lambda x: -x[1][0])[:args.top]:
        print(f"  {ms:8.2f} {n:5d}  {ph:10s} {name}")
    print(f"\ntop (phase, outer op, inner op, shapes, kernel) groups")
    for (ph, outer, inner, shapes, kn), (ms, n) in sorted(by_op.items(), key=lambda x: -x[1][0])[:args.top * 2]:
        print(f"  {ms:8.2f} {n:5d}  {ph:9s} {outer[:40]:40s} {inner[:28]:28s} {shapes} | {kn}")
    by_phase, by_op = idle_gaps(gpu, stacks, phase_of, args.gap)
    print(f"\nGPU idle in gaps over {args.gap:g} µs: {sum(by_phase.values()):.1f} ms")
    for ph, ms in by_phase.most_common():
        print(f"  {ph:14s} {ms:8.1f} ms")
    print("  by the op whose launch ended the gap (ms, gaps)")
    for (ph, outer, inner), (ms, n) in sorted(by_op.items(), key=lambda x: -x[1][0])[:args.top]:
        print(f"  {ms:8.2f} {n:5d}  {ph:9s} {outer:40s} {inner}")


def idle_gaps(gpu: list[dict], stacks: dict[int, list[dict]], phase_of, min_us: float):
    """The GPU's idle time between events (gaps longer than min_us, in ms): by phase, and by (phase, outer op,
    inner op) of the event that ended the gap (the op the GPU waited for) as [ms, gaps]. Overlapping events (two
    streams) count as busy from the first start to the last end."""
    order = sorted(range(len(gpu)), key=lambda i: gpu[i]["ts"])
    by_phase: collections.Counter = collections.Counter()
    by_op: dict = collections.defaultdict(lambda: [0.0, 0])
    end = None
    for i in order:
        if end is not None and gpu[i]["ts"] - end > min_us:
            ms = (gpu[i]["ts"] - end) / 1e3
            ph = phase_of(i)
            st = stacks.get(i, [])
            key = (ph, short(st[0]["name"])[:40] if st else "-", short(st[-1]["name"])[:40] if st else "-")
            by_phase[ph] += ms
            by_op[key][0] += ms
            by_op[key][1] += 1
        e = gpu[i]["ts"] + gpu[i]["dur"]
        end = e if end is None else max(end, e)
    return by_phase, dict(by_op)


if __name__ == "__main__":
    main()
