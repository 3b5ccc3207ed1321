"""Triton kernels of the MoE token permutation: the expand (dispatch) and weighted-reduce (combine) steps
between token order [N, …] and expert-sorted entry order [N·K, …], addressed by pos [N, K] (entry k of
token n sits at row pos[n, k] of the sorted layout; pos is a permutation of 0..N·K−1).

    gather_sum:  out[n] = Σ_k w[n,k]·src[pos[n,k]]        (combine forward; dispatch backward with w = 1)
    scatter:     dst[pos[n,k]] = w[n,k]·src[n]           (dispatch forward with w = 1; combine backward)
                 dw[n,k] = Σ_l src[n,l]·other[pos[n,k],l]  (combine backward: the routing-weight gradient)

One program per token, fp32 accumulation, stores in the destination's dtype; every row is written exactly
once (no atomics: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import interpreted as _interpreted


@triton.jit
def moe_gather_sum_kernel(src_ptr, pos_ptr, w_ptr, out_ptr, L, K, s_src, s_out,
                          BK: tl.constexpr, BL: tl.constexpr, HAS_W: tl.constexpr, HAS_POS: tl.constexpr = True):
    n = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BK)
    km = ks < K
    if HAS_POS:
        p = tl.load(pos_ptr + n * K + ks, mask=km, other=0).to(tl.int64)
    else:  # src in entry order: row n·K + k
        p = n * K + ks
    if HAS_W:
        w = tl.load(w_ptr + n * K + ks, mask=km, other=0.0).to(tl.float32)
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        cm = cols < L
        x = tl.load(src_ptr + p[:, None] * s_src + cols[None, :], mask=km[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        if HAS_W:
            x = x * w[:, None]
        tl.store(out_ptr + n * s_out + cols, tl.sum(x, 0).to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def moe_scatter_kernel(src_ptr, pos_ptr, w_ptr, dst_ptr, other_ptr, dw_ptr, L, K, s_src, s_dst, s_other,
                       BK: tl.constexpr, BL: tl.constexpr, HAS_W: tl.constexpr, HAS_DW: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BK)
    km = ks < K
    p = tl.load(pos_ptr + n * K + ks, mask=km, other=0).to(tl.int64)
    if HAS_W:
        w = tl.load(w_ptr + n * K + ks, mask=km, other=0.0).to(tl.float32)
    acc = tl.zeros([BK], dtype=tl.float32)
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        cm = cols < L
        m = km[:, None] & cm[None, :]
        x = tl.load(src_ptr + n * s_src + cols, mask=cm, other=0.0).to(tl.float32)
        if HAS_W:
            y = w[:, None] * x[None, :]
        else:
            y = tl.broadcast_to(x[None, :], (BK, BL))
        tl.store(dst_ptr + p[:, None] * s_dst + cols[None, :], y.to(dst_ptr.dtype.element_ty), mask=m)
        if HAS_DW:
            o = tl.load(other_ptr + p[:, None] * s_other + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(o * x[None, :], 1)
    if HAS_DW:
        tl.store(dw_ptr + n * K + ks, acc.to(dw_ptr.dtype.element_ty), mask=km)


def _blocks(K: int, L: int) -> tuple[int, int]:
    bk = triton.next_power_of_2(max(K, 1))
    return bk, max(16, min(triton.next_power_of_2(max(L, 1)), 4096 // bk))


def _unit_cols(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gather_sum(src: torch.Tensor, pos: torch.Tensor | None, w: torch.Tensor | None) -> torch.Tensor:
    """src [M, L], pos [N, K], w [N, K] or None → out [N, L] in src's dtype, out[n] = Σ_k w[n,k]·src[pos[n,k]]
    (fp32 sums). pos None: src in entry order, pos[n, k] = n·K + k (then w gives N and K)."""
    N, K = (pos if pos is not None else w).shape
    L = src.shape[1]
    src = _unit_cols(src)
    out = torch.empty(N, L, dtype=src.dtype, device=src.device)
    if N and L:
        BK, BL = _blocks(K, L)
        moe_gather_sum_kernel[(N,)](src, src if pos is None else pos.contiguous(), src if w is None else w.contiguous(),
                                    out, L, K, src.stride(0), out.stride(0), BK=BK, BL=BL, HAS_W=w is not None,
                                    HAS_POS=pos is not None, num_warps=4)
    return out


def scatter(src: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None, other: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """src [N, L] → (dst [N·K, L] in src's dtype with dst[pos[n,k]] = w[n,k]·src[n], and with `other`
    [N·K, L] dw [N, K] in w's dtype, dw[n,k] = Σ_l src[n,l]·other[pos[n,k],l]; else None)."""
    N, K = pos.shape
    L = src.shape[1]
    src = _unit_cols(src)
    dst = torch.empty(N * K, L, dtype=src.dtype, device=src.device)
    dw = None
    if other is not None:
        other = _unit_cols(other)
        dw = torch.zeros(N, K, dtype=w.dtype, device=src.device)
    if N and L:
        BK, BL = _blocks(K, L)
        moe_scatter_kernel[(N,)](src, pos.contiguous(), src if w is None else w.contiguous(), dst,
                                 src if other is None else other, src if dw is None else dw, L, K,
                                 src.stride(0), dst.stride(0), 0 if other is None else other.stride(0),
                                 BK=BK, BL=BL, HAS_W=w is not None, HAS_DW=other is not None, num_warps=4)
    return dst, dw


@triton.jit
def expert_sort_kernel(idx_ptr, pos_ptr, ends_ptr, src_ptr, NK, E, EP: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_SRC: tl.constexpr = False):
    """One program: a stable counting sort of NK expert ids. Pass 1 counts each expert; pass 2 gives entry j
    the row start[e] + (entries of e before j), the in-block rank from a cumulative sum over a one-hot tile.
    HAS_SRC: also src[row] = j (each sorted row's entry)."""
    ee = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    for s in range(0, NK, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        e = tl.load(idx_ptr + offs, mask=offs < NK, other=-1)
        counts += tl.sum((e[:, None] == ee[None, :]).to(tl.int32), 0)
    ends = tl.cumsum(counts, 0)
    tl.store(ends_ptr + ee, ends.to(ends_ptr.dtype.element_ty), mask=ee < E)
    run = ends - counts
    for s in range(0, NK, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < NK
        e = tl.load(idx_ptr + offs, mask=m, other=-1)
        oh = (e[:, None] == ee[None, :]).to(tl.int32)
        rank = tl.cumsum(oh, 0) - oh + run[None, :]
        row = tl.sum(oh * rank, 1)
        tl.store(pos_ptr + offs, row.to(tl.int64), mask=m)
        if HAS_SRC:
            tl.store(src_ptr + row, offs.to(tl.int64), mask=m)
        run += tl.sum(oh, 0)


@triton.jit
def expert_count_kernel(idx_ptr, counts_ptr, NK, EP: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: how many of entries [b·BLOCK, (b+1)·BLOCK) go to each expert → counts[b, :EP]."""
    b = tl.program_id(0)
    ee = tl.arange(0, EP)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(idx_ptr + offs, mask=offs < NK, other=-1)
    tl.store(counts_ptr + b * EP + ee, tl.sum((e[:, None] == ee[None, :]).to(tl.int32), 0))


@triton.jit
def expert_rank_kernel(idx_ptr, counts_ptr, pos_ptr, ends_ptr, src_ptr, NK, E, NB, EP: tl.constexpr,
                       BLOCK: tl.constexpr, RB: tl.constexpr, HAS_SRC: tl.constexpr = False):
    """Program b: the rows of block b's entries, start[e] + (entries of e in earlier blocks) + (in-block rank),
    from every block's counts (`expert_count_kernel`); program 0 also writes ends (HAS_SRC: and src, as
    `expert_sort_kernel`)."""
    b = tl.program_id(0)
    ee = tl.arange(0, EP)
    total = tl.zeros([EP], tl.int32)
    before = tl.zeros([EP], tl.int32)
    for r0 in range(0, NB, RB):
        rr = r0 + tl.arange(0, RB)
        c = tl.load(counts_ptr + rr[:, None] * EP + ee[None, :], mask=(rr < NB)[:, None], other=0)
        total += tl.sum(c, 0)
        before += tl.sum(tl.where((rr < b)[:, None], c, 0), 0)
    ends = tl.cumsum(total, 0)
    if b == 0:
        tl.store(ends_ptr + ee, ends.to(ends_ptr.dtype.element_ty), mask=ee < E)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    m = offs < NK
    e = tl.load(idx_ptr + offs, mask=m, other=-1)
    oh = (e[:, None] == ee[None, :]).to(tl.int32)
    rank = tl.cumsum(oh, 0) - oh + (ends - total + before)[None, :]
    row = tl.sum(oh * rank, 1)
    tl.store(pos_ptr + offs, row.to(tl.int64), mask=m)
    if HAS_SRC:
        tl.store(src_ptr + row, offs.to(tl.int64), mask=m)


# up to this many entries one program sorts them (one launch: decode, short chunks); above, the two block kernels
# (benchmarks/probe/expert_sort.py, H200, per call: 4,096 entries 100 vs 122 us, 16,384 entries 259 vs 120 us)
SORT_ONE_PROGRAM = 4096


def expert_sort(topk_idx: torch.Tensor, num_experts: int, out_int32: bool, one_program: bool | None = None,
                with_src: bool = False) -> tuple[torch.Tensor, ...]:
    """`k3.ops.moe.sort_by_expert` as a counting sort (inputs checked by the caller): one program up to
    `SORT_ONE_PROGRAM` entries, else two launches over blocks of entries (per-block counts, then each block's
    rows from the counts of the blocks before it) -- no radix sort, scatter or search for prefill and training
    batches. `one_program` forces either form (tests). with_src: also src [N·K] int64, each sorted row's entry
    (the inverse of pos), as a third result."""
    flat = topk_idx.reshape(-1).contiguous()
    NK = flat.numel()
    EP = max(16, triton.next_power_of_2(num_experts))
    BLOCK = max(16, 8192 // EP)
    pos = torch.empty(NK, dtype=torch.int64, device=flat.device)
    ends = torch.empty(num_experts, dtype=torch.int32 if out_int32 else torch.int64, device=flat.device)
    src = torch.empty(NK if with_src else 0, dtype=torch.int64, device=flat.device)
    if one_program if one_program is not None else NK <= SORT_ONE_PROGRAM:
        expert_sort_kernel[(1,)](flat, pos, ends, src, NK, num_experts, EP=EP, BLOCK=BLOCK, HAS_SRC=with_src,
                                 num_warps=8)
    else:
        NB = max(1, triton.cdiv(NK, BLOCK))
        counts = torch.empty(NB, EP, dtype=torch.int32, device=flat.device)
        expert_count_kernel[(NB,)](flat, counts, NK, EP=EP, BLOCK=BLOCK, num_warps=4)
        expert_rank_kernel[(NB,)](flat, counts, pos, ends, src, NK, num_experts, NB, EP=EP, BLOCK=BLOCK,
                                  RB=max(1, min(64, 4096 // EP)), HAS_SRC=with_src, num_warps=4)
    return (pos.view(topk_idx.shape), ends, src) if with_src else (pos.view(topk_idx.shape), ends)


def interpreted() -> bool:
    """True when the kernels were bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(moe_gather_sum_kernel)
