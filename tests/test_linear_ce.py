"""Fused linear + cross-entropy (`k3.ops.linear_ce`) against the materialise-every-logit oracle, and the
model's fused LM / MTP loss against its plain logits path.

Tolerances: fp64 chunked vs reference 1e-10 (relative error of the loss, relative RMS error `rel_rmse` of
the gradients); the Triton row kernel through the interpreter in fp32 1e-5; the model (k3-tiny, packed
documents) fused vs plain: losses 1e-6; gradients in fp32 2e-6 over all parameters together and 1e-5 per
parameter (fp32 rounding: the plain path alone is 2e-6..2e-5 per parameter off its fp64 self), in fp64 1e-6
per parameter (the plain path casts its logits to fp32); CUDA bf16 autocast at k3-small's head size: loss 1e-3,
gradients 1e-2.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny, rel_rmse
from k3.ops.linear_ce import default_chunk_size, linear_cross_entropy, triton_available

CUDA = torch.cuda.is_available()


def _rel(a, b) -> float:
    return (abs(a.double() - b.double()) / abs(a.double()).clamp_min(1e-30)).item()


def _inputs(N, V, D, dtype=torch.float64, ignored=(), seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) / D ** 0.5 * 2.0
    t = torch.randint(0, V, (N,), generator=g)
    t[list(ignored)] = -100
    return h.to(device, dtype), w.to(device, dtype), t.to(device)


def _run(h, w, t, scale=3.7, **kw):
    """loss and the gradients of hidden and weight for (loss * scale).backward(), on fresh leaves."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, t, **kw)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [8, None])
def test_torch_matches_reference_fp64(chunk, one_thread):
    h, w, t = _inputs(37, 1000, 64, ignored=(0, 5, 17, 36))
    ref = _run(h, w, t, backend="reference")
    got = _run(h, w, t, backend="torch", chunk_size=chunk)
    assert got[0].dtype == torch.float64
    assert _rel(ref[0], got[0]) <= 1e-10
    assert rel_rmse(ref[1], got[1]) <= 1e-10 and rel_rmse(ref[2], got[2]) <= 1e-10


def test_every_target_ignored_and_single_row(one_thread):
    h, w, t = _inputs(9, 300, 16)
    t[:] = -7
    ref = _run(h, w, t, backend="reference", ignore_index=-7)
    got = _run(h, w, t, backend="torch", chunk_size=4, ignore_index=-7)
    assert ref[0].isnan() and got[0].isnan()
    assert torch.equal(ref[1], got[1]) and torch.equal(ref[2], got[2])  # zero gradients, not NaN
    assert not got[1].any() and not got[2].any()
    h, w, t = _inputs(1, 300, 16, seed=1)
    ref, got = _run(h, w, t, backend="reference"), _run(h, w, t, backend="torch")
    assert _rel(ref[0], got[0]) <= 1e-10
    assert rel_rmse(ref[1], got[1]) <= 1e-10 and rel_rmse(ref[2], got[2]) <= 1e-10


def test_partial_requires_grad_and_no_grad(one_thread):
    h, w, t = _inputs(21, 500, 32, ignored=(3,))
    ref = _run(h, w, t, backend="reference")
    hh = h.clone().requires_grad_()
    (linear_cross_entropy(hh, w, t, chunk_size=5) * 3.7).backward()  # weight is a constant here
    assert rel_rmse(ref[1], hh.grad) <= 1e-10
    ww = w.clone().requires_grad_()
    (linear_cross_entropy(h, ww, t, chunk_size=5) * 3.7).backward()
    assert rel_rmse(ref[2], ww.grad) <= 1e-10
    with torch.no_grad():
        loss = linear_cross_entropy(h.requires_grad_(), w, t, chunk_size=5)
    assert loss.grad_fn is None and _rel(ref[0], loss) <= 1e-10


def test_autocast_casts_like_f_linear(one_thread):
    """CPU bf16 autocast: the op casts hidden and weight like F.linear, returns an fp32 loss and fp32
    gradients for fp32 leaves; against the plain autocast expression (same bf16 logits) within bf16 rounding
    of the gradients."""
    h, w, t = _inputs(29, 700, 48, dtype=torch.float32, ignored=(2,))
    outs = []
    for backend in ("reference", "torch"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(hh, ww, t, chunk_size=6, backend=backend)
        (loss * 3.7).backward()
        assert loss.dtype == torch.float32 and hh.grad.dtype == ww.grad.dtype == torch.float32
        outs.append((loss.detach(), hh.grad, ww.grad))
    (l0, dh0, dw0), (l1, dh1, dw1) = outs
    assert _rel(l0, l1) <= 1e-5
    assert rel_rmse(dh0, dh1) <= 1e-2 and rel_rmse(dw0, dw1) <= 1e-2


def test_bad_arguments_named():
    h, w, t = _inputs(4, 10, 8)
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(h, w, t, backend="fast")
    with pytest.raises(ValueError, match=r"\[V, D\]"):
        linear_cross_entropy(h, w[:, :4], t)
    with pytest.raises(ValueError, match="int64"):
        linear_cross_entropy(h, w, t.int())
    with pytest.raises(ValueError, match="one dtype"):
        linear_cross_entropy(h, w.float(), t)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, t, chunk_size=0)


