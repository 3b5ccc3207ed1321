"""SiTU-GLU on Triton: one elementwise pass forward, one backward (recomputing from the saved g, u).

fp32 math in registers, g, u and the outputs in the input dtype; nothing fp32 is stored. tanh, sech² and
σ are built from exp(−|x|) ≤ 1 (no overflow at any |x|; the caps saturate exactly), with a short series for
tanh near 0 so that it keeps its relative accuracy there. Works on [M, I] row views of any row stride, so the
fused variant reads the gate and up halves of one [M, 2I] GEMM output in place.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._triton import interpreted as _interpreted, pdl
from .._triton_jit import pdl_sync

# Launch parameters (env-overridable for sweeps on the GPU): elements per program tile (a power of two; at most
# 256 columns wide) and warps. 1024 elements at 4 warps: 8 values per thread, <= 56 registers on sm_90 with
# Triton 3.6 (2048: up to 126).
CFG = {
    "tile": int(os.environ.get("K3_SITU_TILE", "1024")),
    "warps": int(os.environ.get("K3_SITU_WARPS", "4")),
}
# The forward of bf16 / fp16 tensors on the GPU through the hardware tanh (`situ_glu_value_approx`; its error is
# under half an output ulp); K3_SITU_APPROX=0: the exact-in-fp32 formula everywhere. fp32 outputs, the interpreter
# and the backward always take the exact one.
APPROX = os.environ.get("K3_SITU_APPROX", "1") == "1"


@triton.jit
def _tanh_sech2(x):
    """(tanh(x), sech²(x)) in fp32."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    a2 = a * a  # tanh series to a^9: relative error < 1e-8 below 0.25, where 1 − e loses digits
    ts = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (-0.05396825396825397
                                                                                    + a2 * 0.021869488536155203))))
    t = tl.where(a < 0.25, ts, t)
    t = tl.where(x < 0, -t, t)
    return t, 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _sigmoids(x):
    """(σ(x), σ(−x)) in fp32."""
    em = tl.exp(-tl.abs(x))
    p = 1.0 / (1.0 + em)
    n = em * p
    pos = x >= 0
    return tl.where(pos, p, n), tl.where(pos, n, p)


@triton.jit
def situ_glu_value(g, u, beta, linear_beta):
    """β₁·tanh(g/β₁)·σ(g)·β₂·tanh(u/β₂) of fp32 tiles (also the epilogue of `moe_decode`'s gate/up kernel)."""
    t1, _ = _tanh_sech2(g / beta)
    s, _ = _sigmoids(g)
    t2, _ = _tanh_sech2(u / linear_beta)
    return (beta * t1 * s) * (linear_beta * t2)


