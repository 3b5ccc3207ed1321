"""Dense projections of a few rows (decode steps): `linear` dispatches y = x W^T (+ add) to a Triton GEMV or cuBLAS.

A batch-1 decode step multiplies one row by every weight matrix of the model, so its time is bytes read plus
per-kernel latency. On the H200 (`benchmarks/probe/gemv.py`) cuBLAS reads the big matrices at the HBM rate (the
503 MB head at 4.2 TB/s) but takes 4–6 µs for the 0.5–5 MB projections of a layer; the GEMV kernel saves 0.5–1.6 µs
on each of those and can add a residual in its epilogue and gate its input (no elementwise kernels).
`triton.py` holds the kernel; this module only picks the path, so importing the model does not import Triton.

`linear(x, w, out_dtype, add, gate)`: the kernel for up to `MAX_ROWS` rows of up to `MAX_K` columns without
autograd on CUDA, else `F.linear` / `torch.mm(out_dtype=...)` / `torch.addmm`. Reference: `F.linear` in fp64
(`tests/test_gemv.py`); the kernel differs from cuBLAS only in the order of its fp32 sums.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .._compile import eager_op
from .._triton import device_reason
from .. import fp8 as fp8_ops
from ..linear_ce.chunked import mm_out_dtype_available

__all__ = ["linear", "linear_fp32_tail", "prologue", "fits", "max_rows", "MAX_ROWS"]

# rows up to which `linear` takes the kernel (x is padded to one 16-row MMA tile); 0 (or K3_GEMV_MAX_ROWS=0): never
MAX_ROWS = int(os.environ.get("K3_GEMV_MAX_ROWS", 16))
# whether it also takes 17 to 32 rows (MMA tiles of 32: a decode batch of 17-32; `WIDE_64`: and of 64, to 64 rows)
# for the weight shapes where that beat cuBLAS: inputs of ≤ `WIDE_MAX_K` columns or outputs of ≥ `WIDE_MIN_N` rows.
# `benchmarks/probe/gemv.py --rows 32 64` (H200, 2026-12-03, µs at 32 / 64 rows, cuBLAS against the kernel): KDA f_b
# [1536, 128] 2.56 / 2.79 against 1.58 / 1.78, MLA q_b [2304, 512] 3.99 / 4.02 against 3.43 / 3.43, MoE latent up
# [1536, 768] 4.33 / 4.40 against 4.06 / 3.91, dense gate_up [12288, 1536] 13.0 / 13.2 against 12.5 / 12.8, the head
# 127.7 / 144.2 against 125.8 / 137.2; but every other K = 1,536 projection 8-25 % slower (12 sequential chunks of
# 128 columns: kda_in 8.9 against 9.7) and the dense down (K 6,144) twice as slow. K3_GEMV_WIDE=0: never.
# Up to 64 rows: `benchmarks/probe/hit_switches.py` (H200, 2026-12-04) has a 16K prefix hit's graph (a 64-row tail) at
# 2.000 against 2.039 ms of GPU time with the 64-row tiles, whatever the other switches (four pairs, 0.03-0.04 ms
# each). Its TTFT moves by ±0.2 ms from one graph capture to the next, which is what `serve.py`'s one-capture
# figures (2.82 against 3.06 ms) had measured. K3_GEMV_WIDE_64=0: up to 32 rows.
WIDE = os.environ.get("K3_GEMV_WIDE", "1") == "1"
WIDE_64 = os.environ.get("K3_GEMV_WIDE_64", "1") == "1"
WIDE_MAX_K, WIDE_MIN_N = 768, 12288
# whether the norm / SiTU-GLU prologues run inside the GEMV (K3_GEMV_PROLOGUE=1) or as their own kernels before it
# (the default). H200, 2026-12-03: on the MMA tile's 16 rows the batch-1 step took 2.24 ms against 1.62 ms; in
# the one-row form each use alone is 1.0-1.23x as fast as norm kernel + GEMV (`benchmarks/probe/gemv_prologue.py`),
# but the whole step gained nothing (1.31 / 1.28 ms against 1.29 / 1.25 ms in two runs of `benchmarks/serve.py`).
PROLOGUE = os.environ.get("K3_GEMV_PROLOGUE", "0") == "1"
MAX_K = 4096  # longer rows go to cuBLAS (k3-small's dense down projection, K 6,144: 10.1 us against 11.0 on the H200)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fits(x: torch.Tensor, w: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether `linear` takes the kernel: ≤ `max_rows(w)` rows, w of ≤ MAX_K columns, no autograd, x and w of one
    float dtype and device (and the optional operands `others` on that device), w [N, K] with unit column stride,
    on CUDA. Not through the CPU interpreter: a whole model's projections there take minutes (the kernel's own
    tests call it directly)."""
    return (x.dim() >= 1 and w.dim() == 2 and x.numel() <= max_rows(w) * x.shape[-1] and not torch.is_grad_enabled()
            and w.shape[-1] <= MAX_K and w.stride(-1) == 1 and x.dtype == w.dtype
            and x.dtype in _DTYPES and x.device == w.device
            and all(t is None or (t.dtype in _DTYPES and t.device == x.device) for t in others)
            and x.is_cuda and device_reason(x, __name__) is None)


