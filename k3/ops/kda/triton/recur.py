"""Sequential KDA kernels: the chunk-to-chunk state recurrence, forward and backward.

One program per (sequence, head, value block of BV columns); the fp32 state tile [K, BV] stays in
registers and each step consumes one 16-token chunk prepared by `intra.kda_intra_fwd_kernel`.
Sequences are given by cu_seqlens (fixed-length batches are passed as packed sequences) and
chunk_off[n], the index of sequence n's first chunk in the global chunk list.

The step is latency-bound (a chain of two small matmuls per 16 tokens), so with PREFETCH the next
chunk's tiles are loaded before the current step's matmuls (register double buffering). With BF16
(bf16/fp16 inputs) the matmul operands are bf16 (the state is rounded to bf16 as a product operand
only; it is carried and accumulated in fp32), otherwise fp32 with DOT_PREC.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mm(a, b, BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    if BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PREC)


@triton.jit
def _load_fwd(w_ptr, u_ptr, qe_ptr, kg_ptr, aqk_ptr, gc_ptr, t0, eos, ci, h, H, K, V, kc, vc):
    """One chunk's tiles (storage dtype): w, qe, kg [16, BK]; u [16, BV]; Aqk [16, 16]; G_C [BK]."""
    rows = tl.arange(0, 16)
    t = t0 + rows
    rm = t < eos
    mk = rm[:, None] & (kc < K)[None, :]
    mv = rm[:, None] & (vc < V)[None, :]
    offk = t[:, None] * (H * K) + h * K + kc[None, :]
    w = tl.load(w_ptr + offk, mask=mk, other=0.0)
    qe = tl.load(qe_ptr + offk, mask=mk, other=0.0)
    kg = tl.load(kg_ptr + offk, mask=mk, other=0.0)
    u = tl.load(u_ptr + t[:, None] * (H * V) + h * V + vc[None, :], mask=mv, other=0.0)
    A = tl.load(aqk_ptr + t[:, None] * (H * 16) + h * 16 + rows[None, :], mask=rm[:, None], other=0.0)
    gC = tl.load(gc_ptr + (ci * H + h) * K + kc, mask=(kc < K) & (t0 + 0 * kc < eos), other=0.0)
    return w, qe, kg, u, A, gC


