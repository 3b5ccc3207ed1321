"""The fused Block AttnRes op (`k3.ops.attn_res`, backends "torch" and "triton") against the stacking reference.

Metric: relative RMS error ||ref - x|| / ||ref|| (conftest.rel_rmse) of the output and of the gradient of every
source, query and norm_weight, each against autograd through `attn_res_reference` on the same values.
Bars: torch backend in fp64 on CPU 1e-10 (the math is exact up to rounding, ~1e-15 measured); Triton through the
interpreter in fp32 against the fp64 reference 1e-5 (measured ~1e-6); mixed fp32 / bf16 sources 1e-5 on fp32
results, 1e-2 on bf16 gradients (one bf16 rounding); CUDA bf16 sources against the fp32 reference on the upcast
inputs 1e-2. The memory test counts the bytes autograd saves (saved_tensors_hooks). The Triton kernels run for
N = 1..10 with several row blocks and D tiles, both ragged (interpreter, fp32); on CUDA every launch setting of
the sweep (`k3.ops.attn_res.triton.SWEEP`) runs once against the reference.
"""
import time

import pytest
import torch

from conftest import rel_rmse
from k3.ops.attn_res import BACKENDS, attn_res, attn_res_reference

CUDA = torch.cuda.is_available()
EPS = 1e-5


def make(N, shape, seed, dtypes=None, grads=None, scale_query=1.0):
    """N sources of `shape` with distinct scales, query [1, D], norm_weight [D], upstream gradient; fp64 values
    (converted per source to dtypes[i]); grads[i] says whether source i requires grad."""
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    src = [torch.randn(*shape, generator=g, dtype=torch.float64) * (0.5 + i) + 0.1 * i for i in range(N)]
    query = torch.randn(1, D, generator=g, dtype=torch.float64) * scale_query
    norm_w = 1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    dh = torch.randn(*shape, generator=g, dtype=torch.float64)
    dtypes = dtypes or [torch.float64] * N
    grads = grads if grads is not None else [True] * N
    return [s.to(dt) for s, dt in zip(src, dtypes)], query, norm_w, dh, grads


def run(fn, src, query, norm_w, dh, grads, dtype=None, param_grad=True, device="cpu", **kw):
    """fn(sources, query, norm_weight, eps, **kw) on fresh leaves (sources in their own dtype unless `dtype`);
    returns (output, [grad of each source or None], grad query, grad norm_weight)."""
    leaves = [s.detach().to(device, dtype or s.dtype).requires_grad_(r) for s, r in zip(src, grads)]
    q = query.detach().to(device, dtype or query.dtype).requires_grad_(param_grad)
    n = norm_w.detach().to(device, dtype or norm_w.dtype).requires_grad_(param_grad)
    h = fn(leaves, q, n, EPS, **kw)
    if any(grads) or param_grad:
        (h.double() * dh.to(device)).sum().backward()
    return h.detach(), [t.grad for t in leaves], q.grad, n.grad


def check(ref, out, tol, grad_tol=None):
    """Compare run() results; returns the errors by name."""
    errs = {"h": rel_rmse(ref[0], out[0])}
    for i, (r, o) in enumerate(zip(ref[1], out[1])):
        assert (r is None) == (o is None), f"source {i}: gradient presence differs ({r is None} vs {o is None})"
        if r is not None:
            errs[f"dv{i}"] = rel_rmse(r, o)
    for name, r, o in (("dquery", ref[2], out[2]), ("dnorm", ref[3], out[3])):
        assert (r is None) == (o is None), f"{name}: gradient presence differs"
        if r is not None:
            errs[name] = rel_rmse(r, o)
    print({k: f"{v:.1e}" for k, v in errs.items()})  # shown with pytest -s
    bad = {k: v for k, v in errs.items() if v > (tol if k == "h" or grad_tol is None else grad_tol)}
    assert not bad, f"over tolerance: {bad}"
    return errs


def reference(sources, query, norm_w, eps):
    return attn_res(sources, query, norm_w, eps, backend="reference")


