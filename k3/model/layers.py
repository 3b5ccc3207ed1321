"""Small building blocks shared by the text model: RMSNorm and the SiTU-GLU MLP."""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from ..ops.gemv import linear
from ..ops.norm import rms_norm
from ..ops.situ import gate_up_weight


_INIT_FNS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "constant_", "zeros_", "ones_")


@contextlib.contextmanager
def no_init_weights():
    """Skip `torch.nn.init` while modules are built whose weights will be overwritten (loading, or shapes on
    the meta device, where those ops would pull in torch's decomposition stack: seconds of imports)."""
    saved = {n: getattr(nn.init, n) for n in _INIT_FNS}
    try:
        for n in _INIT_FNS:
            setattr(nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def joined_weight(owner: nn.Module, name: str, parts: list[torch.Tensor], dtype: torch.dtype,
                  multiple: int = 1) -> torch.Tensor:
    """torch.cat(parts) (rows of linear weights) in `dtype`, so several projections of one input run as one GEMM,
    with zero rows appended up to a multiple of `multiple` rows (an aligned output width: cuBLAS falls back to
    slow unaligned kernels for an odd one, e.g. K3's 6,284 joined KDA projections).

    With autograd (training) it is built per call (gradients flow to the parts). Without it (inference: the
    engine, generate, evaluation) it is cached on `owner` and rebuilt IN PLACE when a part changes (its
    version counter or storage), so a decode step reads the weights once instead of copying them, and a
    CUDA graph that captured the cached tensor stays valid; `refresh_joined_weights` rebuilds every cache
    eagerly (after a weight update, before graphs replay)."""
    rows = sum(p.shape[0] for p in parts)
    pad = -rows % multiple
    if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        zeros = [parts[0].new_zeros(pad, *parts[0].shape[1:], dtype=dtype)] if pad else []
        return torch.cat([p.to(dtype) for p in parts] + zeros)
    key = (dtype, pad, *((p.data_ptr(), p._version) for p in parts))
    cache = owner.__dict__.setdefault("_joined_weights", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        w = _build_joined(parts, dtype, None if hit is None else hit[1], rows + pad)
        cache[name] = (key, w, parts, dtype, rows + pad)
    return cache[name][1]


def _build_joined(parts, dtype, out, rows):
    if out is None or out.shape != (rows, *parts[0].shape[1:]) or out.dtype != dtype \
            or out.device != parts[0].device:  # a moved model (`.cuda()`) gets a new tensor
        out = torch.empty(rows, *parts[0].shape[1:], dtype=dtype, device=parts[0].device)
    r = 0
    with torch.no_grad():
        for p in parts:
            out[r:r + p.shape[0]].copy_(p)
            r += p.shape[0]
        out[r:].zero_()
    return out


def refresh_joined_weights(model: nn.Module) -> None:
    """Rebuild every `joined_weight` cache of `model` in place from its parts' current values."""
    for m in model.modules():
        for name, (key, w, parts, dtype, rows) in list(m.__dict__.get("_joined_weights", {}).items()):
            key = (dtype, key[1], *((p.data_ptr(), p._version) for p in parts))
            m.__dict__["_joined_weights"][name] = (key, _build_joined(parts, dtype, w, rows), parts, dtype, rows)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SituMLP(nn.Module):
    """`gate_proj` / `up_proj` / `down_proj` with SiTU-GLU: the dense layer-0 MLP and the shared experts.

    gate_proj and up_proj run as one GEMM (their weights concatenated at run time, in the autocast dtype when
    autocast is on — cached without autograd, `joined_weight`; the parameters and checkpoint names stay
    separate) whose [.., 2I] output the fused SiTU-GLU reads in place."""

    def __init__(self, hidden: int, intermediate: int, beta: float = 4.0, linear_beta: float = 25.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                residual_inplace: bool = False) -> torch.Tensor:
        """x [.., D] → down(SiTU-GLU(gate x, up x)) (+ `residual`: residual + output, in the down projection's
        epilogue without autograd; `residual_inplace`: the caller's own tensor, which it may accumulate into)."""
        if not x.is_cuda and torch.is_grad_enabled():
            # memory-lean CPU training: keep only x for the backward and recompute the [.., 2I] / [.., I]
            # intermediates there (deterministic on the CPU, so the gradients are the same)
            out = torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
            return out if residual is None else residual + out
        return self._forward(x, residual, residual_inplace)

    def _forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 residual_inplace: bool = False) -> torch.Tensor:
        dev = x.device.type
        dt = (torch.get_autocast_dtype(dev) if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev)
              else self.gate_proj.weight.dtype)
        parts = [self.gate_proj.weight, self.up_proj.weight]
        w = (gate_up_weight(*parts, dt) if torch.is_grad_enabled() and parts[0].requires_grad
             else joined_weight(self, "gate_up", parts, dt))
        return self.down(linear(x, w), residual, residual_inplace)

    def down(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None,
             residual_inplace: bool = False) -> torch.Tensor:
        """The down projection of SiTU-GLU(gate ‖ up [.., 2I]) (+ residual): SiTU-GLU is its prologue (in a decode
        step: as the GEMV loads its input)."""
        return linear(gate_up, self.down_proj.weight, add=residual, glu=(self.beta, self.linear_beta),
                      add_inplace=residual_inplace)
