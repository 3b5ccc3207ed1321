"""The few-row projection kernel (`k3.ops.gemv`) against fp64 `F.linear`: the CPU interpreter here (fp32 and
bf16 inputs), CUDA on the GPU (bf16, k3-small's head and a projection); the dispatch rules of `linear`."""
import pytest
import torch
import torch.nn.functional as F

from conftest import rel_rmse
from k3.ops import gemv
from k3.ops.gemv import triton as gemv_triton

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("one_thread")


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,config", [(1, 40, 70, (16, 32, 4, 2)), (3, 17, 300, (16, 64, 4, 2)),
                                          (16, 130, 64, (32, 128, 4, 2)), (5, 96, 33, None),
                                          (20, 70, 150, (32, 64, 4, 2)), (64, 40, 48, (16, 16, 4, 2)),
                                          (45, 33, 40, None)])
def test_gemv_matches_fp64_linear(M, N, K, config, dtype):
    """Masked row and column blocks (N, K not multiples of the blocks), 1 to 64 rows (MMA tiles of 16, 32 and
    64 rows, the last two partly padding), several column chunks;
    fp32 accumulation of the inputs' exact products: within 1e-6 of fp64 on the inputs as given."""
    g = rng(M * 1000 + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    ref = F.linear(x.double(), w.double())
    with torch.no_grad():
        for out in (None, torch.float32):
            y = gemv_triton.gemv(x.to(DEV), w.to(DEV), out, config=config)
            assert y.dtype == (out or dtype) and y.shape == (M, N)
            tol = 1e-6 if y.dtype == torch.float32 else 8e-3  # bf16 output: one rounding
            assert rel_rmse(ref, y.cpu()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,tail", [(1, 72, 8), (3, 40, 24)])
def test_gemv_fp32_tail_matches_fp64(M, N, tail, dtype):
    """The last `tail` output columns (the router's logits) stored unrounded in fp32, the rest in x's dtype: the
    tail within 1e-6 of fp64 also for bf16 inputs (their products are exact in fp32), the head as without a
    tail; the tail's block boundary falls inside a program's rows (BN 16); `linear_fp32_tail`'s plain path (CPU)
    gives the same; a tail with an accumulator, or not inside N, is refused."""
    g = rng(M * 100 + N)
    K = 50
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    ref = F.linear(x.double(), w.double())
    with torch.no_grad():
        y, t = gemv_triton.gemv(x.to(DEV), w.to(DEV), config=(16, 32, 4, 2), fp32_tail=tail)
        plain = gemv.linear_fp32_tail(x, w, tail)
        with pytest.raises(ValueError, match="fp32_tail"):
            gemv_triton.gemv(x.to(DEV), w.to(DEV), fp32_tail=N)
        with pytest.raises(ValueError, match="fp32_tail"):
            gemv_triton.gemv(x.to(DEV), w.to(DEV), add=torch.zeros(M, N, dtype=dtype, device=DEV), fp32_tail=2)
    assert y.shape == (M, N - tail) and y.dtype == dtype and t.shape == (M, tail) and t.dtype == torch.float32
    assert rel_rmse(ref[:, -tail:], t.cpu()) <= 1e-6
    assert rel_rmse(ref[:, :-tail], y.cpu()) <= (1e-6 if dtype == torch.float32 else 8e-3)
    for a, b in zip(plain, (y, t)):
        assert a.dtype == b.dtype and rel_rmse(a.double(), b.cpu()) <= (1e-6 if a.dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,row", [(37, 70, (4, 32, 4)), (130, 300, (8, 128, 2)), (96, 33, (4, 256, 4))])
def test_gemv_row_form_matches_fp64(N, K, row, dtype):
    """The one-row form (`gemv_row_kernel`): ragged row tiles and column chunks (a chunk wider than K included),
    with and without an accumulator and an fp32 tail; fp32 sums of exact products, within 1e-6 of fp64 before the
    output's rounding. `ROW` on takes it for one plain row; a prologue or several rows with it are refused."""
    g = rng(N * 7 + K)
    x = torch.randn(1, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    add = torch.randn(1, N, generator=g).to(dtype)
    ref = F.linear(x.double(), w.double())
    xd, wd, ad = x.to(DEV), w.to(DEV), add.to(DEV)
    with torch.no_grad():
        for out in (None, torch.float32):
            y = gemv_triton.gemv(xd, wd, out, row=row)
            assert y.dtype == (out or dtype) and y.shape == (1, N)
            assert rel_rmse(ref, y.cpu()) <= (1e-6 if y.dtype == torch.float32 else 8e-3)
        y = gemv_triton.gemv(xd, wd, torch.float32, add=ad, row=row)
        assert rel_rmse(ref + add.double(), y.cpu()) <= 1e-6
        y, t = gemv_triton.gemv(xd, wd, fp32_tail=5, row=row)
        assert t.dtype == torch.float32 and rel_rmse(ref[:, -5:], t.cpu()) <= 1e-6
        assert y.shape == (1, N - 5) and rel_rmse(ref[:, :-5], y.cpu()) <= (1e-6 if dtype == torch.float32 else 8e-3)
        with pytest.raises(ValueError, match="one-row form"):
            gemv_triton.gemv(torch.cat([xd, xd]), wd, row=row)
        with pytest.raises(ValueError, match="one-row form"):
            gemv_triton.gemv(xd, wd, gate=xd, row=row)


def test_gemv_row_switch(monkeypatch):
    """With `ROW` on, one plain row within `row_launch`'s widths takes the row kernel (its launch recorded), and the
    result equals an explicit row launch bitwise; several rows, a prologue or a wider output keep the MMA form."""
    launched = []
    real = gemv_triton.gemv_row_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]
    monkeypatch.setattr(gemv_triton, "gemv_row_kernel", Spy())
    monkeypatch.setattr(gemv_triton, "ROW", True)
    monkeypatch.setattr(gemv_triton, "ROW_MAX_N", 64)
    monkeypatch.setattr(gemv_triton, "ROW_K", (16, 64))
    g = rng(3)
    x, w = torch.randn(1, 48, generator=g).to(DEV), torch.randn(40, 48, generator=g).to(DEV)
    with torch.no_grad():
        a = gemv_triton.gemv(x, w)
        b = gemv_triton.gemv(x, w, row=gemv_triton.row_launch(40, 48))
        assert len(launched) == 2 and torch.equal(a, b)
        gemv_triton.gemv(torch.cat([x, x]), w)
        gemv_triton.gemv(x, w, gate=x)
        gemv_triton.gemv(x, torch.randn(80, 48, generator=g).to(DEV))  # wider than ROW_MAX_N
    assert len(launched) == 2


def test_row_launch_takes_the_shapes_where_the_row_form_won():
    """`row_launch` at k3-small's batch-1 decode shapes: the settings `probe/gemv.py` found fastest on the H200 for
    the narrow projections, the MMA form (None) for the wide outputs and for inputs outside ROW_K."""
    expect = {(512, 1536): (2, 256, 2), (320, 1536): (2, 256, 2), (768, 1536): (2, 256, 2),
              (2304, 512): (8, 256, 4), (1536, 768): (8, 256, 4), (1536, 1536): (4, 256, 4),
              (2048, 1536): (4, 256, 4), (1536, 1024): (4, 256, 4),
              (6336, 1536): None, (12288, 1536): None, (163840, 1536): None, (1536, 128): None, (1536, 6144): None}
    assert {nk: gemv_triton.row_launch(*nk) for nk in expect} == expect


def test_gemv_reads_strided_weights_and_keeps_leading_dims():
    """A weight that is a row slice of a wider matrix (row stride > K) and x [B, T, K] → [B, T, N]."""
    g = rng(7)
    wide = torch.randn(50, 48, generator=g)
    w = wide[:, :40]
    x = torch.randn(2, 3, 40, generator=g)
    with torch.no_grad():
        y = gemv_triton.gemv(x.to(DEV), w.to(DEV), config=(16, 16, 4, 2))
    assert y.shape == (2, 3, 50)
    assert rel_rmse(F.linear(x.double(), w.double()), y.cpu()) <= 1e-6


def test_wide_row_switches(monkeypatch):
    """K3_GEMV_WIDE takes 17-32 rows to the kernel, K3_GEMV_WIDE_64 also 33-64 (a prefix hit's 64-row tail); a
    40-row input follows the second switch, a 20-row input the first; K3_GEMV_MAX_ROWS=0 turns every path off."""
    w = torch.randn(24, 32).to(DEV)
    for wide, w64, limit in ((False, True, 16), (True, False, 32), (True, True, 64)):
        monkeypatch.setattr(gemv, "MAX_ROWS", 16)
        monkeypatch.setattr(gemv, "WIDE", wide)
        monkeypatch.setattr(gemv, "WIDE_64", w64)
        assert gemv.max_rows() == gemv.max_rows(w) == limit
        with torch.no_grad():
            for rows in (16, 20, 40, 64, 65):
                assert gemv.fits(torch.randn(rows, 32).to(DEV), w) == (CUDA and rows <= limit), (wide, w64, rows)
        monkeypatch.setattr(gemv, "MAX_ROWS", 0)
        assert gemv.max_rows() == 0


def test_linear_dispatch():
    """`linear` takes the kernel for ≤ `max_rows()` rows without autograd, else F.linear (same values); the
    output dtype is honoured on both paths; bad shapes name the sizes."""
    g = rng(3)
    w = torch.randn(24, 32, generator=g).to(DEV)
    few, many = torch.randn(2, 32, generator=g).to(DEV), torch.randn(gemv.max_rows() + 1, 32, generator=g).to(DEV)
    assert gemv.max_rows() <= gemv_triton.MAX_TILE_ROWS  # the kernel's widest MMA tile
    with torch.no_grad():
        assert gemv.fits(few, w) == CUDA  # the interpreter only through direct calls
        assert not gemv.fits(many, w)
        for x in (few, many):
            y = gemv.linear(x, w, torch.float64 if not CUDA else None)
            assert rel_rmse(F.linear(x.double(), w.double()).cpu(), y.cpu()) <= 1e-6
    # more than MAX_ROWS rows (a wide tile): only for the shapes where it beat cuBLAS (short inputs, wide outputs)
    K = gemv.WIDE_MAX_K + 8
    wide, long_in = torch.randn(gemv.MAX_ROWS + 5, 32, generator=g), torch.randn(gemv.MAX_ROWS + 5, K, generator=g)
    w_long, w_tall = torch.randn(24, K, generator=g), torch.randn(gemv.WIDE_MIN_N, K, generator=g)
    assert gemv.max_rows(w_long) == gemv.MAX_ROWS and gemv.max_rows(w_tall) == gemv.max_rows()
    with torch.no_grad():
        assert gemv.fits(wide.to(DEV), w) == (CUDA and gemv.WIDE)
        assert not gemv.fits(long_in.to(DEV), w_long.to(DEV))
        assert gemv.fits(long_in.to(DEV), w_tall.to(DEV)) == (CUDA and gemv.WIDE)
        assert gemv.fits(long_in[:2].to(DEV), w_long.to(DEV)) == CUDA  # up to MAX_ROWS rows: any shape
    assert not gemv.fits(few.requires_grad_(), w)  # grad mode on: the autograd path
    with pytest.raises(ValueError, match="33 columns"):
        gemv_triton.gemv(torch.zeros(1, 33), torch.zeros(4, 32))
    with pytest.raises(ValueError, match="at most 64"):
        gemv_triton.gemv(torch.zeros(65, 32), torch.zeros(4, 32))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N,K,M", [(163840, 1536, 1), (6336, 1536, 4), (1536, 128, 16), (2304, 512, 64),
                                   (1536, 768, 40), (12288, 1536, 24)])
def test_cuda_gemv_bf16_equals_cublas(N, K, M):
    """k3-small shapes in bf16 with the default launch settings (1-16 rows, and wide tiles on the shapes `linear`
    gives them): fp32 output within 1e-5 of fp64 (the head's logits), bf16 output within one rounding of cuBLAS."""
    g = torch.Generator(device="cuda").manual_seed(N + M)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    with torch.no_grad():
        ref = F.linear(x.double(), w.double())
        assert gemv.fits(x, w)
        assert rel_rmse(ref, gemv.linear(x, w, torch.float32)) <= 1e-5
        assert rel_rmse(F.linear(x, w).double(), gemv.linear(x, w)) <= 8e-3


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N,K", [(512, 1536), (320, 1536), (1536, 1024), (2304, 512), (1536, 1536), (2048, 1536)])
def test_cuda_row_form_bf16(N, K, monkeypatch):
    """The one-row form at k3-small's decode shapes that `row_launch` takes, in bf16 (`ROW` on, its launch): fp32
    output within 1e-5 of fp64, bf16 within one rounding of cuBLAS; a CUDA graph of it replays bitwise equal to
    eager."""
    monkeypatch.setattr(gemv_triton, "ROW", True)
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    with torch.no_grad():
        assert gemv_triton.row_launch(N, K) is not None
        ref = F.linear(x.double(), w.double())
        assert rel_rmse(ref, gemv.linear(x, w, torch.float32)) <= 1e-5
        eager = gemv.linear(x, w)
        assert rel_rmse(F.linear(x, w).double(), eager) <= 8e-3
        graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph):
            out = gemv.linear(x, w)
        torch.cuda.current_stream().wait_stream(s)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_linear_with_an_accumulator_matches_addmm():
    """y = x W^T + add (the MoE up projection onto the shared experts' output): kernel and cuBLAS paths."""
    g = rng(11)
    x, w, add = torch.randn(3, 40, generator=g), torch.randn(20, 40, generator=g), torch.randn(3, 20, generator=g)
    ref = torch.addmm(add.double(), x.double(), w.double().t())
    with torch.no_grad():
        got = gemv.linear(x.to(DEV), w.to(DEV), add=add.to(DEV))
        assert gemv.fits(x.to(DEV), w.to(DEV), add.to(DEV)) == CUDA
    assert rel_rmse(ref, got.cpu()) <= 1e-6
    big = torch.randn(gemv.max_rows() + 2, 40, generator=g)  # cuBLAS
    badd = torch.randn(gemv.max_rows() + 2, 20, generator=g)
    with torch.no_grad():
        got = gemv.linear(big.to(DEV), w.to(DEV), add=badd.to(DEV))
    assert rel_rmse(torch.addmm(badd.double(), big.double(), w.double().t()), got.cpu()) <= 1e-6
    # add_inplace: the cuBLAS path accumulates into the caller's temporary (the same values, no new output) ...
    tmp = badd.clone().to(DEV)
    with torch.no_grad():
        got2 = gemv.linear(big.to(DEV), w.to(DEV), add=tmp, add_inplace=True)
    assert got2.data_ptr() == tmp.data_ptr() and torch.equal(got2, got)
    # ... but never into an add of another dtype, a strided one, or under autograd
    for a, grad in ((badd.double().to(DEV), False), (torch.randn(20, gemv.max_rows() + 2).t().to(DEV), False),
                    (badd.clone().to(DEV), True)):
        before = a.clone()
        with torch.set_grad_enabled(grad):
            out = gemv.linear(big.to(DEV), w.to(DEV), add=a, add_inplace=True)
        assert out.data_ptr() != a.data_ptr() and torch.equal(a, before)
    with pytest.raises(ValueError, match="add has shape"):
        gemv_triton.gemv(x, w, add=torch.zeros(2, 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_gated_input(dtype):
    """(x ⊙ σ(gate)) W^T + add (the MLA output gate and the residual; gate a column slice of a wider tensor)
    against fp64: fp32 within 1e-6, bf16 (the gated input rounded once, as the kernel feeds the MMA) within 8e-3."""
    g = rng(5)
    M, K, N = 3, 70, 40
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * K ** -0.5
    gate_wide, add = torch.randn(M, K + 9, generator=g), torch.randn(M, N, generator=g)
    gate = gate_wide[:, 3:3 + K]
    cast = lambda t: t.to(dtype).to(DEV)  # noqa: E731
    xd, gd, wd, ad = (cast(t).double().cpu() for t in (x, gate, w, add))
    ref_gated = F.linear(xd * torch.sigmoid(gd), wd) + ad
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    with torch.no_grad():
        got = gemv_triton.gemv(cast(x), cast(w), torch.float32, add=cast(add), gate=cast(gate_wide)[:, 3:3 + K],
                               config=(16, 32, 4, 2))
        assert rel_rmse(ref_gated, got.cpu()) <= tol
        # the dispatch point's fallback (CPU tensors) computes the same
        assert rel_rmse(ref_gated, gemv.linear(xd, wd, add=ad, gate=gd)) <= 1e-12
    with pytest.raises(ValueError, match="gate has shape"):
        gemv_triton.gemv(x, w, gate=torch.zeros(M, K + 1))


def _fp64_prologue(x, gate=None, norm=None, glu=None):
    """The prologue in fp64 from its definitions (independent of `k3.ops.gemv.prologue`)."""
    if glu is not None:
        b1, b2 = glu
        K = x.shape[-1] // 2
        g, u = x[..., :K], x[..., K:]
        x = b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)
    if norm is not None:
        nw, eps, group = norm
        xs = x.reshape(*x.shape[:-1], -1, group or x.shape[-1])
        xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps) * nw
        x = xs.reshape(x.shape)
    if gate is not None:
        x = x * torch.sigmoid(gate)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["row-norm", "head-norm-gate", "glu", "glu-row-norm", "gate"])
