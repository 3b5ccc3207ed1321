"""k3's Triton KDA kernels against the fp64 token-recurrent oracle.

Without CUDA the kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before anything imports triton), at small sizes; with CUDA the same checks run on the GPU
plus bf16 / head-dim-128 cases. Metric: relative RMS error ||ref - x|| / ||ref|| with the issue's
bars: o, final state 5e-3; dq, dk, dv, dh0 8e-3; df (dg), dbeta, dA_log, ddt_bias 2e-2.
"""
import pytest
import torch

CUDA = torch.cuda.is_available()
triton = pytest.importorskip("triton")

import k3.ops.kda.triton as KT  # noqa: E402
from conftest import rel_rmse as rmse  # noqa: E402
from k3.ops.kda import (chunk_kda, chunk_kda_gated, fused_recurrent_kda, kda_decode_step,  # noqa: E402
                        kda_gate)

DEV = "cuda" if CUDA else "cpu"
TOL = {"o": 5e-3, "ht": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3,
       "df": 2e-2, "dg": 2e-2, "dbeta": 2e-2, "dA_log": 2e-2, "ddt_bias": 2e-2}
# fp32 through the interpreter is near-exact (measured <= 1e-6): a tighter bar there also catches
# small systematic errors. On the GPU, fp32 inputs use exact-fp32 dots too.
STRICT = 1e-4
assert CUDA or KT.interpreted(), "conftest.py selects Triton's interpreter on CPU-only hosts"


pytestmark = pytest.mark.usefixtures("one_thread")


