"""The serving engine's decode short conv as one Triton kernel: one new token per sequence against its conv
window in a pool slot, window advanced in place (the PyTorch form in `short_conv_step` takes ~10 kernels)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def short_conv_step_kernel(x_ptr, w_ptr, win_ptr, slot_ptr, y_ptr, C, sx, s_slot,
                           W1: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr):
    """Program (n, channel block): y = silu(Σ_j w[:, j]·win[:, j] + w[:, W1]·x) in fp32; win ← (win[:, 1:], x)."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, WP)
    cm = c < C
    tap = cm[:, None] & (j[None, :] < W1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    base = win_ptr + slot * s_slot + c[:, None] * W1 + j[None, :]
    win = tl.load(base, mask=tap, other=0.0).to(tl.float32)
    nxt = tl.load(base + 1, mask=cm[:, None] & (j[None, :] + 1 < W1), other=0.0)
    xv = tl.load(x_ptr + n * sx + c, mask=cm, other=0.0)
    w = tl.load(w_ptr + c[:, None] * (W1 + 1) + j[None, :], mask=tap, other=0.0).to(tl.float32)
    wl = tl.load(w_ptr + c * (W1 + 1) + W1, mask=cm, other=0.0).to(tl.float32)
    a = tl.sum(win * w, axis=1) + xv.to(tl.float32) * wl
    tl.store(y_ptr + n * C + c, (a * tl.sigmoid(a)).to(y_ptr.dtype.element_ty), mask=cm)
    tl.debug_barrier()  # every thread has read the window before any slot is rewritten
    new = tl.where(j[None, :] == W1 - 1, xv[:, None].to(nxt.dtype), nxt)
    tl.store(base, new.to(win_ptr.dtype.element_ty), mask=tap)


def short_conv_step_triton(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """`k3.ops.conv.short_conv_step` (shapes checked there): x [N, C] (rows may be strided), weight [C, 1, W],
    windows [P, C, W-1] with contiguous slots (the pool's per-layer view), slots [N] distinct."""
    N, C = x.shape
    W1 = weight.shape[-1] - 1
    if x.stride(1) != 1:
        x = x.contiguous()
    if windows[0].stride() != (W1, 1):
        raise ValueError(f"short_conv_step: each window slot must be contiguous [C, W-1], strides {windows.stride()}")
    y = torch.empty(N, C, dtype=x.dtype, device=x.device)
    BC = 128
    short_conv_step_kernel[(N, triton.cdiv(C, BC))](
        x, weight.reshape(C, W1 + 1).float().contiguous(), windows, slots.contiguous(), y, C, x.stride(0),
        windows.stride(0), W1=W1, WP=max(2, triton.next_power_of_2(W1)), BC=BC, num_warps=4)
    return y
