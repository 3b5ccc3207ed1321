"""A batch-1 decode step's whole LatentMoE (joined input projection, routing, routed experts, shared experts,
latent norm, up projection, residual) as one kernel in four phases (`moe_block_triton.py`): by default four
launches of it, one per phase (`SPLIT`), else one persistent launch whose phases meet at grid barriers.

Why: at batch 1 the MoE of a k3-small layer is eight short kernels (the joined GEMV, the routed experts' two, the
shared experts' SiTU and down projection, the latent norm, the up projection) whose time is mostly each kernel's
fixed cost, not the ≈ 24 MB they read. Four phases are the fewest the data dependences allow. As one persistent
launch, programs meeting at three grid barriers (`k3.ops._triton_jit.grid_barrier`), a layer costs 14.6 µs besides
its reads on an H100; as four launches chained by programmatic dependent launch, 8.7-9.4 µs (the latency floor of
`probe/moe_block.py`: every width shrunk to ≈ 1 % of the bytes).

`moe_block_decode` is the one dispatch point; its reference is the composed path it replaces (`LatentMoE.forward`'s
joined inference branch: `linear_fp32_tail`, `experts_decode_routed`, `SituMLP.down`, `linear` with the norm),
which `tests/test_moe_block.py` compares against. The values differ from that path only by the order of fp32
sums (and the shared SiTU-GLU's exact tanh where the separate kernel may use the hardware's on a GPU).

`ON` (K3_MOE_BLOCK; read at each call) is on by default where CUDA is: on the H200 (2026-12-05) `benchmarks/serve.py`
took the batch-1 step from 1.09 to 1.04 ms with it (the one launch), and `probe/moe_block.py` timed 23.2 against
25.7 µs per layer. The one launch is cooperative (`LAUNCH["coop"]`), so the driver guarantees the programs'
co-residency the barriers need or refuses. On a CPU (K3_MOE_BLOCK=1 or the tests) the kernel runs under Triton's
interpreter: split, with a program per tile; as one launch, with one program (the interpreter runs programs one
after another, so a grid barrier among several could only time out).
"""
from __future__ import annotations

import os

import torch

from ._triton import check_counters, cooperative, pdl, runs_on, sm_count

ON = os.environ.get("K3_MOE_BLOCK", "1" if torch.cuda.is_available() else "0") == "1"
# rows per tile of the dense projections (BN), of the experts' gate / up (BI) and down (BL); columns per unrolled
# load (CH); warps; programs per SM; a cooperative launch (`coop`: the driver refuses a grid whose programs cannot
# all be resident at once, where a plain launch would leave the barrier to time out; under graph capture on the
# H200 it costs 0.3-0.5 µs per layer). `probe/moe_block.py` (H200, 2026-12-05, 16 layers in a graph, 12 settings):
# bn 8, bi 8, bl 4, 4 per SM 23.2 µs per layer against 25.7 for the composed path; the other settings 25.5-54.5
LAUNCH = {"bn": 8, "bi": 8, "bl": 4, "ch": 256, "warps": 4, "per_sm": 4, "coop": True}
# SPLIT (K3_MOE_BLOCK_SPLIT, default on; read at each call): the four phases as four launches of the same kernel, a
# program per tile, with kernel boundaries (and programmatic dependent launch) instead of grid barriers, under
# LAUNCH_SPLIT's tiles. `probe/moe_block.py` (H100, 2026-12-05, 16 layers in a graph, two runs): 23.48 / 23.71 µs
# per layer at tiles 4 / 4 / 4 against 25.57 / 25.70 for the one launch (latency floor 9.35 / 8.72 against
# 14.63 / 14.67 µs); `serve.py`'s batch-1 step 1.14 against 1.15 ms in the same run.
SPLIT = os.environ.get("K3_MOE_BLOCK_SPLIT", "1") == "1"
# Its tiles per phase: rows of the joined input (bn1), of the shared experts' down projection (bn2) and of the up
# projection (bn4); the experts' gate / up rows (bi) and down rows (bl)
LAUNCH_SPLIT = {"bn1": 4, "bn2": 4, "bn4": 4, "bi": 4, "bl": 4, "ch": 256, "warps": 4}
# the split form launches phases 1..PHASES: fewer only for `probe/moe_block.py --phases`, which times the prefixes
# 1, 1-2, 1-3 and 1-4 (each phase reads what the ones before it wrote, so only prefixes are safe; the output of a
# shorter prefix is incomplete)
PHASES = 4
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(x: torch.Tensor) -> bool:
    """The kernel can run where x lives: CUDA with Triton, or the CPU interpreter (TRITON_INTERPRET=1)."""
    return runs_on(x, __name__ + "_triton", "moe_block_kernel")


def fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `LatentMoE` takes this kernel: `ON`, one row, no autograd, one float dtype for x and the weights."""
    return (ON and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and not torch.is_grad_enabled()
            and x.dtype in _DTYPES
            and all(w.dtype == x.dtype and w.device == x.device for w in weights) and available(x))


def moe_block_decode(x: torch.Tensor, w_in: torch.Tensor, latent: int, shared: int, w1: torch.Tensor,
                     w2: torch.Tensor, w3: torch.Tensor, w_shared_down: torch.Tensor, w_up: torch.Tensor,
                     norm: tuple[torch.Tensor, float] | None, bias: torch.Tensor | None, top_k: int,
                     renormalize: bool, scaling_factor: float, beta: float, linear_beta: float,
                     residual: torch.Tensor | None, counters: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, D] → (residual + LatentMoE(x) [1, D] in x's dtype, topk_idx [1, K] long, topk_weight [1, K] fp32,
    scores [1, E] fp32).

    w_in [L + 2·I_s + E, D]: the latent down projection ‖ the shared experts' gate ‖ up ‖ the router (the joined
    weight of `LatentMoE`); w1 / w3 [E, I, L] (any expert / row strides), w2 [E, L, I]; w_shared_down [D, I_s];
    w_up [D, L]; norm: the latent RMSNorm's (weight [L], eps) or None; bias: the selection bias [E] or None.
    counters: `k3.ops._triton.grid_counters`' int32 [3] (zeros; the kernel leaves its two barrier counters at zero,
    and sets the third if a barrier timed out); one per caller: two launches must not share one at the same time."""
    D = x.shape[-1]
    E, I, L = w1.shape
    IS, K = shared, top_k
    _check(x, w_in, latent, shared, w1, w2, w3, w_shared_down, w_up, norm, bias, top_k, residual, counters)
    dev, dt = x.device, x.dtype
    f32 = dict(device=dev, dtype=torch.float32)
    lat, gu, h, y, sh = (torch.empty(n, device=dev, dtype=dt) for n in (L, 2 * IS, K * I, L, D))
    z = torch.empty(E, **f32)
    idx = torch.empty(1, K, device=dev, dtype=torch.long)
    wt, scores = torch.empty(1, K, **f32), torch.empty(1, E, **f32)
    out = torch.empty(1, D, device=dev, dtype=dt)
    import triton

    from .moe_block_triton import moe_block_kernel
    c = LAUNCH_SPLIT if SPLIT else LAUNCH
    nw, eps = norm if norm is not None else (x, 0.0)
    cdiv = triton.cdiv
    # (phase, programs, BN): one persistent launch with barriers, or one launch per phase with a program per tile
    if SPLIT:
        bn1, bn2, bn4 = c["bn1"], c["bn2"], c["bn4"]
        grids = [(1, cdiv(L + 2 * IS + E, bn1), bn1), (2, K * cdiv(I, c["bi"]) + cdiv(D, bn2), bn2),
                 (3, cdiv(L, c["bl"]), bn2), (4, cdiv(D, bn4), bn4)][:PHASES]
    else:
        grids = [(0, sm_count(dev) * c["per_sm"] if x.is_cuda else 1, c["bn"])]
    for phase, G, bn in grids:
        moe_block_kernel[(G,)](
            x, x if residual is None else residual, out, w_in, w1, w3, w2, w_shared_down, w_up, nw,
            z if bias is None else bias, lat, gu, z, h, y, sh, idx, wt, scores, counters,
            w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), w2.stride(0), w2.stride(1),
            float(scaling_factor), float(beta), float(linear_beta), float(eps), G, D=D, L=L, I=I, IS=IS, E=E, K=K,
            BE=max(16, triton.next_power_of_2(E)), HAS_BIAS=bias is not None, RENORM=bool(renormalize),
            HAS_NORM=norm is not None, HAS_RES=residual is not None, BN=bn, BI=c["bi"], BL=c["bl"], CH=c["ch"],
            BLN=triton.next_power_of_2(L), PHASE=phase, num_warps=c["warps"],
            **cooperative(x, phase == 0 and c["coop"]), **pdl(x))
    return out, idx, wt, scores


def _check(x, w_in, latent, shared, w1, w2, w3, w_sd, w_up, norm, bias, top_k, residual, counters) -> None:
    D = x.shape[-1]
    E, I, L = w1.shape
    want = {"w_in": (w_in, (L + 2 * shared + E, D)), "w3": (w3, (E, I, L)), "w2": (w2, (E, L, I)),
            "w_shared_down": (w_sd, (D, shared)), "w_up": (w_up, (D, L))}
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"moe_block_decode: x must be one row [1, D], got {tuple(x.shape)}")
    if latent != L:
        raise ValueError(f"moe_block_decode: latent={latent} but the experts take {L} columns")
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"moe_block_decode: {name} has shape {tuple(t.shape)}, expected {shape}")
    for name, t in (("x", x), ("w_in", w_in), ("w_shared_down", w_sd), ("w_up", w_up)):
        if not t.is_contiguous():
            raise ValueError(f"moe_block_decode: {name} must be contiguous")
    if w1.stride(-1) != 1 or w3.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("moe_block_decode: the expert weights need unit column stride")
    if not 0 < top_k <= E:
        raise ValueError(f"moe_block_decode: top_k={top_k} must lie in [1, {E}]")
    if norm is not None and (tuple(norm[0].shape) != (L,) or not norm[0].is_contiguous()):
        raise ValueError(f"moe_block_decode: the norm weight must be a contiguous [{L}], got {tuple(norm[0].shape)}")
    if bias is not None and (tuple(bias.shape) != (E,) or bias.dtype != torch.float32):
        raise ValueError(f"moe_block_decode: bias must be fp32 [{E}], got {bias.dtype} {tuple(bias.shape)}")
    if residual is not None and (tuple(residual.shape) != (1, D) or not residual.is_contiguous()):
        raise ValueError(f"moe_block_decode: residual must be a contiguous [1, {D}], got {tuple(residual.shape)}")
    check_counters(counters, "moe_block_decode", x.device)