def make(B, T, H, K, V, seed, f_shift=0.0, f_scale=1.0, N=None, h0=True):
    """Raw inputs of the fused path: q, k unnormalised; f the gate pre-activation; beta logits;
    a distinct A_log per head; dt_bias; h0; and the upstream gradients do, dht."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    N = N or B
    x = dict(q=r(B, T, H, K) + 0.5, k=r(B, T, H, K), v=r(B, T, H, V), f=f_shift + f_scale * r(B, T, H, K),
             beta=r(B, T, H), A_log=torch.linspace(-1.0, 1.5, H), dt_bias=r(H * K),
             h0=r(N, H, K, V) if h0 else None)
    grads = dict(do=r(B, T, H, V), dht=r(N, H, K, V))
    return x, grads


def run_gated(fn, x, gr, dtype, **kw):
    """fn(q, k, v, f, beta_logit, A_log, dt_bias, initial_state=...) on leaf copies; returns outputs and grads."""
    leaf = {n: (t.detach().to(DEV, dtype if n not in ("A_log", "dt_bias", "h0") or dtype == torch.float64
                               else torch.float32).requires_grad_() if t is not None else None)
            for n, t in x.items()}
    o, ht = fn(leaf["q"], leaf["k"], leaf["v"], leaf["f"], leaf["beta"], leaf["A_log"], leaf["dt_bias"],
               initial_state=leaf["h0"], output_final_state=True, **kw)
    ((o.double() * gr["do"].to(DEV).double()).sum() + (ht.double() * gr["dht"].to(DEV).double()).sum()).backward()
    out = {"o": o.detach(), "ht": ht.detach()}
    out.update({"d" + ("f" if n == "f" else n): t.grad for n, t in leaf.items() if t is not None})
    return out


def reference_gated(q, k, v, f, beta, A_log, dt_bias, **kw):
    return chunk_kda_gated(q, k, v, f, beta, A_log, dt_bias, backend="reference", **kw)


def triton_gated(q, k, v, f, beta, A_log, dt_bias, **kw):
    return chunk_kda_gated(q, k, v, f, beta, A_log, dt_bias, backend="triton", **kw)


def compare(x, gr, dtype=torch.float32, strict=None, **kw):
    ref = run_gated(reference_gated, x, gr, torch.float64, **kw)
    out = run_gated(triton_gated, x, gr, dtype, **kw)
    errs = {}
    for name, r in ref.items():
        t = out[name]
        assert torch.isfinite(t).all(), f"{name} has NaN/Inf"
        errs[name] = rmse(r, t)
    print("rel-RMS", {n: f"{e:.1e}" for n, e in errs.items()})  # shown with pytest -s
    bad = {n: e for n, e in errs.items() if e > (TOL[n] if strict is None else min(TOL[n], strict))}
    assert not bad, f"over tolerance: {bad}; all: {errs}"
    return errs


# ---------------------------------------------------------------- values and gradients
GATES = [(-8.0, 1.0), (-4.0, 1.0), (0.0, 1.0), (8.0, 1.0), (0.0, 8.0)]


@pytest.mark.parametrize("f_shift,f_scale", GATES, ids=["f~-8", "f~-4", "f~0", "f~+8", "f~N(0,64)"])
def test_gated_extreme_gates(f_shift, f_scale):
    """Fused gate/beta/l2norm, per-head A_log, T = 37 (not a multiple of 16), gate regimes near -5 and 0."""
    x, gr = make(1, 37, 2, 32, 16, seed=int(f_shift * 10 + f_scale), f_shift=f_shift, f_scale=f_scale)
    compare(x, gr, strict=None if CUDA else STRICT)


@pytest.mark.parametrize("T", [1, 5, 16])
def test_short_and_boundary_lengths(T):
    x, gr = make(2, T, 2, 16, 32, seed=100 + T)
    compare(x, gr, strict=None if CUDA else STRICT)


@pytest.mark.parametrize("settings, launch", [
    (dict(small_programs=0, mid_programs_max=0), (32, 2)),
    (dict(small_programs=0, mid_programs_min=0, mid_programs_max=10 ** 6), (128, 2)),
    (dict(small_programs=10 ** 6), (128, 4))], ids=["default-settings", "mid-settings", "short-step-settings"])
def test_head_dim_128(settings, launch):
    """K = V = 128 with each launch-setting set of the intra kernel (column block, warps): the default (32, 2), a
    mid-sized forward's (`CFG["mid_programs_*"]`: 128, 2) and a short step's (`CFG["small_programs"]`: 128, 4,
    and value blocks of 16 in the recurrence)."""
    from k3.ops.kda.triton.chunk import _intra_launch, cfg_override
    x, gr = make(1, 20, 2, 128, 128, seed=7)
    with cfg_override(**settings):
        assert _intra_launch(2, 2) == launch
        compare(x, gr, strict=None if CUDA else STRICT)


def test_varlen():
    cu = [0, 5, 21, 21, 60, 77]
    x, gr = make(1, cu[-1], 2, 32, 16, seed=8, N=len(cu) - 1, f_scale=4.0)
    compare(x, gr, strict=None if CUDA else STRICT, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV))


def test_activated_gate_path():
    """chunk_kda(backend='triton'): activated g and post-sigmoid beta, no l2norm in the kernel."""
    x, gr = make(1, 40, 2, 32, 16, seed=9)
    g = kda_gate(x["f"], x["A_log"], x["dt_bias"])
    q = torch.nn.functional.normalize(x["q"], dim=-1)
    k = torch.nn.functional.normalize(x["k"], dim=-1)
    beta = torch.sigmoid(x["beta"])
    res = {}
    for name, dt in (("triton", torch.float32), ("reference", torch.float64)):
        leaf = [t.detach().to(DEV, dt).clone().requires_grad_() for t in (q, k, x["v"], g, beta, x["h0"])]
        o, ht = chunk_kda(*leaf[:5], initial_state=leaf[5], output_final_state=True, backend=name)
        ((o.double() * gr["do"].to(DEV).double()).sum() + (ht.double() * gr["dht"].to(DEV).double()).sum()).backward()
        res[name] = [o, ht] + [t.grad for t in leaf]
    for n, r, t in zip(["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"], res["reference"], res["triton"]):
        assert rmse(r, t) <= min(TOL[n], STRICT if not CUDA else 1.0), (n, rmse(r, t))


def test_no_initial_state_no_dht():
    """Without h0 and without using the final state (the training call)."""
    x, _ = make(2, 30, 2, 32, 32, seed=10, h0=False)
    leaf = {n: t.to(DEV).requires_grad_() for n, t in x.items() if t is not None}
    o, ht = triton_gated(*(leaf[n] for n in ("q", "k", "v", "f", "beta", "A_log", "dt_bias")))
    assert ht is None
    o.square().sum().backward()
    ref = {n: t.double().detach().requires_grad_() for n, t in leaf.items()}
    ro, _ = reference_gated(*(ref[n] for n in ("q", "k", "v", "f", "beta", "A_log", "dt_bias")))
    ro.square().sum().backward()
    assert rmse(ro, o) <= 5e-3
    for n in leaf:
        assert rmse(ref[n].grad, leaf[n].grad) <= 2e-2, n


def test_saved_states_backward_equals_recompute(monkeypatch):
    """What the forward keeps for the backward -- nothing (recompute all), the intra-chunk tiles (CFG save_parts,
    the default) or tiles and states (CFG save_states) -- gives the same gradients, and each really skips its
    recompute: (intra-chunk passes, recurrence passes) = (2, 2), (1, 2), (1, 1)."""
    from k3.ops.kda.triton import chunk as ch
    x, gr = make(1, 35, 2, 32, 16, seed=18)
    calls = {"intra": 0, "recur": 0}
    intra, recur = ch._intra_fwd, ch._recur_fwd

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(ch, "_intra_fwd", count("intra", intra))
    monkeypatch.setattr(ch, "_recur_fwd", count("recur", recur))
    res, counts = [], []
    for parts, states in ((False, False), (True, False), (False, True)):
        monkeypatch.setitem(ch.CFG, "save_parts", parts)
        monkeypatch.setitem(ch.CFG, "save_states", states)
        calls.update(intra=0, recur=0)
        res.append(run_gated(triton_gated, x, gr, torch.float32))
        counts.append((calls["intra"], calls["recur"]))
    assert counts == [(2, 2), (1, 2), (1, 1)], counts
    for r in res[1:]:
        for name in res[0]:
            assert torch.equal(res[0][name], r[name]), name


@pytest.mark.parametrize("cu", [None, [0, 5, 60, 60, 110]], ids=["one-sequence", "varlen"])
def test_sequence_split_equals_whole(cu):
    """CFG["seq_split"]: long sequences cut into segments that run in parallel (summaries, fp32 combine,
    then each segment from its incoming state) give the whole-sequence result, values and gradients,
    including the backward's recompute, states_at offsets and a zero-length sequence next to cut ones."""
    from k3.ops.kda.triton.chunk import _layout, _split_plan, cfg_override
    T = 100 if cu is None else cu[-1]
    x, gr = make(1, T, 1, 16, 16, seed=23, N=1 if cu is None else len(cu) - 1, f_scale=2.0)
    kw = {} if cu is None else dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV))
    _, _, _, cu_h, coff, _ = _layout(kw.get("cu_seqlens"), 1, T, DEV)
    plan = _split_plan(tuple(cu_h), tuple(coff), 3, 1, DEV)
    assert plan is not None and sum(len(t) for t, _ in plan["fsteps"]) >= 2, "the test must exercise cut sequences"
    pos = torch.tensor([32, 48, 80] if cu is None else [5 + 32, 5 + 48, 60 + 32])  # chunk ends in cut sequences
    leaf = [t.to(DEV) for t in _gated_args(x)]
    res, sel = [], []
    for split in (0, 3):
        with cfg_override(seq_split=split, split_min_chunks=1, split_below_programs=10 ** 6):
            res.append(run_gated(triton_gated, x, gr, torch.float32, **kw))
            sel.append(triton_gated(*leaf, initial_state=x["h0"].to(DEV), states_at=pos, **kw)[2])
    sel_whole, sel_split = sel
    for name in res[0]:
        assert rmse(res[0][name], res[1][name]) <= (1e-5 if not CUDA else 5e-3), name
    assert rmse(sel_whole, sel_split) <= (1e-5 if not CUDA else 5e-3)
    ref = run_gated(reference_gated, x, gr, torch.float64, **kw)
    for name, r in ref.items():
        assert rmse(r, res[1][name]) <= (min(TOL[name], STRICT) if not CUDA else TOL[name]), name


