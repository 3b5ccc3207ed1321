"""The MoE router's selection as one Triton kernel for inference: sigmoid scores, the selection bias, top-k,
the chosen scores renormalised and scaled — one program per token instead of ~10 PyTorch kernels per layer
(`k3.ops.moe.route` is the reference and the training path: its weights need autograd)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def route_topk_kernel(logits_ptr, bias_ptr, scores_ptr, idx_ptr, w_ptr, E, scale, x_ptr, gw_ptr, D, sx, sg,
                      K: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                      FROM_X: tl.constexpr, BD: tl.constexpr):
    """Program n: scores = sigmoid(logits[n]); choose the K largest of scores + bias (ties: lowest expert), in
    descending order; weights = the chosen scores (÷ their sum + 1e-20 with RENORM) × scale. FROM_X: the logits
    are computed here, x[n] · gate_weight^T with fp32 accumulation (a decode step's few tokens: no GEMM kernel)."""
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    m = e < E
    if FROM_X:
        z = tl.zeros([BE], tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            xv = tl.load(x_ptr + n * sx + d, mask=dm, other=0.0).to(tl.float32)
            wv = tl.load(gw_ptr + e[:, None].to(tl.int64) * sg + d[None, :], mask=m[:, None] & dm[None, :],
                         other=0.0).to(tl.float32)
            z += tl.sum(wv * xv[None, :], 1)
    else:
        z = tl.load(logits_ptr + n * E + e, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(z)
    tl.store(scores_ptr + n * E + e, s, mask=m)
    c = s
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + e, mask=m, other=0.0).to(tl.float32)
    c = tl.where(m, c, float("-inf"))
    total = 0.0
    cc = c
    for _ in tl.static_range(K):  # pass 1: the sum of the chosen scores
        best = tl.max(cc, 0)
        i = tl.minimum(tl.min(tl.where(cc == best, e, BE), 0), E - 1)  # in range even for a NaN row
        total += tl.sum(tl.where(e == i, s, 0.0), 0)
        cc = tl.where(e == i, float("-inf"), cc)
    if RENORM:
        f = scale / (total + 1e-20)
    else:
        f = scale
    for j in tl.static_range(K):  # pass 2: the same choices, stored
        best = tl.max(c, 0)
        i = tl.minimum(tl.min(tl.where(c == best, e, BE), 0), E - 1)
        tl.store(idx_ptr + n * K + j, i.to(tl.int64))
        tl.store(w_ptr + n * K + j, tl.sum(tl.where(e == i, s, 0.0), 0) * f)
        c = tl.where(e == i, float("-inf"), c)


FROM_X_ROWS = 16  # tokens up to which `route` computes the logits inside the kernel (decode steps)
FROM_X_EXPERTS = 256  # ... for up to this many experts (a [E, BD] weight tile per step of the loop)


def route_topk_triton(logits: torch.Tensor | None, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                      scaling_factor: float, x: torch.Tensor | None = None, gate_weight: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 → (topk_idx [N, k] long, topk_weight [N, k] fp32, scores [N, E] fp32), as `route`.
    With logits None: x [N, D] and gate_weight [E, D] (same dtype, unit column stride), the logits computed in the
    kernel (the fp32 product, up to summation order)."""
    if logits is None:
        N, E, D = x.shape[0], gate_weight.shape[0], x.shape[1]
        dev = x.device
    else:
        N, E = logits.shape
        D, dev = 0, logits.device
        logits = logits.float().contiguous()
    scores = torch.empty(N, E, dtype=torch.float32, device=dev)
    idx = torch.empty(N, top_k, dtype=torch.long, device=dev)
    w = torch.empty(N, top_k, dtype=torch.float32, device=dev)
    if N:
        lg = scores if logits is None else logits
        xs, gw = (lg, lg) if logits is not None else (x, gate_weight)
        BE = max(16, triton.next_power_of_2(E))
        route_topk_kernel[(N,)](lg, lg if bias is None else bias.float().contiguous(), scores, idx, w, E,
                                float(scaling_factor), xs, gw, D, xs.stride(0), gw.stride(0), K=top_k, BE=BE,
                                HAS_BIAS=bias is not None, RENORM=renormalize, FROM_X=logits is None,
                                BD=max(16, min(256, 8192 // BE)), num_warps=4 if E <= 1024 else 8)
    return idx, w, scores
