"""Fixed-shape collectives of the reference backend (gloo on CPU, NCCL on GPU): same shapes every step."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """[n, …] on every rank → [R·n, …] (rank-major)."""
    R = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((R * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.device.type == "cuda":
        dist.all_gather_into_tensor(out, x, group=group)
    else:
        dist.all_gather(list(out.chunk(R)), x, group=group)
    return out


def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """[R, n, …] (chunk r goes to rank r) → [R, n, …] (chunk r came from rank r); equal splits."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out
