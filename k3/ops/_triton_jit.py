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
