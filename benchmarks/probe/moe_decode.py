"""Routed experts of a decode step on the GPU: the few-token GEMV kernels (`k3.ops.moe_decode`) against the
sorted-rows pipeline (counting sort, dispatch, grouped GEMMs, SiTU-GLU, combine) at k3-small's sizes (32 experts,
I 512, latent 768, top 4, bf16, gate ‖ up fused), each captured in a CUDA graph as the engine runs it; µs per
replay (median of 200) and the weight bytes the used experts hold, as a bandwidth.

    python benchmarks/probe/moe_decode.py --out moe_decode.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

from k3.ops import moe_decode  # noqa: E402
from k3.ops.moe import experts_forward  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_decode.json")
    a = ap.parse_args()
    E, I, L, K = 32, 512, 768, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, L, device="cuda", generator=gen).bfloat16() * L ** -0.5
    w2 = torch.randn(E, L, I, device="cuda", generator=gen).bfloat16() * I ** -0.5
    rows = []
    for N in (1, 2, 4, 8, 16, 32):
        idx = torch.rand(N, E, device="cuda", generator=gen).topk(K, dim=-1).indices
        x = torch.randn(N, L, device="cuda", generator=gen).bfloat16()
        w = torch.rand(N, K, device="cuda", generator=gen)
        res = {}
        with torch.no_grad():
            for name, limit in (("gemv", 10 ** 9), ("grouped", 0)):
                moe_decode.MAX_ENTRIES = limit
                out = experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:])
                res[name] = (median_ms(graphed(lambda: experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:])),
                                       20, 200) * 1e3, out)
        used = idx.unique().numel()
        gb = used * 3 * I * L * 2 / 1e9
        rel = ((res["gemv"][1].float() - res["grouped"][1].float()).pow(2).mean()
               / res["grouped"][1].float().pow(2).mean()).sqrt().item()
        rows.append(dict(tokens=N, experts_used=used, gemv_us=res["gemv"][0], grouped_us=res["grouped"][0],
                         rel_rmse=rel))
        print(f"tokens {N:3d} ({used:2d} experts, {gb * 1e3:5.1f} MB): gemv {res['gemv'][0]:6.1f} us "
              f"({gb / res['gemv'][0] * 1e6 / 1e3:5.2f} TB/s), grouped {res['grouped'][0]:6.1f} us, "
              f"{res['grouped'][0] / res['gemv'][0]:.2f}x, rel {rel:.1e}")
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
