"""The token-parallel KDA backward in column blocks: `kda_intra_bwd_kernel`'s gradients with [16, KB] tiles live.

`intra.kda_intra_bwd_kernel` keeps about fifteen [16, K] fp32 tiles live at once: at K = 128, 4 warps, its sm_90a
build takes 255 registers, spills 284 bytes and 57 KB of shared memory, so two programs (8 warps) share an SM, and
it is 36 ms of the 551 ms k3-small training step (latency-bound: ≈ 2.5 GB of states and tokens would take ≈ 0.5 ms
at the HBM rate, against 3 ms per layer). This kernel gives the same gradients from the same inputs while only
column blocks and 16 x 16 matrices are live: no spills, and with small blocks 6 KB of shared memory and 168-206
registers (3 programs per SM). It pays for that in instructions: counted from its SASS (`scripts/sass_count.py`:
loop bodies x trip counts), 1.6-2.9x the whole-row kernel's per program (its passes recompute the factor tiles;
small tiles pay loop and layout overhead). Which one is faster is for the GPU to say
(`benchmarks/kda_train_variants.json`); the loser goes.

Every column-sum the backward needs goes through a 16 x 16 matrix. With w = T diag(beta) ke, u = T diag(beta) v,
dRw = T^T dw and dRu = T^T du (T = (I + diag(beta) M)^-1):
    dRw w^T + dRu u^T = T^T (X + Y) diag(beta) T^T,  X = dw ke^T,  Y = du v^T
    rowsum(ke * dRw) + rowsum(v * dRu) = diag(T^T (X + Y))
so w, u and dRu are never formed. Three passes over the column blocks (one program per (chunk, head)):
  A. M = ke ki^T, the state products dqe = do S^T, dw = -du S^T, dkg = vn dS'^T, dD = rowsum(S * dS') (each state
     read once), and X. The four are parked in scratch -- by default the program's own slot of dS', over the rows
     just read -- to be picked up in pass B;
  then T, dA = do vn^T, Y, dbeta, dM and dv, over value blocks;
  B. per column block, back through the factor tiles to dq, dk (before the l2norm), dg (or f, dt_bias, A_log);
  C. with the l2norm, its backward once the row sums over all columns are known.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .intra import _cols, _gate_cols, _mm, _norms_beta, _program_chunk, _unit_lower_inverse

SCRATCH_ROW = 49  # fp32 values parked per key column: dqe, dw, dkg (16 rows each) and dD


@triton.jit
def _state_grads(hall_ptr, dsall_ptr, vnew_ptr, do_ptr, du_ptr, sbase, t0, nvalid, h, H, K, V, kb,
                 KB: tl.constexpr, BV: tl.constexpr, VB: tl.constexpr, BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    """Key columns [kb, kb + KB) of dqe = do S^T, dw = -du S^T, dkg = vn dS'^T [16, KB] and dD = rowsum(S * dS')
    [KB], over value blocks of VB (a loop: unrolled, as `kda_intra_bwd_kernel` has it, this kernel spills). That
    kernel keeps its own copy: sharing this helper changed its code generation (more spills), and it is the
    measured default until the GPU decides between the two; the loser is then deleted."""
    rows = tl.arange(0, 16)
    rm = rows < nvalid
    kc = kb + tl.arange(0, KB)
    kcm = kc < K
    dqe = tl.zeros([16, KB], tl.float32)
    dw = tl.zeros([16, KB], tl.float32)
    dkg = tl.zeros([16, KB], tl.float32)
    SdS = tl.zeros([VB, KB], tl.float32)  # S * dS' summed over value blocks, reduced once after the loop
    for vb in range(0, BV, VB):
        vc = vb + tl.arange(0, VB)
        vm = vc < V
        sm = vm[:, None] & kcm[None, :]
        mv = rm[:, None] & vm[None, :]
        offv = (t0 + rows)[:, None] * (H * V) + h * V + vc[None, :]
        # the states' tiles loaded transposed, [VB, KB]: the products' right operands as they are (no transpose
        # through shared memory)
        St = tl.load(hall_ptr + sbase + kc[None, :] * V + vc[:, None], mask=sm, other=0.0)
        dSt = tl.load(dsall_ptr + sbase + kc[None, :] * V + vc[:, None], mask=sm, other=0.0)
        dqe += _mm(tl.load(do_ptr + offv, mask=mv, other=0.0), St, BF16, DOT_PREC)
        dw -= _mm(tl.load(du_ptr + offv, mask=mv, other=0.0), St, BF16, DOT_PREC)
        dkg += _mm(tl.load(vnew_ptr + offv, mask=mv, other=0.0), dSt, BF16, DOT_PREC)
        SdS += St.to(tl.float32) * dSt.to(tl.float32)
    dD = tl.sum(SdS, 0)
    return dqe, dw, dkg, dD


@triton.jit
def kda_intra_bwd_cols_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, chunks_ptr,
                              hall_ptr, dsall_ptr, vnew_ptr, do_ptr, du_ptr, scr_ptr,
                              dq_ptr, dk_ptr, dv_ptr, dg_ptr, db_ptr, ddtb_ptr, dalog_ptr,
                              H, K, V, scale, lower_bound, scr_slot, scr_row,
                              BK: tl.constexpr, BV: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
                              KA: tl.constexpr, GATE: tl.constexpr, BETA_SIG: tl.constexpr, L2: tl.constexpr,
                              DOT_PREC: tl.constexpr, BF16: tl.constexpr):
    """Per (chunk, head), `kda_intra_bwd_kernel`'s outputs (see the module docstring). Pass A walks the key columns
    in blocks of KA (its state products are the larger tiles: fewer, longer loops), passes B and C in blocks of KB.
    scr_ptr: fp32 scratch with scr_slot values per program and scr_row (>= SCRATCH_ROW) per key column c (dqe, dw,
    dkg rows at c·scr_row + 0 / 16 / 32, dD at + 48); it may alias the program's dS' slot: pass A parks columns
    [ka, ka + KA) over dS' rows [ka, ka + KA), which it has just read, and nothing after reads them."""
    ic, h, t0, nvalid, rows, rm = _program_chunk(chunks_ptr)
    sx = H * K
    rq, rk, beta = _norms_beta(q_ptr, k_ptr, b_ptr, t0, nvalid, h, sx, H, K, BK, KB, BETA_SIG, L2)
    sbase = (ic * H + h).to(tl.int64) * K * V
    pbase = (ic * H + h).to(tl.int64) * scr_slot
    base = scr_ptr + pbase

    # pass A: M, X and the state products, parked for pass B
    M = tl.zeros([16, 16], tl.float32)
    X = tl.zeros([16, 16], tl.float32)
    for ka in range(0, BK, KA):
        G, _ = _gate_cols(g_ptr, alog_ptr, dtb_ptr, t0, nvalid, h, sx, K, ka, lower_bound, KA, GATE)
        kn = _cols(k_ptr, t0, nvalid, h, sx, K, ka, KA) * rk[:, None]
        ke = kn * tl.exp(G)
        M += tl.dot(ke, tl.trans(kn * tl.exp(-G)), input_precision=DOT_PREC)
        dqe, dw, dkg, dD = _state_grads(hall_ptr, dsall_ptr, vnew_ptr, do_ptr, du_ptr, sbase, t0, nvalid, h, H,
                                        K, V, ka, KA, BV, VB, BF16, DOT_PREC)
        X += tl.dot(dw, tl.trans(ke), input_precision=DOT_PREC)
        tl.debug_barrier()  # every thread has read these dS' rows before any overwrites them
        ca = (ka + tl.arange(0, KA)) * scr_row
        tl.store(base + rows[:, None] + ca[None, :], dqe)
        tl.store(base + 16 + rows[:, None] + ca[None, :], dw)
        tl.store(base + 32 + rows[:, None] + ca[None, :], dkg)
        tl.store(base + 48 + ca, dD)
    M = tl.where(rows[:, None] > rows[None, :], M, 0.0)
    Tm = _unit_lower_inverse(beta[:, None] * M)
    TmT = tl.trans(Tm)

    # dA = do vn^T, Y = du v^T over value blocks
    dA = tl.zeros([16, 16], tl.float32)
    Y = tl.zeros([16, 16], tl.float32)
    for vb in range(0, BV, VB):
        vc = vb + tl.arange(0, VB)
        mv = rm[:, None] & (vc < V)[None, :]
        offv = (t0 + rows)[:, None] * (H * V) + h * V + vc[None, :]
        dA += _mm(tl.load(do_ptr + offv, mask=mv, other=0.0), tl.trans(tl.load(vnew_ptr + offv, mask=mv, other=0.0)),
                  BF16, DOT_PREC)
        Y += tl.dot(tl.load(du_ptr + offv, mask=mv, other=0.0),
                    tl.trans(tl.load(v_ptr + offv, mask=mv, other=0.0).to(tl.float32)), input_precision=DOT_PREC)
    Z = tl.dot(TmT, X + Y, input_precision=DOT_PREC)
    dAkk = -tl.dot(Z * beta[None, :], TmT, input_precision=DOT_PREC)
    dAkk = tl.where(rows[:, None] > rows[None, :], dAkk, 0.0)
    dbeta = tl.sum(tl.where(rows[:, None] == rows[None, :], Z, 0.0), 1) + tl.sum(dAkk * M, 1)
    dM = beta[:, None] * dAkk
    for vb in range(0, BV, VB):  # dv = beta * T^T du
        vc = vb + tl.arange(0, VB)
        mv = rm[:, None] & (vc < V)[None, :]
        offv = (t0 + rows)[:, None] * (H * V) + h * V + vc[None, :]
        dRu = tl.dot(TmT, tl.load(du_ptr + offv, mask=mv, other=0.0), input_precision=DOT_PREC)
        tl.store(dv_ptr + offv, (beta[:, None] * dRu).to(dv_ptr.dtype.element_ty), mask=mv)
    if BETA_SIG:
        dbeta = dbeta * beta * (1.0 - beta)
    tl.store(db_ptr + (t0 + rows) * H + h, dbeta.to(db_ptr.dtype.element_ty), mask=rm)

    # pass B: back through the factor tiles, column block by column block. Aqk's diagonal (dAd) is kept out of
    # the G-gradient as in `kda_intra_bwd_kernel`.
    dA = tl.where(rows[:, None] >= rows[None, :], dA, 0.0)
    dAd = tl.sum(tl.where(rows[:, None] == rows[None, :], dA, 0.0), 1)
    dAs = tl.where(rows[:, None] > rows[None, :], dA, 0.0)
    dAsT = tl.trans(dAs)
    dMT = tl.trans(dM)
    sq = tl.zeros([16], tl.float32)
    sk = tl.zeros([16], tl.float32)
    dal = tl.zeros([KB], tl.float32)
    tl.debug_barrier()  # pass A's parked values are visible to every thread
    for kb in range(0, BK, KB):
        kc = kb + tl.arange(0, KB)
        mk = rm[:, None] & (kc < K)[None, :]
        offk = (t0 + rows)[:, None] * sx + h * K + kc[None, :]
        G, z = _gate_cols(g_ptr, alog_ptr, dtb_ptr, t0, nvalid, h, sx, K, kb, lower_bound, KB, GATE)
        gC = tl.sum(tl.where(rows[:, None] == 15, G, 0.0), 0)
        kn = _cols(k_ptr, t0, nvalid, h, sx, K, kb, KB) * rk[:, None]
        qn = _cols(q_ptr, t0, nvalid, h, sx, K, kb, KB) * rq[:, None]
        qs = qn * scale
        eG = tl.exp(G)
        eGi = tl.exp(-G)
        eC = tl.exp(gC[None, :] - G)
        qe = qs * eG
        ke = kn * eG
        ki = kn * eGi
        kg = kn * eC
        so = rows[:, None] + (kc * scr_row)[None, :]
        dqe = tl.load(base + so) + tl.dot(dAs, ki, input_precision=DOT_PREC)
        dkg = tl.load(base + 32 + so)
        dke = beta[:, None] * tl.dot(TmT, tl.load(base + 16 + so), input_precision=DOT_PREC) \
            + tl.dot(dM, ki, input_precision=DOT_PREC)
        dki = tl.dot(dMT, ke, input_precision=DOT_PREC) + tl.dot(dAsT, qe, input_precision=DOT_PREC)
        dqn = (dqe * eG + dAd[:, None] * kn) * scale
        dkn = dke * eG + dki * eGi + dkg * eC + dAd[:, None] * qs
        dG = dqe * qe + dke * ke - dki * ki - dkg * kg
        dgC = tl.sum(dkg * kg, 0) + tl.load(base + 48 + kc * scr_row) * tl.exp(gC)
        dG += tl.where(rows[:, None] == 15, dgC[None, :], 0.0)
        dg = tl.where(mk, tl.cumsum(dG, 0, reverse=True), 0.0)
        if GATE:
            a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
            x = a * z  # sigmoid'(x) as sigmoid(x) * sigmoid(-x): no cancellation when saturated
            dz = tl.where(mk, dg * lower_bound * tl.sigmoid(x) * tl.sigmoid(-x) * a, 0.0)
            tl.store(dg_ptr + offk, dz.to(dg_ptr.dtype.element_ty), mask=mk)
            tl.store(ddtb_ptr + (ic * H + h) * K + kc, tl.sum(dz, 0), mask=kc < K)
            dal += tl.sum(dz * z, 0)
        else:
            tl.store(dg_ptr + offk, dg.to(dg_ptr.dtype.element_ty), mask=mk)
        if L2:
            sq += tl.sum(dqn * qn, 1)
            sk += tl.sum(dkn * kn, 1)
            tl.debug_barrier()  # every thread has loaded this block's parked dqe and dkg
            tl.store(base + so, dqn)
            tl.store(base + 32 + so, dkn)
        else:
            tl.store(dq_ptr + offk, dqn.to(dq_ptr.dtype.element_ty), mask=mk)
            tl.store(dk_ptr + offk, dkn.to(dk_ptr.dtype.element_ty), mask=mk)
    if GATE:
        tl.store(dalog_ptr + ic * H + h, tl.sum(dal, 0))

    # pass C: the l2norm's backward, d x = (d xn - xn * rowsum(d xn * xn)) / ||x||
    if L2:
        tl.debug_barrier()
        for kb in range(0, BK, KB):
            kc = kb + tl.arange(0, KB)
            mk = rm[:, None] & (kc < K)[None, :]
            offk = (t0 + rows)[:, None] * sx + h * K + kc[None, :]
            so = rows[:, None] + (kc * scr_row)[None, :]
            qn = _cols(q_ptr, t0, nvalid, h, sx, K, kb, KB) * rq[:, None]
            kn = _cols(k_ptr, t0, nvalid, h, sx, K, kb, KB) * rk[:, None]
            dq = (tl.load(base + so) - qn * sq[:, None]) * rq[:, None]
            dk = (tl.load(base + 32 + so) - kn * sk[:, None]) * rk[:, None]
            tl.store(dq_ptr + offk, dq.to(dq_ptr.dtype.element_ty), mask=mk)
            tl.store(dk_ptr + offk, dk.to(dk_ptr.dtype.element_ty), mask=mk)
