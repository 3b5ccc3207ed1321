"""Sequential KDA kernels: the chunk-to-chunk state recurrence, forward and backward.

One program per (sequence, head, value block of BV columns); the fp32 state tile [K, BV] stays in
registers and each step consumes one 16-token chunk prepared by `intra.kda_intra_fwd_kernel`.
Sequences are given by cu_seqlens (fixed-length batches are passed as packed sequences) and
chunk_off[n], the index of sequence n's first chunk in the global chunk list.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kda_recur_fwd_kernel(w_ptr, u_ptr, qe_ptr, kg_ptr, aqk_ptr, gc_ptr, h0_ptr, o_ptr, ht_ptr,
                         hall_ptr, vnew_ptr, slot_ptr, hsel_ptr, cu_ptr, coff_ptr,
                         H, K, V,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                         STORE_H: tl.constexpr, STORE_SEL: tl.constexpr, DOT_PREC: tl.constexpr):
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
    for i in range(0, nch):
        t = bos + i * 16 + rows
        rm = t < eos
        mk = rm[:, None] & km[None, :]
        mv = rm[:, None] & vm[None, :]
        offk = t[:, None] * (H * K) + h * K + kc[None, :]
        offv = t[:, None] * (H * V) + h * V + vc[None, :]
        w = tl.load(w_ptr + offk, mask=mk, other=0.0).to(tl.float32)
        qe = tl.load(qe_ptr + offk, mask=mk, other=0.0).to(tl.float32)
        kg = tl.load(kg_ptr + offk, mask=mk, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offv, mask=mv, other=0.0).to(tl.float32)
        A = tl.load(aqk_ptr + t[:, None] * (H * 16) + h * 16 + rows[None, :], mask=rm[:, None], other=0.0)
        gC = tl.load(gc_ptr + ((c0 + i) * H + h) * K + kc, mask=km, other=0.0)
        if STORE_H:
            tl.store(hall_ptr + ((c0 + i) * H + h).to(tl.int64) * K * V + soff,
                     S.to(hall_ptr.dtype.element_ty), mask=sm)
        vn = u - tl.dot(w, S, input_precision=DOT_PREC)
        o = tl.dot(qe, S, input_precision=DOT_PREC) + tl.dot(A, vn, input_precision=DOT_PREC)
        tl.store(o_ptr + offv, o.to(o_ptr.dtype.element_ty), mask=mv)
        if STORE_H:
            tl.store(vnew_ptr + offv, vn.to(vnew_ptr.dtype.element_ty), mask=mv)
        S = S * tl.exp(gC)[:, None] + tl.dot(tl.trans(kg), vn, input_precision=DOT_PREC)
        if STORE_SEL:
            slot = tl.load(slot_ptr + c0 + i)
            if slot >= 0:
                tl.store(hsel_ptr + (slot * H + h).to(tl.int64) * K * V + soff, S, mask=sm)
    if STORE_HT:
        tl.store(ht_ptr + (n * H + h) * K * V + soff, S, mask=sm)


@triton.jit
def kda_recur_bwd_kernel(qe_ptr, kg_ptr, w_ptr, aqk_ptr, gc_ptr, hall_ptr, vnew_ptr, do_ptr, dht_ptr,
                         dh0_ptr, dqe_ptr, dw_ptr, dkg_ptr, daqk_ptr, du_ptr, dgc_ptr, cu_ptr, coff_ptr,
                         H, K, V, NC, T_total,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    """Reverse sweep: carries dS (gradient of the outgoing state) from the last chunk to the first.

    Writes du = dv_new [T, H, V] and, per value block iv, the partial sums over that block of dqe,
    dw, dkg [NV, T, H, K], dAqk [NV, T, H, 16] and d e^{G_C} [NV, NC, H, K]; and dh0.
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
    for j in range(0, nch):
        i = nch - 1 - j
        t = bos + i * 16 + rows
        rm = t < eos
        mk = rm[:, None] & km[None, :]
        mv = rm[:, None] & vm[None, :]
        offk = t[:, None] * (H * K) + h * K + kc[None, :]
        offv = t[:, None] * (H * V) + h * V + vc[None, :]
        offa = t[:, None] * (H * 16) + h * 16 + rows[None, :]
        S = tl.load(hall_ptr + ((c0 + i) * H + h).to(tl.int64) * K * V + soff, mask=sm, other=0.0).to(tl.float32)
        qe = tl.load(qe_ptr + offk, mask=mk, other=0.0).to(tl.float32)
        kg = tl.load(kg_ptr + offk, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offk, mask=mk, other=0.0).to(tl.float32)
        A = tl.load(aqk_ptr + offa, mask=rm[:, None], other=0.0)
        gC = tl.load(gc_ptr + ((c0 + i) * H + h) * K + kc, mask=km, other=0.0)
        vn = tl.load(vnew_ptr + offv, mask=mv, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + offv, mask=mv, other=0.0).to(tl.float32)
        dvn = tl.dot(tl.trans(A), do, input_precision=DOT_PREC) + tl.dot(kg, dS, input_precision=DOT_PREC)
        tl.store(du_ptr + offv, dvn, mask=mv)
        tl.store(dqe_ptr + part_k + offk, tl.dot(do, tl.trans(S), input_precision=DOT_PREC), mask=mk)
        tl.store(dw_ptr + part_k + offk, -tl.dot(dvn, tl.trans(S), input_precision=DOT_PREC), mask=mk)
        tl.store(dkg_ptr + part_k + offk, tl.dot(vn, tl.trans(dS), input_precision=DOT_PREC), mask=mk)
        tl.store(daqk_ptr + part_a + offa, tl.dot(do, tl.trans(vn), input_precision=DOT_PREC), mask=rm[:, None])
        tl.store(dgc_ptr + ((iv * NC + c0 + i) * H + h) * K + kc, tl.sum(S * dS, 1), mask=km)
        dS = dS * tl.exp(gC)[:, None] + tl.dot(tl.trans(qe), do, input_precision=DOT_PREC) \
            - tl.dot(tl.trans(w), dvn, input_precision=DOT_PREC)
    if HAS_H0:
        tl.store(dh0_ptr + (n * H + h) * K * V + soff, dS, mask=sm)
