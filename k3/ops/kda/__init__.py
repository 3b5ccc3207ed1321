"""Kimi Delta Attention (KDA) ops, with `chunk_kda` as the one dispatch point.

Backends: "fla" (fla.ops.kda.chunk_kda, Triton, CUDA only), "torch" (chunk_kda_torch, chunked
PyTorch with autograd, any device), "reference" (recurrent_kda, token loop). "auto" picks fla
when it is importable and the inputs are on CUDA, else torch. All share the fla contract:
q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; states [N, H, K, V] fp32 (K-first).
"""
from __future__ import annotations

import functools

from ._common import check_inputs
from .chunk import chunk_kda_torch
from .decode import fused_recurrent_kda, kda_decode_step
from .gate import kda_gate, l2norm
from .reference import recurrent_kda

__all__ = ["chunk_kda", "chunk_kda_torch", "recurrent_kda", "fused_recurrent_kda",
           "kda_decode_step", "kda_gate", "l2norm", "fla_available", "BACKENDS"]

BACKENDS = ("auto", "fla", "torch", "reference")


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """True when fla's KDA kernels import (tried once, on first use, not at k3 import time)."""
    try:
        from fla.ops.kda import chunk_kda as _  # noqa: F401
    except Exception:  # ImportError, or a broken triton/CUDA install
        return False
    return True


def _fla_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                   use_qk_l2norm_in_kernel):
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    return fla_chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto"):
    """KDA over whole sequences (training and prefill); returns (o [B, T, H, V], final state or None).

    g is the activated per-token log decay (see `kda_gate`), beta is post-sigmoid; see the
    module docstring for shapes and `BACKENDS` for the choices of `backend`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"chunk_kda: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    check_inputs("chunk_kda", q, k, v, g, beta, initial_state, cu_seqlens,
                 strict_state_dtype=backend != "reference")
    if backend == "auto":
        backend = "fla" if q.is_cuda and fla_available() else "torch"
    args = (q, k, v, g, beta)
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if backend == "fla":
        if not q.is_cuda:
            raise ValueError("chunk_kda: backend 'fla' needs CUDA tensors")
        if not fla_available():
            raise ValueError("chunk_kda: backend 'fla' requested but fla is not importable")
        return _fla_chunk_kda(*args, **kw)
    if backend == "reference":
        return recurrent_kda(*args, **kw)
    return chunk_kda_torch(*args, **kw)