def test_default_chunk_size():
    assert default_chunk_size(163840, torch.bfloat16) * 163840 * 4 <= 2 ** 31
    assert default_chunk_size(163840, torch.bfloat16) % 128 == 0
    n = default_chunk_size(163840, torch.bfloat16, in_place=True)  # the Triton row pass: bf16 buffer only
    assert n * 163840 * 2 <= 2 ** 31 < (n + 128) * 163840 * 2 and n % 128 == 0
    assert default_chunk_size(163840, torch.float32, in_place=True) == default_chunk_size(163840, torch.float32)
    assert default_chunk_size(10 ** 10, torch.float32) == 1


def test_even_chunks():
    """Rows split into equal chunks near the budget: no short tail chunk (each chunk is a pass of the fp32 dW
    accumulator), the fewest chunks that fit `most` (+ 128 rows of slack at GPU sizes), 128-row multiples there."""
    from k3.ops.linear_ce.chunked import even_chunks
    assert even_chunks(32768, 6528) == 6656  # k3-small at 8 x 4,096: five chunks, not five and a 128-row tail
    for most in (6528, 256, 3, 100):
        slack = 128 if most % 128 == 0 else 0
        for n in (1, 2, most - 1, most, most + 1, most + slack, most + slack + 1, 5 * most + 7, 32768, 65536):
            if n < 1:
                continue
            size = even_chunks(n, most)
            parts = -(-n // size)
            assert size <= max(most + slack, 1), (n, most, size)
            assert parts == max(1, -(-n // (most + slack))), (n, most, size)  # the fewest chunks
            tail = n - (parts - 1) * size
            assert tail > size - parts * (128 if slack else 1), (n, most, size)  # chunks of (nearly) equal size
            if slack and n > most + slack:
                assert size % 128 == 0


# ---- Triton row kernel -----------------------------------------------------------------------------
@pytest.mark.skipif(not triton_available(), reason="triton not importable")
@pytest.mark.parametrize("block_v", [128, None])  # 3 steps with a masked tail, or one masked block
def test_triton_rows_match_reference_fp32(block_v, one_thread):
    """The Triton kernel (interpreter on CPU, fp32): loss and gradients through the whole op, 1e-5."""
    from k3.ops.linear_ce import triton as T
    assert CUDA or T.interpreted()
    dev = "cuda" if CUDA else "cpu"
    h, w, t = _inputs(13, 300, 16, dtype=torch.float32, ignored=(4, 12), seed=2, device=dev)
    ref = _run(h.double(), w.double(), t, backend="reference")
    rows = lambda *a: T.ce_rows_triton(*a, block_v=block_v)  # noqa: E731
    from k3.ops.linear_ce.chunked import linear_cross_entropy_chunked
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy_chunked(hh, ww, t, -100, 5, rows)
    (loss * 3.7).backward()
    assert _rel(ref[0], loss.detach()) <= 1e-5
    assert rel_rmse(ref[1], hh.grad) <= 1e-5 and rel_rmse(ref[2], ww.grad) <= 1e-5
    got = _run(h, w, t, backend="triton", chunk_size=5)  # the dispatch point, default block
    assert _rel(ref[0], got[0]) <= 1e-5 and rel_rmse(ref[1], got[1]) <= 1e-5 and rel_rmse(ref[2], got[2]) <= 1e-5


@pytest.mark.skipif(not triton_available(), reason="triton not importable")
def test_triton_rows_default_launch_over_a_wide_vocabulary(one_thread):
    """The row kernel at its default launch for a vocabulary wider than one step (8,192 columns, 16 warps, a masked
    tail; the launch the 163,840-id heads take): loss and softmax - onehot against fp64, an ignored row zero."""
    from k3.ops.linear_ce import triton as T
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 9000, generator=g) * 3).to(dev)
    t = torch.tensor([5, 8999, -100], device=dev)
    loss = torch.empty(3, device=dev)
    got = x.clone()
    T.ce_rows_triton(got, t, -100, True, loss)
    lse = torch.logsumexp(x.double(), -1)
    p = torch.softmax(x.double(), -1)
    p[0, 5] -= 1
    p[1, 8999] -= 1
    p[2] = 0
    want = torch.stack([lse[0] - x[0, 5].double(), lse[1] - x[1, 8999].double(), torch.zeros((), dtype=torch.float64,
                                                                                          device=dev)])
    assert rel_rmse(want, loss) <= 1e-6 and rel_rmse(p, got) <= 1e-6


# ---- model ---------------------------------------------------------------------------------------
CU = [0, 5, 17, 24, 30, 31, 48]  # B=2, T=24: several documents per row, a 1-token document


def _model_run(model, ids, labels, cu, impl):
    model.language_model.loss_impl = impl
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, cu_seqlens=cu)
    (out.loss + 0.1 * out.mtp_loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_model_fused_loss_equals_plain(dtype, one_thread):
    """k3-tiny in training mode with packed documents: loss, mtp_loss and every parameter gradient of
    loss + 0.1 * mtp_loss equal between loss_impl "fused" and "plain"; fused returns no logits. Bars (module
    docstring): losses 1e-6; fp64 gradients 1e-6 per parameter (measured 1.5e-7, the plain path's fp32
    logits); fp32 gradients 2e-6 all together (measured 8e-7) and 1e-5 per parameter (measured 2e-6 at
    worst, e.g. a router weight, where the plain fp32 path is itself 6e-6 off fp64)."""
    model = make_tiny(seed=5).to(dtype).train()
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 4000, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, 9] = labels[1, 3] = -100
    cu = torch.tensor(CU, dtype=torch.int32)
    plain, gp = _model_run(model, ids, labels, cu, "plain")
    fused, gf = _model_run(model, ids, labels, cu, "fused")
    assert plain.logits is not None and plain.mtp_logits is not None
    assert fused.logits is None and fused.mtp_logits is None
    assert _rel(plain.loss, fused.loss) <= 1e-6 and _rel(plain.mtp_loss, fused.mtp_loss) <= 1e-6
    assert gp.keys() == gf.keys() and "language_model.lm_head.weight" in gf
    worst = max(rel_rmse(gp[n], gf[n]) for n in gp if gp[n].abs().sum() > 0)
    assert worst <= (1e-5 if dtype == torch.float32 else 1e-6), worst
    flat = lambda d: torch.cat([d[n].flatten() for n in sorted(d)])  # noqa: E731
    assert rel_rmse(flat(gp), flat(gf)) <= (2e-6 if dtype == torch.float32 else 1e-6)
    model.eval()  # eval keeps the logits, whatever loss_impl says
    with torch.no_grad():
        ev = model(ids, labels=labels, cu_seqlens=cu)
    assert ev.logits is not None and _rel(ev.loss, plain.loss) <= 1e-6
    model.language_model.loss_impl = "fast"
    with pytest.raises(ValueError, match="loss_impl"):
        model(ids, labels=labels)


