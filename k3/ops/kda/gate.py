"""KDA gate and L2 norm: the elementwise pre-processing shared by every KDA path."""
from __future__ import annotations

import torch

from ._common import compute_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in fp32, returned in x's dtype.

    eps sits inside the sqrt (fla's and FlashKDA's convention), so a zero vector maps to zero.
    """
    xf = x.to(compute_dtype(x))
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """K3's lower-bounded ("safe") KDA gate: per-token, per-channel natural-log decay.

    g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias)), so g lies in (lower_bound, 0).
    The bound keeps the cumulative decay of a 16-token sub-chunk within exp range.

    Args:
        g_raw: [B, T, H, K] gate pre-activation (f_b(f_a(x))).
        A_log: [H] per-head log rate (any shape with H elements, e.g. Kimi Linear's [1, 1, H, 1]).
        dt_bias: [H*K] per-channel bias, or None.
    Returns:
        g: [B, T, H, K] in fp32 (fp64 if g_raw is fp64), not cumsummed.
    """
    if g_raw.dim() != 4:
        raise ValueError(f"kda_gate: g_raw must be [B,T,H,K] but got shape {tuple(g_raw.shape)}")
    _, _, H, K = g_raw.shape
    if A_log.numel() != H:
        raise ValueError(f"kda_gate: A_log must have H={H} elements but got shape {tuple(A_log.shape)}")
    dt = compute_dtype(g_raw)
    z = g_raw.to(dt)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(
                f"kda_gate: dt_bias must have H*K={H * K} elements but got shape {tuple(dt_bias.shape)}")
        z = z + dt_bias.to(dt).reshape(H, K)
    rate = A_log.to(dt).reshape(H, 1).exp()
    return lower_bound * torch.sigmoid(rate * z)
