"""Triton KDA kernels: chunked forward/backward with the fused lower-bound gate, and decode.

Importing this package imports triton; `k3.ops.kda.triton_available()` checks that lazily.
"""
from .chunk import chunk_kda_gated_triton, chunk_kda_triton, kda_extend_triton
from .decode import kda_decode_triton

__all__ = ["chunk_kda_triton", "chunk_kda_gated_triton", "kda_decode_triton", "kda_extend_triton", "interpreted"]


def interpreted() -> bool:
    """True when the kernels were bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from ..._triton import interpreted as _interpreted
    from .intra import kda_intra_fwd_kernel
    return _interpreted(kda_intra_fwd_kernel)
