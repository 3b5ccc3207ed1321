"""Causal attention over packed documents, `doc_causal_attention` being the dispatch point.

Token t attends key s iff s <= t and both belong to the same document; documents are given by
`cu_seqlens` (int32 [N+1] over the flattened B·T tokens, fla convention; every row boundary is a document
boundary; None = one document per row). No backend but "reference" builds a [T, T] mask.

Backends: "flex" (torch's flex_attention, compiled once, with a BlockMask derived from the document ids;
CUDA for training: torch's flex has no CPU backward), "varlen" (PyTorch's FlashAttention over cu_seqlens with the
max logit from its own kernel, CUDA; `varlen.py`), "sdpa" (one causal SDPA call per document, any device;
reads the document bounds to the host), "reference" (dense masked SDPA, the oracle). "auto": varlen on CUDA for
half-precision inputs where PyTorch has it (`VARLEN`; K3_ATTN_VARLEN=0: flex instead), else flex on CUDA when T is a
multiple of 128, else sdpa. The k3-small training step (H100, 2026-12-05, three runs each on one machine): 570.0 ms
mean with varlen against 582.8 ms with flex (docs/benchmarks.md, session 33).
`chunk_attention` (chunk.py): one chunk of queries after cached keys whose count is a device tensor (the serving
engine's prefill graphs).
"""

from __future__ import annotations

import functools
import os

import torch

from .._compile import eager_op
from .chunk import CHUNK_BACKENDS, chunk_attention
from .flex import doc_block_mask, doc_block_tables, flex_doc_attention
from .reference import doc_attention_mask, masked_max_logit, reference_doc_attention, token_docs
from .sdpa import doc_segments, sdpa_doc_attention, segment_max_logit
from .varlen import doc_max_logit, varlen_available, varlen_doc_attention

__all__ = ["doc_causal_attention", "BACKENDS", "flex_available", "reference_doc_attention", "sdpa_doc_attention",
           "flex_doc_attention", "doc_block_mask", "doc_block_tables", "doc_attention_mask", "doc_segments",
           "token_docs", "masked_max_logit", "segment_max_logit", "chunk_attention", "CHUNK_BACKENDS",
           "varlen_doc_attention", "varlen_available", "doc_max_logit"]

BACKENDS = ("auto", "flex", "varlen", "sdpa", "reference")
VARLEN = os.environ.get("K3_ATTN_VARLEN", "1") == "1"


@functools.lru_cache(maxsize=None)
def flex_available() -> bool:
    """True when torch's flex_attention with BlockMask.from_kv_blocks and AuxRequest imports."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention  # noqa: F401
    except Exception:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


def _check(q, k, v, cu_seqlens, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"doc_causal_attention: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"doc_causal_attention: expected q, k [B, T, H, Dq] and v [B, T, H, Dv] with equal B, T, H; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
                                   or cu_seqlens.dtype.is_floating_point):
        raise ValueError(f"doc_causal_attention: cu_seqlens must be an integer tensor [N+1] with N >= 1, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")


@eager_op
def doc_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         cu_seqlens: torch.Tensor | None = None, *, return_max_logit: bool = False,
                         backend: str = "auto"):
    """Causal attention inside each packed document.

    q, k [B, T, H, Dq]; v [B, T, H, Dv]; scale multiplies q·k. Returns o [B, T, H, Dv] in q's dtype and, with
    `return_max_logit`, also the QK-clip statistic max_logit [H] (detached; fp32, fp64 for fp64 inputs
    off the flex-CUDA path): per head, the max over batch and allowed (t, s) of scale·q_t·k_s.
    The flex backend does not read cu_seqlens back to the host, so it does not validate its values
    (the model checks them once per forward); sdpa does.
    """
    _check(q, k, v, cu_seqlens, backend)
    B, T = q.shape[:2]
    if backend == "auto":
        if q.is_cuda and VARLEN and varlen_available() and q.dtype in (torch.bfloat16, torch.float16):
            backend = "varlen"
        else:
            backend = "flex" if q.is_cuda and T % 128 == 0 and flex_available() else "sdpa"
    if backend == "reference":
        return reference_doc_attention(q, k, v, scale, cu_seqlens, return_max_logit=return_max_logit)
    if backend == "sdpa":
        return sdpa_doc_attention(q, k, v, scale, cu_seqlens, return_max_logit=return_max_logit)
    if backend == "varlen":
        if not (q.is_cuda and varlen_available()):
            raise ValueError(f"doc_causal_attention: backend 'varlen' needs CUDA tensors and torch.nn.attention.varlen "
                             f"(torch {torch.__version__}, tensors on {q.device}); use 'flex' or 'sdpa'")
        return varlen_doc_attention(q, k, v, scale, cu_seqlens, return_max_logit=return_max_logit)
    if not flex_available():
        raise ValueError("doc_causal_attention: backend 'flex' needs torch.nn.attention.flex_attention with "
                         f"BlockMask.from_kv_blocks and AuxRequest (torch {torch.__version__}); use 'sdpa'")
    if not q.is_cuda and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError(f"doc_causal_attention: backend 'flex' has no backward on {q.device} (torch's "
                         "flex_attention differentiates on CUDA only); use 'sdpa' or run under no_grad")
    return flex_doc_attention(q, k, v, scale, token_docs(cu_seqlens, B, T, q.device),
                              return_max_logit=return_max_logit)
