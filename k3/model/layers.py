"""Small building blocks shared by the text model: RMSNorm and the SiTU-GLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import rms_norm
from ..ops.situ import situ_glu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SituMLP(nn.Module):
    """`gate_proj` / `up_proj` / `down_proj` with SiTU-GLU: the dense layer-0 MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, beta: float = 4.0, linear_beta: float = 25.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
