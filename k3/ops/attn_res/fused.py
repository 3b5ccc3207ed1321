"""Block AttnRes as one autograd Function that keeps no stacked or upcast copy of the candidates.

Per row r of the flattened tokens, with sources v_i [D] and the folded query w = query ⊙ norm_weight:

    rstd_i = (mean_d v_i² + eps)^-1/2,   s_i = rstd_i (v_i · w),   α = softmax_i(s),   h = Σ_i α_i v_i

and, given dh,

    dα_i = dh · v_i,   ds_i = α_i (dα_i − Σ_j α_j dα_j),   c_i = ds_i rstd_i,
    dv_i = α_i dh + c_i w − c_i s_i rstd_i v_i / D,   dw = Σ_rows Σ_i c_i v_i,
    d query = dw ⊙ norm_weight,   d norm_weight = dw ⊙ query.

Autograd keeps references to the sources (alive anyway in the model's block list), the two parameters and
α, rstd (and, for "triton", the scores s) as [N, rows] fp32: O(N·rows) beyond what exists already, where
the reference keeps several fp32 [N, rows, D] tensors. The "torch" math runs over chunks of rows, so its fp32
temporaries are bounded by a chunk; the "triton" math (`triton.py`) streams the sources through a table of
data pointers.
"""
from __future__ import annotations

import torch

CHUNK_ELEMS = 1 << 24  # torch path: rows per chunk = CHUNK_ELEMS // (N·D): fp32 [N, chunk, D] temporaries of 64 MiB


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics / accumulation dtype: fp32, or fp64 for fp64 inputs (as the reference)."""
    return torch.promote_types(dtype, torch.float32)


def fold_query(query: torch.Tensor, norm_weight: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """w = query ⊙ norm_weight as a [D] vector in `acc` (the RMSNorm weight folded into the pseudo-query)."""
    return query.reshape(-1).to(acc) * norm_weight.reshape(-1).to(acc)


def _chunk(N: int, D: int, chunk_rows: int | None) -> int:
    return chunk_rows if chunk_rows else max(1, CHUNK_ELEMS // max(N * D, 1))


def _upcast(flat: list[torch.Tensor], r0: int, r1: int, acc: torch.dtype) -> torch.Tensor:
    """Rows r0:r1 of every source, stacked and upcast: [N, rows, D] in acc (bounded by the chunk)."""
    return torch.stack([v[r0:r1].to(acc) for v in flat])


def forward_torch(flat: list[torch.Tensor], w: torch.Tensor, eps: float, out_dtype: torch.dtype,
                  chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flat: N sources [R, D]; w: folded query [D] in the accumulation dtype.

    Returns h [R, D] in out_dtype, α and rstd [N, R] in w's dtype. Rows go in chunks of about
    CHUNK_ELEMS / (N·D) (or chunk_rows): the fp32 temporaries are [N, chunk, D], never [N, R, D].
    """
    R, D = flat[0].shape
    N, acc = len(flat), w.dtype
    h = torch.empty(R, D, dtype=out_dtype, device=w.device)
    alpha = torch.empty(N, R, dtype=acc, device=w.device)
    rstd = torch.empty(N, R, dtype=acc, device=w.device)
    step = _chunk(N, D, chunk_rows)
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        vf = _upcast(flat, r0, r1, acc)  # [N, c, D]
        rs = torch.rsqrt(torch.linalg.vector_norm(vf, dim=-1).square_().div_(D).add_(eps))
        a = torch.softmax(torch.matmul(vf, w).mul_(rs), dim=0)
        h[r0:r1] = (a.unsqueeze(-1) * vf).sum(0)
        alpha[:, r0:r1], rstd[:, r0:r1] = a, rs
    return h, alpha, rstd


