"""Triton kernels of Block AttnRes: a forward and a backward, each program a contiguous range of rows.

The N candidates are not stacked: each kernel reads them through a device table of data pointers (int64
`t.data_ptr()`, loaded as a vector and cast back to pointers of the sources' dtype), so one row's D tile of
all N sources is a single [NP, BD] tile load (NP = N padded to a power of two; padded lanes are masked and
move no bytes). N and D are runtime values: D = 1536 or 7168 and N = 1..10 run through the same code, D in
tiles of BD. Statistics, softmax and accumulation in fp32.

forward,  per row: pass 1 over the D tiles accumulates Σv² and v·w per source; softmax over the sources;
          α, rstd stored [N, R] fp32; pass 2 writes h = Σ_i α_i v_i tile by tile.
backward, per row: pass 1 accumulates dα_i = dh·v_i and v_i·w; pass 2 writes every needed dv_i and adds
          Σ_i c_i v_i into the program's row of a [programs, D] fp32 buffer, summed afterwards by torch
          (deterministic, no atomics). A persistent grid (as many programs as fit on the GPU at once, from
          the compiled kernel's registers) keeps that buffer small and the wave without a tail.
Pass 2 re-reads the row's sources right after pass 1 (N·D elements: mostly cache hits). DRAM traffic:
forward N reads + 1 write of [R, D], backward N + 1 reads + N writes, plus cache misses of pass 2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TILE_ELEMS = 2048  # elements of one [NP, BD] register tile: BD = TILE_ELEMS // NP, clamped to [128, 1024]
NUM_WARPS = 4
FWD_ROWS = 4  # forward: rows per program (many short programs, no tail)


@triton.jit
def _tables(tab, cols, nmask, like):
    """Entries `cols` of a pointer table as a [NP] vector of pointers to `like`'s element type (0 where ~nmask);
    16-byte aligned (the launchers check) so that the tile loads vectorise."""
    p = tl.load(tab + cols, mask=nmask, other=0).to(tl.pointer_type(like.dtype.element_ty))
    return tl.multiple_of(p, [16])


@triton.jit
def attn_res_fwd_kernel(src_tab, w_ptr, h_ptr, alpha_ptr, rstd_ptr, R, D, N, rows_per_prog, eps,
                        BD: tl.constexpr, NP: tl.constexpr):
    """Rows [pid*rows_per_prog, ...): h [R, D] (sources' dtype), alpha / rstd [N, R] fp32.
    src_tab: int64 [N] data pointers. One row at a time, as [NP, BD] tiles (all sources of a D tile at once)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, NP)
    nmask = cols < N
    srcs = _tables(src_tab, cols, nmask, h_ptr)
    scol = cols.to(tl.int64) * R
    r0 = pid.to(tl.int64) * rows_per_prog  # int64 row index: r * D may exceed 2**31
    for r in range(r0, tl.minimum(r0 + rows_per_prog, R)):
        roff = r * D
        rows = srcs + roff
        ss = tl.zeros([NP], dtype=tl.float32)  # Σ_d v²
        vw = tl.zeros([NP], dtype=tl.float32)  # v · w
        for d0 in range(0, D, BD):
            dc = d0 + tl.arange(0, BD)
            dmask = dc < D
            w = tl.load(w_ptr + dc, mask=dmask, other=0.0)
            v = tl.load(rows[:, None] + dc[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(v * v, 1)
            vw += tl.sum(v * w[None, :], 1)
        rstd = 1.0 / tl.sqrt(ss / D + eps)
        s = tl.where(nmask, vw * rstd, float("-inf"))
        p = tl.exp(s - tl.max(s, 0))
        alpha = p / tl.sum(p, 0)
        tl.store(alpha_ptr + scol + r, alpha, mask=nmask)
        tl.store(rstd_ptr + scol + r, rstd, mask=nmask)
        for d0 in range(0, D, BD):
            dc = d0 + tl.arange(0, BD)
            dmask = dc < D
            v = tl.load(rows[:, None] + dc[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            h = tl.sum(alpha[:, None] * v, 0)
            tl.store(h_ptr + roff + dc, h.to(h_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def attn_res_bwd_kernel(src_tab, dv_tab, dh_ptr, w_ptr, alpha_ptr, rstd_ptr, dwp_ptr, R, D, N, rows_per_prog,
                        BD: tl.constexpr, NP: tl.constexpr, HAS_DW: tl.constexpr):
    """Rows [pid*rows_per_prog, ...): dv_i [R, D] through dv_tab (entry 0: no gradient for that source) and,
    with HAS_DW, these rows' Σ_r Σ_i c_i v_i added into row pid of dwp [programs, D] fp32 (zeroed by the
    caller; read-modify-write by this program only)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, NP)
    nmask = cols < N
    srcs = _tables(src_tab, cols, nmask, dh_ptr)
    dvs = _tables(dv_tab, cols, nmask, dh_ptr)
    gmask = nmask & (dvs.to(tl.int64) != 0)
    scol = cols.to(tl.int64) * R
    r0 = pid.to(tl.int64) * rows_per_prog  # int64 row index: r * D may exceed 2**31
    for r in range(r0, tl.minimum(r0 + rows_per_prog, R)):
        roff = r * D
        rows = srcs + roff
        da = tl.zeros([NP], dtype=tl.float32)  # dh · v
        vw = tl.zeros([NP], dtype=tl.float32)  # v · w
        for d0 in range(0, D, BD):
            dc = d0 + tl.arange(0, BD)
            dmask = dc < D
            w = tl.load(w_ptr + dc, mask=dmask, other=0.0)
            dh = tl.load(dh_ptr + roff + dc, mask=dmask, other=0.0).to(tl.float32)
            v = tl.load(rows[:, None] + dc[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            da += tl.sum(v * dh[None, :], 1)
            vw += tl.sum(v * w[None, :], 1)
        alpha = tl.load(alpha_ptr + scol + r, mask=nmask, other=0.0)
        rstd = tl.load(rstd_ptr + scol + r, mask=nmask, other=0.0)
        c = alpha * (da - tl.sum(alpha * da, 0)) * rstd  # ds_i · rstd_i
        e = c * vw * rstd * rstd / D  # ds_i · rstd_i · s_i · rstd_i / D
        for d0 in range(0, D, BD):
            dc = d0 + tl.arange(0, BD)
            dmask = dc < D
            w = tl.load(w_ptr + dc, mask=dmask, other=0.0)
            dh = tl.load(dh_ptr + roff + dc, mask=dmask, other=0.0).to(tl.float32)
            v = tl.load(rows[:, None] + dc[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            dv = alpha[:, None] * dh[None, :] + c[:, None] * w[None, :] - e[:, None] * v
            tl.store((dvs + roff)[:, None] + dc[None, :], dv.to(dh_ptr.dtype.element_ty),
                     mask=gmask[:, None] & dmask[None, :])
            if HAS_DW:
                dwp = dwp_ptr + pid.to(tl.int64) * D + dc
                tl.debug_barrier()  # the previous row's store of this tile, by any thread, is visible
                tl.store(dwp, tl.load(dwp, mask=dmask, other=0.0) + tl.sum(c[:, None] * v, 0), mask=dmask)


def _table(ptrs: list[int], device: torch.device) -> torch.Tensor:
    """int64 [N] pointer table on `device`: staged through pinned memory and copied without a host sync."""
    t = torch.tensor(ptrs, dtype=torch.int64)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


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


def _tile(N: int, D: int, block_d: int | None) -> tuple[int, int]:
    """(NP, BD): N padded to a power of two, and the D tile so that an [NP, BD] tile holds ~TILE_ELEMS."""
    NP = max(2, triton.next_power_of_2(N))
    return NP, block_d or min(1024, max(128, TILE_ELEMS // NP), max(16, triton.next_power_of_2(D)))


_RESIDENT: dict = {}


def _resident_programs(kernel, args, kw, num_warps, device) -> int:
    """How many programs of this compiled kernel fit on the GPU at once (SMs x per-SM occupancy from its
    registers, shared memory and warps): the backward's persistent grid, one wave, no tail."""
    key = (kernel, device.index, num_warps, tuple(sorted(kw.items())), args[2].dtype)
    if key not in _RESIDENT:
        props = torch.cuda.get_device_properties(device)
        try:  # the compiled kernel's resources (Triton's `warmup` + `_init_handles`, as in its tutorials)
            k = kernel.warmup(*args, grid=(1,), num_warps=num_warps, **kw)
            k._init_handles()
            regs_per_warp = -(-max(k.n_regs, 1) * 32 // 256) * 256  # allocated per warp in units of 256
            by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
            by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (k.metadata.shared + 1024)
            by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
            per_sm = max(1, min(by_regs, by_smem, by_warps, 32))
        except Exception:  # another Triton's internals: a safe guess (<= 128 registers at 4 warps fit 4)
            per_sm = 4
        _RESIDENT[key] = props.multi_processor_count * per_sm
    return _RESIDENT[key]


def attn_res_fwd_triton(flat: list[torch.Tensor], w: torch.Tensor, eps: float, block_d: int | None = None,
                        programs: int | None = None, num_warps: int = NUM_WARPS):
    """flat: N contiguous [R, D] sources of one dtype; w: [D] (used in fp32). Returns h [R, D] in the sources'
    dtype, alpha and rstd [N, R] fp32. Launch settings: block_d (D tile), programs (default R / FWD_ROWS),
    num_warps."""
    R, D = flat[0].shape
    N, dev = len(flat), flat[0].device
    h = torch.empty(R, D, dtype=flat[0].dtype, device=dev)
    alpha = torch.empty(N, R, dtype=torch.float32, device=dev)
    rstd = torch.empty(N, R, dtype=torch.float32, device=dev)
    if R == 0:
        return h, alpha, rstd
    NP, BD = _tile(N, D, block_d)
    rows = triton.cdiv(R, max(1, min(programs or triton.cdiv(R, FWD_ROWS), R)))
    tab = _table([t.data_ptr() for t in flat], dev)
    attn_res_fwd_kernel[(triton.cdiv(R, rows),)](tab, w.float().contiguous(), h, alpha, rstd, R, D, N, rows,
                                                  float(eps), BD=BD, NP=NP, num_warps=num_warps)
    return h, alpha, rstd


def attn_res_bwd_triton(flat: list[torch.Tensor], w: torch.Tensor, alpha: torch.Tensor, rstd: torch.Tensor,
                        dh: torch.Tensor, need: list[bool], need_w: bool, block_d: int | None = None,
                        programs: int | None = None, num_warps: int = NUM_WARPS):
    """Gradients of attn_res_fwd_triton given dh [R, D]: dv_i [R, D] where need[i] (else None) and dw fp32 [D]
    when need_w (else None), the sum over programs of their partial rows (deterministic for a given grid).
    programs: default, as many as are resident at once on CUDA (4 under the interpreter)."""
    R, D = flat[0].shape
    N, dev = len(flat), flat[0].device
    dh = dh.to(flat[0].dtype).contiguous()
    dvs = [torch.empty_like(t) if need[i] else None for i, t in enumerate(flat)]
    if R == 0:
        return dvs, (torch.zeros(D, device=dev) if need_w else None)
    NP, BD = _tile(N, D, block_d)
    tab = _table([t.data_ptr() for t in flat] + [0 if g is None else g.data_ptr() for g in dvs], dev)
    w = w.float().contiguous()
    kw = dict(BD=BD, NP=NP, HAS_DW=need_w)
    if programs is None:
        programs = 4
        if dev.type == "cuda":
            probe = (tab, tab[N:], dh, w, alpha, rstd, alpha if need_w else None, R, D, N, 3)  # 3: unspecialised
            programs = _resident_programs(attn_res_bwd_kernel, probe, kw, num_warps, dev)
    rows = triton.cdiv(R, max(1, min(programs, R)))
    G = triton.cdiv(R, rows)
    dwp = torch.zeros(G, D, dtype=torch.float32, device=dev) if need_w else None
    attn_res_bwd_kernel[(G,)](tab, tab[N:], dh, w, alpha, rstd, dwp, R, D, N, rows, num_warps=num_warps, **kw)
    return dvs, (dwp.sum(0) if need_w else None)
