"""Depthwise causal short convolution + SiLU in plain PyTorch: the oracle, and the decode / conv-state path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import positions_in_doc


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                         output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise conv over time, then SiLU; computed in x's dtype (the weight is cast to it).

    x [B, T, C]; weight [C, 1, W]; state [B, C, W-1]: the W-1 inputs preceding x (zeros = sequence start).
    Returns (y [B, T, C], new_state [B, C, W-1] or None): new_state is the last W-1 inputs seen.
    With `cu_seqlens` (packed documents over the flattened B·T tokens) the window never reaches into the
    previous document; states are not supported then.
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, 1, W):
        raise ValueError(f"short_conv: weight must be [{C}, 1, W], got {tuple(weight.shape)}")
    if cu_seqlens is not None:
        if state is not None or output_final_state:
            raise ValueError("short_conv: cu_seqlens cannot be combined with a conv state")
        return F.silu(_varlen_conv(x, weight, cu_seqlens)), None
    xt = x.transpose(1, 2)  # [B, C, T]
    if state is None:
        state = xt.new_zeros(B, C, W - 1)
    elif state.shape != (B, C, W - 1):
        raise ValueError(f"short_conv: state must be [{B}, {C}, {W - 1}], got {tuple(state.shape)}")
    xp = torch.cat([state.to(xt.dtype), xt], dim=-1)  # [B, C, W-1+T]
    y = F.conv1d(xp, weight.to(xt.dtype), groups=C)  # [B, C, T]
    new_state = xp[..., -(W - 1):].contiguous() if output_final_state else None
    return F.silu(y).transpose(1, 2), new_state


def _varlen_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """y_t = Σ_j w[W-1-j] · x_{t-j}, keeping only taps inside t's document (j ≤ position in document)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    pos = positions_in_doc(cu_seqlens, B, T).view(-1, 1)  # [B·T, 1]
    xf = x.reshape(B * T, C)
    w = weight.view(C, W).to(x.dtype)
    y = xf * w[:, W - 1]
    for j in range(1, W):
        shifted = F.pad(xf, (0, 0, j, 0))[: B * T]
        y = y + (shifted * w[:, W - 1 - j]).masked_fill(pos < j, 0)
    return y.view(B, T, C)
