"""Where a single request's wall time goes between the host and the GPU: k3-small bf16 engine, a cold 8,192-token
prefill (its CUDA graph) and a 16K prefix hit (+64 tokens, its extend graph). One profiled `generate` each
(after warm-up): the host time before the first kernel starts (submit, scheduling, batch tables, graph launch),
the GPU span from the first kernel's start to the last one's end, the kernels' busy time inside it (the rest
are gaps between kernels), and the host time after the last kernel (read-back, sampling, outputs); with the
host ranges of the engine's phases (offsets from the call, ms).

    python benchmarks/probe/prefill_timeline.py --out prefill_timeline.json
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_profile import engine_and_prompts  # noqa: E402
from serve import rand_prompts  # noqa: E402

from k3.serve import SamplingParams  # noqa: E402
from k3.serve import engine as engine_mod  # noqa: E402
from k3.serve import runner as runner_mod  # noqa: E402
from k3.serve import scheduler as scheduler_mod  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def labelled(cls, name: str, label: str):
    """Wrap cls.name in a profiler range `label`."""
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        with record_function(label):
            return fn(*a, **k)
    setattr(cls, name, wrapper)


def union_us(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def timeline(fn) -> dict:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        # the profiler's first CUDA op pays its tracing set-up (≈ 3.5 ms on the H200): outside the timed call
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        with record_function("call"):
            fn()
        torch.cuda.synchronize()
    evs = prof.events()
    call = next(e for e in evs if e.name == "call")
    t0, t1 = call.time_range.start, call.time_range.end
    kern = [(e.time_range.start, e.time_range.end) for e in evs
            if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    first, last = min(s for s, _ in kern), max(e for _, e in kern)
    busy = union_us(kern)
    phases = [(e.name, round((e.time_range.start - t0) / 1e3, 3),
               round((e.time_range.end - e.time_range.start) / 1e3, 3)) for e in evs if e.name.startswith("k3.")]
    return dict(wall_ms=(t1 - t0) / 1e3, host_before_first_kernel_ms=(first - t0) / 1e3,
                gpu_span_ms=(last - first) / 1e3, kernel_busy_ms=busy / 1e3, gaps_ms=(last - first - busy) / 1e3,
                host_after_last_kernel_ms=(t1 - last) / 1e3, kernels=len(kern),
                phases=sorted(phases, key=lambda p: p[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prefill_timeline.json")
    a = ap.parse_args()
    for cls, name in ((engine_mod.Engine, "submit"), (engine_mod.Engine, "step"), (engine_mod.Engine, "_sample"),
                      (engine_mod.Engine, "_finish"), (scheduler_mod.Scheduler, "schedule"),
                      (runner_mod.ModelRunner, "forward"), (torch.cuda.CUDAGraph, "replay")):
        labelled(cls, name, f"k3.{cls.__name__}.{name}")
    eng, V, prefix, tails, seeds = engine_and_prompts()

    def cold():
        eng.reset_prefix_cache()
        p = rand_prompts(1, 8192, V, next(seeds))[0]
        return lambda: eng.generate([p], ONE)

    def hit():
        p = prefix + next(tails)
        return lambda: eng.generate([p], ONE)

    for _ in range(3):
        cold()()
    eng.reset_prefix_cache()
    for _ in range(3):
        hit()()
    res = {}
    for name, make in (("cold_8192", cold), ("hit_16384_plus_64", hit)):
        runs = [timeline(make()) for _ in range(3)]
        r = res[name] = sorted(runs, key=lambda x: x["wall_ms"])[1]
        plain = []
        for _ in range(5):  # the same call without the profiler (its per-op tracing inflates the host times above)
            fn = make()
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            plain.append((time.perf_counter() - t) * 1e3)
        r["plain_wall_ms"] = sorted(plain)[2]
        print(f"== {name}: without the profiler {r['plain_wall_ms']:.2f} ms (median of 5)")
        print(f"== {name}: wall {r['wall_ms']:.2f} ms = host before the first kernel "
              f"{r['host_before_first_kernel_ms']:.2f}"
              f" + GPU span {r['gpu_span_ms']:.2f} (kernels busy {r['kernel_busy_ms']:.2f}, gaps {r['gaps_ms']:.2f}, "
              f"{r['kernels']} kernels) + host after the last {r['host_after_last_kernel_ms']:.2f}")
        for p in r["phases"]:
            print(f"   {p[1]:8.3f} +{p[2]:7.3f} ms  {p[0]}")
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
