"""Packed-document helpers: `cu_seqlens` (int32 [N+1], fla convention, over the flattened B·T tokens;
every row boundary is also a document boundary) → per-token document ids and in-document positions."""

from __future__ import annotations

import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

# whether `host_bounds` keeps each device tensor's values (K3_CU_MEMO=0: read them at every call, as before)
MEMO = os.environ.get("K3_CU_MEMO", "1") == "1"
_HOST: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (its version counter when read, its values)


def host_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """cu_seqlens' values as Python ints, read from the device once per tensor: the model's entry check and every
    KDA layer's chunk tables (12 in k3-small) ask for the same tensor, and each device read waits for the GPU to
    drain its queue mid-forward. Kept while the tensor lives and is not written in place (its version counter,
    which views share)."""
    if not MEMO:
        return tuple(cu_seqlens.tolist())
    hit = _HOST.get(cu_seqlens)
    if hit is not None and hit[0] == cu_seqlens._version:
        return hit[1]
    vals = tuple(cu_seqlens.tolist())
    _HOST[cu_seqlens] = (cu_seqlens._version, vals)
    return vals


def bounds_to(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Host cu_seqlens moved to `device` with its values remembered for `host_bounds`: a forward on the copy reads
    nothing back (a trainer building its batches on the host passes them so; the entry check then costs no sync)."""
    vals = tuple(cu_seqlens.tolist())  # cu_seqlens is on the host: no sync
    out = cu_seqlens.to(device)
    if MEMO:
        _HOST[out] = (out._version, vals)
    return out


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> None:
    """ValueError naming the fault unless cu_seqlens is an integer [N+1] from 0 to `total`, non-decreasing (one
    host read of its values, shared through `host_bounds`)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor [N+1] with N ≥ 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {cu_seqlens.dtype}")
    cu = host_bounds(cu_seqlens)
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {cu[0]}..{cu[-1]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {list(cu)}")


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
    bounds = set(host_bounds(cu_seqlens))
    return all(r * T in bounds for r in range(B + 1))
