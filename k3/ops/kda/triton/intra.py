"""Token-parallel KDA kernels: everything inside one 16-token chunk (forward and backward).

One program per (chunk, head). With C = 16 and the lower-bounded gate (g >= -5), the in-chunk
cumulative log decay G lies in (-80, 0], so the factors q*e^G, k*e^G (<= 1) and k*e^-G (<= e^80)
are all finite in fp32/bf16 and every pair term q_t k_s e^{G_t - G_s} is one dense matmul of
two such factor tiles (no anchor, no pairwise path). Non-causal pairs (values up to e^80, still
finite) are masked after the matmul.

Per chunk (rows t, s; S_0 the incoming state; scale folded into q):
    Akk = beta * tril_strict(ke ki^T),  Aqk = tril(qe ki^T),  T = (I + Akk)^-1,  Tb = T diag(beta)
    kg = k e^{G_C - G}
and the recurrence kernel does v_new = Tb (v - ke S_0) (= u - w S_0 with w = Tb ke, u = Tb v),
o = qe S_0 + Aqk v_new, S_C = e^{G_C} S_0 + kg^T v_new.
"""
from __future__ import annotations

import triton
import triton.language as tl

C = 16  # chunk size (tokens); the recurrence runs one step per chunk


@triton.jit
def _gate(graw, alog_ptr, dtb_ptr, h, K, cols, lower_bound, GATE: tl.constexpr):
    """Per-token log decay g of raw rows [16, n] at head h and columns `cols`, and the pre-activation z:
    with GATE, z = f + dt_bias and g = lower_bound * sigmoid(exp(A_log[h]) * z); else g = z = graw."""
    if GATE:
        a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        z = graw + tl.load(dtb_ptr + h * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        g = lower_bound * tl.sigmoid(a * z)
    else:
        z = graw
        g = graw
    return g, z


@triton.jit
def _beta(b_ptr, t0, nvalid, h, sb, BETA_SIG: tl.constexpr):
    """beta [16] of one chunk of one head (sigmoid of the logits with BETA_SIG), 0 on invalid rows; sb: the
    row stride of beta [T, H] (H when contiguous)."""
    rows = tl.arange(0, 16)
    rm = rows < nvalid
    braw = tl.load(b_ptr + (t0 + rows) * sb + h, mask=rm, other=0.0).to(tl.float32)
    beta = tl.sigmoid(braw) if BETA_SIG else braw
    return tl.where(rm, beta, 0.0)


@triton.jit
def _prep(q_ptr, k_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, t0, nvalid, h, H, K, scale, lower_bound,
          BK: tl.constexpr, GATE: tl.constexpr, BETA_SIG: tl.constexpr, L2: tl.constexpr):
    """Load one chunk of one head and apply l2norm / gate / beta sigmoid.

    Returns q (normalised, scaled), k (normalised), g (log decay, 0 on invalid rows), beta (0 on
    invalid rows), the raw rows needed by the backward (q_raw, k_raw, z) and 1/||q||, 1/||k||.
    """
    rows = tl.arange(0, 16)
    cols = tl.arange(0, BK)
    rm = rows < nvalid
    cm = cols < K
    m2 = rm[:, None] & cm[None, :]
    off = (t0 + rows)[:, None] * (H * K) + h * K + cols[None, :]
    q = tl.load(q_ptr + off, mask=m2, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + off, mask=m2, other=0.0).to(tl.float32)
    rq = tl.full([16], 1.0, tl.float32)
    rk = tl.full([16], 1.0, tl.float32)
    if L2:
        rq = 1.0 / tl.sqrt(tl.sum(q * q, 1) + 1e-6)
        rk = 1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6)
    qn = q * rq[:, None]
    kn = k * rk[:, None]
    g, z = _gate(tl.load(g_ptr + off, mask=m2, other=0.0).to(tl.float32), alog_ptr, dtb_ptr, h, K, cols,
                 lower_bound, GATE)
    g = tl.where(m2, g, 0.0)
    beta = _beta(b_ptr, t0, nvalid, h, H, BETA_SIG)
    return qn * scale, kn, g, beta, qn, kn, z, rq, rk


@triton.jit
def _mm(a, b, BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    """a @ b: bf16 operands (fp32 accumulate) for bf16/fp16 storage on GPU, else fp32 at DOT_PREC."""
    if BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PREC)


