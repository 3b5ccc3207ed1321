"""The GEMV kernel behind `k3.ops.gemv.linear`: y = x W^T (+ add) for up to 64 rows of x, optionally with a
prologue on x as it is loaded: SiTU-GLU of a gate ‖ up input, an RMSNorm (of the row or per head), a gate σ(g).

Each program owns `BN` rows of W [N, K] (row-major, K contiguous) and streams them through in `CH`-column
chunks (loads pipelined over `stages`), multiplying by the x rows padded to one MMA tile of 16, 32 or 64 rows
(`tile_rows`) on the tensor cores with fp32 accumulation: every weight byte is read once, whatever the rows; an
optional `add` [M, N] joins in fp32 and the output is rounded once to its dtype (fp32 logits straight from the
head, bf16 activations elsewhere).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._triton import interpreted as _interpreted, pdl
from .._triton_jit import pdl_sync
from ..moe_block_triton import dot_rows
from ..situ.triton import situ_glu_value

# (BN, CH, warps, stages) by output width, from `benchmarks/probe/gemv.py` on the H200 (2026-12-03): 16 rows per
# program for the narrow projections (many programs), 64 for the wide ones and the head
LAUNCH = ((4096, (16, 512, 4, 3)), (65536, (64, 128, 4, 4)), (1 << 62, (64, 256, 4, 3)))
# for tiles of 32 or 64 rows (a prefix hit's tail, a decode batch of 17-64): narrower chunks, so that the x tile
# and the weight chunk of each pipelining stage fit the shared memory; `benchmarks/probe/gemv.py --rows 32 64` (H200,
# 2026-12-03): within 6 % of the best of 7 settings on the shapes `linear` gives these tiles
LAUNCH_WIDE = ((65536, (32, 128, 4, 3)), (1 << 62, (64, 128, 4, 3)))
MAX_TILE_ROWS = 64
# The one-row form (`gemv_row_kernel`; ROW, K3_GEMV_ROW=0 turns it off, read at each call): one row of x without
# a prologue, BN rows of W per program summed on the CUDA cores, the input width a constexpr so that the chunk loop
# unrolls and every load is issued at once -- the MoE block's phases' form, whose kernels cost 2.2 µs each besides
# their reads against ≈ 3 µs for these MMA GEMVs (`probe/moe_block.py`, `probe/gemv.py`, H100, sessions 32-34). Its
# 4-row tiles give 4x the programs of the 16-row MMA tiles (a 512-row projection: 128 programs on 132 SMs, not 32).
# As one switch for every output up to 16,384 wide it made the H200's batch-1 graph step slower (1.139 against 1.121
# ms, `probe/decode_profile.py`, 2026-12-06): the joined KDA input projection lost. `row_launch` now takes it only
# where `probe/gemv.py` (H200, the same day, best row setting per k3-small decode shape) found it faster than the MMA
# default: up to 768 outputs 2 rows and 2 warps (q_a, kv_a, the latent down: 2.46-2.83 against 3.51-3.71 µs); up to
# ROW_MAX_N outputs 8 rows where the input is at most 768 wide (q_b, the latent up: 2.29 / 2.66 against 3.18 / 3.34),
# else 4 rows (o_proj / g_proj, the shared experts: 2.61-3.88 against 3.46-4.59). Wider outputs (the joined KDA
# input, the dense gate_up, the head) and inputs outside ROW_K (f_b's 128, the dense down's 6,144) keep the MMA form.
# On: with this rule the batch-1 step's GPU time fell 1.210 / 1.214 -> 1.196 / 1.197 ms and its graph step 1.232 /
# 1.217 -> 1.211 / 1.214 ms in two interleaved pairs (`probe/decode_profile.py --batch 1`, H100, session 38).
ROW = os.environ.get("K3_GEMV_ROW", "1") == "1"
ROW_MAX_N, ROW_K = 4096, (256, 2048)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, a_ptr, g_ptr, nw_ptr, M, N, K, sx, sw, sy, sa, sg, eps, beta, linear_beta,
                BN: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr, HAS_ADD: tl.constexpr,
                HAS_GATE: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, MR: tl.constexpr = 16,
                GS: tl.constexpr = 16, BM: tl.constexpr = 16,
                t_ptr=None, st=0, NT: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Program p: output columns [p·BN, (p+1)·BN) of M ≤ BM rows (the MMA tile). The input x is, as each chunk is
    loaded:
    GLU: SiTU-GLU(x[:, c], x[:, K + c]) of a [M, 2K] gate ‖ up (rounded to x's dtype, as the SiTU kernel's
    output); NORM 1: an RMSNorm of the row with weight nw (x ⊙ nw enters the product, the row's rstd scales the
    accumulator: the norm is linear in the product); NORM 2: an RMSNorm of each GS-column group (a head; a chunk
    holds CH // GS of them) with weight nw [GS], in fp32, rounded once; HAS_GATE: ⊙ σ(gate) (after the norm).
    HAS_ADD: + add [M, N].
    NT > 0: output columns N − NT … N − 1 go to t_ptr [M, NT] in fp32, unrounded (the router's logits joined to
    the projections of the same input), the others to y [M, N − NT]."""
    pdl_sync(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = rows < N
    m = tl.arange(0, BM)
    mm = m < M
    # the prologue's tile: MR = 1 for one row with a norm / SiTU-GLU prologue (a batch-1 decode), so its math is
    # not done 16 times over the padding rows of the MMA tile (the 16-row form made the batch-1 step 2.24 ms
    # against 1.62 with separate kernels; this one matches them, `k3.ops.gemv.PROLOGUE`)
    mr = tl.arange(0, MR)
    mrm = mr < M
    acc = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([MR], tl.float32)
    r64 = rows[:, None].to(tl.int64)
    dt = x_ptr.dtype.element_ty
    for c0 in range(0, K, CH):
        cols = c0 + tl.arange(0, CH)
        cm = cols < K
        xm = mrm[:, None] & cm[None, :]
        if GLU:
            gx = tl.load(x_ptr + mr[:, None] * sx + cols[None, :], mask=xm, other=0.0).to(tl.float32)
            ux = tl.load(x_ptr + mr[:, None] * sx + K + cols[None, :], mask=xm, other=0.0).to(tl.float32)
            x = situ_glu_value(gx, ux, beta, linear_beta).to(dt)
        else:
            x = tl.load(x_ptr + mr[:, None] * sx + cols[None, :], mask=xm, other=0.0)
        if NORM == 1:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            x = (xf * tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]).to(dt)
        if NORM == 2:  # the chunk holds CH // GS whole groups (heads): each normalised on its own
            xg = tl.reshape(x.to(tl.float32), [MR * (CH // GS), GS])
            rs = 1.0 / tl.sqrt(tl.sum(xg * xg, 1) / GS + eps)
            xg = xg * rs[:, None] * tl.load(nw_ptr + tl.arange(0, GS)).to(tl.float32)[None, :]
            xf = tl.reshape(xg, [MR, CH])
            if HAS_GATE:
                g = tl.load(g_ptr + mr[:, None] * sg + cols[None, :], mask=xm, other=0.0).to(tl.float32)
                xf = xf * tl.sigmoid(g)
            x = xf.to(dt)
        elif HAS_GATE:
            g = tl.load(g_ptr + mr[:, None] * sg + cols[None, :], mask=xm, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * tl.sigmoid(g)).to(dt)
        if MR == 1:  # row 0 of the MMA tile
            x = tl.where(m[:, None] == 0, x, tl.zeros([BM, CH], dt))
        wm = rm[:, None] & cm[None, :]
        w = tl.load(w_ptr + r64 * sw + cols[None, :], mask=wm, other=0.0)
        if IEEE:  # fp32 inputs, or the CPU interpreter (whose dot mishandles half types): exact fp32 products
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if NORM == 1:
        rs = 1.0 / tl.sqrt(ss / K + eps)
        if MR == 1:
            acc = acc * tl.sum(rs, 0)
        else:
            acc = acc * rs[:, None]
    om = mm[:, None] & rm[None, :]
    if HAS_ADD:
        acc += tl.load(a_ptr + m[:, None] * sa + rows[None, :], mask=om, other=0.0).to(tl.float32)
    if NT > 0:
        tail = rows >= N - NT
        tl.store(t_ptr + m[:, None] * st + (rows - (N - NT))[None, :], acc, mask=om & tail[None, :])
        om = om & (rows < N - NT)[None, :]
    tl.store(y_ptr + m[:, None] * sy + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=om)


@triton.jit
def gemv_row_kernel(x_ptr, w_ptr, y_ptr, a_ptr, t_ptr, N, sw, K: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
                    HAS_ADD: tl.constexpr, NT: tl.constexpr = 0, PDL: tl.constexpr = False):
    """One row: program p writes outputs [p·BN, (p+1)·BN) = W[rows] · x (+ add) in fp32, summed over K in CH-column
    chunks on the CUDA cores (exact fp32 products); NT > 0: outputs N − NT … N − 1 to t_ptr in fp32, unrounded, the
    others rounded to y's dtype (as `gemv_kernel`)."""
    pdl_sync(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = rows < N
    # x read as a [BN, CH] tile in W's layout (X2D), not a [CH] vector broadcast through shared memory behind a
    # barrier per chunk that waits for x's load and so serialises the chunks' weight loads
    acc = dot_rows(w_ptr, rows, N, sw, x_ptr, K, CH, X2D=True)
    if HAS_ADD:
        acc += tl.load(a_ptr + rows, mask=rm, other=0.0).to(tl.float32)
    if NT > 0:
        tl.store(t_ptr + (rows - (N - NT)), acc, mask=rm & (rows >= N - NT))
        rm = rm & (rows < N - NT)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rm)


def row_launch(n: int, k: int) -> tuple[int, int, int] | None:
    """(BN, CH, warps) of the one-row form for n outputs of a k-wide input (see `ROW`), or None where the MMA form
    stays."""
    if n > ROW_MAX_N or not ROW_K[0] <= k <= ROW_K[1]:
        return None
    if n <= 768:
        return (2, 256, 2)
    return (8, 256, 4) if k <= 768 else (4, 256, 4)


def interpreted() -> bool:
    """True when the kernel was bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(gemv_kernel)


def tile_rows(m: int) -> int:
    """The MMA tile's rows for m rows of x: 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def launch(n: int, k: int | None = None, rows: int = 16) -> tuple[int, int, int, int]:
    """(BN, CH, warps, stages) for an output width n (and input width k: a chunk no wider than k needs) and an
    MMA tile of `rows` rows."""
    bn, ch, warps, stages = next(c for limit, c in (LAUNCH if rows <= 16 else LAUNCH_WIDE) if n <= limit)
    return bn, ch if k is None else min(ch, max(16, triton.next_power_of_2(k))), warps, stages


def gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, add: torch.Tensor | None = None,
         gate: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None,
         norm: tuple | None = None, glu: tuple[float, float] | None = None, fp32_tail: int = 0,
         row: tuple[int, int, int] | None = None):
    """x [..., K] (≤ 64 rows), w [N, K] (unit column stride) → prologue(x) w^T (+ add) [..., N] in `out_dtype`
    (x's dtype by default), fp32 accumulation. Prologue (see `k3.ops.gemv.linear`): glu (β, linear β) with x
    [..., 2K]; norm (weight, eps, group or None); gate. `config`: (BN, CH, warps, stages), else `launch(N, K)`
    (a grouped norm: whole groups per chunk). fp32_tail = t > 0: returns (y [..., N − t], tail [..., t] fp32),
    the last t output columns unrounded (no add then). One row without a prologue takes `gemv_row_kernel` with
    `ROW` on (launch `row_launch(N, K)`) or when `row` (BN, CH, warps) is given."""
    N, K = w.shape
    width = 2 * K if glu is not None else K
    if x.shape[-1] != width:
        raise ValueError(f"gemv: x has {x.shape[-1]} columns, w {tuple(w.shape)} expects {width}"
                         f"{' (gate ‖ up)' if glu is not None else ''}")
    x2 = x.reshape(-1, width)
    M = x2.shape[0]
    if M > MAX_TILE_ROWS:
        raise ValueError(f"gemv: {M} rows; the kernel takes at most {MAX_TILE_ROWS}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if fp32_tail and (add is not None or not 0 < fp32_tail < N):
        raise ValueError(f"gemv: fp32_tail={fp32_tail} needs 0 < tail < N = {N} and no add")
    y = torch.empty(M, N - fp32_tail, dtype=out_dtype or x.dtype, device=x.device)
    t = torch.empty(M, fp32_tail, dtype=torch.float32, device=x.device) if fp32_tail else y
    a = _rows(add, M, N, "add", y)
    g = _rows(gate, M, K, "gate", x2)
    nw, eps, group = norm if norm is not None else (None, 0.0, None)
    if norm is not None:
        if nw.shape != ((group,) if group else (K,)):
            raise ValueError(f"gemv: norm weight has shape {tuple(nw.shape)}, expected ({group or K},)")
        if group and (K % group or group & (group - 1) or group < 16):
            raise ValueError(f"gemv: norm groups of {group} columns must be a power of two ≥ 16 dividing K = {K}")
    beta, linear_beta = glu if glu is not None else (0.0, 0.0)
    plain_row = M == 1 and norm is None and glu is None and gate is None and config is None
    if row is not None and not plain_row:
        raise ValueError(f"gemv: the one-row form takes one row without a prologue or config, got {M} rows"
                         f"{', a prologue' if norm is not None or glu is not None or gate is not None else ''}")
    row = row or (row_launch(N, K) if ROW and plain_row else None)
    if row is not None and N:
        bn, ch, warps = row
        gemv_row_kernel[(triton.cdiv(N, bn),)](
            x2, w, y, a, t, N, w.stride(0), K=K, BN=bn, CH=min(ch, triton.next_power_of_2(K)),
            HAS_ADD=add is not None, NT=fp32_tail, num_warps=warps, **pdl(x2))
    elif M and N:
        BM = tile_rows(M)
        bn, ch, warps, stages = config or launch(N, K, BM)
        if group:  # whole groups per chunk (a chunk of one 128-column head took 2.8x as long: 12 serial chunks)
            ch = max(ch, group)
        gemv_kernel[(triton.cdiv(N, bn),)](
            x2, w, y, a, g, x2 if nw is None else nw.contiguous(), M, N, K, x2.stride(0), w.stride(0), y.stride(0),
            a.stride(0), g.stride(0), float(eps), float(beta), float(linear_beta), BN=bn, CH=ch,
            IEEE=x.dtype == torch.float32 or not x.is_cuda, HAS_ADD=add is not None, HAS_GATE=gate is not None,
            NORM=0 if norm is None else (2 if group else 1), GLU=glu is not None,
            MR=1 if M == 1 and (norm is not None or glu is not None) else BM, BM=BM, GS=group or 16, t_ptr=t,
            NT=fp32_tail, st=t.stride(0), num_warps=warps, num_stages=stages, **pdl(x2))
    if fp32_tail:
        return y.view(*x.shape[:-1], N - fp32_tail), t.view(*x.shape[:-1], fp32_tail)
    return y.view(*x.shape[:-1], N)


def _rows(t: torch.Tensor | None, M: int, width: int, name: str, default: torch.Tensor) -> torch.Tensor:
    """An optional [..., width] operand as M rows with unit column stride (`default` when absent)."""
    if t is None:
        return default
    if t.numel() != M * width:
        raise ValueError(f"gemv: {name} has shape {tuple(t.shape)}, expected {M} x {width} values")
    t = t.reshape(M, width)
    return t if t.stride(-1) == 1 else t.contiguous()
