"""Model execution over the paged pool: the runner only builds metadata and calls the model.

One forward is one packed row [1, N] of documents (decode tokens first, then prefill chunks), each continuing
its sequence's cached history: `PackedBatch` holds the index tensors (cu_seqlens, start positions, KDA slots,
MLA pages, conv-window layout, which rows want logits) and `PagedCache` lets the model's own KDA / MLA modules
read and update the pool. The runner embeds the ids, runs `lm.model` and applies the LM head to the wanted
rows only. No layer logic lives here (see k3/model/paged_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.paged_cache import PackedBatch, PagedCache
from .pool import PagePool


@dataclass
class SeqInput:
    """One sequence's share of a forward: `tokens` at positions [start, start + len)."""
    tokens: list[int]
    start: int
    state_page: int
    mla_pages: list[int]
    want_logits: bool


def text_model(model):
    """The `KimiLinearForCausalLM` inside a K3ForConditionalGeneration (or the model itself)."""
    return model.language_model if hasattr(model, "language_model") else model


class ModelRunner:
    def __init__(self, model, pool: PagePool, kda_backend: str = "auto"):
        self.lm = text_model(model)
        self.cfg = self.lm.config
        self.pool = pool
        layers = self.lm.model.decoder_layers
        self.cache = PagedCache(pool.state, pool.conv, pool.mla,
                                kda_layers=[l.layer_idx for l in layers if l.is_kda],
                                mla_layers=[l.layer_idx for l in layers if not l.is_kda],
                                kda_backend=None if kda_backend == "auto" else kda_backend)
        self.device = self.lm.lm_head.weight.device

    def batch(self, seqs: list[SeqInput]) -> PackedBatch:
        """The packed forward's metadata (decode sequences, one token each, should come first)."""
        if any(len(s.tokens) == 0 for s in seqs):
            raise ValueError("empty SeqInput: every sequence in a forward needs at least one token")
        return PackedBatch.build([len(s.tokens) for s in seqs], [s.start for s in seqs],
                                 [s.state_page for s in seqs], [s.mla_pages for s in seqs],
                                 [s.want_logits for s in seqs], self.pool.layout.block_size,
                                 self.pool.layout.conv_width, self.device)

    @torch.no_grad()
    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Run one packed forward; returns fp32 logits [R, V] for the sequences with `want_logits`, in order."""
        if not seqs:
            raise ValueError("ModelRunner.forward: no sequences")
        b = self.batch(seqs)
        ids = torch.tensor([t for s in seqs for t in s.tokens], device=self.device)
        self.cache.batch = b
        try:
            _, hn, _ = self.lm.model(self.lm.model.embed_tokens(ids)[None], cache=self.cache, rows=b.rows)
        finally:
            self.cache.batch = None
        return self.lm.lm_head(hn)[0].float()
