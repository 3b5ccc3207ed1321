"""Copies and zero-fills of word ranges inside one int64 buffer (the serving pool's pages), from a table the device
holds: what a CUDA graph runs at its start so that a step's admission copies (a cached KDA checkpoint into the
sequence's slot, a shared MLA page's rows into its own page) need no host call of their own.

Table (int64, `table_words(S)` words): [count, (src, dst, n) × S]. Segment i < count copies words [src, src + n) to
[dst, dst + n), or zero-fills [dst, dst + n) when src < 0. The segments must not overlap one another's
destinations, nor read another's destination (the caller checks, `PagePool.take_deferred`): they run in parallel.

`apply_page_ops` is the one dispatch point: the Triton kernel (`page_ops_triton.py`, one launch whose programs
share out every segment's words) on CUDA ("triton" also runs it under TRITON_INTERPRET=1), else
`page_ops_reference` (PyTorch, the table read on the host).
"""
from __future__ import annotations

import torch

from ._triton import importable


def table_words(segments: int) -> int:
    """int64 words of a table with room for `segments` segments."""
    return 1 + 3 * segments


def table_of(segments) -> list[int]:
    """The table's words for `segments` ((src, dst, n) each), without spare room: [count, src, dst, n, ...]."""
    return [len(segments), *(x for seg in segments for x in seg)]


def page_ops_reference(words: torch.Tensor, table: torch.Tensor) -> None:
    """The table's segments in order, by PyTorch slicing (reads the table on the host)."""
    t = table.tolist()
    for i in range(t[0]):
        src, dst, n = t[1 + 3 * i:4 + 3 * i]
        if src >= 0:
            words[dst:dst + n] = words[src:src + n]
        else:
            words[dst:dst + n] = 0


def _check(words: torch.Tensor, table: torch.Tensor) -> None:
    for name, t in (("words", words), ("table", table)):
        if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"apply_page_ops: {name} must be a contiguous 1-D int64 tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if (table.numel() - 1) % 3:
        raise ValueError(f"apply_page_ops: a table holds 1 + 3·S words, got {table.numel()}")
    if table.device != words.device:
        raise ValueError(f"apply_page_ops: table on {table.device}, words on {words.device}")


def apply_page_ops(words: torch.Tensor, table: torch.Tensor, backend: str = "auto") -> None:
    """Run `table`'s segments on `words` in place (see the module doc). backend: "auto" (the Triton kernel on CUDA,
    else the reference), "triton", "reference". Graph-capturable with the Triton kernel (no host read)."""
    _check(words, table)
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"apply_page_ops: backend must be auto, triton or reference, got {backend!r}")
    if backend == "triton" or (backend == "auto" and triton_available() and words.is_cuda):
        from .page_ops_triton import page_ops_triton
        return page_ops_triton(words, table)
    page_ops_reference(words, table)


def triton_available() -> bool:
    """True when the Triton kernel imports (tried once, on first use)."""
    return importable(__name__.rsplit(".", 1)[0] + ".page_ops_triton")
