"""SiTU-GLU as an autograd Function in PyTorch: the forward is the reference formula; the backward
recomputes from the saved g, u (input dtype) instead of keeping autograd's fp32 intermediates.

    A = β₁·tanh(g/β₁)·σ(g),  dA/dg = sech²(g/β₁)·σ(g) + A·σ(−g)
    B = β₂·tanh(u/β₂),       dB/du = sech²(u/β₂)
    act = A·B,  dg = dact·B·dA/dg,  du = dact·A·dB/du
"""

from __future__ import annotations

import torch

from .reference import situ_glu_reference


def situ_glu_grads(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, beta: float,
                   linear_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of act(gate, up) for the upstream gradient dout; fp32 math (fp64 for fp64)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    g, u, do = gate.to(acc), up.to(acc), dout.to(acc)
    t1, s, t2 = torch.tanh(g / beta), torch.sigmoid(g), torch.tanh(u / linear_beta)
    a = beta * t1 * s
    da = (1 - t1 * t1) * s + a * torch.sigmoid(-g)
    dg = do * (linear_beta * t2) * da
    du = do * a * (1 - t2 * t2)
    return dg.to(gate.dtype), du.to(up.dtype)


class SituGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        ctx.save_for_backward(gate, up)
        ctx.beta = beta, linear_beta
        return situ_glu_reference(gate, up, beta, linear_beta)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dg, du = situ_glu_grads(gate, up, dout, *ctx.beta)
        return dg, du, None, None


class SituGLUFused(torch.autograd.Function):
    """gate_up [..., 2I] (gate half, then up half) → [..., I]; the gradient comes back as one [..., 2I]."""

    @staticmethod
    def forward(ctx, gate_up, beta, linear_beta):
        ctx.save_for_backward(gate_up)
        ctx.beta = beta, linear_beta
        g, u = gate_up.chunk(2, dim=-1)
        return situ_glu_reference(g, u, beta, linear_beta)

    @staticmethod
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        g, u = gate_up.chunk(2, dim=-1)
        return torch.cat(situ_glu_grads(g, u, dout, *ctx.beta), dim=-1), None, None
