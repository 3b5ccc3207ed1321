"""`l2_prefetch`'s kernel (see `l2_prefetch.py`): program q asks the TMA unit for bytes [q·SPAN, (q+1)·SPAN) of
one allocation in L2 (`cp.async.bulk.prefetch.L2.global`, sm_90+; thread 0 of the program issues it)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def l2_prefetch_kernel(addr, nbytes, SPAN: tl.constexpr):
    """addr, nbytes: 16-byte aligned start and a multiple of 16 (`prefetch_bytes` rounds them)."""
    start = tl.program_id(0).to(tl.int64) * SPAN
    n = tl.minimum(nbytes - start, SPAN).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr + start, n], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_bytes(addr: int, nbytes: int, span: int) -> None:
    """Launch the prefetch of [addr, addr + nbytes) on the current stream, widened to 16-byte bounds (within the
    allocation: the caching allocator rounds blocks to 512 bytes)."""
    lo, hi = addr & ~15, (addr + nbytes + 15) & ~15
    if hi > lo:
        l2_prefetch_kernel[(triton.cdiv(hi - lo, span),)](lo, hi - lo, SPAN=span, num_warps=1)
