"""Depthwise causal short convolution + SiLU (fla `ShortConvolution` semantics), with `short_conv` /
`short_conv_split` as the dispatch points.

Backends: "reference" (`reference.py`, plain PyTorch in x's dtype: every case, including the decode conv
state), "torch" (`recompute.py`: one autograd Function that keeps only x for the backward -- the training
case, any device) and "triton" (`triton.py`: the training case -- no conv state, kernel width <= 4,
fp32/bf16/fp16 -- fused SiLU, fp32 arithmetic, one pass over x forward and backward). "auto" picks triton for
CUDA inputs the kernels handle, else torch without a conv state, else reference.
"""
from __future__ import annotations

import itertools

import torch

from .._compile import eager_op
from .._host import to_device
from .._triton import device_reason, importable

from .recompute import short_conv_torch
from .reference import short_conv_reference

__all__ = ["short_conv", "short_conv_split", "short_conv_step", "conv_tiles", "CONV_TILE", "short_conv_reference",
           "short_conv_torch", "triton_available", "BACKENDS"]

BACKENDS = ("auto", "reference", "torch", "triton")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """True when the Triton short-conv kernels import (tried once, on first use)."""
    return importable(__name__ + ".triton")


def _triton_reason(x, weight, stateful) -> str | None:
    """Why the Triton kernels cannot run this call (None: they can)."""
    if stateful:
        return "a conv state (decode / prefill with cache) is handled by the reference path only"
    if weight.shape[-1] > 4:
        return f"the kernels handle widths up to 4, got {weight.shape[-1]}"
    if x.dtype not in _TRITON_DTYPES:
        return f"x must be float32, bfloat16 or float16, got {x.dtype}"
    return device_reason(x, __name__)


def _pick(fn, backend, x, weight, stateful) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if backend == "auto":
        if x.is_cuda and _triton_reason(x, weight, stateful) is None:
            return "triton"
        return "reference" if stateful else "torch"
    if backend == "torch" and stateful:
        raise ValueError(f"{fn}: backend 'torch' has no conv state (decode / prefill with cache): use 'reference'")
    if backend == "triton":
        why = _triton_reason(x, weight, stateful)
        if why is not None:
            raise ValueError(f"{fn}: backend 'triton' cannot run this call: {why}")
    return backend


def _check(fn, x, weight):
    if x.dim() != 3:
        raise ValueError(f"{fn}: x must be [B, T, C], got shape {tuple(x.shape)}")
    C = x.shape[-1]
    if weight.dim() != 3 or weight.shape[:2] != (C, 1) or weight.shape[-1] < 1:
        raise ValueError(f"{fn}: weight must be [{C}, 1, W] with W >= 1, got {tuple(weight.shape)}")


