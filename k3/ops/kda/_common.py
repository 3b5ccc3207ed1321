"""Input validation and varlen packing shared by the KDA paths (internal)."""
from __future__ import annotations

import torch

from ..varlen import check_cu_seqlens


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs (oracles, gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_inputs(fn, q, k, v, g, beta, initial_state=None, cu_seqlens=None, strict_state_dtype=True) -> int:
    """Check the shapes of a KDA call and return N, the number of sequences (states).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [N, H, K, V] in fp32
    (fp64 also accepted when q is fp64); cu_seqlens: int [N+1] with B == 1.
    """
    if q.dim() != 4:
        raise ValueError(f"{fn}: q must have shape [B,T,H,K] but got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"{fn}: k must have shape [B,T,H,K]={(B, T, H, K)} but got {tuple(k.shape)}")
    if tuple(g.shape) != (B, T, H, K):
        raise ValueError(f"{fn}: g must have shape [B,T,H,K]={(B, T, H, K)} but got {tuple(g.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"{fn}: v must have shape [B,T,H,V]=({B}, {T}, {H}, V) but got {tuple(v.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"{fn}: beta must have shape [B,T,H]={(B, T, H)} but got {tuple(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{fn}: cu_seqlens requires B == 1 (packed sequences) but got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"{fn}: cu_seqlens must be an integer tensor [N+1] but got "
                             f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        V = v.shape[-1]
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(f"{fn}: initial_state must have shape [N,H,K,V]={(N, H, K, V)} "
                             f"but got {tuple(initial_state.shape)}")
        ok = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        if strict_state_dtype and initial_state.dtype not in ok:
            raise ValueError(f"{fn}: initial_state must be torch.float32 but got {initial_state.dtype}")
    return N


def check_token_shapes(fn, q, k, v, g, beta, rows="N") -> tuple[int, int, int, int]:
    """Shapes of per-token rows without a batch dim: q, k, g [N, H, K], v [N, H, V], beta [N, H]; returns
    (N, H, K, V) or raises naming the bad tensor (`rows`: the name of the first dim in the message)."""
    if q.dim() != 3:
        raise ValueError(f"{fn}: q must have shape [{rows},H,K] but got {tuple(q.shape)}")
    N, H, K = q.shape
    V = v.shape[-1]
    for name, x, shp in (("k", k, (N, H, K)), ("g", g, (N, H, K)), ("v", v, (N, H, V)), ("beta", beta, (N, H))):
        if tuple(x.shape) != shp:
            raise ValueError(f"{fn}: {name} must have shape {shp} but got {tuple(x.shape)}")
    return N, H, K, V


def varlen_index(cu_seqlens: torch.Tensor, T: int, multiple: int, device):
    """Gather index [N, L] and validity mask [N, L] that lay packed sequences out as a padded batch.

    L is the longest sequence rounded up to `multiple`; padding slots point at token 0 and are masked.
    """
    cu = torch.tensor(check_cu_seqlens(cu_seqlens, T), dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    L = -(-max(int(lens.max()), 1) // multiple) * multiple
    pos = torch.arange(L)
    valid = pos[None, :] < lens[:, None]
    idx = torch.where(valid, cu[:-1, None] + pos[None, :], 0)
    return idx.to(device), valid.to(device)


def to_batch(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[1, T, ...] packed -> [N, L, ...] zero-padded (differentiable)."""
    y = x[0][idx]
    mask = valid.reshape(valid.shape + (1,) * (y.dim() - 2))
    return torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))


def from_batch(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, L, ...] padded -> [1, T, ...] packed, in cu_seqlens order."""
    return y[valid].unsqueeze(0)


def prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Cast to the compute dtype, default the scale to K^-0.5 and L2-normalise q, k if asked.

    Returns (q, k, v, g, beta, scale, out_dtype): o goes back in v's dtype (fp64 for fp64 inputs).
    """
    dt = compute_dtype(q)
    out_dtype = torch.float64 if dt == torch.float64 else v.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        from .gate import l2norm
        q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta, scale, out_dtype
