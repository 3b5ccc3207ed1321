"""Row-wise FP8 quantisation as Triton kernels: `reference.quantize_rows_reference`'s result, bit for bit.

Any input strides: a transposed view (a weight's columns for the backward's dx GEMM, dy's and x's columns for an
FP8 dW) is read in place and written as rows. Two schedules:

- whole rows: a program takes BR rows and walks their columns twice, the row maxima of |x| first, then x times
  the power-of-two 1/s rounded to e4m3 (the second pass reads what the first left in L2). For inputs with many
  rows (activations [M, K], weights' rows).
- split rows: when there are too few row blocks to fill the GPU (a weight's 1,536 columns, dy's columns over
  32K tokens), each row block's columns are cut into ranges, one program per (rows, range): one kernel takes the
  partial maxima into an fp32 [R] buffer by atomic max (exact: max is order-free), a second scales and casts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import interpreted as _interpreted, pdl
from .._triton_jit import pdl_sync

FILL = 528  # programs wanted (4 per SM of an H100 / H200) before rows are split over column ranges


def interpreted() -> bool:
    return _interpreted(quant_rows_kernel)


@triton.jit
def _tile(x_ptr, r64, rmask, c0, C, sxr, sxc, BC: tl.constexpr):
    cols = c0 + tl.arange(0, BC)
    m = rmask[:, None] & (cols < C)[None, :]
    v = tl.load(x_ptr + r64[:, None] * sxr + cols.to(tl.int64)[None, :] * sxc, mask=m, other=0.0)
    return v.to(tl.float32), cols, m


@triton.jit
def _scale(amax):
    """(s, 1/s): the smallest power of two with amax / s <= 448, from amax's bits (`reference.pow2_scale`)."""
    bits = amax.to(tl.int32, bitcast=True)
    se = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    se = tl.minimum(tl.maximum(se, 1), 253)
    return (se << 23).to(tl.float32, bitcast=True), ((254 - se) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _range_amax(x_ptr, r64, rmask, lo, hi, sxr, sxc, amax, BC: tl.constexpr):
    """amax, raised to the rows' max |x| over columns [lo, hi) of x (strides sxr, sxc)."""
    for c0 in range(lo, hi, BC):
        v, cols, m = _tile(x_ptr, r64, rmask, c0, hi, sxr, sxc, BC)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    return amax


@triton.jit
def _range_cast(x_ptr, r64, rmask, lo, hi, sxr, sxc, q_ptr, sqr, inv, BC: tl.constexpr):
    """q[r, c] = e4m3(x[r, c] · inv[r]) for columns [lo, hi) (q: row stride sqr, unit column stride)."""
    for c0 in range(lo, hi, BC):
        v, cols, m = _tile(x_ptr, r64, rmask, c0, hi, sxr, sxc, BC)
        tl.store(q_ptr + r64[:, None] * sqr + cols[None, :], (v * inv[:, None]).to(q_ptr.dtype.element_ty), mask=m)


@triton.jit
def quant_rows_kernel(x_ptr, q_ptr, s_ptr, amax_ptr, R, C, sxr, sxc, sqr, CPP,
                      BR: tl.constexpr, BC: tl.constexpr, PHASE: tl.constexpr, PDL: tl.constexpr = False):
    """x [R, C] (strides sxr, sxc) → q (row stride sqr, unit column stride) and s, for rows
    [pid0·BR, pid0·BR + BR) and columns [pid1·CPP, pid1·CPP + CPP). PHASE 0: whole rows (CPP = C) in one
    program; 1: atomic max of the range's |x| into amax; 2: scale and cast the range with amax (the first
    range's program stores s)."""
    pdl_sync(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    lo = tl.program_id(1) * CPP
    hi = tl.minimum(lo + CPP, C)
    if PHASE != 2:
        amax = _range_amax(x_ptr, r64, rmask, lo, hi, sxr, sxc, tl.zeros([BR], dtype=tl.float32), BC)
        if PHASE == 1:
            tl.atomic_max(amax_ptr + rows, amax, mask=rmask)
    if PHASE != 1:
        if PHASE == 2:
            amax = tl.load(amax_ptr + rows, mask=rmask, other=0.0)
        s, inv = _scale(amax)
        _range_cast(x_ptr, r64, rmask, lo, hi, sxr, sxc, q_ptr, sqr, inv, BC)
        if tl.program_id(1) == 0:
            tl.store(s_ptr + rows, s, mask=rmask)


def quantize_rows_triton(x: torch.Tensor, block_rows: int | None = None, block_cols: int | None = None,
                         split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference(x)` for x [R, C] fp32/bf16/fp16 on CUDA (or the interpreter), any strides.
    split: column ranges per row block (None: enough to fill the GPU when the row blocks do not; 1: whole rows)."""
    R, C = x.shape
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(R, dtype=torch.float32, device=x.device)
    if R == 0 or C == 0:
        s.fill_(2.0 ** -126)  # the reference's scale of an all-zero (here empty) row
        return q, s
    # a row-major input: few rows, wide column steps (coalesced along the row); a transposed one: 64 rows so a
    # tile's contiguous dimension (its rows) is 64 elements long
    row_major = x.stride(1) == 1 or C == 1
    br = block_rows or (4 if row_major else 64)
    bc = block_cols or (min(1024, triton.next_power_of_2(max(C, 16))) if row_major else 64)
    blocks = triton.cdiv(R, br)
    steps = triton.cdiv(C, bc)
    n = split or max(1, min(steps, FILL // blocks))
    cpp = triton.cdiv(steps, n) * bc  # columns per program, a multiple of bc
    n = triton.cdiv(C, cpp)
    args = (x, q, s, s, R, C, x.stride(0), x.stride(1), q.stride(0), cpp)  # amax_ptr: unread in whole rows
    kw = dict(BR=br, BC=bc, num_warps=4, **pdl(x))
    if n == 1:
        quant_rows_kernel[(blocks, 1)](*args, PHASE=0, **kw)
        return q, s
    amax = torch.zeros(R, dtype=torch.float32, device=x.device)
    args = args[:3] + (amax,) + args[4:]
    quant_rows_kernel[(blocks, n)](*args, PHASE=1, **kw)
    quant_rows_kernel[(blocks, n)](*args, PHASE=2, **kw)
    return q, s


@triton.jit
def quant_pieces_kernel(q_ptr, s_ptr, R, sqr, p0, s0, n0, o0, p1, s1, n1, o1, p2, s2, n2, o2, p3, s3, n3, o3,
                        NP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
    """Rows [pid·BR, pid·BR + BR) of up to four row-major pieces side by side (piece i: pointer p_i, row stride s_i,
    n_i columns, written at column o_i of q): one scale per row over all of them, each piece read twice (the
    second time from L2), no joined copy in memory."""
    pdl_sync(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    amax = _range_amax(p0, r64, rmask, 0, n0, s0, 1, tl.zeros([BR], dtype=tl.float32), BC)
    if NP > 1:
        amax = _range_amax(p1, r64, rmask, 0, n1, s1, 1, amax, BC)
    if NP > 2:
        amax = _range_amax(p2, r64, rmask, 0, n2, s2, 1, amax, BC)
    if NP > 3:
        amax = _range_amax(p3, r64, rmask, 0, n3, s3, 1, amax, BC)
    s, inv = _scale(amax)
    _range_cast(p0, r64, rmask, 0, n0, s0, 1, q_ptr + o0, sqr, inv, BC)
    if NP > 1:
        _range_cast(p1, r64, rmask, 0, n1, s1, 1, q_ptr + o1, sqr, inv, BC)
    if NP > 2:
        _range_cast(p2, r64, rmask, 0, n2, s2, 1, q_ptr + o2, sqr, inv, BC)
    if NP > 3:
        _range_cast(p3, r64, rmask, 0, n3, s3, 1, q_ptr + o3, sqr, inv, BC)
    tl.store(s_ptr + rows, s, mask=rmask)


MAX_PIECES = 4


def quantize_pieces_triton(pieces: list[torch.Tensor], offsets: list[int], width: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, width] e4m3 with piece i (a row-major [R, n_i] tensor) at columns offsets[i], one row scale over all
    pieces, other columns zero; s [R]. At most MAX_PIECES pieces; equals quantising their joined copy."""
    R = pieces[0].shape[0]
    q = torch.empty(R, width, dtype=torch.float8_e4m3fn, device=pieces[0].device)
    s = torch.empty(R, dtype=torch.float32, device=q.device)
    edge = 0  # columns no piece writes (an unused piece, the padding): zeros
    for o, n in sorted((o, p.shape[1]) for p, o in zip(pieces, offsets)) + [(width, 0)]:
        if o > edge:
            q.view(torch.uint8)[:, edge:o].zero_()
        edge = max(edge, o + n)
    if R == 0:
        return q, s
    args = []
    for i in range(MAX_PIECES):
        p, o = (pieces[i], offsets[i]) if i < len(pieces) else (pieces[0], 0)
        args += [p, p.stride(0), p.shape[1], o]
    widest = max(p.shape[1] for p in pieces)
    bc = min(1024, triton.next_power_of_2(max(widest, 16)))
    quant_pieces_kernel[(triton.cdiv(R, 4),)](q, s, R, q.stride(0), *args, NP=len(pieces), BR=4, BC=bc,
                                              num_warps=4, **pdl(q))
    return q, s