@triton.jit
def _tanh_approx(x):
    """tanh(x) in fp32 by the hardware's tanh.approx.f32 (one MUFU instruction; relative error below 2^-10.9,
    under half a bf16 / fp16 ulp): not for fp32 outputs."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def situ_glu_value_approx(g, u, beta, linear_beta):
    """`situ_glu_value` with both tanh by the hardware's and σ(g) = 1 / (1 + exp(−g)) (not (1 + tanh(g/2)) / 2,
    which cancels for negative g): four special-function instructions per element instead of eight, and about
    a third of the arithmetic (no tanh series, no selects), so the pass is memory-bound again."""
    t1 = _tanh_approx(g * (1.0 / beta))
    s = tl.fdiv(1.0, 1.0 + tl.exp(-g), ieee_rounding=False)  # exp(−g) = inf for g < −88: σ = 0 (true: < 1e-38)
    t2 = _tanh_approx(u * (1.0 / linear_beta))
    return (beta * t1 * s) * (linear_beta * t2)


@triton.jit
def situ_fwd_kernel(g_ptr, u_ptr, o_ptr, M, I, s_g, s_u, s_o, beta, linear_beta,
                    BM: tl.constexpr, BI: tl.constexpr, APPROX: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (i, j): rows i*BM.., columns j*BI.. of o = β₁·tanh(g/β₁)·σ(g)·β₂·tanh(u/β₂) (APPROX: by
    `situ_glu_value_approx`, for bf16 / fp16 outputs on the GPU)."""
    pdl_sync(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    r = rows.to(tl.int64)[:, None]
    c = cols[None, :]
    g = tl.load(g_ptr + r * s_g + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * s_u + c, mask=mask, other=0.0).to(tl.float32)
    if APPROX:
        o = situ_glu_value_approx(g, u, beta, linear_beta)
    else:
        o = situ_glu_value(g, u, beta, linear_beta)
    tl.store(o_ptr + r * s_o + c, o.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def situ_bwd_kernel(g_ptr, u_ptr, do_ptr, dg_ptr, du_ptr, M, I, s_g, s_u, s_do, s_dg, s_du, beta, linear_beta,
                    BM: tl.constexpr, BI: tl.constexpr):
    """Program (i, j): dg = do·B·(sech²(g/β₁)·σ(g) + A·σ(−g)), du = do·A·sech²(u/β₂),
    with A = β₁·tanh(g/β₁)·σ(g), B = β₂·tanh(u/β₂)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    r = rows.to(tl.int64)[:, None]
    c = cols[None, :]
    g = tl.load(g_ptr + r * s_g + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * s_u + c, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + r * s_do + c, mask=mask, other=0.0).to(tl.float32)
    t1, h1 = _tanh_sech2(g / beta)
    s, sn = _sigmoids(g)
    t2, h2 = _tanh_sech2(u / linear_beta)
    a = beta * t1 * s
    b = linear_beta * t2
    dg = do * b * (h1 * s + a * sn)
    du = do * a * h2
    tl.store(dg_ptr + r * s_dg + c, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + r * s_du + c, du.to(du_ptr.dtype.element_ty), mask=mask)


def _blocks(I: int) -> tuple[int, int]:
    """(BM, BI): CFG["tile"]-element tiles, at most 256 columns wide."""
    bi = min(triton.next_power_of_2(max(I, 1)), 256, CFG["tile"])
    return max(1, CFG["tile"] // bi), bi


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as an [M, I] view with unit column stride (copied only when no such view exists)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.numel() == 0 else x2.contiguous()


def approx(o: torch.Tensor) -> bool:
    """Whether the forward writing `o` takes the hardware tanh: APPROX, a bf16 / fp16 output, a CUDA tensor."""
    return APPROX and o.dtype in (torch.bfloat16, torch.float16) and o.is_cuda and not interpreted()


def situ_fwd(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """g, u [M, I] row views (unit column stride) → act [M, I] contiguous, in g's dtype."""
    M, I = g.shape
    o = torch.empty(M, I, dtype=g.dtype, device=g.device)
    if o.numel():
        BM, BI = _blocks(I)
        situ_fwd_kernel[(triton.cdiv(M, BM), triton.cdiv(I, BI))](
            g, u, o, M, I, g.stride(0), u.stride(0), o.stride(0), float(beta), float(linear_beta),
            BM=BM, BI=BI, APPROX=approx(o), num_warps=CFG["warps"], **pdl(o))
    return o


def situ_bwd(g, u, do, dg, du, beta: float, linear_beta: float) -> None:
    """Write d gate, d up of [M, I] row views into the views dg, du."""
    M, I = g.shape
    if M * I:
        BM, BI = _blocks(I)
        situ_bwd_kernel[(triton.cdiv(M, BM), triton.cdiv(I, BI))](
            g, u, do, dg, du, M, I, g.stride(0), u.stride(0), do.stride(0), dg.stride(0), du.stride(0),
            float(beta), float(linear_beta), BM=BM, BI=BI, num_warps=CFG["warps"])


class SituGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        ctx.save_for_backward(gate, up)
        ctx.beta = beta, linear_beta
        return situ_fwd(_rows(gate), _rows(up), beta, linear_beta).view(gate.shape)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        g, u = _rows(gate), _rows(up)
        dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        du = torch.empty(u.shape, dtype=u.dtype, device=u.device)
        situ_bwd(g, u, _rows(dout), dg, du, *ctx.beta)
        return dg.view(gate.shape), du.view(up.shape), None, None


class SituGLUFusedTriton(torch.autograd.Function):
    """gate_up [..., 2I] (gate half, then up half) → [..., I]; the gradient comes back as one [..., 2I]."""

    @staticmethod
    def forward(ctx, gate_up, beta, linear_beta):
        ctx.save_for_backward(gate_up)
        ctx.beta = beta, linear_beta
        gu = _rows(gate_up)
        I = gu.shape[1] // 2
        return situ_fwd(gu[:, :I], gu[:, I:], beta, linear_beta).view(*gate_up.shape[:-1], I)

    @staticmethod
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        gu = _rows(gate_up)
        I = gu.shape[1] // 2
        dgu = torch.empty(gu.shape, dtype=gu.dtype, device=gu.device)
        situ_bwd(gu[:, :I], gu[:, I:], _rows(dout), dgu[:, :I], dgu[:, I:], *ctx.beta)
        return dgu.view(gate_up.shape), None, None


def interpreted() -> bool:
    """True when the kernels were bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(situ_fwd_kernel)
