"""Paged MLA decode attention in the absorbed form as a Triton kernel (flash-decoding over KV splits).

One program per (sequence, block of heads, split of the history) -- or, with `groups`, per (up to GROUP_ROWS
rows of one sequence, e.g. a prefix-hit tail's tokens, sharing one read of each latent block) -- walks the
split in blocks of BS gathers each position's latent row c ‖ k_pe straight from the paged pool (page from the per-position
page table, row = position mod page size: no [n, S, C + R] gather, no mask tensor), and keeps an online
softmax in fp32. A history in one split writes the normalised output; more splits write unnormalised partials
and their (max, sum) statistics, combined by `mla_combine_kernel` (one launch; K3_MLA_COMBINE_KERNEL=0:
by `combine`, a few PyTorch ops). Dot products take their
inputs in the pool's dtype and accumulate in fp32 ("ieee" for fp32 pools: no TF32).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._triton import interpreted as _interpreted, pdl
from .._triton_jit import pdl_sync
from . import GROUP_ROWS  # rows of one sequence per program with `groups`: the dots' M is GROUP_ROWS x BH

# Launch settings: bh heads per program (with the rows of a token run, the dots' M = rows x bh), bs history
# positions per block, split positions per program (flash-decoding split), warps (None: 8 when the accumulator
# is wide, else 4) and software-pipelining stages (None: Triton's default); "decode" for one row per program,
# "groups" for token runs (an extend step). `benchmarks/probe/decode_ops.py` times SWEEP_GROUPS on the H200:
# on a prefix hit's 64 rows after 16K cached (k3-small, 2026-12-02) 8 rows x 16 heads, blocks of 64, splits of
# 2,048, 8 warps took 0.259 ms against 0.334 ms for the former 4 x 16 / 32 / 1,024 (the fastest, 16 rows x 4
# heads, 0.251 ms, reads each history three times for lone decode rows: one program per block of 4 heads).
# "decode" from `benchmarks/probe/mla_decode_cfg.py` (H200, 2026-12-03, session 15): blocks of 128 positions with
# two pipelining stages and 4 warps; a history of 200 (1 or 8 sequences) 17.5 → 6.7 µs, 2,000 (1 sequence) 78.9 →
# 37.0, 32 sequences of 2,000 86.9 → 45.7, against the former 16 heads / 32 / default stages (the best setting
# of 36 at each size within 4 %): a batch-1 step's MLA was one program walking its history in 32-row blocks.
LAUNCH = {"decode": dict(bh=16, bs=128, split=1024, warps=4, stages=2),
          "groups": dict(bh=4, bs=128, split=1536, warps=4, stages=2)}  # with GROUP_ROWS = 16
# "groups" likewise (same probe and day, 64 rows after 16,384 cached): 189.4 → 118.1 µs against the former
# 16 heads / 64 / 2,048 / 8 warps / default stages, the best of 32 settings; then (2026-12-04, blocks of (row, head)
# pairs, the 32 settings of SWEEP_GROUPS) runs of 16 rows x 4 heads 88.9 µs against 94.4 for 8 x 8
# candidates for token runs, with g rows per run (GROUP_ROWS is the g in use; a program's M is g x bh of the run's
# (row, head) pairs, so 16 x 4 covers a run's 192 pairs of 12 heads in three full blocks); `probe/mla_decode_cfg.py`
# times each and the CUDA tests check each. Splits of 1,536 (2026-12-04, session 22, 72 settings): 60.5 against
# 73.6 µs for 2,048, the next best. A 16K history is then 11 splits x 12 (run, block) programs = 132, one per SM
# of the H200; at 2,048 its 9 splits (the last of 64 positions) filled 108 (96 busy)
SWEEP_GROUPS = [dict(g=g, bh=bh, bs=128, split=split, warps=w, stages=st)
                for g, bh in ((8, 8), (16, 4)) for split in (1024, 1536, 2048) for w in (4, 8) for st in (2, 3)]


# shared memory the pipelined latent blocks may take (stages x BS x (C + R) x bytes; the H200 gives a block 227 KB,
# the rest goes to the dots' operands): larger latents or fp32 pools halve BS until they fit
SMEM_BUDGET = 180 * 1024


def block_positions(bs: int, stages: int | None, CP: int, RP: int, itemsize: int) -> int:
    """History positions per block: `bs` halved (not below 16) until `stages` buffered blocks of latent rows (CP +
    RP padded columns of `itemsize` bytes) fit `SMEM_BUDGET`. LAUNCH's 128 fits k3-small's bf16 pool (2 x 128 x 320 x
    2 B = 160 KB); an fp32 pool or K3's 512-wide latent needs 64 (a launch at 128 asked for 340 KB: out of resources)."""
    while bs > 16 and (stages or 3) * bs * (CP + RP) * itemsize > SMEM_BUDGET:
        bs //= 2
    return bs


