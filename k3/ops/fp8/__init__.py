"""FP8 projections for training: row-wise scaled e4m3 GEMMs on Hopper's FP8 tensor cores.

`quantize_rows` is the dispatch point of the quantisation (backends "reference": plain PyTorch, the oracle and
the CPU path; "triton": one kernel, bit-identical; "auto": triton on CUDA). `fp8_linear` is x Wᵀ with

- forward:  y  = e4m3(x) e4m3(W)ᵀ, one power-of-two scale per row of x and per row of W;
- backward: dx = e4m3(dy) e4m3(Wᵀ)ᵀ, scales per row of dy and per column of W (`DGRAD`, K3_FP8_DGRAD=0: bf16;
            layers narrower than `DGRAD_MIN_K` at the input take bf16);
            dW = dyᵀ x in x's dtype (bf16): the weight gradient, a sum over every token, keeps full precision,
            as torchao's row-wise recipe ("rowwise_with_gw_hp") does. With `WGRAD` on (K3_FP8_WGRAD=1) dW is an
            FP8 GEMM too, over dy's and x's columns (one scale per column over all M tokens, so one outlier token
            coarsens its column; M must be a multiple of 16, else bf16).

The GEMMs are `torch._scaled_mm` (cuBLAS on sm_89+, oneDNN on CPU); products accumulate in fp32. The
quantisation of a weight happens in the call (once per forward and once per backward), so there is no cache to
go stale when an optimizer writes the weights in place.

`convert_to_float8_training(model)` turns a model's eligible `nn.Linear` modules into `Float8Linear` (same
parameters, same state-dict names) and marks their weights so `k3.ops.joined_linear` takes the FP8 path for
them too. FP8 applies only while autograd records (training); inference and `no_grad` evaluation stay exact.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import nn

from .._compile import eager_op
from .._triton import device_reason, importable
from ..linear_ce import autocast_cast
from .reference import E4M3_MAX, FP8, dequantize_rows, pow2_scale, quantize_rows_reference

__all__ = ["quantize_rows", "quantize_joined", "scaled_mm", "quantize_rows_reference", "dequantize_rows",
           "pow2_scale", "fp8_linear", "fp8_product", "fp8_mm", "weight_grad", "wgrad_fp8", "fp8_reason", "input_reason", "Float8Linear",
           "convert_to_float8_training", "marked", "E4M3_MAX", "FP8", "BACKENDS", "DGRAD", "DGRAD_MIN_K", "WGRAD"]

BACKENDS = ("auto", "reference", "triton")
ALIGN = 16  # _scaled_mm needs both GEMM dimensions of each operand (K and N) to be multiples of 16
# which backward GEMMs run in FP8 (read at each call): dx (K3_FP8_DGRAD=0: bf16) and dW (K3_FP8_WGRAD=1: FP8).
# dx pays for quantising dy (≈ 3 bytes per element of dy) with a third of a GEMM whose depth is the layer's input
# width: at k3-small's 1,536 that saving is about 1.5x the quantisation's cost, a margin the GPU has to confirm.
DGRAD = os.environ.get("K3_FP8_DGRAD", "1") == "1"
WGRAD = os.environ.get("K3_FP8_WGRAD", "0") == "1"
# dx in FP8 only for layers at least this wide at the input (K): the saving per element of dy grows with K, the
# cost of quantising dy does not; below ≈ 1,000 (k3-small's f_b 128, kv_b 256, q_b 512, the latent up 768) the
# FP8 GEMM cannot repay it, so those take the bf16 GEMM (K3_FP8_DGRAD_MIN_K; 0: every layer)
DGRAD_MIN_K = int(os.environ.get("K3_FP8_DGRAD_MIN_K", "1024"))
_MARK = "_k3_fp8"  # attribute set on a weight whose projections run in FP8 (`convert_to_float8_training`)


def triton_available() -> bool:
    return importable(__name__ + ".triton")


@eager_op
def quantize_rows(x: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (fp32 / bf16 / fp16, any strides) → (q [R, C] e4m3 contiguous, s [R] fp32), x ≈ q · s[:, None]
    with s the smallest power of two that keeps every |x| / s within 448 (`reference.pow2_scale`)."""
    if backend not in BACKENDS:
        raise ValueError(f"quantize_rows: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_rows: expected a 2-D fp32/bf16/fp16 tensor, got {x.dtype} {tuple(x.shape)}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_available() else "reference"
    if backend == "reference":
        return quantize_rows_reference(x)
    why = device_reason(x, __name__)
    if why is not None:
        raise ValueError(f"quantize_rows: backend 'triton' cannot run this call: {why}")
    from .triton import quantize_rows_triton
    return quantize_rows_triton(x)


@functools.lru_cache(maxsize=None)
def _fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why x Wᵀ cannot run as `fp8_linear` (None: it can): the weight's shape and dtype, then `input_reason`."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return f"expected x [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
    if weight.shape[0] % ALIGN or weight.shape[0] == 0:
        return f"both weight dimensions must be positive multiples of {ALIGN}, got {tuple(weight.shape)}"
    if x.device != weight.device:
        return f"x and weight must share a device, got {x.device} and {weight.device}"
    if not weight.is_floating_point() or weight.dtype == torch.float64:
        return f"weight must be fp32/bf16/fp16, got {weight.dtype}"
    return input_reason(x)


def input_reason(x: torch.Tensor) -> str | None:
    """Why activations x [..., K] cannot enter an FP8 GEMM (None: they can): K a positive multiple of 16; CUDA
    wants an sm_89+ GPU and bf16 (the row-wise `_scaled_mm` writes bf16 only); the CPU takes fp32 or bf16."""
    K = x.shape[-1] if x.dim() else 0
    if K % ALIGN or K == 0:
        return f"both weight dimensions must be positive multiples of {ALIGN}, got an input width of {K}"
    if x.is_cuda:
        if x.dtype != torch.bfloat16:
            return f"on CUDA x must be bf16 (cast by autocast), got {x.dtype}"
        if not _fp8_capable(x.device.index if x.device.index is not None else torch.cuda.current_device()):
            return "the GPU has no FP8 tensor cores (sm_89 or newer needed)"
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return f"needs CUDA bf16 or CPU fp32/bf16 activations, got {x.dtype} on {x.device}"
    return None


def quantize_joined(pieces: list[torch.Tensor], offsets: list[int], width: int, backend: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of the [R, width] matrix holding piece i ([R, n_i], fp32/bf16/fp16) at columns
    offsets[i] and zeros elsewhere, without making that matrix: one row scale over all pieces. The Triton path
    reads each piece in place (up to `MAX_PIECES`; more, or a piece with a column stride, go through the joined
    copy)."""
    if backend not in BACKENDS:
        raise ValueError(f"quantize_joined: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if not pieces or len(offsets) != len(pieces):
        raise ValueError(f"quantize_joined: expected pieces and one offset each, got {len(pieces)} and {len(offsets)}")
    R = pieces[0].shape[0]
    for p, o in zip(pieces, offsets):
        if p.dim() != 2 or p.shape[0] != R or o < 0 or o + p.shape[1] > width:
            raise ValueError(f"quantize_joined: piece {tuple(p.shape)} at column {o} does not fit [{R}, {width}]")
    if backend == "auto":
        backend = "triton" if pieces[0].is_cuda and triton_available() else "reference"
    if backend == "triton":
        from .triton import MAX_PIECES, quantize_pieces_triton
        if len(pieces) <= MAX_PIECES and all(p.stride(1) == 1 for p in pieces):
            why = device_reason(pieces[0], __name__)
            if why is not None:
                raise ValueError(f"quantize_joined: backend 'triton' cannot run this call: {why}")
            return quantize_pieces_triton(pieces, offsets, width)
    joined = pieces[0].new_zeros(R, width)
    for p, o in zip(pieces, offsets):
        joined[:, o:o + p.shape[1]] = p
    return quantize_rows(joined, backend)


def scaled_mm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
              ) -> torch.Tensor:
    """(aq · sa) (bq · sb)ᵀ for row-quantised aq [M, K], bq [N, K]: one `_scaled_mm` (fp32 accumulation)."""
    if aq.shape[0] == 0 or bq.shape[0] == 0 or aq.shape[1] == 0:  # cuBLAS takes no empty operand
        return torch.zeros(aq.shape[0], bq.shape[0], dtype=out_dtype, device=aq.device)
    if not aq.is_cuda and not _cpu_rowwise_scaled_mm():
        # older torch (2.11) runs `_scaled_mm` on the CPU with per-tensor scales only: the same product in fp32
        # (e4m3 products are exact in fp32; the sums accumulate in fp32, as the GEMM's do)
        return ((aq.float() @ bq.float().t()) * sa[:, None] * sb[None, :]).to(out_dtype)
    return torch._scaled_mm(aq, bq.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes row-wise scales (2.13 does; 2.11 asserts per-tensor only)."""
    a = torch.ones(16, 16).to(FP8)
    s = torch.ones(16)
    try:
        torch._scaled_mm(a, a.t(), scale_a=s[:, None], scale_b=s[None, :], out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def fp8_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a bᵀ for a [M, K] and b [N, K] (any float dtypes and strides), both quantised per row: one `_scaled_mm`."""
    return scaled_mm(*quantize_rows(a), *quantize_rows(b), out_dtype)


def wgrad_fp8(M: int) -> bool:
    """Whether dW = dyᵀ x over M tokens runs as an FP8 GEMM (`WGRAD`, and M a positive multiple of 16)."""
    return WGRAD and M > 0 and M % ALIGN == 0


def weight_grad(dy: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, x_cols=None) -> torch.Tensor:
    """dW = dyᵀ x for dy [M, N] and x [M, K], in `dtype`: a bf16 (x's dtype) GEMM, or with `wgrad_fp8(M)` an FP8 one
    over both operands' columns (transposed views, quantised in place). x_cols: `quantize_rows(x.t())`, when the
    caller shares it between several dy (the joined projections' pieces)."""
    if wgrad_fp8(dy.shape[0]):
        return scaled_mm(*quantize_rows(dy.t()), *(x_cols or quantize_rows(x.t())), x.dtype).to(dtype)
    return dy.t().mm(x).to(dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        x2 = x.reshape(-1, x.shape[-1])
        y = fp8_mm(x2, weight, x.dtype)
        ctx.save_for_backward(x2, weight)
        ctx.xshape = x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0]).to(x2.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            fp8_dx = DGRAD and weight.shape[1] >= DGRAD_MIN_K
            dx = (fp8_mm(dy2, weight.t(), x2.dtype) if fp8_dx else dy2.mm(weight.to(x2.dtype))).view(ctx.xshape)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy2, x2, weight.dtype)
        return dx, dw


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ (no bias) through row-wise FP8 GEMMs forward and for dx, bf16 / x's dtype for dW (module docstring).
    Under autocast, x is cast to the autocast dtype as `F.linear` would; the weight (e.g. an fp32 master) is
    quantised directly. ValueError when the shapes or devices do not fit (`fp8_reason`)."""
    x = autocast_cast(x)
    why = fp8_reason(x, weight)
    if why is not None:
        raise ValueError(f"fp8_linear: {why}")
    return _apply(x, weight)


def fp8_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x Wᵀ as `fp8_linear` while autograd records and FP8 can take the operands (`fp8_reason`); None otherwise,
    for the caller's plain product (`Float8Linear`, and `k3.ops.gemv.linear` for a marked weight)."""
    if not torch.is_grad_enabled():
        return None
    xc = autocast_cast(x)
    return _apply(xc, weight) if fp8_reason(xc, weight) is None else None


def _apply(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`fp8_linear` once x is cast and checked."""
    with torch.autocast(x.device.type, enabled=False):
        return _Fp8Linear.apply(x, weight)


def marked(*weights: torch.Tensor) -> bool:
    """True when every weight was marked for FP8 training and autograd records (training)."""
    return torch.is_grad_enabled() and all(getattr(w, _MARK, False) for w in weights)


class Float8Linear(nn.Linear):
    """An `nn.Linear` (no bias) whose training forward is `fp8_linear`; under `no_grad`, or for an input FP8
    cannot take, it is the plain linear. Made by `convert_to_float8_training`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_product(x, self.weight)
        return super().forward(x) if y is None else y


def convert_to_float8_training(model: nn.Module, module_filter=None) -> int:
    """Turn every bias-free `nn.Linear` of `model` whose weight dimensions are multiples of 16 (and, if given,
    for which `module_filter(name, module)` is true) into a `Float8Linear` in place: the same parameter objects
    and state-dict names. Returns how many converted. Also marks the weights of bias-free linears whose input
    width is a multiple of 16 (narrow ones included, e.g. KDA's β [12, D]) so `k3.ops.joined_linear`, which pads
    the joined rows, takes the FP8 path when all of a call's weights are marked. The LM head stays as it is:
    the fused linear + cross-entropy reads it as a weight, in bf16 (as DeepSeek-V3 keeps its head). Convert before
    sharding: FSDP2's sharded parameters are new objects without the mark (the converted modules stay FP8; the
    joined projections then run in bf16)."""
    n = 0
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear or mod.bias is not None or name.endswith("lm_head") or mod.in_features % ALIGN:
            continue
        if module_filter is not None and not module_filter(name, mod):
            continue
        setattr(mod.weight, _MARK, True)
        if mod.out_features % ALIGN == 0:
            mod.__class__ = Float8Linear
            n += 1
    return n
