"""An experiment, not yet in `k3.ops`: a prefix hit's routed experts as ONE kernel over (expert tile, block of I)
instead of the gate / up kernel, then the down kernel (`k3.ops.moe_tiles`, routed form).

Program (tile p, block j of BI columns of I) finds its tile from the router's choices (`moe_tiles._tile_routed`),
computes h = SiTU-GLU(x W1[e][j]ᵀ, x W3[e][j]ᵀ) for its BM rows and BI columns in registers, rounds it to the
activation dtype (as the two-kernel path stores h), and multiplies it by W2[e][:, j]: a partial [BM, L] of each
row's expert output, stored in fp32 per block j. A second kernel sums, per token, the J partials of each of its K
entries with the router's weights. Every expert weight byte is read once, in one kernel (the down projection's
launch, ramp and its wait for the gate / up kernel are gone), at the price of J fp32 partials (L2-resident: 64
tokens × 4 × 768 × 4 blocks × 4 B = 3 MB at k3-small's sizes).

Timed in CUDA graph replays against `experts_forward` (the routed tile kernels) at 16, 64 and 256 tokens, over a
few launch settings; values checked against it (relative RMS). `--device cpu`: Triton's interpreter at small sizes,
values only (a dry run).

    python benchmarks/probe/moe_fused.py --out moe_fused.json
    python benchmarks/probe/moe_fused.py --device cpu      # the interpreter: values only
    python benchmarks/probe/moe_fused.py --regs            # no GPU: registers / spills of each setting on sm_90a
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

from k3.ops import moe_decode, moe_tiles  # noqa: E402
from k3.ops.moe import experts_forward  # noqa: E402
from k3.ops.moe_tiles import _tile_routed, gate_up_tile  # noqa: E402
from k3.ops.situ.triton import situ_glu_value  # noqa: E402


@triton.jit
def fused_experts_kernel(x_ptr, idx_ptr, w1_ptr, w3_ptr, w2_ptr, part_ptr, E, I, NK, sx, s1_e, s1_r, s3_e, s3_r,
                         s2_e, s2_r, beta, linear_beta, K: tl.constexpr, L: tl.constexpr, EP: tl.constexpr,
                         CH: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                         UPCAST: tl.constexpr):
    """part[j, entry, :] = SiTU-GLU(x W1[e][cols]ᵀ, x W3[e][cols]ᵀ) W2[e][:, cols]ᵀ (fp32) for tile p's entries,
    cols = block j of I."""
    p = tl.program_id(0)
    j = tl.program_id(1)
    e, ent, rm = _tile_routed(idx_ptr, p, NK, E, EP, CH, BM)
    if e < E:
        tok = (ent // K).to(tl.int64)
        cols = j * BI + tl.arange(0, BI)
        cm = cols < I
        e64 = e.to(tl.int64)
        c64 = cols.to(tl.int64)
        dot_t = tl.float32 if UPCAST else x_ptr.dtype.element_ty
        prec: tl.constexpr = "ieee" if UPCAST else "tf32"
        g, u = gate_up_tile(x_ptr, tok, rm, e, cols, cm, w1_ptr, w3_ptr, sx, s1_e, s1_r, s3_e, s3_r, L, BM, BI, BK,
                            prec, UPCAST)
        h = situ_glu_value(g, u, beta, linear_beta).to(x_ptr.dtype.element_ty).to(dot_t)  # h's one rounding
        h = tl.where(cm[None, :], h, 0.0)
        rows = (j * NK + ent).to(tl.int64)
        for n0 in range(0, L, BN):
            ln = n0 + tl.arange(0, BN)
            lm = ln < L
            w2 = tl.load(w2_ptr + e64 * s2_e + ln.to(tl.int64)[None, :] * s2_r + c64[:, None],
                         mask=cm[:, None] & lm[None, :], other=0.0)  # [BI, BN]
            y = tl.dot(h, w2.to(dot_t), input_precision=prec)
            tl.store(part_ptr + rows[:, None] * L + ln[None, :], y, mask=rm[:, None] & lm[None, :])


@triton.jit
def fused_combine_kernel(part_ptr, w_ptr, out_ptr, NK, K: tl.constexpr, J: tl.constexpr, L: tl.constexpr,
                         BL: tl.constexpr):
    """out[n] = Σ_k w[n, k] Σ_j part[j, n·K + k] (fp32), rounded once to out's dtype."""
    n = tl.program_id(0).to(tl.int64)
    for l0 in range(0, L, BL):
        ln = l0 + tl.arange(0, BL)
        lm = ln < L
        acc = tl.zeros([BL], tl.float32)
        for k in tl.static_range(K):
            wk = tl.load(w_ptr + n * K + k).to(tl.float32)
            s = tl.zeros([BL], tl.float32)
            for jj in tl.static_range(J):
                s += tl.load(part_ptr + (jj * NK + n * K + k) * L + ln, mask=lm, other=0.0)
            acc += wk * s
        tl.store(out_ptr + n * L + ln, acc.to(out_ptr.dtype.element_ty), mask=lm)


