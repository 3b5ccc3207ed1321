"""Block Attention Residuals (K3_SPEC §4): softmax over depth of candidate block representations.

    α_i = softmax_i( w · RMSNorm(v_i) ),   h = Σ_i α_i v_i

As in the release, the RMSNorm weight is folded into the pseudo-query (score = Σ_d n(v_i)_d·norm_d·w_d
with n the weightless RMSNorm), statistics and softmax in fp32.

The oracle: stacks the candidates and keeps fp32 [N, ..., D] intermediates for autograd; the fused op
(`k3.ops.attn_res`, backends "torch" / "triton") is checked against it.
"""

from __future__ import annotations

import torch


def attn_res_reference(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Mix `sources` (each [..., D], same shape) with the pseudo-query `query` [D] (or [1, D]).

    Returns a tensor like `sources[0]`: Σ_i softmax_i(score_i)·v_i with the weights in fp32.
    """
    if not sources:
        raise ValueError("attn_res needs at least one source")
    v = torch.stack(sources, dim=0)  # [N, ..., D]
    acc = torch.promote_types(v.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
    vf = v.to(acc)
    n = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)
    w = query.reshape(-1).to(acc) * norm_weight.to(acc)  # folded query [D]
    scores = n @ w  # [N, ...]
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * vf).sum(0).to(v.dtype)
