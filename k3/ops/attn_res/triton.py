"""Triton kernels of Block AttnRes: a block forward and backward, each program a block of BLOCK_R rows; a one-pass
forward over whole rows (`attn_res_stream_kernel`, the default where a row fits: below); and, for a decode step's
few rows, one program per row holding every source (`attn_res_rows_kernel`).

The N candidates are not stacked: each kernel reads them through a device table of data pointers (int64
`t.data_ptr()`, one scalar load per source, cast back to a pointer of the sources' dtype). Every load is a 2-D
[BLOCK_R, BLOCK_D] tile of ONE source (BLOCK_R rows of BLOCK_D contiguous elements: 16-byte vector loads), so
N and D are runtime values: D = 1536 or 7168 and N = 1..10 run through the same code. Statistics, softmax
and accumulation in fp32.

forward,  pass 1: for each source, over the D tiles: Σv² and v·w per row -> rstd_i, s_i = rstd_i (v_i·w),
          stored [N, R] fp32; the block's [BLOCK_R, NP] scores (NP = N padded to a power of two) read back,
          softmax over the sources, α stored [N, R] fp32.
          pass 2: for each D tile, over the sources: h = Σ_i α_i v_i in an fp32 [BLOCK_R, BLOCK_D] tile, stored.
backward, pass 1: for each D tile (dh loaded once), over the sources: dα_i = dh·v_i per row, in a [BLOCK_R, NP]
          register tensor (column i updated with a `tl.where` on arange(NP) == i); then c_i = α_i (dα_i −
          Σ_j α_j dα_j) rstd_i and e_i = c_i s_i rstd_i / D from the saved α, rstd, s, stored to [N, R] scratch.
          pass 2: for each D tile, over the sources: dv_i = α_i dh + c_i w − e_i v_i stored (table entry 0: no
          gradient wanted), Σ_i c_i v_i accumulated in an fp32 tile and, with HAS_DW, its column sums stored as
          the program's row of a [programs, D] fp32 buffer, summed afterwards by torch (deterministic, no atomics).
Per-source row vectors (α_i, c_i, e_i) go through global memory (L1 hits, ordered by a CTA barrier) rather than
being picked out of a register tensor: a [BLOCK_R, NP] tensor in the tile's layout costs as many registers as
a whole tile. Pass 2 re-reads the block's sources right after pass 1 (pass 1 loads ask L2 to keep them, pass 2
loads and the stores to let them go): DRAM traffic is forward N reads + 1 write of [R, D], backward N + 1
reads + N writes, plus the misses of pass 2 (few when BLOCK_R x D x N x resident programs fits in L2).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .._triton import pdl
from .._triton_jit import pdl_sync

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Launch settings per kernel: block_r x block_d, the register tile of one source (powers of two; block_d is
# capped at D's next power of two); num_warps; num_stages, software-pipelining stages of the innermost loops
# (1: none; > 1: cp.async through shared memory); unroll, unroll factor of the innermost loops (1: none), so
# that more tile loads are in flight. Picked on the H200 with `benchmarks/attn_res.py --sweep` (over `SWEEP`).
# Defaults from `benchmarks/attn_res.py --sweep` on the H200 (2026-12-01, rows 32768, D 1536, bf16; best summed
# over N = 3 and 6): forward 0.325 / 0.432 ms, backward 0.611 / 0.789 ms (~1.4-1.7 TB/s effective).
LAUNCH = {
    "fwd": dict(block_r=16, block_d=256, num_warps=4, num_stages=1, unroll=2),
    "bwd": dict(block_r=8, block_d=512, num_warps=4, num_stages=1, unroll=1),
}
# Candidates (block_r, block_d, num_warps, num_stages, unroll) the sweep times. Compiled for sm_90 by Triton 3.6
# (N = 1..10): none spills with bf16 / fp16 sources, and LAUNCH's defaults spill with fp32 sources neither
# (`benchmarks/attn_res.py --regs`).
SWEEP = {
    "fwd": [(32, 256, 4, 1, 1), (16, 256, 4, 1, 1), (32, 256, 8, 1, 1), (64, 256, 8, 1, 1), (16, 512, 4, 1, 1),
            (8, 1024, 8, 1, 1), (4, 1024, 4, 1, 1), (16, 256, 4, 1, 2), (32, 256, 8, 1, 2), (16, 256, 4, 2, 1),
            (32, 256, 8, 3, 1)],
    "bwd": [(16, 256, 4, 1, 1), (8, 256, 4, 1, 1), (16, 256, 8, 1, 1), (32, 256, 8, 1, 1), (8, 512, 4, 1, 1),
            (4, 1024, 4, 1, 1), (8, 256, 4, 1, 2), (16, 256, 8, 1, 2), (16, 256, 4, 2, 1), (32, 256, 8, 2, 1)],
}
SETTINGS = ("block_r", "block_d", "num_warps", "num_stages", "unroll")
# Few rows (decode, small batches): one row's loop over D is the latency chain, so fewer, wider D tiles and
# more programs (a sweep candidate that does not spill).
SMALL_ROWS, LAUNCH_SMALL_FWD = 512, dict(block_r=4, block_d=1024, num_warps=4, num_stages=1, unroll=1)


@triton.jit
def _source(tab, i, like):
    """Entry i of a pointer table as a pointer to `like`'s element type, 16-byte aligned (the launchers check)."""
    p = tl.load(tab + i).to(tl.pointer_type(like.dtype.element_ty))
    return tl.multiple_of(p, 16)


