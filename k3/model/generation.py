"""Plain autoregressive generation (greedy / temperature / top-k / top-p) on the incremental cache, taking
Hugging Face's generation arguments."""

from __future__ import annotations

import torch

from ..ops.sampling import filter_probs
from .cache import K3Cache
from .generation_config import resolve


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None, top_k: int = 0) -> torch.Tensor:
    """logits [B, V] → token ids [B]. temperature 0 = greedy; top_k > 0 / top_p < 1 restrict the draw (the
    serving engine's `filter_probs`, so both sample alike)."""
    if not temperature >= 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 0, got temperature={temperature}, "
                         f"top_p={top_p}, top_k={top_k}")
    if temperature == 0:
        return logits.argmax(-1)
    n = logits.shape[0]
    probs = filter_probs(logits.float(), [temperature] * n, [top_k] * n, [top_p] * n)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             generation_config=None, *, pixel_values: torch.Tensor | None = None,
             grid_thws: torch.Tensor | None = None, prefill_chunk_size: int | None = None,
             generator: torch.Generator | None = None, **kwargs) -> torch.Tensor:
    """Returns [B, T + n] = prompt ids followed by generated ids; rows that finished are padded with
    `pad_token_id` (default: the first EOS id).

    Decoding arguments are Hugging Face's (`max_new_tokens`, `max_length`, `do_sample`, `temperature`, `top_k`,
    `top_p`, `eos_token_id`, `pad_token_id`, or a `GenerationConfig`; see `generation_config.resolve`, which
    refuses the ones this loop does not implement). A left-padded batch (with `attention_mask`) gives each row
    the tokens it would get alone. `prefill_chunk_size` prefills the prompt in chunks (same result as one pass).
    """
    head = getattr(getattr(model, "language_model", model), "lm_head", None)
    args = resolve(generation_config, prompt_length=input_ids.shape[1],
                   vocab_size=None if head is None else head.out_features, **kwargs)
    if prefill_chunk_size is not None and (not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
        raise ValueError(f"prefill_chunk_size must be a positive int, got {prefill_chunk_size!r}")
    was_training = model.training
    model.eval()
    B = input_ids.shape[0]
    embeds, mask, _ = model.embed(input_ids, attention_mask, None, pixel_values, grid_thws)
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    cache = K3Cache()
    eos = torch.tensor(args.eos_token_ids, dtype=torch.long, device=input_ids.device)
    pad = args.pad_token_id if args.pad_token_id is not None else (args.eos_token_ids or [0])[0]
    temperature = args.temperature if args.do_sample else 0.0
    step = prefill_chunk_size or embeds.shape[1]
    out = None
    if args.max_new_tokens:
        for s in range(0, embeds.shape[1], step):
            out = model(inputs_embeds=embeds[:, s:s + step], attention_mask=mask[:, :s + step],
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    new = []
    for _ in range(args.max_new_tokens):
        nxt = sample_next(out.logits[:, -1], temperature, args.top_p, generator, args.top_k)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        if eos.numel():
            done |= torch.isin(nxt, eos)
        new.append(nxt)
        if done.all():
            break
        mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
    model.train(was_training)
    return torch.cat([input_ids] + [t[:, None] for t in new], dim=1) if new else input_ids
