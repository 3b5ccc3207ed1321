"""Routed experts for a few tokens (decode steps): two Triton GEMV kernels instead of the sorted-rows pipeline.

A decode step of batch 1 routes 4 (token, expert) entries. The sorted-rows pipeline (`k3.ops.moe`: counting
sort, dispatch, two grouped GEMMs over every expert with their prepare kernels, SiTU-GLU, combine) is eight
launches whose grouped GEMMs read the used experts' weights at a fraction of the bandwidth. Here:

1. `moe_gate_up_kernel`, program (entry j, block of BI rows of the expert's I): g = W1[e_j] x_n,
   u = W3[e_j] x_n (fp32 accumulation over L in chunks), h[j] = SiTU-GLU(g, u) in the activation dtype;
2. `moe_down_kernel`, program (token n, block of BL outputs): y[n] = Σ_k w[n, k] · W2[e_{n,k}] h[n·K + k]
   in fp32, one rounding to the activation dtype.
Both multiply on the tensor cores (the one row padded to a 16-row tile, as `k3.ops.gemv` does) so that the
weight loads are software-pipelined; the first form's FMA loops read the weights at ≈ 0.8 TB/s (23 µs per
layer for 9.4 MB, H200).

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
# bi / bl: rows of the expert's I (gate/up) or of L (down) per program; chunk: columns per pipelined load
LAUNCH = {"bi": 16, "bl": 16, "chunk": 256, "warps": 4, "stages": 3}


@triton.jit
def moe_gate_up_kernel(x_ptr, idx_ptr, w1_ptr, w3_ptr, h_ptr, K, I, L, sx, s1_e, s1_r, s3_e, s3_r, sh, beta,
                       linear_beta, BI: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program (entry j, rows block): g, u = W1[e_j] x_n, W3[e_j] x_n over L in CH-column chunks on the tensor
    cores (x_n as row 0 of a 16-row tile, fp32 accumulation; loads pipelined), h[j] = SiTU-GLU(g, u)."""
    pdl_sync(PDL)
    j = tl.program_id(0)
    rows = tl.program_id(1) * BI + tl.arange(0, BI)
    rm = rows < I
    e = tl.load(idx_ptr + j).to(tl.int64)
    n = j // K
    m = tl.arange(0, 16)
    r = rows[:, None].to(tl.int64)
    g = tl.zeros([16, BI], tl.float32)
    u = tl.zeros([16, BI], tl.float32)
    for c0 in range(0, L, CH):
        cols = c0 + tl.arange(0, CH)
        cm = cols < L
        x = tl.load(x_ptr + n * sx + m[:, None] * 0 + cols[None, :], mask=(m == 0)[:, None] & cm[None, :],
                    other=0.0)
        wm = rm[:, None] & cm[None, :]
        w1 = tl.load(w1_ptr + e * s1_e + r * s1_r + cols[None, :], mask=wm, other=0.0)
        w3 = tl.load(w3_ptr + e * s3_e + r * s3_r + cols[None, :], mask=wm, other=0.0)
        if IEEE:  # fp32 inputs, or the CPU interpreter (whose dot mishandles half types)
            xf = x.to(tl.float32)
            g += tl.dot(xf, tl.trans(w1.to(tl.float32)), input_precision="ieee")
            u += tl.dot(xf, tl.trans(w3.to(tl.float32)), input_precision="ieee")
        else:
            g += tl.dot(x, tl.trans(w1))
            u += tl.dot(x, tl.trans(w3))
    h = tl.sum(situ_glu_value(g, u, beta, linear_beta), 0)  # row 0 (the others are 0: SiTU-GLU(0, 0) = 0)
    tl.store(h_ptr + j * sh + rows, h.to(h_ptr.dtype.element_ty), mask=rm)


@triton.jit
def moe_down_kernel(h_ptr, idx_ptr, wt_ptr, w2_ptr, y_ptr, K, I, L, sh, sw_e, sw_r, sy,
                    BL: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token n, outputs block): y[n] = Σ_k w[n, k] · W2[e_{n,k}] h[n·K + k] (K ≤ 16), one loop over the
    K experts' CH-column chunks (pipelined loads): expert k's h is row k of the 16-row tile, so row k of the
    accumulator is its product, weighted and summed in fp32 at the end."""
    pdl_sync(PDL)
    n = tl.program_id(0)
    rows = tl.program_id(1) * BL + tl.arange(0, BL)
    rm = rows < L
    r = rows[:, None].to(tl.int64)
    m = tl.arange(0, 16)
    acc = tl.zeros([16, BL], tl.float32)
    nc = tl.cdiv(I, CH)
    for t in range(0, K * nc):
        k = t // nc
        j = n * K + k
        cols = (t % nc) * CH + tl.arange(0, CH)
        cm = cols < I
        e = tl.load(idx_ptr + j).to(tl.int64)
        h = tl.load(h_ptr + j * sh + m[:, None] * 0 + cols[None, :], mask=(m == k)[:, None] & cm[None, :],
                    other=0.0)
        w = tl.load(w2_ptr + e * sw_e + r * sw_r + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(h, tl.trans(w))
    wk = tl.load(wt_ptr + n * K + m, mask=m < K, other=0.0).to(tl.float32)
    tl.store(y_ptr + n * sy + rows, tl.sum(acc * wk[:, None], 0).to(y_ptr.dtype.element_ty), mask=rm)


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fits(x: torch.Tensor, topk_idx: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """Whether `experts_decode` takes this call: few entries, top-k ≤ 16, no autograd, weights in x's dtype,
    CUDA (or the CPU interpreter)."""
    return (topk_idx.numel() <= MAX_ENTRIES and topk_idx.shape[-1] <= 16 and not torch.is_grad_enabled()
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
    kw = dict(IEEE=x.dtype == torch.float32 or not x.is_cuda, num_warps=c["warps"], num_stages=c["stages"],
              **pdl(x))
    moe_gate_up_kernel[(N * K, triton.cdiv(I, c["bi"]))](
        x, idx, w1, w3, h, K, I, L, x.stride(0), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1),
        h.stride(0), float(beta), float(linear_beta), BI=c["bi"], CH=c["chunk"], **kw)
    moe_down_kernel[(N, triton.cdiv(L, c["bl"]))](
        h, idx, wt, w2, y, K, I, L, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), BL=c["bl"],
        CH=c["chunk"], **kw)
    return y
