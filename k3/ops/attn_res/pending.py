"""A sublayer's input norm(AttnRes(sources)) handed over before it is computed (a batch-1 decode step).

In a decode step each AttnRes mix feeds exactly one GEMV: the sublayer's joined input projection (KDA's six
projections, MLA's q / kv_a / g, the MoE's latent ‖ shared gate/up ‖ router, the dense MLP's gate ‖ up). The
decoder then passes a `PendingMix` instead of the mixed row, and `k3.ops.gemv.linear` forms the row inside that
GEMV (`gemv_mix_kernel`): one kernel instead of two. Anything else asks for the tensor (`materialize`, or
`resolve` on a value that may be either), which runs `attn_res_norm` as before.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from . import attn_res_norm

# whether the engine's batch-1 decode hands each mix to its GEMV (K3_ATTN_RES_IN_GEMV=1) or computes it first
# (the default until measured on a GPU; `benchmarks/serve.py` times both in one run)
IN_GEMV = os.environ.get("K3_ATTN_RES_IN_GEMV", "0") == "1"


@dataclass(frozen=True)
class PendingMix:
    """rms_norm(attn_res(sources, query, norm_weight, eps), out_weight, out_eps), shaped `shape` (the sources'
    rows times the width, any leading dims); the shape bookkeeping of a tensor (shape, dtype, device, reshape and
    indexing of leading dims of size 1), nothing else."""
    sources: tuple
    query: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    out_weight: torch.Tensor
    out_eps: float
    backend: str
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:
        return self.sources[0].dtype

    @property
    def device(self) -> torch.device:
        return self.sources[0].device

    @property
    def is_cuda(self) -> bool:
        return self.sources[0].is_cuda

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def reshape(self, *shape) -> "PendingMix":
        shape = torch.Size(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        if -1 in shape:
            known = 1
            for s in shape:
                known *= s if s != -1 else 1
            shape = torch.Size(self.numel() // max(known, 1) if s == -1 else s for s in shape)
        if shape.numel() != self.numel() or shape[-1] != self.shape[-1]:
            raise ValueError(f"PendingMix: cannot reshape {tuple(self.shape)} to {tuple(shape)}")
        return replace(self, shape=shape)

    def __getitem__(self, i) -> "PendingMix":
        if i != 0 or self.shape[0] != 1:
            raise IndexError(f"PendingMix: only [0] of a leading dimension of size 1, got [{i}] of "
                             f"{tuple(self.shape)}")
        return replace(self, shape=self.shape[1:])

    def materialize(self) -> torch.Tensor:
        """The mixed, normalised rows as a tensor (two kernels' worth: `attn_res_norm`)."""
        return attn_res_norm(list(self.sources), self.query, self.norm_weight, self.eps, self.out_weight,
                             self.out_eps, backend=self.backend).reshape(self.shape)


def resolve(x):
    """x itself when a tensor, the materialised rows of a `PendingMix`."""
    return x.materialize() if isinstance(x, PendingMix) else x
