"""MXFP4 (OCP Microscaling FP4) packing, as used by the K3 routed experts.

Storage layout (compressed-tensors ``mxfp4-pack-quantized``) for a weight
``W [..., n]`` with ``n % 32 == 0``:

* ``weight_packed`` uint8 ``[..., n/2]``: two E2M1 codes per byte, **low
  nibble first** (element ``2j`` in bits 0-3, element ``2j+1`` in bits 4-7).
  A code is a sign bit (bit 3) plus a 3-bit index into :data:`E2M1_VALUES`.
* ``weight_scale`` uint8 ``[..., n/32]``: one E8M0 exponent ``s`` per group of
  32 consecutive values along the last dim; the scale is ``2**(s - 127)``.
  ``s == 255`` is NaN in the OCP spec and is rejected on decode.

``value = E2M1_VALUES[code & 7] * (-1 if code & 8 else 1) * 2**(s - 127)``.

All functions are vectorised torch ops (no Python loops over elements) and run
on whatever device their inputs live on.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "GROUP_SIZE",
    "mxfp4_unpack",
    "mxfp4_pack",
    "mxfp4_fake_quantize",
]

#: The 8 non-negative E2M1 magnitudes, indexed by the low 3 bits of a code.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: Number of consecutive values along the last dim sharing one E8M0 scale.
GROUP_SIZE = 32

_E8M0_BIAS = 127
_E8M0_NAN = 255
_E2M1_EMAX = 2  # floor(log2(6)): exponent of the largest E2M1 magnitude

# Rounding thresholds on |x| (x already divided by the group scale). The
# magnitude index is the number of thresholds passed. Ties go to the even
# index (round-half-to-even on the E2M1 mantissa bit), so a midpoint rounds
# *up* only when the upper neighbour has an even index:
#   0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
# (threshold, tie_rounds_up)
_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def _signed_lut(device: torch.device) -> torch.Tensor:
    """fp32 table of the 16 signed E2M1 values, indexed by the 4-bit code."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat((mags, -mags))  # codes 8..15: sign bit set (8 -> -0.0)


def _e8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """Exact ``2**(s - 127)`` in fp32 for uint8 ``s`` in [0, 254], built from bits.

    fp32 also has exponent bias 127, so ``s << 23`` is the fp32 pattern of
    ``2**(s-127)`` for ``s >= 1``; ``s == 0`` is the subnormal ``2**-127``
    (mantissa bit 22).
    """
    s = scale.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23)
    return bits.view(torch.float32)


