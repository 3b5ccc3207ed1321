"""Fused linear + cross-entropy (the LM and MTP heads' training loss) without full-vocabulary logits.

`linear_cross_entropy` is the dispatch point. Backends: "reference" (materialise every logit, then
F.cross_entropy: the oracle), "torch" (chunked: one chunk of logits at a time, gradients formed in the
forward; any device, any float dtype including fp64), "triton" (the same chunking with a Triton kernel for the
row-wise softmax / loss / gradient; CUDA, or Triton's interpreter on CPU; bf16/fp16/fp32), "auto" (triton on
CUDA when triton imports and the dtype is not fp64, else torch). Peak extra memory of the chunked backends:
one chunk of logits (`chunk_size` rows, default ~2 GiB on CUDA, 256 MiB elsewhere) plus dhidden [N, D] and
an fp32 dweight [V, D].
"""
from __future__ import annotations

import torch

from .._compile import eager_op
from .._triton import importable

from .chunked import ce_rows_torch, default_chunk_size, linear_cross_entropy_chunked
from .reference import linear_cross_entropy_reference

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "autocast_cast", "default_chunk_size",
           "triton_available", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton", "reference")


def triton_available() -> bool:
    """True when the Triton row kernel imports (tried once, on first use, not at k3 import time)."""
    return importable(__name__ + ".triton")


def autocast_cast(t: torch.Tensor) -> torch.Tensor:
    """`t` as autocast would feed it to F.linear: cast to the autocast dtype when autocast is enabled on t's
    device and t is a float tensor other than fp64; otherwise t itself. A differentiable cast, so the
    gradient flows back to an fp32 master weight."""
    dev = t.device.type
    if t.is_floating_point() and t.dtype != torch.float64 and torch.is_autocast_enabled(dev):
        return t.to(torch.get_autocast_dtype(dev))
    return t


def _check(hidden, weight, target, chunk_size, backend):
    if backend not in BACKENDS:
        raise ValueError(f"linear_cross_entropy: unknown backend {backend!r}; valid backends are "
                         f"{', '.join(BACKENDS)}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: expected hidden [N, D] and weight [V, D], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if target.shape != (hidden.shape[0],) or target.dtype != torch.int64:
        raise ValueError(f"linear_cross_entropy: target must be int64 [{hidden.shape[0]}], got "
                         f"{target.dtype} {tuple(target.shape)}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"linear_cross_entropy: hidden and weight must be float tensors, got {hidden.dtype} "
                         f"and {weight.dtype}")
    if not (hidden.device == weight.device == target.device):
        raise ValueError(f"linear_cross_entropy: hidden, weight and target must share a device, got "
                         f"{hidden.device}, {weight.device}, {target.device}")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive row count, got {chunk_size}")


@eager_op
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         ignore_index: int = -100, chunk_size: int | None = None,
                         backend: str = "auto") -> torch.Tensor:
    """Mean over targets != ignore_index of -log softmax(hidden @ weight^T)[target]: the value and gradients
    of `F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=ignore_index)` (NaN when every
    target is ignored), without materialising the [N, V] logits (except with backend="reference").

    hidden [N, D], weight [V, D] (float, one dtype), target int64 [N] (values in [0, V) or ignore_index; not
    checked on the fast paths, which would need a host sync). Returns a 0-dim loss in max(dtype, fp32):
    fp32 for bf16/fp16/fp32 inputs, fp64 for fp64. Under autocast, hidden and weight are cast to the
    autocast dtype first, as F.linear would be. `chunk_size`: rows per chunk (default: ~2 GiB of logits on
    CUDA, 256 MiB elsewhere).
    """
    _check(hidden, weight, target, chunk_size, backend)
    hidden, weight = autocast_cast(hidden), autocast_cast(weight)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden and weight must have one dtype (outside autocast), "
                         f"got {hidden.dtype} and {weight.dtype}")
    if backend == "reference":
        return linear_cross_entropy_reference(hidden, weight, target, ignore_index)
    if backend == "auto":
        backend = ("triton" if hidden.is_cuda and hidden.dtype != torch.float64 and triton_available()
                   else "torch")
    if backend == "triton":
        if not triton_available():
            raise ValueError("linear_cross_entropy: backend 'triton' requested but triton is not importable")
        from .triton import ce_rows_triton, interpreted
        if not hidden.is_cuda and not interpreted():
            raise ValueError(f"linear_cross_entropy: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 "
                             f"on CPU), got {hidden.device}")
        if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"linear_cross_entropy: backend 'triton' takes bf16/fp16/fp32, got {hidden.dtype}")
        rows = ce_rows_triton
    else:
        rows = ce_rows_torch
    return linear_cross_entropy_chunked(hidden, weight, target, ignore_index, chunk_size, rows)
