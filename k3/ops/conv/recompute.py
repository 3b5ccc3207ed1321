"""Depthwise causal short conv + SiLU as one autograd Function in PyTorch: the memory-lean CPU path.

Autograd through the reference keeps a shifted, masked copy of x per tap and the pre-activation (about W + 1
[B·T, C] tensors); this Function keeps only x (and the weight), recomputes the pre-activation in the backward
and forms dx and dweight tap by tap. Training case only: no conv state. Arithmetic in max(x's dtype, fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import positions_in_doc


def _shift(x: torch.Tensor, j: int) -> torch.Tensor:
    """Rows moved down by j (x[t - j] at row t; zeros for t < j); negative j moves them up."""
    if j == 0:
        return x
    return F.pad(x, (0, 0, j, 0))[: x.shape[0]] if j > 0 else F.pad(x, (0, 0, 0, -j))[-j:]


def _positions(B: int, T: int, cu_seqlens, device) -> torch.Tensor:
    """[B·T, 1] offset of each token in its document (rows are documents without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.arange(T, device=device).repeat(B).view(-1, 1)
    return positions_in_doc(cu_seqlens, B, T).view(-1, 1)


class _ShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cu_seqlens):
        B, T, C = x.shape
        W = weight.shape[-1]
        ct = torch.promote_types(x.dtype, torch.float32)
        pos = _positions(B, T, cu_seqlens, x.device)
        xf = x.reshape(B * T, C).to(ct)
        w = weight.view(C, W).to(ct)
        pre = xf * w[:, W - 1]
        for j in range(1, W):
            pre = pre + (_shift(xf, j) * w[:, W - 1 - j]).masked_fill(pos < j, 0)
        ctx.save_for_backward(x, weight, pos)
        return F.silu(pre).to(x.dtype).view(B, T, C)

    @staticmethod
    def backward(ctx, dy):
        x, weight, pos = ctx.saved_tensors
        B, T, C = x.shape
        W = weight.shape[-1]
        ct = torch.promote_types(x.dtype, torch.float32)
        xf = x.reshape(B * T, C).to(ct)
        w = weight.view(C, W).to(ct)
        taps = [xf] + [_shift(xf, j).masked_fill(pos < j, 0) for j in range(1, W)]  # taps[j][t] = x[t - j]
        pre = sum(t * w[:, W - 1 - j] for j, t in enumerate(taps))
        sg = torch.sigmoid(pre)
        dpre = dy.reshape(B * T, C).to(ct) * sg * (1 + pre * (1 - sg))
        dx = dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.stack([(dpre * taps[W - 1 - i]).sum(0) for i in range(W)], 1)  # w[:, i] multiplies x[t-(W-1-i)]
            dw = dw.view(C, 1, W).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            dxf = dpre * w[:, W - 1]
            for j in range(1, W):  # x[s] feeds t = s + j when t's document reaches back j tokens
                dxf = dxf + _shift((dpre * w[:, W - 1 - j]).masked_fill(pos < j, 0), -j)
            dx = dxf.to(x.dtype).view(B, T, C)
        return dx, dw, None


def short_conv_torch(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """y = silu(causal depthwise conv(x)) [B, T, C] through `_ShortConvFn` (no conv state)."""
    return _ShortConvFn.apply(x, weight, cu_seqlens)
