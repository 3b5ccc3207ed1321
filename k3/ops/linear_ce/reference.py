"""Oracle for the fused linear + cross-entropy: materialise every logit, then the library cross-entropy."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight).float(), target)`, the logits taken in at least fp32 (fp64
    inputs stay fp64): mean over targets != ignore_index of -log softmax(hidden @ weight^T)[target];
    NaN when every target is ignored. hidden [N, D], weight [V, D], target int64 [N]."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), target,
                           ignore_index=ignore_index)