# ---------------------------------------------------------------- forwards without autograd
def _forward_only(x, dtype, **kw):
    with torch.no_grad():
        args = [t.to(DEV, dtype if i < 5 else torch.float32) for i, t in enumerate(_gated_args(x, "cpu"))]
        return triton_gated(*args, initial_state=x["h0"].to(DEV), output_final_state=True, **kw)


@pytest.mark.parametrize("T,cu,gate,split", [
    (75, None, (0.0, 8.0), 0), (75, None, (-8.0, 1.0), 0), (75, None, (8.0, 1.0), 0), (10, None, (0.0, 1.0), 0),
    (77, [0, 5, 21, 21, 60, 77], (0.0, 4.0), 0), (200, [0, 3, 200], (0.0, 2.0), 3)],
    ids=["N(0,64)", "f~-8", "f~+8", "T<16", "varlen", "split"])
def test_forward_without_autograd(T, cu, gate, split):
    """Without autograd the intra kernel folds T diag(beta) into Aqk and kg (PRE) and the recurrence runs without
    v_new: o and the final state against the fp64 oracle and against the autograd forward, with extreme gates,
    T not a multiple of 16, a sequence shorter than a chunk, varlen with an empty sequence, and splitting."""
    from k3.ops.kda.triton.chunk import cfg_override
    x, _ = make(1, T, 2, 32, 16, seed=30 + T, f_shift=gate[0], f_scale=gate[1], N=1 if cu is None else len(cu) - 1)
    kw = {} if cu is None else dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV))
    with cfg_override(seq_split=split, split_min_chunks=1, split_below_programs=10 ** 6):
        o_pre, h_pre = _forward_only(x, torch.float32, **kw)
        leaf = [t.to(DEV).requires_grad_() for t in _gated_args(x, "cpu")]
        o_ag, h_ag = triton_gated(*leaf, initial_state=x["h0"].to(DEV), output_final_state=True, **kw)
    ref_o, ref_h = reference_gated(*[t.double() for t in _gated_args(x, "cpu")], initial_state=x["h0"].double(),
                                   output_final_state=True, **{k: v.cpu() for k, v in kw.items()})
    bar = 5e-3 if CUDA else STRICT
    for name, r, t in (("o", ref_o, o_pre.cpu()), ("ht", ref_h, h_pre.cpu())):
        assert torch.isfinite(t).all(), name
        assert rmse(r, t) <= bar, (name, rmse(r, t))
    assert rmse(o_ag.detach(), o_pre) <= bar and rmse(h_ag.detach(), h_pre) <= bar


