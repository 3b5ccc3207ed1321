"""Plain autoregressive generation (greedy / temperature / top-p) on the incremental cache."""

from __future__ import annotations

import torch

from .cache import K3Cache


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] → token ids [B]. temperature 0 = greedy; top_p < 1 = nucleus sampling."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={temperature}, top_p={top_p}")
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p  # smallest prefix whose mass reaches top_p (first always kept)
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32,
             temperature: float = 0.0, top_p: float = 1.0, eos_token_id: int | list[int] | None = None,
             pixel_values: torch.Tensor | None = None, grid_thws: torch.Tensor | None = None,
             prefill_chunk_size: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Returns [B, T + n] = prompt ids followed by generated ids (rows that hit EOS are padded with EOS).

    A left-padded batch (with `attention_mask`) gives each row the tokens it would get alone.
    `prefill_chunk_size` prefills the prompt in chunks (same result as one pass).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    B = input_ids.shape[0]
    embeds, mask, _ = model.embed(input_ids, attention_mask, None, pixel_values, grid_thws)
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    cache = K3Cache()
    eos = torch.tensor([] if eos_token_id is None else
                       ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)), device=input_ids.device)
    step = prefill_chunk_size or embeds.shape[1]
    for s in range(0, embeds.shape[1], step):
        out = model(inputs_embeds=embeds[:, s:s + step], attention_mask=mask[:, :s + step],
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    new = []
    for _ in range(max_new_tokens):
        nxt = sample_next(out.logits[:, -1], temperature, top_p, generator)
        if eos.numel():
            nxt = torch.where(done, eos[0].to(nxt.dtype), nxt)
            done |= torch.isin(nxt, eos)
        new.append(nxt)
        if done.all():
            break
        mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
    model.train(was_training)
    return torch.cat([input_ids] + [t[:, None] for t in new], dim=1) if new else input_ids
