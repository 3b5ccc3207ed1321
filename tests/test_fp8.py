"""`k3.ops.fp8`: row-wise e4m3 quantisation against an independent table oracle, the Triton kernel against the
reference (bit for bit), FP8 projections against their dequantised fp64 products, the module conversion, the
joined projections' FP8 path, and a few training steps of k3-tiny with FP8 projections."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import rel_rmse
from k3.ops import fp8
from k3.ops.joined_linear import joined_linear

pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def fp8_dx_at_every_width(monkeypatch):
    """The tests' layers are narrow: take dx in FP8 at every input width (production: `DGRAD_MIN_K`), except
    where a test sets the threshold itself."""
    monkeypatch.setattr(fp8, "DGRAD_MIN_K", 0)


def _e4m3_table() -> torch.Tensor:
    """Every finite e4m3 value, sorted, from the format's definition (bias 7, 3 mantissa bits, no infinities,
    S.1111.111 is NaN): independent of torch's conversion."""
    vals = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.update((v, -v))
    return torch.tensor(sorted(vals), dtype=torch.float64)


def _round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """y (|y| <= 448, fp64) rounded to the nearest e4m3 value, ties to the even mantissa (table lookup)."""
    t = _e4m3_table()
    i = torch.searchsorted(t, y).clamp(1, len(t) - 1)
    lo, hi = t[i - 1], t[i]
    pick_hi = (hi - y) < (y - lo)
    tie = (hi - y) == (y - lo)
    # the even neighbour: its mantissa's last bit is 0 (hi's index parity within a binade alternates)
    hi_even = (torch.frexp(hi.abs())[0] * 16).round().long() % 2 == 0
    pick_hi = pick_hi | (tie & hi_even)
    out = torch.where(pick_hi, hi, lo)
    return torch.where(y == 0, torch.zeros_like(y), out)


def _scale_oracle(amax: float) -> float:
    """The smallest power of two s with amax / s <= 448 (normal fp32 range), from math.frexp."""
    if amax == 0:
        return 2.0 ** -126
    e = math.ceil(math.log2(amax / 448.0))
    while amax / 2.0 ** e > 448.0:
        e += 1
    while e - 1 >= -126 and amax / 2.0 ** (e - 1) <= 448.0:
        e -= 1
    return 2.0 ** max(min(e, 126), -126)


