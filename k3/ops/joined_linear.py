"""Several projections of one input: one GEMM forward, and no joined gradient or add kernels backward.

A layer projects its input x several ways (KDA: q | k | v, f_a, β and the output gate; MLA: q_a, the latent and
the gate). As separate `F.linear` calls that is several GEMMs reading x, narrow ones among them (β has 12
columns in k3-small), and autograd sums x's gradient from them with one add kernel per extra projection. As one
`F.linear(x, torch.cat(W))` split into pieces, the forward is one GEMM, but the backward first copies the pieces'
gradients into one [M, Σn] tensor. `joined_linear` takes the forward of the second and keeps the pieces apart in
the backward: dx = Σ_j dy_j W_j, each product accumulated onto dx by its own GEMM (`addmm_`, β = 1: no add
kernels, one rounding per product), and dW_j = dy_jᵀ x.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from . import fp8 as fp8_ops
from .linear_ce import autocast_cast

MULTIPLE = 64  # the joined weight's rows are padded to a multiple of this (cuBLAS takes its aligned kernels)
# the models' training forwards take `joined_linear` for their input projections: on by default where CUDA is. On the
# H200 (2026-12-05, `train_throughput.py`, k3-small 8 x 4,096, three interleaved runs each) the step took 531.0 /
# 534.6 / 546.5 ms with it against 536.2 / 537.0 / 537.2 without (its backward phase 3.5-4 ms shorter every time),
# peak 68.0 against 66.8 GiB; one layer's forward + backward (`benchmarks/joined_proj.py`): KDA 11.46 -> 11.01 ms,
# MoE 6.38 -> 6.13, MLA unchanged. Off on CPU-only machines: the CPU path keeps its memory-lean recomputing MLP.
ENABLED = os.environ.get("K3_JOINED_PROJ", "1" if torch.cuda.is_available() else "0") == "1"


class _JoinedLinear(torch.autograd.Function):
    """x [..., D] and the weights [n_i, D] of every piece in order → one output [..., Σ_{i in piece} n_i] per piece
    (views of one GEMM output)."""

    @staticmethod
    def forward(ctx, x, pieces, fp8, *weights):
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        rows = sum(w.shape[0] for w in weights)
        pad = -rows % MULTIPLE
        w = torch.cat(list(weights) + ([weights[0].new_zeros(pad, D)] if pad else []))
        y = fp8_ops.fp8_mm(x2, w, x2.dtype) if fp8 else torch.mm(x2, w.t())
        ctx.save_for_backward(x2, w)
        ctx.pieces, ctx.xshape, ctx.fp8 = pieces, x.shape, fp8
        ctx.wrows = [wi.shape[0] for wi in weights]
        ctx.set_materialize_grads(False)  # an unused piece's gradient arrives as None: no GEMM for it
        outs, o = [], 0
        for n in (sum(ctx.wrows[i] for i in p) for p in pieces):
            outs.append(y[:, o:o + n].view(*x.shape[:-1], n))
            o += n
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x2, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        dx, dws, o = None, [None] * len(ctx.wrows), 0
        fp8_dx = ctx.fp8 and fp8_ops.DGRAD and x2.shape[1] >= fp8_ops.DGRAD_MIN_K
        if fp8_dx and need_x:  # FP8: one GEMM against the joined weight, dy's pieces side by side (one row scale)
            M, pieces, offsets, off = x2.shape[0], [], [], 0
            for p, dy in zip(ctx.pieces, dys):
                if dy is not None:
                    pieces.append(dy.reshape(M, -1).to(x2.dtype))
                    offsets.append(off)
                off += sum(ctx.wrows[i] for i in p)
            dx = fp8_ops.scaled_mm(*fp8_ops.quantize_joined(pieces, offsets, w.shape[0]),
                                   *fp8_ops.quantize_rows(w.t()), x2.dtype) if pieces else torch.zeros_like(x2)
            need_x = False
        # FP8 dW: x's columns quantised once for every piece
        x_cols = fp8_ops.quantize_rows(x2.t()) if ctx.fp8 and fp8_ops.wgrad_fp8(x2.shape[0]) and any(need_w) else None
        for piece, dy in zip(ctx.pieces, dys):
            n = sum(ctx.wrows[i] for i in piece)
            if dy is not None:
                dy2 = dy.reshape(-1, n).to(x2.dtype)
                wp = w[o:o + n]
                if need_x:
                    dx = torch.mm(dy2, wp) if dx is None else dx.addmm_(dy2, wp)
                if any(need_w[i] for i in piece):
                    dwp = fp8_ops.weight_grad(dy2, x2, x2.dtype, x_cols) if ctx.fp8 else dy2.t().mm(x2)
                    r = 0
                    for i in piece:
                        dws[i] = dwp[r:r + ctx.wrows[i]]
                        r += ctx.wrows[i]
            o += n
        if need_x and dx is None:  # no piece was used
            dx = torch.zeros_like(x2)
        return (None if dx is None else dx.view(ctx.xshape), None, None, *dws)


def joined_linear(x: torch.Tensor, pieces: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """(x W_0ᵀ, x W_1ᵀ, ...) for the pieces' weights, one output per piece: a piece is a weight [n, D] or a list of
    weights whose outputs are wanted as one tensor (e.g. [W_q, W_k, W_v] → q | k | v [..., n_q + n_k + n_v]).
    Outputs are column views of one GEMM output (row stride: the joined width, padded to `MULTIPLE`). Values and
    gradients are those of the separate `F.linear` calls up to rounding (the backward sums x's gradient in the
    GEMMs' fp32 epilogues instead of bf16 adds). Under autocast x and the weights are cast as `F.linear` would
    cast them."""
    if not pieces:
        raise ValueError("joined_linear: expected at least one weight")
    groups = [[p] if isinstance(p, torch.Tensor) else list(p) for p in pieces]
    if any(not g for g in groups):
        raise ValueError("joined_linear: a piece must hold at least one weight")
    flat = [w for g in groups for w in g]
    D = x.shape[-1]
    for w in flat:
        if w.dim() != 2 or w.shape[1] != D:
            raise ValueError(f"joined_linear: weights must be [n, {D}] for x [..., {D}], got {tuple(w.shape)}")
    fp8 = fp8_ops.marked(*flat)  # weights of `convert_to_float8_training`'s modules, while training
    x = autocast_cast(x)
    flat = [autocast_cast(w) for w in flat]
    if any(w.dtype != x.dtype or w.device != x.device for w in flat):
        raise ValueError(f"joined_linear: weights must match x's dtype and device ({x.dtype}, {x.device}), got "
                         f"{sorted({(str(w.dtype), str(w.device)) for w in flat})}")
    index, i = [], 0
    for g in groups:
        index.append(tuple(range(i, i + len(g))))
        i += len(g)
    with torch.autocast(x.device.type, enabled=False):  # operands already cast
        fp8 = fp8 and fp8_ops.input_reason(x) is None  # the joined rows are padded to MULTIPLE: x alone decides
        return _JoinedLinear.apply(x, tuple(index), fp8, *flat)
