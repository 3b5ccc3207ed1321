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

import torch
import triton
import triton.language as tl

from ._triton import interpreted, pdl
from ._triton_jit import pdl_sync
from .situ.triton import situ_glu_value

MAX_ENTRIES = 64  # (token, expert) entries up to which `experts_forward` takes these kernels (H200 probe:
# 2.39x the grouped path at 1 token, 1.55x at 16, equal at 32 -- k3-small, top 4)
LAUNCH = {"bi": 4, "bl": 4, "chunk": 256, "warps": 4}
# Each program issues ALL its weight loads at once (the loops over L, I and the K experts are unrolled at compile
# time: the widths are constexprs), over few rows (bi / bl), so that the grid has hundreds of programs with
# their loads in flight together. The first form looped at run time over 16-row blocks (128 and 48 programs at
# one token, one chunk in flight each): 17 µs for the pair with its 9.4 MB L2-resident, latency-bound.
# Tried (H200, 2026-12-03): both kernels as 16-row MMA tiles with pipelined loads (as `k3.ops.gemv`): 39.6 µs
# against 17.0 µs for the runtime-loop FMA kernels at one token (`benchmarks/probe/moe_decode.py`).


@triton.jit
def moe_gate_up_kernel(x_ptr, idx_ptr, w1_ptr, w3_ptr, h_ptr, K, I, sx, s1_e, s1_r, s3_e, s3_r, sh, beta,
                       linear_beta, L: tl.constexpr, BI: tl.constexpr, CH: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_sync(PDL)
    j = tl.program_id(0)
    rows = tl.program_id(1) * BI + tl.arange(0, BI)
    rm = rows < I
    e = tl.load(idx_ptr + j).to(tl.int64)
    n = j // K
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
    return (topk_idx.numel() <= MAX_ENTRIES and not torch.is_grad_enabled()
            and (x.is_cuda or interpreted(moe_gate_up_kernel))
            and w1.dtype == w2.dtype == w3.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16,
                                                                             torch.float32))


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