def fused_experts(x, idx, w, w1, w2, w3, beta, linear_beta, cfg):
    """The experiment's two launches: out [N, L] in x's dtype."""
    N, L = x.shape
    E, I = w1.shape[0], w1.shape[1]
    K = idx.shape[1]
    NK = N * K
    BM = moe_tiles.tile_rows(NK, E)
    tiles = triton.cdiv(NK, BM) + min(E, NK)
    J = triton.cdiv(I, cfg["bi"])
    part = torch.empty(J, NK, L, dtype=torch.float32, device=x.device)
    out = torch.empty(N, L, dtype=x.dtype, device=x.device)
    up = x.device.type == "cpu"
    meta = dict(num_warps=cfg["warps"])
    if not up:
        meta["num_stages"] = cfg["stages"]
    fused_experts_kernel[(tiles, J)](
        x, idx.reshape(-1), w1, w3, w2, part, E, I, NK, x.stride(0), w1.stride(0), w1.stride(1), w3.stride(0),
        w3.stride(1), w2.stride(0), w2.stride(1), float(beta), float(linear_beta), K=K, L=L,
        EP=max(16, triton.next_power_of_2(E)), CH=min(256, max(16, triton.next_power_of_2(NK))), BM=BM,
        BI=cfg["bi"], BK=cfg["bk"], BN=cfg["bn"], UPCAST=up, **meta)
    fused_combine_kernel[(N,)](part, w, out, NK, K=K, J=J, L=L, BL=min(1024, triton.next_power_of_2(L)), num_warps=4)
    return out


def regs() -> None:
    """Each CUDA setting compiled for sm_90a without a GPU (`scripts/kda_regs.py`'s ptxas report)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from kda_regs import report
    types = {"x_ptr": "*bf16", "idx_ptr": "*i64", "w1_ptr": "*bf16", "w3_ptr": "*bf16", "w2_ptr": "*bf16",
             "part_ptr": "*fp32", "beta": "fp32", "linear_beta": "fp32"}
    for bi, bn, warps in itertools.product((64, 128), (64, 128), (4, 8)):
        consts = dict(K=4, L=768, EP=32, CH=256, BM=16, BI=bi, BK=64, BN=bn, UPCAST=False)
        print(f"BI {bi} BN {bn} warps {warps}: {report(fused_experts_kernel, types, consts, warps, num_stages=3)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="moe_fused.json")
    ap.add_argument("--regs", action="store_true", help="compile each setting for sm_90a (no GPU needed) and stop")
    a = ap.parse_args()
    if a.regs:
        return regs()
    dev = a.device
    cuda = dev == "cuda"
    E, I, L, K = (32, 512, 768, 4) if cuda else (6, 40, 24, 3)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(E, 2 * I, L, device=dev, generator=gen) * L ** -0.5).to(dtype)
    w2 = (torch.randn(E, L, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
    w1, w3 = w13[:, :I], w13[:, I:]
    moe_decode.MAX_ENTRIES = 0  # the tile kernels at every size here
    cfgs = [dict(bi=bi, bk=64, bn=bn, warps=wp, stages=st)
            for bi, bn, wp, st in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))] if cuda else \
        [dict(bi=16, bk=16, bn=16, warps=4, stages=None)]
    rows = []
    for N in ((16, 64, 256) if cuda else (5, 20)):
        x = torch.randn(N, L, device=dev, generator=gen).to(dtype)
        idx = torch.rand(N, E, device=dev, generator=gen).topk(K, dim=-1).indices
        w = torch.rand(N, K, device=dev, generator=gen)
        with torch.no_grad():
            ref = experts_forward(x, idx, w, w1, w2, w3, grouped=True if cuda else None)
            base = median_ms(graphed(lambda: experts_forward(x, idx, w, w1, w2, w3)), 20, 200) * 1e3 if cuda else None
            for cfg in cfgs:
                try:
                    y = fused_experts(x, idx, w, w1, w2, w3, 4.0, 25.0, cfg)
                    rel = ((y.float() - ref.float()).pow(2).mean() / ref.float().pow(2).mean()).sqrt().item()
                    us = median_ms(graphed(lambda cfg=cfg: fused_experts(x, idx, w, w1, w2, w3, 4.0, 25.0, cfg)),
                                   20, 200) * 1e3 if cuda else None
                except Exception as e:  # noqa: BLE001 (a setting that does not compile: reported)
                    rel, us = repr(e)[:100], float("inf")
                rows.append(dict(tokens=N, cfg=cfg, us=us, tiles_us=base, rel=rel))
        mine = [r for r in rows if r["tokens"] == N]
        best = sorted(mine, key=lambda r: r["us"] if r["us"] is not None else 0)[:4]
        print(f"tokens {N}: routed tile kernels {base} us; fused best " + "; ".join(
            f"{r['cfg']} {r['us']} (rel {r['rel']})" for r in best), flush=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
