"""Routing and expert computation for the Stable LatentMoE (K3_SPEC §5).

The router is a fp32 sigmoid over the full-width input; the selection bias (`e_score_correction_bias`)
changes only *which* experts are chosen; mixing weights are the raw scores of the chosen experts,
renormalised, times `routed_scaling_factor`.

Experts run in one of two ways (`experts_forward`): a per-expert loop (the CPU path and the tests'
reference), or the sorted-rows pipeline used on CUDA with bf16 activations: sort the N·K (token, expert)
entries by expert, `dispatch_rows` (expand each token into its K expert rows), `grouped_situ_ffn` (w1 ‖ w3
as one grouped GEMM, fused SiTU-GLU, w2 grouped GEMM), `combine_rows` (the weighted sum of each token's K
rows in fp32, output in the activation dtype). No host sync on that path, no fp32 [N·K, L] or [N, L]
temporaries.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ._compile import eager_op
from ._triton import importable
from .moe_recompute import experts_loop
from .situ import gate_up_view, gate_up_weight, situ_glu, situ_glu_fused

PERMUTE_BACKENDS = ("auto", "torch", "triton")


# ---- router ------------------------------------------------------------------------------------------
def _no_autocast(x: torch.Tensor):
    dev = x.device.type
    return torch.autocast(dev, enabled=False) if dev in ("cuda", "cpu") else contextlib.nullcontext()


def _split_bf16(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n bf16 tensors whose fp32 sum is t up to ~2^(−8n) relative (each takes the remainder of the last)."""
    parts, r = [], t.float()
    for i in range(n):
        parts.append(r.to(torch.bfloat16))
        if i + 1 < n:
            r = r - parts[-1].float()
    return parts


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 a @ b with fp32 accumulation and an fp32 result (on CPU, where mm has no out_dtype, through fp32:
    the same numbers, since products of bf16 values are exact in fp32)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _sum_parts(z: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Sum of the n equal slices of z along dim, smallest (last) first."""
    parts = z.chunk(n, dim)
    out = parts[-1]
    for p in reversed(parts[:-1]):
        out = out + p
    return out


class RouterLogitsBf16(torch.autograd.Function):
    """x [N, D] bf16 · weight [E, D]ᵀ (fp32 master) → [N, E] fp32 to fp32 rounding, without an fp32 copy of x:
    the weight is split into three bf16 parts (hi + mid + lo = weight to 2⁻²⁴) and one bf16 GEMM with fp32
    accumulation takes all three ([N, 3E] fp32, summed). Backward: dweight the same way (dlogits split in
    three), dx (bf16) from two-part splits of dlogits and the weight (dropped term ~2⁻¹⁶ ≪ bf16 rounding)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        n = 1 if weight.dtype == torch.bfloat16 else 3
        with _no_autocast(x):
            z = _mm_f32(x, torch.cat(_split_bf16(weight, n)).t())
        return _sum_parts(z, n, 1)

    @staticmethod
    def backward(ctx, dz):
        x, weight = ctx.saved_tensors
        dx = dw = None
        with _no_autocast(x):
            dz = dz.float()
            if ctx.needs_input_grad[0]:
                gh, gm = _split_bf16(dz, 2)
                wh, wm = _split_bf16(weight, 2)
                dx = torch.mm(torch.cat([gh, gm, gh], 1), torch.cat([wh, wh, wm], 0)).to(x.dtype)
            if ctx.needs_input_grad[1]:
                g = torch.cat(_split_bf16(dz, 3), 1)
                dw = _sum_parts(_mm_f32(g.t(), x), 3, 0).to(weight.dtype)
        return dx, dw


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """x [N, D] · gate_weight [E, D]ᵀ in fp32 (autocast does not lower it): bf16 CUDA activations in training
    through `RouterLogitsBf16` (no fp32 copy of x kept for the backward); inference on CUDA with bf16 x and
    weight as one bf16 GEMM with an fp32 output (the products of two bf16 values are exact in fp32 and the GEMM
    accumulates in fp32, so this is the fp32 product up to summation order, without casting x and the weight
    in two kernels every step); anything else as F.linear on fp32 copies."""
    if x.is_cuda and x.dtype == torch.bfloat16 and torch.is_grad_enabled():
        return RouterLogitsBf16.apply(x, gate_weight)
    if x.is_cuda and x.dtype == gate_weight.dtype == torch.bfloat16 and x.dim() == 2:
        return torch.mm(x, gate_weight.t(), out_dtype=torch.float32)
    with _no_autocast(x):
        return F.linear(x.float(), gate_weight.float())


@eager_op
def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
          renormalize: bool = True, scaling_factor: float = 1.0, logits: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D] → (topk_idx [N, k] long, topk_weight [N, k] fp32, scores [N, E] fp32). Inference on CUDA takes
    the one-kernel selection (`route_triton.py`; these ops are its reference), training these ops (the
    weights need autograd). `logits` [N, E] fp32: x·gate_weightᵀ computed already (inference: joined to the
    layer's other projections of x, `linear_fp32_tail`)."""
    z = router_logits(x, gate_weight) if logits is None else logits
    if z.is_cuda and not torch.is_grad_enabled() and route_triton_available():
        from .route_triton import route_topk_triton
        return route_topk_triton(z, bias, top_k, renormalize, scaling_factor)
    scores = torch.sigmoid(z)
    choice = scores if bias is None else scores + bias.float()
    idx = torch.topk(choice, top_k, dim=-1, sorted=True).indices
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling_factor, scores


def route_triton_available() -> bool:
    """True when the Triton router kernel imports (tried once)."""
    return importable(__name__.rsplit(".", 1)[0] + ".route_triton")


# ---- token permutation -------------------------------------------------------------------------------
def sort_by_expert(topk_idx: torch.Tensor, num_experts: int, out_int32: bool = False, backend: str = "auto",
                   with_src: bool = False) -> tuple[torch.Tensor, ...]:
    """topk_idx [N, K] → (pos [N, K] int64, ends [E] int64, or int32 with `out_int32`: the grouped GEMM's
    offsets): the (token, expert) entries sorted by expert (stable: token order within an expert); entry
    (n, k) goes to row pos[n, k]; expert e owns rows [ends[e−1], ends[e]), so ends[-1] = N·K. No host sync.
    with_src: also src [N·K] int64, the entry n·K + k of each sorted row (the inverse of pos). Backends: "torch"
    (a stable sort), "triton" (a counting sort in one or two kernels, `moe_triton.expert_sort`), "auto" (the
    kernels on CUDA)."""
    if backend == "auto":
        backend = "torch"
        if topk_idx.is_cuda and importable(__name__.rsplit(".", 1)[0] + ".moe_triton"):
            backend = "triton"
    if _use_triton(backend, topk_idx):
        from .moe_triton import expert_sort
        return expert_sort(topk_idx, num_experts, out_int32, with_src=with_src)
    flat = topk_idx.reshape(-1)
    sorted_e, order = torch.sort(flat, stable=True)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    ends = torch.searchsorted(sorted_e, torch.arange(num_experts, device=flat.device, dtype=sorted_e.dtype),
                              right=True, out_int32=out_int32)
    return (pos.view(topk_idx.shape), ends, order) if with_src else (pos.view(topk_idx.shape), ends)


def _use_triton(backend: str, x: torch.Tensor) -> bool:
    if backend not in PERMUTE_BACKENDS:
        raise ValueError(f"unknown permutation backend {backend!r}; valid backends are {', '.join(PERMUTE_BACKENDS)}")
    if backend == "torch":
        return False
    if backend == "triton":
        from .moe_triton import interpreted
        if not x.is_cuda and not interpreted():
            raise ValueError(f"permutation backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
        return True
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _acc(*ts: torch.Tensor) -> torch.dtype:
    dt = torch.float32
    for t in ts:
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _gather_sum(src, pos, w, triton):
    if triton:
        from .moe_triton import gather_sum
        return gather_sum(src, pos, w)
    N, K = pos.shape
    acc = _acc(src, w)
    rows = src.index_select(0, pos.reshape(-1)).view(N, K, -1).to(acc)
    if w is not None:
        rows = rows * w.to(acc).unsqueeze(-1)
    return rows.sum(1).to(src.dtype)


def _scatter(src, pos, w, other, triton):
    if triton:
        from .moe_triton import scatter
        return scatter(src, pos, w, other)
    N, K = pos.shape
    acc = _acc(src, w)
    x = src.to(acc).unsqueeze(1)
    y = x * w.to(acc).unsqueeze(-1) if w is not None else x.expand(N, K, src.shape[1])
    flat = pos.reshape(-1)
    dst = src.new_empty(N * K, src.shape[1]).index_copy_(0, flat, y.reshape(N * K, -1).to(src.dtype))
    dw = None
    if other is not None:
        dw = (other.index_select(0, flat).view(N, K, -1).to(acc) * x).sum(-1).to(w.dtype)
    return dst, dw


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pos, triton):
        ctx.save_for_backward(pos)
        ctx.triton = triton
        return _scatter(x, pos, None, None, triton)[0]

    @staticmethod
    def backward(ctx, dxs):
        (pos,) = ctx.saved_tensors
        return _gather_sum(dxs, pos, None, ctx.triton), None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ys, pos, w, triton):
        ctx.save_for_backward(ys, pos, w)
        ctx.triton = triton
        return _gather_sum(ys, pos, w, triton)

    @staticmethod
    def backward(ctx, dout):
        ys, pos, w = ctx.saved_tensors
        dys, dw = _scatter(dout, pos, w, ys if ctx.needs_input_grad[2] else None, ctx.triton)
        return dys, None, dw, None