# ---------------------------------------------------------------- torch backend, fp64, CPU
@pytest.mark.parametrize("N", [1, 2, 5])
@pytest.mark.parametrize("shape", [(2, 7, 24), (13, 24)])
@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_torch_backend_matches_reference_fp64(N, shape, chunk_rows):
    """Values and all gradients; chunk_rows=4 splits the rows into several chunks (with a ragged last one);
    for N = 5 sources 1 and 3 need no gradient (they must get None)."""
    grads = [i % 2 == 0 for i in range(N)] if N == 5 else None
    x = make(N, shape, seed=N * 10 + len(shape), grads=grads)
    ref = run(reference, *x)
    out = run(attn_res, *x, backend="torch", chunk_rows=chunk_rows)
    assert out[0].dtype == torch.float64 and out[0].shape == shape
    check(ref, out, 1e-10)


def test_torch_backend_only_parameter_or_only_source_grads():
    """needs_input_grad: sources frozen (only query / norm_weight grads), then parameters frozen."""
    x = make(3, (9, 16), seed=5, grads=[False, False, False])
    check(run(reference, *x), run(attn_res, *x, backend="torch", chunk_rows=4), 1e-10)
    x = make(3, (9, 16), seed=6)
    check(run(reference, *x, param_grad=False), run(attn_res, *x, param_grad=False, backend="torch"), 1e-10)


def test_torch_backend_large_scores():
    """Softmax stability: a large query makes the scores span hundreds (near one-hot α). The parameter gradients
    then come from ds = α(dα − Σαdα), a difference of nearly equal terms that both sides round differently
    (measured ~2e-9 in fp64): gradients to 1e-6, values to 1e-10."""
    x = make(4, (11, 32), seed=7, scale_query=40.0)
    out = run(attn_res, *x, backend="torch")
    assert all(torch.isfinite(t).all() for t in [out[0], *out[1], out[2], out[3]])
    check(run(reference, *x), out, 1e-10, grad_tol=1e-6)


def test_mixed_dtype_sources_keep_reference_semantics():
    """An fp32 embedding with bf16 block outputs: output in the promoted dtype (fp32), each gradient in its
    source's dtype, values as the reference computes them on the same inputs."""
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16]
    x = make(3, (3, 5, 32), seed=11, dtypes=dtypes)
    ref = run(reference, *x)
    out = run(attn_res, *x)  # auto: torch on CPU (the kernels need one dtype)
    assert out[0].dtype == torch.float32
    assert [g.dtype for g in out[1]] == dtypes
    assert out[2].dtype == out[3].dtype == torch.float64
    errs = check(ref, out, 1e-5, grad_tol=1e-2)
    assert errs["dv0"] < 1e-5  # the fp32 source's gradient has no bf16 rounding


