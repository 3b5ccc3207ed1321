"""RMSNorm (optionally times sigmoid(gate)) as Triton kernels, forward and backward.

Rows of width D <= 8192, any number of rows; x, gate and the output in fp32/bf16/fp16, the weight in any
float dtype; all arithmetic in fp32: y = x * rsqrt(mean(x²) + eps) * w [* sigmoid(gate)], rounded once to
x's dtype. The forward stores nothing extra; the backward recomputes the row statistic from x. The weight
gradient is summed per program over a fixed set of rows, then over programs in a fixed order (deterministic).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._triton import interpreted as _interpreted, pdl
from .._triton_jit import pdl_sync

MAX_D = 8192
CFG = {
    # elements per program tile (rows x padded width; a wider row is one tile) and elements per thread:
    # warps = tile / (32 * per_thread), 4..16
    "tile": int(os.environ.get("K3_NORM_TILE", "2048")),
    "per_thread": int(os.environ.get("K3_NORM_PER_THREAD", "16")),
    # programs of the backward (each loops over row blocks; dweight partials are [P, D] fp32)
    "bwd_programs": int(os.environ.get("K3_NORM_BWD_PROGRAMS", "1024")),
}


@triton.jit
def _load_rows(ptr, rows, cols, M, D, stride, G=1, s_in=0):
    """Rows r of a [M, D] operand at r·stride, or, with G > 1, at (r // G)·stride + (r % G)·s_in: the heads of
    a row slice (the KDA gate, a column range of the joined projection) read in place."""
    m = (rows < M)[:, None] & (cols < D)[None, :]
    r = rows.to(tl.int64)
    off = (r // G) * stride + (r % G) * s_in
    return tl.load(ptr + off[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, val, rows, cols, M, D, stride):
    m = (rows < M)[:, None] & (cols < D)[None, :]
    tl.store(ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], val.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, g_ptr, y_ptr, M, D, sx, sg, sy, eps, gG, sg_in,
                        HAS_W: tl.constexpr, GATED: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                        NORM: tl.constexpr = True, PDL: tl.constexpr = False):
    """BR rows: y = x * rsqrt(mean(x²) + eps) [* w] [* sigmoid(g)]; g's rows by (sg, gG, sg_in) (`_load_rows`).
    NORM=False: no normalisation (the MLA output gate x * sigmoid(g))."""
    pdl_sync(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    y = _load_rows(x_ptr, rows, cols, M, D, sx)
    if NORM:
        y = y * (1.0 / tl.sqrt(tl.sum(y * y, 1) / D + eps))[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if GATED:
        y = y * tl.sigmoid(_load_rows(g_ptr, rows, cols, M, D, sg, gG, sg_in))
    _store_rows(y_ptr, y, rows, cols, M, D, sy)


@triton.jit
def rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, dy_ptr, dx_ptr, dg_ptr, dw_ptr, M, D, sx, sg, sdy, sdx, sdg, eps,
                        gG, sg_in, HAS_W: tl.constexpr, GATED: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Row blocks pid, pid + P, ...: dx, dgate, and this program's partial dweight [D] (fp32)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    cols = tl.arange(0, BD)
    cm = cols < D
    w = tl.full([1, BD], 1.0, tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BD], dtype=tl.float32)
    for blk in range(pid, tl.cdiv(M, BR), P):
        rows = blk * BR + tl.arange(0, BR)
        x = _load_rows(x_ptr, rows, cols, M, D, sx)
        r = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
        n = x * r[:, None]
        dy = _load_rows(dy_ptr, rows, cols, M, D, sdy)
        if GATED:
            s = tl.sigmoid(_load_rows(g_ptr, rows, cols, M, D, sg, gG, sg_in))
            _store_rows(dg_ptr, dy * n * w * s * (1.0 - s), rows, cols, M, D, sdg)
            dy = dy * s
        if HAS_W:
            dw += tl.sum(dy * n, 0)
        dn = dy * w
        dx = r[:, None] * (dn - n * (tl.sum(dn * n, 1) / D)[:, None])
        _store_rows(dx_ptr, dx, rows, cols, M, D, sdx)
    if HAS_W:
        tl.store(dw_ptr + pid.to(tl.int64) * D + cols, dw, mask=cm)


def _blocks(D):
    BD = triton.next_power_of_2(D)
    BR = max(1, CFG["tile"] // BD)
    warps = min(16, max(4, BR * BD // (32 * CFG["per_thread"])))
    return BR, BD, warps


def _rows2d(t, D):
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _gate_rows(g, D):
    """The gate as the kernels read it: (tensor, row stride, G, inner stride). A view [..., G, D] whose leading
    dims merge (a row slice of a wider tensor split into heads) is read in place, rows r at
    (r // G)·stride + (r % G)·inner; anything else as `_rows2d`."""
    if g.dim() >= 3 and g.stride(-1) == 1 and g.numel():
        try:
            g3 = g.view(-1, g.shape[-2], D)
        except RuntimeError:  # the leading dims do not merge: copied below
            g3 = None
        if g3 is not None and g3.stride(0) != g3.shape[1] * g3.stride(1):  # not plain rows: read in place
            return g3, g3.stride(0), g3.shape[1], g3.stride(1)
    g2 = _rows2d(g, D)
    return g2, g2.stride(0), 1, 0


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        D = x.shape[-1]
        x2 = _rows2d(x, D)
        g2, sg, gG, sg_in = (None, 0, 1, 0) if gate is None else _gate_rows(gate, D)
        M = x2.shape[0]
        y = torch.empty(M, D, device=x.device, dtype=x.dtype)
        BR, BD, warps = _blocks(D)
        if M:
            rms_norm_fwd_kernel[(triton.cdiv(M, BR),)](
                x2, weight if weight is not None else x2, g2 if g2 is not None else x2, y, M, D, x2.stride(0),
                sg, y.stride(0), eps, gG, sg_in,
                HAS_W=weight is not None, GATED=g2 is not None, BR=BR, BD=BD, num_warps=warps, **pdl(y))
        ctx.save_for_backward(x2, weight, g2)
        ctx.meta = (eps, x.shape, None if gate is None else gate.shape, sg, gG, sg_in)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, g2 = ctx.saved_tensors
        eps, xshape, gshape, sg, gG, sg_in = ctx.meta
        M, D = x2.shape
        dy2 = _rows2d(dy, D)
        dx = torch.empty(M, D, device=x2.device, dtype=x2.dtype)
        dg = torch.empty(M, D, device=x2.device, dtype=g2.dtype) if g2 is not None else None
        BR, BD, warps = _blocks(D)
        P = max(1, min(CFG["bwd_programs"], triton.cdiv(M, BR)))
        dwp = torch.empty(P, D, device=x2.device, dtype=torch.float32) if weight is not None else None
        if M:
            rms_norm_bwd_kernel[(P,)](
                x2, weight if weight is not None else x2, g2 if g2 is not None else x2, dy2, dx,
                dg if dg is not None else dx, dwp if dwp is not None else dx, M, D, x2.stride(0),
                sg, dy2.stride(0), dx.stride(0), dg.stride(0) if dg is not None else 0, eps, gG, sg_in,
                HAS_W=weight is not None, GATED=g2 is not None, BR=BR, BD=BD, num_warps=warps)
        elif dwp is not None:
            dwp.zero_()
        dw = dwp.sum(0).to(weight.dtype) if weight is not None else None
        return dx.view(xshape), dw, (dg.view(gshape) if dg is not None else None), None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x²) + eps) [* weight] [* sigmoid(gate)] over the last dim (<= 8192) on Triton, fp32
    arithmetic, one rounding to x's dtype. Differentiable for x, weight and gate."""
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    return _RMSNorm.apply(x, weight, gate, float(eps))


def output_gate_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) over rows of width ≤ 8192 in fp32, one rounding to x's dtype; forward only. gate may be a
    row slice of a wider tensor (read in place)."""
    D = x.shape[-1]
    x2 = _rows2d(x, D)
    g2, sg, gG, sg_in = _gate_rows(gate, D)
    M = x2.shape[0]
    y = torch.empty(M, D, device=x.device, dtype=x.dtype)
    BR, BD, warps = _blocks(D)
    if M:
        rms_norm_fwd_kernel[(triton.cdiv(M, BR),)](x2, x2, g2, y, M, D, x2.stride(0), sg, y.stride(0), 0.0, gG, sg_in,
                                                  HAS_W=False, GATED=True, BR=BR, BD=BD, NORM=False, num_warps=warps,
                                                  **pdl(y))
    return y.view(x.shape)


def interpreted() -> bool:
    """True when the kernels were bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(rms_norm_fwd_kernel)
