"""The incoming states of a long extend chunk's static segments, in one kernel per layer.

A prefill graph's KDA recurrence runs one sequence's chunk as P segments in parallel (`chunk._extend_split`). Each
segment j was first summarised from a zero state: its own contribution S_loc[j] [H, K, V] and its K x K
transition M[j] [H, K, K]. The segments' incoming states then follow in fp32:

    h[0] = state[slot],   h[j] = M[j-1] h[j-1] + S_loc[j-1]   (j = 1 .. P-1)

As PyTorch ops that is an index_select, a copy and P - 1 batched GEMMs each with a copy of its addend: 2P + 1
kernels per layer (the 8K prefill graph spent ≈ 1 ms of its 27 on them and the gaps between them). Here program
(head, value block) keeps its [K, BV] column block of the state and walks the P - 1 steps itself, the products
in exact fp32 (`input_precision="ieee"`, as cuBLAS's fp32 GEMM): the result differs from the ops only by the
order of the sums. `combine_segments_torch` is the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton import pdl
from ..._triton_jit import pdl_sync


@triton.jit
def segment_combine_kernel(state_ptr, slot_ptr, summ_ptr, h_ptr, s_state, s_sp, s_sh, s_sk, s_hp,
                           K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, BK: tl.constexpr,
                           BKC: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    """summ [P, H, K, V + K] (S_loc ‖ M, rows of stride s_sk); h [P, H, K, V] contiguous per segment (s_hp).
    Steps j ≥ 1 read h[j - 1] back from memory in BKC-row chunks (written by this program's threads just before:
    a barrier orders it), so no register tensor has to be sliced."""
    pdl_sync(PDL)
    hh = tl.program_id(0)
    vc = tl.program_id(1) * BV + tl.arange(0, BV)
    kr = tl.arange(0, BK)
    km = kr < K
    vm = vc < V
    m2 = km[:, None] & vm[None, :]
    slot = tl.load(slot_ptr).to(tl.int64)
    cur = tl.load(state_ptr + slot * s_state + hh * K * V + kr[:, None] * V + vc[None, :], mask=m2, other=0.0)
    hrow = h_ptr + hh * K * V + kr[:, None] * V + vc[None, :]
    tl.store(hrow, cur, mask=m2)
    for j in tl.static_range(1, P):
        tl.debug_barrier()  # h[j - 1] is stored by every thread before any thread reads it back
        srow = summ_ptr + (j - 1) * s_sp + hh * s_sh + kr[:, None] * s_sk
        acc = tl.load(srow + vc[None, :], mask=m2, other=0.0)  # S_loc[j - 1]
        for k0 in tl.static_range(0, BK, BKC):
            kc = k0 + tl.arange(0, BKC)
            kcm = kc < K
            m = tl.load(srow + V + kc[None, :], mask=km[:, None] & kcm[None, :], other=0.0)  # M[j - 1][:, kc]
            hp = tl.load(h_ptr + (j - 1) * s_hp + hh * K * V + kc[:, None] * V + vc[None, :],
                         mask=kcm[:, None] & vm[None, :], other=0.0)
            acc += tl.dot(m, hp, input_precision="ieee")
        tl.store(hrow + j * s_hp, acc, mask=m2)


def combine_segments_torch(summ: torch.Tensor, state: torch.Tensor, slot: torch.Tensor, P: int) -> torch.Tensor:
    """The reference: h [P, H, K, V] fp32 from summ [P, H, K, V + K] and the pool `state` [*, H, K, V] at the
    one-element index tensor `slot` (h[0] = the slot's state; h[j] = M[j-1] h[j-1] + S_loc[j-1])."""
    V = state.shape[-1]
    S_loc, M = summ[..., :V], summ[..., V:]
    h = torch.empty(P, *state.shape[1:], device=summ.device, dtype=torch.float32)
    h[0] = state.index_select(0, slot)[0]
    for j in range(1, P):  # one batched GEMM with the add per step, written in place (no add kernel)
        torch.baddbmm(S_loc[j - 1], M[j - 1], h[j - 1], out=h[j])
    return h


def combine_segments(summ: torch.Tensor, state: torch.Tensor, slot: torch.Tensor, P: int,
                     block_v: int = 32, block_k: int = 32, num_warps: int = 4) -> torch.Tensor:
    """`combine_segments_torch` as one Triton kernel (grid: heads x value blocks of `block_v`). state: an fp32 pool
    whose slots hold contiguous [H, K, V]; slot: one-element int tensor on the device (never read to the host)."""
    H, K, V = state.shape[1:]
    if summ.shape != (P, H, K, V + K) or summ.stride(-1) != 1 or summ.dtype != torch.float32:
        raise ValueError(f"combine_segments: summ must be fp32 [{P}, {H}, {K}, {V + K}] with unit last stride, got "
                         f"{summ.dtype} {tuple(summ.shape)}")
    if state.dtype != torch.float32 or state[0].stride() != (K * V, V, 1) or slot.numel() != 1:
        raise ValueError(f"combine_segments: need an fp32 pool of contiguous [{H}, {K}, {V}] slots and one slot "
                         f"index, got {state.dtype} strides {state.stride()} and {slot.numel()} indices")
    h = torch.empty(P, H, K, V, device=summ.device, dtype=torch.float32)
    BK = max(16, triton.next_power_of_2(K))
    BV = min(block_v, max(16, triton.next_power_of_2(V)))
    segment_combine_kernel[(H, triton.cdiv(V, BV))](
        state, slot, summ, h, state.stride(0), summ.stride(0), summ.stride(1), summ.stride(2), h.stride(0),
        K=K, V=V, P=P, BK=BK, BKC=min(block_k, BK), BV=BV, num_warps=num_warps, **pdl(h))
    return h
