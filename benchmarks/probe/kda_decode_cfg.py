"""Launch settings of the Triton KDA decode step (columns per program × warps) at the engine's shapes: k3-small
(H 12, K = V 128), one layer's strided view of a page-major fp32 state pool, N sequences at scattered slots.
Reports time (CUDA events, median of 50 after warm-up) and the state traffic's bandwidth (read + write)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graph_us, median_ms  # noqa: E402

from k3.ops.kda.triton import kda_decode_triton  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kda_decode_cfg.json")
    a = ap.parse_args()
    H, K, L, P = 12, 128, 12, 600
    pool = torch.randn(P, L, H, K, K, device="cuda") * 0.01
    res = []
    for N in (1, 32, 256):
        g = torch.Generator(device="cuda").manual_seed(N)
        slots = torch.randperm(P, device="cuda", generator=g)[:N]
        q, k, f = (torch.randn(N, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        v = torch.randn(N, H, K, device="cuda", dtype=torch.bfloat16)
        bl = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
        A_log, dtb = torch.randn(H, device="cuda"), torch.randn(H * K, device="cuda")
        for bv, w in [(32, 4), (16, 4), (32, 2), (64, 4), (64, 8), (128, 8), (128, 16)]:
            def run():
                kda_decode_triton(q, k, v, f, bl, pool[:, 5], state_indices=slots, A_log=A_log, dt_bias=dtb,
                                  beta_logits=True, use_qk_l2norm_in_kernel=True, block_v=bv, num_warps=w)
            ms = median_ms(run, warmup=5, reps=50)
            gbs = N * H * K * K * 4 * 2 / (ms * 1e-3) / 1e9
            res.append(dict(N=N, block_v=bv, warps=w, ms=ms, GBps=gbs))
            print(f"N {N:4d} BV {bv:4d} warps {w:3d}: {ms * 1e3:8.1f} us  {gbs:8.0f} GB/s")
    # small decode batches as a step runs them: the 12 layers' calls in one CUDA graph (no Python launch), µs per call
    for N in (1, 4):
        g = torch.Generator(device="cuda").manual_seed(N)
        slots = torch.randperm(P, device="cuda", generator=g)[:N]
        q, k, f, v = (torch.randn(N, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        bl = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
        A_log, dtb = torch.randn(H, device="cuda"), torch.randn(H * K, device="cuda")
        for bv, w in [(64, 4), (32, 4), (32, 2), (16, 2), (16, 1), (16, 4), (8, 1)]:
            def layers():
                for layer in range(L):
                    kda_decode_triton(q, k, v, f, bl, pool[:, layer], state_indices=slots, A_log=A_log, dt_bias=dtb,
                                      beta_logits=True, use_qk_l2norm_in_kernel=True, block_v=bv, num_warps=w)
            us = graph_us(layers, 50) / L
            res.append(dict(N=N, graph=True, block_v=bv, warps=w, us=us))
            print(f"graph N {N:2d} BV {bv:4d} warps {w:3d}: {us:6.2f} us per call", flush=True)
    # extend steps (`ExtendGraph`): n sequences of T tokens each, stepped through recurrently (latency-bound)
    for n, T in ((1, 64), (32, 128)):
        g = torch.Generator(device="cuda").manual_seed(n * T)
        slots = torch.randperm(P, device="cuda", generator=g)[:n]
        cu = torch.arange(0, n * T + 1, T, device="cuda")
        q, k, f, v = (torch.randn(n * T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        bl = torch.randn(n * T, H, device="cuda", dtype=torch.bfloat16)
        A_log, dtb = torch.randn(H, device="cuda"), torch.randn(H * K, device="cuda")
        for bv, w in [(64, 4), (32, 4), (32, 2), (16, 2), (16, 1), (8, 1)]:
            def run():
                kda_decode_triton(q, k, v, f, bl, pool[:, 5], state_indices=slots, cu_seqlens=cu, A_log=A_log,
                                  dt_bias=dtb, beta_logits=True, use_qk_l2norm_in_kernel=True, block_v=bv,
                                  num_warps=w)
            ms = median_ms(run, warmup=5, reps=50)
            res.append(dict(n=n, T=T, block_v=bv, warps=w, ms=ms, us_per_token=ms * 1e3 / T))
            print(f"extend n {n:3d} x T {T:4d} BV {bv:4d} warps {w:3d}: {ms * 1e3:8.1f} us  "
                  f"{ms * 1e3 / T:6.2f} us per token")
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
