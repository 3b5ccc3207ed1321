"""Chunked linear + cross-entropy that never holds more than one chunk of logits.

The forward walks the rows in chunks; per chunk it forms the logits (one GEMM in the input dtype, fp32
accumulation inside), the row-wise log-sum-exp and loss in fp32, and -- when a gradient is needed -- the
logits gradient softmax - onehot over the chunk's logits buffer in place, then dh = g @ W and dW += g^T @ h
(fp32 accumulator). Only dh [N, D] and dW [V, D] survive to the backward, which scales them by
grad_output / (number of valid targets). No host synchronisation: the count stays a device tensor.

The row-wise step is pluggable (`rows`): `ce_rows_torch` here, `ce_rows_triton` in `triton.py`.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

RowsFn = Callable[[torch.Tensor, torch.Tensor, int, bool, torch.Tensor], None]


def default_chunk_size(vocab: int, dtype: torch.dtype, budget: int = 2 ** 31, in_place: bool = False) -> int:
    """Rows per chunk so that the memory one chunk of logits takes is about `budget` bytes (2 GiB: GEMMs of
    thousands of rows on a GPU; the CPU path passes 256 MiB, since the chunk is alive at the forward's memory
    peak): the logits in max(dtype, fp32) (the torch row pass's working copy), or with `in_place` (the Triton
    row pass, which works in the logits buffer) in dtype. A multiple of 128 when larger than 128 (GEMM-friendly).
    Larger chunks mean fewer passes of the fp32 dW accumulator (1 GiB at K3's vocabulary and k3-small's width)
    through the dW GEMM's epilogue."""
    item = torch.empty((), dtype=dtype).element_size()
    item = item if in_place else max(item, 4)
    n = max(1, budget // (max(vocab, 1) * item))
    return n - n % 128 if n > 128 else n


def even_chunks(n: int, most: int) -> int:
    """Rows per chunk for n rows in equal chunks of about `most` rows. When `most` is a multiple of 128 (a GPU's
    GEMM-friendly size) a chunk may take up to 128 rows more, and its size is rounded up to a multiple of 128. Each
    chunk costs a pass of the fp32 dW accumulator whatever its size, so a short tail chunk is a pass with little
    GEMM behind it: 32,768 rows in chunks of 6,528 were five full chunks and a 128-row tail, whose dW GEMM alone took
    ≈ 1 ms on an H100; now they are five chunks of 6,656."""
    slack = 128 if most % 128 == 0 else 0
    if n <= most + slack:
        return max(n, 1)
    parts = -(-n // (most + slack))
    size = -(-n // parts)
    return -(-size // 128) * 128 if slack else size


def ce_rows_torch(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, grad: bool,
                  loss_out: torch.Tensor) -> None:
    """Row-wise cross-entropy of a logits chunk [n, V]: writes each row's loss (0 on ignored rows) into
    loss_out [n]; with grad, overwrites logits IN PLACE with softmax - onehot(target) (0 on ignored rows),
    in the logits' dtype. Statistics in max(dtype, fp32)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # `logits` itself when fp32/fp64
    lse = torch.logsumexp(x, dim=-1)
    valid = target != ignore_index
    tgt = torch.where(valid, target, 0)[:, None]
    loss_out.copy_(torch.where(valid, lse - x.gather(1, tgt)[:, 0], 0.0))
    if grad:
        x.sub_(lse[:, None]).exp_()  # x is logits or a private copy: in place either way
        x.scatter_add_(1, tgt, -valid[:, None].to(x.dtype))
        x.masked_fill_(~valid[:, None], 0.0)
        if x is not logits:
            logits.copy_(x)


@functools.lru_cache(maxsize=None)
def _addmm_out_dtype(device_type: str) -> bool:
    """Whether torch.addmm(..., out_dtype=fp32, out=acc) (fp32 output of a bf16 GEMM, accumulated in place)
    runs on this device type (CUDA in recent torch; not on CPU). Probed once with a 2 x 2 call."""
    if device_type != "cuda":
        return False
    try:
        a = torch.zeros(2, 2, device=device_type, dtype=torch.bfloat16)
        acc = torch.zeros(2, 2, device=device_type, dtype=torch.float32)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def mm_out_dtype_available(device_type: str) -> bool:
    """Whether torch.mm(..., out_dtype=fp32) runs for bf16 operands on this device type."""
    if device_type != "cuda":
        return False
    try:
        a = torch.zeros(2, 2, device=device_type, dtype=torch.bfloat16)
        torch.mm(a, a, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc in a wider dtype than a, b when they are bf16/fp16: fp32 GEMM output where
    the device can (no rounding of the chunk's product), else the product in the input dtype added in."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _addmm_out_dtype(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif mm_out_dtype_available(acc.device.type):
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
    else:
        acc.add_(torch.mm(a, b))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, chunk_size, rows, need_dh, need_dw):
        N, _ = hidden.shape
        V = weight.shape[0]
        acc_t = torch.promote_types(hidden.dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):  # the caller already applied autocast's cast
            hidden, weight = hidden.contiguous(), weight.contiguous()
            valid = target != ignore_index
            n_valid = valid.sum()
            row_loss = torch.empty(N, device=hidden.device, dtype=acc_t)
            dh = torch.empty_like(hidden) if need_dh else None
            dw = torch.zeros(weight.shape, device=weight.device, dtype=acc_t) if need_dw else None
            grad = need_dh or need_dw
            buf = torch.empty(min(chunk_size, N), V, device=hidden.device, dtype=hidden.dtype)
            wt = weight.t()
            for s in range(0, N, chunk_size):
                e = min(s + chunk_size, N)
                h = hidden[s:e]
                lg = torch.mm(h, wt, out=buf[: e - s])
                rows(lg, target[s:e], ignore_index, grad, row_loss[s:e])
                if need_dh:
                    torch.mm(lg, weight, out=dh[s:e])
                if need_dw:
                    _accumulate(dw, lg.t(), h)
            loss = row_loss.sum() / n_valid  # NaN when every target is ignored, like F.cross_entropy
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.save_for_backward(dh, dw, n_valid)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw, n_valid = ctx.saved_tensors
        scale = grad_out / n_valid.clamp_min(1)  # 0-dim device tensors: no host sync
        gh = gw = None
        if dh is not None:
            gh = torch.mul(dh, scale, out=torch.empty_like(dh, dtype=ctx.hidden_dtype))
        if dw is not None:
            gw = torch.mul(dw, scale, out=torch.empty_like(dw, dtype=ctx.weight_dtype))
        return gh, gw, None, None, None, None, None, None


def linear_cross_entropy_chunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                 ignore_index: int = -100, chunk_size: int | None = None,
                                 rows: RowsFn = ce_rows_torch) -> torch.Tensor:
    """The fused loss (see the module docstring) with the row-wise step `rows`. hidden [N, D] and weight
    [V, D] of one float dtype (autocast already applied by the caller), target int64 [N]."""
    if chunk_size is None:
        chunk_size = even_chunks(hidden.shape[0], default_chunk_size(
            weight.shape[0], hidden.dtype, 2 ** 31 if hidden.is_cuda else 2 ** 28, in_place=rows is not ce_rows_torch))
    grad_on = torch.is_grad_enabled()
    need_dh, need_dw = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    return _LinearCrossEntropy.apply(hidden, weight, target, ignore_index, int(chunk_size), rows,
                                     need_dh, need_dw)