def interpreted() -> bool:
    return _interpreted(mla_decode_kernel)


@triton.jit
def mla_decode_kernel(QL, QP, KV, PAGES, LENS, GRP, O, M, L, scale, H, PS, s_kv_page, s_kv_row, s_pages, s_qln,
                      s_qlh, s_qpn, s_qph, s_on, s_oh,
                      C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr,
                      G: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr, NS: tl.constexpr,
                      DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_GRP: tl.constexpr,
                      ALL_SPLITS: tl.constexpr = True, PDL: tl.constexpr = False, TABLE: tl.constexpr = False):
    """Program (group j, block b, split): rows GRP[j] = (row0, count) (row j alone without groups); its count x H
    (row, head) pairs, row-major, in blocks of G x BH as the dots' M (no padding heads when BH does not divide H;
    a block past a short group's pairs reads nothing). The rows of a group share the page table of its last row and
    each masks past its length. ALL_SPLITS=False: a split past every row's history stores nothing (the combine
    kernel reads only each row's non-empty splits; a graph's history bucket can be twice the history). TABLE: PAGES
    holds each row's page table (position p's page at column p // PS), not the page of every position."""
    pdl_sync(PDL)
    j = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    if HAS_GRP:
        row0 = tl.load(GRP + 2 * j).to(tl.int32)
        cnt = tl.load(GRP + 2 * j + 1).to(tl.int32)
    else:
        row0 = j
        cnt = 1
    if HAS_GRP:
        f = hb * (G * BH) + tl.arange(0, G * BH)  # flat (row, head) pairs of the group
        grow = f // H
        heads = f % H
        im = grow < cnt
    else:  # one row: its heads (as before the runs' flat blocks: the decode step's code as timed)
        grow = tl.zeros([G * BH], tl.int32)
        heads = hb * BH + tl.arange(0, G * BH)
        im = heads < H
    rows = tl.where(im, row0 + grow, row0).to(tl.int64)
    h64 = heads.to(tl.int64)
    cc = tl.arange(0, CP)
    rr = tl.arange(0, RP)
    cm = cc < C
    rm = rr < R
    ql = tl.load(QL + rows[:, None] * s_qln + h64[:, None] * s_qlh + cc[None, :], mask=im[:, None] & cm[None, :],
                 other=0.0)
    qp = tl.load(QP + rows[:, None] * s_qpn + h64[:, None] * s_qph + rr[None, :], mask=im[:, None] & rm[None, :],
                 other=0.0)
    dot_t = tl.float32 if UPCAST else KV.dtype.element_ty  # UPCAST: the CPU interpreter (its bf16 dot is wrong)
    ql = ql.to(dot_t)
    qp = qp.to(dot_t)
    lens = tl.load(LENS + rows, mask=im, other=0).to(tl.int32)  # [G * BH]: each row's history
    last = (row0 + tl.maximum(cnt, 1) - 1).to(tl.int64)
    n_valid = tl.max(lens, 0)  # the last row's (positions ascend within a group); 0 for a block with no pair
    start = sp * SPLIT
    end = tl.minimum(start + SPLIT, n_valid)
    m_i = tl.full([G * BH], float("-inf"), tl.float32)
    l_i = tl.zeros([G * BH], tl.float32)
    acc = tl.zeros([G * BH, CP], tl.float32)
    for s0 in range(start, end, BS):
        pos = s0 + tl.arange(0, BS)
        pm = pos < end
        page = tl.load(PAGES + last * s_pages + (pos // PS if TABLE else pos), mask=pm, other=0)
        row = page.to(tl.int64) * s_kv_page + (pos % PS).to(tl.int64) * s_kv_row
        c = tl.load(KV + row[:, None] + cc[None, :], mask=pm[:, None] & cm[None, :], other=0.0).to(dot_t)  # [BS, CP]
        kp = tl.load(KV + row[:, None] + C + rr[None, :], mask=pm[:, None] & rm[None, :], other=0.0).to(dot_t)
        s = tl.dot(ql, tl.trans(c), input_precision=DOT_PREC) + tl.dot(qp, tl.trans(kp), input_precision=DOT_PREC)
        s = tl.where((pos[None, :] < lens[:, None]) & pm[None, :], s * scale, float("-inf"))  # pm: this split only
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_t), c, input_precision=DOT_PREC)
        m_i = m_new
    if NS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 only on masked rows (never stored)
        tl.store(O + rows[:, None] * s_on + h64[:, None] * s_oh + cc[None, :], out.to(O.dtype.element_ty),
                 mask=im[:, None] & cm[None, :])
    elif ALL_SPLITS or start < n_valid:  # an empty split's partials are written only for `combine`'s ops
        prow = ((rows * NS + sp) * H + h64).to(tl.int64)
        tl.store(O + prow[:, None] * C + cc[None, :], acc, mask=im[:, None] & cm[None, :])
        tl.store(M + prow, m_i, mask=im)
        tl.store(L + prow, l_i, mask=im)


