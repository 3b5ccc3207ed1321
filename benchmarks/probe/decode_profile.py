"""Where a decode step's time goes: k3-small bf16 engine, batch B, one eager step under torch.profiler (top
CUDA kernels, their count and summed GPU time, the step's wall time) and the CUDA-graph step's time.

    python benchmarks/probe/decode_profile.py --batch 1 256 --out decode_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve import build, rand_prompts  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402


def steps_ms(eng, n):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--out", default="decode_profile.json")
    a = ap.parse_args()
    model = build("k3-small", "cuda", torch.bfloat16)
    V = model.config.text_config.vocab_size
    eng = Engine(model, EngineConfig(block_size=6144, hash_block_size=512, max_num_seqs=max(a.batch),
                                     gpu_memory_fraction=0.5, async_scheduling=False))  # one step = one forward
    res = {}
    for B in a.batch:
        eng.reset_prefix_cache()
        rids = [eng.submit(p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
                for p in rand_prompts(B, 128, V, B)]
        while any(len(eng.requests[r].output) == 0 for r in rids):
            eng.step()
        eng.runner.use_graphs = True
        graph_ms = steps_ms(eng, 20)
        eng.runner.use_graphs = False
        eager_ms = steps_ms(eng, 10)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            eng.step()
            torch.cuda.synchronize()
        # where the copy kernels come from: aten::copy_ calls grouped by the Python lines that issued them
        sites = [e for e in prof.key_averages(group_by_stack_n=3) if e.key == "aten::copy_"]
        res[f"copy_sites_{B}"] = [(e.count, [f for f in e.stack if "/k3/" in f][:3]) for e in
                                  sorted(sites, key=lambda e: -e.count)[:12]]
        evs = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        gpu_us = sum(e.self_device_time_total for e in evs)
        n_k = sum(e.count for e in evs)
        top = sorted(evs, key=lambda e: -e.self_device_time_total)[:40]  # every kind of kernel
        res[B] = dict(graph_step_ms=graph_ms, eager_step_ms=eager_ms, eager_gpu_ms=gpu_us / 1e3, kernels=n_k,
                      top=[(e.key[:160], e.count, round(e.self_device_time_total / 1e3, 3)) for e in top])
        eng.runner.use_graphs = True
        for r in rids:
            eng.abort(r)
        print(f"batch {B}: graph step {graph_ms:.3f} ms, eager step {eager_ms:.3f} ms, eager GPU busy "
              f"{gpu_us / 1e3:.3f} ms in {n_k} kernels")
        for k, c, ms in res[B]["top"]:
            print(f"   {ms:8.3f} ms {c:5d}x  {k}")
        for c, stack in res[f"copy_sites_{B}"]:
            print(f"   copy_ {c:4d}x  {' <- '.join(stack)}")
    # TTFT of a prefix hit: a 16K-token prefix, then the same prefix with a new 64-token tail, profiled
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefix = rand_prompts(1, 16384, V, 8)[0]
    for k in range(3):  # warm-up: shapes compiled, then cold and hit once each
        eng.reset_prefix_cache()
        eng.generate([prefix + rand_prompts(1, 64, V, 20 + k)[0]], one)
        eng.generate([prefix + rand_prompts(1, 64, V, 30 + k)[0]], one)
    eng.reset_prefix_cache()
    eng.generate([prefix + rand_prompts(1, 64, V, 9)[0]], one)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        out = eng.generate([prefix + rand_prompts(1, 64, V, 10)[0]], one)[0]
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    ka = prof.key_averages()
    cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]
    gpu = sorted([e for e in ka if e.device_type.name == "CUDA"], key=lambda e: -e.self_device_time_total)[:25]
    res["ttft_hit"] = dict(wall_ms=wall, cached=out.num_cached_tokens,
                           top_cpu=[(e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in cpu],
                           top_gpu=[(e.key[:80], e.count, round(e.self_device_time_total / 1e3, 3)) for e in gpu])
    print(f"prefix hit: {wall:.1f} ms, {out.num_cached_tokens} cached")
    for k, c, ms in res["ttft_hit"]["top_cpu"]:
        print(f"   cpu {ms:8.3f} ms {c:5d}x  {k}")
    for k, c, ms in res["ttft_hit"]["top_gpu"]:
        print(f"   gpu {ms:8.3f} ms {c:5d}x  {k}")
    Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
