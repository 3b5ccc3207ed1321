"""Paged MLA decode attention in the absorbed (latent) form; `paged_mla_decode` is the dispatch point.

Each of n single-token queries attends the first lens[i] positions of its sequence's history, read straight
from a paged latent pool: o_i = Σ_p softmax_p(scale · (q_lat_i · c_p + q_pe_i · k_pe_p)) · c_p, with c_p ‖ k_pe_p the
pool row of position p (page pages[i, p], row p mod page size). q_lat = q_nope · W_uk per head (the caller
absorbs kv_b's key half into the query, and its value half into the output).

Backends: "triton" (one kernel, flash-decoding splits; CUDA, or the CPU interpreter), "reference" (gathers
the [n, S, C + R] rows and computes in fp32 (fp64 for fp64 inputs): the oracle), "auto" (triton on CUDA).
"""
from __future__ import annotations

import os

import torch

from .._compile import eager_op
from .._triton import device_reason

GROUP_ROWS = 16  # rows per run of `groups` (one Triton program each; `triton.LAUNCH['groups']`)

BACKENDS = ("auto", "triton", "reference")
# whether an MLA layer of the engine writes its new latent rows with the latent RMSNorm in the same kernel
# (`write_latents` with norm: the default, level at batch 1 and faster at 32 and 256 on the H200, docs/benchmarks.md
# session 16) or as norm, cat and index_put (K3_MLA_FUSED_WRITE=0)
FUSED_WRITE = os.environ.get("K3_MLA_FUSED_WRITE", "1") == "1"
# whether the engine's graph batches hand the MLA kernel each row's page table (`paged_mla_decode(...,
# table_history=S)`: the kernel finds position p's page at column p // page_size) instead of a per-position [n, S]
# page table built inside every captured forward (a gather and a select over n x S, plus the row mask and offsets:
# ≈ 6 small kernels per decode step, 8 MB of writes in a 16K prefix hit's). H200, 2026-12-04 (`benchmarks/serve.py`
# flips it in the same run): decode batch 1 / 32 1.11 / 1.83 ms against 1.13 / 1.86; a 16K prefix hit's graph
# 0.03-0.06 ms less GPU time whatever the other switches (`benchmarks/probe/hit_switches.py`: 2.000 against 2.044 ms).
# K3_MLA_PAGE_TABLE=0: the per-position table.
PAGE_TABLE = os.environ.get("K3_MLA_PAGE_TABLE", "1") == "1"


def page_of_positions(table: torch.Tensor, history: int, page_size: int) -> torch.Tensor:
    """The per-position page table [n, history] of each row's page table `table` [n, P] (column j: the page of
    positions j·page_size …); positions past the table map to its last column (past every row's length anyway)."""
    col = (torch.arange(history, device=table.device) // page_size).clamp_max(table.shape[1] - 1)
    return table.gather(1, col.expand(table.shape[0], history))


def paged_mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, pages: torch.Tensor,
                               lens: torch.Tensor, scale: float, table_history: int | None = None) -> torch.Tensor:
    """The dense oracle: gather every history row, mask past lens, softmax in fp32 / fp64."""
    if table_history is not None:
        pages = page_of_positions(pages, table_history, kv.shape[1])
    n, H, C = q_lat.shape
    S = pages.shape[1]
    acc = torch.promote_types(q_lat.dtype, torch.float32)
    pos = torch.arange(S, device=kv.device)
    valid = pos[None, :] < lens[:, None]
    rows = kv[torch.where(valid, pages, 0), (pos % kv.shape[1])[None, :].expand(n, S)].to(acc)  # [n, S, C + R]
    c, k_pe = rows[..., :C], rows[..., C:]
    s = (torch.einsum("nhc,nsc->nhs", q_lat.to(acc), c) + torch.einsum("nhr,nsr->nhs", q_pe.to(acc), k_pe)) * scale
    p = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("nhs,nsc->nhc", p, c).to(q_lat.dtype)


def _check(q_lat, q_pe, kv, pages, lens, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"paged_mla_decode: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if q_lat.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"paged_mla_decode: expected q_lat [n, H, C] and q_pe [n, H, R], got {tuple(q_lat.shape)} "
                         f"and {tuple(q_pe.shape)}")
    n, _, C = q_lat.shape
    if kv.dim() != 3 or kv.shape[2] != C + q_pe.shape[2] or kv.stride(2) != 1:
        raise ValueError(f"paged_mla_decode: kv must be [pages, page_size, C + R] = [*, *, {C + q_pe.shape[2]}] "
                         f"with contiguous rows, got {tuple(kv.shape)} strides {kv.stride()}")
    if pages.dim() != 2 or pages.shape[0] != n or lens.shape != (n,) or pages.dtype.is_floating_point \
            or lens.dtype.is_floating_point:
        raise ValueError(f"paged_mla_decode: pages must be an integer [n, S] and lens an integer [n] with n = {n}, "
                         f"got {pages.dtype} {tuple(pages.shape)} and {lens.dtype} {tuple(lens.shape)}")


