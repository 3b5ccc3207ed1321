"""Routed experts for tens to a few thousand (token, expert) entries: two Triton GEMM kernels over expert tiles.

Between a decode step's few entries (`moe_decode`: GEMV kernels, ≤ `moe_decode.MAX_ENTRIES`) and a long prefill's
many (`k3.ops.moe`: the sorted-rows pipeline with `torch._grouped_mm`), a prefix hit's tail or a decode batch of
32–256 sequences routes ≈ 8–32 entries per expert. There the sorted-rows pipeline is eight launches per layer
(sort, dispatch, two grouped GEMMs with their prepare kernels, SiTU-GLU, combine) whose CUTLASS GEMMs tile
rows by 64 or more and read the experts' weights at well under the memory bandwidth. Here, after the same
counting sort (which also gives each sorted row its entry, `src`):

1. `moe_tile_gate_up_kernel`, program (tile p, block of BN columns of I): tile p is BM consecutive sorted rows of
   one expert (expert e owns cdiv(count_e, BM) tiles, found from the sort's `ends` on the device: no host sync,
   a static grid of cdiv(N·K, BM) + E tiles, the spare ones idle). It reads its rows of x through `src` (no
   dispatch copy), g = x W1[e]ᵀ and u = x W3[e]ᵀ on the tensor cores with fp32 accumulation, and stores
   h = SiTU-GLU(g, u) (the fp32 tiles: no rounding of g and u) in the activation dtype.
2. `moe_tile_down_kernel`, program (tile p, block of BN columns of L): ys = h W2[e]ᵀ, stored per sorted row.
3. `combine_rows` (the existing gather-sum): out[n] = Σ_k w[n, k] ys[pos[n, k]] in fp32.

Up to `ROUTED_MAX_ENTRIES` entries there is no sort kernel: each gate / up program finds its tile from the
router's choices (`_tile_routed`: the experts' counts, then its rows' entries by rank, the same tiles and row order
as the sort's), h is stored in tile order, program (p, 0) leaves the tile's expert and entries in a small table for
the down kernel, which writes ys in entry order; the gather-sum then reads row n·K + k (no `pos`). One launch and
one dependent step fewer per MoE layer (the sort was ≈ 4 µs of a prefix hit's ≈ 35 µs per layer on the H200).

The reference is `experts_forward`'s fp64 loop (`tests/test_moe_fast.py`); on CUDA the values differ from the
grouped path only by roundings (it rounds g and u to bf16 before SiTU-GLU).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._triton import interpreted as _interpreted, pdl
from ._triton_jit import pdl_sync
from .situ.triton import situ_glu_value

# entries (N·K) above `moe_decode.MAX_ENTRIES` up to which `experts_forward` takes these kernels (K3_MOE_TILES=0:
# never). Above, the grouped GEMMs' large tiles win (a long prefill: thousands of rows per expert).
MAX_ENTRIES = 4096
ON = os.environ.get("K3_MOE_TILES", "1") == "1"
# launch settings: rows per tile by the mean rows per expert (the first bound ≥ it), columns per program,
# the reduction chunk, warps, software-pipelining stages
TILE_ROWS = ((16, 16), (48, 32), (1 << 30, 64))
LAUNCH = {"bn": 64, "bk": 64, "warps": 4, "stages": 3}
# the down kernel's own (columns of L per program, reduction chunk over I, warps, stages). `probe/moe_tiles.py`
# (H200, 2026-12-04, 72 settings, the gate / up kernel at LAUNCH): chunks of 128 took 36.8 / 52.8 µs for both
# kernels at 64 / 256 tokens against 38.4 / 57.2 with LAUNCH's 64 (the best at 64 tokens, 36.7, within 1 %)
LAUNCH_DOWN = {"bn": 64, "bk": 128, "warps": 4, "stages": 3}
# up to ROUTED_MAX_ENTRIES entries, each program finds its tile from the router's choices itself (`_tile_routed`,
# chunks of ROUTED_CHUNK entries) instead of a counting-sort kernel before the two (K3_MOE_TILES_ROUTED=0: the sort)
ROUTED = os.environ.get("K3_MOE_TILES_ROUTED", "1") == "1"
ROUTED_MAX_ENTRIES = 1024
ROUTED_CHUNK = 256


def interpreted() -> bool:
    return _interpreted(moe_tile_gate_up_kernel)


@triton.jit
def _tile(ends_ptr, p, E, EP: tl.constexpr, BM: tl.constexpr):
    """Tile p's expert e (E when p is a spare tile), its first sorted row and its expert's row end: expert e owns
    rows [ends[e-1], ends[e]) and the cdiv(count, BM) tiles after those of the experts before it."""
    ee = tl.arange(0, EP)
    em = ee < E
    end = tl.load(ends_ptr + ee, mask=em, other=0).to(tl.int32)
    start = tl.load(ends_ptr + ee - 1, mask=em & (ee > 0), other=0).to(tl.int32)
    ntiles = tl.where(em, (end - start + BM - 1) // BM, 0)
    cum = tl.cumsum(ntiles, 0)  # inclusive: expert e's tiles end at cum[e]
    e = tl.sum((cum <= p).to(tl.int32), 0)
    here = ee == e
    first_tile = tl.sum(tl.where(here, cum - ntiles, 0), 0)
    row0 = tl.sum(tl.where(here, start, 0), 0) + (p - first_tile) * BM
    row_end = tl.sum(tl.where(here, end, 0), 0)
    return e, row0, row_end


@triton.jit
def _tile_routed(idx_ptr, p, NK, E, EP: tl.constexpr, CH: tl.constexpr, BM: tl.constexpr):
    """Tile p without a sort, from the router's choices idx [NK] (entry j = n·K + k chose expert idx[j]): the
    same tiles as `_tile` (expert e's cdiv(count, BM) tiles after those of the experts before it), and the entries
    of its BM rows, e's entries in ascending order (a stable sort's), ranks p's first .. + BM; a row mask. Two
    passes over idx in chunks of CH: the counts, then each chunk's ranks of e by a running cumulative sum."""
    ee = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    for s in range(0, NK, CH):
        jj = s + tl.arange(0, CH)
        ids = tl.load(idx_ptr + jj, mask=jj < NK, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == ee[None, :]).to(tl.int32), 0)
    ntiles = tl.where(ee < E, (counts + BM - 1) // BM, 0)
    cum = tl.cumsum(ntiles, 0)  # inclusive: expert e's tiles end at cum[e]
    e = tl.sum((cum <= p).to(tl.int32), 0)
    here = ee == e
    rank = (p - tl.sum(tl.where(here, cum - ntiles, 0), 0)) * BM + tl.arange(0, BM)  # the rows' ranks within e
    ent = tl.zeros([BM], tl.int32)
    seen = 0
    for s in range(0, NK, CH):
        jj = s + tl.arange(0, CH)
        m = (tl.load(idx_ptr + jj, mask=jj < NK, other=-1).to(tl.int32) == e).to(tl.int32)
        r = seen + tl.cumsum(m, 0) - 1
        ent += tl.sum(tl.where((m[None, :] > 0) & (r[None, :] == rank[:, None]), jj[None, :], 0), 1)
        seen += tl.sum(m, 0)
    return e, ent, rank < tl.sum(tl.where(here, counts, 0), 0)


@triton.jit
def gate_up_tile(x_ptr, tok, rm, e, cols, cm, w1_ptr, w3_ptr, sx, s1_e, s1_r, s3_e, s3_r, L: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """(g, u) fp32 [BM, BN] = x[tok] W1[e][cols]ᵀ, x[tok] W3[e][cols]ᵀ over L in chunks of BK (rows rm, columns
    cm; UPCAST: fp32 dots, the CPU interpreter's bf16 dot being wrong)."""
    e64 = e.to(tl.int64)
    c64 = cols.to(tl.int64)
    dot_t = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    g = tl.zeros([BM, BN], tl.float32)
    u = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, L, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < L
        xa = tl.load(x_ptr + tok[:, None] * sx + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        wm = km[:, None] & cm[None, :]
        w1 = tl.load(w1_ptr + e64 * s1_e + c64[None, :] * s1_r + kk[:, None], mask=wm, other=0.0)  # [BK, BN]
        w3 = tl.load(w3_ptr + e64 * s3_e + c64[None, :] * s3_r + kk[:, None], mask=wm, other=0.0)
        xa = xa.to(dot_t)
        g = tl.dot(xa, w1.to(dot_t), g, input_precision=DOT_PREC)
        u = tl.dot(xa, w3.to(dot_t), u, input_precision=DOT_PREC)
    return g, u


@triton.jit
def moe_tile_gate_up_kernel(x_ptr, src_ptr, ends_ptr, w1_ptr, w3_ptr, h_ptr, tab_ptr, E, I, NK, sx, s1_e, s1_r,
                            s3_e, s3_r, sh, beta, linear_beta, K: tl.constexpr, L: tl.constexpr, EP: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
                            UPCAST: tl.constexpr, ROUTED: tl.constexpr = False, CH: tl.constexpr = 16,
                            PDL: tl.constexpr = False):
    """h[rows, cols] = SiTU-GLU(x[tok] W1[e][cols]ᵀ, x[tok] W3[e][cols]ᵀ) for tile p's rows: the sort's rows
    (tok = src // K), or with ROUTED (src_ptr: the router's idx [NK]; `_tile_routed`) h's rows p·BM .. + BM, and
    program (p, 0) writes the tile's table for the down kernel: tab[p·(BM + 1)] = e, then its rows' entries (-1:
    none)."""
    pdl_sync(PDL)
    p = tl.program_id(0)
    if ROUTED:
        e, ent, rm = _tile_routed(src_ptr, p, NK, E, EP, CH, BM)
        rows = p * BM + tl.arange(0, BM)
        tok = (ent // K).to(tl.int64)
        if tl.program_id(1) == 0:
            tl.store(tab_ptr + p * (BM + 1), e)
            tl.store(tab_ptr + p * (BM + 1) + 1 + tl.arange(0, BM), tl.where(rm, ent, -1))
    else:
        e, row0, row_end = _tile(ends_ptr, p, E, EP, BM)
        rows = row0 + tl.arange(0, BM)
        rm = rows < row_end
        tok = (tl.load(src_ptr + rows, mask=rm, other=0) // K).to(tl.int64)
    if e < E:
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cm = cols < I
        g, u = gate_up_tile(x_ptr, tok, rm, e, cols, cm, w1_ptr, w3_ptr, sx, s1_e, s1_r, s3_e, s3_r, L, BM, BN, BK,
                            DOT_PREC, UPCAST)
        h = situ_glu_value(g, u, beta, linear_beta)
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * sh + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])


@triton.jit
def moe_tile_down_kernel(h_ptr, ends_ptr, w2_ptr, y_ptr, tab_ptr, E, L, sh, s2_e, s2_r, sy, I: tl.constexpr,
                         EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, ROUTED: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """ys[rows, cols] = h[rows] W2[e][cols]ᵀ for tile p's sorted rows; with ROUTED h's rows p·BM .. + BM into ys's
    rows of their entries (the gate / up kernel's table: ys in entry order)."""
    pdl_sync(PDL)
    p = tl.program_id(0)
    if ROUTED:
        e = tl.load(tab_ptr + p * (BM + 1))
        ent = tl.load(tab_ptr + p * (BM + 1) + 1 + tl.arange(0, BM))
        rm = ent >= 0
        r64 = (p * BM + tl.arange(0, BM)).to(tl.int64)
        out64 = ent.to(tl.int64)
    else:
        e, row0, row_end = _tile(ends_ptr, p, E, EP, BM)
        rows = row0 + tl.arange(0, BM)
        rm = rows < row_end
        r64 = rows.to(tl.int64)
        out64 = r64
    if e < E:
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cm = cols < L
        e64 = e.to(tl.int64)
        c64 = cols.to(tl.int64)
        dot_t = tl.float32 if UPCAST else h_ptr.dtype.element_ty
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < I
            ha = tl.load(h_ptr + r64[:, None] * sh + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            w = tl.load(w2_ptr + e64 * s2_e + c64[None, :] * s2_r + kk[:, None], mask=km[:, None] & cm[None, :],
                        other=0.0)
            acc = tl.dot(ha.to(dot_t), w.to(dot_t), acc, input_precision=DOT_PREC)
        tl.store(y_ptr + out64[:, None] * sy + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])


def routed(entries: int) -> bool:
    """Whether `experts_forward` lets the tile kernels find their tiles from the router's choices (`ROUTED`, up
    to `ROUTED_MAX_ENTRIES`) instead of running the counting sort first."""
    return ROUTED and entries <= ROUTED_MAX_ENTRIES


def fits(x: torch.Tensor, entries: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """Whether `experts_forward` takes these kernels: `ON`, up to `MAX_ENTRIES` entries, no autograd, weights in
    x's dtype, CUDA (or the CPU interpreter)."""
    return (ON and entries <= MAX_ENTRIES and not torch.is_grad_enabled()
            and (x.is_cuda or interpreted()) and w1.dtype == w2.dtype == w3.dtype == x.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def tile_rows(entries: int, experts: int) -> int:
    """Rows per tile for `entries` spread over `experts` (`TILE_ROWS`: by the mean per expert)."""
    mean = entries / max(1, experts)
    return next(bm for bound, bm in TILE_ROWS if mean <= bound)


def experts_tiles(x: torch.Tensor, src: torch.Tensor, ends: torch.Tensor | None, top_k: int, w1: torch.Tensor,
                  w2: torch.Tensor, w3: torch.Tensor, beta: float, linear_beta: float,
                  block_rows: int | None = None) -> torch.Tensor:
    """The experts' outputs per sorted row, ys [N·K, L] in x's dtype: x [N, L]; src [N·K] the entry (n·K + k) of
    each sorted row and ends [E] the experts' inclusive row ends (`moe_triton.expert_sort` with `with_src`);
    w1 / w3 [E, I, L] (any expert / row strides: the halves of a fused gate ‖ up tensor are read in place),
    w2 [E, L, I]. block_rows: rows per tile (default `tile_rows`; tests).
    ends None: src is the router's choices idx [N·K] (`topk_idx` flattened) and the kernels find their tiles from
    it (`_tile_routed`: no sort kernel); ys is then in entry order, ys[n·K + k] = expert idx[n, k] of x[n]."""
    N, L = x.shape
    E, I = w1.shape[0], w1.shape[1]
    NK = src.numel()
    routed = ends is None
    if (src.shape != (N * top_k,) or (not routed and ends.shape != (E,)) or w2.shape != (E, L, I)
            or w3.shape != w1.shape):
        raise ValueError(f"experts_tiles: need src [{N * top_k}], ends [{E}] or None, w1 / w3 [{E}, I, {L}], "
                         f"w2 [{E}, {L}, I]; got {tuple(src.shape)}, {None if routed else tuple(ends.shape)}, "
                         f"{tuple(w1.shape)} / {tuple(w3.shape)}, {tuple(w2.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w1, w2, w3 = (w if w.stride(-1) == 1 else w.contiguous() for w in (w1, w2, w3))
    ys = torch.empty(NK, L, dtype=x.dtype, device=x.device)
    if NK == 0:
        return ys
    BM = block_rows or tile_rows(NK, E)
    tiles = triton.cdiv(NK, BM) + min(E, NK)  # an upper bound of Σ_e cdiv(count_e, BM): a static grid
    # routed: h in tile order (tiles x BM rows) and the tiles' table (expert, entries) for the down kernel
    h = torch.empty(tiles * BM if routed else NK, I, dtype=x.dtype, device=x.device)
    tab = torch.empty(tiles * (BM + 1) if routed else 0, dtype=torch.int32, device=x.device)
    src = src.contiguous()
    up = interpreted()
    prec = "ieee" if x.dtype == torch.float32 or up else "tf32"

    def meta(c):
        m = dict(EP=max(16, triton.next_power_of_2(E)), BM=BM, BN=c["bn"], BK=c["bk"], DOT_PREC=prec, UPCAST=up,
                 ROUTED=routed, num_warps=c["warps"], **pdl(x))
        if not up:
            m["num_stages"] = c["stages"]
        return m

    moe_tile_gate_up_kernel[(tiles, triton.cdiv(I, LAUNCH["bn"]))](
        x, src, src if routed else ends, w1, w3, h, tab, E, I, NK, x.stride(0), w1.stride(0), w1.stride(1),
        w3.stride(0), w3.stride(1), h.stride(0), float(beta), float(linear_beta), K=top_k, L=L,
        CH=min(ROUTED_CHUNK, max(16, triton.next_power_of_2(NK))), **meta(LAUNCH))
    moe_tile_down_kernel[(tiles, triton.cdiv(L, LAUNCH_DOWN["bn"]))](
        h, ends if not routed else tab, w2, ys, tab, E, L, h.stride(0), w2.stride(0), w2.stride(1), ys.stride(0),
        I=I, **meta(LAUNCH_DOWN))
    return ys