def test_autocast_does_not_lower_the_statistics():
    """Under CPU bf16 autocast the op still computes in fp32 (autocast is off inside): same result as without."""
    x = make(3, (6, 32), seed=12, dtypes=[torch.float32] * 3)
    ref = run(reference, *x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(attn_res, *x, backend="torch")
    assert out[0].dtype == torch.float32
    check(ref, out, 1e-6)


def test_saved_tensors_are_the_sources_plus_per_row_stats():
    """What autograd keeps for backward: the sources themselves (no copies), query and norm_weight, and
    O(N * rows) statistics -- against the reference, which keeps several [N, rows, D] tensors."""
    N, R, D = 5, 64, 48
    src, query, norm_w, _, _ = make(N, (R, D), seed=13)
    src = [s.requires_grad_() for s in src]
    query, norm_w = query.requires_grad_(), norm_w.requires_grad_()
    ptrs = {s.data_ptr() for s in src}

    def saved_bytes(backend):
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attn_res(src, query, norm_w, EPS, backend=backend)
        own = {t.data_ptr() for t in saved if t.data_ptr() in ptrs}
        extra = sum(t.numel() * t.element_size() for t in saved
                    if t.data_ptr() not in ptrs and t.data_ptr() not in (query.data_ptr(), norm_w.data_ptr()))
        return own, extra

    own, extra = saved_bytes("torch")
    assert own == ptrs, "every source is saved by reference"
    assert extra <= 2 * N * R * 8, f"saved {extra} bytes beyond the sources; expected <= 2*N*rows fp64"
    _, extra_ref = saved_bytes("reference")
    assert extra_ref >= 2 * N * R * D * 8  # the oracle's fp64 stacks: the measurement sees them


def test_dispatch_and_errors():
    x = make(2, (4, 8), seed=14)[:3]
    src, query, norm_w = x
    assert torch.equal(attn_res(src, query, norm_w, EPS, backend="reference"),
                       attn_res_reference(src, query, norm_w, EPS))
    assert "auto" in BACKENDS
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        attn_res(src, query, norm_w, EPS, backend="cuda")
    with pytest.raises(ValueError, match=r"sources\[1\] has shape \(4, 9\), expected \(4, 8\)"):
        attn_res([src[0], torch.randn(4, 9, dtype=torch.float64)], query, norm_w, EPS)
    with pytest.raises(ValueError, match=r"query has shape \(1, 7\), expected \[8\] or \[1, 8\]"):
        attn_res(src, query[:, :7], norm_w, EPS)
    with pytest.raises(ValueError, match="at least one source"):
        attn_res([], query, norm_w, EPS)


@pytest.mark.skipif(CUDA, reason="CPU dispatch")
def test_auto_is_torch_on_cpu(monkeypatch):
    import k3.ops.attn_res.fused as F
    calls = []
    fwd = F.forward_torch
    monkeypatch.setattr(F, "forward_torch", lambda *a, **k: calls.append(1) or fwd(*a, **k))
    src, query, norm_w = make(2, (4, 8), seed=15)[:3]
    attn_res([s.float() for s in src], query.float(), norm_w.float(), EPS)
    assert calls == [1]


# ---------------------------------------------------------------- Triton: interpreter on CPU, GPU with CUDA
triton = pytest.importorskip("triton")
import k3.ops.attn_res.triton as AT  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
SMALL = dict(fwd=dict(block_r=8, block_d=16), bwd=dict(block_r=8, block_d=16))  # row blocks and D tiles


@pytest.mark.parametrize("launch", [SMALL, {}], ids=["tiled", "default"])
def test_triton_matches_reference_fp32(launch, one_thread):
    """D = 48 in tiles of 16 (3 tiles), N = 3, 37 rows in blocks of 8 (5 programs, the last one ragged);
    and the default launch (one D tile, one row block)."""
    x = make(3, (37, 48), seed=21)
    ref = run(reference, *x)
    out = run(attn_res, *x, dtype=torch.float32, device=DEV, backend="triton", **launch)
    check(ref, out, 1e-5)


def test_triton_partial_gradients(one_thread):
    """A source without gradient (table entry 0: no dv written) and frozen query / norm_weight (no dw)."""
    x = make(3, (19, 48), seed=22, grads=[True, False, True])
    for param_grad in (False, True):
        ref = run(reference, *x, param_grad=param_grad)
        out = run(attn_res, *x, dtype=torch.float32, device=DEV, param_grad=param_grad, backend="triton", **SMALL)
        check(ref, out, 1e-5)


RAGGED = dict(fwd=dict(block_r=8, block_d=16), bwd=dict(block_r=8, block_d=16))


@pytest.mark.parametrize("N", range(1, 11))
def test_triton_every_n_ragged_blocks(N, one_thread):
    """N = 1..10 (NP = 2..16), 37 rows in blocks of 8 (5 programs, the last holding 5 rows) and D = 40 in tiles
    of 16 (the last holding 8 columns): values and every gradient against the fp64 reference, 1e-5 (fp32 kernels;
    measured ~1e-7). Source 1 (N >= 2) needs no gradient: its table entry is 0 and nothing is written for it."""
    x = make(N, (37, 40), seed=40 + N, grads=[i != 1 for i in range(N)])
    ref = run(reference, *x)
    out = run(attn_res, *x, dtype=torch.float32, device=DEV, backend="triton", **RAGGED)
    check(ref, out, 1e-5)


def test_triton_forward_keeps_alpha_rstd_and_scores(one_thread):
    """What the forward kernel saves for its backward, [N, rows] fp32 each: α, rstd and the scores s (only the
    backward reads s, so a wrong s would show only in gradients), against fp64 formulas, 1e-5."""
    N, R, D = 5, 21, 40
    src, query, norm_w, _, _ = make(N, (R, D), seed=50)
    v = torch.stack([s.float().double() for s in src])  # the fp32 inputs, in fp64: [N, R, D]
    w = (query.reshape(-1) * norm_w).float()
    h, alpha, rstd, s = AT.attn_res_fwd_triton([t.float().to(DEV) for t in src], w.to(DEV), EPS, block_r=8,
                                               block_d=16)
    rstd_ref = torch.rsqrt(v.pow(2).mean(-1) + EPS)
    s_ref = (v @ w.double()) * rstd_ref
    alpha_ref = torch.softmax(s_ref, 0)
    h_ref = (alpha_ref.unsqueeze(-1) * v).sum(0)
    for name, ref, got in (("h", h_ref, h), ("alpha", alpha_ref, alpha), ("rstd", rstd_ref, rstd), ("s", s_ref, s)):
        assert got.shape == ref.shape and got.dtype == torch.float32, name
        assert rel_rmse(ref, got.cpu()) < 1e-5, (name, rel_rmse(ref, got.cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_forward_folds_the_query_in_kernel(dtype, one_thread):
    """`query=` (the kernel folds norm_weight ⊙ query in fp32) gives bitwise the outputs of the kernel fed the
    folded vector from `fold_query`: the same fp32 products, so the fold moved into the kernel changes nothing."""
    from k3.ops.attn_res.fused import fold_query
    src, query, norm_w, _, _ = make(4, (13, 40), seed=52)
    flat = [t.to(DEV, dtype) for t in src]
    q, n = query.to(DEV, dtype), norm_w.to(DEV, dtype)
    folded = AT.attn_res_fwd_triton(flat, fold_query(q, n, torch.float32), EPS, block_r=8, block_d=16)
    inkernel = AT.attn_res_fwd_triton(flat, n, EPS, query=q, block_r=8, block_d=16)
    for a, b in zip(folded, inkernel):
        assert torch.equal(a, b)


@pytest.mark.parametrize("N,D", [(1, 40), (5, 48), (8, 1100)])
def test_rows_kernel_equals_the_block_kernel(N, D, one_thread):
    """The one-program-per-row inference kernel against the block kernel (fp32: same math, sums in another
    order, 1e-6) and the fp64 oracle (1e-5), with and without the norm epilogue, N = 1 (NP padded to 2) to 8."""
    src, query, norm_w, _, _ = make(N, (7, D), seed=53 + N)
    flat = [t.to(DEV, torch.float32) for t in src]
    q, n = query.to(DEV, torch.float32), norm_w.to(DEV, torch.float32)
    nw = (1 + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(N), dtype=torch.float64)).float().to(DEV)
    ref = attn_res_reference(src, query, norm_w, EPS)
    for norm in (None, (nw, 1e-6)):
        block = AT.attn_res_fwd_triton(flat, n, EPS, norm=norm, query=q)[0]
        rows = AT.attn_res_rows_triton(flat, n, EPS, norm=norm, query=q)
        assert rel_rmse(block.double(), rows) <= 1e-6, rel_rmse(block.double(), rows)
        if norm is None:
            assert rel_rmse(ref, rows.cpu()) <= 1e-5


@pytest.mark.parametrize("N,D,R", [(1, 40, 9), (2, 48, 37), (5, 40, 37), (10, 1100, 7)])
def test_stream_kernel_equals_the_block_kernel_and_the_oracle(N, D, R, one_thread):
    """The one-pass kernel (whole rows, online softmax over the sources) against fp64 formulas of h, α, rstd and
    the scores (1e-5; fp32 kernels) and against the block kernel (same fp32 math, sums in another order: 1e-6),
    in blocks of 4 rows (R = 37: the last block ragged; loads prefetched by hand) and of 1 row (loads pipelined by
    Triton; D = 1100: 2048 columns), N = 1 (NP padded
    to 2) to 10; with the query folded in the kernel and with the norm epilogue (h only, stats=False)."""
    src, query, norm_w, _, _ = make(N, (R, D), seed=70 + N)
    flat = [t.to(DEV, torch.float32) for t in src]
    q, n = query.to(DEV, torch.float32), norm_w.to(DEV, torch.float32)
    v = torch.stack([t.float().double() for t in src])
    w = (query.reshape(-1).float() * norm_w.float()).double()
    rstd_ref = torch.rsqrt(v.pow(2).mean(-1) + EPS)
    s_ref = (v @ w) * rstd_ref
    alpha_ref = torch.softmax(s_ref, 0)
    h_ref = (alpha_ref.unsqueeze(-1) * v).sum(0)
    for block_r, stages in ((4, 0), (1, 2)):
        got = AT.attn_res_fwd_triton(flat, n, EPS, query=q, stream=dict(block_r=block_r, num_stages=stages))
        block = AT.attn_res_fwd_triton(flat, n, EPS, query=q, block_r=8, block_d=16)
        for name, ref, g, b in zip(("h", "alpha", "rstd", "s"), (h_ref, alpha_ref, rstd_ref, s_ref), got, block):
            assert g.shape == ref.shape and g.dtype == torch.float32, name
            assert rel_rmse(ref, g.cpu()) < 1e-5, (name, block_r, stages, rel_rmse(ref, g.cpu()))
            assert rel_rmse(b.double(), g) < 1e-6, (name, block_r, stages, rel_rmse(b.double(), g))
    nw = (1 + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(N), dtype=torch.float64)).float().to(DEV)
    normed = AT.attn_res_fwd_triton(flat, n, EPS, norm=(nw, 1e-6), query=q, stats=False, stream={})
    assert normed[1:] == (None, None, None)
    ref = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double().cpu()
    assert rel_rmse(ref, normed[0].cpu()) < 1e-5


def test_stream_config():
    """Whole rows of next_pow2(D) columns, rows per program capped by STREAM_MAX_TILE, warps raised to 32 tile
    elements per thread; too wide: None (the block kernel); bad values named."""
    assert AT.stream_config(1536, 2, 4, 3) == dict(block_r=2, block_d=2048, num_warps=4, num_stages=3)
    assert AT.stream_config(1536)["block_d"] == 2048 and AT.stream_config(1536)["block_r"] == AT.LAUNCH_STREAM["block_r"]
    assert AT.stream_config(7168, block_r=8, num_warps=2) == dict(block_r=1, block_d=8192, num_warps=8,
                                                                  num_stages=AT.LAUNCH_STREAM["num_stages"])
    assert AT.stream_config(40, block_r=2)["block_d"] == 64
    assert AT.stream_config(AT.STREAM_MAX_TILE + 1) is None
    for setting in AT.SWEEP_STREAM:
        assert AT.stream_config(1536, *setting)["num_stages"] == setting[2]
    with pytest.raises(ValueError, match=r"stream block_r=3, expected a power of two"):
        AT.stream_config(48, block_r=3)
    with pytest.raises(ValueError, match=r"stream num_warps=0, expected a power of two"):
        AT.stream_config(48, num_warps=0)
    with pytest.raises(ValueError, match=r"stream num_stages=-1, expected an integer >= 0"):
        AT.stream_config(48, num_stages=-1)


def test_triton_zero_rows():
    """An empty batch: empty output, empty source gradients, zero parameter gradients; no launch."""
    x = make(3, (0, 16), seed=51)
    out = run(attn_res, *x, dtype=torch.float32, device=DEV, backend="triton")
    assert out[0].shape == (0, 16) and all(g.shape == (0, 16) for g in out[1])
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.equal(out[3], torch.zeros_like(out[3]))


def test_triton_launch_settings_are_checked():
    """launch_config: LAUNCH defaults with overrides, block_d capped at D's next power of two, bad values named."""
    assert AT.launch_config("fwd", 40, block_d=1024)["block_d"] == 64
    assert AT.launch_config("bwd", 7168, block_r=None) == AT.LAUNCH["bwd"]
    for kind in ("fwd", "bwd"):
        for setting in AT.SWEEP[kind]:
            assert AT.launch_config(kind, 1536, **dict(zip(AT.SETTINGS, setting))) == dict(zip(AT.SETTINGS, setting))
    with pytest.raises(ValueError, match=r"fwd block_r=12, expected a power of two"):
        AT.launch_config("fwd", 48, block_r=12)
    with pytest.raises(ValueError, match=r"bwd num_stages=0, expected an integer >= 1"):
        AT.launch_config("bwd", 48, num_stages=0)
    with pytest.raises(ValueError, match=r"unknown bwd launch setting 'programs'; expected one of block_r"):
        AT.launch_config("bwd", 48, programs=4)
    with pytest.raises(ValueError, match=r"unknown kernel 'mid'"):
        AT.launch_config("mid", 48)


def test_triton_backend_rejects_what_the_kernels_cannot_take():
    q, n = torch.randn(16, device=DEV), torch.ones(16, device=DEV)
    src = [torch.randn(4, 16, device=DEV), torch.randn(4, 16, device=DEV, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"sources\[1\] has dtype torch.float64"):
        attn_res(src, q, n, EPS, backend="triton")
    with pytest.raises(ValueError, match=r"sources\[0\] is not contiguous"):
        attn_res([torch.randn(16, 4, device=DEV).t(), torch.randn(4, 16, device=DEV)], q, n, EPS, backend="triton")
    with pytest.raises(ValueError, match=r"sources\[1\] is not 16-byte aligned"):
        attn_res([src[0], torch.randn(65, device=DEV)[1:].view(4, 16)], q, n, EPS, backend="triton")


# ---------------------------------------------------------------- CUDA: bf16 at the model's sizes
cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("D", [1536, 7168])
def test_cuda_bf16_matches_fp32_reference(D):
    """bf16 sources (N = 6, 8192 rows) through auto (= triton) against the fp32 reference on the upcast
    inputs; fp32 query / norm_weight as under autocast. Prints a timing (not asserted)."""
    N, R = 6, 8192
    g = torch.Generator(device="cuda").manual_seed(D)
    src = [(torch.randn(R, D, device="cuda", generator=g) * (0.5 + i)).bfloat16() for i in range(N)]
    query = torch.randn(1, D, device="cuda", generator=g)
    norm_w = 1 + 0.3 * torch.randn(D, device="cuda", generator=g)
    dh = torch.randn(R, D, device="cuda", generator=g).bfloat16()

    def go(fn, upcast, **kw):
        leaves = [(s.float() if upcast else s.detach()).requires_grad_() for s in src]
        q, n = query.clone().requires_grad_(), norm_w.clone().requires_grad_()
        h = fn(leaves, q, n, EPS, **kw)
        h.backward(dh.to(h.dtype))
        return [h] + [t.grad for t in leaves] + [q.grad, n.grad]

    ref = go(attn_res_reference, True)
    out = go(attn_res, False)
    assert out[0].dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in out[1:N + 1])
    names = ["h"] + [f"dv{i}" for i in range(N)] + ["dquery", "dnorm"]
    errs = {n: rel_rmse(r, o) for n, r, o in zip(names, ref, out)}
    print({k: f"{v:.1e}" for k, v in errs.items()})
    assert all(torch.isfinite(o).all() for o in out)
    assert max(errs.values()) <= 1e-2, errs
    again = go(attn_res, False)
    assert all(torch.equal(a, b) for a, b in zip(out, again)), "the backward is deterministic"

    leaves = [s.requires_grad_() for s in src]
    q, n = query.clone().requires_grad_(), norm_w.clone().requires_grad_()
    for name, fn in (("reference", attn_res_reference), ("fused", attn_res)):
        fwd = _ms(lambda: fn(leaves, q, n, EPS))
        both = _ms(lambda: fn(leaves, q, n, EPS).backward(dh))
        print(f"D={D} N={N} rows={R} {name}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms")


def _cuda_inputs(N, R, D, dtype, seed):
    """Sources of distinct scales, a query giving scores of a few units (~0.1·sqrt(D)), fp32 parameters."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    src = [(torch.randn(R, D, device="cuda", generator=g) * (0.5 + i) + 0.1 * i).to(dtype) for i in range(N)]
    query = 0.1 * torch.randn(1, D, device="cuda", generator=g)
    norm_w = 1 + 0.3 * torch.randn(D, device="cuda", generator=g)
    dh = torch.randn(R, D, device="cuda", generator=g).to(dtype)
    return src, query, norm_w, dh


def _cuda_grads(fn, src, query, norm_w, dh, upcast=None, **kw):
    """[h, dv_0.., dquery, dnorm] of fn on fresh leaves (all inputs upcast to `upcast` for the reference)."""
    leaves = [s.detach().to(upcast or s.dtype).requires_grad_() for s in src]
    q, n = (t.detach().to(upcast or t.dtype).requires_grad_() for t in (query, norm_w))
    h = fn(leaves, q, n, EPS, **kw)
    h.backward(dh.to(h.dtype))
    return [h] + [t.grad for t in leaves] + [q.grad, n.grad]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind,setting", [(k, s) for k in ("fwd", "bwd") for s in AT.SWEEP[k]],
                         ids=[f"{k}-{'-'.join(map(str, s))}" for k in ("fwd", "bwd") for s in AT.SWEEP[k]])
def test_cuda_every_sweep_setting(kind, setting):
    """Every launch setting the sweep may pick (unrolled and pipelined loops run only on the GPU), with the other
    kernel at its default: bf16 sources, 1003 rows (a ragged last block for every block_r), D = 1536, N = 1, 3,
    10, against the fp32 reference on the upcast inputs, 1e-2 (bf16 outputs)."""
    for N in (1, 3, 10):
        x = _cuda_inputs(N, 1003, 1536, torch.bfloat16, seed=N)
        ref = _cuda_grads(attn_res_reference, *x, upcast=torch.float32)
        out = _cuda_grads(attn_res, *x, backend="triton", **{kind: dict(zip(AT.SETTINGS, setting))})
        errs = {i: rel_rmse(r, o) for i, (r, o) in enumerate(zip(ref, out))}
        assert max(errs.values()) <= 1e-2, (N, errs)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("setting", AT.SWEEP_STREAM, ids=["-".join(map(str, s)) for s in AT.SWEEP_STREAM])
def test_cuda_every_stream_setting(setting):
    """Every launch setting of the one-pass kernel the sweep may pick: bf16 sources, 1003 rows, D = 1536, N = 1,
    3, 10, h, α, rstd and s against the block kernel's (1e-2: bf16 h; the statistics are fp32 from the same
    bf16 values, 1e-5) and the norm epilogue against the block kernel's (1e-2)."""
    g = torch.Generator(device="cuda").manual_seed(80)
    nw = 1 + 0.3 * torch.randn(1536, device="cuda", generator=g)
    for N in (1, 3, 10):
        flat = [(torch.randn(1003, 1536, device="cuda", generator=g) * (0.5 + i)).bfloat16() for i in range(N)]
        w = 0.1 * torch.randn(1536, device="cuda", generator=g)
        got = AT.attn_res_fwd_triton(flat, w, EPS, stream=dict(zip(AT.STREAM_SETTINGS, setting)))
        ref = AT.attn_res_fwd_triton(flat, w, EPS, block_r=16)
        for name, r, o in zip(("h", "alpha", "rstd", "s"), ref, got):
            assert rel_rmse(r.double(), o) <= (1e-2 if name == "h" else 1e-5), (N, name, rel_rmse(r.double(), o))
        one = AT.attn_res_fwd_triton(flat, w, EPS, norm=(nw, 1e-6), stats=False, stream=dict(block_r=setting[0]))
        two = AT.attn_res_fwd_triton(flat, w, EPS, norm=(nw, 1e-6), block_r=16)
        assert rel_rmse(two[0].double(), one[0]) <= 1e-2


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_fp32_fp16_sources(dtype):
    """The kernels' other source dtypes against the fp64 reference on the same values: fp32 1e-5 (measured in the
    interpreter 1.6e-6, where the fp32 reference itself is at 7e-6), fp16 1e-2 (fp16 outputs); N = 7, 517 rows,
    D = 7168 (several D tiles of the default launch)."""
    x = _cuda_inputs(7, 517, 7168, dtype, seed=3)
    ref = _cuda_grads(attn_res_reference, *x, upcast=torch.float64)
    out = _cuda_grads(attn_res, *x, backend="triton")
    assert all(o.dtype == dtype for o in out[:8])
    errs = {i: rel_rmse(r, o) for i, (r, o) in enumerate(zip(ref, out))}
    assert max(errs.values()) <= (1e-5 if dtype == torch.float32 else 1e-2), errs


