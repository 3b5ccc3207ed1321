"""Why `serve.py`'s 16K prefix hit (the third request on a fresh prefix) takes longer than `graph_launch.py`'s hits
(many hits on one prefix): k3-small bf16 engine (as `prefill_profile.py`), rounds of reset → cold prompt (16,384 +
64 tokens) → five more requests with new 64-token tails on the same prefix. For each position in the round: wall
ms (synchronised perf_counter), the engine phases (`host_hit.py`'s wrappers) and the GPU time of each graph replay
(CUDA events around `CUDAGraph.replay`), medians over the rounds.

    python benchmarks/probe/hit_pattern.py [--rounds 4] --out hit_pattern.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_hit import PHASES, timed, times  # noqa: E402
from prefill_profile import engine_and_prompts  # noqa: E402
from serve import rand_prompts  # noqa: E402

from k3.serve import SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
NAMES = ("cold", "junction", "hit3", "hit4", "hit5", "hit6")
replays: list = []


def event_replay():
    """Wrap CUDAGraph.replay: CUDA events around each replay, kept in `replays` (read after a synchronize)."""
    fn = torch.cuda.CUDAGraph.replay

    def wrapper(self, *a, **k):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        try:
            return fn(self, *a, **k)
        finally:
            e.record()
            replays.append((s, e))
    torch.cuda.CUDAGraph.replay = wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="hit_pattern.json")
    a = ap.parse_args()
    eng, V, _, _, _ = engine_and_prompts()
    for seed in (1, 2):  # warm-up: prefill graphs, then the hit's extend graph
        eng.reset_prefix_cache()
        p = rand_prompts(1, 16384, V, seed)[0]
        for t in rand_prompts(2, 64, V, seed + 50):
            eng.generate([p + t], ONE)
    for cls, name in PHASES:
        timed(cls, name)
    event_replay()
    res = collections.defaultdict(lambda: collections.defaultdict(list))
    for rep in range(a.rounds):
        eng.reset_prefix_cache()
        prefix = rand_prompts(1, 16384, V, 8 + 100 * rep)[0]
        for name, tail in zip(NAMES, rand_prompts(len(NAMES), 64, V, 9 + 100 * rep)):
            times.clear()
            replays.clear()
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = eng.generate([prefix + tail], ONE)[0]
            torch.cuda.synchronize()
            res[name]["wall"].append((time.perf_counter() - t) * 1e3)
            res[name]["cached"].append(out.num_cached_tokens)
            res[name]["replay_gpu"].append(sum(s.elapsed_time(e) for s, e in replays))
            for k, v in times.items():
                res[name][k].append(sum(v))
    summary = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in res.items()}
    for name, d in summary.items():
        print(f"{name:9s} " + " ".join(f"{k.split('.')[-1]}={v:.3f}" for k, v in d.items()), flush=True)
    Path(a.out).write_text(json.dumps(dict(summary=summary, all={n: dict(d) for n, d in res.items()}), indent=1))


if __name__ == "__main__":
    main()
