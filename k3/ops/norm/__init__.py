"""RMSNorm, with `rms_norm` / `rms_norm_gated` as the dispatch points.

Backends: "reference" (`reference.py`, plain PyTorch: the release's rounding, any dtype and width), "torch"
(`recompute.py`: one autograd Function keeping only the inputs and the fp32 reciprocal RMS for the backward;
any device) and "triton" (`triton.py`: rows up to 8192 wide, fp32/bf16/fp16, one pass over the rows forward and
backward, no fp32 temporaries in memory). "auto" picks triton for CUDA inputs the kernels handle, else torch.

The triton and torch paths normalise in fp32, multiplies by the weight in fp32 and rounds once to x's dtype; the
reference rounds the normalised x to x's dtype before multiplying by the weight (cast to x's dtype), as the
release does. Identical in fp32 (up to the order of fp32 operations); for bf16 inputs a bf16-level difference.
"""
from __future__ import annotations

import torch

from .._compile import eager_op
from .._triton import device_reason, importable

from .recompute import rms_norm_torch
from .reference import rms_norm_gated_reference, rms_norm_reference

__all__ = ["rms_norm", "rms_norm_gated", "output_gate", "rms_norm_reference", "rms_norm_gated_reference",
           "rms_norm_torch", "triton_available", "BACKENDS"]

BACKENDS = ("auto", "reference", "torch", "triton")
MAX_D = 8192  # widest row of the Triton kernels (one row per program tile)
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """True when the Triton RMSNorm kernels import (tried once, on first use)."""
    return importable(__name__ + ".triton")


def _triton_reason(x, weight, gate) -> str | None:
    """Why the Triton kernels cannot run this call (None: they can)."""
    D = x.shape[-1] if x.dim() else 0
    if not 1 <= D <= MAX_D:
        return f"rows must be 1..{MAX_D} wide, got {D}"
    for name, t in (("x", x), ("gate", gate)):
        if t is not None and t.dtype not in _TRITON_DTYPES:
            return f"{name} must be float32, bfloat16 or float16, got {t.dtype}"
    if weight is not None and not weight.dtype.is_floating_point:
        return f"weight must be a float tensor, got {weight.dtype}"
    return device_reason(x, __name__)


def _pick(fn, backend, x, weight, gate) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if x.is_cuda and _triton_reason(x, weight, gate) is None else "torch"
    if backend == "triton":
        why = _triton_reason(x, weight, gate)
        if why is not None:
            raise ValueError(f"{fn}: backend 'triton' cannot run this call: {why}")
    return backend


def _check(fn, x, weight, gate=None):
    if x.dim() < 1:
        raise ValueError(f"{fn}: x must have at least one dimension, got a scalar")
    D = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (D,):
        raise ValueError(f"{fn}: weight must be [{D}] (x's last dim), got {tuple(weight.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"{fn}: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")


@eager_op
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, backend: str = "auto") -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) * weight` over the last dim; fp32 statistics, output in x's dtype.
    (See the module docstring for where the backends round.)"""
    _check("rms_norm", x, weight)
    picked = _pick("rms_norm", backend, x, weight, None)
    if picked == "reference":
        return rms_norm_reference(x, weight, eps)
    if picked == "torch":
        return rms_norm_torch(x, weight, eps)
    from .triton import rms_norm_triton
    return rms_norm_triton(x, weight, eps)


@eager_op
def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor | None, gate: torch.Tensor, eps: float,
                   backend: str = "auto") -> torch.Tensor:
    """rms_norm(x in fp32) * weight * sigmoid(gate in fp32), in fp32 (fp64 for fp64 inputs on the reference
    path), output in x's dtype. gate has x's shape. The KDA layer's output: o_norm(o) * sigmoid(g_proj(x))."""
    _check("rms_norm_gated", x, weight, gate)
    picked = _pick("rms_norm_gated", backend, x, weight, gate)
    if picked == "reference":
        return rms_norm_gated_reference(x, weight, gate, eps)
    if picked == "torch":
        return rms_norm_torch(x, weight, eps, gate)
    from .triton import rms_norm_triton
    return rms_norm_triton(x, weight, eps, gate)


@eager_op
def output_gate(x: torch.Tensor, gate: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """x * sigmoid(gate) (gate of x's shape): the MLA layer's output gate. "triton" ("auto" on CUDA): one forward
    kernel, fp32 arithmetic, one rounding to x's dtype, gate read in place when it is a row slice; it has no
    backward, so "auto" takes the plain ops (sigmoid and product each rounded to x's dtype: what training
    differentiates) when autograd needs the gradient, as "torch" / "reference" always do."""
    _check("output_gate", x, None, gate)
    picked = _pick("output_gate", backend, x, None, gate)
    if picked == "triton" and torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad):
        if backend == "triton":
            raise ValueError("output_gate: backend 'triton' has no backward; call it without autograd or use 'auto'")
        picked = "torch"
    if picked != "triton":
        return x * torch.sigmoid(gate)
    from .triton import output_gate_triton
    return output_gate_triton(x, gate)
