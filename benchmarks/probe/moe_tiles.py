"""Routed experts of a prefix hit's tail or a decode batch on the GPU: the expert-tile kernels (`k3.ops.moe_tiles`)
(the routed form where it applies, and after the counting sort) against the sorted-rows pipeline (counting sort,
dispatch, grouped GEMMs, SiTU-GLU, combine) at k3-small's sizes
(32 experts, I 512, latent 768, top 4, bf16, gate ‖ up fused), each captured in a CUDA graph as the engine runs
it: µs per replay (median of 200), the experts' weight bytes as a bandwidth, then a sweep of the tile kernels'
launch settings at 64 and 256 tokens (`--sweep joint`: both kernels' shared settings and rows per tile; `down`,
the default: the down kernel's own). `--tokens 2048 8192` with `--prefill-rows 64 128`: prefill sizes (8,192 to 32,768
entries, past `MAX_ENTRIES`, lifted here), where the tiles' fused SiTU-GLU epilogue would save the grouped path's
separate SiTU pass, at each of those rows per tile (the first is the default's).

    python benchmarks/probe/moe_tiles.py [--tokens N ...] [--sweep joint down] [--prefill-rows 64 128] \
        --out moe_tiles.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

from k3.ops import moe_decode, moe_tiles  # noqa: E402
from k3.ops.moe import experts_forward  # noqa: E402


def time_setting(run) -> float:
    """µs per graph replay of run() at the current launch settings (NaN, reported, for one that does not compile)."""
    try:
        with torch.no_grad():
            return median_ms(graphed(run), 10, 100) * 1e3
    except Exception as e:  # noqa: BLE001 (a setting that does not compile: reported)
        print(f"   {type(e).__name__}: {str(e)[:100]}")
        return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_tiles.json")
    ap.add_argument("--sweep", nargs="*", default=["down"], choices=["joint", "down"],
                    help="launch sweeps: both kernels' shared settings and tile rows, or the down kernel's own")
    ap.add_argument("--tokens", type=int, nargs="*", default=[16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--prefill-rows", type=int, nargs="*", default=[],
                    help="rows per tile to time at the token counts past MAX_ENTRIES / top-k (each a tiles row)")
    a = ap.parse_args()
    E, I, L, K = 32, 512, 768, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, L, device="cuda", generator=gen).bfloat16() * L ** -0.5
    w2 = torch.randn(E, L, I, device="cuda", generator=gen).bfloat16() * I ** -0.5
    moe_decode.MAX_ENTRIES = 0
    limit = moe_tiles.MAX_ENTRIES
    moe_tiles.MAX_ENTRIES = 1 << 30  # the tiles at every size asked for (the engine stops at `limit`)
    rows, sweep = [], []
    inputs = {}
    for N in a.tokens:
        idx = torch.rand(N, E, device="cuda", generator=gen).topk(K, dim=-1).indices
        x = torch.randn(N, L, device="cuda", generator=gen).bfloat16()
        w = torch.rand(N, K, device="cuda", generator=gen)
        inputs[N] = (x, idx, w)
        run = lambda: experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:])  # noqa: E731
        res = {}
        routed = moe_tiles.ROUTED
        with torch.no_grad():
            for name, on, rt in (("tiles", True, routed), ("sorted", True, False), ("grouped", False, routed)):
                moe_tiles.ON, moe_tiles.ROUTED = on, rt
                res[name] = (median_ms(graphed(run), 20, 200) * 1e3, run())
        moe_tiles.ON, moe_tiles.ROUTED = True, routed
        used = idx.unique().numel()
        gb = used * 3 * I * L * 2 / 1e9
        rel = ((res["tiles"][1].float() - res["grouped"][1].float()).pow(2).mean()
               / res["grouped"][1].float().pow(2).mean()).sqrt().item()
        same = torch.equal(res["tiles"][1], res["sorted"][1])
        rows.append(dict(tokens=N, experts_used=used, tiles_us=res["tiles"][0], sorted_tiles_us=res["sorted"][0],
                         grouped_us=res["grouped"][0], rel_rmse=rel, routed_equals_sorted=same,
                         routed=moe_tiles.routed(N * K)))
        print(f"tokens {N:5d} ({used:2d} experts, {gb * 1e3:5.1f} MB): tiles {res['tiles'][0]:6.1f} us "
              f"({gb / res['tiles'][0] * 1e6 / 1e3:5.2f} TB/s; routed {moe_tiles.routed(N * K)}), after the sort "
              f"{res['sorted'][0]:6.1f} us (outputs equal: {same}), grouped {res['grouped'][0]:6.1f} us, "
              f"{res['grouped'][0] / res['tiles'][0]:.2f}x, rel {rel:.1e}", flush=True)
        if N * K > limit:  # a prefill's size: the tiles at other rows per tile
            default_rows = moe_tiles.TILE_ROWS
            for bm in a.prefill_rows:
                moe_tiles.TILE_ROWS = ((1 << 30, bm),)
                us = time_setting(run)
                sweep.append(dict(kernel="prefill_rows", tokens=N, bm=bm, us=us, grouped_us=res["grouped"][0]))
                print(f"   tiles of {bm} rows: {us:7.1f} us ({res['grouped'][0] / us:.2f}x the grouped path)")
            moe_tiles.TILE_ROWS = default_rows
    default = (dict(moe_tiles.LAUNCH), moe_tiles.TILE_ROWS)
    for N in [n for n in (64, 256) if n in inputs] if "joint" in a.sweep else ():
        x, idx, w = inputs[N]
        run = lambda: experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:])  # noqa: E731
        for bm, bn, bk, warps, stages in itertools.product((16, 32), (32, 64, 128), (64, 128), (4,), (2, 3, 4)):
            moe_tiles.LAUNCH.update(bn=bn, bk=bk, warps=warps, stages=stages)
            moe_tiles.TILE_ROWS = ((1 << 30, bm),)
            us = time_setting(run)
            sweep.append(dict(kernel="joint", tokens=N, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, us=us))
        moe_tiles.LAUNCH.clear()
        moe_tiles.LAUNCH.update(default[0])
        moe_tiles.TILE_ROWS = default[1]
        best = sorted((r for r in sweep if r["kernel"] == "joint" and r["tokens"] == N), key=lambda r: r["us"])[:5]
        for r in best:
            print(f"sweep tokens {N}: {r}")
    # the down kernel's own settings (gate / up at the defaults): both kernels, timed together
    default_down = dict(moe_tiles.LAUNCH_DOWN)
    for N in [n for n in (64, 256) if n in inputs] if "down" in a.sweep else ():
        x, idx, w = inputs[N]
        run = lambda: experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:])  # noqa: E731
        for bn, bk, warps, stages in itertools.product((64, 128, 256), (64, 128), (4, 8), (2, 3, 4)):
            moe_tiles.LAUNCH_DOWN.update(bn=bn, bk=bk, warps=warps, stages=stages)
            us = time_setting(run)
            sweep.append(dict(kernel="down", tokens=N, bn=bn, bk=bk, warps=warps, stages=stages, us=us))
        moe_tiles.LAUNCH_DOWN.clear()
        moe_tiles.LAUNCH_DOWN.update(default_down)
        mine = [r for r in sweep if r["kernel"] == "down" and r["tokens"] == N]
        at_default = next(r["us"] for r in mine if all(r[k] == default_down[k] for k in ("bn", "bk", "warps", "stages")))
        for r in sorted(mine, key=lambda r: r["us"])[:5]:
            print(f"down sweep tokens {N} (default {at_default:.1f} us): {r}")
    moe_tiles.MAX_ENTRIES = limit
    Path(a.out).write_text(json.dumps(dict(rows=rows, sweep=sweep), indent=1))


if __name__ == "__main__":
    main()