def mxfp4_unpack(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantise MXFP4: ``packed`` uint8 [..., n/2] + ``scale`` uint8 [..., n/32] -> [..., n].

    Computes in fp32 (fp64 when ``dtype`` is fp64), then casts to ``dtype``.
    Exact in fp64 always, and in fp32/bf16 except where ``|value| >= 2**128``
    (scale bytes 253/254 with large codes), which overflows to +-inf; fp16
    under/overflows far sooner. Raises ValueError on bad dtypes or shapes, or
    on an E8M0 scale byte of 255 (NaN).
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4_unpack: packed must be a uint8 tensor, got "
            f"{getattr(packed, 'dtype', type(packed))}"
        )
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4_unpack: scale must be a uint8 tensor, got "
            f"{getattr(scale, 'dtype', type(scale))}"
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"mxfp4_unpack: dtype must be a floating dtype, got {dtype}")
    if packed.dim() < 1:
        raise ValueError(
            f"mxfp4_unpack: packed must have at least 1 dim, got shape {tuple(packed.shape)}"
        )
    half = packed.shape[-1]
    if half % (GROUP_SIZE // 2) != 0:
        raise ValueError(
            f"mxfp4_unpack: packed shape {tuple(packed.shape)}: last dim {half} "
            f"(= n/2) must be a multiple of {GROUP_SIZE // 2} (n a multiple of {GROUP_SIZE})"
        )
    n = 2 * half
    groups = n // GROUP_SIZE
    expected_scale = tuple(packed.shape[:-1]) + (groups,)
    if tuple(scale.shape) != expected_scale:
        raise ValueError(
            f"mxfp4_unpack: scale shape {tuple(scale.shape)} does not match packed "
            f"shape {tuple(packed.shape)}; expected scale shape {expected_scale}"
        )
    if packed.device != scale.device:
        raise ValueError(
            f"mxfp4_unpack: packed on {packed.device} but scale on {scale.device}"
        )
    bad = scale == _E8M0_NAN
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"mxfp4_unpack: E8M0 scale byte 255 (NaN in the OCP MX spec) at index "
            f"{where} of scale shape {tuple(scale.shape)}"
        )

    lead = packed.shape[:-1]
    # [..., n/2, 2] with the low nibble first, flattened to [..., n].
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(-1)
    cdtype = torch.float64 if dtype == torch.float64 else torch.float32
    lut = _signed_lut(packed.device).to(cdtype)
    vals = torch.index_select(lut, 0, codes.to(torch.int32))
    vals = vals.view(*lead, groups, GROUP_SIZE)
    vals = vals * _e8m0_to_fp32(scale).to(cdtype).unsqueeze(-1)
    return vals.reshape(*lead, n).to(dtype)


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` [..., n] (n % 32 == 0) to MXFP4 ``(packed [..., n/2], scale [..., n/32])``.

    Per group of 32, following the OCP MX spec: ``s = floor(log2(amax)) - 2 + 127``
    clamped to [0, 254] (an all-zero group gets ``s = 0``); each ``w / 2**(s-127)``
    is rounded to the nearest E2M1 magnitude, ties to even (0.25->0, 0.75->1,
    1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), saturating at 6. The sign is taken
    from the sign bit, so negatives that round to zero become code 8 (-0).
    Computes in fp32 (fp64 inputs in fp64). Non-finite inputs raise ValueError.
    """
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
        raise ValueError(
            f"mxfp4_pack: w must be a floating-point tensor, got "
            f"{getattr(w, 'dtype', type(w))}"
        )
    if w.dim() < 1 or w.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(
            f"mxfp4_pack: w shape {tuple(w.shape)}: last dim must be a multiple of "
            f"{GROUP_SIZE}"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError(
            f"mxfp4_pack: w (shape {tuple(w.shape)}) contains inf/NaN, which MXFP4 "
            f"cannot encode"
        )

    lead = w.shape[:-1]
    n = w.shape[-1]
    groups = n // GROUP_SIZE
    cdtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    x = w.to(cdtype).reshape(*lead, groups, GROUP_SIZE)

    amax = x.abs().amax(dim=-1)
    # frexp: amax = m * 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1
    # exactly (subnormals included). amax == 0 gives e == 0; handled below.
    _, e = torch.frexp(amax)
    s = (e.to(torch.int32) - 1 - _E2M1_EMAX + _E8M0_BIAS).clamp_(0, 254)
    s = torch.where(amax == 0, torch.zeros_like(s), s)
    scale_u8 = s.to(torch.uint8)

    # Division by a power of two is exact (the quotient only loses bits when
    # it is an fp32 subnormal, far below the first rounding threshold 0.25).
    y = x.abs() / _e8m0_to_fp32(scale_u8).to(cdtype).unsqueeze(-1)
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t, tie_up in _THRESHOLDS:  # 7 vectorised comparisons, not an element loop
        idx += (y >= t) if tie_up else (y > t)
    codes = idx | (torch.signbit(x).to(torch.uint8) << 3)
    codes = codes.reshape(*lead, n)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale_u8.contiguous()


def mxfp4_fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """``mxfp4_unpack(*mxfp4_pack(w))`` in ``w.dtype`` (no autograd wiring)."""
    return mxfp4_unpack(*mxfp4_pack(w), dtype=w.dtype)
