"""RMSNorm as the release computes it: statistics in fp32, weight applied after casting back."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) * weight` over the last dim; fp32 statistics, output in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)