def combine(part: torch.Tensor, m: torch.Tensor, l: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Splits' unnormalised outputs part [n, NS, H, C] and statistics m, l [n, NS, H] → [n, H, C] in dtype
    (an empty split has m = -inf, l = 0 and weighs nothing). The reference of `mla_combine_kernel`."""
    mx = m.amax(1, keepdim=True)
    w = torch.exp(m - mx)  # [n, NS, H]
    return ((part * w[..., None]).sum(1) / (l * w).sum(1)[..., None]).to(dtype)


# whether the splits' outputs are combined by `mla_combine_kernel` (one launch, written straight into the caller's
# strided output) or (K3_MLA_COMBINE_KERNEL=0) by `combine`'s PyTorch ops and a copy (≈ 8 launches per MLA layer:
# a prefix hit's tail over 16K cached tokens runs 8 splits per layer). `benchmarks/serve.py` (H200, 2026-12-04):
# 16K prefix hit 4.7 against 5.0 ms; decode batch 1 / 32 unchanged (1.15 / 1.94 ms).
COMBINE_KERNEL = os.environ.get("K3_MLA_COMBINE_KERNEL", "1") == "1"


@triton.jit
def mla_combine_kernel(P, M, L, O, LENS, H, NS, s_on, s_oh, C: tl.constexpr, SPLIT: tl.constexpr,
                       BH: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row n, block of BH heads, block of BC columns): o[n, h] = Σ_s e^(m_s − max) part_s / Σ_s e^(m_s −
    max) l_s over the row's non-empty splits only (the first ceil(LENS[n] / SPLIT); the others are never read, so
    the decode kernel need not write them), as an online rescaled sum in fp32, one rounding to O's dtype
    (part [n, NS, H, C], m / l [n, NS, H] contiguous). Blocks of columns: a prefix hit's 64 rows are 768 programs,
    not 64 each streaming every split of every column (65 µs per layer on the H200 at 9 of 16 splits)."""
    pdl_sync(PDL)
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    cc = tl.program_id(2) * BC + tl.arange(0, BC)
    hm = heads < H
    pm = hm[:, None] & (cc < C)[None, :]
    ns = tl.minimum(tl.cdiv(tl.load(LENS + n).to(tl.int32), SPLIT), NS)
    mx = tl.full([BH], float("-inf"), tl.float32)
    den = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BC], tl.float32)
    for s in range(0, ns):
        row = (n * NS + s) * H + heads
        ms = tl.load(M + row, mask=hm, other=float("-inf"))
        m_new = tl.maximum(mx, ms)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing yet: no NaN from -inf - -inf
        a = tl.exp(mx - m_safe)
        w = tl.exp(ms - m_safe)
        den = den * a + w * tl.load(L + row, mask=hm, other=0.0)
        part = tl.load(P + row.to(tl.int64)[:, None] * C + cc[None, :], mask=pm, other=0.0)
        acc = acc * a[:, None] + w[:, None] * part
        mx = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]  # a row with no key at all (padding): zeros, not NaN
    tl.store(O + n * s_on + heads.to(tl.int64)[:, None] * s_oh + cc[None, :], out.to(O.dtype.element_ty), mask=pm)


def combine_launch(H: int, C: int) -> tuple[int, int]:
    """(heads, columns) per program of `mla_combine_kernel`."""
    return min(4, triton.next_power_of_2(H)), min(128, max(16, triton.next_power_of_2(C)))