@pytest.mark.cuda
@cuda
@torch.no_grad()
def test_cuda_graph_with_static_tables_replays_on_new_values():
    """AttnRes + norm captured in CUDA graphs inside `static_tables`: the pointer tables are written after the
    capture (no copy node) into an arena outside the graphs' shared pool. Graph A's scratch (small temporaries
    freed during its capture) is reused by graph B's capture from the same pool, so a table allocated there would
    be overwritten by A's replays; replays of A then B after new values are copied into the sources must equal
    the eager op."""
    from k3.ops.attn_res import attn_res_norm, static_tables
    g = torch.Generator(device="cuda").manual_seed(61)
    src = [torch.randn(3, 1536, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(5)]
    query = torch.randn(1, 1536, device="cuda", generator=g)
    nw, w = (1 + 0.3 * torch.randn(1536, device="cuda", generator=g) for _ in range(2))

    def fn():
        return attn_res_norm(src, query, nw, EPS, w, 1e-6)

    def scratch():  # small temporaries, freed inside the capture: their blocks go back to the pool
        return sum((src[0][:1, :8] * float(i)).float().sum() for i in range(8))

    fn()
    scratch()
    a, b, keep = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), []
    with static_tables(keep, "cuda"), torch.cuda.graph(a):
        out_a = scratch()
    with static_tables(keep, "cuda"), torch.cuda.graph(b, pool=a.pool()):
        out_b = fn()
    assert len(keep) == 2 and all(t.is_cuda for t in keep)
    for _ in range(3):
        for t in src:
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))
        a.replay()
        b.replay()
        assert torch.equal(out_b, fn()) and torch.equal(out_a, scratch())