def test_forward_without_autograd_reads_row_slices_in_place(monkeypatch):
    """Inference passes q, k, v as row slices of the short conv's output and beta of the joined projection's: the
    forward reads them in place (no copies) and gives bitwise what contiguous copies give; varlen, states_at.
    A_log and dt_bias are parameters, as in the model: under no_grad the forward still takes the inference path
    (in place; Tb folded, `pre`, when CFG fold_tb asks), although autograd marks parameters as needing gradients
    even there."""
    import k3.ops.kda.triton.chunk as CH
    seen = []
    intra = CH._intra_fwd
    monkeypatch.setattr(CH, "_intra_fwd", lambda q, *a, pre=False: seen.append((q.data_ptr(), pre)) or
                        intra(q, *a, pre=pre))
    x, _ = make(1, 75, 2, 32, 32, seed=17, N=2)
    q, k, v, f, beta, A_log, dt_bias = _gated_args(x)
    A_log, dt_bias = torch.nn.Parameter(A_log), torch.nn.Parameter(dt_bias)
    wide = torch.cat([t.reshape(1, 75, -1) for t in (q, k, v)] + [beta, beta], -1)
    qs, ks, vs = (t.reshape(1, 75, 2, 32) for t in wide[..., :192].split(64, -1))
    bs = wide[..., 192:194]
    assert not qs.is_contiguous() and qs.stride(1) == 196 and bs.stride(1) == 196
    kw = dict(initial_state=x["h0"].to(DEV), output_final_state=True, states_at=torch.tensor([16, 75]),
              cu_seqlens=torch.tensor([0, 40, 75], dtype=torch.int32), backend="triton")
    for fold in (False, True):  # Tb folded into Aqk and kg (CFG fold_tb) or not
        seen.clear()
        with torch.no_grad(), CH.cfg_override(fold_tb=fold):
            got = chunk_kda_gated(qs, ks, vs, f, bs, A_log, dt_bias, **kw)
            ref = chunk_kda_gated(q, k, v, f, beta, A_log, dt_bias, **kw)
        assert seen == [(qs.data_ptr(), fold), (q.data_ptr(), fold)]
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    seen.clear()
    chunk_kda_gated(q, k, v, f, beta, A_log, dt_bias, **kw)[0].sum().backward()  # with autograd: no `pre`
    assert [p for _, p in seen] == [False] and A_log.grad is not None


