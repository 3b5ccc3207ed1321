"""Recurrent KDA for decoding: a few tokens per call, or exactly one token against a state pool."""
from __future__ import annotations

import torch

from ._common import check_inputs, check_token_shapes, from_batch, prepare, to_batch, varlen_index
from .gate import l2norm


def _step(q, k, v, g, beta, S):
    """One KDA step on [N, H, *] tensors and S [N, H, K, V] (q already scaled). Out of place."""
    S = g.exp()[..., None] * S
    err = v - torch.einsum("nhk,nhkv->nhv", k, S)
    S = S + (beta[..., None] * k)[..., None] * err[..., None, :]
    return torch.einsum("nhk,nhkv->nhv", q, S), S


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """Token-recurrent KDA for decode and short prefills (fla's `fused_recurrent_kda` contract).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [N, H, K, V] fp32;
    cu_seqlens: int [N+1] with B == 1. Returns o [B, T, H, V] in v's dtype and the final state
    [N, H, K, V] fp32 (or None). Computes in fp32; all sequences step together (varlen ones are
    zero-padded, which leaves their state unchanged). Autograd-safe but not meant for training.
    """
    N = check_inputs("fused_recurrent_kda", q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta, scale, out_dtype = prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    q = q * scale
    if cu_seqlens is not None:
        idx, valid = varlen_index(cu_seqlens, T, 1, q.device)
        q, k, v, g, beta = (to_batch(x, idx, valid) for x in (q, k, v, g, beta))
    S = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for t in range(q.shape[1]):
        o_t, S = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o_t)
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    if cu_seqlens is not None:
        o = from_batch(o, valid)
    return o.to(out_dtype), (S if output_final_state else None)


def kda_decode_step(q, k, v, g, beta, state, scale=None, use_qk_l2norm_in_kernel=False,
                    state_indices=None, inplace=True):
    """Advance N sequences by ONE token each.

    Args:
        q, k, g: [N, H, K]; v: [N, H, V]; beta: [N, H].
        state: [N, H, K, V], or a pool [P, H, K, V] when state_indices [N] (long, each in [0, P),
            no duplicates) picks each sequence's slot. Any float dtype; math runs in fp32.
        inplace: write the new states into `state` (other pool slots are left untouched);
            otherwise return an updated copy and leave `state` as is.
    Returns:
        (o [N, H, V] in v's dtype, state).
    """
    N, H, K, V = check_token_shapes("kda_decode_step", q, k, v, g, beta)
    if state_indices is None:
        if tuple(state.shape) != (N, H, K, V):
            raise ValueError(f"kda_decode_step: state must have shape [N,H,K,V]={(N, H, K, V)} "
                             f"but got {tuple(state.shape)}")
    else:
        if tuple(state_indices.shape) != (N,) or state_indices.is_floating_point():
            raise ValueError(f"kda_decode_step: state_indices must be an integer tensor [N]={(N,)} "
                             f"but got {state_indices.dtype} {tuple(state_indices.shape)}")
        if state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V):
            raise ValueError(f"kda_decode_step: state pool must have shape [P,H,K,V]=(P, {H}, {K}, {V}) "
                             f"but got {tuple(state.shape)}")
        state_indices = state_indices.to(device=state.device, dtype=torch.long)
    dt = torch.float64 if state.dtype == torch.float64 else torch.float32
    out_dtype = v.dtype
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    S = state if state_indices is None else state.index_select(0, state_indices)
    o, S = _step(q * scale, k, v, g, beta, S.to(dt))
    if not inplace:
        state = state.clone()
    if state_indices is None:
        state.copy_(S)
    else:
        state.index_copy_(0, state_indices, S.to(state.dtype))
    return o.to(out_dtype), state
