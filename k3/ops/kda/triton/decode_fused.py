"""One Triton kernel for a KDA layer's decode step between its input projection and its output norm.

A decode step (one new token per sequence) otherwise runs three kernels per KDA layer: the `f_b` GEMV of the
gate's low-rank pre-activation, the short conv against each slot's window (`short_conv_step_kernel`) and the
recurrent step (`kda_decode_kernel`). Here program (n, h) does all three for head h of sequence n:

1. q, k, v: silu(conv) of the head's channels of the projection y against the slot's conv windows (fp32, rounded
   to y's dtype as the conv kernel stores them), the windows advanced in place;
2. f = W_fb[h·K:(h+1)·K] · f_a (fp32 sums of the inputs' products, rounded to y's dtype as the GEMV stores it);
3. the gated delta-rule step on the slot's fp32 state [K, V] (updated in place), as `kda_decode_kernel`.

The whole value width is one program (BV = V): the q and k windows are read and rewritten by the same program,
so no other program may read them afterwards. The unfused kernels are the reference (`tests/test_kda_triton.py`);
the results differ from them only by the order of f's sums.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton import pdl, static_weight
from ..._triton_jit import pdl_sync
from ...conv.triton_step import conv_token


@triton.jit
def kda_decode_fused_kernel(y_ptr, fa_ptr, b_ptr, wfb_ptr, wc_ptr, win_ptr, s_ptr, idx_ptr, alog_ptr, dtb_ptr, o_ptr,
                            H, KA, sy, sfa, sb, s_win, s_state, scale, lower_bound,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BA: tl.constexpr, W1: tl.constexpr, WP: tl.constexpr, HAS_DTB: tl.constexpr,
                            PDL: tl.constexpr = False, PRE: tl.constexpr = False):
    n = tl.program_id(0)
    h = tl.program_id(1)
    kc = tl.arange(0, BK)
    vc = tl.arange(0, BV)
    km = kc < K
    vm = vc < V
    # the large reads first, so they are in flight while the conv and the gate are computed: f_b's rows (32 KB at
    # k3-small; a model weight is read even before the PDL wait), then the state (64 KB)
    ac = tl.arange(0, BA)
    am = ac < KA
    wm = km[:, None] & am[None, :]
    wfb_rows = wfb_ptr + (h * K + kc)[:, None].to(tl.int64) * KA + ac[None, :]
    if PRE:  # a model weight (`static_weight`): read before the wait
        wfb = tl.load(wfb_rows, mask=wm, other=0.0)
    pdl_sync(PDL)
    if not PRE:
        wfb = tl.load(wfb_rows, mask=wm, other=0.0)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    dt = o_ptr.dtype.element_ty
    sm = km[:, None] & vm[None, :]
    sp = s_ptr + slot * s_state + h * K * V + kc[:, None] * V + vc[None, :]
    S = tl.load(sp, mask=sm, other=0.0)
    fa = tl.load(fa_ptr + n * sfa + ac, mask=am, other=0.0).to(tl.float32)
    # 1. the short conv of the head's q, k, v channels (q ‖ k ‖ v in y, H·K, H·K and H·V wide)
    yn = y_ptr + n * sy
    wins = win_ptr + slot * s_win
    cq = h * K + kc
    ck = H * K + h * K + kc
    cv = 2 * H * K + h * V + vc
    q, wq, tq = conv_token(yn, wc_ptr, wins + cq * W1, cq, km, W1, WP)
    k, wk, tk = conv_token(yn, wc_ptr, wins + ck * W1, ck, km, W1, WP)
    v, wv, tv = conv_token(yn, wc_ptr, wins + cv * W1, cv, vm, W1, WP)
    q = q.to(dt).to(tl.float32)
    k = k.to(dt).to(tl.float32)
    v = v.to(dt).to(tl.float32)
    # 2. the gate's pre-activation f = W_fb[h·K + kc] · f_a[n], then g and beta
    f = tl.sum(wfb.to(tl.float32) * fa[None, :], 1).to(dt).to(tl.float32)
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if HAS_DTB:
        f = f + tl.load(dtb_ptr + h * K + kc, mask=km, other=0.0).to(tl.float32)
    g = lower_bound * tl.sigmoid(a * f)
    b = tl.sigmoid(tl.sum(tl.load(b_ptr + n * sb + h + 0 * kc, mask=kc == 0, other=0.0).to(tl.float32), 0))
    # 3. the recurrent step on the slot's state
    S = S.to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    S = S * tl.exp(tl.where(km, g, 0.0))[:, None]
    err = v - tl.sum(k[:, None] * S, 0)
    S = S + (b * k)[:, None] * err[None, :]
    o = tl.sum((q * scale)[:, None] * S, 0)
    tl.store(o_ptr + n * H * V + h * V + vc, o.to(dt), mask=vm)
    tl.store(sp, S.to(s_ptr.dtype.element_ty), mask=sm)
    tl.debug_barrier()  # every thread has read the windows before they are rewritten
    j = tl.arange(0, WP)[None, :]
    tl.store(wins + cq[:, None] * W1 + j, wq.to(win_ptr.dtype.element_ty), mask=tq)
    tl.store(wins + ck[:, None] * W1 + j, wk.to(win_ptr.dtype.element_ty), mask=tk)
    tl.store(wins + cv[:, None] * W1 + j, wv.to(win_ptr.dtype.element_ty), mask=tv)


def kda_decode_fused_triton(y: torch.Tensor, fa: torch.Tensor, beta_logit: torch.Tensor, w_fb: torch.Tensor,
                            w_conv: torch.Tensor, windows: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                            A_log: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float,
                            scale: float | None = None, num_warps: int | None = None) -> torch.Tensor:
    """See `k3.ops.kda.kda_decode_step_fused` (shapes checked there). Returns o [N, H, V] in y's dtype.
    num_warps: per program (default 8 for a 128 × 128 state; `benchmarks/probe/kda_fused_decode.py` sweeps it)."""
    N = y.shape[0]
    H, K, V = state.shape[1:]
    C, W = w_conv.shape[0], w_conv.shape[-1]
    KA = fa.shape[-1]
    w = w_conv.reshape(C, W).float().contiguous()
    o = torch.empty(N, H, V, dtype=y.dtype, device=y.device)
    if N == 0:
        return o
    BK, BV = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    launch_pdl = pdl(o)
    kda_decode_fused_kernel[(N, H)](
        y, fa, beta_logit, w_fb.contiguous(), w, windows, state, slots.contiguous(), A_log.contiguous(),
        None if dt_bias is None else dt_bias.contiguous(), o, H, KA, y.stride(0), fa.stride(0), beta_logit.stride(0),
        windows.stride(0), state.stride(0), K ** -0.5 if scale is None else float(scale), float(lower_bound),
        K=K, V=V, BK=BK, BV=BV, BA=max(16, triton.next_power_of_2(KA)), W1=W - 1,
        WP=max(2, triton.next_power_of_2(W - 1)), HAS_DTB=dt_bias is not None,
        PRE=bool(launch_pdl) and static_weight(w_fb), num_warps=num_warps or (8 if BK * BV >= 8192 else 4),
        **launch_pdl)
    return o