@pytest.mark.cuda
@cuda
def test_cuda_autocast_dispatches_to_triton_and_matches_torch(monkeypatch):
    """Under bf16 autocast with bf16 sources and fp32 parameters: auto picks the kernels; output bf16,
    parameter gradients fp32, and the torch backend agrees."""
    N, R, D = 4, 1000, 1536
    x = make(N, (R, D), seed=31, dtypes=[torch.bfloat16] * N)
    src, query, norm_w, dh, grads = x
    calls = []
    fwd = AT.attn_res_fwd_triton
    monkeypatch.setattr(AT, "attn_res_fwd_triton", lambda *a, **k: calls.append(1) or fwd(*a, **k))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tri = run(attn_res, src, query.float(), norm_w.float(), dh, grads, device="cuda")
        assert calls == [1], "auto ran the Triton forward"
        tor = run(attn_res, src, query.float(), norm_w.float(), dh, grads, device="cuda", backend="torch")
    assert calls == [1]
    assert tri[0].dtype == torch.bfloat16 and tri[2].dtype == torch.float32
    check(tor, tri, 1e-2)


# ---------------------------------------------------------------- inference: AttnRes with its output RMSNorm fused
@pytest.mark.parametrize("rows_kernel,stream", [(True, True), (False, True), (False, False)],
                         ids=["rows-kernel", "stream-kernel", "block-kernel"])
