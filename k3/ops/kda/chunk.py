"""Chunked KDA in plain PyTorch: the fla-free prefill/training path (autograd, CPU and GPU).

Within a chunk of C tokens with cumulative log decay G_t = g_1 + ... + g_t (per channel), the
delta-rule errors of the chunk satisfy (I + A_kk) d = beta*v - (beta*k*e^G) S_0, with
A_kk[t, s] = beta_t sum_c k_t[c] k_s[c] e^{G_t[c] - G_s[c]} (s < t). So with T = (I + A_kk)^{-1}
(the WY/UT form) d = u - w S_0, u = T(beta*v), w = T(beta*k*e^G), and

    o = scale * ((q*e^G) S_0 + A_qk d),   A_qk[t, s] = sum_c q_t k_s e^{G_t - G_s} (s <= t)
    S_C = e^{G_C} S_0 + (k * e^{G_C - G})^T d.

Numerics: every exponent that reaches exp() is <= 0 (no overflow, and no inf*0 in the backward).
Pairs inside a 16-token diagonal sub-block use the pairwise e^{G_t - G_s} with the non-causal
entries set to -inf before exp; pairs across sub-blocks factor through the first token r of the
later sub-block, e^{G_t - G_r} * e^{G_r - G_s} with s < r <= t.
"""
from __future__ import annotations

import torch

from ._common import check_inputs, from_batch, prepare, to_batch, varlen_index
from .gate import l2norm

SUB = 16  # sub-chunk (diagonal tile) size


def _intra_scores(a, b, G, strict):
    """sum_c a_t[c] b_s[c] exp(G_t[c] - G_s[c]) for s <= t (s < t if strict), else 0.

    a, b, G: [..., C, K] with C a multiple of SUB. Returns [..., C, C].
    """
    *lead, C, K = G.shape
    n = C // SUB
    ab, bb, Gb = (x.reshape(*lead, n, SUB, K) for x in (a, b, G))
    # Diagonal tiles: pairwise exponent, masked to -inf before exp.
    keep = torch.ones(SUB, SUB, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    E = (Gb[..., :, None, :] - Gb[..., None, :, :]).masked_fill(~keep[..., None], float("-inf")).exp()
    diag = (ab[..., :, None, :] * bb[..., None, :, :] * E).sum(-1)               # [..., n, SUB, SUB]
    # Off-diagonal tiles: anchor at the first token r of the row's sub-block (s < r <= t).
    Gr = Gb[..., :, :1, :]                                                     # [..., n, 1, K]
    a_r = ab * (Gb - Gr).exp()                                                 # exponent <= 0
    s_idx = torch.arange(C, device=G.device)
    before = s_idx[None, :] < (torch.arange(n, device=G.device) * SUB)[:, None]  # [n, C]: s < r
    x = (Gr - G[..., None, :, :]).masked_fill(~before[..., None], float("-inf"))  # [..., n, C, K]
    b_r = b[..., None, :, :] * x.exp()
    off = a_r @ b_r.transpose(-1, -2)                                          # [..., n, SUB, C]
    eye = torch.eye(n, dtype=G.dtype, device=G.device)
    A = off.reshape(*lead, n, SUB, n, SUB) + diag[..., None, :] * eye[:, None, :, None]
    return A.reshape(*lead, C, C)


def _chunk_fwd(q, k, v, g, beta, scale, h0, C, qk_l2norm=False):
    """Core on a padded batch. q, k, g: [B, H, NT*C, K]; v: [B, H, NT*C, V]; beta: [B, H, NT*C].
    qk_l2norm: L2-normalise q and k here (per token, so padding and segmenting commute with it)."""
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    B, H, Tp, K = q.shape
    V = v.shape[-1]
    NT = Tp // C
    q, k, g = (x.reshape(B, H, NT, C, K) for x in (q, k, g))
    v = v.reshape(B, H, NT, C, V)
    beta = beta.reshape(B, H, NT, C, 1)
    q = q * scale
    G = g.cumsum(-2)                                                           # [B, H, NT, C, K]
    A_kk = beta * _intra_scores(k, k, G, strict=True)
    A_qk = _intra_scores(q, k, G, strict=False)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta * k * G.exp(), beta * v], -1)
    wu = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
    w, u = wu.split([K, V], -1)
    qg = q * G.exp()
    G_last = G[..., -1:, :]
    kg = k * (G_last - G).exp()
    decay = G_last.squeeze(-2).exp()[..., None]                                # [B, H, NT, K, 1]

    S = h0
    outs = []
    for n in range(NT):
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + A_qk[:, :, n] @ v_new)
        S = decay[:, :, n] * S + kg[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2) if outs else v.new_zeros(B, H, 0, C, V)
    return o.reshape(B, H, Tp, V), S


