"""Token-by-token KDA recurrence: the obviously-correct oracle for values and gradients."""
from __future__ import annotations

import torch

from ._common import check_inputs, compute_dtype
from .gate import l2norm


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """Plain token loop of Kimi Delta Attention (K-first state S in R^{K x V} per head).

        S' = Diag(exp(g_t)) S_{t-1};  S_t = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = scale * S_t^T q_t

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] per-token log decay (<= 0, not cumsummed);
        beta: [B, T, H]; scale: default K^-0.5; initial_state: [N, H, K, V] (any float dtype);
        cu_seqlens: int [N+1] packed sequences (B == 1), each run from its own initial state.
    Returns:
        o [B, T, H, V] in v's dtype (fp64 for fp64 inputs), and the final state [N, H, K, V] in
        fp32 (fp64 for fp64 inputs) if output_final_state else None. Computes in max(fp32, input
        dtype) and is differentiable by autograd.
    """
    N = check_inputs("recurrent_kda", q, k, v, g, beta, initial_state, cu_seqlens, strict_state_dtype=False)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype, g.dtype) else compute_dtype(q)
    out_dtype = torch.float64 if dt == torch.float64 else v.dtype
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if initial_state is None:
        initial_state = q.new_zeros(N, H, K, V)
    h0 = initial_state.to(dt)

    if cu_seqlens is None:
        spans = [(slice(None), slice(0, T), h0)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(slice(0, 1), slice(cu[n], cu[n + 1]), h0[n:n + 1]) for n in range(N)]

    outs, finals = [], []
    for b, ts, S in spans:
        for t in range(ts.start, ts.stop):
            kt, qt = k[b, t], q[b, t]                                   # [b, H, K]
            S = g[b, t].exp()[..., None] * S                              # decay
            err = v[b, t] - torch.einsum("bhk,bhkv->bhv", kt, S)          # delta-rule error
            S = S + beta[b, t][..., None, None] * kt[..., None] * err[..., None, :]
            outs.append(scale * torch.einsum("bhk,bhkv->bhv", qt, S))
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, V)
    else:
        o = torch.cat(outs, 0).unsqueeze(0) if outs else v.new_zeros(1, 0, H, V)
    final = torch.cat(finals, 0) if output_final_state else None
    return o.to(out_dtype), final