# ---------------------------------------------------------------- causality and continuation
def _gated_args(x, dev=DEV):
    return [x[n].to(dev) for n in ("q", "k", "v", "f", "beta", "A_log", "dt_bias")]


def test_prefix_causality():
    x, _ = make(1, 50, 2, 32, 16, seed=11)
    y, _ = make(1, 50, 2, 32, 16, seed=12)
    P = 21  # inside the second 16-token chunk
    z = dict(x)
    for n in ("q", "k", "v", "f", "beta"):
        z[n] = torch.cat([x[n][:, :P], y[n][:, P:]], 1)
    oa, _ = triton_gated(*_gated_args(x), initial_state=x["h0"].to(DEV))
    ob, _ = triton_gated(*_gated_args(z), initial_state=x["h0"].to(DEV))
    assert (oa[:, :P] - ob[:, :P]).abs().max().item() <= 1e-6
    assert not torch.allclose(oa[:, P:], ob[:, P:])


def test_split_and_carry_equals_whole():
    x, _ = make(2, 70, 2, 32, 16, seed=13)
    a = _gated_args(x)
    o, ht = triton_gated(*a, initial_state=x["h0"].to(DEV), output_final_state=True)
    P = 27
    cut = lambda s: [t[:, s] for t in a[:5]] + a[5:]  # noqa: E731
    o1, h1 = triton_gated(*cut(slice(0, P)), initial_state=x["h0"].to(DEV), output_final_state=True)
    o2, h2 = triton_gated(*cut(slice(P, None)), initial_state=h1, output_final_state=True)
    assert rmse(o, torch.cat([o1, o2], 1)) <= 1e-5 and rmse(ht, h2) <= 1e-5


def test_prefill_then_decode_with_state_pool():
    """Prefill 50 tokens of 3 sequences, then decode 2 tokens per call (speculative-style) into pool
    slots [4, 0, 2] of a 6-slot pool: equals the whole run; slots 1, 3, 5 stay bit-identical."""
    N, T, P, H, K, V = 3, 56, 50, 2, 32, 16
    x, _ = make(N, T, H, K, V, seed=14)
    a = _gated_args(x)
    ro, rht = reference_gated(*(t.double() for t in a), initial_state=x["h0"].double().to(DEV), output_final_state=True)
    _, h1 = triton_gated(*[t[:, :P] for t in a[:5]], *a[5:], initial_state=x["h0"].to(DEV), output_final_state=True)
    pool = torch.randn(6, H, K, V, device=DEV)
    idx = torch.tensor([4, 0, 2], device=DEV)
    pool[idx] = h1
    before = pool.clone()
    outs = []
    for t in range(P, T, 2):
        q, k, v, f, b = (u[:, t:t + 2].reshape(N * 2, *u.shape[2:]) for u in a[:5])
        cu = torch.arange(0, 2 * N + 1, 2, device=DEV, dtype=torch.int32)
        o = KT.kda_decode_triton(q, k, v, f, b, pool, state_indices=idx, cu_seqlens=cu,
                                 use_qk_l2norm_in_kernel=True, A_log=a[5], dt_bias=a[6], beta_logits=True)
        outs.append(o.reshape(N, 2, H, V))
    assert rmse(ro[:, P:], torch.cat(outs, 1)) <= 5e-5 and rmse(rht, pool[idx]) <= 5e-5
    rest = torch.tensor([1, 3, 5], device=DEV)
    assert torch.equal(pool[rest], before[rest])


