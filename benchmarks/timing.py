"""Median wall time of a callable for the benchmark scripts: CUDA events on GPU, perf_counter on CPU."""
from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, warmup: int, reps: int, cuda: bool = True, before=None) -> float:
    """Median milliseconds of fn() over `reps` calls after `warmup` calls; `before()` runs ahead of each
    timed call (e.g. a barrier across ranks), outside the timed region."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph (one warm-up run on a side stream first: Triton compiles, cuBLAS picks its
    kernels) → the graph's `replay`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def graph_us(fn, reps: int, warmup: int = 3) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph (`graphed`), over `reps` replays."""
    return 1e3 * median_ms(graphed(fn), warmup, reps)
