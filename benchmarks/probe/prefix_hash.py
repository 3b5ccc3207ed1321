"""Host time of the prefix cache's chained block hashes for one long prompt: from a list of Python ints (each
512-token block converted to int64 bytes per lookup: the baseline) against from a `Sequence`, whose prompt keeps
the int64 buffer `Engine.submit` checked (`Sequence.token_bytes`). Same keys asserted; best of `--reps`.

    python benchmarks/probe/prefix_hash.py --tokens 16448
"""
from __future__ import annotations

import argparse
import random
import time
from array import array

from k3.serve.prefix_cache import extend_hashes
from k3.serve.request import Sequence
from k3.serve.sampling import SamplingParams


def best_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16448)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(163840) for _ in range(a.tokens)]
    seq = Sequence(request_id="p", prompt_ids=array("q", prompt), params=SamplingParams(), eos=())
    lists, seqs = [], []
    extend_hashes(lists, prompt, a.block)
    extend_hashes(seqs, seq, a.block)
    assert lists == seqs, "the two paths must give the same keys"
    t_list = best_us(lambda: extend_hashes([], prompt, a.block), a.reps)
    t_seq = best_us(lambda: extend_hashes([], seq, a.block), a.reps)
    print(f"{a.tokens} tokens, {len(lists)} blocks of {a.block}: from the list {t_list:.0f} us, from the int64 "
          f"buffer {t_seq:.0f} us ({t_list / t_seq:.2f}x)")


if __name__ == "__main__":
    main()
