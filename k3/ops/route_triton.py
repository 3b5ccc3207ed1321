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
def route_topk_kernel(logits_ptr, bias_ptr, scores_ptr, idx_ptr, w_ptr, E, scale,
                      K: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program n: scores = sigmoid(logits[n]); choose the K largest of scores + bias (ties: lowest expert), in
    descending order; weights = the chosen scores (÷ their sum + 1e-20 with RENORM) × scale."""
    pdl_sync(PDL)
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    m = e < E
    s = tl.sigmoid(tl.load(logits_ptr + n * E + e, mask=m, other=0.0).to(tl.float32))
    tl.store(scores_ptr + n * E + e, s, mask=m)
    c = s
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + e, mask=m, other=0.0).to(tl.float32)
    c = tl.where(m, c, float("-inf"))
    total = 0.0
    cc = c
    for _ in tl.static_range(K):  # pass 1: the sum of the chosen scores
        best = tl.max(cc, 0)
        i = tl.minimum(tl.min(tl.where(cc == best, e, BE), 0), E - 1)  # in range even for a NaN row
        total += tl.sum(tl.where(e == i, s, 0.0), 0)
        cc = tl.where(e == i, float("-inf"), cc)
    if RENORM:
        f = scale / (total + 1e-20)
    else:
        f = scale
    for j in tl.static_range(K):  # pass 2: the same choices, stored
        best = tl.max(c, 0)
        i = tl.minimum(tl.min(tl.where(c == best, e, BE), 0), E - 1)
        tl.store(idx_ptr + n * K + j, i.to(tl.int64))
        tl.store(w_ptr + n * K + j, tl.sum(tl.where(e == i, s, 0.0), 0) * f)
        c = tl.where(e == i, float("-inf"), c)


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