def test_pow2_scale_is_the_tightest_power_of_two():
    gen = torch.Generator().manual_seed(0)
    edges = [0.0, 448.0, 448.0 * 2 ** -20, 448.0 * 2 ** 10, 449.0, 447.99, 224.0, 1.0, 3e-39, 1e-30, 1.75, 1.7500001]
    amax = torch.cat([torch.tensor(edges), torch.exp(torch.randn(2000, generator=gen) * 20).float()])
    s, inv = fp8.pow2_scale(amax)
    for a, si, ii in zip(amax.tolist(), s.tolist(), inv.tolist()):
        assert si == _scale_oracle(a), a
        assert si * ii == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_reference_rounds_to_nearest_even(dtype):
    """q · s equals x / s rounded by the e4m3 table, then times s: every element, rows of very different sizes."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(24, 80, generator=gen) * torch.exp(torch.randn(24, 1, generator=gen) * 8)).to(dtype)
    x[3] = 0
    q, s = fp8.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and q.is_contiguous()
    y = x.double() / s.double()[:, None]
    assert y.abs().max() <= 448
    torch.testing.assert_close(q.double(), _round_e4m3(y), rtol=0, atol=0)
    torch.testing.assert_close(fp8.dequantize_rows(q, s), _round_e4m3(y) * s.double()[:, None], rtol=0, atol=0)
    assert (q[3].double() == 0).all()


def _exact_rows(R, C, gen, dtype):
    """Rows of e4m3 values times a power of two, each row's largest magnitude in (224, 448] · 2^k: the quantised
    values need no rounding (the CPU interpreter's own fp8 conversion rounds some ties and binade edges wrongly,
    so the interpreter check stays away from rounding; the CUDA test below covers it)."""
    t = _e4m3_table()
    t = t[t.abs() <= 224]
    x = t[torch.randint(0, len(t), (R, C), generator=gen)]
    big = torch.tensor([240.0, 256.0, 288.0, 320.0, 384.0, 416.0, 448.0], dtype=torch.float64)
    col = torch.randint(0, C, (R,), generator=gen)
    sign = torch.sign(torch.randn(R, generator=gen))
    x[torch.arange(R), col] = big[torch.randint(0, len(big), (R,), generator=gen)] * sign
    k = torch.randint(-20, 20, (R, 1), generator=gen).double()
    return (x * 2.0 ** k).to(dtype)


@pytest.mark.parametrize("split", [None, 1, 3], ids=["auto", "whole-rows", "3-ranges"])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("shape", [(7, 48), (130, 200)])
def test_triton_kernel_equals_reference_interpreter(shape, transposed, split):
    """The kernel's scales bit for bit and its e4m3 output (exactly representable inputs), row-major and a
    transposed view (a weight's columns), with row and column tails, whole rows and rows split over column
    ranges (atomic maxima, then the cast)."""
    from k3.ops.fp8 import triton as fp8_triton
    if not fp8_triton.interpreted():
        pytest.skip("the interpreter check (CUDA runs the test below)")
    gen = torch.Generator().manual_seed(2)
    R, C = shape
    x = _exact_rows(R, C, gen, torch.float32)
    if transposed:  # the same values read through column strides
        x = x.t().contiguous().t()
        assert x.stride() == (1, R)
    q, s = fp8_triton.quantize_rows_triton(x, split=split)
    qr, sr = fp8.quantize_rows_reference(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    # random (rounded) rows: the scales still match bit for bit
    xr = torch.randn(R, C, generator=gen) * torch.exp(torch.randn(R, 1, generator=gen) * 6)
    assert torch.equal(fp8_triton.quantize_rows_triton(xr, split=split)[1], fp8.quantize_rows_reference(xr)[1])


def _joined_case(gen, R, widths, exact):
    """Pieces [R, n_i] at increasing offsets with a gap after the second (an unused piece) and padding after
    the last; returns pieces, offsets, width and their joined copy."""
    pieces, offsets, o = [], [], 0
    for i, n in enumerate(widths):
        p = (_exact_rows(R, n, gen, torch.float32) * (2.0 ** i) if exact
             else torch.randn(R, n, generator=gen) * torch.exp(torch.randn(R, 1, generator=gen) * 3))
        pieces.append(p)
        offsets.append(o)
        o += n + (16 if i == 1 else 0)
    width = o + 24
    joined = torch.zeros(R, width)
    for p, off in zip(pieces, offsets):
        joined[:, off:off + p.shape[1]] = p
    return pieces, offsets, width, joined


@pytest.mark.parametrize("widths", [(40,), (40, 12, 96), (40, 12, 96, 8), (8, 8, 8, 8, 8)],
                         ids=["1-piece", "3-pieces", "4-pieces", "5-pieces-fallback"])
def test_quantize_joined_equals_quantising_the_joined_copy(widths):
    """dy's pieces side by side, read in place: q and s equal quantising the joined matrix (zeros where no
    piece is), in the reference and in the Triton kernel (interpreter: exactly representable values for q,
    random ones for s)."""
    gen = torch.Generator().manual_seed(9)
    pieces, offsets, width, joined = _joined_case(gen, 37, widths, exact=False)
    qr, sr = fp8.quantize_rows_reference(joined)
    q, s = fp8.quantize_joined(pieces, offsets, width, backend="reference")
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    from k3.ops.fp8 import triton as fp8_triton
    if not fp8_triton.interpreted():
        return
    assert torch.equal(fp8.quantize_joined(pieces, offsets, width, backend="triton")[1], sr)
    # exact values: each row's maximum sits in one piece, the scaled values need no rounding
    pieces, offsets, width, joined = _joined_case(gen, 37, widths, exact=True)
    big = torch.stack([p.abs().amax(1) for p in pieces]).amax(0)
    keep = torch.stack([p.abs().amax(1) for p in pieces])
    for i, p in enumerate(pieces):  # rows whose largest value is not in piece i: piece i scaled below it exactly
        p *= torch.where(keep[i] == big, 1.0, 2.0 ** -30)[:, None]
    joined = torch.zeros(37, width)
    for p, off in zip(pieces, offsets):
        joined[:, off:off + p.shape[1]] = p
    qr, sr = fp8.quantize_rows_reference(joined)
    q, s = fp8.quantize_joined(pieces, offsets, width, backend="triton")
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_quantize_joined_bad_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="does not fit"):
        fp8.quantize_joined([x], [4], 10)
    with pytest.raises(ValueError, match="one offset each"):
        fp8.quantize_joined([x], [], 10)
    with pytest.raises(ValueError, match="does not fit"):
        fp8.quantize_joined([x, torch.randn(5, 8)], [0, 8], 16)


def test_triton_kernel_empty_inputs():
    from k3.ops.fp8 import triton as fp8_triton
    if not fp8_triton.interpreted():
        pytest.skip("the interpreter check")
    for shape in ((0, 32), (3, 0)):
        q, s = fp8.quantize_rows(torch.zeros(shape), backend="triton")
        qr, sr = fp8.quantize_rows_reference(torch.zeros(shape))
        assert q.shape == qr.shape and torch.equal(s, sr)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("split", [None, 1], ids=["auto", "whole-rows"])
def test_triton_kernel_equals_reference_cuda(dtype, transposed, split):
    """On the GPU, with the hardware's e4m3 conversion: bit for bit, random rows (rounding everywhere)."""
    from k3.ops.fp8 import triton as fp8_triton
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(1000, 1536, generator=gen) * torch.exp(torch.randn(1000, 1, generator=gen) * 4)).to(dtype)
    x = x.cuda()
    x = x.t() if transposed else x
    q, s = fp8_triton.quantize_rows_triton(x, split=split)
    qr, sr = fp8.quantize_rows_reference(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@cuda
def test_quantize_joined_cuda_bitwise():
    gen = torch.Generator().manual_seed(10)
    pieces, offsets, width, joined = _joined_case(gen, 3000, (4608, 128, 12, 1536), exact=False)
    pieces = [p.cuda().bfloat16() for p in pieces]
    joined = joined.cuda().bfloat16()
    q, s = fp8.quantize_joined(pieces, offsets, width, backend="triton")
    qr, sr = fp8.quantize_rows_reference(joined)
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def _oracle_mm(a, b):
    """The dequantised operands' product in fp64: what an FP8 GEMM with fp32 accumulation approximates."""
    qa, sa = fp8.quantize_rows_reference(a)
    qb, sb = fp8.quantize_rows_reference(b)
    return fp8.dequantize_rows(qa, sa) @ fp8.dequantize_rows(qb, sb).t()


def test_fp8_linear_equals_its_dequantised_products():
    """Forward x Wᵀ and dx = dy W against the fp64 products of the quantised operands (fp32 accumulation:
    rel. RMS <= 1e-6); dW = dyᵀ x unquantised (to fp32 rounding); both within FP8 error of the exact linear."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 50, 64, generator=gen, requires_grad=True)
    w = (torch.randn(96, 64, generator=gen) * 0.1).requires_grad_()
    y = fp8.fp8_linear(x, w)
    assert y.shape == (3, 50, 96) and y.dtype == torch.float32
    assert rel_rmse(_oracle_mm(x.detach().reshape(-1, 64), w.detach()).view(y.shape), y) < 1e-6
    dy = torch.randn(y.shape, generator=gen)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    assert rel_rmse(_oracle_mm(dy.reshape(-1, 96), w.detach().t()).view(dx.shape), dx) < 1e-6
    assert rel_rmse(dy.reshape(-1, 96).double().t() @ x.detach().reshape(-1, 64).double(), dw) < 1e-6
    # against the exact linear: e4m3's 3 mantissa bits (relative step 2^-3, RMS rounding error ≈ 2^-4/√3 per operand)
    ref = F.linear(x.double(), w.double())
    assert 5e-3 < rel_rmse(ref, y) < 0.06
    rdx = dy.double() @ w.detach().double()
    assert 5e-3 < rel_rmse(rdx, dx) < 0.06


def test_scaled_mm_cpu_fallback_equals_the_rowwise_gemm(monkeypatch):
    """Where the CPU `_scaled_mm` takes per-tensor scales only (torch 2.11), `scaled_mm` forms the same product
    in fp32: equal to the fp64 product of the quantised operands, and to the row-wise GEMM where torch has one."""
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(48, 80, generator=gen), torch.randn(24, 80, generator=gen) * 30
    qa, sa = fp8.quantize_rows(a)
    qb, sb = fp8.quantize_rows(b)
    native = fp8.scaled_mm(qa, sa, qb, sb, torch.float32) if fp8._cpu_rowwise_scaled_mm() else None
    monkeypatch.setattr(fp8, "_cpu_rowwise_scaled_mm", lambda: False)
    got = fp8.scaled_mm(qa, sa, qb, sb, torch.float32)
    assert rel_rmse(_oracle_mm(a, b), got) < 1e-6
    if native is not None:
        assert rel_rmse(native.double(), got) < 1e-6


@pytest.mark.parametrize("M", [160, 150], ids=["M%16=0", "M%16!=0"])
def test_fp8_weight_grad_option(monkeypatch, M):
    """With WGRAD on, dW = dyᵀ x is the FP8 product over both operands' columns (each column of dy and x
    quantised over the M tokens), unless M is not a multiple of 16 (then the plain GEMM); in the linear and in
    the joined projections."""
    monkeypatch.setattr(fp8, "WGRAD", True)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(M, 64, generator=gen, requires_grad=True)
    w = (torch.randn(32, 64, generator=gen) * 0.1).requires_grad_()
    dy = torch.randn(M, 32, generator=gen)
    dw, = torch.autograd.grad(fp8.fp8_linear(x, w), [w], dy)
    want = _oracle_mm(dy.t(), x.detach().t()) if M % 16 == 0 else dy.double().t() @ x.detach().double()
    assert rel_rmse(want, dw) < 1e-6
    exact = dy.double().t() @ x.detach().double()
    assert (0.005 < rel_rmse(exact, dw) < 0.06) if M % 16 == 0 else rel_rmse(exact, dw) < 1e-6
    setattr(w, "_k3_fp8", True)
    (out,) = joined_linear(x, [w])
    dwj, = torch.autograd.grad(out, [w], dy)
    assert rel_rmse(want, dwj) < 1e-6
    # two pieces: x's columns quantised once, shared by both weight gradients
    w2 = (torch.randn(16, 64, generator=gen) * 0.1).requires_grad_()
    setattr(w2, "_k3_fp8", True)
    dy2 = torch.randn(M, 16, generator=gen)
    out1, out2 = joined_linear(x, [w, w2])
    dw1, dw2 = torch.autograd.grad((out1 * dy).sum() + (out2 * dy2).sum(), [w, w2])
    want2 = _oracle_mm(dy2.t(), x.detach().t()) if M % 16 == 0 else dy2.double().t() @ x.detach().double()
    assert rel_rmse(want, dw1) < 1e-6 and rel_rmse(want2, dw2) < 1e-6


@pytest.mark.parametrize("switch", ["DGRAD=0", "narrower-than-DGRAD_MIN_K"])
def test_fp8_dgrad_off_gives_the_bf16_input_gradient(monkeypatch, switch):
    """K3_FP8_DGRAD=0, or a layer narrower at the input than K3_FP8_DGRAD_MIN_K: dx is the plain product dy W (the
    forward stays FP8), in the linear and the joined path."""
    if switch == "DGRAD=0":
        monkeypatch.setattr(fp8, "DGRAD", False)
    else:
        monkeypatch.setattr(fp8, "DGRAD_MIN_K", 65)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(40, 64, generator=gen, requires_grad=True)
    w = (torch.randn(32, 64, generator=gen) * 0.1).requires_grad_()
    dy = torch.randn(40, 32, generator=gen)
    y = fp8.fp8_linear(x, w)
    assert rel_rmse(_oracle_mm(x.detach(), w.detach()), y) < 1e-6
    dx, = torch.autograd.grad(y, [x], dy)
    assert rel_rmse(dy.double() @ w.detach().double(), dx) < 1e-6
    setattr(w, "_k3_fp8", True)
    (out,) = joined_linear(x, [w])
    dxj, = torch.autograd.grad(out, [x], dy)
    assert rel_rmse(dy.double() @ w.detach().double(), dxj) < 1e-6


@cuda
def test_fp8_linear_cuda_equals_its_dequantised_products():
    """cuBLAS's row-wise FP8 GEMMs under bf16 autocast (fp32 master weight): forward and dx against the fp64
    products of the same quantised operands (bf16 output: rel. RMS <= 5e-3); dW against the bf16 GEMM's."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1000, 1536, generator=gen).cuda().requires_grad_()
    w = (torch.randn(2304, 1536, generator=gen) * 0.03).cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fp8.fp8_linear(x, w)
    assert y.dtype == torch.bfloat16
    assert rel_rmse(_oracle_mm(x.detach().bfloat16().cpu(), w.detach().cpu()), y.cpu()) < 5e-3
    dy = torch.randn(y.shape, generator=gen).cuda().bfloat16()
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    assert rel_rmse(_oracle_mm(dy.cpu(), w.detach().cpu().t()), dx.cpu()) < 5e-3
    assert dw.dtype == torch.float32
    assert rel_rmse(dy.double().t() @ x.detach().bfloat16().double(), dw) < 5e-3