@triton.jit
def attn_res_fwd_kernel(src_tab, w_ptr, q_ptr, h_ptr, alpha_ptr, rstd_ptr, s_ptr, nw_ptr, R, D, N, eps, out_eps,
                        BR: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr, STAGES: tl.constexpr,
                        UNROLL: tl.constexpr, NORM: tl.constexpr = False, FOLD: tl.constexpr = False):
    """Rows [pid*BR, pid*BR + BR): h [R, D] (sources' dtype); alpha, rstd, s [N, R] fp32. src_tab: int64 [N].
    FOLD: the query is w_ptr [D] ⊙ q_ptr [D], folded here in fp32 (as `fold_query`) rather than by two casts and
    a multiply before the launch (three kernels fewer per site, which matters in a decode step's graph).
    NORM (inference): h is then replaced by RMSNorm(h) with weight nw_ptr [D] and out_eps, computed from h as
    rounded to its dtype (pass 3: the rows just written, re-read from L1 / L2): the sublayer's input in one kernel."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BR * D  # int64: R * D may exceed 2**31; offsets inside the block are int32
    ri = tl.arange(0, BR)
    rmask = ri < R - pid * BR
    roff = ri * D
    row = pid * BR + ri  # int32: N·R < 2**31 (an [N, R] fp32 tensor of 8 GiB would be needed otherwise)
    for i in range(N):  # pass 1: statistics of source i
        src = _source(src_tab, i, h_ptr) + base
        ss = tl.zeros([BR], tl.float32)
        vw = tl.zeros([BR], tl.float32)
        for d0 in tl.range(0, D, BD, num_stages=STAGES, loop_unroll_factor=UNROLL):
            dc = d0 + tl.arange(0, BD)
            dmask = dc < D
            w = tl.load(w_ptr + dc[None, :], mask=dmask[None, :], other=0.0).to(tl.float32)
            if FOLD:
                w = w * tl.load(q_ptr + dc[None, :], mask=dmask[None, :], other=0.0).to(tl.float32)
            v = tl.load(src + roff[:, None] + dc[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            ss += tl.sum(v * v, 1)
            vw += tl.sum(v * w, 1)
        r = 1.0 / tl.sqrt(ss / D + eps)
        tl.store(rstd_ptr + i * R + row, r, mask=rmask)
        tl.store(s_ptr + i * R + row, vw * r, mask=rmask)
    tl.debug_barrier()  # this block's s, written by any thread, is visible to all
    ids = tl.arange(0, NP)[None, :]
    so = ids * R + row[:, None]  # [BR, NP] offsets into [N, R]
    smask = rmask[:, None] & (ids < N)
    s = tl.where(ids < N, tl.load(s_ptr + so, mask=smask, other=0.0), float("-inf"))
    p = tl.exp(s - tl.max(s, 1)[:, None])  # padded columns: exp(-inf) = 0
    tl.store(alpha_ptr + so, p / tl.sum(p, 1)[:, None], mask=smask)
    tl.debug_barrier()  # and so is its alpha
    hp = h_ptr + base
    ss2 = tl.zeros([BR], tl.float32)
    for d0 in range(0, D, BD):  # pass 2: h = Σ_i α_i v_i, one D tile at a time
        dc = d0 + tl.arange(0, BD)
        m2 = rmask[:, None] & (dc < D)[None, :]
        off = roff[:, None] + dc[None, :]
        acc = tl.zeros([BR, BD], tl.float32)
        for i in tl.range(0, N, num_stages=STAGES, loop_unroll_factor=UNROLL):
            a = tl.load(alpha_ptr + i * R + row, mask=rmask, other=0.0)
            v = tl.load(_source(src_tab, i, h_ptr) + base + off, mask=m2, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            acc += a[:, None] * v
        hb = acc.to(h_ptr.dtype.element_ty)
        if NORM:
            hf = hb.to(tl.float32)
            ss2 += tl.sum(hf * hf, 1)
            tl.store(hp + off, hb, mask=m2)
        else:
            tl.store(hp + off, hb, mask=m2, eviction_policy="evict_first")
    if NORM:  # pass 3: y = h · rsqrt(mean(h²) + eps) · weight, in place
        tl.debug_barrier()
        r2 = 1.0 / tl.sqrt(ss2 / D + out_eps)
        for d0 in range(0, D, BD):
            dc = d0 + tl.arange(0, BD)
            m2 = rmask[:, None] & (dc < D)[None, :]
            off = roff[:, None] + dc[None, :]
            hf = tl.load(hp + off, mask=m2, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + dc, mask=dc < D, other=0.0).to(tl.float32)
            tl.store(hp + off, (hf * r2[:, None] * nw[None, :]).to(h_ptr.dtype.element_ty), mask=m2)


@triton.jit
def attn_res_rows_kernel(src_tab, w_ptr, q_ptr, h_ptr, nw_ptr, D, N, eps, out_eps,
                         NP: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, FOLD: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Inference, few rows (a decode or extend step): program r holds row r of ALL N sources as one [NP, BD]
    register tile, read once; statistics, softmax, the mix and (NORM) its RMSNorm come from registers. The
    block kernel above instead walks sources and D tiles with dependent loads in three passes, which at one
    row is a chain of ~15 memory latencies. Same math and precision (fp32; the norm reads the mix as rounded
    to its dtype); α, rstd and s are not kept (no backward)."""
    pdl_sync(PDL)
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    d = tl.arange(0, BD)
    im = i < N
    dm = d < D
    src = tl.load(src_tab + i, mask=im, other=0).to(tl.pointer_type(h_ptr.dtype.element_ty))
    m2 = im[:, None] & dm[None, :]
    v = tl.load(tl.multiple_of(src, 16)[:, None] + r * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    if FOLD:
        w = w * tl.load(q_ptr + d, mask=dm, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, 1) / D + eps)
    s = tl.where(im, tl.sum(v * w[None, :], 1) * rstd, float("-inf"))
    p = tl.exp(s - tl.max(s, 0))
    a = p / tl.sum(p, 0)
    h = tl.sum(a[:, None] * v, 0).to(h_ptr.dtype.element_ty)
    if NORM:
        hf = h.to(tl.float32)
        r2 = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / D + out_eps)
        h = (hf * r2 * tl.load(nw_ptr + d, mask=dm, other=0.0).to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + r * D + d, h, mask=dm)


