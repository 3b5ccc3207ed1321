"""Triton row-wise cross-entropy over a chunk of logits: loss per row and, in place, its gradient.

Importing this module imports triton; `k3.ops.linear_ce.triton_available()` checks that lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import interpreted as _interpreted


@triton.jit
def ce_rows_kernel(x_ptr, tgt_ptr, loss_ptr, stride, V, ignore_index, BLOCK: tl.constexpr, GRAD: tl.constexpr):
    """Program r: row r of x [n, V] (bf16/fp16/fp32). Pass 1: per-lane online max / sum-exp in fp32 over V
    in BLOCK-wide steps -> lse, loss = lse - x[target] (0 when target == ignore_index). Pass 2 (GRAD):
    x <- exp(x - lse) - [j == target] in x's dtype, in place (0 on an ignored row). Pass 1 asks L2 to keep
    the row and pass 2 to let it go, so pass 2 re-reads more of it from L2 instead of HBM."""
    r = tl.program_id(0)
    base = x_ptr + r.to(tl.int64) * stride
    tgt = tl.load(tgt_ptr + r)
    valid = tgt != ignore_index
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1.0e30, tl.float32)  # finite: a lane that only sees masked -inf keeps s = 0, no NaN
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf"), eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    mx = tl.max(m, 0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
    safe = tl.where(valid, tgt, 0)
    xt = tl.load(base + safe).to(tl.float32)
    tl.store(loss_ptr + r, tl.where(valid, lse - xt, 0.0))
    if GRAD:
        for start in range(0, V, BLOCK):
            cols = start + offs
            cm = cols < V
            x = tl.load(base + cols, mask=cm, other=0.0, eviction_policy="evict_first").to(tl.float32)
            p = tl.exp(x - lse) - tl.where(cols == safe, 1.0, 0.0)
            p = tl.where(valid, p, 0.0)
            tl.store(base + cols, p.to(x_ptr.dtype.element_ty), mask=cm, eviction_policy="evict_first")


def interpreted() -> bool:
    """True when the kernel was bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(ce_rows_kernel)


def ce_rows_triton(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, grad: bool,
                   loss_out: torch.Tensor, block_v: int | None = None, num_warps: int | None = None) -> None:
    """`chunked.ce_rows_torch`'s contract with one Triton program per row: logits [n, V] bf16/fp16/fp32 with
    unit column stride, target int64 [n], loss_out fp32 [n] (written); with grad, logits becomes
    softmax - onehot IN PLACE. block_v / num_warps: launch settings (columns per step, warps per program).
    The L2 hints (see the kernel) took a 3,200 x 163,840 bf16 chunk from 0.987 to 0.915 ms on the H200
    (`benchmarks/probe/linear_ce_chunks.py`); 8,192 columns per step over 16 warps then took it from 0.910 to
    0.851 ms (3.46 -> 3.70 TB/s counted as 3 passes; H200, 2026-12-06, the best of six settings; another lane
    split, so another fp32 summation order)."""
    n, V = logits.shape
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32) or logits.stride(1) != 1:
        raise ValueError(f"ce_rows_triton: logits must be bf16/fp16/fp32 with unit column stride, got "
                         f"{logits.dtype} strides {logits.stride()}")
    if loss_out.dtype != torch.float32 or not loss_out.is_contiguous():
        raise ValueError(f"ce_rows_triton: loss_out must be contiguous fp32, got {loss_out.dtype}")
    if n == 0:
        return
    block = block_v or min(8192, triton.next_power_of_2(V))
    warps = num_warps or (16 if block >= 8192 else 8 if block >= 2048 else 4)
    ce_rows_kernel[(n,)](logits, target.contiguous(), loss_out, logits.stride(0), V, ignore_index,
                         BLOCK=block, GRAD=grad, num_warps=warps)
