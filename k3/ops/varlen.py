"""Packed-document helpers: `cu_seqlens` (int32 [N+1], fla convention, over the flattened B·T tokens;
every row boundary is also a document boundary) → per-token document ids and in-document positions."""

from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor [N+1] with N ≥ 1, got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got "
                         f"{int(cu_seqlens[0])}..{int(cu_seqlens[-1])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {cu_seqlens.tolist()}")


def doc_ids(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B, T] int64: index of the document each token belongs to."""
    idx = torch.arange(B * T, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), idx, right=True).view(B, T)


def positions_in_doc(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B, T] int64: offset of each token from the start of its document."""
    d = doc_ids(cu_seqlens, B, T).flatten()
    return (torch.arange(B * T, device=cu_seqlens.device) - cu_seqlens.to(torch.int64)[d]).view(B, T)


def row_aligned(cu_seqlens: torch.Tensor, B: int, T: int) -> bool:
    """True when every row boundary (multiples of T) is a document boundary."""
    bounds = set(cu_seqlens.tolist())
    return all(r * T in bounds for r in range(B + 1))
