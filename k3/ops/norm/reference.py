"""RMSNorm in plain PyTorch: the oracle (and the CPU path)."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) * weight` over the last dim as the release computes it: fp32 statistics, the
    normalised x rounded to x's dtype, then multiplied by the weight cast to x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)


def rms_norm_gated_reference(x: torch.Tensor, weight: torch.Tensor | None, gate: torch.Tensor,
                             eps: float) -> torch.Tensor:
    """rms_norm(x in fp32) * weight * sigmoid(gate in fp32), computed in fp32 (fp64 for fp64 x), returned in x's
    dtype: the KDA layer's output gate (`o_norm(o.float()) * sigmoid(g_proj(x).float())`)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    y = rms_norm_reference(x.to(ct), weight, eps) * torch.sigmoid(gate.to(ct))
    return y.to(x.dtype)
