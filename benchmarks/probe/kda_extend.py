"""The engine's KDA extend step two ways, at k3-small's shapes (H 12, K = V 128, one layer's strided view of a
page-major fp32 state pool, n sequences of T new tokens at scattered slots, bf16 inputs): token by token
(`kda_decode_triton` with cu_seqlens, the decode kernel's loop) and in 16-token tiles (`kda_extend_triton`:
the chunked kernels over device-built tables). Both are timed as the engine runs them, inside a captured CUDA
graph (10 calls per replay; CUDA events, median of 30 replays), so host launch cost is excluded. Also reports
their agreement (relative RMS of the outputs) and which one `kda_decode_step_gated` picks
(`EXTEND_CHUNKED_MIN_TOKENS`).

    python benchmarks/probe/kda_extend.py --out kda_extend.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_ms  # noqa: E402

from k3.model.paged_cache import token_runs  # noqa: E402
from k3.ops.kda import EXTEND_CHUNKED_MIN_TOKENS  # noqa: E402
from k3.ops.kda.triton import kda_decode_triton, kda_extend_triton  # noqa: E402

SHAPES = ((1, 16), (1, 32), (1, 64), (1, 128), (4, 32), (4, 64), (8, 16), (16, 16), (32, 16), (32, 8), (64, 8))


def graph_ms(fn, calls: int = 10) -> float:
    """GPU milliseconds per call of fn, replayed from a CUDA graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, warmup=3, reps=30) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kda_extend.json")
    a = ap.parse_args()
    H, K, L, P = 12, 128, 12, 600
    dev = "cuda"
    pool = torch.randn(P, L, H, K, K, device=dev) * 0.01
    A_log, dtb = torch.randn(H, device=dev), torch.randn(H * K, device=dev)
    res = []
    for n, T in SHAPES:
        g = torch.Generator(device=dev).manual_seed(n * T)
        slots = torch.randperm(P, device=dev, generator=g)[:n]
        N = n * T
        cu = torch.arange(0, N + 1, T, device=dev)
        q, k, f, v = (torch.randn(N, H, K, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
        bl = torch.randn(N, H, device=dev, dtype=torch.bfloat16, generator=g)
        chunks = token_runs(cu, N, 16, first=True)
        kw = dict(A_log=A_log, dt_bias=dtb, use_qk_l2norm_in_kernel=True)

        def steps(state):
            return kda_decode_triton(q, k, v, f, bl, state, state_indices=slots, cu_seqlens=cu, beta_logits=True, **kw)

        def tiles(state):
            return kda_extend_triton(q, k, v, f, bl, A_log, dtb, state, slots, cu, *chunks,
                                     use_qk_l2norm_in_kernel=True)

        s1, s2 = pool[:, 5].clone(), pool[:, 5].clone()
        o1, o2 = steps(s1), tiles(s2)
        err = ((o1.float() - o2.float()).pow(2).mean() / o1.float().pow(2).mean()).sqrt().item()
        serr = ((s1 - s2).pow(2).mean() / s1.pow(2).mean()).sqrt().item()
        t_steps = graph_ms(lambda: steps(pool[:, 5]))
        t_tiles = graph_ms(lambda: tiles(pool[:, 6]))
        pick = "tiles" if N >= EXTEND_CHUNKED_MIN_TOKENS * n else "steps"
        res.append(dict(n=n, T=T, steps_us=t_steps * 1e3, tiles_us=t_tiles * 1e3, speedup=t_steps / t_tiles,
                        rel_rmse_o=err, rel_rmse_state=serr, picked=pick))
        print(f"n {n:3d} x T {T:4d}: token steps {t_steps * 1e3:8.1f} us, tiles {t_tiles * 1e3:8.1f} us "
              f"({t_steps / t_tiles:5.2f}x), rel. RMS o {err:.1e} state {serr:.1e}; picked: {pick}")
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
