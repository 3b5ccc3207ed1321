"""Document-causal attention through PyTorch's FlashAttention over cu_seqlens (`torch.nn.attention.varlen`, CUDA),
with QK-clip's max logit from its own kernel (`max_logit_triton.py`), which FlashAttention does not return.

The documents are the cu_seqlens segments cut again at every row boundary (the backends' convention: attention
never crosses a row): both bound lists concatenated and sorted on the device, so a bound present in both gives an
empty sequence, which FlashAttention skips (no host sync, no unique). The kernel takes one head dim, so v is
zero-padded to q's (exact: zero value columns give zero outputs, sliced off). `probe/mla_train_attn.py` (H200,
2026-12-05, B 8 × T 4,096, H 12, d_qk 192, d_v 128): forward + backward 5.33 ms against 8.32 for flex without the
max logit, 6.50 with it at the kernel's old launch (1.43 ms; 0.74 at `MAX_LOGIT_LAUNCH`). `auto`'s choice on CUDA.
FlashAttention-2's backward sums dq with atomic adds: gradients are not bitwise the same from run to run (flex's
backward has no atomics; `K3_ATTN_VARLEN=0` selects it)."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from ..varlen import doc_ids


@functools.lru_cache(maxsize=None)
def varlen_available() -> bool:
    """True when `torch.nn.attention.varlen.varlen_attn` imports."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except Exception:
        return False
    return True


def doc_bounds(cu_seqlens: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """int32 sorted segment bounds over the B·T flattened tokens: cu_seqlens' and every row's (repeats allowed)."""
    rows = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device)
    if cu_seqlens is None:
        return rows
    return torch.sort(torch.cat([cu_seqlens.to(device=device, dtype=torch.int32), rows])).values


def doc_first(bounds: torch.Tensor, tokens: int) -> torch.Tensor:
    """int32 [tokens]: the first token of each token's document, from `doc_bounds` over that many tokens (a
    repeated bound is an empty document: `doc_ids` skips it)."""
    return bounds[doc_ids(bounds, 1, tokens)[0]]


# the max-logit kernel's launch (query rows, key rows per tile, warps, stages): `probe/mla_train_attn.py` (H200,
# 2026-12-05, B 8 × T 4,096, H 12, d 192, 11 launches): 128 × 64, 8 warps, 2 stages 0.742 ms (128 × 64 × 4 × 3
# 0.752, 64 × 32 × 4 × 3 0.792), against 1.432 ms for the 64 × 64 × 8 × 3 it had (FlashAttention's forward: 1.52)
MAX_LOGIT_LAUNCH = (128, 64, 8, 2)


@torch.no_grad()
def doc_max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, cu_seqlens: torch.Tensor | None = None,
                  block: int | None = None, bounds: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Per head, the max over batch and allowed (t, s) of scale·q_t·k_s, fp32 [H]: q, k [B, T, H, D] (CUDA, or the
    CPU through Triton's interpreter). bounds: `doc_bounds(cu_seqlens, B, T)` when the caller has them. The
    reference is `reference.masked_max_logit`. config: the launch (query rows, key rows per tile, warps, stages),
    default `MAX_LOGIT_LAUNCH`; block: query and key rows both (the tests' small tiles)."""
    from .max_logit_triton import doc_max_logit_kernel

    B, T, H, D = q.shape
    qf, kf = q.reshape(B * T, H, D), k.reshape(B * T, H, D)
    qf, kf = (x if x.stride(-1) == 1 else x.contiguous() for x in (qf, kf))
    if bounds is None:
        bounds = doc_bounds(cu_seqlens, B, T, q.device)
    first = doc_first(bounds, B * T)
    bm, bn, warps, stages = config or ((block, block, 8, 3) if block else MAX_LOGIT_LAUNCH)
    nb = -(-(B * T) // bm)
    d1, d2 = head_parts(D)
    out = torch.empty(nb, H, dtype=torch.float32, device=q.device)
    doc_max_logit_kernel[(nb, H)](qf, kf, first, out, B * T, H, D, qf.stride(0), qf.stride(1), kf.stride(0),
                                  kf.stride(1), BM=bm, BN=bn, D1=d1, D2=d2,
                                  IEEE=q.dtype == torch.float32 or not q.is_cuda, num_warps=warps, num_stages=stages)
    return out.amax(0) * scale


def head_parts(D: int) -> tuple[int, int]:
    """A head dim as two power-of-two tile widths (each ≥ 16, the MMA's least) covering it: (the largest power of
    two ≤ D, or 16, and what the rest rounds up to, 0 when none is left): 192 → (128, 64), 128 → (128, 0)."""
    d1 = max(16, 1 << (D.bit_length() - 1))
    rest = D - d1
    return d1, 0 if rest <= 0 else max(16, 1 << (rest - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _causal_kwargs() -> dict:
    """varlen_attn's causal keyword in this torch: `is_causal` (older) or a (-1, 0) window."""
    from torch.nn.attention.varlen import varlen_attn
    return {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else {"window_size": (-1, 0)}


def varlen_doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         cu_seqlens: torch.Tensor | None = None, *, return_max_logit: bool = False):
    """q, k [B, T, H, Dq], v [B, T, H, Dv] (CUDA, half precision) → o [B, T, H, Dv] (, max_logit fp32 [H])."""
    from torch.nn.attention.varlen import varlen_attn

    B, T, H, Dq = q.shape
    Dv = v.shape[-1]
    if Dv > Dq:
        raise ValueError(f"varlen_doc_attention: v's head dim {Dv} exceeds q's {Dq}")
    bounds = doc_bounds(cu_seqlens, B, T, q.device)
    vp = F.pad(v, (0, Dq - Dv)) if Dv < Dq else v
    o = varlen_attn(q.reshape(B * T, H, Dq), k.reshape(B * T, H, Dq), vp.reshape(B * T, H, Dq), bounds, bounds, T, T,
                    scale=scale, **_causal_kwargs())
    o = o[..., :Dv].reshape(B, T, H, Dv)
    if not return_max_logit:
        return o
    return o, doc_max_logit(q.detach(), k.detach(), scale, bounds=bounds)
