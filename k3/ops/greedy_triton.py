"""Greedy picks of a decode step's rows as two Triton kernels: token = argmax(logits), log p(token) under
log_softmax(logits), and whether the row is not finite — what `k3.ops.sampling.greedy_pick` computes with
≈ 10 PyTorch kernels (amax, isfinite, argmax, gather, logsumexp's passes, two `where`), each reading the
[n, V] fp32 logits again (163,840 columns in K3).

1. `greedy_part_kernel`, program (row, vocabulary split of SPLIT columns): the split's max, its first argmax,
   Σ exp(x − max) and a flag for a NaN / +inf entry, in one pass over blocks of BLOCK columns;
2. `greedy_combine_kernel`, program row: the splits merged in order (the first maximal index wins, as in
   `torch.argmax`), log p = −log Σ exp(x − max) (the token's logit is the max), and the non-finite rows (NaN,
   +inf, or all −inf) as token −1, log p NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreted as _interpreted, pdl
from ._triton_jit import pdl_sync
from .sampling import check_outputs

SPLIT, BLOCK = 8192, 2048  # columns per program of the first kernel, per load (a 163,840-wide row: 20 programs)


@triton.jit
def greedy_part_kernel(x_ptr, m_ptr, i_ptr, s_ptr, f_ptr, V, sx, NS, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_sync(PDL)
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max, its first column, Σ exp(x − m)
    idx = tl.zeros([BLOCK], tl.int32)
    s = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    for c0 in range(sp * SPLIT, tl.minimum(sp * SPLIT + SPLIT, V), BLOCK):
        col = c0 + c
        x = tl.load(x_ptr + r * sx + col, mask=col < V, other=float("-inf")).to(tl.float32)
        bad = bad | ((x != x) | (x == float("inf"))).to(tl.int32)
        up = x > m  # strictly: a lane keeps its first maximal column
        m_new = tl.where(up, x, m)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        idx = tl.where(up, col, idx)
        m = m_new
    mx = tl.max(m, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    first = tl.min(tl.where(m == mx, idx, 2147483647), 0)
    o = r * NS + sp
    tl.store(m_ptr + o, mx)
    tl.store(i_ptr + o, first)
    tl.store(s_ptr + o, tl.sum(s * tl.exp(m - mx_safe), 0))
    tl.store(f_ptr + o, tl.max(bad, 0))


@triton.jit
def greedy_combine_kernel(m_ptr, i_ptr, s_ptr, f_ptr, tok_ptr, lp_ptr, rows_ptr, last_ptr, n, NS, BS: tl.constexpr,
                          ROWS: tl.constexpr = False, LAST: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_sync(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BS)
    jm = j < NS
    m = tl.load(m_ptr + r * NS + j, mask=jm, other=float("-inf"))
    idx = tl.load(i_ptr + r * NS + j, mask=jm, other=2147483647)
    s = tl.load(s_ptr + r * NS + j, mask=jm, other=0.0)
    bad = tl.max(tl.load(f_ptr + r * NS + j, mask=jm, other=0), 0)
    mx = tl.max(m, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    tok = tl.min(tl.where(m == mx, idx, 2147483647), 0)  # splits are in column order: the first maximal one
    total = tl.sum(s * tl.exp(m - mx_safe), 0)
    bad = (bad > 0) | (mx == float("-inf"))
    tok = tl.where(bad, -1, tok).to(tl.int64)
    lp = tl.where(bad, float("nan"), -tl.log(total))
    tl.store(tok_ptr + r, tok)
    tl.store(lp_ptr + r, lp)
    if ROWS:  # the engine's read-back rows [2, n] fp64: ids (exact below 2^53), log p
        tl.store(rows_ptr + r, tok.to(tl.float64))
        tl.store(rows_ptr + n + r, lp.to(tl.float64))
    if LAST:  # the next forward's device-fed ids: a failed row's -1 as 0 (a valid index; the host drops the row)
        tl.store(last_ptr + r, tl.maximum(tok, 0))


def interpreted() -> bool:
    return _interpreted(greedy_part_kernel)


def greedy_pick_triton(logits: torch.Tensor, split: int = SPLIT, block: int = BLOCK, rows: torch.Tensor | None = None,
                       last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] (unit column stride) → (token ids [n] int64, −1 for a non-finite row; log p(token) [n]
    fp32, NaN there). split / block: columns per first-kernel program / per load (powers of two, block ≤ split;
    tests use small ones). `rows` / `last`: as `k3.ops.sampling.greedy_pick`'s, written by the second kernel."""
    n, V = logits.shape
    check_outputs(n, logits.device, rows, last)
    if split & (split - 1) or block & (block - 1) or block > split:
        raise ValueError(f"greedy_pick: split={split} and block={block} must be powers of two with block <= split")
    tok = torch.empty(n, dtype=torch.int64, device=logits.device)
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return tok, lp
    if V >= 2 ** 31:
        raise ValueError(f"greedy_pick: {V} columns do not fit the kernels' int32 indices")
    ns = triton.cdiv(V, split)
    m, s = torch.empty(2, n, ns, dtype=torch.float32, device=logits.device).unbind(0)
    i, f = torch.empty(2, n, ns, dtype=torch.int32, device=logits.device).unbind(0)
    greedy_part_kernel[(n, ns)](logits, m, i, s, f, V, logits.stride(0), ns, SPLIT=split, BLOCK=block,
                                num_warps=8 if block >= 2048 else 4, **pdl(lp))
    greedy_combine_kernel[(n,)](m, i, s, f, tok, lp, tok if rows is None else rows, tok if last is None else last, n,
                                ns, BS=max(16, triton.next_power_of_2(ns)), ROWS=rows is not None,
                                LAST=last is not None, num_warps=1, **pdl(lp))
    return tok, lp
