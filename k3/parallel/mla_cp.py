"""MLA context parallelism: one Gated MLA layer on this rank's share of the sequences (training / prefill).

Layout (shared with `k3.parallel.cp`): each row of T tokens is cut into 2·P equal segments of s = T / (2·P)
tokens (P = cp ranks); rank r holds segments r and 2P−1−r, concatenated: its local row is [seg r | seg 2P−1−r]
(the causal load balance: every rank holds one early and one late segment, so the same number of
(query, key) pairs under the causal mask).

K3's MLA is NoPE: a key depends only on its token's latent, never on its position, so no rotary bookkeeping.
The layer's own pieces compute the local queries (`project_q`) and the normalised latent [c | k_pe]
(`project_latent`, what the decode cache holds); one differentiable all-gather of the latent over the cp group
(backward: a reduce-scatter of its gradient) gives every rank the whole sequence's latent, which is put in
global order and expanded to per-head keys / values by the layer (`expand_kv`). The local queries then attend
with the causal + document mask expressed in global positions: "sdpa" runs one SDPA call per contiguous query
piece (a segment, or its part inside one document) against the keys [document start, piece end) with a
lower-right causal mask, no [T, T] mask; "reference" (the oracle, `layer.attn_backend == "reference"`) builds the
dense boolean mask. The QK-clip statistic (`record_max_logit`) is the max over the local (query, key) pairs,
then all-reduced with MAX over the cp group: every rank records the whole sequence's per-head max.

Communication per layer: all-gather of B·T·(kv_lora_rank + rope) activations (each rank receives the
P−1 other shares), the same in the backward. Memory: every rank expands the whole sequence's keys and values
(B·T·H·(nope + rope + v)), kept for the backward: the limit of gathering rather than ringing the latent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..ops.attention.reference import token_docs
from .kda_cp import all_gather_cp

__all__ = ["zigzag_segments", "segment_owner", "local_positions", "row_bounds", "gather_sequence",
           "attend_global", "mla_forward_cp"]


def zigzag_segments(rank: int, size: int) -> tuple[int, int]:
    """The two global segments (of 2·size per row) that cp rank `rank` holds, in local order."""
    if not 0 <= rank < size:
        raise ValueError(f"cp rank {rank} outside [0, {size})")
    return rank, 2 * size - 1 - rank


def segment_owner(j: int, size: int) -> tuple[int, int]:
    """(rank, local slot 0 or 1) holding global segment j."""
    return (j, 0) if j < size else (2 * size - 1 - j, 1)


def local_positions(rank: int, size: int, seg_len: int, device=None) -> torch.Tensor:
    """Global in-row position of each of this rank's 2·seg_len local tokens (long [2·seg_len])."""
    a, b = zigzag_segments(rank, size)
    t = torch.arange(seg_len, device=device)
    return torch.cat([a * seg_len + t, b * seg_len + t])


def row_bounds(cu_seqlens, B: int, T: int) -> list[list[int]]:
    """Per row, the sorted document boundaries inside [0, T] (0 and T included; empty documents dropped) of
    packed documents `cu_seqlens` over the flattened B·T tokens of the whole sequences; None: [0, T] per row.
    Every row boundary must be a document boundary (a document never continues into the next row)."""
    if cu_seqlens is None:
        return [[0, T] for _ in range(B)]
    cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != B * T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to B·T={B * T} (the whole sequences), got {cu}")
    have = set(cu)
    missing = [r * T for r in range(B + 1) if r * T not in have]
    if missing:
        raise ValueError(f"context parallelism needs every row boundary to be a document boundary: "
                         f"cu_seqlens {cu} lacks {missing} (rows of T={T})")
    return [sorted({c - r * T for c in have if r * T <= c <= (r + 1) * T}) for r in range(B)]


def gather_sequence(x_local: torch.Tensor, group, size: int) -> torch.Tensor:
    """x_local [B, 2s, F] (this rank's two segments) → [B, 2·size·s, F], the whole rows in global order, by one
    differentiable all-gather (every rank's share gets the sum of all ranks' gradients)."""
    B, L, Fd = x_local.shape
    s = L // 2
    g = all_gather_cp(x_local, group).view(size, B, 2, s, Fd)
    own = [segment_owner(j, size) for j in range(2 * size)]
    ranks = torch.tensor([o[0] for o in own], device=x_local.device)
    slots = torch.tensor([o[1] for o in own], device=x_local.device)
    return g[ranks, :, slots].transpose(0, 1).reshape(B, 2 * size * s, Fd)  # [2P, B, s, F] → [B, T, F]


def _pieces(qpos_runs: list[tuple[int, int, int]], bounds: list[list[int]] | None):
    """(row or None for all rows, local query start, global start, length, key start) for each contiguous query
    piece: a run of consecutive global positions, cut at document starts; keys [key start, global end)."""
    for lo, g0, n in qpos_runs:
        if bounds is None:
            yield None, lo, g0, n, 0
            continue
        for b, bd in enumerate(bounds):
            cuts = sorted({g0, g0 + n} | {c for c in bd if g0 < c < g0 + n})
            for a, e in zip(cuts[:-1], cuts[1:]):
                d0 = max(c for c in bd if c <= a)
                yield b, lo + a - g0, a, e - a, d0


