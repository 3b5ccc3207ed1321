"""Short convolution (depthwise, causal, width <= 4) + SiLU as Triton kernels, forward and backward.

Training path only (no conv state): x [N, C] flattened tokens, their positions in their documents (or rows),
fp32 weight [C, 4] (narrower kernels are zero-padded on the left, i.e. at the oldest taps).
The forward stores only y = silu(conv(x)); the backward reloads x, recomputes the pre-activations it needs and
returns dx and per-program partial dweight sums, added up afterwards in a fixed order (deterministic).
Arithmetic is fp32 whatever the storage dtype (the reference computes in x's dtype: bf16-level differences).

Tap j of token t reads x[t - j] with weight w[:, 3 - j], and exists iff j <= pos[t] (its position in its
document, or in its row without documents). The backward therefore needs, per token t, the pre-activations of
the tokens t .. t+3 that read it, i.e. x[t-3 .. t+3]: seven shifted tiles, loaded once each.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..varlen import positions_in_doc

WMAX = 4  # kernel width handled by the kernels (the model's short_conv_kernel_size)

# Launch parameters (env-overridable for sweeps on the GPU: `benchmarks/kda_layer.py --sweep`). Chosen by
# register count for sm_90 (Triton 3.6, bf16): forward 103 registers, backward 151, no spills.
CFG = {
    "fwd_bt": int(os.environ.get("K3_CONV_FWD_BT", "16")),
    "fwd_bc": int(os.environ.get("K3_CONV_FWD_BC", "128")),
    "fwd_warps": int(os.environ.get("K3_CONV_FWD_WARPS", "4")),
    "bwd_bt": int(os.environ.get("K3_CONV_BWD_BT", "16")),
    "bwd_bc": int(os.environ.get("K3_CONV_BWD_BC", "64")),
    "bwd_warps": int(os.environ.get("K3_CONV_BWD_WARPS", "4")),
    # token tiles per backward program: the weight-gradient partials are per program ([P, 4, C] fp32)
    "bwd_tiles": int(os.environ.get("K3_CONV_BWD_TILES", "32")),
}


@triton.jit
def _pos(pos_ptr, u, N):
    """Position of tokens u [BT] in their document (or row), as a column [BT, 1]; -1 past the last token."""
    return tl.load(pos_ptr + u, mask=u < N, other=-1)[:, None]


@triton.jit
def _rows(ptr, u, cols, N, C, stride):
    """Rows u [BT] x columns `cols` of a [N, C] matrix (row stride `stride`) in fp32; 0 outside."""
    m = ((u >= 0) & (u < N))[:, None] & (cols < C)[None, :]
    off = u.to(tl.int64)[:, None] * stride + cols[None, :]
    return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _wcol(w_ptr, cols, C, k):
    """Column k of the [C, 4] fp32 weight, as a [1, BC] row."""
    return tl.load(w_ptr + cols * 4 + k, mask=cols < C, other=0.0)[None, :]


@triton.jit
def _pre(xa, xb, xc, xd, p, w0, w1, w2, w3):
    """Pre-activation of a token whose inputs x[t], x[t-1], x[t-2], x[t-3] are xa..xd, at position p."""
    a = w3 * xa
    a += tl.where(p >= 1, w2 * xb, 0.0)
    a += tl.where(p >= 2, w1 * xc, 0.0)
    a += tl.where(p >= 3, w0 * xd, 0.0)
    return a


@triton.jit
def _dpre(a, dy):
    """d(silu(a)) / da * dy."""
    s = tl.sigmoid(a)
    return dy * s * (1.0 + a * (1.0 - s))


@triton.jit
def short_conv_fwd_kernel(x_ptr, w_ptr, pos_ptr, y_ptr, N, C, sx, sy, BT: tl.constexpr, BC: tl.constexpr):
    """y = silu(conv(x)) for one [BT tokens, BC channels] tile."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    p = _pos(pos_ptr, t, N)
    w0 = _wcol(w_ptr, cols, C, 0)
    w1 = _wcol(w_ptr, cols, C, 1)
    w2 = _wcol(w_ptr, cols, C, 2)
    w3 = _wcol(w_ptr, cols, C, 3)
    a = _pre(_rows(x_ptr, t, cols, N, C, sx), _rows(x_ptr, t - 1, cols, N, C, sx),
             _rows(x_ptr, t - 2, cols, N, C, sx), _rows(x_ptr, t - 3, cols, N, C, sx), p, w0, w1, w2, w3)
    y = a * tl.sigmoid(a)
    m = (t < N)[:, None] & (cols < C)[None, :]
    tl.store(y_ptr + t.to(tl.int64)[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def short_conv_bwd_kernel(x_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, dw_ptr, N, C, sx, sdy, sdx,
                          NB: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dx for NB consecutive [BT, BC] tiles, and this program's partial dweight [4, BC] (fp32)."""
    pid_t = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = cols < C
    w0 = _wcol(w_ptr, cols, C, 0)
    w1 = _wcol(w_ptr, cols, C, 1)
    w2 = _wcol(w_ptr, cols, C, 2)
    w3 = _wcol(w_ptr, cols, C, 3)
    dw0 = tl.zeros([BC], dtype=tl.float32)
    dw1 = tl.zeros([BC], dtype=tl.float32)
    dw2 = tl.zeros([BC], dtype=tl.float32)
    dw3 = tl.zeros([BC], dtype=tl.float32)
    for b in range(NB):
        t = (pid_t * NB + b) * BT + tl.arange(0, BT)
        # pre-activation gradients d_j at tokens t + j (zero past the end: dy is 0 there); token t feeds t + j
        # through tap j iff that tap exists at t + j (same document). Ordered so that few x tiles are live.
        xm3 = _rows(x_ptr, t - 3, cols, N, C, sx)
        xm2 = _rows(x_ptr, t - 2, cols, N, C, sx)
        xm1 = _rows(x_ptr, t - 1, cols, N, C, sx)
        x0 = _rows(x_ptr, t, cols, N, C, sx)
        p0 = _pos(pos_ptr, t, N)
        d = _dpre(_pre(x0, xm1, xm2, xm3, p0, w0, w1, w2, w3), _rows(dy_ptr, t, cols, N, C, sdy))
        dw3 += tl.sum(d * x0, 0)
        dw2 += tl.sum(tl.where(p0 >= 1, d * xm1, 0.0), 0)
        dw1 += tl.sum(tl.where(p0 >= 2, d * xm2, 0.0), 0)
        dw0 += tl.sum(tl.where(p0 >= 3, d * xm3, 0.0), 0)
        dx = w3 * d
        xp1 = _rows(x_ptr, t + 1, cols, N, C, sx)
        p = _pos(pos_ptr, t + 1, N)
        d = _dpre(_pre(xp1, x0, xm1, xm2, p, w0, w1, w2, w3), _rows(dy_ptr, t + 1, cols, N, C, sdy))
        dx += tl.where(p >= 1, w2 * d, 0.0)
        xp2 = _rows(x_ptr, t + 2, cols, N, C, sx)
        p = _pos(pos_ptr, t + 2, N)
        d = _dpre(_pre(xp2, xp1, x0, xm1, p, w0, w1, w2, w3), _rows(dy_ptr, t + 2, cols, N, C, sdy))
        dx += tl.where(p >= 2, w1 * d, 0.0)
        xp3 = _rows(x_ptr, t + 3, cols, N, C, sx)
        p = _pos(pos_ptr, t + 3, N)
        d = _dpre(_pre(xp3, xp2, xp1, x0, p, w0, w1, w2, w3), _rows(dy_ptr, t + 3, cols, N, C, sdy))
        dx += tl.where(p >= 3, w0 * d, 0.0)
        m = (t < N)[:, None] & cm[None, :]
        tl.store(dx_ptr + t.to(tl.int64)[:, None] * sdx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
    base = dw_ptr + pid_t.to(tl.int64) * 4 * C + cols
    tl.store(base, dw0, mask=cm)
    tl.store(base + C, dw1, mask=cm)
    tl.store(base + 2 * C, dw2, mask=cm)
    tl.store(base + 3 * C, dw3, mask=cm)


def _launch_fwd(x2d, w4, pos, out):
    N, C = x2d.shape
    bt, bc = CFG["fwd_bt"], CFG["fwd_bc"]
    grid = (triton.cdiv(N, bt), triton.cdiv(C, bc))
    short_conv_fwd_kernel[grid](x2d, w4, pos, out, N, C, x2d.stride(0), out.stride(0), BT=bt, BC=bc,
                                num_warps=CFG["fwd_warps"])


def _launch_bwd(x2d, w4, pos, dy, dx):
    """dx (written in place, any row stride) and the weight gradient [C, 4] fp32 of one channel segment."""
    N, C = x2d.shape
    bt, bc = CFG["bwd_bt"], CFG["bwd_bc"]
    nb = max(1, min(CFG["bwd_tiles"], triton.cdiv(N, bt)))
    P = triton.cdiv(N, bt * nb)
    dwp = torch.empty(P, 4, C, device=x2d.device, dtype=torch.float32)
    short_conv_bwd_kernel[(P, triton.cdiv(C, bc))](
        x2d, w4, pos, dy, dx, dwp, N, C, x2d.stride(0), dy.stride(0), dx.stride(0), NB=nb, BT=bt, BC=bc,
        num_warps=CFG["bwd_warps"])
    return dwp.sum(0).t()


class _ShortConv(torch.autograd.Function):
    """x2d [N, C], w4 [C, 4] fp32, pos int32 [N] -> one output [N, c_i] (contiguous) per segment."""

    @staticmethod
    def forward(ctx, x2d, w4, pos, sizes):
        N = x2d.shape[0]
        outs, off = [], 0
        for c in sizes:
            y = torch.empty(N, c, device=x2d.device, dtype=x2d.dtype)
            if N and c:
                _launch_fwd(x2d[:, off:off + c], w4[off:off + c], pos, y)
            outs.append(y)
            off += c
        ctx.save_for_backward(x2d, w4, pos)
        ctx.sizes = sizes
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x2d, w4, pos = ctx.saved_tensors
        sizes = ctx.sizes
        dx = torch.empty_like(x2d)
        dws, off = [], 0
        for c, dy in zip(sizes, dys):
            if dy is None or x2d.shape[0] == 0 or c == 0:
                dx[:, off:off + c] = 0
                dws.append(w4.new_zeros(c, 4))
            else:
                dy = dy if dy.stride(-1) == 1 else dy.contiguous()
                dws.append(_launch_bwd(x2d[:, off:off + c], w4[off:off + c], pos, dy, dx[:, off:off + c]))
            off += c
        return dx, torch.cat(dws), None, None


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                      sizes: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """silu(causal depthwise conv(x)) on Triton; x [B, T, C] (fp32/bf16/fp16), weight [C, 1, W] with W <= 4.

    Without `cu_seqlens` the window stops at each row's start; with it (packed documents over the B·T
    tokens) at each document's start. Returns one tensor [B, T, c] per entry of `sizes` (channel segments
    of x, each contiguous; default: one segment of all C), in x's dtype; fp32 arithmetic. Differentiable
    for x and weight (dweight in weight's dtype).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    sizes = (C,) if sizes is None else tuple(int(s) for s in sizes)
    if sum(sizes) != C or any(s < 0 for s in sizes):
        raise ValueError(f"short_conv_triton: sizes must be non-negative and sum to C={C}, got {sizes}")
    if W > WMAX:
        raise ValueError(f"short_conv_triton: kernel width must be <= {WMAX}, got {W}")
    x2d = x.reshape(B * T, C)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    w4 = F.pad(weight.reshape(C, W).float(), (WMAX - W, 0)).contiguous()
    if cu_seqlens is not None:
        pos = positions_in_doc(cu_seqlens, B, T).reshape(-1).to(torch.int32)
    else:
        pos = torch.arange(B * T, device=x.device, dtype=torch.int32) % max(T, 1)
    outs = _ShortConv.apply(x2d, w4, pos, sizes)
    return tuple(y.view(B, T, y.shape[-1]) for y in outs)


def interpreted() -> bool:
    """True when the kernels were bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(short_conv_fwd_kernel).__name__ == "InterpretedFunction"
