"""`@triton.jit` helpers shared by several kernel packages (imported only by their `triton` modules)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def token_range(cu_ptr, n, HAS_CU: tl.constexpr):
    """Sequence n's rows [bos, eos): cu[n]..cu[n+1] of a varlen batch, or row n alone without cu_seqlens."""
    if HAS_CU:
        bos = tl.load(cu_ptr + n)
        eos = tl.load(cu_ptr + n + 1)
    else:
        bos = n
        eos = n + 1
    return bos, eos


@triton.jit
def pdl_sync(PDL: tl.constexpr):
    """A kernel's first statement under programmatic dependent launch (`k3.ops._triton.pdl`): wait until the
    kernel before it in the stream has completed and flushed its writes (before ANY global read or write: the
    caching allocator may hand this kernel a buffer that one still reads), then let the next kernel launch.
    Every program runs it, so a kernel completes only after its predecessor did (the chain stays ordered)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