def test_states_at_offsets():
    cu = [0, 40, 40, 75]
    x, _ = make(1, 75, 2, 32, 16, seed=15, N=3)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    pos = [16, 40, 72, 75, 56]  # seq 0 at 16 and its end; seq 2 at 32 and 16 tokens in, and its end
    o, ht, st = chunk_kda_gated(*_gated_args(x), initial_state=x["h0"].to(DEV), output_final_state=True,
                                cu_seqlens=cu_t, backend="triton", states_at=torch.tensor(pos))
    assert st.shape == (5, 2, 32, 16) and st.dtype == torch.float32
    for m, p in enumerate(pos):
        n = 0 if p <= 40 else 2
        bos = cu[n]
        _, ref = reference_gated(*[t[:, bos:p].double() for t in _gated_args(x)[:5]],
                                 *[t.double() for t in _gated_args(x)[5:]],
                                 initial_state=x["h0"][n:n + 1].double().to(DEV), output_final_state=True)
        assert rmse(ref[0], st[m]) <= 1e-5, p
    assert torch.equal(st[3], ht[2]) and torch.equal(st[1], ht[0])
    # the other backends run the pieces between the positions in turn: same outputs, states and final states
    for backend in ("torch", "reference"):
        o2, ht2, st2 = chunk_kda_gated(*_gated_args(x), initial_state=x["h0"].to(DEV), output_final_state=True,
                                       cu_seqlens=cu_t, backend=backend, states_at=torch.tensor(pos))
        assert rmse(o2, o) <= 1e-5 and rmse(st2, st) <= 1e-5 and rmse(ht2, ht) <= 1e-5, backend
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match="multiple of 16"):
            chunk_kda_gated(*_gated_args(x), cu_seqlens=cu_t, backend=backend, states_at=torch.tensor([20]))
        with pytest.raises(ValueError, match="twice"):
            chunk_kda_gated(*_gated_args(x), cu_seqlens=cu_t, backend=backend, states_at=torch.tensor([16, 16]))


def test_host_cu_seqlens_equals_device_cu_seqlens():
    """cu_seqlens on the host (as the serving engine passes it) gives bitwise the outputs, final states and
    `states_at` states of the same cu_seqlens on the inputs' device, for each backend (the non-Triton ones get a
    device copy)."""
    cu = [0, 40, 40, 75]
    x, _ = make(1, 75, 2, 32, 16, seed=16, N=3)
    host, dev = torch.tensor(cu, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32, device=DEV)
    for backend in ("triton", "torch", "reference"):
        outs = [chunk_kda_gated(*_gated_args(x), initial_state=x["h0"].to(DEV), output_final_state=True,
                                cu_seqlens=c, backend=backend, states_at=torch.tensor([16, 75])) for c in (dev, host)]
        for a, b in zip(*outs):
            assert a.device == b.device and torch.equal(a, b), backend


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_host_cu_seqlens_forward_makes_no_host_sync():
    """With cu_seqlens and states_at on the host, an inference forward (layout seen before) never waits for the
    device: sync debug mode "error" raises on any synchronising call."""
    x, _ = make(1, 75, 2, 32, 16, seed=16, N=3)
    host = torch.tensor([0, 40, 40, 75], dtype=torch.int32)
    args, h0 = _gated_args(x), x["h0"].to(DEV)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=host, backend="triton", lower_bound=-5.0)
    with torch.no_grad():
        ref = chunk_kda_gated(*args, states_at=torch.tensor([16, 75]), **kw)  # first call: tables built
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = chunk_kda_gated(*args, states_at=torch.tensor([16, 75]), **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


# ---------------------------------------------------------------- decode entry points
def test_decode_entry_points():
    """fused_recurrent_kda / kda_decode_step with backend='triton' equal the PyTorch versions."""
    x, _ = make(3, 6, 2, 32, 16, seed=16)
    g = kda_gate(x["f"], x["A_log"], x["dt_bias"])
    args = [t.to(DEV) for t in (x["q"], x["k"], x["v"], g, torch.sigmoid(x["beta"]))]
    h0 = x["h0"].to(DEV)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_t, h_t = fused_recurrent_kda(*args, backend="triton", **kw)
    o_r, h_r = fused_recurrent_kda(*args, backend="torch", **kw)
    assert rmse(o_r, o_t) <= 1e-5 and rmse(h_r, h_t) <= 1e-5 and torch.equal(h0, x["h0"].to(DEV))
    pool = torch.randn(5, 2, 32, 16, device=DEV)
    idx = torch.tensor([3, 1, 4], device=DEV)
    p_t, p_r = pool.clone(), pool.clone()
    o1, ret = kda_decode_step(*(t[:, 0] for t in args), p_t, state_indices=idx, backend="triton")
    o2, _ = kda_decode_step(*(t[:, 0] for t in args), p_r, state_indices=idx, backend="torch")
    assert ret is p_t and rmse(o2, o1) <= 1e-5 and rmse(p_r, p_t) <= 1e-5
    assert torch.equal(p_t[[0, 2]], pool[[0, 2]])


# ---------------------------------------------------------------- dispatch and validation
def test_dispatch_and_errors():
    x, _ = make(1, 20, 2, 16, 16, seed=17)
    a = _gated_args(x)
    o_t, _ = chunk_kda_gated(*a, backend="triton")
    o_c, _ = chunk_kda_gated(*a, backend="torch")
    assert rmse(o_c, o_t) <= 1e-5
    g = torch.full_like(a[0], -6.0)
    with pytest.raises(ValueError, match="g >= -5"):
        chunk_kda(a[0], a[1], a[2], g, torch.rand(1, 20, 2, device=DEV), backend="triton")
    with pytest.raises(ValueError, match="g >= -5"):  # a caller-guaranteed bound is checked, not trusted blindly
        chunk_kda(a[0], a[1], a[2], g, torch.rand(1, 20, 2, device=DEV), backend="triton", g_lower_bound=-6.0)
    gs = -5 * torch.rand_like(a[0])  # within the bound: the guaranteed bound gives the same result as reading min(g)
    beta = torch.rand(1, 20, 2, device=DEV)
    o1, _ = chunk_kda(a[0], a[1], a[2], gs, beta, backend="triton")
    o2, _ = chunk_kda(a[0], a[1], a[2], gs, beta, backend="triton", g_lower_bound=-5.0)
    assert torch.equal(o1, o2)
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_kda_gated(*a, backend="triton", lower_bound=-6.0)
    with pytest.raises(ValueError, match="A_log"):
        chunk_kda_gated(*a[:5], torch.zeros(3, device=DEV), a[6], backend="triton")
    big = torch.randn(1, 4, 1, 256, device=DEV)
    with pytest.raises(ValueError, match="up to 128"):
        chunk_kda(big, big, big, -torch.rand_like(big), torch.rand(1, 4, 1, device=DEV), backend="triton")


# ---------------------------------------------------------------- GPU only: bf16, K3 sizes, fla
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@cuda
@needs_cuda
@pytest.mark.parametrize("f_shift,f_scale", GATES, ids=["f~-8", "f~-4", "f~0", "f~+8", "f~N(0,64)"])
def test_gpu_bf16_k128(f_shift, f_scale):
    x, gr = make(2, 500, 4, 128, 128, seed=20, f_shift=f_shift, f_scale=f_scale)
    for n in ("q", "k", "v", "f", "beta"):  # the oracle sees the same bf16-rounded inputs
        x[n] = x[n].bfloat16().float()
    compare(x, gr, dtype=torch.bfloat16)


@cuda
@needs_cuda
def test_gpu_bf16_varlen():
    cu = [0, 15, 100, 300, 1200, 2000]
    x, gr = make(1, cu[-1], 4, 128, 128, seed=21, N=len(cu) - 1, f_scale=4.0)
    for n in ("q", "k", "v", "f", "beta"):
        x[n] = x[n].bfloat16().float()
    compare(x, gr, dtype=torch.bfloat16, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV))