@pytest.mark.parametrize("M", [1, 3])
def test_gemv_prologues_match_fp64(kind, dtype, M):
    """The GEMV's input prologues (`linear(..., norm=, glu=, gate=)`) against their fp64 definitions, with a
    residual added: RMSNorm of the row (the MoE's latent norm before the up projection, MLA's q_a norm: the rstd
    scales the accumulator), per-head RMSNorm with the output gate (KDA's o_norm before o_proj), SiTU-GLU of a
    gate ‖ up input (the shared experts' down projection), the gate alone (MLA). One row (a batch-1 decode: the
    prologue on a [1, CH] tile) and three. x is a row slice of a wider tensor. fp32 within 1e-6;
    bf16 within 1e-2 (the prologue's output rounded once to bf16, as the MMA reads it, where the separate kernels
    round it too). The dispatch point's plain-ops fallback equals the definitions to 1e-12 in fp64."""
    g = rng(len(kind) * 10 + M)
    K, N, group = 64, 40, 16
    glu = (4.0, 25.0) if kind.startswith("glu") else None
    width = 2 * K if glu else K
    wide = torch.randn(M, width + 5, generator=g) * 2
    w = torch.randn(N, K, generator=g) * K ** -0.5
    add = torch.randn(M, N, generator=g)
    norm = gate = None
    if "norm" in kind:
        grp = group if kind.startswith("head") else None
        norm = (torch.rand(grp or K, generator=g) + 0.5, 1e-5, grp)
    if "gate" in kind:
        gate = torch.randn(M, K, generator=g)
    cast = lambda t: None if t is None else t.to(dtype).to(DEV)  # noqa: E731
    dd = lambda t: None if t is None else cast(t).double().cpu()  # noqa: E731
    x = wide[:, 2:2 + width]
    normd = None if norm is None else (dd(norm[0]), norm[1], norm[2])
    ref = F.linear(_fp64_prologue(dd(x), dd(gate), normd, glu), dd(w)) + dd(add)
    with torch.no_grad():
        got = gemv_triton.gemv(cast(wide)[:, 2:2 + width], cast(w), torch.float32, add=cast(add), gate=cast(gate),
                               norm=None if norm is None else (cast(norm[0]), norm[1], norm[2]), glu=glu,
                               config=(16, 32, 4, 2))
        assert rel_rmse(ref, got.cpu()) <= (1e-6 if dtype == torch.float32 else 1e-2)
        plain = gemv.linear(dd(x), dd(w), add=dd(add), gate=dd(gate), norm=normd, glu=glu)
    assert rel_rmse(ref, plain) <= 1e-12


