"""Routed experts for a few tokens (decode steps): two Triton GEMV kernels instead of the sorted-rows pipeline.

A decode step of batch 1 routes 4 (token, expert) entries. The sorted-rows pipeline (`k3.ops.moe`: counting
sort, dispatch, two grouped GEMMs over every expert with their prepare kernels, SiTU-GLU, combine) is eight
launches whose grouped GEMMs read the used experts' weights at a fraction of the bandwidth. Here:

1. `moe_gate_up_kernel`, program (entry j, block of BI rows of the expert's I): g = W1[e_j] x_n,
   u = W3[e_j] x_n (fp32 accumulation over L in chunks), h[j] = SiTU-GLU(g, u) in the activation dtype;
2. `moe_down_kernel`, program (token n, block of BL outputs): y[n] = Σ_k w[n, k] · W2[e_{n,k}] h[n·K + k]
   in fp32, one rounding to the activation dtype.

Reads exactly the used experts' weight rows; no sort, no host sync (CUDA-graph safe). The reference is the
sorted-rows pipeline / the fp64 loop (`tests/test_moe_fast.py`); the values differ from the grouped path only
by roundings (it rounds the gate/up and down GEMM outputs to bf16, these kernels keep them in fp32).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._triton import interpreted, pdl
from ._triton_jit import pdl_sync
from .route_triton import route_factor, route_next, route_row
from .situ.triton import situ_glu_value

MAX_ENTRIES = 64  # (token, expert) entries up to which `experts_forward` takes these kernels (H200 probe:
# 2.39x the grouped path at 1 token, 1.55x at 16, equal at 32 -- k3-small, top 4)
LAUNCH = {"bi": 4, "bl": 4, "chunk": 256, "warps": 4}
# whether an inference decode step's LatentMoE chooses its experts inside the gate / up kernel
# (`experts_decode_routed`: no routing kernel, 15 launches fewer per k3-small step) or by `route`'s kernel
# (K3_MOE_ROUTE_IN_EXPERTS=0). `benchmarks/serve.py` (H200, 2026-12-03, session 17): 1.15 / 2.30 / 4.21 ms per step
# at batch 1 / 32 / 256 against 1.16 / 2.30 / 4.20-4.67 by the route kernel: no slower, fewer launches
ROUTED = os.environ.get("K3_MOE_ROUTE_IN_EXPERTS", "1") == "1"
# The loops over L, I and the K experts are unrolled at compile time (the widths are constexprs), over few rows
# (bi / bl), so that the grid has hundreds of programs with their loads in flight together. (Within a program the
# sm_90a code still waits for each chunk's input vector, broadcast through shared memory behind a barrier, before
# that chunk's weight loads; reading it as a tile instead was slower in the MoE block: H200, 2026-12-06.) The first
# form looped at run time over 16-row blocks (128 and 48 programs at one token, one chunk in flight each): 17 µs for
# the pair with its 9.4 MB L2-resident, latency-bound.
# Tried (H200, 2026-12-03): both kernels as 16-row MMA tiles with pipelined loads (as `k3.ops.gemv`): 39.6 µs
# against 17.0 µs for the runtime-loop FMA kernels at one token (`benchmarks/probe/moe_decode.py`).


@triton.jit
def moe_gate_up_kernel(x_ptr, idx_ptr, w1_ptr, w3_ptr, h_ptr, K: tl.constexpr, I, sx, s1_e, s1_r, s3_e, s3_r, sh,
                       beta, linear_beta, L: tl.constexpr, BI: tl.constexpr, CH: tl.constexpr,
                       PDL: tl.constexpr = False, ROUTE: tl.constexpr = False, z_ptr=None, bias_ptr=None,
                       wt_ptr=None, sc_ptr=None, E=0, scale=1.0, BE: tl.constexpr = 16,
                       HAS_BIAS: tl.constexpr = False, RENORM: tl.constexpr = True):
    """ROUTE: entry j's expert is chosen here from the router's fp32 logits z [N, E] (`route_triton`'s
    selection), and programs (j, 0) store idx [N·K] and weights wt [N·K] (and, for k = 0, token n's scores
    [N, E]) as `route` returns them, for the down kernel and the caller: the step has no routing kernel."""
    pdl_sync(PDL)
    j = tl.program_id(0)
    rows = tl.program_id(1) * BI + tl.arange(0, BI)
    rm = rows < I
    n = j // K
    if ROUTE:
        ee, em, sc, c = route_row(z_ptr, bias_ptr, n, E, BE, HAS_BIAS)
        f = route_factor(ee, sc, c, E, scale, K, BE, RENORM)
        e = 0
        wj = 0.0
        for k in tl.static_range(K):
            i, si, c = route_next(ee, sc, c, E, BE)
            e = tl.where(j % K == k, i, e)
            wj = tl.where(j % K == k, si * f, wj)
        if tl.program_id(1) == 0:
            tl.store(idx_ptr + j, e.to(tl.int64))
            tl.store(wt_ptr + j, wj)
            if j % K == 0:
                tl.store(sc_ptr + n * E + ee, sc, mask=em)
        e = e.to(tl.int64)
    else:
        e = tl.load(idx_ptr + j).to(tl.int64)
    r = rows[:, None].to(tl.int64)
    g = tl.zeros([BI], tl.float32)
    u = tl.zeros([BI], tl.float32)
    for c0 in tl.static_range(0, L, CH):
        cols = c0 + tl.arange(0, CH)
        cm = cols < L
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + n * sx + cols, mask=cm, other=0.0).to(tl.float32)
        w1 = tl.load(w1_ptr + e * s1_e + r * s1_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w3 = tl.load(w3_ptr + e * s3_e + r * s3_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g += tl.sum(w1 * x[None, :], 1)
        u += tl.sum(w3 * x[None, :], 1)
    h = situ_glu_value(g, u, beta, linear_beta)
    tl.store(h_ptr + j * sh + rows, h.to(h_ptr.dtype.element_ty), mask=rm)


@triton.jit
def moe_down_kernel(h_ptr, idx_ptr, wt_ptr, w2_ptr, y_ptr, L, sh, sw_e, sw_r, sy, K: tl.constexpr,
                    I: tl.constexpr, BL: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr = False):
    pdl_sync(PDL)
    n = tl.program_id(0)
    rows = tl.program_id(1) * BL + tl.arange(0, BL)
    rm = rows < L
    r = rows[:, None].to(tl.int64)
    acc = tl.zeros([BL], tl.float32)
    for k in tl.static_range(K):
        j = n * K + k
        e = tl.load(idx_ptr + j).to(tl.int64)
        wk = tl.load(wt_ptr + j).to(tl.float32)
        part = tl.zeros([BL], tl.float32)
        for c0 in tl.static_range(0, I, CH):
            cols = c0 + tl.arange(0, CH)
            cm = cols < I
            h = tl.load(h_ptr + j * sh + cols, mask=cm, other=0.0).to(tl.float32)
            w = tl.load(w2_ptr + e * sw_e + r * sw_r + cols[None, :], mask=rm[:, None] & cm[None, :],
                        other=0.0).to(tl.float32)
            part += tl.sum(w * h[None, :], 1)
        acc += wk * part
    tl.store(y_ptr + n * sy + rows, acc.to(y_ptr.dtype.element_ty), mask=rm)


def _chunk(chunk: int, width: int) -> int:
    """Columns per unrolled load: `chunk`, or less for a narrow width (a power of two, ≥ 16)."""
    return min(chunk, max(16, triton.next_power_of_2(width)))


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fits(x: torch.Tensor, topk_idx: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """Whether `experts_decode` takes this call: few entries, no autograd, weights in x's dtype, CUDA (or the
    CPU interpreter)."""
    return _fits(x, topk_idx.numel(), w1, w2, w3)


def _fits(x: torch.Tensor, entries: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    return (entries <= MAX_ENTRIES and not torch.is_grad_enabled()
            and (x.is_cuda or interpreted(moe_gate_up_kernel))
            and w1.dtype == w2.dtype == w3.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16,
                                                                             torch.float32))


def routed_fits(x: torch.Tensor, top_k: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """Whether `experts_decode_routed` takes a decode step's MoE: `ROUTED` on, and `fits` for its entries."""
    return ROUTED and _fits(x, x.shape[0] * top_k, w1, w2, w3)


