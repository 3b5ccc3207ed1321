"""SiTU-GLU, the oracle: the formula written out with torch ops (autograd differentiates it).

    act(g, u) = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂)

Computed in fp32 (fp64 inputs in fp64), returned in the input dtype.
"""

from __future__ import annotations

import torch


def situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
                       linear_beta: float = 25.0) -> torch.Tensor:
    acc = torch.promote_types(gate.dtype, torch.float32)
    g, u = gate.to(acc), up.to(acc)
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)
