"""The incoming states of a long prefill chunk's segments (`chunk._extend_split`) in one kernel per layer.

Each segment j was first summarised from a zero state: its own contribution S[j] [H, K, V] and its K x K
transition M[j]. The segments' incoming states then follow in order:

    h[0] = state[slot],   h[j] = M[j-1] h[j-1] + S[j-1]   (j = 1 .. P-1)

As PyTorch ops (`combine_segments_torch`, the reference) that is an index_select, a copy and P - 1 batched fp32
GEMMs: cuBLAS runs them as SIMT fp32 kernels of ~5.7 µs each, 84 of the 8K prefill graph's 880 kernels (0.48 ms of
21.4). Here program (head, value block) keeps its [K, BV] column block of h in registers and walks the P - 1 steps
with one tensor-core product each, in 3xTF32 by default (`PREC`: the fp32 product to about fp32's rounding,
unlike plain TF32's 2^-11). The version removed on 2026-12-03 walked K in chunks with exact fp32 FMA dots
(`ieee`) and was slower than the GEMMs; this one takes 28.4 µs against their 52.0 at P = 8 (LAUNCH's note).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton import interpreted as _interpreted, pdl
from ..._triton_jit import pdl_sync

PREC = "tf32x3"  # tl.dot input precision on the GPU ("ieee": exact fp32 FMA; "tf32": one TF32 product)
# `benchmarks/probe/kda_combine.py` (H200, 2026-12-04, graph replays, H 12, K = V 128; µs at P = 4 / 8): 3xTF32 with
# value blocks of 16 and 8 warps 17.1 / 28.4 against the GEMMs' 25.4 / 52.0; blocks of 32: 18.3 / 30.4; 4 warps
# 25-88; prefetching the next step's operands no faster (14.9-43.8); one TF32 product 12-22 at 1-2e-3 error
LAUNCH = dict(block_v=16, num_warps=8, prefetch=False)


@triton.jit
def _step_operands(summ_ptr, j, hh, kr, km, vc, m2, s_sp, s_sh, s_sk, V: tl.constexpr):
    """Step j's addend S[j] [BK, BV] (this program's value columns) and transition M[j] [BK, BK]."""
    row = summ_ptr + j * s_sp + hh * s_sh + kr[:, None] * s_sk
    return (tl.load(row + vc[None, :], mask=m2, other=0.0),
            tl.load(row + V + kr[None, :], mask=km[:, None] & km[None, :], other=0.0))


@triton.jit
def segment_combine_kernel(state_ptr, slot_ptr, summ_ptr, h_ptr, s_state, s_sp, s_sh, s_sk, s_hp,
                           K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           PREC: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    """summ [P, H, K, V + K] (S ‖ M, rows of stride s_sk); h [P, H, K, V], [H, K, V] contiguous per segment.
    PREFETCH: step j + 1's operands are loaded before step j's product (they do not depend on h)."""
    pdl_sync(PDL)
    hh = tl.program_id(0)
    vc = tl.program_id(1) * BV + tl.arange(0, BV)
    kr = tl.arange(0, BK)
    km = kr < K
    m2 = km[:, None] & (vc < V)[None, :]
    slot = tl.load(slot_ptr).to(tl.int64)
    h = tl.load(state_ptr + slot * s_state + hh * K * V + kr[:, None] * V + vc[None, :], mask=m2, other=0.0)
    out = h_ptr + hh * K * V + kr[:, None] * V + vc[None, :]
    tl.store(out, h, mask=m2)
    s, m = _step_operands(summ_ptr, 0, hh, kr, km, vc, m2, s_sp, s_sh, s_sk, V)
    for j in tl.static_range(1, P):
        if PREFETCH and j + 1 < P:
            s_n, m_n = _step_operands(summ_ptr, j, hh, kr, km, vc, m2, s_sp, s_sh, s_sk, V)
        h = tl.dot(m, h, acc=s, input_precision=PREC)
        tl.store(out + j * s_hp, h, mask=m2)
        if j + 1 < P:
            if PREFETCH:
                s, m = s_n, m_n
            else:
                s, m = _step_operands(summ_ptr, j, hh, kr, km, vc, m2, s_sp, s_sh, s_sk, V)


def combine_segments_torch(summ: torch.Tensor, state: torch.Tensor, slot: torch.Tensor, P: int) -> torch.Tensor:
    """The reference: h [P, H, K, V] fp32 from summ [P, H, K, V + K] (S ‖ M) and the pool `state` [*, H, K, V]
    at the one-element index tensor `slot` (h[0] = the slot's state, h[j] = M[j-1] h[j-1] + S[j-1])."""
    V = state.shape[-1]
    S_loc, M = summ[..., :V], summ[..., V:]
    h = torch.empty(P, *state.shape[1:], device=summ.device, dtype=torch.float32)
    torch.index_select(state, 0, slot, out=h[:1])
    h[1:] = S_loc[:-1]  # one copy of the addends; each step then accumulates onto its own (contiguous) h[j]
    for j in range(1, P):  # one batched GEMM per step, beta = 1 in place
        h[j].baddbmm_(M[j - 1], h[j - 1])
    return h


def combine_segments(summ: torch.Tensor, state: torch.Tensor, slot: torch.Tensor, P: int,
                     block_v: int | None = None, num_warps: int | None = None,
                     precision: str | None = None, prefetch: bool | None = None) -> torch.Tensor:
    """`combine_segments_torch` as one Triton kernel (grid: heads x value blocks). state: an fp32 pool whose slots
    hold contiguous [H, K, V]; slot: a one-element int tensor on the device (never read to the host).
    block_v / num_warps / prefetch / precision replace `LAUNCH` / `PREC` (sweeps, tests; the interpreter always computes
    in exact fp32)."""
    H, K, V = state.shape[1:]
    if summ.shape != (P, H, K, V + K) or summ.stride(-1) != 1 or summ.dtype != torch.float32:
        raise ValueError(f"combine_segments: summ must be fp32 [{P}, {H}, {K}, {V + K}] with unit last stride, got "
                         f"{summ.dtype} {tuple(summ.shape)}")
    if state.dtype != torch.float32 or state[0].stride() != (K * V, V, 1) or slot.numel() != 1:
        raise ValueError(f"combine_segments: need an fp32 pool of contiguous [{H}, {K}, {V}] slots and one slot "
                         f"index, got {state.dtype} strides {tuple(state.stride())} and {slot.numel()} indices")
    h = torch.empty(P, H, K, V, device=summ.device, dtype=torch.float32)
    BK = max(16, triton.next_power_of_2(K))
    BV = min(block_v or LAUNCH["block_v"], max(16, triton.next_power_of_2(V)))
    prec = "ieee" if interpreted() else (precision or PREC)
    segment_combine_kernel[(H, triton.cdiv(V, BV))](
        state, slot, summ, h, state.stride(0), summ.stride(0), summ.stride(1), summ.stride(2), h.stride(0),
        K=K, V=V, P=P, BK=BK, BV=BV, PREC=prec,
        PREFETCH=LAUNCH["prefetch"] if prefetch is None else prefetch, num_warps=num_warps or LAUNCH["num_warps"],
        **pdl(h))
    return h


def interpreted() -> bool:
    """True when the kernel was bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(segment_combine_kernel)
