"""Oracle for document-causal attention: the dense [B, 1, T, T] mask (causal & same document) as an additive
bias to SDPA, and the QK-clip max logit over the masked dense scores in query blocks. Quadratic memory in T;
this is the path MLA used before the document-aware backends, kept as the reference they are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import doc_ids


def token_docs(cu_seqlens: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """[B, T] int64 document id of every token; cu_seqlens None: one document per row (the row index)."""
    if cu_seqlens is None:
        return torch.arange(B, device=device).unsqueeze(1).expand(B, T).contiguous()
    return doc_ids(cu_seqlens.to(device), B, T)


def doc_attention_mask(cu_seqlens: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """Boolean [B, 1, T, T]: query t may attend key s iff s <= t and both are in the same document (and row)."""
    d = token_docs(cu_seqlens, B, T, device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return ((d.unsqueeze(2) == d.unsqueeze(1)) & causal).unsqueeze(1)


@torch.no_grad()
def masked_max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, docs: torch.Tensor,
                     block: int = 512) -> torch.Tensor:
    """Per head, max over batch and allowed (t, s) of scale·q_t·k_s, in query blocks of `block` rows
    (memory O(B·H·block·T), no host sync). Scores in q's dtype as MLA computed them, the max in fp32
    (fp64 for fp64 inputs). q, k [B, T, H, Dq]; docs [B, T] → [H]."""
    B, T, H, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    best = torch.full((H,), float("-inf"), dtype=acc, device=q.device)
    pos = torch.arange(T, device=q.device)
    for s in range(0, T, block):
        e = min(s + block, T)
        sc = torch.einsum("bthd,bshd->bhts", q[:, s:e], k).to(acc) * scale
        allowed = (docs[:, s:e, None] == docs[:, None, :]) & (pos[None, s:e, None] >= pos[None, None, :])
        sc = sc.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        best = torch.maximum(best, sc.amax(dim=(0, 2, 3)))
    return best


def reference_doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            cu_seqlens: torch.Tensor | None = None, *, return_max_logit: bool = False):
    """Dense masked SDPA. q, k [B, T, H, Dq], v [B, T, H, Dv] → o [B, T, H, Dv] (, max_logit [H]).
    Masked scores get the dtype's finite minimum (as MLA's dense path did); no row is fully masked (t sees t)."""
    B, T = q.shape[:2]
    allowed = doc_attention_mask(cu_seqlens, B, T, q.device)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=bias, scale=scale).transpose(1, 2)
    if not return_max_logit:
        return o
    return o, masked_max_logit(q, k, scale, token_docs(cu_seqlens, B, T, q.device))