def test_fp8_linear_bf16_autocast_and_errors():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 32, generator=gen)
    w = torch.randn(16, 32, generator=gen, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8.fp8_linear(x, w)
    assert y.dtype == torch.bfloat16
    assert rel_rmse(_oracle_mm(x.bfloat16(), w.detach()), y) < 1e-2  # one bf16 rounding of the output
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.fp8_linear(x, torch.randn(12, 32))
    with pytest.raises(ValueError, match="positive multiples"):
        fp8.fp8_linear(torch.randn(4, 0), torch.randn(16, 0))
    # no tokens: empty output, zero weight gradient
    x0 = torch.randn(2, 0, 32, requires_grad=True)
    y0 = fp8.fp8_linear(x0, w)
    assert y0.shape == (2, 0, 16)
    w.grad = None
    y0.sum().backward()
    assert x0.grad.shape == x0.shape and torch.equal(w.grad, torch.zeros_like(w))
    with pytest.raises(ValueError, match="expected x"):
        fp8.fp8_linear(x, torch.randn(16, 48))
    with pytest.raises(ValueError, match="expected x"):
        fp8.fp8_linear(x, torch.randn(32))
    with pytest.raises(ValueError, match="fp32/bf16"):
        fp8.fp8_linear(x.double(), torch.randn(16, 32))
    with pytest.raises(ValueError, match="unknown backend"):
        fp8.quantize_rows(x, backend="cuda")
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_rows(x[0])


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64, bias=False)
        self.b = nn.Linear(64, 32, bias=True)  # a bias: kept
        self.narrow = nn.Linear(32, 12, bias=False)  # marked (joinable), not converted
        self.lm_head = nn.Linear(32, 48, bias=False)  # the head: kept


