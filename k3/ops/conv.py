"""Depthwise causal short convolution + SiLU (fla `ShortConvolution` semantics) with a decode cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
               output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise conv over time, then SiLU.

    x [B, T, C]; weight [C, 1, W]; state [B, C, W-1]: the W-1 inputs preceding x (zeros = sequence start).
    Returns (y [B, T, C], new_state [B, C, W-1] or None): new_state is the last W-1 inputs seen.
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, 1, W):
        raise ValueError(f"short_conv: weight must be [{C}, 1, W], got {tuple(weight.shape)}")
    xt = x.transpose(1, 2)  # [B, C, T]
    if state is None:
        state = xt.new_zeros(B, C, W - 1)
    elif state.shape != (B, C, W - 1):
        raise ValueError(f"short_conv: state must be [{B}, {C}, {W - 1}], got {tuple(state.shape)}")
    xp = torch.cat([state.to(xt.dtype), xt], dim=-1)  # [B, C, W-1+T]
    y = F.conv1d(xp, weight.to(xt.dtype), groups=C)  # [B, C, T]
    new_state = xp[..., -(W - 1):].contiguous() if output_final_state else None
    return F.silu(y).transpose(1, 2), new_state