@triton.jit
def _unit_lower_inverse(A):
    """(I + A)^-1 for a strictly lower-triangular 16x16 A (nilpotent: A^16 = 0), as the product
    (I - A)(I + A^2)(I + A^4)(I + A^8) = sum_j (-A)^j, with exact-fp32 dots."""
    rows = tl.arange(0, 16)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    A2 = tl.dot(A, A, input_precision="ieee")
    A4 = tl.dot(A2, A2, input_precision="ieee")
    A8 = tl.dot(A4, A4, input_precision="ieee")
    Tm = tl.dot(eye - A, eye + A2, input_precision="ieee")
    Tm = tl.dot(Tm, eye + A4, input_precision="ieee")
    return tl.dot(Tm, eye + A8, input_precision="ieee")


@triton.jit
def _factors(qs, kn, g, beta, DOT_PREC: tl.constexpr):
    """Per-chunk factor tiles and the two 16x16 score matrices (see module docstring)."""
    rows = tl.arange(0, 16)
    G = tl.cumsum(g, 0)
    gC = tl.sum(tl.where(rows[:, None] == 15, G, 0.0), 0)                 # G at the chunk end [BK]
    eG = tl.exp(G)
    qe = qs * eG
    ke = kn * eG
    ki = kn * tl.exp(-G)
    kg = kn * tl.exp(gC[None, :] - G)
    M = tl.dot(ke, tl.trans(ki), input_precision=DOT_PREC)
    M = tl.where(rows[:, None] > rows[None, :], M, 0.0)
    Aqk = tl.dot(qe, tl.trans(ki), input_precision=DOT_PREC)
    Aqk = tl.where(rows[:, None] >= rows[None, :], Aqk, 0.0)
    Tm = _unit_lower_inverse(beta[:, None] * M)
    return G, gC, eG, qe, ke, ki, kg, M, Aqk, Tm


