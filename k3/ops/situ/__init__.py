"""SiTU-GLU, K3's soft-capped SwiGLU (K3_SPEC §5), with `situ_glu` / `situ_glu_fused` as the dispatch points.

    act(g, u) = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂)

Both GLU branches are soft-capped with β·tanh(·/β) (β₁ = 4 on the gate, β₂ = 25 on the up branch), so
|act| < β₁·β₂ = 100 per coordinate; near 0 it agrees with SwiGLU's silu(g)·u. The sigmoid reads the
*uncapped* g, as in the release. Computed in fp32 (fp64 for fp64 inputs), returned in the input dtype.

Backends: "triton" (`k3.ops.situ.triton`: one fused pass forward, one backward), "torch" (the formula in
PyTorch with a hand-written backward, `recompute.py`), "reference" (the formula under autograd,
`reference.py`); "auto" is triton for CUDA tensors when triton imports, else torch. triton and torch keep
only g and u (input dtype) for the backward, no fp32 intermediates.
"""

from __future__ import annotations

import torch

from .._compile import eager_op
from .._triton import importable

from .recompute import SituGLU, SituGLUFused, situ_glu_grads
from .reference import situ_glu_reference

__all__ = ["situ_glu", "situ_glu_fused", "gate_up_weight", "gate_up_view", "situ_glu_reference", "situ_glu_grads",
           "triton_available", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton", "reference")
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_available() -> bool:
    """True when the Triton SiTU kernels import (tried once, on first use)."""
    return importable(__name__ + ".triton")


def _backend(fn: str, backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if x.is_cuda and x.dtype in _TRITON_DTYPES and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError(f"{fn}: backend 'triton' requested but triton is not importable")
        from .triton import interpreted
        if not x.is_cuda and not interpreted():
            raise ValueError(f"{fn}: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), "
                             f"got {x.device}")
        if x.dtype not in _TRITON_DTYPES:
            raise ValueError(f"{fn}: backend 'triton' takes bf16, fp16 or fp32 tensors, got {x.dtype}")
    return backend


@eager_op
def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
             backend: str = "auto") -> torch.Tensor:
    """act(gate, up) elementwise; gate and up of one shape and dtype; output in that dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have the same shape and dtype")
    backend = _backend("situ_glu", backend, gate)
    if backend == "reference":
        return situ_glu_reference(gate, up, beta, linear_beta)
    if backend == "triton":
        from .triton import SituGLUTriton
        return SituGLUTriton.apply(gate, up, beta, linear_beta)
    return SituGLU.apply(gate, up, beta, linear_beta)


@eager_op
def situ_glu_fused(gate_up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                   backend: str = "auto") -> torch.Tensor:
    """act of one [..., 2I] tensor holding the gate half then the up half (a fused gate/up GEMM's output,
    read in place) → [..., I]; its gradient comes back as one [..., 2I] tensor for that GEMM's backward."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"situ_glu_fused: gate_up {tuple(gate_up.shape)} needs an even last dim (gate ‖ up)")
    backend = _backend("situ_glu_fused", backend, gate_up)
    if backend == "reference":
        g, u = gate_up.chunk(2, dim=-1)
        return situ_glu_reference(g, u, beta, linear_beta)
    if backend == "triton":
        from .triton import SituGLUFusedTriton
        return SituGLUFusedTriton.apply(gate_up, beta, linear_beta)
    return SituGLUFused.apply(gate_up, beta, linear_beta)


def gate_up_weight(w_gate: torch.Tensor, w_up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """w_gate ‖ w_up along dim −2 ([..., I, D] twice → [..., 2I, D]), in `dtype` (default w_gate's): the weight
    of one fused gate/up GEMM whose output `situ_glu_fused` takes. An fp32 master weight is converted in the
    same pass as the concatenation (no fp32 copy); gradients flow back to both parts."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate_up_weight: gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must match")
    dtype = w_gate.dtype if dtype is None else dtype
    if w_gate.dtype == dtype and w_up.dtype == dtype:
        return torch.cat([w_gate, w_up], dim=-2)
    return _GateUpCast.apply(w_gate, w_up, dtype)


class _GateUpCast(torch.autograd.Function):
    """The converting concatenation with a backward of two converting copies, one per half of the gradient
    (autograd's own for copies into slices of a new tensor would first clone the whole gradient)."""

    @staticmethod
    def forward(ctx, w_gate, w_up, dtype):
        I = w_gate.shape[-2]
        out = torch.empty(*w_gate.shape[:-2], 2 * I, w_gate.shape[-1], dtype=dtype, device=w_gate.device)
        out.narrow(-2, 0, I).copy_(w_gate)
        out.narrow(-2, I, I).copy_(w_up)
        ctx.I, ctx.dtypes = I, (w_gate.dtype, w_up.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        I, (dg, du) = ctx.I, ctx.dtypes
        return grad.narrow(-2, 0, I).to(dg), grad.narrow(-2, I, I).to(du), None


def gate_up_view(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor | None:
    """w_gate ‖ w_up along dim −2 WITHOUT a copy, when the two are the halves of one tensor laid out that way
    (`k3.model.moe.fuse_gate_up`): a [..., 2I, D] view of their storage, else None. For inference only: the view
    spans both parameters, so autograd would credit w_gate alone."""
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype or w_gate.device != w_up.device \
            or w_gate.dim() < 2:
        return None
    I, D = w_gate.shape[-2:]
    lead = w_gate.shape[:-2]
    stride, step = [D, 1], 2 * I * D
    for n in reversed(lead):
        stride.insert(0, step)
        step *= n
    stride = tuple(stride)
    if w_gate.stride() != stride or w_up.stride() != stride or w_up.data_ptr() != w_gate.data_ptr() \
            + I * D * w_gate.element_size() or w_gate.untyped_storage().data_ptr() != w_up.untyped_storage().data_ptr():
        return None
    return w_gate.as_strided((*lead, 2 * I, D), stride)
