"""Batched sampling with per-request temperature / top-k / top-p / seed, and log-probs.

Rows are processed in groups: greedy rows by one argmax; rows without a seed share one multinomial draw;
seeded rows draw from their own `torch.Generator`, so a seeded request's tokens do not depend on what
else is in the batch.
"""

from __future__ import annotations

import torch

from .request import SamplingParams


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """logits [n, V] fp32; per-row temperature (> 0), top_k (0 = off), top_p → probabilities [n, V]
    with the temperature applied and everything outside the top-k / nucleus set to zero (renormalised)."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sp, si = probs.sort(dim=-1, descending=True)
        rank = torch.arange(sp.shape[-1], device=sp.device)[None, :]
        keep = (sp.cumsum(-1) - sp) < top_p[:, None]  # smallest prefix reaching top_p (first always kept)
        keep &= (top_k[:, None] == 0) | (rank < top_k[:, None])
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """logits [n, V] fp32 → (token ids, log p(token) under log_softmax(logits))."""
    n = logits.shape[0]
    dev = logits.device
    out = torch.empty(n, dtype=torch.long, device=dev)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        gi = torch.tensor(greedy, device=dev)
        out[gi] = logits[gi].argmax(-1)
    if rand:
        ri = torch.tensor(rand, device=dev)
        probs = filter_probs(logits[ri],
                             torch.tensor([params[i].temperature for i in rand], device=dev, dtype=logits.dtype),
                             torch.tensor([params[i].top_k for i in rand], device=dev),
                             torch.tensor([params[i].top_p for i in rand], device=dev, dtype=logits.dtype))
        shared = [j for j, i in enumerate(rand) if generators[i] is None]
        if shared:
            sj = torch.tensor(shared, device=dev)
            out[ri[sj]] = torch.multinomial(probs[sj], 1).squeeze(-1)
        for j, i in enumerate(rand):
            if generators[i] is not None:
                out[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, out[:, None])[:, 0]
    return out.tolist(), lp.tolist()
