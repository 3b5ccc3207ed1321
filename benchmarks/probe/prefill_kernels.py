"""Launch settings of the two kernels that dominate a one-sequence prefill of k3-small (H 12, K = V 128, bf16,
8,192 tokens, no autograd) on the GPU: the chunked KDA forward (`chunk_kda_gated_triton`: value-block width of
the recurrence and sequence splitting, which decide how many programs the 12 heads get), the prefill short
conv (`short_conv_step` with `conv_tiles`: the window-skipping tiles against the former every-tile window loads,
channels per program, warps, tokens per tile; x a row slice of the model's 64-aligned projection output) and
SiTU-GLU (elements per program and warps, at the prefill's routed-expert and shared-expert shapes). CUDA events, median of 20-50 after warm-up (the conv in a CUDA
graph); each variant's output against the default's (relative RMS).

    python benchmarks/probe/prefill_kernels.py [--parts kda conv situ] --out prefill_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

import k3.ops.situ.triton as ST  # noqa: E402

import k3.ops.conv as CV  # noqa: E402
import k3.ops.conv.triton_step as TS  # noqa: E402
from k3.ops.conv import conv_tiles, short_conv_step  # noqa: E402
from k3.ops.kda.triton import chunk_kda_gated_triton  # noqa: E402
from k3.ops.kda.triton.chunk import cfg_override  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()).sqrt().item()


def situ_case(M, I, dev, dtype, cuda):
    """SiTU-GLU of a [M, 2I] gate ‖ up GEMM output (`situ_fwd`) with the hardware tanh and without (K3_SITU_APPROX),
    each at every (elements per program, warps), the default first (µs of CUDA graph replays, GB/s of g, u read
    and the output written)."""
    gen = torch.Generator(device=dev).manual_seed(M + I)
    gu = torch.randn(M, 2 * I, device=dev, dtype=dtype, generator=gen) * 4
    g, u = gu[:, :I], gu[:, I:]
    base = ST.situ_fwd(g, u, 4.0, 25.0)  # the config's β₁, β₂
    old, approx, rows = dict(ST.CFG), ST.APPROX, []

    def timed(fn):  # CUDA graph replays: a launch's host time (~20 µs) would hide these 30-100 µs kernels
        return median_ms(graphed(fn) if cuda else fn, warmup=3 if cuda else 0, reps=50 if cuda else 1, cuda=cuda)

    try:
        for hw in (approx, not approx):  # the hardware-tanh forward (K3_SITU_APPROX) and the exact one
            ST.APPROX = hw
            for tile, warps in ((old["tile"], old["warps"]), (1024, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 8),
                                (8192, 8)):
                ST.CFG.update(tile=tile, warps=warps)
                ms = timed(lambda: ST.situ_fwd(g, u, 4.0, 25.0))
                row = dict(M=M, I=I, approx=hw, tile=tile, warps=warps, us=ms * 1e3,
                           GBps=3 * M * I * gu.element_size() / (ms * 1e-3) / 1e9,
                           rel_rmse=rel(ST.situ_fwd(g, u, 4.0, 25.0), base))
                rows.append(row)
                print(f"situ [{M}, 2x{I}] approx {int(hw)} tile {tile:5d} warps {warps}: {row['us']:7.1f} us "
                      f"({row['GBps']:5.0f} GB/s) rel {row['rel_rmse']:.1e}")
    finally:
        ST.CFG.update(old)
        ST.APPROX = approx
    # references for the memory system at the default tiles: the same kernel on contiguous copies of g and u, and
    # PyTorch's g + u on the strided views (the same bytes moved, no special functions)
    gc, uc = g.contiguous(), u.contiguous()
    for name, fn in (("situ_contiguous_inputs", lambda: ST.situ_fwd(gc, uc, 4.0, 25.0)),
                     ("torch_add_strided", lambda: torch.add(g, u))):
        ms = timed(fn)
        rows.append(dict(M=M, I=I, variant=name, us=ms * 1e3, GBps=3 * M * I * gu.element_size() / (ms * 1e-3) / 1e9))
        print(f"situ [{M}, 2x{I}] {name}: {rows[-1]['us']:7.1f} us ({rows[-1]['GBps']:5.0f} GB/s)")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prefill_kernels.json")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--parts", nargs="*", default=["conv"], choices=["kda", "conv", "situ"])
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under Triton's interpreter (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    T, H, K = a.tokens, 12, 128
    dev, bf = a.device, (torch.bfloat16 if a.device == "cuda" else torch.float32)
    cuda = dev == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, f = (torch.randn(1, T, H, K, device=dev, dtype=bf, generator=g) for _ in range(4))
    beta = torch.randn(1, T, H, device=dev, dtype=bf, generator=g)
    A_log, dtb = torch.randn(H, device=dev) * 0.3, torch.randn(H * K, device=dev) * 0.5
    h0 = torch.randn(1, H, K, K, device=dev) * 0.1
    res = {"kda": [], "conv": []}

    def kda():
        with torch.no_grad():
            return chunk_kda_gated_triton(q, k, v, f, beta, A_log, dtb, initial_state=h0, output_final_state=True,
                                          cu_seqlens=torch.tensor([0, T], dtype=torch.int32))[0]

    base = kda() if "kda" in a.parts else None
    for bv in (64, 32, 16) if "kda" in a.parts else ():
        for min_chunks in (0, 128, 64, 32):
            cfg = dict(fwd_bv=bv, seq_split=8 if min_chunks else 0, split_min_chunks=max(min_chunks, 1),
                       split_below_programs=10 ** 6)
            with cfg_override(**cfg):
                ms = median_ms(kda, warmup=3 if cuda else 0, reps=20 if cuda else 1, cuda=cuda)
                err = rel(kda(), base)
            res["kda"].append(dict(block_v=bv, split_min_chunks=min_chunks, ms=ms, rel_rmse=err))
            print(f"kda fwd T {T} BV {bv:3d} split {'off' if not min_chunks else min_chunks:>4}: {ms:7.3f} ms  "
                  f"rel {err:.1e}")

    C, P = 3 * H * K, 64
    # a row slice of the joined projection's output, whose width the model pads to a multiple of 64 (6,336)
    x = torch.randn(T, C + 1728, device=dev, dtype=bf, generator=g)[:, :C]
    w = torch.randn(C, 1, 4, device=dev, generator=g)
    pool = torch.randn(P, C, 3, device=dev, dtype=bf, generator=g)
    slots, cu = torch.tensor([5], device=dev), torch.tensor([0, T], dtype=torch.int32, device=dev)
    pool0 = pool.clone()  # the timed calls advance `pool`'s windows; the checks start from these
    ref = short_conv_step(x, w, pool0.clone(), slots, cu_seqlens=cu, tiles=conv_tiles([T], dev), backend="triton")
    old, old_tile = dict(TS.TILES_LAUNCH), CV.CONV_TILE
    try:
        for skip in (False, True) if "conv" in a.parts else ():  # False: the former kernel (window loads everywhere)
            for bt in (16, 32, 64):  # tokens per tile (the host's tile table and the kernel's BT together)
                CV.CONV_TILE = TS.CONV_TILE = bt
                tiles = conv_tiles([T], dev)
                for bc in (64, 128):
                    for warps in (2, 4):
                        TS.TILES_LAUNCH.update(bc=bc, warps=warps, skip=skip)
                        step = lambda: short_conv_step(x, w, pool, slots, cu_seqlens=cu, tiles=tiles,  # noqa: E731
                                                       backend="triton")
                        ms = median_ms(graphed(step) if cuda else step, warmup=3 if cuda else 0,
                                       reps=50 if cuda else 1, cuda=cuda)
                        err = rel(short_conv_step(x, w, pool0.clone(), slots, cu_seqlens=cu, tiles=tiles,
                                                  backend="triton"), ref)
                        gbs = 2 * T * C * 2 / (ms * 1e-3) / 1e9
                        res["conv"].append(dict(skip=skip, bt=bt, bc=bc, warps=warps, ms=ms, GBps=gbs, rel_rmse=err))
                        print(f"conv tiles skip {int(skip)} BT {bt:3d} BC {bc:3d} warps {warps}: {ms * 1e3:7.1f} us  "
                              f"{gbs:6.0f} GB/s  rel {err:.1e}")
    finally:
        TS.TILES_LAUNCH.update(old)
        CV.CONV_TILE = TS.CONV_TILE = old_tile
    res["situ"] = [r for M, I in ((4 * T, 512), (T, 1024)) for r in situ_case(M, I, dev, bf, cuda)] \
        if "situ" in a.parts else []
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
