"""Tests for k3.io.mxfp4 (OCP MXFP4 pack / unpack)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis.extra import numpy as hnp
from hypothesis import given, settings, strategies as st

from k3.io.mxfp4 import (
    E2M1_VALUES,
    mxfp4_fake_quantize,
    mxfp4_pack,
    mxfp4_unpack,
)

MAGS = E2M1_VALUES


def _code_value(code: int) -> float:
    v = MAGS[code & 7]
    return -v if code & 8 else v


def _u8(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.uint8)


def _random_canonical(shape_lead, n, gen, smax=252):
    """Random packed bytes + scales in [0, smax] that mxfp4_pack reproduces exactly.

    Every group with s >= 1 gets at least one code of magnitude 4 or 6
    (index 6/7), so its amax pins floor(log2(amax/scale)) == 2. s == 0
    groups are clamped anyway, so any codes are canonical there. smax=252 keeps
    every value below 2**128 (finite in fp32/bf16); 253/254 need fp64.
    """
    groups = n // 32
    codes = torch.randint(0, 16, (*shape_lead, groups, 32), generator=gen, dtype=torch.int64)
    pos = torch.randint(0, 32, (*shape_lead, groups, 1), generator=gen)
    big = torch.randint(6, 8, (*shape_lead, groups, 1), generator=gen)
    sign = torch.randint(0, 2, (*shape_lead, groups, 1), generator=gen) * 8
    codes.scatter_(-1, pos, big | sign)
    codes = codes.reshape(*shape_lead, n)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scale = torch.randint(0, smax + 1, (*shape_lead, groups), generator=gen).to(torch.uint8)
    edges = torch.tensor([0, 1, smax], dtype=torch.uint8)  # edge exponents
    k = min(3, scale.numel())
    scale.view(-1)[:k] = edges[:k]
    return packed, scale


# ---------------------------------------------------------------- 1. decode


def test_e2m1_table():
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def test_decode_hand_bytes():
    row = torch.zeros(16, dtype=torch.uint8)
    row[0], row[1] = 0x21, 0x9F
    for s, mult in ((127, 1.0), (128, 2.0), (126, 0.5)):
        out = mxfp4_unpack(row[None], _u8([[s]]), dtype=torch.float32)[0]
        assert out.shape == (32,)
        # 0x21: low nibble 1 -> 0.5, high nibble 2 -> 1.0
        assert out[0].item() == 0.5 * mult and out[1].item() == 1.0 * mult
        # 0x9F: low nibble 0xF -> -6, high nibble 0x9 -> -0.5
        assert out[2].item() == -6.0 * mult and out[3].item() == -0.5 * mult
        assert torch.all(out[4:] == 0)


def test_decode_all_16_codes_full_row():
    # element 2j = code j, element 2j+1 = code 15 - j: every code appears twice,
    # once in each nibble position.
    codes = [c for j in range(16) for c in (j, 15 - j)]
    packed = _u8([[codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]])
    assert packed[0, 0].item() == 0xF0 and packed[0, 15].item() == 0x0F
    for s in (127, 130, 120, 1, 0, 252, 253, 254):
        for dt in (torch.float32, torch.bfloat16, torch.float64):
            if s >= 253 and dt != torch.float64:
                continue  # 6 * 2**126 >= 2**128 overflows fp32/bf16 (see test_decode_overflow)
            out = mxfp4_unpack(packed, _u8([[s]]), dtype=dt)
            assert out.dtype == dt and out.shape == (1, 32)
            for i, c in enumerate(codes):
                want = math.ldexp(_code_value(c), s - 127)
                got = out[0, i].item()
                assert got == want, (s, dt, i, c, got, want)
                # signed zero: code 8 decodes to -0.0
                assert math.copysign(1.0, got) == (-1.0 if c & 8 else 1.0)


def test_decode_overflow_beyond_fp32_range():
    # s = 254, code 7 (6.0): 6 * 2**127 is finite only in fp64
    packed = torch.full((1, 16), 0x77, dtype=torch.uint8)
    s = _u8([[254]])
    assert torch.all(mxfp4_unpack(packed, s, torch.float64) == 6 * 2.0**127)
    assert torch.all(torch.isinf(mxfp4_unpack(packed, s, torch.float32)))
    # code 2 (1.0) at s = 254 is 2**127: still finite in fp32
    assert torch.all(mxfp4_unpack(torch.full((1, 16), 0x22, dtype=torch.uint8), s, torch.float32) == 2.0**127)


def test_decode_two_groups_use_their_own_scale():
    packed = torch.full((1, 32), 0x22, dtype=torch.uint8)  # all 1.0
    out = mxfp4_unpack(packed, _u8([[127, 130]]), dtype=torch.float32)
    assert torch.all(out[0, :32] == 1.0) and torch.all(out[0, 32:] == 8.0)


def test_decode_nan_scale_rejected():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="255"):
        mxfp4_unpack(packed, _u8([[127], [255]]))


# ---------------------------------------------------------------- 2. round trip


@pytest.mark.parametrize("lead,n", [((4,), 64), ((2, 3), 128), ((), 32), ((64,), 256)])
def test_round_trip_bit_exact(lead, n):
    gen = torch.Generator().manual_seed(1234 + n)
    packed, scale = _random_canonical(lead, n, gen)
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        w = mxfp4_unpack(packed, scale, dtype=dt)
        p2, s2 = mxfp4_pack(w)
        assert p2.dtype == torch.uint8 and s2.dtype == torch.uint8
        assert torch.equal(s2, scale), dt
        assert torch.equal(p2, packed), dt
        assert torch.equal(mxfp4_fake_quantize(w), w)
    # fp64 reaches the top exponents 253/254 too
    packed64, scale64 = _random_canonical(lead, n, gen, smax=254)
    p2, s2 = mxfp4_pack(mxfp4_unpack(packed64, scale64, dtype=torch.float64))
    assert torch.equal(p2, packed64) and torch.equal(s2, scale64)
    # bf16 decode is exact: equals the fp32 decode
    assert torch.equal(
        mxfp4_unpack(packed, scale, torch.bfloat16).float(),
        mxfp4_unpack(packed, scale, torch.float32),
    )


# ---------------------------------------------------------------- 3. random weights


def _halfstep(x: torch.Tensor) -> torch.Tensor:
    """Max rounding error (in units of the group scale) for |x| <= 6."""
    return torch.where(x <= 2, 0.25, torch.where(x <= 4, 0.5, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_normal_error_bound(dtype):
    gen = torch.Generator().manual_seed(0)
    lo, hi = (-6, 6) if dtype == torch.float16 else (-40, 40)
    # N(0, 1) values, each group of 32 at its own random octave
    octave = torch.randint(lo, hi, (64, 16, 1), generator=gen).float()
    w = (torch.randn(64, 16, 32, generator=gen) * torch.exp2(octave)).view(64, 512).to(dtype)
    packed, scale = mxfp4_pack(w)
    q = mxfp4_unpack(packed, scale, dtype=torch.float32).view(64, 16, 32)
    wf = w.float().view(64, 16, 32)
    sc = torch.exp2(scale.float() - 127).unsqueeze(-1)  # exact for s in [1, 254]
    amax = wf.abs().amax(-1, keepdim=True)

    # shared exponent: amax / scale in [4, 8), i.e. s = floor(log2 amax) - 2 + 127
    r = amax / sc
    assert torch.all((r >= 4) & (r < 8))
    # every quantised value is within 6 * scale (saturation), group max included
    assert torch.all(q.abs() <= 6 * sc)
    # elementwise bound: with x = |w| / scale,
    #   |w - q| <= halfstep(x) * scale  for x <= 6  (0.25 / 0.5 / 1.0 below 2 / 4 / 6)
    #   |w - q| == (x - 6) * scale      for x > 6   (saturated to 6 * scale)
    x = wf.abs() / sc
    err = (wf - q).abs()
    sat = x > 6
    assert torch.all(err[~sat] <= (_halfstep(x) * sc)[~sat])
    assert torch.equal(q[sat].abs(), (6 * sc).expand_as(q)[sat])
    assert torch.all(torch.sign(q[q != 0]) == torch.sign(wf[q != 0]))
    # which implies a group-relative bound: |w - q| <= amax / 4
    assert torch.all(err <= amax / 4)
    # and it is a real quantiser: mean relative error is modest
    assert (err.sum() / wf.abs().sum()).item() < 0.15


def test_rounding_ties_to_even_and_saturation():
    # x values (scale 1, group amax pinned to 4 by element 0)
    xs = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 5.01, 7.9, -5.0, -0.1, 0.0, -0.0]
    want = [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 6.0, 6.0, -4.0, -0.0, 0.0, -0.0]
    w = torch.tensor(xs + [0.0] * 16)
    packed, scale = mxfp4_pack(w)
    assert scale.tolist() == [127]
    q = mxfp4_unpack(packed, scale, torch.float32)
    assert q[:16].tolist() == want
    assert [math.copysign(1, v) for v in q[:16].tolist()] == [math.copysign(1, v) for v in want]


def test_scale_edge_cases():
    # all-zero group -> s = 0; tiny (subnormal) group -> clamped s = 0; huge -> s = 252
    w = torch.zeros(3, 32)
    w[1, 0] = 1e-45  # fp32 subnormal 2^-149
    w[2, 0] = torch.finfo(torch.float32).max
    packed, scale = mxfp4_pack(w)
    assert scale[:, 0].tolist() == [0, 0, 252]
    q = mxfp4_unpack(packed, scale, torch.float32)
    assert torch.all(q[:2] == 0)
    assert q[2, 0].item() == 6 * 2.0**125  # saturated: 3.4e38 / 2^125 = 7.99...


# ---------------------------------------------------------------- 4. shapes


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (32,)])
def test_shapes(shape):
    w = torch.randn(shape)
    packed, scale = mxfp4_pack(w)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert scale.shape == (*shape[:-1], shape[-1] // 32)
    q = mxfp4_unpack(packed, scale)
    assert q.shape == shape and q.dtype == torch.bfloat16
    assert mxfp4_fake_quantize(w).shape == shape
    assert mxfp4_fake_quantize(w).dtype == w.dtype


def test_batched_matches_per_row():
    w = torch.randn(2, 5, 96)
    packed, scale = mxfp4_pack(w)
    for i in range(2):
        p_i, s_i = mxfp4_pack(w[i])
        assert torch.equal(p_i, packed[i]) and torch.equal(s_i, scale[i])
        assert torch.equal(mxfp4_unpack(p_i, s_i), mxfp4_unpack(packed, scale)[i])


@pytest.mark.parametrize(
    "packed_shape,scale_shape,out_shape",
    [
        ((3072, 1792), (3072, 112), (3072, 3584)),  # experts.{e}.w1 / w3
        ((3584, 1536), (3584, 96), (3584, 3072)),  # experts.{e}.w2
    ],
)
def test_checkpoint_shapes(packed_shape, scale_shape, out_shape):
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, packed_shape, generator=gen, dtype=torch.uint8)
    scale = torch.randint(117, 128, scale_shape, generator=gen, dtype=torch.uint8)
    out = mxfp4_unpack(packed, scale)
    assert out.shape == out_shape and out.dtype == torch.bfloat16
    # spot-check one row and one column against the scalar formula
    r, c = 1234, 777
    for i, j in [(r, k) for k in range(0, out_shape[1], 97)] + [(k, c) for k in range(0, out_shape[0], 101)]:
        byte = packed[i, j // 2].item()
        code = (byte >> 4) if j % 2 else (byte & 0xF)
        want = math.ldexp(_code_value(code), scale[i, j // 32].item() - 127)
        assert out[i, j].item() == want


def test_expert_bytes_on_disk():
    # notes §2.9: one routed expert (w1 + w2 + w3, packed + scales) = 17,547,264 bytes
    def nbytes(out, inp):
        return out * inp // 2 + out * inp // 32

    assert 2 * nbytes(3072, 3584) + nbytes(3584, 3072) == 17_547_264


# ---------------------------------------------------------------- 5. errors


def test_unpack_errors():
    ok_s = torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\(4, 17\)"):  # odd last dim
        mxfp4_unpack(torch.zeros(4, 17, dtype=torch.uint8), ok_s)
    with pytest.raises(ValueError, match=r"\(4, 8\)"):  # n = 16, not a multiple of 32
        mxfp4_unpack(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(4, 3\).*\(4, 32\).*\(4, 2\)"):  # wrong scale shape
        mxfp4_unpack(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(3, 2\)"):  # wrong leading dims
        mxfp4_unpack(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"int8"):  # wrong packed dtype
        mxfp4_unpack(torch.zeros(4, 32, dtype=torch.int8), ok_s)
    with pytest.raises(ValueError, match=r"float32"):  # wrong scale dtype
        mxfp4_unpack(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"int32"):  # non-float output dtype
        mxfp4_unpack(torch.zeros(4, 32, dtype=torch.uint8), ok_s, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\(\)"):  # 0-dim
        mxfp4_unpack(torch.tensor(0, dtype=torch.uint8), torch.tensor(0, dtype=torch.uint8))


def test_pack_errors():
    with pytest.raises(ValueError, match=r"\(3, 33\)"):
        mxfp4_pack(torch.zeros(3, 33))
    with pytest.raises(ValueError, match=r"\(2, 16\)"):
        mxfp4_pack(torch.zeros(2, 16))
    with pytest.raises(ValueError, match=r"int64"):
        mxfp4_pack(torch.zeros(2, 32, dtype=torch.int64))
    bad = torch.zeros(2, 32)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"\(2, 32\)"):
        mxfp4_pack(bad)
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match="inf"):
        mxfp4_pack(bad)


# ---------------------------------------------------------------- 6. property


_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=100, deadline=None)
@given(
    w=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])), elements=_f32),
    shift=st.integers(-140, 100),
)
def test_pack_unpack_pack_idempotent(w, shift):
    w = torch.from_numpy(w)
    # also exercise groups at a random overall magnitude (incl. subnormal range)
    w2 = w * 2.0**shift if abs(shift) < 120 else w
    w2 = torch.where(torch.isfinite(w2), w2, w)
    for x in (w, w2):
        packed, scale = mxfp4_pack(x)
        for dt in (torch.float32, torch.bfloat16):
            pk2, sc2 = mxfp4_pack(mxfp4_unpack(packed, scale, dtype=dt))
            assert torch.equal(pk2, packed)
            assert torch.equal(sc2, scale)
        fq = mxfp4_fake_quantize(x)
        assert torch.equal(mxfp4_fake_quantize(fq), fq)


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=gen) * 3
    p, s = mxfp4_pack(w)
    pc, sc = mxfp4_pack(w.cuda())
    assert pc.is_cuda and torch.equal(pc.cpu(), p) and torch.equal(sc.cpu(), s)
    qc = mxfp4_unpack(pc, sc)
    assert qc.is_cuda and torch.equal(qc.cpu(), mxfp4_unpack(p, s))
    packed, scale = _random_canonical((8,), 128, gen)
    assert torch.equal(
        mxfp4_unpack(packed.cuda(), scale.cuda(), torch.float32).cpu(),
        mxfp4_unpack(packed, scale, torch.float32),
    )
