"""Document-causal attention with `torch.nn.attention.flex_attention` and a BlockMask built from the
document ids (CUDA: one compiled kernel, memory linear in T).

`create_block_mask` evaluates the mask on the whole [T, T] grid (seconds per batch at T 4096), so the block
tables are derived from the document ids of each 128-token block's first and last token instead. Documents
are contiguous, so for query block i and key block j:
- full (every pair allowed, no mask_mod needed): j < i and doc(first token of j) == doc(last token of i);
- any pair allowed: j <= i and doc(last token of j) >= doc(first token of i);
- partial (mask_mod decides per pair) = any & ~full.
Everything stays on the device (no host sync), so a new batch of the same shapes reuses the compiled kernel.
T need not be a multiple of 128: the last block is short and its last token is the row's last token.
"""

from __future__ import annotations

import torch

BLOCK = 128
# Backward tiles from `benchmarks/flex_sweep.py` on the H200 (2026-12-01; B 8, T 4096, H 12, Dq 192, Dv 128, packed
# documents): forward + backward 5.39 ms vs 7.07 ms with the defaults; the forward keeps its defaults.
KERNEL_OPTIONS = {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
_COMPILED: dict[str, object] = {}  # the compiled flex_attention, built on first CUDA use


def compiled_flex():
    """`torch.compile(flex_attention, dynamic=False)`, compiled once per process (lazily)."""
    fn = _COMPILED.get("flex")
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention
        fn = _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return fn


def doc_block_tables(docs: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """docs [B, T] (non-decreasing along T) → (partial, full) bool [B, 1, n, n], n = ceil(T / block),
    indexed [b, 0, query block, key block]."""
    B, T = docs.shape
    n = -(-T // block)
    first_pos = torch.arange(n, device=docs.device) * block
    last_pos = (first_pos + block - 1).clamp(max=T - 1)
    first, last = docs[:, first_pos], docs[:, last_pos]  # [B, n]
    i = torch.arange(n, device=docs.device)
    qi, kj = i[:, None], i[None, :]
    full = (kj < qi) & (first[:, None, :] == last[:, :, None])
    anyb = (kj <= qi) & (last[:, None, :] >= first[:, :, None])
    return (anyb & ~full).unsqueeze(1), full.unsqueeze(1)


def ordered_blocks(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [..., n, n] → (num_blocks int32 [..., n], indices int32 [..., n, n]): each row's set key
    blocks first, in ascending order (a stable sort of ~table), as flex's BlockMask stores them."""
    num = table.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~table).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return num, idx


def doc_block_mask(docs: torch.Tensor, block: int = BLOCK):
    """flex BlockMask for document-causal attention over docs [B, T], built without evaluating the mask on
    a [T, T] grid. mask_mod (partial blocks only): same document and key position <= query position."""
    from torch.nn.attention.flex_attention import BlockMask

    T = docs.shape[1]
    partial, full = doc_block_tables(docs, block)

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(*ordered_blocks(partial), *ordered_blocks(full), BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(T, T))


def flex_doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, docs: torch.Tensor, *,
                       return_max_logit: bool = False, flex_fn=None):
    """q, k [B, T, H, Dq], v [B, T, H, Dv], docs [B, T] → o [B, T, H, Dv] (, max_logit fp32 [H]).

    flex_fn: the flex_attention callable (default: the compiled one on CUDA, eager elsewhere; eager flex
    materialises the scores and has no backward on CPU, so off CUDA this is for checking only). On CUDA the
    max logit comes from the kernel (`AuxRequest(max_scores=True)`: scaled scores, max over allowed keys);
    elsewhere flex cannot return it and it is computed in query blocks (`masked_max_logit`)."""
    from torch.nn.attention.flex_attention import flex_attention

    if flex_fn is None:
        flex_fn = compiled_flex() if q.is_cuda else flex_attention
    bm = doc_block_mask(docs)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if return_max_logit and q.is_cuda:
        from torch.nn.attention.flex_attention import AuxRequest

        o, aux = flex_fn(qt, kt, vt, block_mask=bm, scale=scale, return_aux=AuxRequest(max_scores=True),
                         kernel_options=KERNEL_OPTIONS)
        return o.transpose(1, 2), aux.max_scores.detach().amax(dim=(0, 2)).float()
    o = flex_fn(qt, kt, vt, block_mask=bm, scale=scale,
                kernel_options=KERNEL_OPTIONS if q.is_cuda else None).transpose(1, 2)
    if not return_max_logit:
        return o
    from .reference import masked_max_logit

    return o, masked_max_logit(q, k, scale, docs)
