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
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-settings sweep")
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
    # launch settings of the GEMV kernels at 1 and 8 tokens (µs per replay; the default first)
    sweep = []
    default = dict(moe_decode.LAUNCH)
    moe_decode.MAX_ENTRIES = 10 ** 9
    for N in () if a.no_sweep else (1, 8):
        idx = torch.rand(N, E, device="cuda", generator=gen).topk(K, dim=-1).indices
        x = torch.randn(N, L, device="cuda", generator=gen).bfloat16()
        w = torch.rand(N, K, device="cuda", generator=gen)
        for cfg in [default] + [dict(bi=bi, bl=bl, chunk=ch, warps=wp) for bi in (2, 4, 8) for bl in (2, 4, 8)
                                for ch in (256,) for wp in (2, 4, 8)]:
            moe_decode.LAUNCH.update(cfg)
            with torch.no_grad():
                us = median_ms(graphed(lambda: experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:])), 10, 100) * 1e3
            sweep.append(dict(tokens=N, **cfg, us=us))
        moe_decode.LAUNCH.update(default)
    for N in () if a.no_sweep else (1, 8):
        best = sorted((r for r in sweep if r["tokens"] == N), key=lambda r: r["us"])[:6]
        print(f"launch sweep, {N} tokens: default {sweep[[r['tokens'] for r in sweep].index(N)]['us']:.1f} us; "
              "best " + "; ".join(f"{r['bi']}/{r['bl']}/{r['chunk']}/{r['warps']} {r['us']:.1f}" for r in best))
    Path(a.out).write_text(json.dumps(dict(rows=rows, sweep=sweep), indent=1))


if __name__ == "__main__":
    main()