@torch.no_grad()
def _piece_max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, block: int = 256) -> torch.Tensor:
    """q [B, L, H, D], keys k [B, M, H, D] (M ≥ L, query i sees keys ≤ M − L + i) → per-head max of scale·q·k."""
    L, M, H = q.shape[1], k.shape[1], q.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    best = torch.full((H,), float("-inf"), dtype=acc, device=q.device)
    kidx = torch.arange(M, device=q.device)
    for i0 in range(0, L, block):
        i1 = min(i0 + block, L)
        m = M - L + i1
        sc = torch.einsum("bthd,bshd->bhts", q[:, i0:i1], k[:, :m]).to(acc)
        future = kidx[None, :m] > (M - L + torch.arange(i0, i1, device=q.device))[:, None]
        best = torch.maximum(best, sc.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3)))
    return best * scale


def attend_global(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, qpos: torch.Tensor,
                  bounds: list[list[int]] | None, *, return_max_logit: bool = False, backend: str = "sdpa"):
    """Causal attention of local queries against the whole rows' keys, inside documents, in global positions.

    q [B, Tq, H, Dq] at global in-row positions qpos [Tq] (increasing inside each contiguous run); k [B, T, H, Dq],
    v [B, T, H, Dv] in global order; bounds: per-row document boundaries (`row_bounds`) or None (one document
    per row). Query at p sees keys s ≤ p of its document. Returns o [B, Tq, H, Dv] (, max_logit [H], detached,
    over this rank's queries only). backend "sdpa" (per piece, lower-right causal) or "reference" (dense mask).
    """
    B, Tq, H, _ = q.shape
    T = k.shape[1]
    if backend == "reference":
        docs = token_docs(None if bounds is None else _bounds_cu(bounds, T, q.device), B, T, q.device)
        kpos = torch.arange(T, device=q.device)
        allowed = (kpos[None, None, :] <= qpos[None, :, None]) & (docs[:, qpos, None] == docs[:, None, :])
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed,
                                                                                     torch.finfo(q.dtype).min)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=bias.unsqueeze(1), scale=scale).transpose(1, 2)
        if not return_max_logit:
            return o
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.no_grad():
            sc = torch.einsum("bthd,bshd->bhts", q, k).to(acc) * scale
            mx = sc.masked_fill(~allowed.unsqueeze(1), float("-inf")).amax(dim=(0, 2, 3))
        return o, mx
    if backend != "sdpa":
        raise ValueError(f"attend_global: backend must be 'sdpa' or 'reference', got {backend!r}")
    pos = qpos.tolist()
    runs, start = [], 0
    for i in range(1, Tq + 1):  # contiguous runs of global positions
        if i == Tq or pos[i] != pos[i - 1] + 1:
            runs.append((start, pos[start], i - start))
            start = i
    outs, best = [], None
    for b, lo, g0, n, d0 in _pieces(runs, bounds):
        rows = slice(None) if b is None else slice(b, b + 1)
        qp, kp, vp = q[rows, lo:lo + n], k[rows, d0:g0 + n], v[rows, d0:g0 + n]
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                           attn_mask=causal_lower_right(n, g0 + n - d0), scale=scale)
        outs.append((b, lo, n, o.transpose(1, 2)))
        if return_max_logit:
            m = _piece_max_logit(qp, kp, scale)
            best = m if best is None else torch.maximum(best, m)
    if bounds is None:
        o = torch.cat([p for _, _, _, p in sorted(outs, key=lambda t: t[1])], 1)
    else:  # pieces of every row: stitch each row in local order
        o = torch.cat([torch.cat([p for bb, _, _, p in sorted(outs, key=lambda t: t[1]) if bb == b], 1)
                       for b in range(B)], 0)
    return (o, best) if return_max_logit else o


def _bounds_cu(bounds: list[list[int]], T: int, device) -> torch.Tensor:
    """Per-row boundaries back to cu_seqlens over the flattened rows."""
    cu = sorted({r * T + c for r, bd in enumerate(bounds) for c in bd})
    return torch.tensor(cu, dtype=torch.int64, device=device)


def mla_forward_cp(layer, x: torch.Tensor, group, cu_seqlens=None, bounds: list[list[int]] | None = None
                   ) -> torch.Tensor:
    """`MLAttention.forward` for this rank's two segments x [B, 2s, D] of the whole rows (layout above).

    cu_seqlens: packed documents over the flattened rows of the whole sequences (B·2s·P tokens), or None; or pass
    the already-checked per-row `bounds`. Equals the single-process layer on the whole rows, sliced to this
    rank's tokens. Parameter gradients are this rank's share (sum them over the cp group)."""
    B, L, _ = x.shape
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if L % 2:
        raise ValueError(f"context parallelism: the local row holds two equal segments, got {L} tokens")
    T = L * size
    if bounds is None and cu_seqlens is not None:
        bounds = row_bounds(cu_seqlens, B, T)
    if bounds is not None and all(bd == [0, T] for bd in bounds):
        bounds = None  # one document per row: batched calls
    q = layer.project_q(x)
    c, k_pe = layer.project_latent(x)
    lat = gather_sequence(torch.cat([c, k_pe], -1), group, size)  # [B, T, C + R]
    k, v = layer.expand_kv(*lat.split([layer.kv_lora_rank, layer.rope], -1))
    qpos = local_positions(rank, size, L // 2, x.device)
    record = layer.record_max_logit and layer.training
    backend = "reference" if layer.attn_backend == "reference" else "sdpa"
    out = attend_global(q, k, v, layer.scale, qpos, bounds, return_max_logit=record, backend=backend)
    if record:
        out, mx = out
        mx = mx.float().contiguous()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)  # the whole sequence's max, on every rank
        layer.max_logit = mx
    return layer._finish(x, out)