@triton.jit
def _cols(x_ptr, t0, nvalid, h, sx, K, kb, KB: tl.constexpr):
    """Rows [t0, t0 + nvalid) x columns [kb, kb + KB) of one head of x [T, H, K] (row stride sx; each row's
    [H, K] contiguous), as fp32 (0 outside)."""
    rows = tl.arange(0, 16)
    cols = kb + tl.arange(0, KB)
    m2 = (rows < nvalid)[:, None] & (cols < K)[None, :]
    off = (t0 + rows)[:, None] * sx + h * K + cols[None, :]
    return tl.load(x_ptr + off, mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _gate_cols(g_ptr, alog_ptr, dtb_ptr, t0, nvalid, h, sg, K, kb, lower_bound, KB: tl.constexpr, GATE: tl.constexpr):
    """In-chunk cumulative log decay G [16, KB] of columns [kb, kb + KB) (0 on invalid rows/columns), and the
    gate's pre-activation z (f + dt_bias with GATE, else g itself) for the backward."""
    rows = tl.arange(0, 16)
    cols = kb + tl.arange(0, KB)
    g, z = _gate(_cols(g_ptr, t0, nvalid, h, sg, K, kb, KB), alog_ptr, dtb_ptr, h, K, cols, lower_bound, GATE)
    g = tl.where((rows < nvalid)[:, None] & (cols < K)[None, :], g, 0.0)
    return tl.cumsum(g, 0), z


@triton.jit
def _norms_beta(q_ptr, k_ptr, b_ptr, t0, nvalid, h, sx, sb, K, BK: tl.constexpr, KB: tl.constexpr,
                BETA_SIG: tl.constexpr, L2: tl.constexpr):
    """1/||q||, 1/||k|| per row (1 without L2) and beta (0 on invalid rows), reading q, k in column blocks."""
    rq = tl.full([16], 1.0, tl.float32)
    rk = tl.full([16], 1.0, tl.float32)
    if L2:
        sq = tl.zeros([16], tl.float32)
        sk = tl.zeros([16], tl.float32)
        for kb in range(0, BK, KB):
            qb = _cols(q_ptr, t0, nvalid, h, sx, K, kb, KB)
            kb_ = _cols(k_ptr, t0, nvalid, h, sx, K, kb, KB)
            sq += tl.sum(qb * qb, 1)
            sk += tl.sum(kb_ * kb_, 1)
        rq = 1.0 / tl.sqrt(sq + 1e-6)
        rk = 1.0 / tl.sqrt(sk + 1e-6)
    return rq, rk, _beta(b_ptr, t0, nvalid, h, sb, BETA_SIG)


@triton.jit
def kda_intra_fwd_kernel(q_ptr, k_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, chunks_ptr,
                         ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr,
                         H, K, sx, sg, sb, scale, lower_bound,
                         BK: tl.constexpr, KB: tl.constexpr, GATE: tl.constexpr,
                         BETA_SIG: tl.constexpr, L2: tl.constexpr, DOT_PREC: tl.constexpr, PRE: tl.constexpr):
    """Per (chunk, head): ke, qe, kg [T, H, K], Aqk and Tb = T diag(beta) [T, H, 16], G_C [NC, H, K]. The inputs'
    row strides: sx (q and k), sg (g), sb (beta) -- row slices of wider tensors need no copy; outputs contiguous.

    One pass in column blocks of KB (every factor is per column except the l2norms and the two score
    matrices, which are sums over columns), so only [16, KB] tiles are live: low register use, many
    programs per SM. w = Tb ke and u = Tb v are left to the recurrence (v_new = Tb (v - ke S)), so k, g are
    read and the gate evaluated once, and v not at all.
    PRE (forwards without autograd): fold Tb into the outputs' factors instead, Aqk <- Aqk Tb and
    kg <- Tb^T kg (re-read from the just-written kg), and do not store Tb: the recurrence then needs no
    v_new (o = qe S + Aqk X, S' = e^{G_C} S + kg^T X with X = v - ke S), one matmul less on its chain.
    """
    ic = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(chunks_ptr + 2 * ic)
    nvalid = tl.load(chunks_ptr + 2 * ic + 1)
    rows = tl.arange(0, 16)
    rm = rows < nvalid
    rq, rk, beta = _norms_beta(q_ptr, k_ptr, b_ptr, t0, nvalid, h, sx, sb, K, BK, KB, BETA_SIG, L2)
    odt = ke_ptr.dtype.element_ty
    M = tl.zeros([16, 16], tl.float32)
    Aqk = tl.zeros([16, 16], tl.float32)
    for kb in range(0, BK, KB):
        cols = kb + tl.arange(0, KB)
        mk = rm[:, None] & (cols < K)[None, :]
        offk = (t0 + rows)[:, None] * (H * K) + h * K + cols[None, :]
        G, _ = _gate_cols(g_ptr, alog_ptr, dtb_ptr, t0, nvalid, h, sg, K, kb, lower_bound, KB, GATE)
        gC = tl.sum(tl.where(rows[:, None] == 15, G, 0.0), 0)
        kn = _cols(k_ptr, t0, nvalid, h, sx, K, kb, KB) * rk[:, None]
        eG = tl.exp(G)
        ki = kn * tl.exp(-G)
        ke = kn * eG
        M += tl.dot(ke, tl.trans(ki), input_precision=DOT_PREC)
        qe = _cols(q_ptr, t0, nvalid, h, sx, K, kb, KB) * (rq * scale)[:, None] * eG
        Aqk += tl.dot(qe, tl.trans(ki), input_precision=DOT_PREC)
        tl.store(ke_ptr + offk, ke.to(odt), mask=mk)
        tl.store(qe_ptr + offk, qe.to(odt), mask=mk)
        tl.store(kg_ptr + offk, (kn * tl.exp(gC[None, :] - G)).to(odt), mask=mk)
        tl.store(gc_ptr + (ic * H + h) * K + cols, gC, mask=cols < K)
    M = tl.where(rows[:, None] > rows[None, :], M, 0.0)
    Aqk = tl.where(rows[:, None] >= rows[None, :], Aqk, 0.0)
    offa = (t0 + rows)[:, None] * (H * 16) + h * 16 + rows[None, :]
    Tb = _unit_lower_inverse(beta[:, None] * M) * beta[None, :]
    if PRE:
        tl.store(aqk_ptr + offa, tl.dot(Aqk, Tb, input_precision="ieee"), mask=rm[:, None])
        tl.debug_barrier()  # this program's kg stores are visible to all its threads
        TbT = tl.trans(Tb)
        for kb in range(0, BK, KB):
            cols = kb + tl.arange(0, KB)
            mk = rm[:, None] & (cols < K)[None, :]
            offk = (t0 + rows)[:, None] * (H * K) + h * K + cols[None, :]
            kg = tl.load(kg_ptr + offk, mask=mk, other=0.0).to(tl.float32)
            tl.store(kg_ptr + offk, tl.dot(TbT, kg, input_precision=DOT_PREC).to(odt), mask=mk)
    else:
        tl.store(aqk_ptr + offa, Aqk, mask=rm[:, None])
        tl.store(tb_ptr + offa, Tb, mask=rm[:, None])


@triton.jit
def _state_grads(hall_ptr, dsall_ptr, vnew_ptr, do_ptr, du_ptr, ic, h, t0, nvalid, H, K, V,
                 BK: tl.constexpr, BV: tl.constexpr, VB: tl.constexpr, DOT_PREC: tl.constexpr, BF16: tl.constexpr):
    """The recurrence's gradients of one (chunk, head), value block by value block (states never live whole in
    registers): dqe = do S^T, dw = -du S^T, dkg = vn dS'^T [16, BK], dAqk = do vn^T [16, 16] and
    d e^{G_C} = rowsum(S * dS') [BK], from the incoming state S (hall) and the outgoing state's gradient dS'."""
    rows = tl.arange(0, 16)
    cols = tl.arange(0, BK)
    rm = rows < nvalid
    cm = cols < K
    dqe = tl.zeros([16, BK], tl.float32)
    dw = tl.zeros([16, BK], tl.float32)
    dkg = tl.zeros([16, BK], tl.float32)
    dA = tl.zeros([16, 16], tl.float32)
    dD = tl.zeros([BK], tl.float32)
    sbase = (ic * H + h).to(tl.int64) * K * V
    for vb in tl.static_range(0, BV, VB):
        vcb = vb + tl.arange(0, VB)
        vmb = vcb < V
        smb = cm[:, None] & vmb[None, :]
        mvb = rm[:, None] & vmb[None, :]
        offb = (t0 + rows)[:, None] * (H * V) + h * V + vcb[None, :]
        S = tl.load(hall_ptr + sbase + cols[:, None] * V + vcb[None, :], mask=smb, other=0.0)
        dS = tl.load(dsall_ptr + sbase + cols[:, None] * V + vcb[None, :], mask=smb, other=0.0)
        dob = tl.load(do_ptr + offb, mask=mvb, other=0.0)
        vnb = tl.load(vnew_ptr + offb, mask=mvb, other=0.0)
        dub = tl.load(du_ptr + offb, mask=mvb, other=0.0)
        dqe += _mm(dob, tl.trans(S), BF16, DOT_PREC)
        dw -= _mm(dub, tl.trans(S), BF16, DOT_PREC)
        dkg += _mm(vnb, tl.trans(dS), BF16, DOT_PREC)
        dA += _mm(dob, tl.trans(vnb), BF16, DOT_PREC)
        dD += tl.sum(S.to(tl.float32) * dS.to(tl.float32), 1)
    return dqe, dw, dkg, dA, dD


@triton.jit
def kda_intra_bwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, chunks_ptr,
                         hall_ptr, dsall_ptr, vnew_ptr, do_ptr, du_ptr,
                         dq_ptr, dk_ptr, dv_ptr, dg_ptr, db_ptr, ddtb_ptr, dalog_ptr,
                         H, K, V, scale, lower_bound,
                         BK: tl.constexpr, BV: tl.constexpr, VB: tl.constexpr, GATE: tl.constexpr,
                         BETA_SIG: tl.constexpr, L2: tl.constexpr, DOT_PREC: tl.constexpr, BF16: tl.constexpr):
    """Per (chunk, head): the recurrence's non-sequential gradients from the chunk's incoming state S
    (hall) and the gradient dS' of its outgoing state (dsall) -- dqe = do S^T, dw = -du S^T, dkg = vn dS'^T,
    dAqk = do vn^T, d e^{G_C} = rowsum(S * dS') in value blocks of VB -- then back through the chunk to q, k,
    v, g (or f, dt_bias, A_log) and beta (or its logit), including the l2norm."""
    ic = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(chunks_ptr + 2 * ic)
    nvalid = tl.load(chunks_ptr + 2 * ic + 1)
    rows = tl.arange(0, 16)
    cols = tl.arange(0, BK)
    rm = rows < nvalid
    cm = cols < K
    mk = rm[:, None] & cm[None, :]
    dqe, dw, dkg, dA, dD = _state_grads(hall_ptr, dsall_ptr, vnew_ptr, do_ptr, du_ptr, ic, h, t0, nvalid, H, K, V,
                                        BK, BV, VB, DOT_PREC, BF16)

    qs, kn, g, beta, qn, _, z, rq, rk = _prep(q_ptr, k_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, t0, nvalid, h, H, K,
                                              scale, lower_bound, BK, GATE, BETA_SIG, L2)
    G, gC, eG, qe, ke, ki, kg, M, Aqk, Tm = _factors(qs, kn, g, beta, DOT_PREC)
    vcols = tl.arange(0, BV)
    mv = rm[:, None] & (vcols < V)[None, :]
    offv = (t0 + rows)[:, None] * (H * V) + h * V + vcols[None, :]
    v = tl.load(v_ptr + offv, mask=mv, other=0.0).to(tl.float32)
    Rw = beta[:, None] * ke
    Ru = beta[:, None] * v
    w = tl.dot(Tm, Rw, input_precision=DOT_PREC)
    u = tl.dot(Tm, Ru, input_precision=DOT_PREC)
    offk = (t0 + rows)[:, None] * (H * K) + h * K + cols[None, :]
    du = tl.load(du_ptr + offv, mask=mv, other=0.0)
    dA = tl.where(rows[:, None] >= rows[None, :], dA, 0.0)

    # through w = T Rw, u = T Ru, T = (I + beta*M)^-1
    TmT = tl.trans(Tm)
    dRw = tl.dot(TmT, dw, input_precision=DOT_PREC)
    dRu = tl.dot(TmT, du, input_precision=DOT_PREC)
    dAkk = -(tl.dot(dRw, tl.trans(w), input_precision=DOT_PREC) + tl.dot(dRu, tl.trans(u), input_precision=DOT_PREC))
    dAkk = tl.where(rows[:, None] > rows[None, :], dAkk, 0.0)
    dv = beta[:, None] * dRu
    dbeta = tl.sum(v * dRu, 1) + tl.sum(ke * dRw, 1) + tl.sum(dAkk * M, 1)
    dM = beta[:, None] * dAkk
    dke = beta[:, None] * dRw + tl.dot(dM, ki, input_precision=DOT_PREC)
    # Aqk's diagonal q_t.k_t (no decay, no G dependence) is kept out of the G-gradient, where its
    # two large opposite terms would cancel only up to matmul rounding (amplified ~e^5 at g = -5).
    dAd = tl.sum(tl.where(rows[:, None] == rows[None, :], dA, 0.0), 1)
    dAs = tl.where(rows[:, None] > rows[None, :], dA, 0.0)
    dki = tl.dot(tl.trans(dM), ke, input_precision=DOT_PREC) + tl.dot(tl.trans(dAs), qe, input_precision=DOT_PREC)
    dqe += tl.dot(dAs, ki, input_precision=DOT_PREC)

    # through the factor tiles to q, k and G
    dqs = dqe * eG + dAd[:, None] * kn
    dkn = dke * eG + dki * tl.exp(-G) + dkg * tl.exp(gC[None, :] - G) + dAd[:, None] * qs
    dG = dqe * qe + dke * ke - dki * ki - dkg * kg
    dgC = tl.sum(dkg * kg, 0) + dD * tl.exp(gC)
    dG += tl.where(rows[:, None] == 15, dgC[None, :], 0.0)
    dg = tl.cumsum(dG, 0, reverse=True)
    dg = tl.where(mk, dg, 0.0)

    dqn = dqs * scale
    if L2:
        dq = (dqn - qn * tl.sum(dqn * qn, 1)[:, None]) * rq[:, None]
        dk = (dkn - kn * tl.sum(dkn * kn, 1)[:, None]) * rk[:, None]
    else:
        dq = dqn
        dk = dkn
    if GATE:
        a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        x = a * z  # sigmoid'(x) as sigmoid(x) * sigmoid(-x): no cancellation when saturated
        dz = dg * lower_bound * tl.sigmoid(x) * tl.sigmoid(-x) * a
        dz = tl.where(mk, dz, 0.0)
        tl.store(dg_ptr + offk, dz.to(dg_ptr.dtype.element_ty), mask=mk)
        tl.store(ddtb_ptr + (ic * H + h) * K + cols, tl.sum(dz, 0), mask=cm)
        tl.store(dalog_ptr + ic * H + h, tl.sum(tl.sum(dz * z, 1), 0))
    else:
        tl.store(dg_ptr + offk, dg.to(dg_ptr.dtype.element_ty), mask=mk)
    if BETA_SIG:
        dbeta = dbeta * beta * (1.0 - beta)
    tl.store(db_ptr + (t0 + rows) * H + h, dbeta.to(db_ptr.dtype.element_ty), mask=rm)
    tl.store(dq_ptr + offk, dq.to(dq_ptr.dtype.element_ty), mask=mk)
    tl.store(dk_ptr + offk, dk.to(dk_ptr.dtype.element_ty), mask=mk)
    tl.store(dv_ptr + offv, dv.to(dv_ptr.dtype.element_ty), mask=mv)