def paged_mla_decode_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, pages: torch.Tensor,
                            lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                            groups: torch.Tensor | None = None, group_rows: int = GROUP_ROWS,
                            launch: dict | None = None, table_history: int | None = None) -> torch.Tensor:
    """See `k3.ops.mla_decode.paged_mla_decode` (inputs already checked). q_lat, q_pe and `out` may be strided
    views (e.g. head-major [H, n, C] transposed) as long as their last dimension is contiguous. groups: int
    [NG, 2] (first row, count ≤ GROUP_ROWS) of rows that share their last row's page table (one program reads
    each block of latents once for all of them), covering every row once. group_rows: the most rows in a run
    (sweeps); launch: settings replacing LAUNCH's (sweeps, tests); table_history: `pages` is each row's page table
    over that many positions."""
    n, H, C = q_lat.shape
    R = q_pe.shape[-1]
    S = pages.shape[1] if table_history is None else table_history
    q_lat, q_pe = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_lat, q_pe))
    pages, lens = pages.contiguous(), lens.contiguous()
    qs = (q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1))
    cfg = {**LAUNCH["decode" if groups is None else "groups"], **(launch or {})}
    SPLIT, BH = cfg["split"], cfg["bh"]
    NS = triton.cdiv(S, SPLIT)
    G = 1 if groups is None else group_rows
    grid = (n if groups is None else groups.shape[0], triton.cdiv(G * H, G * BH), NS)
    grp = None if groups is None else groups.contiguous()
    up = interpreted()
    prec = "ieee" if kv.dtype == torch.float32 or up else "tf32"
    CP, RP = max(16, triton.next_power_of_2(C)), max(16, triton.next_power_of_2(R))
    warps = cfg["warps"] or (8 if CP * G >= 512 else 4)
    BS = block_positions(cfg["bs"], cfg["stages"], CP, RP, kv.element_size())
    meta = dict(C=C, R=R, CP=CP, RP=RP, BH=BH, G=G, BS=BS, SPLIT=SPLIT, DOT_PREC=prec, UPCAST=up,
                HAS_GRP=groups is not None, ALL_SPLITS=not COMBINE_KERNEL, TABLE=table_history is not None,
                num_warps=warps, **pdl(q_lat))
    if cfg["stages"]:
        meta["num_stages"] = cfg["stages"]
    if NS == 1:
        if out is None:
            out = torch.empty(n, H, C, device=q_lat.device, dtype=q_lat.dtype)
        mla_decode_kernel[grid](q_lat, q_pe, kv, pages, lens, grp, out, out, out, float(scale), H, kv.shape[1],
                                kv.stride(0), kv.stride(1), pages.stride(0), *qs, out.stride(0), out.stride(1),
                                NS=1, **meta)
        return out
    part = torch.empty(n, NS, H, C, device=q_lat.device, dtype=torch.float32)
    m = torch.empty(n, NS, H, device=q_lat.device, dtype=torch.float32)
    l = torch.empty_like(m)
    mla_decode_kernel[grid](q_lat, q_pe, kv, pages, lens, grp, part, m, l, float(scale), H, kv.shape[1],
                            kv.stride(0), kv.stride(1), pages.stride(0), *qs, 0, 0, NS=NS, **meta)
    if COMBINE_KERNEL:
        if out is None:
            out = torch.empty(n, H, C, device=q_lat.device, dtype=q_lat.dtype)
        bh, bc = combine_launch(H, C)
        mla_combine_kernel[(n, triton.cdiv(H, bh), triton.cdiv(C, bc))](
            part, m, l, out, lens, H, NS, out.stride(0), out.stride(1), C=C, SPLIT=SPLIT, BH=bh, BC=bc, num_warps=4,
            **pdl(q_lat))
        return out
    res = combine(part, m, l, q_lat.dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


@triton.jit
def latent_write_kernel(c_ptr, kp_ptr, w_ptr, kv_ptr, page_ptr, off_ptr, C, R, sc, skp, s_page, s_row, eps,
                        BC: tl.constexpr, BR: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    """Program t: the new token's latent row c ‖ k_pe into the pool at (page[t], off[t]); NORM: c is the raw
    projection and gets the latent RMSNorm first (fp32, rounded to c's dtype as the norm kernel stores it)."""
    pdl_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    cc = tl.arange(0, BC)
    rr = tl.arange(0, BR)
    cm = cc < C
    rm = rr < R
    c = tl.load(c_ptr + t * sc + cc, mask=cm, other=0.0)
    if NORM:
        cf = c.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(cf * cf, 0) / C + eps)
        c = (cf * r * tl.load(w_ptr + cc, mask=cm, other=0.0).to(tl.float32)).to(c_ptr.dtype.element_ty)
    kp = tl.load(kp_ptr + t * skp + rr, mask=rm, other=0.0)
    row = kv_ptr + tl.load(page_ptr + t).to(tl.int64) * s_page + tl.load(off_ptr + t).to(tl.int64) * s_row
    tl.store(row + cc, c.to(kv_ptr.dtype.element_ty), mask=cm)
    tl.store(row + C + rr, kp.to(kv_ptr.dtype.element_ty), mask=rm)


def write_latents_triton(kv: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor, c: torch.Tensor,
                         k_pe: torch.Tensor, norm: tuple | None = None) -> None:
    """See `k3.ops.mla_decode.write_latents` (inputs checked there)."""
    N, C = c.shape
    R = k_pe.shape[1]
    if N == 0:
        return
    w, eps = norm if norm is not None else (c, 0.0)
    latent_write_kernel[(N,)](c, k_pe, w.contiguous(), kv, pages.contiguous(), offs.contiguous(), C, R, c.stride(0),
                              k_pe.stride(0), kv.stride(0), kv.stride(1), float(eps),
                              BC=max(16, triton.next_power_of_2(C)), BR=max(16, triton.next_power_of_2(R)),
                              NORM=norm is not None, num_warps=1 if C + R <= 512 else 4, **pdl(c))