@triton.jit
def kda_recur_fwd_kernel(w_ptr, u_ptr, qe_ptr, kg_ptr, aqk_ptr, gc_ptr, h0_ptr, o_ptr, ht_ptr,
                         hall_ptr, vnew_ptr, slot_ptr, hsel_ptr, cu_ptr, coff_ptr,
                         H, K, V,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                         STORE_H: tl.constexpr, STORE_SEL: tl.constexpr, DOT_PREC: tl.constexpr,
                         BF16: tl.constexpr, PREFETCH: tl.constexpr):
    """o = qe S + Aqk (u - w S); S <- e^{G_C} S + kg^T (u - w S), chunk by chunk.

    STORE_H: write the incoming state of every chunk to hall [NC, H, K, V] and v_new to vnew
    (for the backward). STORE_SEL: after chunk c, write S to hsel[slot[c]] when slot[c] >= 0.
    """
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    c0 = tl.load(coff_ptr + n)
    rows = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    vc = iv * BV + tl.arange(0, BV)
    km = kc < K
    vm = vc < V
    sm = km[:, None] & vm[None, :]
    soff = kc[:, None] * V + vc[None, :]
    if HAS_H0:
        S = tl.load(h0_ptr + (n * H + h) * K * V + soff, mask=sm, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], tl.float32)
    nch = tl.cdiv(eos - bos, 16)
    if PREFETCH:
        w_n, qe_n, kg_n, u_n, A_n, gC_n = _load_fwd(w_ptr, u_ptr, qe_ptr, kg_ptr, aqk_ptr, gc_ptr, bos, eos, c0,
                                                    h, H, K, V, kc, vc)
    for i in range(0, nch):
        if PREFETCH:
            w, qe, kg, u, A, gC = w_n, qe_n, kg_n, u_n, A_n, gC_n
            w_n, qe_n, kg_n, u_n, A_n, gC_n = _load_fwd(w_ptr, u_ptr, qe_ptr, kg_ptr, aqk_ptr, gc_ptr,
                                                        bos + (i + 1) * 16, eos, c0 + tl.minimum(i + 1, nch - 1),
                                                        h, H, K, V, kc, vc)
        else:
            w, qe, kg, u, A, gC = _load_fwd(w_ptr, u_ptr, qe_ptr, kg_ptr, aqk_ptr, gc_ptr, bos + i * 16, eos,
                                            c0 + i, h, H, K, V, kc, vc)
        t = bos + i * 16 + rows
        mv = (t < eos)[:, None] & vm[None, :]
        offv = t[:, None] * (H * V) + h * V + vc[None, :]
        if STORE_H:
            tl.store(hall_ptr + ((c0 + i) * H + h).to(tl.int64) * K * V + soff,
                     S.to(hall_ptr.dtype.element_ty), mask=sm)
        vn = u.to(tl.float32) - _mm(w, S, BF16, DOT_PREC)
        o = _mm(qe, S, BF16, DOT_PREC) + _mm(A, vn, BF16, DOT_PREC)
        tl.store(o_ptr + offv, o.to(o_ptr.dtype.element_ty), mask=mv)
        if STORE_H:
            tl.store(vnew_ptr + offv, vn.to(vnew_ptr.dtype.element_ty), mask=mv)
        S = S * tl.exp(gC)[:, None] + _mm(tl.trans(kg), vn, BF16, DOT_PREC)
        if STORE_SEL:
            slot = tl.load(slot_ptr + c0 + i)
            if slot >= 0:
                tl.store(hsel_ptr + (slot * H + h).to(tl.int64) * K * V + soff, S, mask=sm)
    if STORE_HT:
        tl.store(ht_ptr + (n * H + h) * K * V + soff, S, mask=sm)


@triton.jit
def _load_bwd(qe_ptr, kg_ptr, w_ptr, aqk_ptr, gc_ptr, hall_ptr, vnew_ptr, do_ptr, t0, eos, ci, h, H, K, V,
              kc, vc):
    rows = tl.arange(0, 16)
    t = t0 + rows
    rm = t < eos
    mk = rm[:, None] & (kc < K)[None, :]
    mv = rm[:, None] & (vc < V)[None, :]
    offk = t[:, None] * (H * K) + h * K + kc[None, :]
    offv = t[:, None] * (H * V) + h * V + vc[None, :]
    sm = (kc < K)[:, None] & (vc < V)[None, :] & (t0 + 0 * vc < eos)[None, :]
    S = tl.load(hall_ptr + (ci * H + h).to(tl.int64) * K * V + kc[:, None] * V + vc[None, :], mask=sm, other=0.0)
    qe = tl.load(qe_ptr + offk, mask=mk, other=0.0)
    kg = tl.load(kg_ptr + offk, mask=mk, other=0.0)
    w = tl.load(w_ptr + offk, mask=mk, other=0.0)
    A = tl.load(aqk_ptr + t[:, None] * (H * 16) + h * 16 + rows[None, :], mask=rm[:, None], other=0.0)
    gC = tl.load(gc_ptr + (ci * H + h) * K + kc, mask=(kc < K) & (t0 + 0 * kc < eos), other=0.0)
    vn = tl.load(vnew_ptr + offv, mask=mv, other=0.0)
    do = tl.load(do_ptr + offv, mask=mv, other=0.0)
    return S, qe, kg, w, A, gC, vn, do