def backward_torch(flat: list[torch.Tensor], w: torch.Tensor, alpha: torch.Tensor, rstd: torch.Tensor,
                   dh: torch.Tensor, need: list[bool], need_w: bool, chunk_rows: int | None = None
                   ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """Gradients of the forward above: dv_i [R, D] in each source's dtype where need[i] (else None), and
    dw [D] in the accumulation dtype when need_w (else None). dh: [R, D]. Same chunks as the forward."""
    R, D = flat[0].shape
    N, acc = len(flat), w.dtype
    dvs = [torch.empty_like(v) if need[i] else None for i, v in enumerate(flat)]
    dw = torch.zeros(D, dtype=acc, device=w.device) if need_w else None
    step = _chunk(N, D, chunk_rows)
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        vf = _upcast(flat, r0, r1, acc)  # [N, c, D]
        dhf = dh[r0:r1].to(acc)
        a, rs = alpha[:, r0:r1], rstd[:, r0:r1]
        da = (vf * dhf).sum(-1)  # dα_i = dh · v_i
        c = a * (da - (a * da).sum(0, keepdim=True)) * rs  # ds_i · rstd_i
        e = c * torch.matmul(vf, w) * rs * rs / D  # ds_i · rstd_i · s_i · rstd_i / D
        if need_w:
            dw.addmv_(vf.reshape(-1, D).t(), c.reshape(-1))
        if any(need):
            dv = (e.unsqueeze(-1) * vf).neg_().add_(a.unsqueeze(-1) * dhf).add_(c.unsqueeze(-1) * w)
            for i, g in enumerate(dvs):
                if g is not None:
                    g[r0:r1] = dv[i]
    return dvs, dw


class AttnResFunction(torch.autograd.Function):
    """h = attn_res(sources) with a hand-written backward; `impl` is "torch" or "triton" (kernels in
    `triton.py`, which need same-dtype contiguous sources). Inputs: (impl, opts, query, norm_weight, eps,
    *sources), all sources of one shape [..., D]; opts: a dict of launch / chunk settings."""

    @staticmethod
    def forward(ctx, impl, opts, query, norm_weight, eps, *sources):
        shape, D = sources[0].shape, sources[0].shape[-1]
        out_dtype = sources[0].dtype
        for t in sources[1:]:
            out_dtype = torch.promote_types(out_dtype, t.dtype)
        flat = [t.reshape(-1, D) for t in sources]
        with torch.autocast(sources[0].device.type, enabled=False):
            if impl == "triton":  # also keeps the scores s [N, rows] fp32: its backward needs no v·w pass
                from .triton import attn_res_fwd_triton  # the kernel folds query ⊙ norm_weight itself
                h, *stats = attn_res_fwd_triton(flat, norm_weight, eps, query=query, **opts.get("fwd", {}))
            else:
                w = fold_query(query, norm_weight, acc_dtype(out_dtype))
                h, *stats = forward_torch(flat, w, eps, out_dtype, opts.get("chunk_rows"))
        ctx.save_for_backward(query, norm_weight, *stats, *sources)  # stats: alpha, rstd (, s)
        ctx.impl, ctx.opts, ctx.D, ctx.n_stats = impl, opts, D, len(stats)
        return h.reshape(shape)

    @staticmethod
    def backward(ctx, dh):
        query, norm_weight, *saved = ctx.saved_tensors
        stats, sources = saved[:ctx.n_stats], saved[ctx.n_stats:]
        alpha, rstd = stats[0], stats[1]
        need = list(ctx.needs_input_grad[5:])
        need_q, need_n = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        D = ctx.D
        flat = [t.reshape(-1, D) for t in sources]
        dh = dh.reshape(-1, D)
        with torch.autocast(dh.device.type, enabled=False):
            w = fold_query(query, norm_weight, alpha.dtype)
            if ctx.impl == "triton":
                from .triton import attn_res_bwd_triton
                dvs, dw = attn_res_bwd_triton(flat, w, alpha, rstd, stats[2], dh, need, need_q or need_n,
                                              **ctx.opts.get("bwd", {}))
            else:
                dvs, dw = backward_torch(flat, w, alpha, rstd, dh, need, need_q or need_n,
                                         ctx.opts.get("chunk_rows"))
            dq = (dw * norm_weight.reshape(-1).to(dw.dtype)).reshape(query.shape).to(query.dtype) if need_q else None
            dn = (dw * query.reshape(-1).to(dw.dtype)).reshape(norm_weight.shape).to(norm_weight.dtype) \
                if need_n else None
        dvs = [None if g is None else g.reshape(t.shape) for g, t in zip(dvs, sources)]
        return (None, None, dq, dn, None, *dvs)