# ---- CUDA ----------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_bf16_autocast_k3_small_head():
    """k3-small's head (V = 163840, D = 1536), N = 4096, bf16 autocast over fp32 leaves: the fused op (auto:
    triton) against the plain autocast path; no host sync in the op; peak memory well below the plain path."""
    torch.manual_seed(0)
    N, V, D = 4096, 163840, 1536
    h = torch.randn(N, D, device="cuda")
    w = torch.randn(V, D, device="cuda") * 0.02
    t = torch.randint(0, V, (N,), device="cuda")
    t[::17] = -100
    res, peak = {}, {}
    for impl in ("plain", "fused", "fused"):  # the second fused run is the measured one (warm Triton cache)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if impl == "fused" and impl in res:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = (F.cross_entropy(F.linear(hh, ww).float(), t) if impl == "plain"
                        else linear_cross_entropy(hh, ww, t))
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        peak[impl] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        res[impl] = (loss.detach(), hh.grad, ww.grad)
    print(f"peak extra memory, forward + backward: plain {peak['plain']:.2f} GiB, fused {peak['fused']:.2f} GiB")
    (l0, dh0, dw0), (l1, dh1, dw1) = res["plain"], res["fused"]
    assert l1.dtype == torch.float32 and dh1.dtype == dw1.dtype == torch.float32
    assert _rel(l0, l1) <= 1e-3
    assert rel_rmse(dh0, dh1) <= 1e-2 and rel_rmse(dw0, dw1) <= 1e-2
    assert peak["fused"] < 0.5 * peak["plain"]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_and_torch_backends(dtype):
    """Both chunked backends on the GPU against the fp64 reference of the same (rounded) inputs:
    fp32 1e-5 (loss) / 1e-4 (gradients, TF32 off); bf16 loss 1e-3, gradients 1e-2."""
    h, w, t = _inputs(300, 5000, 128, dtype=dtype, ignored=(1, 7, 299), seed=3, device="cuda")
    ref = _run(h.double(), w.double(), t, backend="reference")
    tol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-3, 1e-2)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for backend in ("triton", "torch"):
            got = _run(h, w, t, backend=backend, chunk_size=64)
            assert got[1].dtype == dtype and got[2].dtype == dtype
            assert _rel(ref[0], got[0]) <= tol[0], backend
            assert rel_rmse(ref[1], got[1]) <= tol[1] and rel_rmse(ref[2], got[2]) <= tol[1], backend
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