@cuda
@needs_cuda
@pytest.mark.parametrize("f_shift,f_scale", [(-8.0, 1.0), (0.0, 8.0)], ids=["f~-8", "f~N(0,64)"])
def test_gpu_bf16_forward_without_autograd(f_shift, f_scale):
    """The inference forward (PRE) in bf16 at K = V = 128, varlen, against the fp64 oracle."""
    cu = [0, 15, 100, 333, 1200, 2000]
    x, _ = make(1, cu[-1], 4, 128, 128, seed=24, N=len(cu) - 1, f_shift=f_shift, f_scale=f_scale)
    for n in ("q", "k", "v", "f", "beta"):
        x[n] = x[n].bfloat16().float()
    kw = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV))
    o, ht = _forward_only(x, torch.bfloat16, **kw)
    ref_o, ref_h = reference_gated(*[t.double().to(DEV) for t in _gated_args(x, "cpu")],
                                   initial_state=x["h0"].double().to(DEV), output_final_state=True, **kw)
    print("rel-RMS o", rmse(ref_o, o), "ht", rmse(ref_h, ht))
    assert rmse(ref_o, o) <= TOL["o"] and rmse(ref_h, ht) <= TOL["ht"], (rmse(ref_o, o), rmse(ref_h, ht))


@cuda
@needs_cuda
def test_gpu_fp32_tight():
    x, gr = make(2, 300, 3, 64, 64, seed=22, f_scale=4.0)
    compare(x, gr, dtype=torch.float32, strict=STRICT)
