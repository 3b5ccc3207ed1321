"""Triton KDA decode: a few new tokens per sequence against a pool of fp32 states, updated in place."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..._triton import pdl, sm_count
from ..._triton_jit import pdl_sync, token_range

from .._common import check_token_shapes


# one token per sequence and fewer programs than SMs at the default 64 columns (a batch-1 step: 24 programs for
# k3-small's 12 heads): `NARROW_LAUNCH` (columns, warps) instead, so that more SMs read the state.
# `probe/kda_decode_cfg.py` (H100, 2026-12-05, 12 layers' calls in a CUDA graph, µs per call): batch 1, 64 columns
# × 4 warps 3.35 against 2.57 for 16 × 1 (2.61 for 16 × 2, 2.73 for 32 × 4); batch 4, 4.69 against 3.97. In
# `benchmarks/serve.py` the batch-1 step moved within its noise (1.156 against 1.158 ms). K3_KDA_DECODE_NARROW=0: off
NARROW = os.environ.get("K3_KDA_DECODE_NARROW", "1") == "1"
NARROW_LAUNCH = (16, 1)


@triton.jit
def _token_inputs(q_ptr, k_ptr, g_ptr, v_ptr, b_ptr, t, eos, sq, sk, sg, sv, sb, h, V, offk, km, kc, vc, vm):
    """Token t's q, k, g [BK], v [BV] and beta (a [BK] vector, nonzero at 0 only: summed by the caller), as
    stored; zeros when t >= eos. Masks as vectors: a scalar mask is not supported everywhere (the interpreter)."""
    live = (t + 0 * kc) < eos
    q = tl.load(q_ptr + t * sq + offk, mask=km & live, other=0.0)
    k = tl.load(k_ptr + t * sk + offk, mask=km & live, other=0.0)
    g = tl.load(g_ptr + t * sg + offk, mask=km & live, other=0.0)
    v = tl.load(v_ptr + t * sv + h * V + vc, mask=vm & ((t + 0 * vc) < eos), other=0.0)
    b = tl.load(b_ptr + t * sb + h + 0 * kc, mask=(kc == 0) & live, other=0.0)
    return q, k, g, v, b


@triton.jit
def kda_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, o_ptr, s_ptr, idx_ptr, cu_ptr,
                      H, K, V, slot_stride, sq, sk, sv, sg, sb, scale, lower_bound,
                      BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, BETA_SIG: tl.constexpr,
                      L2: tl.constexpr, HAS_IDX: tl.constexpr, HAS_CU: tl.constexpr, HAS_DTB: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program (n, h, iv): tokens cu[n]..cu[n+1] of sequence n (token n alone without cu), state slot idx[n]
    (or n), columns iv*BV.."""
    pdl_sync(PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    if HAS_IDX:
        slot = tl.load(idx_ptr + n).to(tl.int64)
    else:
        slot = n.to(tl.int64)
    bos, eos = token_range(cu_ptr, n, HAS_CU)
    kc = tl.arange(0, BK)
    vc = iv * BV + tl.arange(0, BV)
    km = kc < K
    vm = vc < V
    sm = km[:, None] & vm[None, :]
    sp = s_ptr + slot * slot_stride + h * K * V + kc[:, None] * V + vc[None, :]
    S = tl.load(sp, mask=sm, other=0.0).to(tl.float32)
    if GATE:
        a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        if HAS_DTB:
            dtb = tl.load(dtb_ptr + h * K + kc, mask=km, other=0.0).to(tl.float32)
        else:
            dtb = tl.zeros([BK], tl.float32)
    offk = h * K + kc
    # token t's inputs are loaded during token t-1's math (software prefetch: the loop is latency-bound when a
    # sequence has many tokens, as in the engine's extend steps)
    nq, nk, ng, nv, nb = _token_inputs(q_ptr, k_ptr, g_ptr, v_ptr, b_ptr, bos, eos, sq, sk, sg, sv, sb, h, V, offk,
                                       km, kc, vc, vm)
    for t in range(bos, eos):
        q, k, g, v = nq.to(tl.float32), nk.to(tl.float32), ng.to(tl.float32), nv.to(tl.float32)
        b = tl.sum(nb.to(tl.float32), 0)
        nq, nk, ng, nv, nb = _token_inputs(q_ptr, k_ptr, g_ptr, v_ptr, b_ptr, t + 1, eos, sq, sk, sg, sv, sb, h, V,
                                           offk, km, kc, vc, vm)
        if L2:
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        if GATE:
            g = lower_bound * tl.sigmoid(a * (g + dtb))
        if BETA_SIG:
            b = tl.sigmoid(b)
        S = S * tl.exp(tl.where(km, g, 0.0))[:, None]
        err = v - tl.sum(k[:, None] * S, 0)
        S = S + (b * k)[:, None] * err[None, :]
        o = tl.sum((q * scale)[:, None] * S, 0)
        tl.store(o_ptr + t * H * V + h * V + vc, o.to(o_ptr.dtype.element_ty), mask=vm)
    tl.store(sp, S.to(s_ptr.dtype.element_ty), mask=sm)


def _index(x, device):
    """An int32 / int64 index tensor as the kernel reads it (either width; no conversion kernel per call)."""
    if x is None:
        return None
    if x.dtype not in (torch.int32, torch.int64):
        x = x.to(torch.int64)
    return x.to(device).contiguous()


def kda_decode_triton(q, k, v, g, beta, state, state_indices=None, cu_seqlens=None, scale=None,
                      use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0,
                      beta_logits=False, block_v=None, num_warps=4):
    """Advance sequences by their new tokens, updating `state` IN PLACE.

    q, k, g: [Ttot, H, K] packed new tokens; v: [Ttot, H, V]; beta: [Ttot, H]. cu_seqlens: int [N+1]
    token ranges per sequence (default: one token each; empty ranges allowed). state: fp32 [P, H, K, V]; state_indices:
    int [N] distinct slots (default: slot n for sequence n); each slot's [H, K, V] must be contiguous, the slots
    themselves may be strided (a layer's view of a page-major pool). With A_log given, g is the raw gate
    pre-activation f and g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)); with beta_logits,
    beta is passed through a sigmoid. Slots not indexed are not read or written. Returns o [Ttot, H, V].
    block_v / num_warps: launch settings (columns of the state per program, warps per program).
    """
    T, H, K, V = check_token_shapes("kda_decode_triton", q, k, v, g, beta, rows="T")
    if state_indices is not None and (state_indices.dim() != 1 or state_indices.is_floating_point()):
        raise ValueError(f"kda_decode_triton: state_indices must be an integer tensor [N] but got "
                         f"{state_indices.dtype} {tuple(state_indices.shape)}")
    if state.dtype != torch.float32 or state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V):
        raise ValueError(f"kda_decode_triton: state must be fp32 [P,{H},{K},{V}] but got "
                         f"{state.dtype} {tuple(state.shape)}")
    if state[0].stride() != (K * V, V, 1) or state.stride(0) < H * K * V:
        raise ValueError(f"kda_decode_triton: each state slot [H, K, V] must be contiguous and slots must not "
                         f"overlap (it is updated in place), got strides {state.stride()}")
    N = T if cu_seqlens is None else cu_seqlens.numel() - 1
    if state_indices is not None and state_indices.numel() != N:
        raise ValueError(f"kda_decode_triton: state_indices has {state_indices.numel()} entries for {N} sequences")
    if state_indices is None and state.shape[0] < N:
        raise ValueError(f"kda_decode_triton: state has {state.shape[0]} slots for {N} sequences")
    scale = K ** -0.5 if scale is None else float(scale)
    # q, k, v, g may be row slices of a wider tensor (the decode conv's or the joined projection's output): rows
    # strided, each row's [H, K] contiguous; beta's rows likewise (no copy kernels per call)
    q, k, v, g = (x if x.stride()[1:] == (x.shape[2], 1) else x.contiguous() for x in (q, k, v, g))
    beta = beta if beta.stride(1) == 1 else beta.contiguous()
    # rows past cu[N] belong to no sequence (a captured extend step's padding): zeros, never stale memory
    o = (torch.empty if cu_seqlens is None else torch.zeros)(T, H, V, device=q.device, dtype=v.dtype)
    BK = max(16, triton.next_power_of_2(K))
    # one token per sequence: 64 columns per program (9 % faster than 32 at 256 sequences on the H200); several
    # (extend steps, a latency-bound loop per sequence): 16 columns, 1 warp (H200, `benchmarks/probe/
    # kda_decode_cfg.py`: 1 x 64 tokens 122 us as 8 x 1 and against 146 us for 64 x 4; 32 x 128 tokens 543 us
    # against 670 and 738)
    if cu_seqlens is not None and block_v is None:
        block_v, num_warps = 16, 1
    elif block_v is None and NARROW and q.is_cuda and N * H * triton.cdiv(V, 64) < sm_count(q.device):
        block_v, num_warps = NARROW_LAUNCH
    BV = block_v or min(64, max(16, triton.next_power_of_2(V)))
    gate = A_log is not None
    grid = (N, H, triton.cdiv(V, BV))
    has_dtb = gate and dt_bias is not None
    kda_decode_kernel[grid](
        q, k, v, g, beta, A_log.contiguous() if gate else None, dt_bias.contiguous() if has_dtb else None,
        o, state, _index(state_indices, q.device), _index(cu_seqlens, q.device), H, K, V, state.stride(0),
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), scale, float(lower_bound),
        BK=BK, BV=BV, GATE=gate, BETA_SIG=beta_logits, L2=use_qk_l2norm_in_kernel,
        HAS_IDX=state_indices is not None, HAS_CU=cu_seqlens is not None, HAS_DTB=has_dtb, num_warps=num_warps,
        **pdl(o))
    return o
