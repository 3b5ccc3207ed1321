"""`l2_prefetch`'s kernel (see `l2_prefetch.py`): program q asks the TMA unit for bytes [q·SPAN, (q+1)·SPAN) of
one allocation in L2 (`cp.async.bulk.prefetch.L2.global`, sm_90+; thread 0 of the program issues it)."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_jit import prefetch_l2


@triton.jit
def l2_prefetch_kernel(addr, nbytes, SPAN: tl.constexpr):
    """addr, nbytes: 16-byte aligned start and a multiple of 16 (`prefetch_bytes` rounds them)."""
    start = tl.program_id(0).to(tl.int64) * SPAN
    prefetch_l2(addr + start, tl.minimum(nbytes - start, SPAN).to(tl.int32))


def prefetch_bytes(addr: int, nbytes: int, span: int) -> None:
    """Launch the prefetch of [addr, addr + nbytes) on the current stream, widened to 16-byte bounds (within the
    allocation: the caching allocator rounds blocks to 512 bytes)."""
    lo, hi = addr & ~15, (addr + nbytes + 15) & ~15
    if hi > lo:
        l2_prefetch_kernel[(triton.cdiv(hi - lo, span),)](lo, hi - lo, SPAN=span, num_warps=1)
