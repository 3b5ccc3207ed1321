"""A batch-1 decode step's whole KDA attention (joined input projection, f_b, short conv step, recurrent step,
gated output norm, o_proj, residual) as ONE persistent kernel (`kda_block_triton.py`), the KDA counterpart of
`k3.ops.moe_block`: six short kernels whose time is mostly fixed cost become one whose programs meet at three grid
barriers.

`kda_block_decode` is the one dispatch point; `kda_block_reference` is the composed path it replaces
(`KimiDeltaAttention._forward_paged`'s decode branch: `linear`, `short_conv_step`, `kda_decode_step_gated`, the
gated norm and `linear`), which `tests/test_kda_block.py` compares against, outputs and the updated conv window and
state. `ON` (K3_KDA_BLOCK=1) is read at each call; off by default until `benchmarks/serve.py` has timed it. On a CPU
the kernel runs under Triton's interpreter with one program.
"""
from __future__ import annotations

import os

import torch

from ._triton import check_counters, cooperative, interpreted, pdl, runs_on

ON = os.environ.get("K3_KDA_BLOCK", "0") == "1"
# rows per tile of the projections (BN), conv channels per tile (BC), state columns per recurrent tile (BV),
# columns per unrolled load (CH), warps, programs per SM, a cooperative launch (`coop`, as `moe_block.LAUNCH`).
# Not yet tuned on a GPU.
# `mma`, `stages`: the joined projection's and f_b's tiles on the tensor cores (`moe_block_triton._dot_rows`).
LAUNCH = {"bn": 8, "bc": 64, "bv": 16, "ch": 256, "warps": 4, "per_sm": 2, "coop": False, "mma": False, "stages": 3}


def fits(x: torch.Tensor, head_dim: int, *weights: torch.Tensor) -> bool:
    """Whether the KDA layer takes this kernel: `ON`, one row, no autograd, a power-of-two head dim, one float
    dtype for x and the weights, CUDA (or the CPU interpreter)."""
    return (ON and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and not torch.is_grad_enabled()
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and head_dim >= 16
            and head_dim & (head_dim - 1) == 0 and all(w.dtype == x.dtype and w.device == x.device for w in weights)
            and runs_on(x, __name__ + "_triton", "kda_block_kernel"))


def kda_block_decode(x: torch.Tensor, w_in: torch.Tensor, w_fb: torch.Tensor, w_conv: torch.Tensor,
                     conv_pool: torch.Tensor, state_pool: torch.Tensor, slot: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor | None, lower_bound: float, o_norm: tuple[torch.Tensor, float],
                     w_o: torch.Tensor, residual: torch.Tensor | None, counters: torch.Tensor) -> torch.Tensor:
    """x [1, D] (the layer's normed input) → residual + the KDA attention's output [1, D] in x's dtype, the
    sequence's conv window and recurrent state (pool slot `slot`, a device tensor [1]) advanced in place.

    w_in [≥ 4·H·K + K + H, D]: q ‖ k ‖ v ‖ f_a ‖ b ‖ g projections (the joined weight; padding rows unread);
    w_fb [H·K, K]; w_conv [3·H·K, 1, W] (the three convs' taps, any float dtype); conv_pool [P, 3·H·K, W-1] and
    state_pool [P, H, K, K] fp32 (each slot contiguous); A_log [H]; dt_bias [H·K] or None; o_norm (weight [K], eps);
    w_o [D, H·K]; counters: `k3.ops._triton.grid_counters`' int32 [3] (see `k3.ops.moe_block.moe_block_decode`)."""
    D = x.shape[-1]
    HK, K = w_fb.shape
    H = HK // K
    W = w_conv.shape[-1]
    _check(x, w_in, w_fb, w_conv, conv_pool, state_pool, slot, A_log, dt_bias, o_norm, w_o, residual, counters)
    dev, dt = x.device, x.dtype
    yin = torch.empty(4 * HK + K + H, device=dev, dtype=dt)
    f, qkv, o = (torch.empty(n, device=dev, dtype=dt) for n in (HK, 3 * HK, HK))
    out = torch.empty(1, D, device=dev, dtype=dt)
    import triton

    from .kda_block_triton import kda_block_kernel
    c = LAUNCH
    G = torch.cuda.get_device_properties(dev).multi_processor_count * c["per_sm"] if x.is_cuda else 1
    kda_block_kernel[(G,)](
        x, x if residual is None else residual, out, w_in, w_fb, w_conv, conv_pool, conv_pool.stride(0), state_pool,
        state_pool.stride(0), slot, A_log, A_log if dt_bias is None else dt_bias, o_norm[0], w_o, yin, f, qkv, o,
        counters, K ** -0.5, float(lower_bound), float(o_norm[1]), G, D=D, H=H, K=K, W1=W - 1,
        WP=max(2, triton.next_power_of_2(W - 1)), HAS_RES=residual is not None, HAS_DTB=dt_bias is not None,
        BN=c["bn"], BC=c["bc"], BV=min(c["bv"], K), CH=c["ch"], MMA=c["mma"], STAGES=c["stages"],
        IEEE=interpreted(kda_block_kernel) or w_in.dtype == torch.float32, num_warps=c["warps"],
        **cooperative(x, c["coop"]), **pdl(x))
    return out


