"""Row-wise FP8 quantisation as one Triton kernel: `reference.quantize_rows_reference`'s result, bit for bit.

A program takes BR rows and walks their columns twice: the row maxima of |x| first, then x times the
power-of-two 1/s rounded to e4m3 (the second pass reads what the first left in L2). Any input strides: a
transposed view (a weight's columns, for the backward's dx GEMM) is read in place and written as rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import interpreted as _interpreted, pdl
from .._triton_jit import pdl_sync


def interpreted() -> bool:
    return _interpreted(quant_rows_kernel)


@triton.jit
def quant_rows_kernel(x_ptr, q_ptr, s_ptr, R, C, sxr, sxc, sqr, BR: tl.constexpr, BC: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Rows [pid·BR, pid·BR + BR) of x [R, C] (strides sxr, sxc) → q (row stride sqr, unit column stride) and s.
    The scale's exponent comes from amax's bits (`reference.pow2_scale`): exact, no log2 or division."""
    pdl_sync(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    amax = tl.zeros([BR], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols < C)[None, :]
        v = tl.load(x_ptr + r64[:, None] * sxr + cols.to(tl.int64)[None, :] * sxc, mask=m, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    se = e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    se = tl.minimum(tl.maximum(se, 1), 253)
    s = (se << 23).to(tl.float32, bitcast=True)
    inv = ((254 - se) << 23).to(tl.float32, bitcast=True)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols < C)[None, :]
        v = tl.load(x_ptr + r64[:, None] * sxr + cols.to(tl.int64)[None, :] * sxc, mask=m, other=0.0)
        q = (v.to(tl.float32) * inv[:, None]).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + r64[:, None] * sqr + cols[None, :], q, mask=m)
    tl.store(s_ptr + rows, s, mask=rmask)


def quantize_rows_triton(x: torch.Tensor, block_rows: int | None = None, block_cols: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference(x)` for x [R, C] fp32/bf16/fp16 on CUDA (or the interpreter), any strides."""
    R, C = x.shape
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(R, dtype=torch.float32, device=x.device)
    if R == 0:
        return q, s
    # a row-major input: few rows, wide column steps (coalesced along the row); a transposed one: 64 rows so a
    # tile's contiguous dimension (its rows) is 64 elements long
    row_major = x.stride(1) == 1 or C == 1
    br = block_rows or (4 if row_major else 64)
    bc = block_cols or (min(1024, triton.next_power_of_2(max(C, 16))) if row_major else 64)
    quant_rows_kernel[(triton.cdiv(R, br),)](x, q, s, R, C, x.stride(0), x.stride(1), q.stride(0), BR=br, BC=bc,
                                             num_warps=4, **pdl(x))
    return q, s