@eager_op
def dispatch_rows(x: torch.Tensor, pos: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """x [N, L], pos [N, K] (`sort_by_expert`) → xs [N·K, L] with xs[pos[n, k]] = x[n]. The backward sums each
    token's K row gradients in fp32 (no atomics), output in x's dtype. backend: "auto" (Triton on CUDA), "torch",
    "triton"."""
    return _DispatchRows.apply(x, pos, _use_triton(backend, x))


@eager_op
def combine_rows(ys: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """ys [N·K, L] (expert-sorted rows), pos [N, K], weight [N, K] → [N, L] in ys's dtype:
    Σ_k weight[n, k]·ys[pos[n, k]], accumulated in fp32 (fp64 for fp64). Differentiable in ys and weight."""
    if weight.shape != pos.shape:
        raise ValueError(f"combine_rows: weight {tuple(weight.shape)} must match pos {tuple(pos.shape)}")
    return _CombineRows.apply(ys, pos, weight, _use_triton(backend, ys))


# ---- experts -----------------------------------------------------------------------------------------
def grouped_mm_available(x: torch.Tensor) -> bool:
    """`torch._grouped_mm` path: CUDA bf16 activations (bf16 weights, or fp32 master weights under autocast)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def routed_decode_fits(x: torch.Tensor, top_k: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """Whether a decode step's experts and their routing run as the two `moe_decode` kernels
    (`experts_decode_routed`): the GEMV kernels' conditions (`experts_forward`) and `moe_decode.ROUTED` on."""
    if not (grouped_mm_available(x) and importable(__name__.rsplit(".", 1)[0] + ".moe_decode")):
        return False
    from . import moe_decode
    return moe_decode.routed_fits(x, top_k, w1, w2, w3)


@eager_op
def experts_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, w3: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                    grouped: bool | None = None) -> torch.Tensor:
    """Σ_k weight_k · expert_{idx_k}(x) with SiTU-GLU experts; weights stacked as w1/w3 [E, I, L], w2 [E, L, I].

    x [N, L] → [N, L] in x's dtype, accumulated in fp32 (fp64 for fp64 inputs). `grouped` (default: CUDA
    bf16 activations) runs the sorted-rows pipeline (module docstring) with `torch._grouped_mm` GEMMs (per-expert
    GEMMs for fp64, which it does not take), no host sync -- without autograd, for a few tokens two GEMV kernels
    (`moe_decode`) instead, for up to thousands of entries two GEMM kernels over expert tiles (`moe_tiles`);
    else one loop step per used expert, host-side counts
    (off CUDA as `moe_recompute.experts_loop`, which saves only its inputs for the backward).
    """
    if grouped is None:
        grouped = grouped_mm_available(x)
    if grouped and importable(__name__.rsplit(".", 1)[0] + ".moe_decode"):
        from . import moe_decode
        if moe_decode.fits(x, topk_idx, w1, w2, w3):  # a decode step's few tokens: two GEMV kernels
            return moe_decode.experts_decode(x, topk_idx, topk_weight, w1, w2, w3, beta, linear_beta)
        from . import moe_tiles
        if moe_tiles.fits(x, topk_idx.numel(), w1, w2, w3):  # tens to thousands of entries: expert tiles
            if moe_tiles.routed(topk_idx.numel()):  # the kernels find their tiles from the choices: no sort
                from .moe_triton import gather_sum
                ys = moe_tiles.experts_tiles(x, topk_idx.reshape(-1), None, topk_idx.shape[1], w1, w2, w3, beta,
                                             linear_beta)
                return gather_sum(ys, None, topk_weight)
            pos, ends, src = sort_by_expert(topk_idx, w1.shape[0], with_src=True)
            ys = moe_tiles.experts_tiles(x, src, ends, topk_idx.shape[1], w1, w2, w3, beta, linear_beta)
            return combine_rows(ys, pos, topk_weight)
    if grouped:
        gmm = hasattr(torch, "_grouped_mm") and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        pos, ends = sort_by_expert(topk_idx, w1.shape[0], out_int32=gmm)
        ys = grouped_situ_ffn(dispatch_rows(x, pos), ends, w1, w2, w3, beta, linear_beta, use_grouped_mm=gmm,
                              covers_all_rows=True)
        return combine_rows(ys, pos, topk_weight)
    if not x.is_cuda and not torch.is_autocast_enabled(x.device.type):
        # off CUDA: the same loop as one Function that recomputes each expert in the backward (memory-lean)
        return experts_loop(x, topk_idx, topk_weight, w1, w2, w3, beta, linear_beta)
    N, K = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // K
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(N, x.shape[-1], dtype=acc, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token[start:start + n]
        xe = x[rows]
        h = situ_glu(F.linear(xe, w1[e]), F.linear(xe, w3[e]), beta, linear_beta)
        ye = F.linear(h, w2[e]).to(acc) * topk_weight.reshape(-1)[order[start:start + n]].unsqueeze(-1)
        out = out.index_add(0, rows, ye)
        start += n
    return out.to(x.dtype)


def grouped_situ_ffn(x: torch.Tensor, cu_seqlens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     w3: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
                     use_grouped_mm: bool | None = None, covers_all_rows: bool = False) -> torch.Tensor:
    """SiTU-GLU experts over row groups: x [N, L], cu_seqlens [G] inclusive ends, w1/w3 [G, I, L], w2 [G, L, I].

    Rows after cu_seqlens[-1] must be zero (they run through the last group and stay zero). Weights are taken
    in x's dtype (fp32 master weights are converted here, w1 ‖ w3 into one [G, 2I, L] tensor in the same pass),
    so the gate and up projections are one GEMM whose [N, 2I] output the fused SiTU-GLU reads in place. With
    `torch._grouped_mm` (default: CUDA bf16; no host sync) or a per-group loop (reads cu_seqlens on the host).
    `covers_all_rows`: the caller guarantees cu_seqlens[-1] = N, so int32 offsets are used without a copy."""
    if use_grouped_mm is None:
        use_grouped_mm = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    if use_grouped_mm:
        if covers_all_rows and cu_seqlens.dtype == torch.int32:
            offs = cu_seqlens  # the caller guarantees cu_seqlens[-1] = N (sort_by_expert's ends): used as is
        else:
            offs = cu_seqlens.to(torch.int32).clone()
            offs[-1:].fill_(x.shape[0])  # a fill kernel (item assignment would copy a pageable host scalar: a sync)
        w2 = w2.to(x.dtype)
        w13 = gate_up_view(w1, w3) if not torch.is_grad_enabled() and w1.dtype == x.dtype else None
        if w13 is not None:  # inference on weights laid out w1 ‖ w3 (`k3.model.moe.fuse_gate_up`): one GEMM
            h = situ_glu_fused(torch._grouped_mm(x, w13.transpose(1, 2), offs=offs), beta, linear_beta)
        elif not torch.is_grad_enabled() and w1.dtype == x.dtype and w3.dtype == x.dtype:
            # inference (decode) on separate w1, w3: two GEMMs on the weights as they are; concatenating w1 ‖ w3
            # would copy every expert's weights on each call, more bytes than a small batch's GEMMs read
            h = situ_glu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs),
                         torch._grouped_mm(x, w3.transpose(1, 2), offs=offs), beta, linear_beta)
        else:
            gu = torch._grouped_mm(x, gate_up_weight(w1, w3, x.dtype).transpose(1, 2), offs=offs)
            h = situ_glu_fused(gu, beta, linear_beta)
        return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    w13 = gate_up_view(w1, w3) if not torch.is_grad_enabled() and w1.dtype == x.dtype else None
    w13 = gate_up_weight(w1, w3, x.dtype) if w13 is None else w13
    w2 = w2.to(x.dtype)
    ends = cu_seqlens.tolist()
    parts, start = [], 0
    for gi, end in enumerate(ends):
        if end > start:
            parts.append(F.linear(situ_glu_fused(F.linear(x[start:end], w13[gi]), beta, linear_beta), w2[gi]))
        start = end
    parts.append(x.new_zeros(x.shape[0] - start, w2.shape[1]))
    return torch.cat(parts)
