"""The MoE router's selection as one Triton kernel for inference: sigmoid scores, the selection bias, top-k,
the chosen scores renormalised and scaled — one program per token instead of ~10 PyTorch kernels per layer
(`k3.ops.moe.route` is the reference and the training path: its weights need autograd). For a few tokens (a
decode step) the kernel also computes the logits x·Wᵀ itself (fp32 accumulation of the exact products of the
bf16 inputs, as the GEMM with an fp32 output that it replaces): one launch per layer instead of two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import pdl
from ._triton_jit import pdl_sync


@triton.jit
def route_topk_kernel(logits_ptr, bias_ptr, scores_ptr, idx_ptr, w_ptr, E, scale, x_ptr, gw_ptr, sx, sg,
                      K: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                      D: tl.constexpr = 0, CH: tl.constexpr = 16, PDL: tl.constexpr = False):
    """Program n: scores = sigmoid(logits[n]); choose the K largest of scores + bias (ties: lowest expert), in
    descending order; weights = the chosen scores (÷ their sum + 1e-20 with RENORM) × scale. D > 0: the logits
    are x[n] [D] · gw [E, D]ᵀ, computed here in fp32 (all of gw's CH-column chunks loaded at once: the loop is
    unrolled), instead of read from logits_ptr."""
    pdl_sync(PDL)
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    m = e < E
    if D > 0:
        z = tl.zeros([BE], tl.float32)
        for c0 in tl.static_range(0, D, CH):
            cols = c0 + tl.arange(0, CH)
            cm = cols < D
            xv = tl.load(x_ptr + n * sx + cols, mask=cm, other=0.0)
            wv = tl.load(gw_ptr + e[:, None].to(tl.int64) * sg + cols[None, :], mask=m[:, None] & cm[None, :],
                         other=0.0)
            z += tl.sum(wv.to(tl.float32) * xv.to(tl.float32)[None, :], 1)
        s = tl.sigmoid(z)
    else:
        s = tl.sigmoid(tl.load(logits_ptr + n * E + e, mask=m, other=0.0).to(tl.float32))
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


FUSED_MAX_TOKENS = 16  # tokens up to which `route` computes the logits inside the kernel (each program reads
# all of the router's weight: E x D, 98 KB at k3-small, from L2 after the first)


def route_topk_triton(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                      scaling_factor: float, x: torch.Tensor | None = None, gate_weight: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 → (topk_idx [N, k] long, topk_weight [N, k] fp32, scores [N, E] fp32), as `route`.
    With logits None: x [N, D] and gate_weight [E, D] (one dtype) instead, the logits computed in the kernel."""
    fused = logits is None
    if fused:
        if x.dtype != gate_weight.dtype or x.shape[-1] != gate_weight.shape[-1]:
            raise ValueError(f"route: x {tuple(x.shape)} {x.dtype} and gate weight {tuple(gate_weight.shape)} "
                             f"{gate_weight.dtype} need one dtype and width")
        x, gate_weight = x if x.stride(-1) == 1 else x.contiguous(), gate_weight.contiguous()
        (N, D), E = x.shape, gate_weight.shape[0]
        ref = x
    else:
        N, E = logits.shape
        logits = logits.float().contiguous()
        ref, D = logits, 0
    scores = torch.empty(N, E, dtype=torch.float32, device=ref.device)
    idx = torch.empty(N, top_k, dtype=torch.long, device=ref.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=ref.device)
    if N:
        route_topk_kernel[(N,)](scores if fused else logits, scores if bias is None else bias.float().contiguous(),
                                scores, idx, w, E, float(scaling_factor), x if fused else scores,
                                gate_weight if fused else scores, x.stride(0) if fused else 0,
                                gate_weight.stride(0) if fused else 0, K=top_k,
                                BE=max(16, triton.next_power_of_2(E)), HAS_BIAS=bias is not None,
                                RENORM=renormalize, D=D, CH=min(256, max(16, triton.next_power_of_2(D or 1))),
                                num_warps=8 if fused or E > 1024 else 4, **pdl(w))
    return idx, w, scores
