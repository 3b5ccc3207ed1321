"""The serving engine's decode short conv as one Triton kernel: the new tokens of each sequence (one in a decode
step, a few in a captured extend step) against its conv window in a pool slot, window advanced in place (the
PyTorch form in `short_conv_step` takes ~10 kernels). Decode steps take `short_conv_step_kernel` (one token per
sequence); extend steps `short_conv_extend_kernel` (tiles of tokens in parallel); prefill chunks
`short_conv_tiles_kernel` (one program per tile) and the extend kernel's window update."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import CONV_TILE  # tokens per tile of the tiles kernel
from .._triton import pdl
from .._triton_jit import pdl_sync

# channels per program and warps of `short_conv_tiles_kernel` (`benchmarks/probe/prefill_kernels.py`, H200, 8,192
# tokens x 4,608 channels bf16: 64 / 2 warps 191 us, 64 / 4 264 us, 128 / 4 226 us, 256 / 4 277 us)
# skip: tiles that no tap of which reaches the window skip its loads (False: every tile gathers them, the former
# kernel, kept for the probe's before/after)
TILES_LAUNCH = {"bc": 64, "warps": 2, "skip": True}
# `short_conv_extend_kernel`: channels per program, tokens per tile, warps, and the most parts a sequence's tiles
# are dealt to (`extend_parts`; 1: one program walks all its tiles, the former kernel). `probe/kda_small.py` (H200,
# 2026-12-04, a 64-token tail over 4,608 channels, 48 settings): 32 / 16 / 4 warps / 8 parts 3.12 µs against 4.65
# for the former 64 channels / 32 tokens / one part
EXTEND_LAUNCH = {"bc": 32, "bt": 16, "warps": 4, "parts": 8}


def extend_parts(N: int, n: int) -> int:
    """Parts (programs per sequence and channel block) of an extend step of N rows over n sequences: enough for
    the mean sequence's tiles, at most EXTEND_LAUNCH["parts"] (a 64-token hit tail: 4 tiles of 16, 4 parts)."""
    bt = EXTEND_LAUNCH["bt"]
    return max(1, min(EXTEND_LAUNCH["parts"], triton.cdiv(N, bt * max(1, n))))



@triton.jit
def short_conv_step_kernel(x_ptr, w_ptr, win_ptr, slot_ptr, y_ptr, C, sx, s_slot,
                           W1: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
    """Program (n, channel block): the one new token x of sequence n, y = silu(Σ_j w[:, j]·win[:, j] + w[:, W1]·x)
    in fp32, then win ← (win[:, 1:], x) written back to slot[n]."""
    pdl_sync(PDL)
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, WP)
    cm = c < C
    tap = cm[:, None] & (j[None, :] < W1)
    base = win_ptr + tl.load(slot_ptr + n).to(tl.int64) * s_slot + c[:, None] * W1 + j[None, :]
    win = tl.load(base, mask=tap, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c[:, None] * (W1 + 1) + j[None, :], mask=tap, other=0.0).to(tl.float32)
    wl = tl.load(w_ptr + c * (W1 + 1) + W1, mask=cm, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + n * sx + c, mask=cm, other=0.0).to(tl.float32)
    a = tl.sum(win * w, axis=1) + xv * wl
    tl.store(y_ptr + n * C + c, (a * tl.sigmoid(a)).to(y_ptr.dtype.element_ty), mask=cm)
    # shift[i, j] = (i == j + 1): win @ shift moves every column one step left (register-only)
    shift = (j[:, None] == j[None, :] + 1).to(tl.float32)
    win = tl.where(j[None, :] == W1 - 1, xv[:, None], tl.sum(win[:, :, None] * shift[None, :, :], axis=1))
    tl.debug_barrier()  # every thread has read the window before the slot is rewritten
    tl.store(base, win.to(win_ptr.dtype.element_ty), mask=tap)