@eager_op
def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
               output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise conv over time, then SiLU.

    x [B, T, C]; weight [C, 1, W]; state [B, C, W-1]: the W-1 inputs preceding x (zeros = sequence start).
    Returns (y [B, T, C] in x's dtype, new_state [B, C, W-1] or None): new_state is the last W-1 inputs seen.
    With `cu_seqlens` (packed documents over the flattened B·T tokens) the window never reaches into the
    previous document; states are not supported then. The triton backend computes in fp32 (the reference in
    x's dtype, with the weight cast to it): equal in fp32, bf16-level differences for bf16 inputs.
    """
    _check("short_conv", x, weight)
    stateful = state is not None or output_final_state
    if cu_seqlens is not None and stateful:
        raise ValueError("short_conv: cu_seqlens cannot be combined with a conv state")
    picked = _pick("short_conv", backend, x, weight, stateful)
    if picked == "reference":
        return short_conv_reference(x, weight, state, output_final_state, cu_seqlens)
    if picked == "torch":
        return short_conv_torch(x, weight, cu_seqlens), None
    from .triton import short_conv_triton
    return short_conv_triton(x, weight, cu_seqlens)[0], None


@eager_op
def short_conv_split(x: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...] | list[int],
                     cu_seqlens: torch.Tensor | None = None, backend: str = "auto") -> tuple[torch.Tensor, ...]:
    """`short_conv(x, weight, cu_seqlens=cu_seqlens)[0].split(sizes, -1)` with each piece contiguous.

    For a layer that convolves several projections at once (q, k, v from one GEMM): the triton backend
    writes each channel segment to its own contiguous tensor, so neither the pieces nor their gradients
    need a copy. No conv state (training / prefill without cache).
    """
    _check("short_conv_split", x, weight)
    sizes = tuple(int(s) for s in sizes)
    if sum(sizes) != x.shape[-1] or any(s < 0 for s in sizes):
        raise ValueError(f"short_conv_split: sizes must be non-negative and sum to C={x.shape[-1]}, got {sizes}")
    picked = _pick("short_conv_split", backend, x, weight, False)
    if picked != "triton":
        y = (short_conv_torch(x, weight, cu_seqlens) if picked == "torch"
             else short_conv_reference(x, weight, cu_seqlens=cu_seqlens)[0])
        return tuple(p.contiguous() for p in y.split(sizes, -1))
    from .triton import short_conv_triton
    return short_conv_triton(x, weight, cu_seqlens, sizes)


CONV_TILE = 32  # tokens per program of the Triton step kernels over several tokens per sequence


def conv_tiles(lens: list[int], device) -> torch.Tensor:
    """int32 [NT, 2] (sequence, first token) of every `CONV_TILE`-token tile of packed sequences of `lens` tokens,
    for `short_conv_step(..., tiles=)`: built on the host (prefill chunks, whose lengths the host knows) and sent
    through pinned memory (no host sync)."""
    cu = [0, *itertools.accumulate(lens)]
    return to_device(torch.tensor([(j, t0) for j in range(len(lens)) for t0 in range(cu[j], cu[j + 1], CONV_TILE)],
                                  dtype=torch.int32).reshape(-1, 2), device)


@eager_op
def short_conv_step(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor,
                    backend: str = "auto", cu_seqlens: torch.Tensor | None = None,
                    tiles: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens of n sequences against a pool of conv windows (the serving engine's decode and extend steps).

    x [N, C]; weight [C, 1, W]; windows [P, C, W-1]: each slot's last W-1 inputs (oldest first), a view of the
    engine's pool, updated IN PLACE at `slots` [n] (long, distinct) to include the sequence's new tokens.
    cu_seqlens (int [n + 1], optional): sequence i owns rows cu[i]..cu[i+1] of x (empty allowed; rows past cu[n]
    belong to none and get 0); without it each sequence has one token (n = N). Returns SiLU(conv) [N, C] in x's
    dtype, computed in fp32 (fp64 for fp64 inputs); equal to `short_conv` with `state` = the window. No host
    sync or data-dependent shape on the Triton path, so it can be captured in a CUDA graph.
    backend: "auto" (the one-kernel Triton form, `triton_step.py`, on CUDA), "triton" or "reference" (PyTorch
    ops, the oracle; a host loop over the sequences with cu_seqlens). tiles (with cu_seqlens, `conv_tiles(lens)`):
    the Triton form runs one program per tile of tokens (prefill chunks) instead of one per sequence; rows past
    cu[n] (a captured prefill's padding) must then lie in the last sequence's tiles, which write them as 0.
    """
    N, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, 1, W) or windows.dim() != 3 or tuple(windows.shape[1:]) != (C, W - 1):
        raise ValueError(f"short_conv_step: need weight [{C}, 1, W] and windows [P, {C}, W-1], got "
                         f"{tuple(weight.shape)} and {tuple(windows.shape)}")
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"short_conv_step: unknown backend {backend!r}; valid backends are auto, triton, reference")
    n = N if cu_seqlens is None else cu_seqlens.numel() - 1
    if slots.shape != (n,):
        raise ValueError(f"short_conv_step: need one slot per sequence ({n}), got slots {tuple(slots.shape)}")
    if backend == "triton" or (backend == "auto" and x.is_cuda and x.dtype in _TRITON_DTYPES
                               and windows[0].is_contiguous() and triton_available()):
        from .triton_step import short_conv_step_triton
        return short_conv_step_triton(x, weight, windows, slots, cu_seqlens, tiles)
    acc = torch.promote_types(x.dtype, torch.float32)
    if cu_seqlens is not None:  # the oracle: each sequence's window, then its tokens, through `short_conv`
        y = torch.zeros_like(x)
        cu = cu_seqlens.tolist()
        for i, slot in enumerate(slots.tolist()):
            if cu[i + 1] > cu[i]:
                yi, win = short_conv_reference(x[None, cu[i]:cu[i + 1]].to(acc), weight.to(acc),
                                               windows[slot][None].to(acc), output_final_state=True)
                y[cu[i]:cu[i + 1]] = yi[0].to(x.dtype)
                windows[slot] = win[0].to(windows.dtype)
        return y
    full = torch.cat([windows.index_select(0, slots).to(x.dtype), x[:, :, None]], dim=-1)  # [N, C, W]
    windows[slots] = full[..., 1:].to(windows.dtype)
    y = (full.to(acc) * weight.view(C, W).to(acc)).sum(-1)
    return torch.nn.functional.silu(y).to(x.dtype)
