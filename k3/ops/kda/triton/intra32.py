"""Forward intra-chunk KDA kernel over 32-token chunks (for forwards without autograd).

A 32-token chunk halves the recurrence's sequential steps (`recur.py`, BT = 32). Its cumulative log decay
spans up to 160, beyond one dense factor product, so the chunk is two 16-token tiles a (tokens 0-15) and
b (16-31), each with its own local cumulative decay (La, Lb, both in (-80, 0]):
- diagonal blocks as in `intra.py`: k e^{L} against k e^{-L} (factors <= e^80, finite);
- the off-diagonal block (b rows, a columns) anchored at the tile boundary: k_b e^{Lb} against
  k_a e^{La_C - La}, both factors <= 1 (and the latter is tile a's own kg, so it costs no exponential);
- T = (I + A)^-1 blockwise: T_aa, T_bb as in `intra.py`, T_ba = -T_bb A_ba T_aa.
The outputs are those of `intra.kda_intra_fwd_kernel` for 32-token chunks (Aqk, Tb [T, H, 32]).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .intra import _cols, _gate_cols, _norms_beta, _unit_lower_inverse

BT = tl.constexpr(32)  # chunk size (tokens)


@triton.jit
def _row_last(x):
    """Row 15 of a [16, n] tile (the tile's end), as [n]."""
    return tl.sum(tl.where(tl.arange(0, 16)[:, None] == 15, x, 0.0), 0)


@triton.jit
def _store_rows(ptr, x, t0, nvalid, h, H, D, c0, NCOL: tl.constexpr):
    """Store a [16, NCOL] tile at rows t0.. (nvalid valid), columns c0.. of one head of [T, H, D]."""
    rows = tl.arange(0, 16)
    cols = c0 + tl.arange(0, NCOL)
    m = (rows < nvalid)[:, None] & (cols < D)[None, :]
    tl.store(ptr + (t0 + rows)[:, None] * (H * D) + h * D + cols[None, :], x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def kda_intra_fwd32_kernel(q_ptr, k_ptr, g_ptr, b_ptr, alog_ptr, dtb_ptr, chunks_ptr,
                           ke_ptr, qe_ptr, kg_ptr, aqk_ptr, tb_ptr, gc_ptr,
                           H, K, scale, lower_bound,
                           BK: tl.constexpr, KB: tl.constexpr, GATE: tl.constexpr,
                           BETA_SIG: tl.constexpr, L2: tl.constexpr, DOT_PREC: tl.constexpr):
    """Per (32-token chunk, head): ke, qe, kg [T, H, K], Aqk and Tb = T diag(beta) [T, H, 32], G_C [NC, H, K],
    in one pass over column blocks of KB as `intra.kda_intra_fwd_kernel`."""
    ic = tl.program_id(0)
    h = tl.program_id(1)
    ta = tl.load(chunks_ptr + 2 * ic)
    na = tl.load(chunks_ptr + 2 * ic + 1)
    tb = ta + 16
    nb = na - 16
    rows = tl.arange(0, 16)
    rqa, rka, beta_a = _norms_beta(q_ptr, k_ptr, b_ptr, ta, na, h, H, K, BK, KB, BETA_SIG, L2)
    rqb, rkb, beta_b = _norms_beta(q_ptr, k_ptr, b_ptr, tb, nb, h, H, K, BK, KB, BETA_SIG, L2)
    Maa = tl.zeros([16, 16], tl.float32)
    Mba = tl.zeros([16, 16], tl.float32)
    Mbb = tl.zeros([16, 16], tl.float32)
    Aaa = tl.zeros([16, 16], tl.float32)
    Aba = tl.zeros([16, 16], tl.float32)
    Abb = tl.zeros([16, 16], tl.float32)
    for kb in range(0, BK, KB):
        cols = kb + tl.arange(0, KB)
        La, _ = _gate_cols(g_ptr, alog_ptr, dtb_ptr, ta, na, h, H, K, kb, lower_bound, KB, GATE)
        Lb, _ = _gate_cols(g_ptr, alog_ptr, dtb_ptr, tb, nb, h, H, K, kb, lower_bound, KB, GATE)
        gCa = _row_last(La)
        gCb = _row_last(Lb)
        ka = _cols(k_ptr, ta, na, h, H, K, kb, KB) * rka[:, None]
        kbt = _cols(k_ptr, tb, nb, h, H, K, kb, KB) * rkb[:, None]
        ea = tl.exp(La)
        eb = tl.exp(Lb)
        kia = ka * tl.exp(-La)
        kib = kbt * tl.exp(-Lb)
        kta = ka * tl.exp(gCa[None, :] - La)      # tile a's own kg: the off-diagonal block's column factor
        kea = ka * ea
        keb = kbt * eb
        Maa += tl.dot(kea, tl.trans(kia), input_precision=DOT_PREC)
        Mbb += tl.dot(keb, tl.trans(kib), input_precision=DOT_PREC)
        Mba += tl.dot(keb, tl.trans(kta), input_precision=DOT_PREC)
        qa = _cols(q_ptr, ta, na, h, H, K, kb, KB) * (rqa * scale)[:, None] * ea
        qb = _cols(q_ptr, tb, nb, h, H, K, kb, KB) * (rqb * scale)[:, None] * eb
        Aaa += tl.dot(qa, tl.trans(kia), input_precision=DOT_PREC)
        Abb += tl.dot(qb, tl.trans(kib), input_precision=DOT_PREC)
        Aba += tl.dot(qb, tl.trans(kta), input_precision=DOT_PREC)
        # chunk-relative factors: k e^{G}, q e^{G} (G from the chunk start), k e^{G_C - G}, and G_C
        xa = tl.exp(gCa)[None, :]
        _store_rows(ke_ptr, kea, ta, na, h, H, K, kb, KB)
        _store_rows(ke_ptr, keb * xa, tb, nb, h, H, K, kb, KB)
        _store_rows(qe_ptr, qa, ta, na, h, H, K, kb, KB)
        _store_rows(qe_ptr, qb * xa, tb, nb, h, H, K, kb, KB)
        _store_rows(kg_ptr, kta * tl.exp(gCb)[None, :], ta, na, h, H, K, kb, KB)
        _store_rows(kg_ptr, kbt * tl.exp(gCb[None, :] - Lb), tb, nb, h, H, K, kb, KB)
        tl.store(gc_ptr + (ic * H + h) * K + cols, gCa + gCb, mask=cols < K)
    lower = rows[:, None] > rows[None, :]
    Taa = _unit_lower_inverse(beta_a[:, None] * tl.where(lower, Maa, 0.0))
    Tbb = _unit_lower_inverse(beta_b[:, None] * tl.where(lower, Mbb, 0.0))
    Tba = -tl.dot(tl.dot(Tbb, beta_b[:, None] * Mba, input_precision="ieee"), Taa, input_precision="ieee")
    diag = rows[:, None] >= rows[None, :]
    zero = tl.zeros([16, 16], tl.float32)
    _store_rows(aqk_ptr, tl.where(diag, Aaa, 0.0), ta, na, h, H, BT, 0, 16)
    _store_rows(aqk_ptr, zero, ta, na, h, H, BT, 16, 16)
    _store_rows(aqk_ptr, Aba, tb, nb, h, H, BT, 0, 16)
    _store_rows(aqk_ptr, tl.where(diag, Abb, 0.0), tb, nb, h, H, BT, 16, 16)
    _store_rows(tb_ptr, Taa * beta_a[None, :], ta, na, h, H, BT, 0, 16)
    _store_rows(tb_ptr, zero, ta, na, h, H, BT, 16, 16)
    _store_rows(tb_ptr, Tba * beta_a[None, :], tb, nb, h, H, BT, 0, 16)
    _store_rows(tb_ptr, Tbb * beta_b[None, :], tb, nb, h, H, BT, 16, 16)
