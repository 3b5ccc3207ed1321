"""Block Attention Residuals (K3_SPEC §4), with `attn_res` as the dispatch point.

    α_i = softmax_i( w · RMSNorm(v_i) ),   h = Σ_i α_i v_i,   w = query ⊙ norm_weight (the release's folding)

Backends: "triton" (`triton.py`: forward kernels (one pass over whole rows with an online softmax where a row
fits, else two passes over row blocks) and a backward kernel, reading the candidates through a table of data
pointers; CUDA, or Triton's interpreter on CPU), "torch" (`fused.py`: the same autograd Function with
the math in PyTorch over chunks of rows, any device), "reference" (`reference.py`: stacks the candidates,
fp32 [N, ..., D] intermediates; the oracle). "torch" and "triton" keep for backward only the sources
themselves (no stack, no copy, no cast) plus α and rstd [N, rows] fp32. "auto": triton on CUDA when the
kernels take the sources (one dtype of bf16 / fp16 / fp32, one shape, contiguous), else torch.
Mixed-dtype sources give an output in the promoted dtype (as the reference); statistics, softmax and
accumulation in fp32 (fp64 for fp64 inputs), also under autocast.
"""
from __future__ import annotations

import contextlib

import torch

from .._compile import eager_op
from .._triton import importable, interpreted
from ..norm import rms_norm
from .fused import AttnResFunction
from .reference import attn_res_reference

__all__ = ["attn_res", "attn_res_norm", "attn_res_reference", "static_tables", "triton_available", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton", "reference")


def triton_available() -> bool:
    """True when the Triton AttnRes kernels import (tried once, on first use, not at k3 import time)."""
    return importable(__name__ + ".triton")


def static_tables(keep: list, device):
    """Context around a CUDA graph capture on `device` that writes the captured kernels' pointer tables once,
    after the capture, into an arena allocated outside the graph's pool, instead of replaying a copy into them
    (`triton.static_tables`); `keep` receives the arena (hold it as long as the graph). A no-op without Triton."""
    if not triton_available():
        return contextlib.nullcontext(keep)
    from .triton import static_tables as tables
    return tables(keep, device)


def _interpreted() -> bool:
    from .triton import attn_res_fwd_kernel
    return interpreted(attn_res_fwd_kernel)


def _check(sources, query, norm_weight) -> None:
    if not sources:
        raise ValueError("attn_res needs at least one source")
    shape = sources[0].shape
    if len(shape) < 1:
        raise ValueError("attn_res: sources must be [..., D] tensors, got a 0-d sources[0]")
    for i, t in enumerate(sources):
        if t.shape != shape:
            raise ValueError(f"attn_res: sources[{i}] has shape {tuple(t.shape)}, expected {tuple(shape)} "
                             f"(every source has sources[0]'s shape)")
        if not t.is_floating_point():
            raise ValueError(f"attn_res: sources[{i}] has dtype {t.dtype}, expected a floating dtype")
    D = shape[-1]
    if query.numel() != D:
        raise ValueError(f"attn_res: query has shape {tuple(query.shape)}, expected [{D}] or [1, {D}]")
    if norm_weight.numel() != D:
        raise ValueError(f"attn_res: norm_weight has shape {tuple(norm_weight.shape)}, expected [{D}]")


@eager_op
def attn_res(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float,
             backend: str = "auto", **opts) -> torch.Tensor:
    """Mix `sources` (each [..., D], same shape) with the pseudo-query `query` [D] (or [1, D]).

    Returns Σ_i softmax_i(score_i)·v_i shaped like `sources[0]`, in the sources' (promoted) dtype, with
    gradients for every source, query and norm_weight that require one. `backend`: see `BACKENDS` and the
    module docstring. opts (tuning/tests): chunk_rows (torch: rows per chunk), fwd / bwd (triton: dicts of
    block_r, block_d, num_warps, num_stages, unroll; see `triton.launch_config`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"attn_res: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if backend == "reference":
        return attn_res_reference(sources, query, norm_weight, eps)
    sources = list(sources)
    _check(sources, query, norm_weight)
    if backend == "auto":
        backend = "torch"
        if sources[0].is_cuda and triton_available():
            from .triton import kernel_fits
            if kernel_fits(sources) is None and query.device == sources[0].device \
                    and norm_weight.device == sources[0].device:
                backend = "triton"
    elif backend == "triton":
        if not triton_available():
            raise ValueError("attn_res: backend 'triton' requested but triton is not importable")
        from .triton import kernel_fits
        if not sources[0].is_cuda and not _interpreted():
            raise ValueError(f"attn_res: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), "
                             f"got {sources[0].device}")
        why = kernel_fits(sources)
        if why is not None:
            raise ValueError(f"attn_res: backend 'triton' cannot take these sources: {why}; use 'torch'")
    return AttnResFunction.apply(backend, opts, query, norm_weight, float(eps), *sources)


@eager_op
def attn_res_norm(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  out_weight: torch.Tensor, out_eps: float, backend: str = "auto") -> torch.Tensor:
    """rms_norm(attn_res(sources, query, norm_weight, eps), out_weight, out_eps): a sublayer's input. Without
    autograd, on CUDA (or the interpreter with backend "triton"), one Triton kernel (`attn_res_fwd_kernel` with
    its NORM epilogue: the norm reads the mix as rounded to its dtype, as the two-op path does); otherwise
    the two ops with `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"attn_res_norm: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    sources = list(sources)
    fused = not torch.is_grad_enabled() and backend in ("auto", "triton") and triton_available() \
        and (sources[0].is_cuda or (backend == "triton" and _interpreted()))
    if fused:
        from .triton import kernel_fits
        _check(sources, query, norm_weight)
        fused = kernel_fits(sources) is None and out_weight.shape == sources[0].shape[-1:] \
            and all(t.device == sources[0].device for t in (query, norm_weight, out_weight))
    if not fused:
        return rms_norm(attn_res(sources, query, norm_weight, eps, backend=backend), out_weight, out_eps)
    from .triton import attn_res_fwd_triton, attn_res_rows_triton, rows_kernel_fits
    D = sources[0].shape[-1]
    flat = [t.reshape(-1, D) for t in sources]
    # the kernels fold query ⊙ norm_weight themselves (no launches before them); few rows: one program per row
    if rows_kernel_fits(flat[0].shape[0], len(flat), D):
        h = attn_res_rows_triton(flat, norm_weight, eps, norm=(out_weight, out_eps), query=query)
    else:
        h = attn_res_fwd_triton(flat, norm_weight, eps, norm=(out_weight, out_eps), query=query, stats=False)[0]
    return h.reshape(sources[0].shape)
