"""Where a prefill's time goes: k3-small bf16 engine, one cold 8,192-token prefill (through its CUDA graph, and
eagerly), one cold 16,384-token prompt (two chunks) and one prefix-hit tail (16K cached + 64 new tokens). For each: wall time, summed GPU kernel time and the top kernels, the host→device
synchronisations
with the Python line that caused each (`torch.cuda.set_sync_debug_mode`), and the host's Python hot spots
(cProfile, top by own time), and the aten ops with the most GPU time.

    python benchmarks/probe/prefill_profile.py --out prefill_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve import build, rand_prompts  # noqa: E402
from timing import sync_sites  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def gpu_time_ms(fn, top: int | None = None) -> tuple[float, int, list]:
    """Summed GPU kernel time (ms), kernel count and the `top` kernels by time (all: None): (name, ms, calls)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"),
                 key=lambda e: -e.self_device_time_total)
    kernels = [(e.key[:90], e.self_device_time_total / 1e3, e.count) for e in evs[:top]]
    return sum(e.self_device_time_total for e in evs) / 1e3, sum(e.count for e in evs), kernels


def op_sites(fn, top: int = 20) -> list:
    """The aten ops whose kernels take the most GPU time: (op, calls, GPU ms) -- how much of a forward goes to
    copies, casts, sorts and concatenations. (Grouping by Python stack gave no k3 frames under the profiler here:
    the ops' `eager_op` wrappers; `TorchDispatchMode` with a traceback finds the call sites instead.)"""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    leaf = {"aten::copy_", "aten::cat", "aten::sort", "aten::index", "aten::index_put_", "aten::fill_",
            "aten::add", "aten::add_", "aten::mul", "aten::sub", "aten::where", "aten::scatter_", "aten::gather",
            "aten::cumsum", "aten::index_select", "aten::masked_fill_", "aten::zero_", "aten::exp", "aten::sigmoid",
            "aten::div", "aten::clamp", "aten::matmul"}
    rows = [(e.key, e.count, round(e.device_time_total / 1e3, 3)) for e in prof.key_averages()
            if e.key in leaf and e.device_time_total]
    return sorted(rows, key=lambda r: -r[2])[:top]


def hot_spots(fn, n: int = 35) -> str:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("k3/", n)
    return s.getvalue()


def engine_and_prompts():
    """The probes' k3-small bf16 engine (8K prefill chunks, prefix cache on), its vocabulary size, a 16K shared
    prefix, an iterator of 64-token tails and one of prompt seeds."""
    model = build("k3-small", "cuda", torch.bfloat16)
    V = model.config.text_config.vocab_size
    eng = Engine(model, EngineConfig(hash_block_size=512, block_size=6144, max_num_batched_tokens=8192,
                                     max_num_seqs=32, gpu_memory_fraction=0.5, enable_prefix_caching=True))
    return eng, V, rand_prompts(1, 16384, V, 8)[0], iter(rand_prompts(40, 64, V, 9)), iter(range(100, 200))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prefill_profile.json")
    a = ap.parse_args()
    eng, V, prefix, tails, seeds = engine_and_prompts()

    def cold():
        eng.reset_prefix_cache()
        eng.generate([rand_prompts(1, 8192, V, next(seeds))[0]], ONE)

    def hit():
        eng.generate([prefix + next(tails)], ONE)

    for _ in range(2):
        cold()
    eng.reset_prefix_cache()
    for _ in range(3):
        hit()  # the first computes the prefix, the others hit
    res = {}
    def cold_eager():  # the same prefill without its CUDA graph (the eager forward: before / after in one run)
        eng.runner.use_prefill_graphs = False
        try:
            cold()
        finally:
            eng.runner.use_prefill_graphs = True

    def cold_16k():  # a prompt over two chunks: the second after 8,192 cached tokens (a prefill graph with history)
        eng.reset_prefix_cache()
        eng.generate([rand_prompts(1, 16384, V, next(seeds))[0]], ONE)

    cold_16k()
    for name, fn in (("cold_8192", cold), ("cold_8192_eager", cold_eager), ("cold_16384", cold_16k),
                     ("hit_16384_plus_64", hit)):
        r = res[name] = {}
        r["wall_ms"] = sorted(timed(fn) for _ in range(3))[1]
        r["gpu_ms"], r["kernels"], r["top_kernels"] = gpu_time_ms(fn)
        r["syncs"] = sync_sites(fn, True)
        r["n_syncs"] = sum(r["syncs"].values())
        r["op_sites"] = op_sites(fn)
        r["cprofile"] = hot_spots(fn)
        print(f"== {name}: wall {r['wall_ms']:.1f} ms, GPU {r['gpu_ms']:.1f} ms in {r['kernels']} kernels, "
              f"{r['n_syncs']} syncs")
        for k, v in list(r["syncs"].items())[:25]:
            print(f"   {v:5d}  {k}")
        for name, ms, calls in r["top_kernels"][:25]:
            print(f"   k {ms:8.3f} ms {calls:5d}  {name}")
        for name, ms, calls in sorted(r["top_kernels"], key=lambda k: -k[2])[:30]:  # the most launched
            print(f"   n {calls:5d} {ms:8.3f} ms  {name}")
        for op, calls, ms in r["op_sites"]:
            print(f"   op {ms:8.3f} ms {calls:5d}  {op}")
        print(r["cprofile"])
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