@triton.jit
def kda_recur_bwd_kernel(qe_ptr, kg_ptr, w_ptr, aqk_ptr, gc_ptr, hall_ptr, vnew_ptr, do_ptr, dht_ptr,
                         dh0_ptr, dqe_ptr, dw_ptr, dkg_ptr, daqk_ptr, du_ptr, dgc_ptr, cu_ptr, coff_ptr,
                         H, K, V, NC, T_total,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                         DOT_PREC: tl.constexpr, BF16: tl.constexpr, PREFETCH: tl.constexpr):
    """Reverse sweep: carries dS (gradient of the outgoing state) from the last chunk to the first.

    Writes du = dv_new [T, H, V] and, per value block iv, the partial sums over that block of dqe,
    dw, dkg [NV, T, H, K], dAqk [NV, T, H, 16] and d e^{G_C} [NV, NC, H, K]; and dh0. Products with
    the fp32 gradient state dS use DOT_PREC (never bf16).
    """
    n = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    c0 = tl.load(coff_ptr + n)
    rows = tl.arange(0, 16)
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
    nch = tl.cdiv(eos - bos, 16)
    part_k = iv * T_total * H * K
    part_a = iv * T_total * H * 16
    if PREFETCH:
        i0 = tl.maximum(nch - 1, 0)
        S_n, qe_n, kg_n, w_n, A_n, gC_n, vn_n, do_n = _load_bwd(qe_ptr, kg_ptr, w_ptr, aqk_ptr, gc_ptr, hall_ptr,
                                                                vnew_ptr, do_ptr, bos + i0 * 16, eos, c0 + i0,
                                                                h, H, K, V, kc, vc)
    for j in range(0, nch):
        i = nch - 1 - j
        if PREFETCH:
            S, qe, kg, w, A, gC, vn, do = S_n, qe_n, kg_n, w_n, A_n, gC_n, vn_n, do_n
            ip = tl.maximum(i - 1, 0)
            S_n, qe_n, kg_n, w_n, A_n, gC_n, vn_n, do_n = _load_bwd(qe_ptr, kg_ptr, w_ptr, aqk_ptr, gc_ptr, hall_ptr,
                                                                    vnew_ptr, do_ptr, bos + ip * 16, eos, c0 + ip,
                                                                    h, H, K, V, kc, vc)
        else:
            S, qe, kg, w, A, gC, vn, do = _load_bwd(qe_ptr, kg_ptr, w_ptr, aqk_ptr, gc_ptr, hall_ptr, vnew_ptr,
                                                    do_ptr, bos + i * 16, eos, c0 + i, h, H, K, V, kc, vc)
        t = bos + i * 16 + rows
        rm = t < eos
        mk = rm[:, None] & km[None, :]
        mv = rm[:, None] & vm[None, :]
        offk = t[:, None] * (H * K) + h * K + kc[None, :]
        offv = t[:, None] * (H * V) + h * V + vc[None, :]
        offa = t[:, None] * (H * 16) + h * 16 + rows[None, :]
        dvn = _mm(tl.trans(A), do, BF16, DOT_PREC) + _mm(kg, dS, False, DOT_PREC)
        tl.store(du_ptr + offv, dvn, mask=mv)
        tl.store(dqe_ptr + part_k + offk, _mm(do, tl.trans(S), BF16, DOT_PREC), mask=mk)
        tl.store(dw_ptr + part_k + offk, -_mm(dvn, tl.trans(S), BF16, DOT_PREC), mask=mk)
        tl.store(dkg_ptr + part_k + offk, _mm(vn, tl.trans(dS), False, DOT_PREC), mask=mk)
        tl.store(daqk_ptr + part_a + offa, _mm(do, tl.trans(vn), BF16, DOT_PREC), mask=rm[:, None])
        tl.store(dgc_ptr + ((iv * NC + c0 + i) * H + h) * K + kc, tl.sum(S.to(tl.float32) * dS, 1), mask=km)
        dS = dS * tl.exp(gC)[:, None] + _mm(tl.trans(qe), do, BF16, DOT_PREC) \
            - _mm(tl.trans(w), dvn, BF16, DOT_PREC)
    if HAS_H0:
        tl.store(dh0_ptr + (n * H + h) * K * V + soff, dS, mask=sm)