def kda_block_reference(x: torch.Tensor, w_in: torch.Tensor, w_fb: torch.Tensor, w_conv: torch.Tensor,
                        conv_pool: torch.Tensor, state_pool: torch.Tensor, slot: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor | None, lower_bound: float, o_norm: tuple[torch.Tensor, float],
                        w_o: torch.Tensor, residual: torch.Tensor | None, counters: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """`kda_block_decode` by the ops the engine's decode branch runs without it (`linear`, `short_conv_step`,
    `kda_decode_step_gated`, `linear` with the gated norm as its prologue), pools updated in place alike."""
    from .conv import short_conv_step
    from .gemv import linear
    from .kda import kda_decode_step_gated
    HK, K = w_fb.shape
    H = HK // K
    y, fa, bl, gate, _ = linear(x, w_in).split([3 * HK, K, H, HK, w_in.shape[0] - 4 * HK - K - H], -1)
    f = linear(fa, w_fb).view(1, H, K)
    q, k, v = short_conv_step(y, w_conv, conv_pool, slot.reshape(1)).split(HK, dim=-1)
    o = kda_decode_step_gated(q.reshape(1, H, K), k.reshape(1, H, K), v.reshape(1, H, K), f, bl, A_log, dt_bias,
                              state_pool, slot.reshape(1), lower_bound)
    return linear(o.reshape(1, HK), w_o, add=residual, gate=gate, norm=(*o_norm, K))


def _check(x, w_in, w_fb, w_conv, conv_pool, state_pool, slot, A_log, dt_bias, o_norm, w_o, residual,
           counters) -> None:
    D = x.shape[-1]
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"kda_block_decode: x must be one contiguous row [1, D], got {tuple(x.shape)}")
    if w_fb.dim() != 2 or w_fb.shape[0] % w_fb.shape[1]:
        raise ValueError(f"kda_block_decode: w_fb must be [H·K, K], got {tuple(w_fb.shape)}")
    HK, K = w_fb.shape
    H = HK // K
    W = w_conv.shape[-1]
    want = {"w_fb": (w_fb, (HK, K)), "w_conv": (w_conv, (3 * HK, 1, W)), "w_o": (w_o, (D, HK)),
            "A_log": (A_log, (H,)), "o_norm weight": (o_norm[0], (K,))}
    if dt_bias is not None:
        want["dt_bias"] = (dt_bias, (HK,))
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"kda_block_decode: {name} has shape {tuple(t.shape)}, expected {shape}")
        if not t.is_contiguous():
            raise ValueError(f"kda_block_decode: {name} must be contiguous")
    if w_in.dim() != 2 or w_in.shape[1] != D or w_in.shape[0] < 4 * HK + K + H or not w_in.is_contiguous():
        raise ValueError(f"kda_block_decode: w_in must be a contiguous [≥ {4 * HK + K + H}, {D}], got "
                         f"{tuple(w_in.shape)}")
    if conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (3 * HK, W - 1) or conv_pool[0].stride() != (W - 1, 1):
        raise ValueError(f"kda_block_decode: conv_pool must be [P, {3 * HK}, {W - 1}] with contiguous slots, got "
                         f"{tuple(conv_pool.shape)} strides {conv_pool.stride()}")
    if (state_pool.dtype != torch.float32 or state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (H, K, K)
            or state_pool[0].stride() != (K * K, K, 1)):
        raise ValueError(f"kda_block_decode: state_pool must be fp32 [P, {H}, {K}, {K}] with contiguous slots, got "
                         f"{state_pool.dtype} {tuple(state_pool.shape)}")
    if slot.numel() != 1 or slot.is_floating_point() or slot.device != x.device:
        raise ValueError(f"kda_block_decode: slot must be one integer on x's device, got {slot.dtype} "
                         f"{tuple(slot.shape)}")
    if residual is not None and (tuple(residual.shape) != (1, D) or not residual.is_contiguous()):
        raise ValueError(f"kda_block_decode: residual must be a contiguous [1, {D}], got {tuple(residual.shape)}")
    check_counters(counters, "kda_block_decode", x.device)