@triton.jit
def _stream_step(v, w, i, m, l, acc, rstd_ptr, s_ptr, R, D, eps, row, rmask, STATS: tl.constexpr):
    """Fold source i's fp32 rows v [BR, BD] into the online softmax (m, l, acc); STATS: store its rstd, score."""
    r = 1.0 / tl.sqrt(tl.sum(v * v, 1) / D + eps)
    s = tl.sum(v * w[None, :], 1) * r
    if STATS:
        tl.store(rstd_ptr + i * R + row, r, mask=rmask)
        tl.store(s_ptr + i * R + row, s, mask=rmask)
    mn = tl.maximum(m, s)
    c = tl.exp(m - mn)  # 0 for the first source (m = -inf)
    p = tl.exp(s - mn)
    return mn, l * c + p, acc * c[:, None] + p[:, None] * v


@triton.jit
def attn_res_stream_kernel(src_tab, w_ptr, q_ptr, h_ptr, alpha_ptr, rstd_ptr, s_ptr, nw_ptr, R, D, N, eps, out_eps,
                           BR: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr, STAGES: tl.constexpr,
                           STATS: tl.constexpr, NORM: tl.constexpr = False, FOLD: tl.constexpr = False,
                           PDL: tl.constexpr = False):
    """Rows [pid*BR, pid*BR + BR), each whole (BD >= D), in ONE pass over the sources: source i's [BR, D] tile is
    loaded once (STAGES = 0: the next one's load issued before this one's math; else Triton's pipelining, STAGES
    deep), its rstd and score formed from registers,
    and folded into h by an online softmax (running max m and sum l per row, the fp32 accumulator rescaled by
    exp(m_old - m_new)), so no source is read twice and no pass waits on another. The block kernel's outputs:
    h (NORM: RMSNorm(h) with nw_ptr and out_eps, from h rounded to its dtype) and, with STATS, alpha, rstd and
    s [N, R] fp32 (alpha from the stored scores, as the block kernel). Same math in fp32, sums in another order."""
    pdl_sync(PDL)
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BR * D
    ri = tl.arange(0, BR)
    rmask = ri < R - pid * BR
    row = pid * BR + ri
    dc = tl.arange(0, BD)
    dmask = dc < D
    m2 = rmask[:, None] & dmask[None, :]
    off = (ri * D)[:, None] + dc[None, :]
    w = tl.load(w_ptr + dc, mask=dmask, other=0.0).to(tl.float32)
    if FOLD:
        w = w * tl.load(q_ptr + dc, mask=dmask, other=0.0).to(tl.float32)
    ids = tl.arange(0, NP)
    tab = tl.load(src_tab + ids, mask=ids < N, other=0)  # the N source addresses, int64, read once
    ty = tl.pointer_type(h_ptr.dtype.element_ty)
    m = tl.full([BR], float("-inf"), tl.float32)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, BD], tl.float32)
    if STAGES == 0:  # the next source's load issued by hand before this one's math (a register tile each)
        first = tl.sum(tl.where(ids == 0, tab, 0), 0).to(ty)
        nxt = tl.load(tl.multiple_of(first, 16) + base + off, mask=m2, other=0.0, eviction_policy="evict_first")
        for i in range(N):
            v = nxt.to(tl.float32)
            later = tl.sum(tl.where(ids == i + 1, tab, 0), 0).to(ty)  # null past the last source: nothing loaded
            nxt = tl.load(tl.multiple_of(later, 16) + base + off, mask=m2 & (ri * 0 + i + 1 < N)[:, None],
                          other=0.0, eviction_policy="evict_first")
            m, l, acc = _stream_step(v, w, i, m, l, acc, rstd_ptr, s_ptr, R, D, eps, row, rmask, STATS)
    else:  # Triton's software pipelining of the loads (through shared memory, STAGES deep)
        for i in tl.range(0, N, num_stages=STAGES):
            src = tl.sum(tl.where(ids == i, tab, 0), 0).to(ty)
            v = tl.load(tl.multiple_of(src, 16) + base + off, mask=m2, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            m, l, acc = _stream_step(v, w, i, m, l, acc, rstd_ptr, s_ptr, R, D, eps, row, rmask, STATS)
    hb = (acc / l[:, None]).to(h_ptr.dtype.element_ty)
    if NORM:
        hf = hb.to(tl.float32)
        r2 = 1.0 / tl.sqrt(tl.sum(hf * hf, 1) / D + out_eps)
        hb = (hf * r2[:, None] * tl.load(nw_ptr + dc, mask=dmask, other=0.0).to(tl.float32)[None, :]
              ).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + base + off, hb, mask=m2, eviction_policy="evict_first")
    if STATS:
        tl.debug_barrier()  # this block's scores, written by any thread, are visible to all
        so = ids[None, :] * R + row[:, None]
        smask = rmask[:, None] & (ids < N)[None, :]
        s = tl.where(ids[None, :] < N, tl.load(s_ptr + so, mask=smask, other=0.0), float("-inf"))
        p = tl.exp(s - tl.max(s, 1)[:, None])  # the block kernel's softmax of the same scores, not m and l:
        tl.store(alpha_ptr + so, p / tl.sum(p, 1)[:, None], mask=smask)  # α = 1 exactly for one source


