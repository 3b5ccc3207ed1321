"""Routing and expert computation for the Stable LatentMoE (K3_SPEC §5).

The router is a fp32 sigmoid over the full-width input; the selection bias (`e_score_correction_bias`)
changes only *which* experts are chosen; mixing weights are the raw scores of the chosen experts,
renormalised, times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .situ import situ_glu


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
          renormalize: bool = True, scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D] → (topk_idx [N, k] long, topk_weight [N, k] fp32, scores [N, E] fp32)."""
    scores = torch.sigmoid(F.linear(x.float(), gate_weight.float()))
    choice = scores if bias is None else scores + bias.float()
    idx = torch.topk(choice, top_k, dim=-1, sorted=True).indices
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling_factor, scores


def grouped_mm_available(x: torch.Tensor) -> bool:
    """`torch._grouped_mm` path: CUDA bf16 activations (bf16 weights, or fp32 master weights under autocast)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def experts_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, w3: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                    grouped: bool | None = None) -> torch.Tensor:
    """Σ_k weight_k · expert_{idx_k}(x) with SiTU-GLU experts; weights stacked as w1/w3 [E, I, L], w2 [E, L, I].

    Groups token–expert entries by expert (one sort), runs each used expert once on its rows, and
    accumulates in fp32 (fp64 for fp64 inputs). x [N, L] → [N, L] in x's dtype. On CUDA with bf16
    activations the experts run as three `torch._grouped_mm` calls (no host sync), else one loop step per
    used expert; `grouped` forces the choice.
    """
    N, K = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // K
    if grouped is None:
        grouped = grouped_mm_available(x)
    if grouped:  # three grouped GEMMs, no host sync
        dt = x.dtype
        ends = torch.bincount(flat, minlength=w1.shape[0]).cumsum(0)
        ys = grouped_situ_ffn(x[token], ends, w1.to(dt), w2.to(dt), w3.to(dt), beta, linear_beta,
                              use_grouped_mm=True)
        y = torch.zeros(N, x.shape[-1], dtype=torch.float32, device=x.device).index_add(
            0, token, ys.float() * topk_weight.reshape(-1)[order].float().unsqueeze(-1))
        return y.to(dt)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(N, x.shape[-1], dtype=acc, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token[start:start + n]
        xe = x[rows]
        h = situ_glu(F.linear(xe, w1[e]), F.linear(xe, w3[e]), beta, linear_beta)
        ye = F.linear(h, w2[e]).to(acc) * topk_weight.reshape(-1)[order[start:start + n]].unsqueeze(-1)
        out = out.index_add(0, rows, ye)
        start += n
    return out.to(x.dtype)


def grouped_situ_ffn(x: torch.Tensor, cu_seqlens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     w3: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                     use_grouped_mm: bool | None = None) -> torch.Tensor:
    """SiTU-GLU experts over row groups: x [N, L], cu_seqlens [G] inclusive ends, w1/w3 [G, I, L], w2 [G, L, I].

    Rows after cu_seqlens[-1] must be zero (they run through the last group and stay zero). With
    `torch._grouped_mm` (CUDA bf16; no host sync) or a per-group loop (needs cu_seqlens on the host)."""
    if use_grouped_mm is None:
        use_grouped_mm = (x.is_cuda and hasattr(torch, "_grouped_mm")
                          and all(t.dtype == torch.bfloat16 for t in (x, w1, w2, w3)))
    if use_grouped_mm:
        offs = cu_seqlens.to(torch.int32).clone()
        offs[-1] = x.shape[0]
        g = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
        u = torch._grouped_mm(x, w3.transpose(1, 2), offs=offs)
        return torch._grouped_mm(situ_glu(g, u, beta, linear_beta), w2.transpose(1, 2), offs=offs)
    ends = cu_seqlens.tolist()
    parts, start = [], 0
    for gi, end in enumerate(ends):
        if end > start:
            xe = x[start:end]
            parts.append(F.linear(situ_glu(F.linear(xe, w1[gi]), F.linear(xe, w3[gi]), beta, linear_beta), w2[gi]))
        start = end
    parts.append(x.new_zeros(x.shape[0] - start, w2.shape[1]))
    return torch.cat(parts)
