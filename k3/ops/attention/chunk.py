"""Causal attention of one chunk of queries after cached keys, with the key count on the device (a prefill graph's
chunk after history: static shapes, no host read).

q [N, H, Dq] are the last N of `key_len` positions; k [S, H, Dq], v [S, H, Dv] hold positions 0 .. S - 1 (S >=
key_len; rows from key_len on are ignored). Query i attends keys j <= i + key_len - N (causal, aligned to the last
key). Backends: "flash" (CUDA, bf16 / fp16: FlashAttention-2's varlen kernel with the key count as its device
`cu_seqlens_k`; it needs one head dim, so v is zero-padded to Dq), "sdpa" (any device: reads key_len to the host and
slices the keys: the oracle, and the CPU path)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .._compile import eager_op

CHUNK_BACKENDS = ("auto", "flash", "sdpa")


@functools.lru_cache(maxsize=None)
def _flash_device(index: int) -> bool:
    """FlashAttention-2 in this torch build and an Ampere-or-newer GPU."""
    return (hasattr(torch.ops.aten, "_flash_attention_forward") and torch.version.hip is None
            and torch.cuda.get_device_capability(index) >= (8, 0))


def _flash_ok(q: torch.Tensor) -> bool:
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
            and _flash_device(q.device.index if q.device.index is not None else torch.cuda.current_device()))


@eager_op
def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_len: torch.Tensor, scale: float,
                    backend: str = "auto") -> torch.Tensor:
    """o [N, H, Dv] in q's dtype (see the module docstring); key_len: int tensor [1] on q's device."""
    if backend not in CHUNK_BACKENDS:
        raise ValueError(f"chunk_attention: unknown backend {backend!r}; valid backends are "
                         f"{', '.join(CHUNK_BACKENDS)}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2] or k.shape[1:] != q.shape[1:]:
        raise ValueError(f"chunk_attention: expected q [N, H, D], k [S, H, D], v [S, H, Dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_len.numel() != 1 or key_len.dtype.is_floating_point:
        raise ValueError(f"chunk_attention: key_len must be one integer, got {key_len.dtype} {tuple(key_len.shape)}")
    N, S, Dv = q.shape[0], k.shape[0], v.shape[-1]
    if backend == "flash" or (backend == "auto" and _flash_ok(q)):
        if not _flash_ok(q):
            raise ValueError(f"chunk_attention: the flash backend needs an sm80+ GPU, bf16 / fp16 and a head dim "
                             f"<= 256 divisible by 8, got {q.device.type} {q.dtype} head dim {q.shape[-1]}")
        vp = F.pad(v, (0, q.shape[-1] - Dv)) if Dv < q.shape[-1] else v
        cq = torch.arange(2, dtype=torch.int32, device=q.device) * N  # no host→device copy (graph capture)
        ck = torch.cat([cq[:1], key_len.reshape(1).to(torch.int32)])
        o = torch.ops.aten._flash_attention_forward(q.contiguous(), k.contiguous(), vp.contiguous(), cq, ck, N, S, 0.0,
                                                    True, False, scale=scale)[0]
        return o[..., :Dv]
    L = int(key_len.reshape(-1)[0])
    if not N <= L <= S:
        raise ValueError(f"chunk_attention: key_len {L} must lie in [N={N}, S={S}]")
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[:L].transpose(0, 1)[None],
                                       v[:L].transpose(0, 1)[None], attn_mask=causal_lower_right(N, L), scale=scale)
    return o[0].transpose(0, 1)
