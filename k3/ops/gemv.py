"""Dense projections of a few rows (decode steps): y = x W^T as a Triton GEMV beside `F.linear`.

A batch-1 decode step multiplies one row by every weight matrix of the model: the work is reading the weights
(the LM head alone is 503 MB in k3-small), so the time is bytes / bandwidth. cuBLAS picks GEMM kernels for these
shapes that read the weights well below the HBM rate. `gemv_kernel` gives each program `BN` weight rows and
streams them through in `CH`-column chunks (pipelined loads, fp32 accumulation on the tensor cores with the few
x rows padded to 16); the output is written once in the requested dtype (fp32 logits straight from the head).

`linear(x, w, out_dtype)` is the dispatch point: the kernel for up to `MAX_ROWS` rows without autograd on CUDA
(or the CPU interpreter), `F.linear` / `torch.mm(out_dtype=...)` otherwise. The reference is `F.linear` in fp64
(`tests/test_gemv.py`); the kernel differs from cuBLAS only in the order of its fp32 sums.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton import interpreted

MAX_ROWS = 16  # rows up to which `linear` takes the kernel (x is padded to one 16-row MMA tile)
# (BN, CH, warps, stages) by output width: many programs for the narrow projections, long rows for the head
LAUNCH = ((4096, (16, 256, 4, 4)), (1 << 62, (64, 128, 4, 4)))


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sx, sw, sy, BN: tl.constexpr, CH: tl.constexpr,
                IEEE: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = rows < N
    m = tl.arange(0, 16)
    mm = m < M
    acc = tl.zeros([16, BN], tl.float32)
    for c0 in range(0, K, CH):
        cols = c0 + tl.arange(0, CH)
        cm = cols < K
        x = tl.load(x_ptr + m[:, None] * sx + cols[None, :], mask=mm[:, None] & cm[None, :], other=0.0)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * sw + cols[None, :], mask=rm[:, None] & cm[None, :],
                    other=0.0)
        if IEEE:  # fp32 inputs, or the CPU interpreter (whose dot mishandles half types): exact fp32 products
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + m[:, None] * sy + rows[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & rm[None, :])


def launch(n: int) -> tuple[int, int, int, int]:
    """(BN, CH, warps, stages) for an output width n."""
    return next(c for limit, c in LAUNCH if n <= limit)


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear` takes the kernel: ≤ MAX_ROWS rows, no autograd, x and w of one dtype with unit column
    stride, CUDA (or the CPU interpreter)."""
    return (x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and not torch.is_grad_enabled()
            and (x.is_cuda or interpreted(gemv_kernel)) and x.device == w.device and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.dim() == 2 and w.stride(-1) == 1)


def gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] (≤ MAX_ROWS rows), w [N, K] (unit column stride) → x w^T [..., N] in `out_dtype` (x's dtype
    by default), fp32 accumulation. `config`: (BN, CH, warps, stages), else `launch(N)`."""
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"gemv: x has {x.shape[-1]} columns, w {tuple(w.shape)} expects {K}")
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv: {M} rows > MAX_ROWS={MAX_ROWS}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        bn, ch, warps, stages = config or launch(N)
        gemv_kernel[(triton.cdiv(N, bn),)](x2, w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0), BN=bn, CH=ch,
                                          IEEE=x.dtype == torch.float32 or not x.is_cuda, num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x w^T (a bias-free `F.linear`) in `out_dtype` (default x's dtype): the GEMV kernel for a few rows without
    autograd (`fits`), else cuBLAS (`torch.mm(..., out_dtype=)` where a wider output is asked of a half-precision
    product, else `F.linear` and a cast)."""
    if fits(x, w):
        return gemv(x, w, out_dtype)
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, w)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and out_dtype == torch.float32 and w.dtype == x.dtype:
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=out_dtype).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w).to(out_dtype)
