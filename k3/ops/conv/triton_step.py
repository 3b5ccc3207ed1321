"""The serving engine's decode short conv as one Triton kernel: the new tokens of each sequence (one in a decode
step, a few in a captured extend step) against its conv window in a pool slot, window advanced in place (the
PyTorch form in `short_conv_step` takes ~10 kernels)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_jit import token_range


@triton.jit
def short_conv_step_kernel(x_ptr, w_ptr, win_ptr, slot_ptr, cu_ptr, y_ptr, C, sx, s_slot,
                           W1: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, HAS_CU: tl.constexpr):
    """Program (n, channel block): for each new token x of sequence n (tokens cu[n]..cu[n+1], or token n alone
    without cu), y = silu(Σ_j w[:, j]·win[:, j] + w[:, W1]·x) in fp32, then win ← (win[:, 1:], x); the window
    stays in registers between tokens and goes back to slot[n] once."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, WP)
    cm = c < C
    tap = cm[:, None] & (j[None, :] < W1)
    bos, eos = token_range(cu_ptr, n, HAS_CU)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    base = win_ptr + slot * s_slot + c[:, None] * W1 + j[None, :]
    win = tl.load(base, mask=tap, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c[:, None] * (W1 + 1) + j[None, :], mask=tap, other=0.0).to(tl.float32)
    wl = tl.load(w_ptr + c * (W1 + 1) + W1, mask=cm, other=0.0).to(tl.float32)
    # shift[i, j] = (i == j + 1): win @ shift moves every column one step left (register-only)
    shift = (j[:, None] == j[None, :] + 1).to(tl.float32)
    for t in range(bos, eos):
        xv = tl.load(x_ptr + t * sx + c, mask=cm, other=0.0).to(tl.float32)
        a = tl.sum(win * w, axis=1) + xv * wl
        tl.store(y_ptr + t * C + c, (a * tl.sigmoid(a)).to(y_ptr.dtype.element_ty), mask=cm)
        nxt = tl.sum(win[:, :, None] * shift[None, :, :], axis=1)
        win = tl.where(j[None, :] == W1 - 1, xv[:, None], nxt)
    tl.debug_barrier()  # every thread has read the window before the slot is rewritten
    tl.store(base, win.to(win_ptr.dtype.element_ty), mask=tap)


def short_conv_step_triton(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
                           slots: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """`k3.ops.conv.short_conv_step` (shapes checked there): x [N, C] (rows may be strided), weight [C, 1, W],
    windows [P, C, W-1] with contiguous slots (the pool's per-layer view), slots [n] distinct; cu_seqlens [n + 1]
    the tokens of each sequence (None: one each). Rows of x outside every sequence get y = 0."""
    N, C = x.shape
    W1 = weight.shape[-1] - 1
    if x.stride(1) != 1:
        x = x.contiguous()
    if windows[0].stride() != (W1, 1):
        raise ValueError(f"short_conv_step: each window slot must be contiguous [C, W-1], strides {windows.stride()}")
    n = N if cu_seqlens is None else cu_seqlens.numel() - 1
    y = (torch.empty if cu_seqlens is None else torch.zeros)(N, C, dtype=x.dtype, device=x.device)
    BC = 128
    short_conv_step_kernel[(n, triton.cdiv(C, BC))](
        x, weight.reshape(C, W1 + 1).float().contiguous(), windows, slots.contiguous(),
        None if cu_seqlens is None else cu_seqlens.contiguous(), y, C, x.stride(0), windows.stride(0), W1=W1,
        WP=max(2, triton.next_power_of_2(W1)), BC=BC, HAS_CU=cu_seqlens is not None, num_warps=4)
    return y