def max_rows(w: torch.Tensor | None = None) -> int:
    """Rows up to which `linear` takes the kernel (for the weight w [N, K]): `MAX_ROWS`, or 32 (64 with `WIDE_64`)
    with `WIDE` where the wide tiles won (any shape when w is None; MAX_ROWS 0: never)."""
    wide = WIDE and MAX_ROWS and (w is None or w.shape[1] <= WIDE_MAX_K or w.shape[0] >= WIDE_MIN_N)
    return max(MAX_ROWS, 64 if WIDE_64 else 32) if wide else MAX_ROWS


@eager_op
def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
           add: torch.Tensor | None = None, gate: torch.Tensor | None = None, norm: tuple | None = None,
           glu: tuple[float, float] | None = None, add_inplace: bool = False) -> torch.Tensor:
    """prologue(x) [..., K] @ w[N, K]^T (+ add [..., N]) in `out_dtype` (default x's dtype): the GEMV kernel for a few
    rows without autograd (`fits`), else cuBLAS (`torch.mm(..., out_dtype=)` for fp32 out of a half-precision
    product on CUDA, `torch.addmm` for an add without autograd or autocast, else `F.linear` (+ add) and a cast).
    `add` is how a decode step folds a residual or the shared experts' output into the GEMV's epilogue.
    add_inplace: `add` is the caller's temporary, which cuBLAS may accumulate into and return (`addmm_`: no copy
    of it into a new output first, one kernel fewer per call); only without autograd, in x's dtype, contiguous.

    The prologue, applied in this order, is what the GEMV does to x as it loads it (no separate kernels), and
    the plain ops otherwise (`prologue`):
    - glu = (β, linear β): x is [..., 2K] gate ‖ up, the input SiTU-GLU(gate, up) (`k3.ops.situ.situ_glu_fused`);
    - norm = (weight, eps, group): RMSNorm of each row (group None; weight [K]) or of each `group` columns
      (a head; weight [group]) (`k3.ops.norm.rms_norm`);
    - gate: ⊙ σ(gate) [..., K] (with a grouped norm: `rms_norm_gated`, the KDA output gate; alone: the MLA one)."""
    if fits(x, w, add, gate):
        from .triton import gemv
        if (norm is not None or glu is not None) and not (PROLOGUE and _prologue_fits(norm, w.shape[1])):
            x, gate, norm, glu = prologue(x, gate, norm, glu), None, None, None  # their own kernels (PROLOGUE)
        return gemv(x, w, out_dtype, add=add, gate=gate, norm=norm, glu=glu)
    x = prologue(x, gate, norm, glu)
    # a weight `convert_to_float8_training` marked, while training: its FP8 product, as its module would give
    y = fp8_ops.fp8_product(x, w) if fp8_ops.marked(w) else None
    if y is not None:
        y = y if add is None else y + add
        return y if out_dtype is None else y.to(out_dtype)
    if add is None and out_dtype in (None, x.dtype):
        return F.linear(x, w)
    if add is not None and (torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)):
        # autograd / autocast: add in the GEMM's epilogue (`torch.addmm`, one rounding, no add kernel; its
        # gradient for `add` is the output's, passed on as is) where that keeps F.linear(x, w) + add's dtype
        if add.shape[-1] == w.shape[0] and add.shape[:-1] == x.shape[:-1] and _addmm_keeps_dtype(x, w, add):
            y = torch.addmm(add.reshape(-1, w.shape[0]), x.reshape(-1, x.shape[-1]), w.t()).view(add.shape)
        else:
            y = F.linear(x, w) + add
        return y if out_dtype is None else y.to(out_dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if add is not None:
        a2 = add.reshape(-1, w.shape[0])  # a view of add when it is contiguous
        if add_inplace and add.dtype == x.dtype and add.is_contiguous():
            y = a2.addmm_(x2, w.t())  # into the caller's temporary: addmm would copy it to a new output first
        else:
            y = torch.addmm(a2.to(x.dtype), x2, w.t())
    elif (out_dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
          and mm_out_dtype_available(x.device.type)):
        return torch.mm(x2, w.t(), out_dtype=out_dtype).view(*lead, w.shape[0])
    else:
        y = F.linear(x2, w)
    return (y if out_dtype is None else y.to(out_dtype)).view(*lead, w.shape[0])


@eager_op
def linear_fp32_tail(x: torch.Tensor, w: torch.Tensor, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] @ w[N, K]^T as (y [..., N − tail] in x's dtype, logits [..., tail] in fp32): projections of one
    input joined with the MoE router's rows (whose logits stay fp32, as `k3.ops.moe.router_logits`). One GEMV
    for a decode step's few rows (the kernel stores the last `tail` columns unrounded), else `linear` on the two
    row blocks of w."""
    if fits(x, w):
        from .triton import gemv
        return gemv(x, w, fp32_tail=tail)
    wt = w[-tail:]
    if x.dtype != torch.float32 and not (x.is_cuda and mm_out_dtype_available(x.device.type)):
        return linear(x, w[:-tail]), F.linear(x.float(), wt.float())  # exact products, as the GEMM's fp32 output
    return linear(x, w[:-tail]), linear(x, wt, out_dtype=torch.float32)


def _addmm_keeps_dtype(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor) -> bool:
    """Whether addmm(add, x, wᵀ) has F.linear(x, w) + add's dtype: under autocast when add is already in the
    autocast dtype (autocast casts all three to it), else when the three share one dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return add.dtype == torch.get_autocast_dtype(dev)
    return x.dtype == w.dtype == add.dtype


def _prologue_fits(norm: tuple | None, K: int) -> bool:
    """A grouped norm in the kernel needs power-of-two groups of ≥ 16 columns dividing K (whole groups per chunk)."""
    if norm is None or not norm[2]:
        return True
    g = norm[2]
    return g >= 16 and g & (g - 1) == 0 and K % g == 0


def prologue(x: torch.Tensor, gate: torch.Tensor | None = None, norm: tuple | None = None,
             glu: tuple[float, float] | None = None) -> torch.Tensor:
    """`linear`'s prologue as plain ops (the reference of the kernel's, and the path for training and CPUs)."""
    if glu is not None:
        from ..situ import situ_glu_fused
        x = situ_glu_fused(x, *glu)
    if norm is not None:
        from ..norm import rms_norm, rms_norm_gated
        nw, eps, group = norm
        shape = x.shape
        if group:
            xg = x.reshape(*shape[:-1], shape[-1] // group, group)
            y = (rms_norm(xg, nw, eps) if gate is None else rms_norm_gated(xg, nw, gate.reshape(xg.shape), eps))
            return y.reshape(shape)
        x = rms_norm(x, nw, eps)
    if gate is not None:
        from ..norm import output_gate
        x = output_gate(x, gate)
    return x
