"""QK-clip's statistic for document-causal attention as one Triton kernel (`varlen.doc_max_logit`): per head, the
max over allowed (t, s) of q_t·k_s, for attention kernels that do not return it (PyTorch's FlashAttention)."""
from __future__ import annotations

import triton
import triton.language as tl

from .._triton import interpreted as _interpreted


@triton.jit
def doc_max_logit_kernel(q_ptr, k_ptr, first_ptr, out_ptr, NT, H, D, sq_t, sq_h, sk_t, sk_h,
                         BM: tl.constexpr, BN: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, IEEE: tl.constexpr):
    """Program (i, h): query rows [i·BM, (i+1)·BM) of the flattened tokens, head h. Row t may see keys
    first[t] ≤ s ≤ t (first[t]: the first token of t's document, cut at rows); the block walks the keys from its
    rows' smallest `first` to its last row in BN-key tiles, q·kᵀ on the tensor cores (fp32 accumulation; exact
    fp32 products with IEEE). The head dim is two power-of-two parts, columns [0, D1) and [D1, D1 + D2) (D2 = 0:
    none), so MLA's 192 is 128 + 64 rather than a padded 256. out[i, h] = the block's max (-inf past the tokens)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    rows = i * BM + tl.arange(0, BM)
    rm = rows < NT
    q1 = _part(q_ptr, rows, rm, h, sq_t, sq_h, 0, D1, D)
    if D2 > 0:
        q2 = _part(q_ptr, rows, rm, h, sq_t, sq_h, D1, D2, D)
    first = tl.load(first_ptr + rows, mask=rm, other=NT)
    lo = tl.min(first, 0)
    hi = tl.minimum(i * BM + BM, NT)
    best = tl.full([BM], float("-inf"), tl.float32)
    for n0 in range(lo - lo % BN, hi, BN):
        keys = n0 + tl.arange(0, BN)
        km = keys < NT
        s = _dot(q1, _part(k_ptr, keys, km, h, sk_t, sk_h, 0, D1, D), IEEE)
        if D2 > 0:
            s += _dot(q2, _part(k_ptr, keys, km, h, sk_t, sk_h, D1, D2, D), IEEE)
        ok = (keys[None, :] >= first[:, None]) & (keys[None, :] <= rows[:, None]) & rm[:, None]
        best = tl.maximum(best, tl.max(tl.where(ok, s, float("-inf")), 1))
    tl.store(out_ptr + i * H + h, tl.max(best, 0))


@triton.jit
def _part(ptr, rows, rm, h, s_t, s_h, c0, W: tl.constexpr, D):
    """Columns [c0, c0 + W) (those < D) of the given token rows of head h, [len(rows), W]."""
    cols = c0 + tl.arange(0, W)
    return tl.load(ptr + rows[:, None].to(tl.int64) * s_t + h * s_h + cols[None, :],
                   mask=rm[:, None] & (cols < D)[None, :], other=0.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a bᵀ in fp32: exact fp32 products with IEEE (fp32 inputs, or the interpreter), else the tensor cores."""
    if IEEE:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b))


def interpreted() -> bool:
    """True when the kernel was bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return _interpreted(doc_max_logit_kernel)
