"""Packed-document helpers: `cu_seqlens` (int32 [N+1], fla convention, over the flattened B·T tokens;
every row boundary is also a document boundary) → per-token document ids and in-document positions."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._host import to_device

# whether `remembered` / `bounds_to` keep a cu_seqlens' host values (K3_CU_MEMO=0: every consumer reads them)
MEMO = os.environ.get("K3_CU_MEMO", "1") == "1"
_HOST: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (its version counter when read, its values)


def _kept(cu_seqlens: torch.Tensor) -> tuple[int, ...] | None:
    """The values `remembered` or `bounds_to` kept for this tensor, while its version counter (which views share)
    has not moved; else None."""
    hit = _HOST.get(cu_seqlens)
    return hit[1] if hit is not None and hit[0] == cu_seqlens._version else None


def host_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """cu_seqlens' values as Python ints: kept ones (`_kept`), else read (on a GPU, a sync: the host waits for the
    queue to drain, mid-forward when a layer asks)."""
    kept = _kept(cu_seqlens)
    return kept if kept is not None else tuple(cu_seqlens.tolist())


@contextlib.contextmanager
def remembered(cu_seqlens: torch.Tensor | None):
    """Within: `host_bounds(cu_seqlens)` answers from one read made on entry. The model's forward runs its entry
    check and every layer inside, so the 12 KDA layers of k3-small build their chunk tables without a device read
    each. Scoped because a write the version counter does not see (a kernel's, a NumPy view's) could change the
    values between forwards; a tensor already kept (`bounds_to`, an outer scope) stays kept."""
    if not isinstance(cu_seqlens, torch.Tensor) or not MEMO or _kept(cu_seqlens) is not None:
        yield  # (a non-tensor fails the entry check)
        return
    _HOST[cu_seqlens] = (cu_seqlens._version, tuple(cu_seqlens.tolist()))
    try:
        yield
    finally:
        _HOST.pop(cu_seqlens, None)


def remembers_cu_seqlens(forward):
    """A forward run inside `remembered(cu_seqlens)` when cu_seqlens comes by keyword (as `K3ForConditionalGeneration`,
    the trainer and the benchmarks pass it): its checks, every layer and the MTP layers share one host read. Passed
    by position, each consumer reads it (correct, as before this existed)."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        with remembered(kwargs.get("cu_seqlens")):
            return forward(self, *args, **kwargs)
    return wrapper


def bounds_to(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Host cu_seqlens moved to `device`, its values kept for `host_bounds` while the copy lives (the caller's
    promise: the copy is written only through torch ops, which move its version). A forward on it reads nothing
    back; `k3 train` moves its batches so."""
    vals = tuple(cu_seqlens.tolist())  # on the host: no sync
    out = to_device(cu_seqlens, device)  # through pinned memory: no wait for the stream
    if MEMO:
        _HOST[out] = (out._version, vals)
    return out


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> tuple[int, ...]:
    """cu_seqlens' values (`host_bounds`: one host read, or none inside `remembered` or after `bounds_to`); a
    ValueError naming the fault unless it is an integer [N+1] from 0 to `total`, non-decreasing."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor [N+1] with N ≥ 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {cu_seqlens.dtype}")
    cu = host_bounds(cu_seqlens)
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {cu[0]}..{cu[-1]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {list(cu)}")
    return cu


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
