"""The serving engine's own host time per decode step: `Engine.step` with the model forward replaced by a stub
that returns fixed logits, so what is left is scheduling, batch inputs, sampling and the request outputs.

    python benchmarks/probe/engine_host.py --batch 256 --prompt 1000 [--profile]

k3-tiny on the CPU (the engine's Python is the same on any device); sampling runs on the CPU here (a GPU runs
it as kernels), so the figure is an upper bound of the host part of a GPU decode step at that batch.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_tiny  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--generated", type=int, default=0, help="decode steps before timing (output length so far)")
    ap.add_argument("--vocab", type=int, default=4096, help="width of the stub's logits")
    ap.add_argument("--output-kind", default="cumulative", choices=("cumulative", "delta", "final_only"))
    ap.add_argument("--profile", action="store_true", help="cProfile of 20 more steps (top 20 by own time)")
    ap.add_argument("--gc-freeze", action="store_true", help="EngineConfig.gc_freeze (as `k3 serve`)")
    a = ap.parse_args(argv)
    if a.batch < 1 or a.prompt < 1 or a.steps < 1:
        ap.error(f"--batch {a.batch}, --prompt {a.prompt} and --steps {a.steps} must be ≥ 1")
    torch.set_num_threads(1)
    B, P = a.batch, a.prompt
    pages = B * (-(-(P + a.generated + a.steps + 64) // 64) + 2) + 64  # MLA pages of 64 tokens + a KDA slot per request
    eng = Engine(make_tiny(seed=0).eval(), EngineConfig(block_size=64, hash_block_size=16, num_pages=pages,
                                                        max_num_seqs=B, max_num_batched_tokens=max(B, 8192),
                                                        gc_freeze=a.gc_freeze))
    fixed = torch.randn(B, a.vocab)
    eng.runner.forward = lambda seqs: fixed[:sum(s.want_logits for s in seqs)]
    rng = random.Random(0)
    for _ in range(B):
        eng.submit([rng.randrange(4000) for _ in range(P)],
                   SamplingParams(max_tokens=a.generated + a.steps + 100, temperature=0, ignore_eos=True, output_kind=a.output_kind))
    while any(not r.output for r in eng.requests.values()):  # every prompt prefilled
        eng.step()
    if len(eng.scheduler.running) != B:
        raise SystemExit(f"only {len(eng.scheduler.running)} of {B} requests run at once (pool too small)")
    for _ in range(a.generated):
        eng.step()
    collections = []  # the generation of each garbage collection during the timed steps
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    print(f"batch {B}, prompt {P}, {len(next(iter(eng.requests.values())).output)} generated: host time per decode step (stub forward, {a.steps} steps): median "
          f"{1e3 * statistics.median(times):.2f} ms, mean {1e3 * statistics.mean(times):.2f} ms, max "
          f"{1e3 * max(times):.2f} ms; p99 {1e3 * sorted(times)[int(0.99 * (len(times) - 1))]:.2f} ms; garbage "
          f"collections by generation {({g: collections.count(g) for g in (0, 1, 2)})}")
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            eng.step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
