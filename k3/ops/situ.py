"""SiTU-GLU, K3's soft-capped SwiGLU (K3_SPEC §5).

    act(g, u) = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂)

Both GLU branches are soft-capped with β·tanh(·/β) (β₁ = 4 on the gate, β₂ = 25 on the up branch), so
|act| < β₁·β₂ = 100 per coordinate; near 0 it agrees with SwiGLU's silu(g)·u. The sigmoid reads the
*uncapped* g, as in the release. Computed in fp32, returned in the input dtype.
"""

from __future__ import annotations

import torch


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)
