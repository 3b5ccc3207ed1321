"""QK-clip's statistic for document-causal attention as one Triton kernel (`varlen.doc_max_logit`): per head, the
max over allowed (t, s) of q_t·k_s, for attention kernels that do not return it (PyTorch's FlashAttention)."""
from __future__ import annotations

import triton
import triton.language as tl

from .._triton import interpreted as _interpreted


@triton.jit
def doc_max_logit_kernel(q_ptr, k_ptr, first_ptr, out_ptr, NT, H, D, sq_t, sq_h, sk_t, sk_h,
                         BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, IEEE: tl.constexpr):
    """Program (i, h): query rows [i·BM, (i+1)·BM) of the flattened tokens, head h. Row t may see keys
    first[t] ≤ s ≤ t (first[t]: the first token of t's document, cut at rows); the block walks the keys from its
    rows' smallest `first` to its last row in BN-key tiles, q·kᵀ on the tensor cores (fp32 accumulation; exact
    fp32 products with IEEE). out[i, h] = the block's max (-inf past the tokens)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    rows = i * BM + tl.arange(0, BM)
    rm = rows < NT
    cols = tl.arange(0, DP)
    cm = cols < D
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * sq_t + h * sq_h + cols[None, :], mask=rm[:, None] & cm[None, :],
                other=0.0)
    first = tl.load(first_ptr + rows, mask=rm, other=NT)
    lo = tl.min(first, 0)
    hi = tl.minimum(i * BM + BM, NT)
    best = tl.full([BM], float("-inf"), tl.float32)
    for n0 in range(lo - lo % BN, hi, BN):
        keys = n0 + tl.arange(0, BN)
        kt = tl.load(k_ptr + keys[:, None].to(tl.int64) * sk_t + h * sk_h + cols[None, :],
                     mask=(keys < NT)[:, None] & cm[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt))
        ok = (keys[None, :] >= first[:, None]) & (keys[None, :] <= rows[:, None]) & rm[:, None]
        best = tl.maximum(best, tl.max(tl.where(ok, s, float("-inf")), 1))
    tl.store(out_ptr + i * H + h, tl.max(best, 0))


def interpreted() -> bool:
    """True when the kernel was bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(doc_max_logit_kernel)