@triton.jit
def _conv_tile(x_ptr, w_ptr, y_ptr, wbase, t0, bos, eos, c, cm, C, sx, W1: tl.constexpr, BT: tl.constexpr,
               zero_end=0, WIN: tl.constexpr = True):
    """Tokens t0 .. t0 + BT (below eos) of the sequence starting at bos, channels c, all in parallel: token t's tap
    at distance d reads x[t - d] inside the sequence, else window column W1 - (bos - (t - d)) (window rows `wbase`);
    y = silu(conv) in fp32. Rows eos .. zero_end (padding after the last sequence) get y = 0.
    WIN=False: the caller knows t0 - W1 >= bos (no tap reaches the window): x loads only, no window gathers (the
    strided window addresses and their masks cost more instructions per element than the rest of the tile)."""
    t = t0 + tl.arange(0, BT)
    tm = (t < eos)[:, None] & cm[None, :]
    sm = (t < tl.maximum(eos, zero_end))[:, None] & cm[None, :]
    wl = tl.load(w_ptr + c * (W1 + 1) + W1, mask=cm, other=0.0).to(tl.float32)
    a = tl.load(x_ptr + t[:, None] * sx + c[None, :], mask=tm, other=0.0).to(tl.float32) * wl[None, :]
    for d in tl.static_range(1, W1 + 1):
        s = t - d
        if WIN:
            inx = (s >= bos)[:, None]
            v = tl.load(x_ptr + s[:, None] * sx + c[None, :], mask=tm & inx, other=0.0).to(tl.float32) \
                + tl.load(wbase[None, :] + (W1 + s - bos)[:, None], mask=tm & (s < bos)[:, None],
                          other=0.0).to(tl.float32)
        else:
            v = tl.load(x_ptr + s[:, None] * sx + c[None, :], mask=tm, other=0.0).to(tl.float32)
        a += v * tl.load(w_ptr + c * (W1 + 1) + (W1 - d), mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + t[:, None] * C + c[None, :], (a * tl.sigmoid(a)).to(y_ptr.dtype.element_ty), mask=sm)


@triton.jit
def short_conv_tiles_kernel(x_ptr, w_ptr, win_ptr, slot_ptr, cu_ptr, tile_ptr, y_ptr, C, sx, s_slot, NSEQ, N,
                            W1: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SKIP: tl.constexpr = True):
    """Program (tile, channel block) of a prefill: tile = (sequence n, first token t0), BT tokens of sequence n, in
    parallel with every other tile (a long prompt is many programs); windows only read (`short_conv_extend_kernel`
    with CONV=False advances them afterwards). The last sequence's tiles also zero the rows after it up to N (a
    captured prefill's padding)."""
    n = tl.load(tile_ptr + 2 * tl.program_id(0))
    t0 = tl.load(tile_ptr + 2 * tl.program_id(0) + 1)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    wbase = win_ptr + tl.load(slot_ptr + n).to(tl.int64) * s_slot + c * W1
    zero_end = tl.where(n == NSEQ - 1, N, 0)
    if SKIP and t0 - W1 >= bos:  # every tile but a sequence's first: no tap reaches the window
        _conv_tile(x_ptr, w_ptr, y_ptr, wbase, t0, bos, eos, c, cm, C, sx, W1, BT, zero_end, WIN=False)
    else:
        _conv_tile(x_ptr, w_ptr, y_ptr, wbase, t0, bos, eos, c, cm, C, sx, W1, BT, zero_end)


