"""The MoE router's selection as one Triton kernel for inference: sigmoid scores, the selection bias, top-k,
the chosen scores renormalised and scaled — one program per token instead of ~10 PyTorch kernels per layer
(`k3.ops.moe.route` is the reference and the training path: its weights need autograd)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import pdl
from ._triton_jit import pdl_sync


@triton.jit
def route_row(logits_ptr, bias_ptr, n, E, BE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Token n's router row: (expert ids e [BE], their mask, sigmoid scores s, choice keys c = s + bias, −inf
    past E). logits [N, E] fp32, contiguous rows."""
    e = tl.arange(0, BE)
    m = e < E
    s = tl.sigmoid(tl.load(logits_ptr + n * E + e, mask=m, other=0.0).to(tl.float32))
    c = s
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + e, mask=m, other=0.0).to(tl.float32)
    return e, m, s, tl.where(m, c, float("-inf"))


@triton.jit
def route_next(e, s, c, E, BE: tl.constexpr):
    """The next choice: the largest key (ties: lowest expert; in range even for a NaN row), its score, and the
    keys with it removed."""
    best = tl.max(c, 0)
    i = tl.minimum(tl.min(tl.where(c == best, e, BE), 0), E - 1)
    return i, tl.sum(tl.where(e == i, s, 0.0), 0), tl.where(e == i, float("-inf"), c)


@triton.jit
def route_factor(e, s, c, E, scale, K: tl.constexpr, BE: tl.constexpr, RENORM: tl.constexpr):
    """What each chosen score is multiplied by: scale, ÷ (the K chosen scores' sum + 1e-20) with RENORM."""
    total = 0.0
    for _ in tl.static_range(K):
        _, si, c = route_next(e, s, c, E, BE)
        total += si
    if RENORM:
        return scale / (total + 1e-20)
    return scale


@triton.jit
def route_topk_kernel(logits_ptr, bias_ptr, scores_ptr, idx_ptr, w_ptr, E, scale,
                      K: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program n: scores = sigmoid(logits[n]); choose the K largest of scores + bias (ties: lowest expert), in
    descending order; weights = the chosen scores (÷ their sum + 1e-20 with RENORM) × scale."""
    pdl_sync(PDL)
    n = tl.program_id(0).to(tl.int64)
    e, m, s, c = route_row(logits_ptr, bias_ptr, n, E, BE, HAS_BIAS)
    tl.store(scores_ptr + n * E + e, s, mask=m)
    f = route_factor(e, s, c, E, scale, K, BE, RENORM)
    for j in tl.static_range(K):  # the same choices, stored
        i, si, c = route_next(e, s, c, E, BE)
        tl.store(idx_ptr + n * K + j, i.to(tl.int64))
        tl.store(w_ptr + n * K + j, si * f)


def route_topk_triton(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                      scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 → (topk_idx [N, k] long, topk_weight [N, k] fp32, scores [N, E] fp32), as `route`."""
    N, E = logits.shape
    logits = logits.float().contiguous()
    scores = torch.empty_like(logits)
    idx = torch.empty(N, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    if N:
        route_topk_kernel[(N,)](logits, logits if bias is None else bias.float().contiguous(), scores, idx, w, E,
                                float(scaling_factor), K=top_k, BE=max(16, triton.next_power_of_2(E)),
                                HAS_BIAS=bias is not None, RENORM=renormalize, num_warps=4 if E <= 1024 else 8,
                                **pdl(w))
    return idx, w, scores