def _segmented_fwd(q, k, v, g, beta, scale, h0, C, segment_chunks, qk_l2norm=False):
    """`_chunk_fwd` over segments of `segment_chunks` chunks, the state carried from one to the next. With
    autograd each segment is checkpointed: the backward keeps only the segment inputs and the incoming states
    (~(3K + 2V) values per token and head instead of the intra-chunk tiles, ~16·K per token and head per
    [16, 16, K] exponent tile), and recomputes one segment at a time, so memory grows linearly in T with a
    small constant. Same operations in the same order: the result is bitwise that of one `_chunk_fwd` call."""
    Tp = q.shape[2]
    L = segment_chunks * C
    if Tp <= L:
        return _chunk_fwd(q, k, v, g, beta, scale, h0, C, qk_l2norm)
    ckpt = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, h0))
    outs, S = [], h0
    for s in range(0, Tp, L):
        part = [x[:, :, s:s + L] for x in (q, k, v, g, beta)]
        if ckpt:
            o, S = torch.utils.checkpoint.checkpoint(_chunk_fwd, *part, scale, S, C, qk_l2norm,
                                                     use_reentrant=False)
        else:
            o, S = _chunk_fwd(*part, scale, S, C, qk_l2norm)
        outs.append(o)
    return torch.cat(outs, 2), S


def chunk_kda_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=64, segment_chunks=16):
    """Chunked KDA (WY/UT form, 64-token chunks in 16-token sub-chunks) in PyTorch.

    Same contract as `recurrent_kda` / fla's `chunk_kda`:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] per-token log decay (<= 0, not
        cumsummed); beta: [B, T, H]; initial_state: [N, H, K, V] fp32; cu_seqlens: int [N+1], B == 1.
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] in fp32 (or None).
    Computes in fp32 whatever the input dtype (fp64 for fp64 inputs). Any T works: the tail is
    padded with k = v = beta = g = 0, which leaves the state unchanged. Varlen sequences are
    padded to a common multiple of the chunk size and run as one batch. Under autograd, segments of
    `segment_chunks` chunks are recomputed in the backward (see `_segmented_fwd`): memory linear in T.
    """
    N = check_inputs("chunk_kda_torch", q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size % SUB != 0 or chunk_size <= 0:
        raise ValueError(f"chunk_kda_torch: chunk_size must be a positive multiple of {SUB}, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    # q/k L2 norm inside the (checkpointed) segments: the backward keeps the raw q, k only
    q, k, v, g, beta, scale, out_dtype = prepare(q, k, v, g, beta, scale, False)

    if cu_seqlens is not None:
        idx, valid = varlen_index(cu_seqlens, T, chunk_size, q.device)
        q, k, v, g, beta = (to_batch(x, idx, valid) for x in (q, k, v, g, beta))
    Tp = -(-q.shape[1] // chunk_size) * chunk_size
    pad = Tp - q.shape[1]
    # [b, t, h, d] -> [b, h, Tp, d], zero-padded at the tail.
    q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v, g))
    beta = torch.nn.functional.pad(beta, (0, 0, 0, pad)).transpose(1, 2)

    h0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(q.dtype)
    o, S = _segmented_fwd(q, k, v, g, beta, scale, h0, chunk_size, segment_chunks, use_qk_l2norm_in_kernel)
    o = o.transpose(1, 2)
    o = from_batch(o, valid) if cu_seqlens is not None else o[:, :T]
    return o.to(out_dtype), (S if output_final_state else None)