@pytest.mark.parametrize("D", [48, 1100])
def test_attn_res_norm_fused_equals_the_two_ops(D, rows_kernel, stream, one_thread, monkeypatch):
    """rms_norm(attn_res(...)) as one kernel without autograd: against the fp64 two-op oracle (fp32, 1e-5; D =
    1100 spans two 1024-wide tiles of the small-rows launch, so the norm's third pass revisits written tiles),
    against the two Triton ops in bf16 (the norm reads the rounded mix, as they do: within bf16 rounding), and
    with autograd on it is the two ops (gradients flow)."""
    from k3.ops.attn_res import attn_res_norm
    from k3.ops.norm.reference import rms_norm_reference
    if not rows_kernel:  # the NORM epilogue of the kernels that more than ROWS_KERNEL_MAX_ROWS rows take
        monkeypatch.setattr(AT, "ROWS_KERNEL_MAX_ROWS", 0)
    monkeypatch.setattr(AT, "STREAM", stream)
    assert AT.rows_kernel_fits(9, 3, D) == rows_kernel
    src, query, norm_w, _, _ = make(3, (9, D), seed=60)
    out_w = 1 + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(61), dtype=torch.float64)
    ref = rms_norm_reference(attn_res_reference(src, query, norm_w, EPS), out_w, 1e-6)
    f32 = [t.float().to(DEV) for t in (query, norm_w, out_w)]
    with torch.no_grad():
        out = attn_res_norm([s.float().to(DEV) for s in src], f32[0], f32[1], EPS, f32[2], 1e-6, backend="triton")
        assert rel_rmse(ref, out.cpu()) <= 1e-5
        bf = [s.to(DEV, torch.bfloat16) for s in src]
        q16, n16, o16 = (t.to(torch.bfloat16) for t in f32)
        two = rms_norm_reference(attn_res(bf, q16, n16, EPS, backend="triton"), o16, 1e-6)
        one = attn_res_norm(bf, q16, n16, EPS, o16, 1e-6, backend="triton")
        assert one.dtype == torch.bfloat16 and rel_rmse(two.float(), one.float()) <= 8e-3
    leaves = [s.float().to(DEV).requires_grad_() for s in src]
    y = attn_res_norm(leaves, f32[0], f32[1], EPS, f32[2], 1e-6, backend="triton")
    y.sum().backward()
    assert rel_rmse(ref, y.detach().cpu()) <= 1e-5 and all(t.grad is not None for t in leaves)
