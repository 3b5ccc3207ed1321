"""Short convolution (depthwise, causal, width <= 4) + SiLU as Triton kernels, forward and backward.

Training path only (no conv state): x [N, C] flattened tokens, their positions in their documents (or rows),
fp32 weight [C, 4] (narrower kernels are zero-padded on the left, i.e. at the oldest taps).
Arithmetic is fp32 whatever the storage dtype (the reference computes in x's dtype: bf16-level differences).

Tap j of token t reads x[t - j] with weight w[:, 3 - j], and exists iff j <= pos[t] (its position in its
document, or in its row without documents).

Forward: one [BT tokens, BC channels] tile per program, reading x[t-3 .. t] as four shifted tiles; it stores only
y = silu(conv(x)).

Backward (bandwidth-bound: x and dy read once, dx written once): with a[t] the pre-activation and
d[t] = dy[t] · silu'(a[t]),
    dx[s] = sum_j [j <= pos[s+j]] · w[3-j] · d[s+j],     dw[3-j] = sum_t [j <= pos[t]] · d[t] · x[t-j].
Each program owns BT consecutive tokens of one BC-channel block and streams through them one token at a time,
carrying x[t-1 .. t-3] and the partial sums of dx[t-1 .. t-3] in registers: token t's d completes dx[t-3].
So no token's d is computed twice and nothing is shifted across threads; the only re-reads are a halo of
3 tokens on each side (x before, x and dy after). Tokens go in groups of 4; the next one or two groups are
loaded while one is computed (explicit prefetch: memory-level parallelism without relying on the compiler's
pipeliner).
One launch covers up to three channel segments (q, k, v: each with its own dy tensor) and writes dx and
per-program partial weight gradients [programs, 4, C] (fp32), summed afterwards in a fixed order
(deterministic).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._triton import interpreted as _interpreted

from ..varlen import positions_in_doc

WMAX = 4  # kernel width handled by the kernels (the model's short_conv_kernel_size)
MAXSEG = 3  # channel segments (separate dy tensors) per backward launch; more take several launches

# Launch settings (env-overridable; `benchmarks/kda_layer.py --sweep` times alternatives on the GPU).
#   key        env var             default  meaning
#   fwd_bt     K3_CONV_FWD_BT      16       forward: tokens per tile
#   fwd_bc     K3_CONV_FWD_BC      128      forward: channels per tile
#   fwd_warps  K3_CONV_FWD_WARPS   4        forward: warps per program
#   bwd_bt     K3_CONV_BWD_BT      256      backward: tokens per program (a multiple of 4), streamed
#   bwd_bc     K3_CONV_BWD_BC      64       backward: channels per program (a power of 2)
#   bwd_warps  K3_CONV_BWD_WARPS   1        backward: warps per program (bwd_bc / (32 · warps) channels a thread)
#   bwd_ahead  K3_CONV_BWD_AHEAD   2        backward: groups of 4 tokens loaded ahead of the one computed (1, 2)
#   bwd_cfast  K3_CONV_BWD_CFAST   1        backward: 1 = channel blocks are the grid's fast axis (programs that
#                                           run together read whole rows), 0 = token blocks are
# sm_90 registers (Triton 3.6, bf16, k3-small strides, ptxas -v; no spills): forward 66; backward 80 at the
# defaults (2 channels a thread: 25 warps an SM, 2 KB of loads in flight each), 72 with bwd_ahead 1; with 4
# channels a thread 144 (bwd_ahead 1). SASS of the backward's loop: ~62 instructions per element, 40 of them
# arithmetic (the H200 issues ~55 an element in the time it moves x, dy and dx at 3.6 TB/s).
CFG = {
    "fwd_bt": int(os.environ.get("K3_CONV_FWD_BT", "16")),
    "fwd_bc": int(os.environ.get("K3_CONV_FWD_BC", "128")),
    "fwd_warps": int(os.environ.get("K3_CONV_FWD_WARPS", "4")),
    "bwd_bt": int(os.environ.get("K3_CONV_BWD_BT", "256")),
    "bwd_bc": int(os.environ.get("K3_CONV_BWD_BC", "64")),
    "bwd_warps": int(os.environ.get("K3_CONV_BWD_WARPS", "1")),
    "bwd_ahead": int(os.environ.get("K3_CONV_BWD_AHEAD", "1")),  # sweep on the H200: 0.695 ms vs 0.776 ms (2)
    "bwd_cfast": int(os.environ.get("K3_CONV_BWD_CFAST", "1")),
}


@triton.jit
def _pos(pos_ptr, u, N):
    """Position of tokens u [BT] in their document (or row), as a column [BT, 1]; -1 past the last token."""
    return tl.load(pos_ptr + u, mask=u < N, other=-1)[:, None]


@triton.jit
def _rows(ptr, u, cols, N, C, stride):
    """Rows u [BT] x columns `cols` of a [N, C] matrix (row stride `stride`) in fp32; 0 outside."""
    m = ((u >= 0) & (u < N))[:, None] & (cols < C)[None, :]
    off = u.to(tl.int64)[:, None] * stride + cols[None, :]
    return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _wcol(w_ptr, cols, C, k):
    """Column k of the [C, 4] fp32 weight, as a [1, BC] row."""
    return tl.load(w_ptr + cols * 4 + k, mask=cols < C, other=0.0)[None, :]


@triton.jit
def _pre(xa, xb, xc, xd, p, w0, w1, w2, w3):
    """Pre-activation of a token whose inputs x[t], x[t-1], x[t-2], x[t-3] are xa..xd, at position p."""
    a = w3 * xa
    a += tl.where(p >= 1, w2 * xb, 0.0)
    a += tl.where(p >= 2, w1 * xc, 0.0)
    a += tl.where(p >= 3, w0 * xd, 0.0)
    return a


@triton.jit
def short_conv_fwd_kernel(x_ptr, w_ptr, pos_ptr, y_ptr, N, C, sx, sy, BT: tl.constexpr, BC: tl.constexpr):
    """y = silu(conv(x)) for one [BT tokens, BC channels] tile."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    p = _pos(pos_ptr, t, N)
    w0 = _wcol(w_ptr, cols, C, 0)
    w1 = _wcol(w_ptr, cols, C, 1)
    w2 = _wcol(w_ptr, cols, C, 2)
    w3 = _wcol(w_ptr, cols, C, 3)
    a = _pre(_rows(x_ptr, t, cols, N, C, sx), _rows(x_ptr, t - 1, cols, N, C, sx),
             _rows(x_ptr, t - 2, cols, N, C, sx), _rows(x_ptr, t - 3, cols, N, C, sx), p, w0, w1, w2, w3)
    y = a * tl.sigmoid(a)
    m = (t < N)[:, None] & (cols < C)[None, :]
    tl.store(y_ptr + t.to(tl.int64)[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _segment(blk, BC: tl.constexpr, p0, p1, p2, s0, s1, s2, col0, col1, col2, c0, c1, c2):
    """Channel block `blk` of a launch over up to three segments (blocks numbered segment after segment):
    its segment's dy pointer and row stride, first column in x, width, and the block's index in the segment."""
    nb0 = tl.cdiv(c0, BC)
    nb1 = tl.cdiv(c1, BC)
    p = p0
    s = s0
    col = col0
    c = c0
    b = blk
    if blk >= nb0:
        p = p1
        s = s1
        col = col1
        c = c1
        b = blk - nb0
    if blk >= nb0 + nb1:
        p = p2
        s = s2
        col = col2
        c = c2
        b = blk - nb0 - nb1
    return p, s, col, c, b


@triton.jit
def _fetch(x_ptr, dy_ptr, pos_ptr, t, sx, sdy, cols, dcols, cs, N):
    """x[t], dy[t] (storage dtype, 0 past the end) and pos[t] (-1 past the end) of one token t >= 0.
    (Row conditions are folded into the column bound: one compare per element, and the interpreter rejects
    `tensor & scalar` masks.)"""
    ok = t < N
    m = dcols < tl.where(ok, cs, 0)
    r = tl.cast(t, tl.int64)
    x = tl.load(x_ptr + r * sx + cols, mask=m, other=0.0)
    g = tl.load(dy_ptr + r * sdy + dcols, mask=m, other=0.0)
    p = tl.load(pos_ptr + t, mask=ok, other=-1)
    return x, g, p


@triton.jit
def _fetch4(x_ptr, dy_ptr, pos_ptr, t, sx, sdy, cols, dcols, cs, N):
    """_fetch of tokens t .. t+3."""
    xa, ga, pa = _fetch(x_ptr, dy_ptr, pos_ptr, t, sx, sdy, cols, dcols, cs, N)
    xb, gb, pb = _fetch(x_ptr, dy_ptr, pos_ptr, t + 1, sx, sdy, cols, dcols, cs, N)
    xc, gc, pc = _fetch(x_ptr, dy_ptr, pos_ptr, t + 2, sx, sdy, cols, dcols, cs, N)
    xd, gd, pd = _fetch(x_ptr, dy_ptr, pos_ptr, t + 3, sx, sdy, cols, dcols, cs, N)
    return xa, ga, pa, xb, gb, pb, xc, gc, pc, xd, gd, pd


@triton.jit
def _bwd_token(t, t0, x, g, p, xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3, w0, w1, w2, w3,
               dx_ptr, sdx, cols, dcols, cs, N, OWN: tl.constexpr):
    """Token t (input x, upstream gradient g, position p; xm1..xm3 = x[t-1..t-3] in fp32, r1..r3 = the partial
    sums of dx[t-1..t-3]): stores the now complete dx[t-3] (if it is one of this program's tokens), adds t's
    weight-gradient terms if t is this program's (OWN), and returns the state shifted by one token.
    Tap j exists iff p >= j: its 0/1 factor fj is a per-token scalar (one multiply, no per-lane select)."""
    xf = x.to(tl.float32)
    f1 = (p >= 1).to(tl.float32)
    f2 = (p >= 2).to(tl.float32)
    f3 = (p >= 3).to(tl.float32)
    x1 = xm1 * f1  # the inputs token t reads through taps 1..3
    x2 = xm2 * f2
    x3 = xm3 * f3
    a = w3 * xf + w2 * x1 + w1 * x2 + w0 * x3
    s = tl.sigmoid(a)
    d = g.to(tl.float32) * s * (1.0 + a * (1.0 - s))  # dL/da = dy · silu'(a)
    u = t - 3
    tl.store(dx_ptr + tl.cast(u, tl.int64) * sdx + cols, (r3 + w0 * (d * f3)).to(dx_ptr.dtype.element_ty),
             mask=dcols < tl.where((u >= t0) & (u < N), cs, 0))
    if OWN:
        dw3 += d * xf
        dw2 += d * x1
        dw1 += d * x2
        dw0 += d * x3
    return xf, xm1, xm2, w3 * d, r1 + w2 * (d * f1), r2 + w1 * (d * f2), dw0, dw1, dw2, dw3


@triton.jit
def _bwd_group(t, t0, xa, ga, pa, xb, gb, pb, xc, gc, pc, xd, gd, pd, xm1, xm2, xm3, r1, r2, r3,
               dw0, dw1, dw2, dw3, w0, w1, w2, w3, dx_ptr, sdx, cols, dcols, cs, N, OWN: tl.constexpr,
               K: tl.constexpr):
    """_bwd_token over tokens t .. t+K-1 (K = 3 or 4) fetched by _fetch4; returns the state after them."""
    xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3 = _bwd_token(
        t, t0, xa, ga, pa, xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, dx_ptr, sdx, cols,
        dcols, cs, N, OWN)
    xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3 = _bwd_token(
        t + 1, t0, xb, gb, pb, xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, dx_ptr, sdx, cols,
        dcols, cs, N, OWN)
    xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3 = _bwd_token(
        t + 2, t0, xc, gc, pc, xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, dx_ptr, sdx, cols,
        dcols, cs, N, OWN)
    if K == 4:
        xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3 = _bwd_token(
            t + 3, t0, xd, gd, pd, xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, dx_ptr, sdx,
            cols, dcols, cs, N, OWN)
    return xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3


@triton.jit
def short_conv_bwd_kernel(x_ptr, w_ptr, pos_ptr, dx_ptr, dw_ptr, dy0_ptr, dy1_ptr, dy2_ptr,
                          N, C, sx, sdx, sdy0, sdy1, sdy2, col0, col1, col2, c0, c1, c2,
                          BT: tl.constexpr, BC: tl.constexpr, AHEAD: tl.constexpr, CFAST: tl.constexpr):
    """dx for tokens [BT·i, BT·i + BT) of one BC-channel block, streamed token by token, and the program's partial
    weight gradient [4, BC] (fp32) into dw[i, :, columns]. Program (block, i) if CFAST (the programs running
    together then read whole rows), else (i, block). Groups of 4 tokens; AHEAD (1 or 2) groups are in flight
    while one is computed."""
    tl.static_assert(BT % 4 == 0, "tokens per backward program must be a multiple of 4")
    tl.static_assert((AHEAD == 1) | (AHEAD == 2), "AHEAD must be 1 or 2")
    if CFAST:
        pid_c = tl.program_id(0)
        pid_t = tl.program_id(1)
    else:
        pid_t = tl.program_id(0)
        pid_c = tl.program_id(1)
    dy_ptr, sdy, col, cs, blk = _segment(pid_c, BC, dy0_ptr, dy1_ptr, dy2_ptr, sdy0, sdy1, sdy2,
                                         col0, col1, col2, c0, c1, c2)
    dcols = blk * BC + tl.arange(0, BC)  # columns of dy (its segment)
    cm = dcols < cs
    cols = col + dcols  # columns of x, dx, the weight and its gradient
    w0 = tl.load(w_ptr + cols * 4, mask=cm, other=0.0)
    w1 = tl.load(w_ptr + cols * 4 + 1, mask=cm, other=0.0)
    w2 = tl.load(w_ptr + cols * 4 + 2, mask=cm, other=0.0)
    w3 = tl.load(w_ptr + cols * 4 + 3, mask=cm, other=0.0)
    t0 = pid_t * BT
    # x[t0-1 .. t0-3]: read by this program's first tokens (0 before the first token: masked by pos anyway)
    xm1 = tl.load(x_ptr + (t0 - 1).to(tl.int64) * sx + cols, mask=dcols < tl.where(t0 >= 1, cs, 0),
                  other=0.0).to(tl.float32)
    xm2 = tl.load(x_ptr + (t0 - 2).to(tl.int64) * sx + cols, mask=dcols < tl.where(t0 >= 2, cs, 0),
                  other=0.0).to(tl.float32)
    xm3 = tl.load(x_ptr + (t0 - 3).to(tl.int64) * sx + cols, mask=dcols < tl.where(t0 >= 3, cs, 0),
                  other=0.0).to(tl.float32)
    r1 = tl.zeros([BC], dtype=tl.float32)
    r2 = tl.zeros([BC], dtype=tl.float32)
    r3 = tl.zeros([BC], dtype=tl.float32)
    dw0 = tl.zeros([BC], dtype=tl.float32)
    dw1 = tl.zeros([BC], dtype=tl.float32)
    dw2 = tl.zeros([BC], dtype=tl.float32)
    dw3 = tl.zeros([BC], dtype=tl.float32)
    # x, g (= dy), p (= pos) of tokens t .. t+3 (slots 0-3: being computed), t+4 .. t+7 (4-7: the next group,
    # loaded a round earlier when AHEAD == 2) and t+8 .. t+11 (8-11, AHEAD == 2)
    x0, g0, p0, x1, g1, p1, x2, g2, p2, x3, g3, p3 = _fetch4(x_ptr, dy_ptr, pos_ptr, t0, sx, sdy, cols, dcols,
                                                             cs, N)
    if AHEAD == 2:
        x4, g4, p4, x5, g5, p5, x6, g6, p6, x7, g7, p7 = _fetch4(x_ptr, dy_ptr, pos_ptr, t0 + 4, sx, sdy, cols,
                                                                 dcols, cs, N)
    for t in range(t0, t0 + BT, 4):
        # load ahead while this group computes (the loads past t0 + BT fetch the 3-token halo)
        if AHEAD == 2:
            x8, g8, p8, x9, g9, p9, x10, g10, p10, x11, g11, p11 = _fetch4(x_ptr, dy_ptr, pos_ptr, t + 8, sx, sdy,
                                                                           cols, dcols, cs, N)
        else:
            x4, g4, p4, x5, g5, p5, x6, g6, p6, x7, g7, p7 = _fetch4(x_ptr, dy_ptr, pos_ptr, t + 4, sx, sdy, cols,
                                                                     dcols, cs, N)
        xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3 = _bwd_group(
            t, t0, x0, g0, p0, x1, g1, p1, x2, g2, p2, x3, g3, p3, xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3,
            w0, w1, w2, w3, dx_ptr, sdx, cols, dcols, cs, N, True, 4)
        x0, g0, p0, x1, g1, p1, x2, g2, p2, x3, g3, p3 = x4, g4, p4, x5, g5, p5, x6, g6, p6, x7, g7, p7
        if AHEAD == 2:
            x4, g4, p4, x5, g5, p5, x6, g6, p6, x7, g7, p7 = x8, g8, p8, x9, g9, p9, x10, g10, p10, x11, g11, p11
    # halo: tokens t0+BT .. t0+BT+2 complete dx of this program's last three tokens (their dweight terms belong
    # to the next program)
    xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2, dw3 = _bwd_group(
        t0 + BT, t0, x0, g0, p0, x1, g1, p1, x2, g2, p2, x3, g3, p3, xm1, xm2, xm3, r1, r2, r3, dw0, dw1, dw2,
        dw3, w0, w1, w2, w3, dx_ptr, sdx, cols, dcols, cs, N, False, 3)
    base = dw_ptr + pid_t.to(tl.int64) * 4 * C + cols
    tl.store(base, dw0, mask=cm)
    tl.store(base + C, dw1, mask=cm)
    tl.store(base + 2 * C, dw2, mask=cm)
    tl.store(base + 3 * C, dw3, mask=cm)


def _launch_fwd(x2d, w4, pos, out):
    N, C = x2d.shape
    bt, bc = CFG["fwd_bt"], CFG["fwd_bc"]
    grid = (triton.cdiv(N, bt), triton.cdiv(C, bc))
    short_conv_fwd_kernel[grid](x2d, w4, pos, out, N, C, x2d.stride(0), out.stride(0), BT=bt, BC=bc,
                                num_warps=CFG["fwd_warps"])


def _launch_bwd(x2d, w4, pos, segs, dx):
    """dx (written in place) and the weight gradient [C, 4] fp32 for the channel segments `segs`:
    (first column, width, dy [N, width] with unit column stride) each; one launch per MAXSEG segments."""
    N, C = x2d.shape
    bt, bc, ahead, cfast = CFG["bwd_bt"], CFG["bwd_bc"], CFG["bwd_ahead"], bool(CFG["bwd_cfast"])
    if ahead not in (1, 2):
        raise ValueError(f"short conv: CFG['bwd_ahead'] must be 1 or 2, got {ahead}")
    if bt < 4 or bt % 4:
        raise ValueError(f"short conv: CFG['bwd_bt'] must be a positive multiple of 4, got {bt}")
    P = triton.cdiv(N, bt)
    if cfast and P > 65535:
        raise ValueError(f"short conv: {N} tokens make {P} token blocks of CFG['bwd_bt']={bt}, over the grid's 65535 "
                         "on its second axis: raise bwd_bt or set bwd_cfast=0")
    covered = sum(c for _, c, _ in segs)
    dwp = (torch.empty if covered == C else torch.zeros)(P, 4, C, device=x2d.device, dtype=torch.float32)
    for i in range(0, len(segs), MAXSEG):
        group = list(segs[i:i + MAXSEG])
        blocks = sum(triton.cdiv(c, bc) for _, c, _ in group)
        group += [(0, 0, group[0][2])] * (MAXSEG - len(group))  # unused slots: no blocks
        (o0, c0, d0), (o1, c1, d1), (o2, c2, d2) = group
        short_conv_bwd_kernel[(blocks, P) if cfast else (P, blocks)](
            x2d, w4, pos, dx, dwp, d0, d1, d2, N, C, x2d.stride(0), dx.stride(0), d0.stride(0), d1.stride(0),
            d2.stride(0), o0, o1, o2, c0, c1, c2, BT=bt, BC=bc, AHEAD=ahead, CFAST=cfast,
            num_warps=CFG["bwd_warps"])
    return dwp.sum(0).t()


class _ShortConv(torch.autograd.Function):
    """x2d [N, C], w4 [C, 4] fp32, pos int32 [N] -> one output [N, c_i] (contiguous) per segment."""

    @staticmethod
    def forward(ctx, x2d, w4, pos, sizes):
        N = x2d.shape[0]
        outs, off = [], 0
        for c in sizes:
            y = torch.empty(N, c, device=x2d.device, dtype=x2d.dtype)
            if N and c:
                _launch_fwd(x2d[:, off:off + c], w4[off:off + c], pos, y)
            outs.append(y)
            off += c
        ctx.save_for_backward(x2d, w4, pos)
        ctx.sizes = sizes
        ctx.set_materialize_grads(False)  # an unused segment's gradient arrives as None: no kernel work for it
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x2d, w4, pos = ctx.saved_tensors
        N, C = x2d.shape
        dx = torch.empty(N, C, device=x2d.device, dtype=x2d.dtype)
        segs, off = [], 0
        for c, dy in zip(ctx.sizes, dys):
            if dy is None or N == 0 or c == 0:
                dx[:, off:off + c] = 0
            else:
                dy = dy.to(x2d.dtype)
                segs.append((off, c, dy if dy.stride(-1) == 1 else dy.contiguous()))
            off += c
        dw = _launch_bwd(x2d, w4, pos, segs, dx) if segs else w4.new_zeros(C, 4)
        return dx, dw, None, None


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                      sizes: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """silu(causal depthwise conv(x)) on Triton; x [B, T, C] (fp32/bf16/fp16), weight [C, 1, W] with W <= 4.

    Without `cu_seqlens` the window stops at each row's start; with it (packed documents over the B·T
    tokens) at each document's start. Returns one tensor [B, T, c] per entry of `sizes` (channel segments
    of x, each contiguous; default: one segment of all C), in x's dtype; fp32 arithmetic. Differentiable
    for x and weight (dweight in weight's dtype).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    sizes = (C,) if sizes is None else tuple(int(s) for s in sizes)
    if sum(sizes) != C or any(s < 0 for s in sizes):
        raise ValueError(f"short_conv_triton: sizes must be non-negative and sum to C={C}, got {sizes}")
    if W > WMAX:
        raise ValueError(f"short_conv_triton: kernel width must be <= {WMAX}, got {W}")
    x2d = x.reshape(B * T, C)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    w4 = F.pad(weight.reshape(C, W).float(), (WMAX - W, 0)).contiguous()
    if cu_seqlens is not None:
        pos = positions_in_doc(cu_seqlens, B, T).reshape(-1).to(torch.int32)
    else:
        pos = torch.arange(B * T, device=x.device, dtype=torch.int32) % max(T, 1)
    outs = _ShortConv.apply(x2d, w4, pos, sizes)
    return tuple(y.view(B, T, y.shape[-1]) for y in outs)


def interpreted() -> bool:
    """True when the kernels were bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(short_conv_fwd_kernel)