def test_gemv_prologue_errors():
    """Bad prologue operands name the sizes: a glu input that is not [M, 2K], a norm weight of the wrong length,
    a norm group that does not divide K."""
    x, w = torch.zeros(1, 32), torch.zeros(8, 32)
    with pytest.raises(ValueError, match="expects 64"):
        gemv_triton.gemv(x, w, glu=(4.0, 25.0))
    with pytest.raises(ValueError, match="norm weight"):
        gemv_triton.gemv(x, w, norm=(torch.ones(16), 1e-5, None))
    with pytest.raises(ValueError, match="groups of 24"):
        gemv_triton.gemv(x, w, norm=(torch.ones(24), 1e-5, 24))
    assert not gemv._prologue_fits((torch.ones(24), 1e-5, 24), 32) and gemv._prologue_fits(None, 32)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind,N,K", [("head-norm-gate", 1536, 1536), ("glu", 1536, 1024), ("row-norm", 1536, 768),
                                      ("row-norm", 2304, 512)])
def test_cuda_prologues_bf16_equal_the_separate_kernels(kind, N, K, monkeypatch):
    """k3-small's decode shapes in bf16 (KDA o_proj after o_norm and its gate, the shared experts' down after
    SiTU-GLU, the MoE up projection after its latent norm, MLA q_b after q_a_layernorm), one row with a residual:
    the GEMV with the prologue (`PROLOGUE = True`) against the norm / SiTU kernel then the GEMV (the default) and
    fp64."""
    g = torch.Generator(device="cuda").manual_seed(N + K)
    glu = (4.0, 25.0) if kind == "glu" else None
    x = torch.randn(1, 2 * K if glu else K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    add = torch.randn(1, N, device="cuda", generator=g).bfloat16()
    gate = torch.randn(1, K, device="cuda", generator=g).bfloat16() if "gate" in kind else None
    norm = None
    if "norm" in kind:
        grp = 128 if kind.startswith("head") else None
        norm = ((torch.rand(grp or K, device="cuda", generator=g) + 0.5).bfloat16(), 1e-5, grp)
    with torch.no_grad():
        ref = F.linear(_fp64_prologue(x.double(), None if gate is None else gate.double(),
                                      None if norm is None else (norm[0].double(), norm[1], norm[2]), glu),
                       w.double()) + add.double()
        monkeypatch.setattr(gemv, "PROLOGUE", True)
        fused = gemv.linear(x, w, add=add, gate=gate, norm=norm, glu=glu)
        monkeypatch.setattr(gemv, "PROLOGUE", False)
        separate = gemv.linear(x, w, add=add, gate=gate, norm=norm, glu=glu)
    assert rel_rmse(ref, fused) <= 1e-2 and rel_rmse(ref, separate) <= 1e-2
    assert rel_rmse(separate.double(), fused) <= 1e-2