@triton.jit
def short_conv_extend_kernel(x_ptr, w_ptr, win_ptr, slot_ptr, cu_ptr, y_ptr, C, sx, s_slot, N,
                             W1: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                             CONV: tl.constexpr):
    """Program (n, channel block, part s of S = the grid's third size), several tokens per sequence (an extend
    step): the tiles of BT tokens t0 = bos + s·BT, bos + (s + S)·BT, ... of sequence n, each all in parallel
    (`_conv_tile`; only the first tile's taps reach the window), then part 0 alone, after its own tiles, makes
    the window the last W1 inputs of (window ‖ tokens): the only program that reads or writes the window. No
    loop-carried chain through the tokens (the decode kernel above steps one token at a time), and a 64-token tail
    is S programs per channel block, not one walking its tiles in turn. With CONV, the last sequence's programs
    also store y = 0 in the rows after it up to N (a captured step's padding: no zero-filled output first).
    CONV=False: only the window update (after `short_conv_tiles_kernel`, which zeroes the padding itself)."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    part = tl.program_id(2)
    S = tl.num_programs(2)
    cm = c < C
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    wbase = win_ptr + tl.load(slot_ptr + n).to(tl.int64) * s_slot + c * W1  # [BC]: this slot's window rows
    if CONV:
        for t0 in range(bos + part * BT, eos, S * BT):
            if t0 - W1 >= bos:  # no tap reaches the window
                _conv_tile(x_ptr, w_ptr, y_ptr, wbase, t0, bos, eos, c, cm, C, sx, W1, BT, WIN=False)
            else:
                _conv_tile(x_ptr, w_ptr, y_ptr, wbase, t0, bos, eos, c, cm, C, sx, W1, BT)
        if n == tl.num_programs(0) - 1:
            for t0 in range(eos + part * BT, N, S * BT):
                t = t0 + tl.arange(0, BT)
                tl.store(y_ptr + t[:, None] * C + c[None, :], tl.zeros([BT, BC], y_ptr.dtype.element_ty),
                         mask=(t < N)[:, None] & cm[None, :])
    if part == 0:
        i = tl.arange(0, WP)
        p = eos - W1 + i  # the new window's column i holds position p
        im = cm[:, None] & (i < W1)[None, :]
        nx = (p >= bos)[None, :]
        new = tl.load(x_ptr + p[None, :] * sx + c[:, None], mask=im & nx, other=0.0).to(win_ptr.dtype.element_ty) \
            + tl.load(wbase[:, None] + (W1 + p - bos)[None, :], mask=im & (p < bos)[None, :], other=0.0)
        tl.debug_barrier()  # every read of the old window (token taps and the new window) before it is rewritten
        tl.store(wbase[:, None] + i[None, :], new, mask=im)


def short_conv_step_triton(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
                           slots: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                           tiles: torch.Tensor | None = None) -> torch.Tensor:
    """`k3.ops.conv.short_conv_step` (shapes checked there): x [N, C] (rows may be strided), weight [C, 1, W],
    windows [P, C, W-1] with contiguous slots (the pool's per-layer view), slots [n] distinct; cu_seqlens [n + 1]
    the tokens of each sequence (None: one each). Rows of x outside every sequence get y = 0 (with tiles, the rows
    after the last sequence must lie in its tiles: a prefill chunk and its padding). tiles (int [NT, 2],
    `conv_tiles`: (sequence, first token) of every `CONV_TILE`-token tile): the conv runs one program per tile
    and channel block (prefill chunks: a long sequence is many programs), then the windows advance."""
    N, C = x.shape
    W1 = weight.shape[-1] - 1
    if x.stride(1) != 1:
        x = x.contiguous()
    if windows[0].stride() != (W1, 1):
        raise ValueError(f"short_conv_step: each window slot must be contiguous [C, W-1], strides {windows.stride()}")
    n = N if cu_seqlens is None else cu_seqlens.numel() - 1
    # rows outside every sequence (a captured step's padding) get 0: the last sequence's programs write them
    y = (torch.empty if n else torch.zeros)(N, C, dtype=x.dtype, device=x.device)
    w = weight.reshape(C, W1 + 1).contiguous()  # in its own dtype: the kernels upcast each tap (no kernel per call)
    WP = max(2, triton.next_power_of_2(W1))
    if cu_seqlens is None:  # decode: one token per sequence
        BC = 128
        short_conv_step_kernel[(n, triton.cdiv(C, BC))](x, w, windows, slots.contiguous(), y, C, x.stride(0),
                                                        windows.stride(0), W1=W1, WP=WP, BC=BC, num_warps=4,
                                                        **pdl(y))
        return y
    BC = EXTEND_LAUNCH["bc"]  # narrow: more programs (an extend step often holds one or two sequences)
    slots, cu = slots.contiguous(), cu_seqlens.contiguous()
    if tiles is not None and tiles.shape[0]:
        bc = TILES_LAUNCH["bc"]
        short_conv_tiles_kernel[(tiles.shape[0], triton.cdiv(C, bc))](x, w, windows, slots, cu, tiles.contiguous(),
                                                                       y, C, x.stride(0), windows.stride(0), n, N,
                                                                       W1=W1,
                                                                       BT=CONV_TILE, BC=bc,
                                                                       SKIP=TILES_LAUNCH["skip"],
                                                                       num_warps=TILES_LAUNCH["warps"])
    bt = EXTEND_LAUNCH["bt"]
    parts = 1 if tiles is not None or bt < W1 else extend_parts(N, n)  # bt >= W1: only a first tile reads windows
    short_conv_extend_kernel[(n, triton.cdiv(C, BC), parts)](x, w, windows, slots, cu, y, C, x.stride(0),
                                                             windows.stride(0), N, W1=W1, WP=WP, BT=bt, BC=BC,
                                                             CONV=tiles is None, num_warps=EXTEND_LAUNCH["warps"])
    return y

