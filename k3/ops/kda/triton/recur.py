"""Sequential KDA kernels: the chunk-to-chunk state recurrence, forward and backward.

One program per (sequence, head, value block of BV columns); each step consumes one chunk of BT = 16 tokens
prepared by `intra.kda_intra_fwd_kernel` (BT is a parameter so that longer steps can be timed on their own:
`benchmarks/kda_profile.py --recur-steps`). Sequences are given by cu_seqlens (fixed-length batches
are passed as packed sequences) and chunk_off[n], the index of sequence n's first chunk in the global chunk
list.

Per chunk the intra kernel gives ke = k e^{G} (no beta), Tb = (I + beta Akk)^-1 diag(beta), qe, kg, Aqk and
G_C; the recurrence forms v_new = Tb (v - ke S) itself (w = Tb ke and u = Tb v are never stored).

The forward holds its fp32 state transposed, S^T [BV, BK], so that every matmul of a step has the value
block as its M dimension (M = BV = 64, whatever BT): Hopper's warpgroup MMA with the chunk tiles as
shared-memory operands, instead of M = BT = 16 MMAs whose operands every warp holds whole in registers
(measured: 0.73 -> 0.58 ms at B1 T8192 H96). The backward's state-gradient update already has M = K, and
keeps dS [BK, BV]. All states in memory use the public [K, V] layout.

The step is latency-bound (a chain of two or three small matmuls per chunk), so with PREFETCH the next
chunk's tiles are loaded before the current step's matmuls (register double buffering). With BF16
(bf16/fp16 inputs) the matmul operands are bf16 (the state is rounded to bf16 as a product operand
only; it is carried and accumulated in fp32), otherwise fp32 with DOT_PREC.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .intra import _mm


@triton.jit
def _load_step(ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr, x_ptr, sx, t0, eos, ci, h, H, K, V, kc, vc,
               BT: tl.constexpr, TRANS_X: tl.constexpr, TB: tl.constexpr):
    """One chunk's tiles (storage dtype) for a recurrence step: ke, qe, kg [BT, BK]; x [BT, BV] (v forward,
    do backward), or x^T [BV, BT] with TRANS_X; Aqk, Tb [BT, BT] (Tb only with TB, else 0); G_C [BK].
    Zero outside the sequence."""
    rows = tl.arange(0, BT)
    t = t0 + rows
    rm = t < eos
    mk = rm[:, None] & (kc < K)[None, :]
    offk = t[:, None] * (H * K) + h * K + kc[None, :]
    ke = tl.load(ke_ptr + offk, mask=mk, other=0.0)
    qe = tl.load(qe_ptr + offk, mask=mk, other=0.0)
    kg = tl.load(kg_ptr + offk, mask=mk, other=0.0)
    if TRANS_X:
        x = tl.load(x_ptr + t[None, :] * sx + h * V + vc[:, None], mask=(vc < V)[:, None] & rm[None, :],
                    other=0.0)
    else:
        x = tl.load(x_ptr + t[:, None] * sx + h * V + vc[None, :], mask=rm[:, None] & (vc < V)[None, :],
                    other=0.0)
    offa = t[:, None] * (H * BT) + h * BT + rows[None, :]
    A = tl.load(aqk_ptr + offa, mask=rm[:, None], other=0.0)
    if TB:
        Tb = tl.load(tb_ptr + offa, mask=rm[:, None], other=0.0)
    else:
        Tb = tl.zeros([BT, BT], tl.float32)
    gC = tl.load(gc_ptr + (ci * H + h) * K + kc, mask=(kc < K) & (t0 + 0 * kc < eos), other=0.0)
    return ke, qe, kg, x, A, Tb, gC


@triton.jit
def kda_recur_fwd_kernel(ke_ptr, v_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr, h0_ptr, o_ptr, ht_ptr,
                         hall_ptr, vnew_ptr, slot_ptr, hsel_ptr, cu_ptr, coff_ptr, idx_ptr,
                         H, K, V, CS, sv, slot_stride, zero_to,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                         STORE_H: tl.constexpr, STORE_SEL: tl.constexpr, DOT_PREC: tl.constexpr,
                         BF16: tl.constexpr, PREFETCH: tl.constexpr, SUMMARY: tl.constexpr, BT: tl.constexpr,
                         PRE: tl.constexpr, STORE_O: tl.constexpr, HAS_IDX: tl.constexpr):
    """v_new = Tb (v - ke S), o = qe S + Aqk v_new, S <- e^{G_C} S + kg^T v_new, chunk by chunk (computed
    transposed: v_new^T = (v^T - S^T ke^T) Tb^T, o^T = S^T qe^T + v_new^T Aqk^T, S^T <- S^T e^{G_C} + v_new^T kg).
    PRE: Tb is already folded into Aqk and kg (`kda_intra_fwd_kernel`'s PRE), so X = v - ke S takes v_new's
    place (no STORE_H). STORE_O: write o (off in the backward's recompute, which wants only the states).

    Program (n, h, iv) runs tokens cu[n*CS] .. cu[n*CS + 1] (CS = 1: consecutive sequences; CS = 2: a list of
    (start, end) pairs) whose first chunk is coff[n]. STORE_H: write the incoming state of every chunk to
    hall [NC, H, K, V] and v_new to vnew (for the backward). STORE_SEL: after chunk c, write S to
    hsel[slot[c]] when slot[c] >= 0.
    SUMMARY (segment summary for splitting long sequences): no output; the state has V + K columns, the
    first V start at 0 (the segment's own contribution, v as given) and the last K at the identity with
    v = 0 (the segment's K x K transition), and ht [N, H, K, V + K] receives both.
    sv: v's row stride (H * V when contiguous). HAS_IDX (the engine's extend steps): sequence n's initial and
    final state are slot idx[n] of a pool (h0_ptr = ht_ptr, slots `slot_stride` elements apart), updated in place.
    zero_to (with STORE_O): the last sequence's programs also store o = 0 in the rows after it, up to zero_to (a
    captured step's padding; no zero-filled output buffer first).
    """
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    bos = tl.load(cu_ptr + n * CS)
    eos = tl.load(cu_ptr + n * CS + 1)
    c0 = tl.load(coff_ptr + n)
    rows = tl.arange(0, BT)
    kc = tl.arange(0, BK)
    vc = iv * BV + tl.arange(0, BV)
    VS = V + K if SUMMARY else V
    km = kc < K
    vm = vc < V
    sm = (vc < VS)[:, None] & km[None, :]
    soff = kc[None, :] * VS + vc[:, None]           # [K, VS] memory layout of S^T's elements
    if HAS_IDX:
        sbase = tl.load(idx_ptr + n).to(tl.int64) * slot_stride + h * K * VS
    else:
        sbase = (n * H + h) * K * VS
    if HAS_H0:
        S = tl.load(h0_ptr + sbase + soff, mask=sm, other=0.0).to(tl.float32)
    elif SUMMARY:
        S = (kc[None, :] == vc[:, None] - V).to(tl.float32)
    else:
        S = tl.zeros([BV, BK], tl.float32)
    nch = tl.cdiv(eos - bos, BT)
    if PREFETCH:
        ke_n, qe_n, kg_n, v_n, A_n, Tb_n, gC_n = _load_step(ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr, v_ptr,
                                                            sv, bos, eos, c0, h, H, K, V, kc, vc, BT, True, not PRE)
    if STORE_SEL:  # the checkpoint slot of each chunk, loaded a step ahead (off the state's chain)
        slot_n = tl.load(slot_ptr + c0, mask=nch > 0, other=-1)
    for i in range(0, nch):
        if STORE_SEL:
            slot = slot_n
            slot_n = tl.load(slot_ptr + c0 + tl.minimum(i + 1, nch - 1))
        if PREFETCH:
            ke, qe, kg, vT, A, Tb, gC = ke_n, qe_n, kg_n, v_n, A_n, Tb_n, gC_n
            ke_n, qe_n, kg_n, v_n, A_n, Tb_n, gC_n = _load_step(
                ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr, v_ptr, sv, bos + (i + 1) * BT, eos,
                c0 + tl.minimum(i + 1, nch - 1), h, H, K, V, kc, vc, BT, True, not PRE)
        else:
            ke, qe, kg, vT, A, Tb, gC = _load_step(ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr, v_ptr, sv,
                                                   bos + i * BT, eos, c0 + i, h, H, K, V, kc, vc, BT, True, not PRE)
        t = bos + i * BT + rows
        mv = vm[:, None] & (t < eos)[None, :]
        offv = t[None, :] * (H * V) + h * V + vc[:, None]
        if STORE_H:
            tl.store(hall_ptr + ((c0 + i) * H + h).to(tl.int64) * K * V + soff,
                     S.to(hall_ptr.dtype.element_ty), mask=sm)
        X = vT.to(tl.float32) - _mm(S, tl.trans(ke), BF16, DOT_PREC)
        if PRE:
            vn = X
        else:
            vn = tl.dot(X, tl.trans(Tb), input_precision=DOT_PREC)
        if STORE_O:
            o = _mm(S, tl.trans(qe), BF16, DOT_PREC) + _mm(vn, tl.trans(A), BF16, DOT_PREC)
            tl.store(o_ptr + offv, o.to(o_ptr.dtype.element_ty), mask=mv)
        if STORE_H:
            tl.store(vnew_ptr + offv, vn.to(vnew_ptr.dtype.element_ty), mask=mv)
        S = S * tl.exp(gC)[None, :] + _mm(vn, kg, BF16, DOT_PREC)
        if STORE_SEL:
            if slot >= 0:
                tl.store(hsel_ptr + (slot * H + h).to(tl.int64) * K * V + soff, S, mask=sm)
    if STORE_HT:
        tl.store(ht_ptr + sbase + soff, S, mask=sm)
    if STORE_O:
        if n == tl.num_programs(0) - 1:
            for t0 in range(eos, zero_to, BT):
                t = t0 + rows
                tl.store(o_ptr + t[None, :] * (H * V) + h * V + vc[:, None], tl.zeros([BV, BT], o_ptr.dtype.element_ty),
                         mask=vm[:, None] & (t < zero_to)[None, :])


@triton.jit
def kda_recur_bwd_kernel(ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr, do_ptr, dht_ptr, dh0_ptr, du_ptr,
                         dsall_ptr, cu_ptr, coff_ptr, H, K, V, CS,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                         DOT_PREC: tl.constexpr, BF16: tl.constexpr, PREFETCH: tl.constexpr, SUMMARY: tl.constexpr,
                         BT: tl.constexpr):
    """Reverse sweep of the state gradient only: dS' (gradient of the state leaving a chunk) runs from
    the last chunk to the first. Per chunk c it writes dS'_c to dsall [NC, H, K, V] and du = dv_new
    = Aqk^T do + kg dS'_c [T, H, V]; at the start of the sequence, dh0. Everything that does not feed the
    recurrence (dq, dk, dw, dAqk, d e^{G_C}) is left to the token-parallel `kda_intra_bwd_kernel`.
    w = Tb ke is formed per chunk from the loaded tiles, off the dS chain.
    Tokens cu[n*CS] .. cu[n*CS + 1] as in `kda_recur_fwd_kernel`. SUMMARY: write nothing per chunk, only dh0
    (a segment's own contribution to the gradient of its incoming state, for sequence splitting).
    """
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    bos = tl.load(cu_ptr + n * CS)
    eos = tl.load(cu_ptr + n * CS + 1)
    c0 = tl.load(coff_ptr + n)
    rows = tl.arange(0, BT)
    kc = tl.arange(0, BK)
    vc = iv * BV + tl.arange(0, BV)
    km = kc < K
    vm = vc < V
    sm = km[:, None] & vm[None, :]
    soff = kc[:, None] * V + vc[None, :]
    if HAS_DHT:
        dS = tl.load(dht_ptr + (n * H + h) * K * V + soff, mask=sm, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], tl.float32)
    nch = tl.cdiv(eos - bos, BT)
    if PREFETCH:
        i0 = tl.maximum(nch - 1, 0)
        ke_n, qe_n, kg_n, do_n, A_n, Tb_n, gC_n = _load_step(ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr, do_ptr,
                                                             H * V, bos + i0 * BT, eos, c0 + i0, h, H, K, V, kc, vc, BT,
                                                             False, True)
    for j in range(0, nch):
        i = nch - 1 - j
        if PREFETCH:
            ke, qe, kg, do, A, Tb, gC = ke_n, qe_n, kg_n, do_n, A_n, Tb_n, gC_n
            ip = tl.maximum(i - 1, 0)
            ke_n, qe_n, kg_n, do_n, A_n, Tb_n, gC_n = _load_step(ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr,
                                                                 do_ptr, H * V, bos + ip * BT, eos, c0 + ip, h, H, K,
                                                                 V, kc, vc, BT, False, True)
        else:
            ke, qe, kg, do, A, Tb, gC = _load_step(ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr, do_ptr, H * V,
                                                   bos + i * BT, eos, c0 + i, h, H, K, V, kc, vc, BT, False, True)
        w = tl.dot(Tb, ke.to(tl.float32), input_precision=DOT_PREC)
        t = bos + i * BT + rows
        mv = (t < eos)[:, None] & vm[None, :]
        dvn = _mm(tl.trans(A), do, BF16, DOT_PREC) + _mm(kg, dS, BF16, DOT_PREC)
        if not SUMMARY:
            tl.store(dsall_ptr + ((c0 + i) * H + h).to(tl.int64) * K * V + soff,
                     dS.to(dsall_ptr.dtype.element_ty), mask=sm)
            tl.store(du_ptr + t[:, None] * (H * V) + h * V + vc[None, :], dvn, mask=mv)
        dS = dS * tl.exp(gC)[:, None] + _mm(tl.trans(qe), do, BF16, DOT_PREC) \
            - _mm(tl.trans(w), dvn, BF16, DOT_PREC)
    if HAS_H0:
        tl.store(dh0_ptr + (n * H + h) * K * V + soff, dS, mask=sm)
