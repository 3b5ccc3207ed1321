"""RMSNorm (and its sigmoid-gated form) as one autograd Function in PyTorch: the memory-lean CPU path.

Autograd through the reference keeps the fp32 normalised rows and the pre-weight product (two [rows, D] tensors
per norm); this Function keeps only its inputs and the fp32 [rows] reciprocal RMS and recomputes the rest in
the backward. Arithmetic in max(x's dtype, fp32), one rounding at the end (like the Triton kernels): equal to
the reference in fp32 and fp64.
"""
from __future__ import annotations

import torch


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        ct = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(ct)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = xf * rstd
        if weight is not None:
            y = y * weight.to(ct)
        if gate is not None:
            y = y * torch.sigmoid(gate.to(ct))
        ctx.save_for_backward(x, weight, gate, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, gate, rstd = ctx.saved_tensors
        ct = rstd.dtype
        xhat = x.to(ct) * rstd
        g = dy.to(ct)
        dgate = None
        if gate is not None:
            sg = torch.sigmoid(gate.to(ct))
            y0 = xhat if weight is None else xhat * weight.to(ct)
            if ctx.needs_input_grad[2]:
                dgate = (g * y0 * sg * (1 - sg)).to(gate.dtype)
            g = g * sg
        dw = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
            g = g * weight.to(ct)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, dgate, None


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm (gate None) or rms_norm_gated through `_RMSNormFn` (see the module docstring)."""
    return _RMSNormFn.apply(x, weight, gate, eps)
