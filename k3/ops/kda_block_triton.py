"""`kda_block_decode`'s kernel (see `kda_block.py`): a batch-1 decode step's KDA attention in one launch of G
persistent programs, four phases apart by grid barriers (`k3.ops._triton_jit.grid_barrier`), each phase's tiles
shared out over the programs (tile t to program t mod G), chunk loops unrolled (constexpr widths):

1. the joined input projection: q ‖ k ‖ v ‖ f_a ‖ β logits ‖ output gate, rounded to the activation dtype;
2. f_b (the gate's second projection) beside the short conv step of q ‖ k ‖ v (SiLU; the slot's window advanced
   in place), as `short_conv_step_kernel`;
3. the recurrent step per (head, value block), as `kda_decode_kernel`: l2-normalised q, k, the lower-bounded
   gate, β = σ(logit), the state in its pool slot updated in place;
4. o_norm (per head) ⊙ σ(gate), o_proj, + the residual.
Values written in one phase are read in the next past L1 (`.cg`)."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_jit import grid_barrier, grid_done, pdl_sync
from .moe_block_triton import _dot_rows


@triton.jit
def kda_block_kernel(x_ptr, res_ptr, out_ptr, win_ptr, wfb_ptr, wc_ptr, cpool_ptr, c_slot, spool_ptr, s_slot,
                     slot_ptr, alog_ptr, dtb_ptr, onw_ptr, wo_ptr, yin_ptr, f_ptr, qkv_ptr, o_ptr, cnt_ptr,
                     scale, lower_bound, eps, G,
                     D: tl.constexpr, H: tl.constexpr, K: tl.constexpr, W1: tl.constexpr, WP: tl.constexpr,
                     HAS_RES: tl.constexpr, HAS_DTB: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
                     BV: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr = False, MMA: tl.constexpr = False,
                     STAGES: tl.constexpr = 3, IEEE: tl.constexpr = False):
    pdl_sync(PDL)
    p = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    HK: tl.constexpr = H * K
    RIN: tl.constexpr = 4 * HK + K + H  # q ‖ k ‖ v ‖ f_a ‖ β ‖ gate (the joined weight's padding rows: not needed)
    FA: tl.constexpr = 3 * HK
    BETA: tl.constexpr = 3 * HK + K
    GATE: tl.constexpr = 3 * HK + K + H
    slot = tl.load(slot_ptr).to(tl.int64)
    # 1. the joined input projection
    for t in range(p, (RIN + BN - 1) // BN, G):
        rows = t * BN + tl.arange(0, BN)
        acc = _dot_rows(win_ptr, rows, RIN, D, x_ptr, D, CH, MMA=MMA, S=STAGES, IEEE=IEEE)
        tl.store(yin_ptr + rows, acc.to(dt), mask=rows < RIN)
    grid_barrier(cnt_ptr, G)
    # 2. f_b | the short conv step of q ‖ k ‖ v
    NFB: tl.constexpr = (HK + BN - 1) // BN
    for t in range(p, NFB + (3 * HK + BC - 1) // BC, G):
        if t < NFB:
            rf = t * BN + tl.arange(0, BN)
            facc = _dot_rows(wfb_ptr, rf, HK, K, yin_ptr + FA, K, K, MMA=MMA, S=STAGES, IEEE=IEEE)
            tl.store(f_ptr + rf, facc.to(dt), mask=rf < HK)
        else:
            c = (t - NFB) * BC + tl.arange(0, BC)
            j = tl.arange(0, WP)
            cm = c < 3 * HK
            tap = cm[:, None] & (j[None, :] < W1)
            base = cpool_ptr + slot * c_slot + c[:, None] * W1 + j[None, :]
            win = tl.load(base, mask=tap, other=0.0).to(tl.float32)
            w = tl.load(wc_ptr + c[:, None] * (W1 + 1) + j[None, :], mask=tap, other=0.0).to(tl.float32)
            wl = tl.load(wc_ptr + c * (W1 + 1) + W1, mask=cm, other=0.0).to(tl.float32)
            xv = tl.load(yin_ptr + c, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
            a = tl.sum(win * w, axis=1) + xv * wl
            tl.store(qkv_ptr + c, (a * tl.sigmoid(a)).to(dt), mask=cm)
            shift = (j[:, None] == j[None, :] + 1).to(tl.float32)  # win @ shift: every column one step left
            win = tl.where(j[None, :] == W1 - 1, xv[:, None], tl.sum(win[:, :, None] * shift[None, :, :], axis=1))
            tl.debug_barrier()  # every thread has read the window before the slot is rewritten
            tl.store(base, win.to(cpool_ptr.dtype.element_ty), mask=tap)
    grid_barrier(cnt_ptr, 2 * G)
    # 3. the recurrent step: tile (head h, value block iv)
    NVB: tl.constexpr = (K + BV - 1) // BV
    kc = tl.arange(0, K)
    for t in range(p, H * NVB, G):
        h = t // NVB
        vc = (t % NVB) * BV + tl.arange(0, BV)
        q = tl.load(qkv_ptr + h * K + kc, cache_modifier=".cg").to(tl.float32)
        k = tl.load(qkv_ptr + HK + h * K + kc, cache_modifier=".cg").to(tl.float32)
        v = tl.load(qkv_ptr + 2 * HK + h * K + vc, cache_modifier=".cg").to(tl.float32)
        g = tl.load(f_ptr + h * K + kc, cache_modifier=".cg").to(tl.float32)
        if HAS_DTB:
            g += tl.load(dtb_ptr + h * K + kc).to(tl.float32)
        g = lower_bound * tl.sigmoid(tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * g)
        b = tl.sigmoid(tl.load(yin_ptr + BETA + h, cache_modifier=".cg").to(tl.float32))
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        sp = spool_ptr + slot * s_slot + h * K * K + kc[:, None] * K + vc[None, :]
        S = tl.load(sp).to(tl.float32) * tl.exp(g)[:, None]
        err = v - tl.sum(k[:, None] * S, 0)
        S = S + (b * k)[:, None] * err[None, :]
        tl.store(o_ptr + h * K + vc, tl.sum((q * scale)[:, None] * S, 0).to(dt))
        tl.store(sp, S.to(spool_ptr.dtype.element_ty))
    grid_barrier(cnt_ptr, 3 * G)
    # 4. o_norm(o) ⊙ σ(gate) → o_proj, + residual; a chunk is one head (its norm from its own K values)
    onw = tl.load(onw_ptr + kc).to(tl.float32)
    for t in range(p, (D + BN - 1) // BN, G):
        rows = t * BN + tl.arange(0, BN)
        rm = rows < D
        r = rows[:, None].to(tl.int64) * HK
        acc = tl.zeros([BN], tl.float32)
        for hh in tl.static_range(H):
            ov = tl.load(o_ptr + hh * K + kc, cache_modifier=".cg").to(tl.float32)
            gv = tl.load(yin_ptr + GATE + hh * K + kc, cache_modifier=".cg").to(tl.float32)
            xo = (ov / tl.sqrt(tl.sum(ov * ov, 0) / K + eps) * onw * tl.sigmoid(gv)).to(dt).to(tl.float32)
            w = tl.load(wo_ptr + r + hh * K + kc[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
            acc += tl.sum(w * xo[None, :], 1)
        if HAS_RES:
            acc += tl.load(res_ptr + rows, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + rows, acc.to(dt), mask=rm)
    grid_done(cnt_ptr, G)
