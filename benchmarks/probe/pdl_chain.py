"""What programmatic dependent launch (PDL, Hopper's `griddepcontrol`) saves on a chain of small dependent
kernels inside a CUDA graph, as in a batch-1 decode step: x ← W_i x (a one-row GEMV, 16 weight rows per program)
repeated, optionally with a one-program RMSNorm kernel between the GEMVs. Modes:
  plain     ordinary launches;
  wait      launch_pdl=True, `gdc_wait` first in every program, then `gdc_launch_dependents`;
  prefetch  launch_pdl=True, every program loads its first weight chunk before `gdc_wait` (weights are not
            written by the previous kernel), then launches its dependents.
Checks every mode's output equals the plain one bit for bit; prints µs per kernel (CUDA events around graph
replays, median of --reps).

    python benchmarks/probe/pdl_chain.py --out pdl_chain.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

MODES = {"plain": 0, "wait": 1, "prefetch": 2}


@triton.jit
def gemv1_kernel(x_ptr, w_ptr, y_ptr, N, K, BN: tl.constexpr, CH: tl.constexpr, MODE: tl.constexpr):
    if MODE == 1:  # wait first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    r64 = rows[:, None].to(tl.int64)
    cols = tl.arange(0, CH)
    w0 = tl.load(w_ptr + r64 * K + cols[None, :])
    if MODE == 2:  # the first weight chunk is in flight before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.arange(0, 16)
    acc = tl.zeros([16, BN], tl.float32)
    x = tl.load(x_ptr + m[:, None] * 0 + cols[None, :], mask=(m < 1)[:, None], other=0.0)
    acc += tl.dot(x, tl.trans(w0))
    for c0 in range(CH, K, CH):
        c = c0 + cols
        x = tl.load(x_ptr + m[:, None] * 0 + c[None, :], mask=(m < 1)[:, None], other=0.0)
        w = tl.load(w_ptr + r64 * K + c[None, :])
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + m[:, None] * 0 + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=(m < 1)[:, None])


@triton.jit
def norm_kernel(x_ptr, w_ptr, y_ptr, K, BK: tl.constexpr, MODE: tl.constexpr):
    if MODE > 0:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    c = tl.arange(0, BK)
    x = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < K, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / K + 1e-6)
    tl.store(y_ptr + c, (x * r * w).to(y_ptr.dtype.element_ty), mask=c < K)


def chain(ws, nw, x0, bufs, mode: str, norms: bool, BN=16, CH=512):
    K = x0.shape[-1]
    pdl = mode != "plain"
    x = x0
    for i, w in enumerate(ws):
        y = bufs[2 * i % len(bufs)]
        gemv1_kernel[(w.shape[0] // BN,)](x, w, y, w.shape[0], K, BN=BN, CH=CH, MODE=MODES[mode], num_warps=4,
                                          num_stages=3, launch_pdl=pdl)
        x = y
        if norms:
            z = bufs[(2 * i + 1) % len(bufs)]
            norm_kernel[(1,)](x, nw, z, K, BK=triton.next_power_of_2(K), MODE=MODES[mode] > 0, num_warps=4,
                              launch_pdl=pdl)
            x = z
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--copies", type=int, default=24, help="distinct weights (more than L2 holds)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="pdl_chain.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    W = [torch.randn(a.n, a.k, device=dev, dtype=torch.bfloat16) / a.k ** 0.5 for _ in range(a.copies)]
    nw = torch.rand(a.k, device=dev, dtype=torch.bfloat16) + 0.5
    ws = [W[i % a.copies] for i in range(a.length)]
    x0 = torch.randn(1, a.k, device=dev, dtype=torch.bfloat16)
    res = {"n": a.n, "k": a.k, "length": a.length, "device": torch.cuda.get_device_name()}
    ref = {}
    for norms in (False, True):
        for mode in MODES:
            if a.n != a.k:
                break
            key = f"{mode}{'+norm' if norms else ''}"
            bufs = [torch.empty(1, a.k, device=dev, dtype=torch.bfloat16) for _ in range(4)]
            try:
                chain(ws, nw, x0, bufs, mode, norms)  # compile
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s), torch.cuda.graph(g):
                    out = chain(ws, nw, x0, bufs, mode, norms)
                torch.cuda.current_stream().wait_stream(s)
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
                times = []
                for _ in range(a.reps):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    g.replay()
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3)
                kernels = a.length * (2 if norms else 1)
                t = statistics.median(times)
                r = out.float().clone()
                ref.setdefault(norms, r)
                same = bool(torch.equal(r, ref[norms]))
                res[key] = {"us": t, "us_per_kernel": t / kernels, "equal_to_plain": same}
                print(f"{key:16s} {t:9.1f} us  {t / kernels:6.2f} us/kernel  equal={same}", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                res[key] = {"error": repr(e)[:400]}
                print(f"{key:16s} failed: {e!r}"[:400], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