def experts_decode_routed(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                          renormalize: bool, scaling_factor: float, w1: torch.Tensor, w2: torch.Tensor,
                          w3: torch.Tensor, beta: float, linear_beta: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`k3.ops.moe.route` (from the router's fp32 logits [N, E]) and `experts_decode` in the same two kernels
    (the gate / up kernel routes, the down kernel reads its choices): returns (y [N, L], topk_idx [N, k] long,
    topk_weight [N, k] fp32, scores [N, E] fp32), as the two calls."""
    N, L = x.shape
    E, I = w1.shape[0], w1.shape[1]
    K = top_k
    if logits.shape != (N, E) or logits.dtype != torch.float32:
        raise ValueError(f"experts_decode_routed: logits must be fp32 [{N}, {E}], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if not 0 < K <= E:
        raise ValueError(f"experts_decode_routed: top_k={K} must lie in [1, {E}]")
    x, w1, w3, w2, z = _unit(x), _unit(w1), _unit(w3), _unit(w2), logits.contiguous()
    idx = torch.empty(N, K, dtype=torch.long, device=x.device)
    wt = torch.empty(N, K, dtype=torch.float32, device=x.device)
    scores = torch.empty(N, E, dtype=torch.float32, device=x.device)
    h = torch.empty(N * K, I, dtype=x.dtype, device=x.device)
    y = torch.empty(N, L, dtype=x.dtype, device=x.device)
    if N == 0:
        return y, idx, wt, scores
    c = LAUNCH
    moe_gate_up_kernel[(N * K, triton.cdiv(I, c["bi"]))](
        x, idx, w1, w3, h, K, I, x.stride(0), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), h.stride(0),
        float(beta), float(linear_beta), L=L, BI=c["bi"], CH=_chunk(c["chunk"], L), num_warps=c["warps"],
        ROUTE=True, z_ptr=z, bias_ptr=z if bias is None else bias.float().contiguous(), wt_ptr=wt, sc_ptr=scores,
        E=E, scale=float(scaling_factor), BE=max(16, triton.next_power_of_2(E)), HAS_BIAS=bias is not None,
        RENORM=bool(renormalize), **pdl(x))
    moe_down_kernel[(N, triton.cdiv(L, c["bl"]))](
        h, idx, wt, w2, y, L, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), K=K, I=I, BL=c["bl"],
        CH=_chunk(c["chunk"], I), num_warps=c["warps"], **pdl(x))
    return y, idx, wt, scores


def experts_decode(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w3: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """`k3.ops.moe.experts_forward` for a few tokens: x [N, L], topk_idx / topk_weight [N, K], w1 / w3 [E, I, L]
    (any expert / row strides: the halves of a fused gate ‖ up tensor are read in place), w2 [E, L, I] →
    [N, L] in x's dtype."""
    N, K = topk_idx.shape
    E, I, L = w1.shape
    x, w1, w3, w2 = _unit(x), _unit(w1), _unit(w3), _unit(w2)
    idx = topk_idx.reshape(-1).contiguous()
    wt = topk_weight.reshape(-1).contiguous()
    h = torch.empty(N * K, I, dtype=x.dtype, device=x.device)
    y = torch.empty(N, L, dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    c = LAUNCH
    moe_gate_up_kernel[(N * K, triton.cdiv(I, c["bi"]))](
        x, idx, w1, w3, h, K, I, x.stride(0), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), h.stride(0),
        float(beta), float(linear_beta), L=L, BI=c["bi"], CH=_chunk(c["chunk"], L), num_warps=c["warps"], **pdl(x))
    moe_down_kernel[(N, triton.cdiv(L, c["bl"]))](
        h, idx, wt, w2, y, L, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), K=K, I=I, BL=c["bl"],
        CH=_chunk(c["chunk"], I), num_warps=c["warps"], **pdl(x))
    return y
