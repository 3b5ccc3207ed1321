"""Row-wise FP8 (e4m3) quantisation in plain PyTorch: the oracle of the Triton kernel, and the CPU path.

Each row r of x gets one power-of-two scale s_r, the smallest with max|x_r| / s_r <= 448 (e4m3's largest
finite value), and q_r = e4m3(x_r / s_r) rounded to nearest even. A power of two makes x / s exact in fp32 (only
the exponent moves), so every implementation that rounds to nearest even agrees bit for bit, and dequantising
(q · s) is exact. The scale is built from amax's bits, not from a log2 or a division that a GPU approximates.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
# 448 = 1.75 · 2^8. amax = 1.m · 2^E needs s = 2^(E-8) while 1.m <= 1.75 (mantissa bits <= 0x600000), else
# 2^(E-7). s's biased exponent is kept in [1, 253], so s and 1/s are normal fp32 numbers (amax = 0 gives 2^-126).
_MANT_175 = 0x600000
_EXP_MIN, _EXP_MAX = 1, 253


def pow2_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, 1/s) for fp32 amax >= 0: s = the smallest power of two with amax / s <= 448, as exact fp32."""
    bits = amax.float().contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    se = (e - 8 + (m > _MANT_175).to(torch.int32)).clamp(_EXP_MIN, _EXP_MAX)
    return (se << 23).view(torch.float32), ((254 - se) << 23).view(torch.float32)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (any float dtype, any strides) → (q [R, C] e4m3 contiguous, s [R] fp32): x ≈ q · s[:, None]."""
    xf = x.float()
    s, inv = pow2_scale(xf.abs().amax(dim=1) if x.shape[1] else xf.new_zeros(x.shape[0]))
    return (xf * inv[:, None]).to(FP8).contiguous(), s


def dequantize_rows(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q · s[:, None] in `dtype` (exact in fp32 and fp64)."""
    return q.to(dtype) * s.to(dtype)[:, None]