def test_convert_to_float8_training_keeps_parameters_and_names():
    torch.manual_seed(0)
    m = _Toy()
    keys, params = list(m.state_dict()), [id(p) for p in m.parameters()]
    assert fp8.convert_to_float8_training(m) == 1
    assert list(m.state_dict()) == keys and [id(p) for p in m.parameters()] == params
    assert type(m.a) is fp8.Float8Linear and type(m.b) is nn.Linear and type(m.narrow) is nn.Linear
    assert type(m.lm_head) is nn.Linear
    with torch.no_grad():
        x = torch.randn(5, 32)
        assert fp8.marked(m.a.weight) is False  # no autograd recording: plain linear
        assert torch.equal(m.a(x), F.linear(x, m.a.weight))
    assert fp8.marked(m.a.weight, m.narrow.weight) and not fp8.marked(m.lm_head.weight)
    x = torch.randn(5, 32)
    torch.testing.assert_close(m.a(x), fp8.fp8_linear(x, m.a.weight), rtol=0, atol=0)
    assert fp8.convert_to_float8_training(_Toy(), lambda name, mod: name != "a") == 0


@pytest.mark.parametrize("unused", [None, 1], ids=["all-used", "piece-unused"])
def test_joined_linear_fp8_path(unused):
    """Marked weights: each output equals that piece's own FP8 product (x's row scales and each weight row's
    scale do not depend on the joining); dx is the FP8 product of dy's pieces side by side (one row scale over
    them, zeros for an unused piece) and the joined weight; dW as in the plain path."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 30, 48, generator=gen, requires_grad=True)
    ws = [(torch.randn(n, 48, generator=gen) * 0.2).requires_grad_() for n in (32, 12, 16)]
    for w in ws:
        setattr(w, "_k3_fp8", True)
    outs = joined_linear(x, [[ws[0], ws[1]], ws[2]])
    x2 = x.detach().reshape(-1, 48)
    wa = torch.cat([w.detach() for w in ws[:2]])
    assert rel_rmse(_oracle_mm(x2, wa).view(outs[0].shape), outs[0]) < 1e-6
    assert rel_rmse(_oracle_mm(x2, ws[2].detach()).view(outs[1].shape), outs[1]) < 1e-6
    dys = [torch.randn(o.shape, generator=gen) for o in outs]
    if unused is not None:
        dys[unused] = None
    loss = sum((o * d).sum() for o, d in zip(outs, dys) if d is not None)
    dx, *dws = torch.autograd.grad(loss, [x, *ws], allow_unused=True)
    dy_all = torch.cat([torch.zeros(60, o.shape[-1]) if d is None else d.reshape(60, -1) for o, d in zip(outs, dys)]
                       + [torch.zeros(60, 64 - 60)], dim=1)
    w_all = torch.cat([w.detach() for w in ws] + [torch.zeros(4, 48)])
    assert rel_rmse(_oracle_mm(dy_all, w_all.t()).view(dx.shape), dx) < 1e-6
    for i, w in enumerate(ws):
        piece = 0 if i < 2 else 1
        if dys[piece] is None:
            assert dws[i] is None
        else:
            lo = [0, 32, 0][i]
            want = dys[piece].reshape(60, -1)[:, lo:lo + w.shape[0]].double().t() @ x2.double()
            assert rel_rmse(want, dws[i]) < 1e-6
    # unmarked weights (or no autograd recording): the plain path, bit for bit F.linear's GEMM
    plain = [w.detach().clone().requires_grad_() for w in ws]
    with torch.no_grad():
        got = joined_linear(x, [[ws[0], ws[1]], ws[2]])
    ref = joined_linear(x, [[plain[0], plain[1]], plain[2]])
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("mode", ["fp32", "bf16-joined"])
def test_k3_tiny_trains_with_fp8_projections(monkeypatch, mode):
    """k3-tiny, 8 AdamW steps on a fixed batch, with and without FP8 projections: FP8 converts the model's
    projections (not the head or the narrow ones), the loss falls the same way, within 2 % at every step. The
    second mode runs as training on a GPU does: bf16 autocast over fp32 masters, input projections joined (their
    FP8 backward quantises dy's pieces side by side)."""
    from k3 import K3Config, K3ForConditionalGeneration
    import k3.ops.joined_linear as JL
    joined = mode == "bf16-joined"
    monkeypatch.setattr(JL, "ENABLED", joined)
    calls = []
    real = fp8.quantize_joined
    monkeypatch.setattr(fp8, "quantize_joined", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(use_fp8):
        torch.manual_seed(0)
        cfg = K3Config.preset("k3-tiny")
        model = K3ForConditionalGeneration(cfg).train()
        n = fp8.convert_to_float8_training(model) if use_fp8 else 0
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.text_config.vocab_size, (2, 64), generator=gen)
        losses = []
        for _ in range(8):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=joined):
                out = model(input_ids=ids, labels=ids)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            losses.append(out.loss.item())
        return n, losses

    n, fp8_losses = run(True)
    assert (len(calls) > 0) == joined
    _, ref_losses = run(False)
    assert n > 10
    assert fp8_losses[-1] < fp8_losses[0] - 0.5
    for a, b in zip(fp8_losses, ref_losses):
        assert abs(a - b) / b < 0.02, (fp8_losses, ref_losses)


def test_k3_train_fp8_run_saves_a_plain_checkpoint(tmp_path):
    """`k3 train --fp8`: the trainer converts the projections, trains, and its checkpoint has the plain names
    (a model built without FP8 loads it and reproduces the saved weights)."""
    from test_train import tiny
    from k3 import K3ForConditionalGeneration
    from k3.train.state import latest_checkpoint
    from k3.train.trainer import Trainer
    tr = Trainer(tiny(tmp_path / "run", fp8=True, steps=2, eval_every=0, save_every=2, curriculum="none"))
    assert sum(type(m) is fp8.Float8Linear for m in tr.model.modules()) > 10
    summary = tr.fit()
    assert summary["finished"] and summary["step"] == 2 and math.isfinite(summary["loss"])
    loaded = K3ForConditionalGeneration.from_pretrained(latest_checkpoint(tmp_path / "run"))
    assert not any(type(m) is fp8.Float8Linear for m in loaded.modules())
    want, got = tr.model.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    k = next(k for k in want if k.endswith("o_proj.weight"))
    torch.testing.assert_close(got[k], want[k].to(got[k].device, got[k].dtype), rtol=0, atol=0)