# The one-pass kernel holds BR whole rows: BR x next_pow2(D) <= STREAM_MAX_TILE elements (D = 1536: 4 rows;
# 7168: 1). Wider rows take the block kernel. K3_ATTN_RES_STREAM=0: always the block kernel.
STREAM = os.environ.get("K3_ATTN_RES_STREAM", "1") == "1"
STREAM_MAX_TILE = 8192
# `benchmarks/attn_res.py --sweep` (H200, 2026-12-04, graph replays, D 1536 bf16): one row at 2 warps (32 elements
# per thread) was the best setting at every N and size: rows 8,192, N 2 / 4 / 6 / 9: 0.039 / 0.058 / 0.074 / 0.104
# ms against 0.038 / 0.066 / 0.086 / 0.130 for the block kernel's best; rows 32,768, N 6: 0.275 against 0.321.
LAUNCH_STREAM = dict(block_r=1, num_warps=2, num_stages=0)
STREAM_SETTINGS = ("block_r", "num_warps", "num_stages")
SWEEP_STREAM = [(1, 2, 0), (1, 4, 0), (2, 4, 0), (2, 8, 0), (4, 8, 0), (8, 16, 0), (1, 4, 2), (2, 4, 2),
                (2, 8, 3), (4, 8, 2), (4, 8, 3)]  # STREAM_SETTINGS


