"""`moe_block_decode`'s kernel (see `moe_block.py`): a batch-1 decode step's whole LatentMoE in one launch of G
persistent programs (all resident: at most the SMs × the programs that fit on each), four phases apart by grid
barriers. Each phase shares its row tiles out over the programs (tile t to program t mod G). The widths are
constexprs, so the chunk loops unroll. Each projection reads its input as a [CH] vector broadcast over the tile's
rows (as tiles in the weights' layout, `dot_rows`' X2D, it was slower: 27.5-33.9 against 22.1-27.4 µs per layer,
H200, 2026-12-06).

1. the joined input projection (latent down ‖ shared gate ‖ up ‖ router): latent and gate ‖ up rounded to the
   activation dtype, the router's logits kept in fp32;
2. the routed experts' gate / up with SiTU-GLU (each program also chooses the K experts from the logits:
   `route_triton`'s selection; the first tile of each choice stores it), and beside them the shared experts' down
   projection of SiTU-GLU(gate, up) plus the residual;
3. the routed experts' down projection, weighted by the choices' weights and summed;
4. the latent RMSNorm (each program forms the statistics itself) and the up projection plus the shared output.
Values written in one phase are read in the next past L1 (`.cg`).

PHASE = p (1-4) runs phase p alone, without barriers: the split form, four launches in a row with kernel boundaries
(and programmatic dependent launch) in place of the grid barriers, any number of programs per launch."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_jit import grid_barrier, grid_done, pdl_sync
from .route_triton import route_factor, route_next
from .situ.triton import situ_glu_value


@triton.jit
def dot_rows(w_ptr, rows, N, ld, x_ptr, K: tl.constexpr, CH: tl.constexpr, GLU: tl.constexpr = False,
             beta=0.0, linear_beta=0.0, NORM: tl.constexpr = False, nw_ptr=None, rstd=1.0, X2D: tl.constexpr = False):
    """fp32 Σ_c W[rows, c] · x[c] over K columns (W row stride ld; rows ≥ N give 0); shared with `k3.ops.gemv`'s
    one-row kernel. GLU: x[c] is SiTU-GLU(x[c], x[K + c]) rounded to W's dtype (the input of a down projection);
    NORM: x[c] · rstd · nw[c] rounded to W's dtype (an RMSNorm whose statistics the caller formed). The chunk loop
    unrolls; sums on the CUDA cores.
    X2D: x is read as a [rows, CH] tile in W's layout (every row the same x: cache hits) instead of a [CH] vector
    broadcast over the rows. The broadcast converts x's layout through shared memory with two barriers per chunk
    (sm_90a SASS, Triton 3.6), and a barrier waits for x's load, so each chunk's weight loads are issued only after
    a cache round trip for the chunk's x: the chunks' reads do not overlap."""
    rm = rows < N
    r = rows[:, None].to(tl.int64) * ld
    wdt = w_ptr.dtype.element_ty
    acc = tl.zeros(rows.shape, tl.float32)
    zero = tl.zeros_like(rows)[:, None]
    for c0 in tl.static_range(0, K, CH):
        cols = c0 + tl.arange(0, CH)
        cm = cols < K
        if X2D:
            x = _x_chunk(x_ptr, zero + cols[None, :], (zero == 0) & cm[None, :], K, GLU, beta, linear_beta, NORM,
                         nw_ptr, rstd, wdt)
        else:
            x = _x_chunk(x_ptr, cols, cm, K, GLU, beta, linear_beta, NORM, nw_ptr, rstd, wdt)[None, :]
        w = tl.load(w_ptr + r + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x, 1)
    return acc


@triton.jit
def _x_chunk(x_ptr, cols, cm, K: tl.constexpr, GLU: tl.constexpr, beta, linear_beta, NORM: tl.constexpr, nw_ptr,
             rstd, wdt: tl.constexpr):
    """x[cols] in fp32 as `dot_rows` multiplies it (read past L1: another program wrote it before a barrier);
    cols and cm a [CH] vector or a [rows, CH] tile of column indices and their mask."""
    x = tl.load(x_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
    if GLU:
        u = tl.load(x_ptr + K + cols, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
        x = situ_glu_value(x, u, beta, linear_beta).to(wdt).to(tl.float32)
    if NORM:
        x = (x * rstd * tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)).to(wdt).to(tl.float32)
    return x


@triton.jit
def moe_block_kernel(x_ptr, res_ptr, out_ptr, win_ptr, w1_ptr, w3_ptr, w2_ptr, wsd_ptr, wup_ptr, nw_ptr, bias_ptr,
                     lat_ptr, gu_ptr, z_ptr, h_ptr, y_ptr, sh_ptr, idx_ptr, wt_ptr, sc_ptr, cnt_ptr,
                     s1_e, s1_r, s3_e, s3_r, s2_e, s2_r, scale, beta, linear_beta, eps, G,
                     D: tl.constexpr, L: tl.constexpr, I: tl.constexpr, IS: tl.constexpr, E: tl.constexpr,
                     K: tl.constexpr, BE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                     HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr,
                     BL: tl.constexpr, CH: tl.constexpr, BLN: tl.constexpr, PDL: tl.constexpr = False,
                     PHASE: tl.constexpr = 0):
    pdl_sync(PDL)
    p = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    RIN: tl.constexpr = L + 2 * IS + E
    # 1. latent ‖ shared gate ‖ up ‖ router logits
    if PHASE == 0 or PHASE == 1:
        for t in range(p, (RIN + BN - 1) // BN, G):
            rows = t * BN + tl.arange(0, BN)
            acc = dot_rows(win_ptr, rows, RIN, D, x_ptr, D, CH)
            tl.store(lat_ptr + rows, acc.to(dt), mask=rows < L)
            tl.store(gu_ptr + (rows - L), acc.to(dt), mask=(rows >= L) & (rows < L + 2 * IS))
            tl.store(z_ptr + (rows - L - 2 * IS), acc, mask=(rows >= L + 2 * IS) & (rows < RIN))
    if PHASE == 0:
        grid_barrier(cnt_ptr, G)
    if PHASE == 0 or PHASE == 2:
        _phase2(res_ptr, wsd_ptr, w1_ptr, w3_ptr, bias_ptr, lat_ptr, gu_ptr, z_ptr, h_ptr, sh_ptr, idx_ptr, wt_ptr,
                sc_ptr, s1_e, s1_r, s3_e, s3_r, scale, beta, linear_beta, G, p, dt, D, L, I, IS, E, K, BE, HAS_BIAS,
                RENORM, HAS_RES, BN, BI, CH)
    if PHASE == 0:
        grid_barrier(cnt_ptr, 2 * G)
    if PHASE == 0 or PHASE == 3:
        _phase3(w2_ptr, h_ptr, y_ptr, idx_ptr, wt_ptr, s2_e, s2_r, G, p, dt, L, I, K, BL, CH)
    if PHASE == 0:
        grid_barrier(cnt_ptr, 3 * G)
    if PHASE == 0 or PHASE == 4:
        _phase4(out_ptr, wup_ptr, nw_ptr, y_ptr, sh_ptr, eps, G, p, dt, D, L, HAS_NORM, BN, CH, BLN)
    if PHASE == 0:
        grid_done(cnt_ptr, G)


@triton.jit
def _phase2(res_ptr, wsd_ptr, w1_ptr, w3_ptr, bias_ptr, lat_ptr, gu_ptr, z_ptr, h_ptr, sh_ptr, idx_ptr, wt_ptr, sc_ptr,
            s1_e, s1_r, s3_e, s3_r, scale, beta, linear_beta, G, p, dt: tl.constexpr, D: tl.constexpr,
            L: tl.constexpr, I: tl.constexpr, IS: tl.constexpr, E: tl.constexpr, K: tl.constexpr, BE: tl.constexpr,
            HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, HAS_RES: tl.constexpr, BN: tl.constexpr,
            BI: tl.constexpr, CH: tl.constexpr):
    """2. routed experts' gate / up (+ the choice) | shared experts' down (+ residual)."""
    NBI: tl.constexpr = (I + BI - 1) // BI
    NEXP: tl.constexpr = K * NBI
    ee = tl.arange(0, BE)
    em = ee < E
    sc = tl.sigmoid(tl.load(z_ptr + ee, mask=em, other=0.0, cache_modifier=".cg"))
    ck = sc
    if HAS_BIAS:
        ck = ck + tl.load(bias_ptr + ee, mask=em, other=0.0).to(tl.float32)
    ck = tl.where(em, ck, float("-inf"))
    f = route_factor(ee, sc, ck, E, scale, K, BE, RENORM)
    for t in range(p, NEXP + (D + BN - 1) // BN, G):
        if t < NEXP:
            k = t // NBI
            ri = (t % NBI) * BI + tl.arange(0, BI)
            e = 0
            wk = 0.0
            c = ck
            for kk in tl.static_range(K):
                i, si, c = route_next(ee, sc, c, E, BE)
                e = tl.where(k == kk, i, e)
                wk = tl.where(k == kk, si * f, wk)
            if t % NBI == 0:
                tl.store(idx_ptr + k, e.to(tl.int64))
                tl.store(wt_ptr + k, wk)
                if k == 0:
                    tl.store(sc_ptr + ee, sc, mask=em)
            e64 = e.to(tl.int64)
            g = dot_rows(w1_ptr + e64 * s1_e, ri, I, s1_r, lat_ptr, L, CH)
            u = dot_rows(w3_ptr + e64 * s3_e, ri, I, s3_r, lat_ptr, L, CH)
            h = situ_glu_value(g, u, beta, linear_beta)
            tl.store(h_ptr + k * I + ri, h.to(dt), mask=ri < I)
        else:
            rs = (t - NEXP) * BN + tl.arange(0, BN)
            sacc = dot_rows(wsd_ptr, rs, D, IS, gu_ptr, IS, CH, True, beta, linear_beta)
            if HAS_RES:
                sacc += tl.load(res_ptr + rs, mask=rs < D, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(sh_ptr + rs, sacc.to(dt), mask=rs < D)


@triton.jit
def _phase3(w2_ptr, h_ptr, y_ptr, idx_ptr, wt_ptr, s2_e, s2_r, G, p, dt: tl.constexpr, L: tl.constexpr,
            I: tl.constexpr, K: tl.constexpr, BL: tl.constexpr, CH: tl.constexpr):
    """3. routed experts' down projections, weighted and summed."""
    for t in range(p, (L + BL - 1) // BL, G):
        rows = t * BL + tl.arange(0, BL)
        acc = tl.zeros([BL], tl.float32)
        for kk in tl.static_range(K):
            e = tl.load(idx_ptr + kk, cache_modifier=".cg")
            wk = tl.load(wt_ptr + kk, cache_modifier=".cg")
            acc += wk * dot_rows(w2_ptr + e * s2_e, rows, L, s2_r, h_ptr + kk * I, I, CH)
        tl.store(y_ptr + rows, acc.to(dt), mask=rows < L)


@triton.jit
def _phase4(out_ptr, wup_ptr, nw_ptr, y_ptr, sh_ptr, eps, G, p, dt: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
            HAS_NORM: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, BLN: tl.constexpr):
    """4. latent RMSNorm, up projection + the shared output."""
    if HAS_NORM:
        cl = tl.arange(0, BLN)
        yv = tl.load(y_ptr + cl, mask=cl < L, other=0.0, cache_modifier=".cg").to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(yv * yv, 0) / L + eps)
    else:
        rstd = tl.full([], 1.0, tl.float32)
    for t in range(p, (D + BN - 1) // BN, G):
        rows = t * BN + tl.arange(0, BN)
        rm = rows < D
        acc = tl.load(sh_ptr + rows, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += dot_rows(wup_ptr, rows, D, L, y_ptr, L, CH, NORM=HAS_NORM, nw_ptr=nw_ptr, rstd=rstd)
        tl.store(out_ptr + rows, acc.to(dt), mask=rm)
