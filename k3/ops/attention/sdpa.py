"""Document-causal attention by one causal SDPA call per document (any device; the CPU path).

Each document is attended alone with `is_causal=True`, so no mask tensor exists at all. PyTorch's CPU
flash kernel (memory linear in T) is only chosen when the query/key and value head dims are equal, so the
narrower of the two is zero-padded (exact: zero key columns add nothing to a score, zero value columns give
zero outputs, sliced off). The document bounds are read to the host (`varlen.host_bounds`: once per forward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import check_cu_seqlens


def doc_segments(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[tuple[int, int]]:
    """Non-empty [start, end) token ranges over the flattened B·T tokens: the documents, also cut at every
    row boundary (attention never crosses a row, as in the dense reference)."""
    bounds = {r * T for r in range(B + 1)}
    if cu_seqlens is not None:
        bounds |= set(check_cu_seqlens(cu_seqlens, B * T))
    b = sorted(bounds)
    return [(s, e) for s, e in zip(b[:-1], b[1:]) if e > s]


@torch.no_grad()
def segment_max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, segments: list[tuple[int, int]],
                      block: int = 256) -> torch.Tensor:
    """Per head, max over segments and causal (t, s) inside a segment of scale·q_t·k_s; q, k [N, H, Dq]
    flattened tokens → [H]. Query blocks of `block` rows: the keys before the block need no mask, the
    block's own keys a [block, block] causal one; memory O(H·block·length), never [T, T]. Scores in q's
    dtype; scale (> 0, so it commutes with max) applied to the maxima, in fp32 (fp64 for fp64 inputs)."""
    H = q.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    best = torch.full((H,), float("-inf"), dtype=q.dtype, device=q.device)
    qh, kh = q.transpose(0, 1), k.transpose(0, 1)  # [H, N, Dq]
    for a, b in segments:
        for s in range(a, b, block):
            e = min(s + block, b)
            diag = torch.bmm(qh[:, s:e], kh[:, s:e].transpose(1, 2))  # [H, e - s, e - s]
            future = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
            best = torch.maximum(best, diag.masked_fill(future, float("-inf")).amax(dim=(1, 2)))
            if s > a:
                best = torch.maximum(best, torch.bmm(qh[:, s:e], kh[:, a:s].transpose(1, 2)).amax(dim=(1, 2)))
    return best.to(acc) * scale


def sdpa_doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       cu_seqlens: torch.Tensor | None = None, *, return_max_logit: bool = False):
    """q, k [B, T, H, Dq], v [B, T, H, Dv] → o [B, T, H, Dv] (, max_logit [H]); see the module docstring."""
    B, T, H, Dq = q.shape
    Dv = v.shape[-1]
    D = max(Dq, Dv)
    qp, kp, vp = (F.pad(x, (0, D - x.shape[-1])) if x.shape[-1] < D else x for x in (q, k, v))
    if cu_seqlens is None:  # one document per row: a single batched call
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                           is_causal=True, scale=scale).transpose(1, 2)[..., :Dv]
        segments = [(r * T, (r + 1) * T) for r in range(B)] if return_max_logit else []
    else:
        segments = doc_segments(cu_seqlens, B, T)
        qf, kf, vf = (x.reshape(B * T, H, D) for x in (qp, kp, vp))
        outs = []
        for a, b in segments:
            o = F.scaled_dot_product_attention(qf[a:b].transpose(0, 1)[None], kf[a:b].transpose(0, 1)[None],
                                               vf[a:b].transpose(0, 1)[None], is_causal=True, scale=scale)
            outs.append(o[0, ..., :Dv].transpose(0, 1))  # [L, H, Dv]
        o = torch.cat(outs).view(B, T, H, Dv)
    if not return_max_logit:
        return o
    return o, segment_max_logit(q.reshape(B * T, H, Dq), k.reshape(B * T, H, Dq), scale, segments)
