"""The routed experts' per-expert loop as one autograd Function: the memory-lean path off CUDA.

Autograd through the plain loop (`experts_forward(..., grouped=False)` before this existed) keeps, per routed
token, the gathered input row, the gate and up pre-activations, the SiTU-GLU output and the down projection's
output: ≈ 2·(L + 3I) + L values per token and route. This Function keeps only its inputs (x [N, L], the routing
weights [N, K] and the expert-sorted order) and recomputes each expert's FFN in the backward, so a MoE layer's
saved activations no longer grow with I or K (CPU training at 64K tokens). Same arithmetic as the loop: each
expert's rows in x's dtype, combined in max(x's dtype, fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .situ import situ_glu


def _expert(xe, w1, w2, w3, beta, linear_beta):
    return F.linear(situ_glu(F.linear(xe, w1), F.linear(xe, w3), beta, linear_beta), w2)


class ExpertsLoop(torch.autograd.Function):
    """x [N, L], topk_idx / topk_weight [N, K], w1 / w3 [E, I, L], w2 [E, L, I] → [N, L] in x's dtype."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weight, w1, w2, w3, beta, linear_beta):
        N, K = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
        acc = torch.promote_types(x.dtype, torch.float32)
        out = torch.zeros(N, x.shape[-1], dtype=acc, device=x.device)
        tw = topk_weight.reshape(-1)
        start = 0
        for e, n in enumerate(counts):
            if n:
                sel = order[start:start + n]
                rows = sel // K
                ye = _expert(x[rows], w1[e], w2[e], w3[e], beta, linear_beta).to(acc)
                out.index_add_(0, rows, ye * tw[sel].to(acc).unsqueeze(-1))
            start += n
        ctx.save_for_backward(x, topk_weight, w1, w2, w3, order)
        ctx.counts, ctx.K, ctx.beta, ctx.linear_beta = counts, K, beta, linear_beta
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, gout):
        x, topk_weight, w1, w2, w3, order = ctx.saved_tensors
        K, need = ctx.K, ctx.needs_input_grad
        acc = torch.promote_types(x.dtype, torch.float32)
        g = gout.to(acc)
        tw = topk_weight.reshape(-1)
        gx = torch.zeros(x.shape, dtype=acc, device=x.device) if need[0] else None
        gtw = torch.zeros(tw.shape, dtype=topk_weight.dtype, device=x.device) if need[2] else None
        gw = [torch.zeros_like(w) if need[i] else None for i, w in ((3, w1), (4, w2), (5, w3))]
        start = 0
        for e, n in enumerate(ctx.counts):
            if n:
                sel = order[start:start + n]
                rows = sel // K
                with torch.enable_grad():
                    xe = x[rows].detach().requires_grad_(need[0])
                    ws = [w[e].detach().requires_grad_(gw[i] is not None) for i, w in enumerate((w1, w2, w3))]
                    ye = _expert(xe, ws[0], ws[1], ws[2], ctx.beta, ctx.linear_beta).to(acc)
                    ge = g[rows]
                    if gtw is not None:
                        gtw[sel] = (ye.detach() * ge).sum(-1).to(gtw.dtype)
                    inputs = [t for t in [xe] + ws if t.requires_grad]
                    grads = torch.autograd.grad(ye, inputs, ge * tw[sel].to(acc).unsqueeze(-1)) if inputs else []
                grads = iter(grads)
                if need[0]:
                    gx.index_add_(0, rows, next(grads).to(acc))
                for i in range(3):
                    if gw[i] is not None:
                        gw[i][e] += next(grads)
            start += n
        return (None if gx is None else gx.to(x.dtype), None, None if gtw is None else gtw.view_as(topk_weight),
                gw[0], gw[1], gw[2], None, None)


def experts_loop(x, topk_idx, topk_weight, w1, w2, w3, beta: float = 4.0, linear_beta: float = 25.0):
    """`ExpertsLoop.apply` (see the module docstring)."""
    return ExpertsLoop.apply(x, topk_idx, topk_weight, w1, w2, w3, beta, linear_beta)