def triton_reason(kv: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot read this latent pool, or None."""
    why = device_reason(kv, __name__)
    if why is None and kv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        why = f"pool dtype {kv.dtype} (needs fp32 / bf16 / fp16)"
    return why


@eager_op
def paged_mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, pages: torch.Tensor,
                     lens: torch.Tensor, scale: float, backend: str = "auto", out: torch.Tensor | None = None,
                     groups: torch.Tensor | None = None, table_history: int | None = None) -> torch.Tensor:
    """q_lat [n, H, C] and q_pe [n, H, R] (one query per sequence), kv [P, page_size, C + R] the latent pool of
    one layer (a strided view is fine), pages [n, S] the page of each history position (S >= max(lens); any
    value past lens[i]), lens [n] >= 1 the history lengths (the query's own row included) → o_lat [n, H, C]
    in q_lat's dtype, written into `out` when given (any [n, H, C] view with a contiguous last dimension, e.g. a
    head-major buffer transposed: the callers' batched GEMMs then need no copies). Lengths are not read back
    to the host (CUDA-graph safe).

    groups (optional, int [NG, 2]): (first row, count ≤ `GROUP_ROWS`) runs of consecutive rows of ONE sequence,
    positions ascending (an extend step's tokens), every row in exactly one run (count 0 for unused entries).
    The Triton kernel then reads each block of that sequence's latents once for the whole run, through the last
    row's page table; the result is the same (the reference ignores it).

    table_history (optional): `pages` is then each row's page table [n, P] (column j: the page of positions
    j·page_size …, P ≥ ceil(S / page_size)) over a padded history of S = table_history positions, rather than the
    page of every position; same result."""
    _check(q_lat, q_pe, kv, pages, lens, backend)
    if table_history is not None and (table_history < 1 or pages.shape[1] < -(-table_history // kv.shape[1])):
        raise ValueError(f"paged_mla_decode: table_history {table_history} needs a page table [n, >= "
                         f"{-(-table_history // kv.shape[1])}] (page size {kv.shape[1]}), got {tuple(pages.shape)}")
    if groups is not None and (groups.dim() != 2 or groups.shape[1] != 2 or groups.dtype.is_floating_point):
        raise ValueError(f"paged_mla_decode: groups must be an integer [NG, 2] of (first row, count), got "
                         f"{groups.dtype} {tuple(groups.shape)}")
    if backend == "auto":
        backend = "triton" if kv.is_cuda and triton_reason(kv) is None else "reference"
    if out is not None and (out.shape != q_lat.shape or out.dtype != q_lat.dtype or out.stride(-1) != 1):
        raise ValueError(f"paged_mla_decode: out must be {tuple(q_lat.shape)} {q_lat.dtype} with a contiguous last "
                         f"dimension, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if backend == "reference":
        o = paged_mla_decode_reference(q_lat, q_pe, kv, pages, lens, scale, table_history)
        return o if out is None else out.copy_(o)
    why = triton_reason(kv)
    if why is not None:
        raise ValueError(f"paged_mla_decode: backend 'triton' cannot run here: {why}")
    from .triton import paged_mla_decode_triton
    return paged_mla_decode_triton(q_lat, q_pe, kv, pages, lens, scale, out, groups, table_history=table_history)


@eager_op
def write_latents(kv: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                  norm: tuple | None = None, backend: str = "auto") -> None:
    """The new tokens' latent rows into a layer's pool, in place: kv [P, page_size, C + R] (a strided view is
    fine, rows contiguous), pages / offs [N] each token's (page, row), c [N, C] and k_pe [N, R] (rows may be
    strided). norm = (weight [C], eps): c is the raw projection and is RMS-normalised first (`k3.ops.norm.rms_norm`,
    rounded to c's dtype). backend "auto": one Triton kernel on CUDA, else (and "reference") the plain ops."""
    if backend not in BACKENDS:
        raise ValueError(f"write_latents: unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    N, C = c.shape
    if k_pe.dim() != 2 or k_pe.shape[0] != N or kv.dim() != 3 or kv.shape[2] != C + k_pe.shape[1] \
            or kv.stride(2) != 1 or pages.shape != (N,) or offs.shape != (N,):
        raise ValueError(f"write_latents: need c [N, C], k_pe [N, R], kv [P, page_size, C + R] with contiguous rows "
                         f"and pages / offs [N], got {tuple(c.shape)}, {tuple(k_pe.shape)}, {tuple(kv.shape)} "
                         f"(strides {kv.stride()}), {tuple(pages.shape)}, {tuple(offs.shape)}")
    if backend == "auto":
        backend = "triton" if kv.is_cuda and triton_reason(kv) is None else "reference"
    if backend == "triton" and c.stride(-1) == 1 and k_pe.stride(-1) == 1:
        from .triton import write_latents_triton
        return write_latents_triton(kv, pages, offs, c, k_pe, norm)
    if norm is not None:
        from ..norm import rms_norm
        c = rms_norm(c, norm[0], norm[1])
    kv[pages, offs] = torch.cat([c, k_pe], dim=-1).to(kv.dtype)
