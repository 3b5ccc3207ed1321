"""Where a 16K prefix hit's host time goes, without the profiler, and what one CUDA graph launch costs the host.

1. k3-small bf16 engine (as `prefill_profile.py`): after warm-up, 9 prefix hits (16K cached + 64 new tokens) with
   perf_counter wrappers around the engine's phases (submit, schedule, the graph's `fill`, the input copy, the
   graph launch, sampling, outputs): the median host ms of each and of the whole call.
2. `CUDAGraph.replay()` alone, host time of the call (median of 30, the GPU drained between calls), for each graph
   the engine holds (extend, prefill, decode), with programmatic dependent launch on and off (recaptured); and
   each replay's GPU time from start to end (CUDA events: its kernels and the gaps between them).
3. Synthetic graphs of n kernels (n = 100, 300, 600): a torch add, a trivial Triton kernel, the same with PDL; the
   launch's host time per kernel node.

    python benchmarks/probe/graph_launch.py --out graph_launch.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_hit import timed as timed_method, times  # noqa: E402
from prefill_profile import engine_and_prompts  # noqa: E402
from serve import rand_prompts, with_settings  # noqa: E402

import k3.ops._triton as kt  # noqa: E402
from k3.ops._triton_jit import pdl_sync  # noqa: E402
from k3.serve import SamplingParams  # noqa: E402
from k3.serve import engine as engine_mod  # noqa: E402
from k3.serve import runner as runner_mod  # noqa: E402
from k3.serve import scheduler as scheduler_mod  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def replay_host_ms(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


@triton.jit
def tiny_kernel(x_ptr, PDL: tl.constexpr = False):
    pdl_sync(PDL)
    i = tl.program_id(0)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1.0)


def synthetic(n: int, kind: str) -> float:
    x = torch.zeros(1024, device="cuda")
    kw = {"PDL": True, "launch_pdl": True} if kind == "triton_pdl" else {}

    def body():
        for _ in range(n):
            if kind == "torch_add":
                x.add_(1.0)
            else:
                tiny_kernel[(4,)](x, **kw)
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return replay_host_ms(g)


def replay_gpu_ms(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    """GPU time of one replay from start to end (CUDA events, median): the kernels and the gaps between them."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def graph_table(eng) -> dict:
    return {str(k): replay_host_ms(g.graph) for k, g in eng.runner.graphs.items() if g.graph is not None}


def graph_gpu_table(eng) -> dict:
    return {str(k): replay_gpu_ms(g.graph) for k, g in eng.runner.graphs.items() if g.graph is not None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="graph_launch.json")
    a = ap.parse_args()
    res = {"synthetic": {}}
    for n in (100, 300, 600):
        for kind in ("torch_add", "triton", "triton_pdl"):
            ms = synthetic(n, kind)
            res["synthetic"][f"{kind}_{n}"] = ms
            print(f"synthetic {kind:10s} n {n:4d}: launch {ms:7.3f} ms host, {1e3 * ms / n:6.2f} us per node")
    for cls, name in ((engine_mod.Engine, "submit"), (engine_mod.Engine, "step"), (engine_mod.Engine, "_sample"),
                      (engine_mod.Engine, "_finish"), (scheduler_mod.Scheduler, "schedule"),
                      (runner_mod.ModelRunner, "forward"), (runner_mod.ExtendGraph, "fill"),
                      (runner_mod.ModelRunner, "graph_for"), (torch.cuda.CUDAGraph, "replay")):
        timed_method(cls, name)
    eng, V, prefix, tails, seeds = engine_and_prompts()
    for _ in range(2):
        eng.reset_prefix_cache()
        eng.generate([rand_prompts(1, 8192, V, next(seeds))[0]], ONE)
    eng.reset_prefix_cache()

    def hits(n: int) -> dict:
        for _ in range(3):
            eng.generate([prefix + next(tails)], ONE)
        walls = []
        per = collections.defaultdict(list)
        for _ in range(n):
            p = prefix + next(tails)
            times.clear()
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.generate([p], ONE)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
            for k, v in times.items():
                per[k].append(sum(v))
        return dict(wall_ms=statistics.median(walls), phases_ms={k: statistics.median(v) for k, v in per.items()})

    res["hit"] = hits(9)
    print(f"hit: wall {res['hit']['wall_ms']:.2f} ms (median of 9)")
    for k, v in res["hit"]["phases_ms"].items():
        print(f"   {v:7.3f} ms  {k}")
    res["replay_pdl_on"] = graph_table(eng)
    res["replay_gpu_ms"] = graph_gpu_table(eng)
    for k, v in res["replay_gpu_ms"].items():
        print(f"replay {k:32s} GPU {v:7.3f} ms (events around one replay, median of 30)")

    def no_pdl():
        eng.generate([rand_prompts(1, 8192, V, next(seeds))[0]], ONE)
        r = hits(5)
        return dict(hit=r, replay=graph_table(eng))
    res["pdl_off"] = with_settings(eng, [(kt, "PDL", False)], no_pdl)
    print(f"hit without PDL: wall {res['pdl_off']['hit']['wall_ms']:.2f} ms")
    for k, v in res["replay_pdl_on"].items():
        print(f"replay {k:32s} host {v:7.3f} ms with PDL, {res['pdl_off']['replay'].get(k, float('nan')):7.3f} without")
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