def stream_config(D: int, block_r: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> dict | None:
    """The one-pass kernel's launch for rows of width D (None when a row does not fit): block_r rows (capped so
    that the tile holds STREAM_MAX_TILE elements), next_pow2(D) columns, num_warps (raised to 32 tile elements
    per thread), num_stages (0: the next source's load by hand; >= 1: Triton's pipelining)."""
    bd = max(16, triton.next_power_of_2(D))
    if bd > STREAM_MAX_TILE:
        return None
    br = block_r if block_r is not None else LAUNCH_STREAM["block_r"]
    nw = num_warps if num_warps is not None else LAUNCH_STREAM["num_warps"]
    ns = num_stages if num_stages is not None else LAUNCH_STREAM["num_stages"]
    for k, v in (("block_r", br), ("num_warps", nw)):
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"attn_res triton: stream {k}={v!r}, expected a power of two")
    if not isinstance(ns, int) or ns < 0:
        raise ValueError(f"attn_res triton: stream num_stages={ns!r}, expected an integer >= 0")
    br = min(br, STREAM_MAX_TILE // bd)
    # at most 32 elements of the tile per thread: more spill (D = 7168 at 2 warps: 10 KB)
    return dict(block_r=br, block_d=bd, num_warps=max(nw, br * bd // 1024), num_stages=ns)


ROWS_KERNEL_MAX_ROWS, ROWS_KERNEL_MAX_TILE = 512, 16384  # rows, NP x BD elements held by one program


def rows_kernel_fits(R: int, N: int, D: int) -> bool:
    """Whether `attn_res_rows_triton` takes R rows of N sources of width D (few rows, a tile that fits)."""
    return R <= ROWS_KERNEL_MAX_ROWS and max(2, triton.next_power_of_2(N)) * triton.next_power_of_2(D) \
        <= ROWS_KERNEL_MAX_TILE


def attn_res_rows_triton(flat: list[torch.Tensor], w: torch.Tensor, eps: float, norm: tuple | None = None,
                         query: torch.Tensor | None = None) -> torch.Tensor:
    """h [R, D] of `attn_res_fwd_triton` (same arguments) through `attn_res_rows_kernel`: one program per row,
    for inference on few rows (`rows_kernel_fits`); no statistics returned."""
    R, D = flat[0].shape
    N, dev = len(flat), flat[0].device
    h = torch.empty(R, D, dtype=flat[0].dtype, device=dev)
    if R == 0:
        return h
    NP, BD = max(2, triton.next_power_of_2(N)), triton.next_power_of_2(D)
    nw, out_eps = norm if norm is not None else (None, 0.0)
    q = None if query is None else query.reshape(-1).contiguous()
    attn_res_rows_kernel[(R,)](_table([t.data_ptr() for t in flat], dev), w.reshape(-1).contiguous(), q, h,
                               None if nw is None else nw.contiguous(), D, N, float(eps), float(out_eps), NP=NP,
                               BD=BD, NORM=norm is not None, FOLD=query is not None,
                               num_warps=8 if NP * BD >= 8192 else 4, **pdl(h))
    return h


@triton.jit
def attn_res_bwd_kernel(src_tab, dv_tab, dh_ptr, w_ptr, alpha_ptr, rstd_ptr, s_ptr, c_ptr, e_ptr, dwp_ptr, R, D, N,
                        BR: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr, STAGES: tl.constexpr,
                        UNROLL: tl.constexpr, HAS_DW: tl.constexpr):
    """Rows [pid*BR, pid*BR + BR): dv_i [R, D] through dv_tab (entry 0: no gradient for that source) and, with
    HAS_DW, these rows' Σ_r Σ_i c_i v_i as row pid of dwp [programs, D] fp32. c, e: [N, R] fp32 scratch."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BR * D
    ri = tl.arange(0, BR)
    rmask = ri < R - pid * BR
    roff = ri * D
    row = pid * BR + ri  # int32: N·R < 2**31 (an [N, R] fp32 tensor of 8 GiB would be needed otherwise)
    ids = tl.arange(0, NP)[None, :]
    dhp = dh_ptr + base
    da = tl.zeros([BR, NP], tl.float32)  # dα_i = dh · v_i, column i
    for d0 in range(0, D, BD):  # pass 1: the dh tile is loaded once and used for every source
        dc = d0 + tl.arange(0, BD)
        m2 = rmask[:, None] & (dc < D)[None, :]
        off = roff[:, None] + dc[None, :]
        dh = tl.load(dhp + off, mask=m2, other=0.0, eviction_policy="evict_last").to(tl.float32)
        for i in tl.range(0, N, num_stages=STAGES, loop_unroll_factor=UNROLL):
            v = tl.load(_source(src_tab, i, dh_ptr) + base + off, mask=m2, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            da = tl.where(ids == i, da + tl.sum(v * dh, 1)[:, None], da)
    so = ids * R + row[:, None]
    smask = rmask[:, None] & (ids < N)
    alpha = tl.load(alpha_ptr + so, mask=smask, other=0.0)
    rstd = tl.load(rstd_ptr + so, mask=smask, other=0.0)
    c = alpha * (da - tl.sum(alpha * da, 1)[:, None]) * rstd  # ds_i · rstd_i
    tl.store(c_ptr + so, c, mask=smask)
    s = tl.load(s_ptr + so, mask=smask, other=0.0)
    tl.store(e_ptr + so, c * s * rstd / D, mask=smask)  # ds_i · rstd_i · s_i · rstd_i / D
    tl.debug_barrier()  # this block's c and e, written by any thread, are visible to all
    for d0 in range(0, D, BD):  # pass 2: dv_i tiles, Σ_i c_i v_i
        dc = d0 + tl.arange(0, BD)
        dmask = dc < D
        m2 = rmask[:, None] & dmask[None, :]
        off = roff[:, None] + dc[None, :]
        w = tl.load(w_ptr + dc[None, :], mask=dmask[None, :], other=0.0)
        dh = tl.load(dhp + off, mask=m2, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc = tl.zeros([BR, BD], tl.float32)
        for i in tl.range(0, N, num_stages=STAGES, loop_unroll_factor=UNROLL):
            c_i = tl.load(c_ptr + i * R + row, mask=rmask, other=0.0)[:, None]
            v = tl.load(_source(src_tab, i, dh_ptr) + base + off, mask=m2, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            if HAS_DW:
                acc += c_i * v
            g = tl.load(dv_tab + i)  # 0: no gradient wanted for source i, nothing stored
            a_i = tl.load(alpha_ptr + i * R + row, mask=rmask, other=0.0)[:, None]
            e_i = tl.load(e_ptr + i * R + row, mask=rmask, other=0.0)[:, None]
            dv = a_i * dh + c_i * w - e_i * v
            gp = tl.multiple_of(g.to(tl.pointer_type(dh_ptr.dtype.element_ty)), 16) + base
            tl.store(gp + off, dv.to(dh_ptr.dtype.element_ty), mask=tl.where(g != 0, m2, False),
                     eviction_policy="evict_first")
        if HAS_DW:
            tl.store(dwp_ptr + pid.to(tl.int64) * D + dc, tl.sum(acc, 0), mask=dmask)


_CAPTURED_TABLES: list[torch.Tensor] = []  # pinned sources of copies recorded in CUDA graphs (kept forever)
_STATIC: list[dict] = []  # the open `static_tables` contexts (innermost last): arena, entries used, host values


@contextlib.contextmanager
def static_tables(keep: list, device, capacity: int = 4096):
    """Around a CUDA graph capture (outside `torch.cuda.graph`): the pointer tables of the kernels captured inside
    are slices of one device arena allocated here, before the capture (so outside the graph's memory pool, whose
    blocks other graphs sharing it reuse as scratch), and written once when the context exits, after the capture,
    instead of by a host-to-device copy node replayed with the graph (their contents, the graph's static
    addresses, never change). `keep` receives the arena: hold it as long as the graph. Tables past `capacity`
    entries fall back to the copy."""
    st = {"arena": torch.empty(capacity, dtype=torch.int64, device=device), "used": 0, "host": []}
    _STATIC.append(st)
    try:
        yield keep
    finally:
        _STATIC.remove(st)
        if st["used"]:
            st["arena"][:st["used"]].copy_(torch.tensor(st["host"], dtype=torch.int64))
        keep.append(st["arena"])


def _table(ptrs: list[int], device: torch.device) -> torch.Tensor:
    """int64 [N] pointer table on `device`: staged through pinned memory and copied without a host sync.

    Under CUDA graph capture inside `static_tables`, a slice of its arena, written after the capture. Under
    another capture, the copy is recorded with the pinned buffer's address and repeated on every replay, so that
    buffer is kept alive (the host allocator would otherwise hand it to a later pin, and a replay would read
    someone else's pointers). The pointers themselves are the graph's static addresses."""
    if device.type != "cuda":
        return torch.tensor(ptrs, dtype=torch.int64)
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing and _STATIC:
        st, n = _STATIC[-1], len(ptrs)
        off = st["used"]
        if off + n <= st["arena"].numel() and st["arena"].device == device:
            st["host"] += ptrs + [0] * (n % 2)  # the next slice starts 16-byte aligned
            st["used"] += n + n % 2
            return st["arena"][off:off + n]
    t = torch.tensor(ptrs, dtype=torch.int64).pin_memory()
    if capturing:
        _CAPTURED_TABLES.append(t)
    return t.to(device, non_blocking=True)


def kernel_fits(sources: list[torch.Tensor]) -> str | None:
    """None when the kernels can take these sources, else the reason: they need one dtype of bf16 / fp16 /
    fp32, one shape, one device, contiguous 16-byte-aligned memory."""
    t0 = sources[0]
    if t0.dtype not in DTYPES:
        return f"dtype {t0.dtype} (expected one of bf16, fp16, fp32)"
    for i, t in enumerate(sources):
        if t.dtype != t0.dtype:
            return f"sources[{i}] has dtype {t.dtype}, sources[0] {t0.dtype} (expected one dtype)"
        if t.shape != t0.shape:
            return f"sources[{i}] has shape {tuple(t.shape)}, sources[0] {tuple(t0.shape)} (expected one shape)"
        if t.device != t0.device:
            return f"sources[{i}] is on {t.device}, sources[0] on {t0.device} (expected one device)"
        if not t.is_contiguous():
            return f"sources[{i}] is not contiguous"
        if t.data_ptr() % 16:
            return f"sources[{i}] is not 16-byte aligned (data_ptr % 16 = {t.data_ptr() % 16})"
    return None


def launch_config(kind: str, D: int, **overrides) -> dict:
    """The launch settings of kernel `kind` ("fwd" / "bwd"): `LAUNCH[kind]` updated with `overrides` (keys in
    `SETTINGS`; None keeps the default), block_d capped at D's next power of two (>= 16)."""
    if kind not in LAUNCH:
        raise ValueError(f"attn_res triton: unknown kernel {kind!r}; expected one of {', '.join(LAUNCH)}")
    cfg = dict(LAUNCH[kind])
    for k, v in overrides.items():
        if k not in cfg:
            raise ValueError(f"attn_res triton: unknown {kind} launch setting {k!r}; expected one of "
                             f"{', '.join(SETTINGS)}")
        if v is not None:
            cfg[k] = v
    for k in SETTINGS:
        v = cfg[k]
        pow2 = k in ("block_r", "block_d", "num_warps")
        if not isinstance(v, int) or v < 1 or (pow2 and v & (v - 1)):
            raise ValueError(f"attn_res triton: {kind} {k}={v!r}, expected "
                             f"{'a power of two' if pow2 else 'an integer >= 1'}")
    cfg["block_d"] = min(cfg["block_d"], max(16, triton.next_power_of_2(D)))
    return cfg


def _consts(cfg: dict, N: int) -> dict:
    """Kernel constexprs and launch options from a launch_config."""
    return dict(BR=cfg["block_r"], BD=cfg["block_d"], NP=max(2, triton.next_power_of_2(N)),
                STAGES=cfg["num_stages"], UNROLL=cfg["unroll"], num_warps=cfg["num_warps"])


def attn_res_fwd_triton(flat: list[torch.Tensor], w: torch.Tensor, eps: float, norm: tuple | None = None,
                        query: torch.Tensor | None = None, stats: bool = True, stream: dict | None = None,
                        **launch):
    """flat: N contiguous [R, D] sources of one dtype; w: [D] (used in fp32), or with `query` [D] given, the
    norm weight that the kernel folds with it (w ⊙ query in fp32, equal to `fold_query`). Returns h [R, D] in
    the sources' dtype, alpha, rstd and s (the scores) [N, R] fp32 (None each without `stats`). norm = (weight
    [D], eps): h is RMSNorm(h) instead (inference; `attn_res_norm`). The one-pass kernel (`stream`: overrides of
    LAUNCH_STREAM, `stream_config`) runs when STREAM and a row fits, unless `launch` overrides LAUNCH["fwd"] of
    the block kernel (`launch_config`), which runs otherwise."""
    R, D = flat[0].shape
    N, dev = len(flat), flat[0].device
    one = stream_config(D, **(stream or {})) if (STREAM or stream is not None) and not launch else None
    if one is None:
        cfg = launch_config("fwd", D, **({**LAUNCH_SMALL_FWD, **launch} if R <= SMALL_ROWS else launch))
    h = torch.empty(R, D, dtype=flat[0].dtype, device=dev)
    stat = torch.empty(3, N, R, dtype=torch.float32, device=dev).unbind(0) if stats or one is None else None
    out = (h, *(stat if stats else (None,) * 3))
    if R == 0:
        return out
    tab = _table([t.data_ptr() for t in flat], dev)
    nw, out_eps = norm if norm is not None else (None, 0.0)
    q = None if query is None else query.reshape(-1).contiguous()
    alpha, rstd, s = stat if stat is not None else (None,) * 3
    args = (tab, w.reshape(-1).contiguous(), q, h, alpha, rstd, s, None if nw is None else nw.contiguous(), R, D,
            N, float(eps), float(out_eps))
    if one is not None:
        attn_res_stream_kernel[(triton.cdiv(R, one["block_r"]),)](
            *args, BR=one["block_r"], BD=one["block_d"], NP=max(2, triton.next_power_of_2(N)),
            STAGES=one["num_stages"], STATS=stats, NORM=norm is not None, FOLD=query is not None,
            num_warps=one["num_warps"], **pdl(h))
    else:
        attn_res_fwd_kernel[(triton.cdiv(R, cfg["block_r"]),)](*args, NORM=norm is not None, FOLD=query is not None,
                                                               **_consts(cfg, N))
    return out


def attn_res_bwd_triton(flat: list[torch.Tensor], w: torch.Tensor, alpha: torch.Tensor, rstd: torch.Tensor,
                        s: torch.Tensor, dh: torch.Tensor, need: list[bool], need_w: bool, **launch):
    """Gradients of attn_res_fwd_triton given dh [R, D] and its alpha, rstd, s: dv_i [R, D] where need[i] (else
    None) and dw fp32 [D] when need_w (else None), the sum of the programs' partial rows (deterministic).
    launch: overrides of LAUNCH["bwd"] (`launch_config`)."""
    R, D = flat[0].shape
    N, dev = len(flat), flat[0].device
    cfg = launch_config("bwd", D, **launch)
    dh = dh.to(flat[0].dtype).contiguous()
    dvs = [torch.empty_like(t) if need[i] else None for i, t in enumerate(flat)]
    if R == 0:
        return dvs, (torch.zeros(D, device=dev) if need_w else None)
    G = triton.cdiv(R, cfg["block_r"])
    tab = _table([t.data_ptr() for t in flat] + [0 if g is None else g.data_ptr() for g in dvs], dev)
    dwp = torch.empty(G, D, dtype=torch.float32, device=dev) if need_w else None
    c, e = torch.empty(2, N, R, dtype=torch.float32, device=dev).unbind(0)
    attn_res_bwd_kernel[(G,)](tab, tab[N:], dh, w.float().contiguous(), alpha, rstd, s, c, e, dwp, R, D, N,
                              HAS_DW=need_w, **_consts(cfg, N))
    return dvs, (dwp.sum(0) if need_w else None)
