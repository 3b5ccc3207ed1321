"""Document-causal attention (k3.ops.attention): the sdpa and flex backends against the dense masked
reference, the flex BlockMask tables against the dense mask, MLA on the new path against its dense path,
and memory linear in T on the CPU path."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import make_tiny, rel_rmse
from k3.model.mla import MLAttention
from k3.ops.attention import (doc_attention_mask, doc_block_mask, doc_block_tables, doc_causal_attention,
                              flex_doc_attention, reference_doc_attention, token_docs)

CUDA = torch.cuda.is_available()
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def random_cu(B: int, T: int, max_len: int, g: torch.Generator, empty: bool = False) -> torch.Tensor:
    """Random document lengths in [1, max_len] per row (every row boundary a document boundary);
    empty=True repeats a few bounds (zero-length documents)."""
    bounds = [0]
    for r in range(B):
        pos = r * T
        while pos < (r + 1) * T:
            pos = min(pos + int(torch.randint(1, max_len + 1, (1,), generator=g)), (r + 1) * T)
            bounds.append(pos)
            if empty and torch.rand(1, generator=g) < 0.2:
                bounds.append(pos)
    return torch.tensor(bounds, dtype=torch.int32)


# (B, T, max document length or None for one document per row, zero-length documents)
LAYOUTS = {
    "many_short": (2, 300, 20, False),  # many documents, most shorter than a 128 block, 1-token ones likely
    "cross_blocks": (3, 256, 150, True),  # documents across block boundaries, T % 128 == 0, empty documents
    "one_long_per_row": (2, 260, None, False),  # cu_seqlens None
    "one_long_packed": (1, 200, 1000, False),  # a single document as cu_seqlens [0, T]
    "short_row": (2, 77, 30, False),  # T shorter than one block
}


def make_inputs(layout: str, dtype=torch.float64, H=3, Dq=24, Dv=16, seed=0):
    B, T, max_len, empty = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    cu = None if max_len is None else random_cu(B, T, max_len, g, empty)
    q, k = (torch.randn(B, T, H, Dq, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
    return q, k, v, cu


def textbook(q, k, v, scale, cu):
    """Per document and head: softmax(scale·q kᵀ + causal mask) v, fp64 loops over the flattened tokens."""
    B, T, H, _ = q.shape
    bounds = sorted({r * T for r in range(B + 1)} | (set() if cu is None else set(cu.tolist())))
    qf, kf, vf = (x.reshape(B * T, H, -1).double() for x in (q, k, v))
    out = torch.zeros(B * T, H, v.shape[-1], dtype=torch.float64)
    best = torch.full((H,), -math.inf, dtype=torch.float64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        for h in range(H):
            s = (qf[a:b, h] @ kf[a:b, h].T) * scale
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), -math.inf)
            out[a:b, h] = torch.softmax(s, -1) @ vf[a:b, h]
            best[h] = max(best[h], s.max())
    return out.view(B, T, H, -1), best


@pytest.mark.parametrize("layout", ["many_short", "cross_blocks", "one_long_per_row"])
def test_reference_is_textbook_attention(layout):
    q, k, v, cu = make_inputs(layout, seed=1)
    o, mx = reference_doc_attention(q, k, v, 0.3, cu, return_max_logit=True)
    o_ref, mx_ref = textbook(q, k, v, 0.3, cu)
    assert rel_rmse(o_ref, o) < 1e-12
    assert torch.allclose(mx, mx_ref, rtol=1e-13, atol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sdpa_matches_reference_fp64_values_grads_max_logit(layout):
    q, k, v, cu = make_inputs(layout, seed=2)
    scale = 24 ** -0.5
    outs = {}
    for backend in ("reference", "sdpa"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o, mx = doc_causal_attention(qq, kk, vv, scale, cu, return_max_logit=True, backend=backend)
        go = torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=o.dtype)
        grads = torch.autograd.grad(o, (qq, kk, vv), go)
        outs[backend] = (o.detach(), mx, grads)
    (o_r, mx_r, g_r), (o_s, mx_s, g_s) = outs["reference"], outs["sdpa"]
    assert o_s.shape == o_r.shape == (*q.shape[:3], v.shape[-1]) and o_s.dtype == torch.float64
    assert rel_rmse(o_r, o_s) < 1e-10
    for name, a, b in zip("qkv", g_r, g_s):
        assert rel_rmse(a, b) < 1e-10, name
    assert mx_s.shape == (q.shape[2],) and mx_s.dtype == torch.float64
    assert torch.allclose(mx_s, mx_r, rtol=1e-12, atol=0)


def test_sdpa_matches_reference_fp32_grads():
    q, k, v, cu = make_inputs("cross_blocks", dtype=torch.float32, seed=4)
    res = {}
    for backend in ("reference", "sdpa"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o, mx = doc_causal_attention(qq, kk, vv, 0.2, cu, return_max_logit=True, backend=backend)
        o.square().sum().backward()
        res[backend] = (o.detach(), mx, qq.grad, kk.grad, vv.grad)
    assert res["sdpa"][1].dtype == torch.float32
    for a, b in zip(res["reference"], res["sdpa"]):
        assert rel_rmse(a, b) < 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flex_eager_matches_reference_fp64(layout):
    """Eager flex on CPU (forward only: torch's flex has no CPU backward). Its dense math path applies the
    mask_mod on the whole grid, so the block tables are checked separately below."""
    q, k, v, cu = make_inputs(layout, seed=5)
    o_r, mx_r = doc_causal_attention(q, k, v, 0.25, cu, return_max_logit=True, backend="reference")
    o_f, mx_f = doc_causal_attention(q, k, v, 0.25, cu, return_max_logit=True, backend="flex")
    assert rel_rmse(o_r, o_f) < 1e-10
    assert torch.allclose(mx_f, mx_r, rtol=1e-12, atol=0)
    assert rel_rmse(o_r, doc_causal_attention(q, k, v, 0.25, cu, backend="flex")) < 1e-10


def emulate_block_sparse(bm, docs: torch.Tensor, side: str) -> torch.Tensor:
    """The [B, T, T] mask a block-sparse kernel applies when driven by the BlockMask's tables: pairs in a
    listed full block are allowed, pairs in a listed partial block go through mask_mod, all others are
    skipped. side "kv": the forward's per-query-block key lists; "q": the backward's per-key-block query lists."""
    B, T = docs.shape
    bs = bm.BLOCK_SIZE[0]
    n = -(-T // bs)
    out = torch.zeros(B, T, T, dtype=torch.int64)  # counts: a pair visited twice would show as 2
    tabs = ((bm.kv_num_blocks, bm.kv_indices, False), (bm.full_kv_num_blocks, bm.full_kv_indices, True)) \
        if side == "kv" else ((bm.q_num_blocks, bm.q_indices, False), (bm.full_q_num_blocks, bm.full_q_indices, True))
    for num, idx, full in tabs:
        assert num.dtype == idx.dtype == torch.int32 and num.shape == (B, 1, n) and idx.shape == (B, 1, n, n)
        for b in range(B):
            for r in range(n):
                for c in idx[b, 0, r, :num[b, 0, r]].tolist():
                    qi, kj = (r, c) if side == "kv" else (c, r)
                    tq = torch.arange(qi * bs, min((qi + 1) * bs, T))
                    tk = torch.arange(kj * bs, min((kj + 1) * bs, T))
                    m = torch.ones(len(tq), len(tk), dtype=torch.bool) if full else \
                        bm.mask_mod(torch.tensor(b), torch.tensor(0), tq[:, None], tk[None, :])
                    out[b, tq[:, None], tk[None, :]] += m.long()
    assert out.max() <= 1, "a (query, key) pair is covered by two listed blocks"
    return out.bool()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("B,T,max_len", [(3, 384, 200), (2, 300, 40), (2, 77, 20), (1, 129, 128), (2, 512, 600)])
def test_block_mask_tables_equal_dense_mask(B, T, max_len, seed):
    g = torch.Generator().manual_seed(100 + seed)
    cu = random_cu(B, T, max_len, g, empty=seed % 2 == 1)
    docs = token_docs(cu, B, T, "cpu")
    dense = doc_attention_mask(cu, B, T, "cpu")[:, 0]
    bm = doc_block_mask(docs)
    assert emulate_block_sparse(bm, docs, "kv").equal(dense)
    assert emulate_block_sparse(bm, docs, "q").equal(dense)
    # the tables are exact: a block is listed iff it holds an allowed pair, and full iff all its pairs are
    # allowed (below the diagonal; diagonal blocks always go through mask_mod)
    partial, full = (t[:, 0] for t in doc_block_tables(docs))
    n = partial.shape[-1]
    pad = torch.zeros(B, n * 128, n * 128, dtype=torch.int8)
    pad[:, :T, :T] = dense.to(torch.int8)
    valid = torch.zeros(n * 128, dtype=torch.bool)
    valid[:T] = True
    blocks = pad.view(B, n, 128, n, 128).transpose(2, 3)
    vmask = (valid.view(n, 128)[:, None, :, None] & valid.view(n, 128)[None, :, None, :])
    any_allowed = blocks.amax(dim=(-1, -2)).bool()
    all_allowed = (blocks.bool() | ~vmask).flatten(-2).all(-1)
    below = torch.ones(n, n, dtype=torch.bool).tril(-1)
    assert (partial | full).equal(any_allowed) and not (partial & full).any()
    assert full.equal(all_allowed & below)


def test_no_recompile_for_a_new_batch_cpu():
    """Compiled flex (aot_eager on CPU) with the document BlockMask: a new batch with new cu_seqlens and the
    same shapes reuses the graph (the block tables and document ids are tensors, not guarded constants)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(flex_attention, backend="aot_eager", dynamic=False)
    q, k, v, _ = make_inputs("many_short", dtype=torch.float32, seed=6)
    B, T = q.shape[:2]
    g = torch.Generator().manual_seed(7)
    for i, max_len in enumerate((20, 200)):
        cu = random_cu(B, T, max_len, g)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            o = flex_doc_attention(q, k, v, 0.3, token_docs(cu, B, T, "cpu"), flex_fn=fn)
        assert rel_rmse(reference_doc_attention(q, k, v, 0.3, cu), o) < 1e-5
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


# ---- MLA on the new path ---------------------------------------------------------------------------
def _run_model(backend: str, grad: bool = True):
    model = make_tiny(seed=7).double().train()
    for m in model.modules():  # plain LM head: logits are formed (the fused loss head returns none)
        if hasattr(m, "loss_impl"):
            m.loss_impl = "plain"
    mlas = [m for m in model.modules() if isinstance(m, MLAttention)]
    for m in mlas:
        m.attn_backend, m.record_max_logit = backend, True
    ids = torch.randint(0, 4000, (2, 32), generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0, 5, 17, 24, 30, 31, 32, 48, 60, 61, 64], dtype=torch.int32)  # 1-token documents
    with torch.set_grad_enabled(grad):
        out = model(ids, labels=ids, cu_seqlens=cu)
    grads = {}
    if grad:
        (out.loss + out.mtp_loss).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, [m.max_logit.clone() for m in mlas]


def test_mla_doc_path_matches_dense_reference_in_training():
    ref, g_ref, mx_ref = _run_model("reference")
    new, g_new, mx_new = _run_model("auto")  # sdpa on CPU
    assert rel_rmse(ref.logits, new.logits) < 1e-10
    assert abs(ref.loss.item() - new.loss.item()) < 1e-10 and abs(ref.mtp_loss.item() - new.mtp_loss.item()) < 1e-10
    assert g_ref.keys() == g_new.keys() and len(g_ref) > 10
    for n in g_ref:
        if g_ref[n].abs().sum() > 0:
            assert rel_rmse(g_ref[n], g_new[n]) < 1e-10, n
    assert len(mx_ref) >= 2
    for a, b in zip(mx_ref, mx_new):  # the dense path records fp32 maxima
        assert b.dtype == torch.float32 and b.shape == a.shape
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
    flex, _, mx_flex = _run_model("flex", grad=False)  # eager flex on CPU: forward only
    assert rel_rmse(ref.logits, flex.logits) < 1e-10
    for a, b in zip(mx_ref, mx_flex):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)


def test_mla_path_choice(monkeypatch):
    """No cache and no attention_mask: doc_causal_attention, no dense mask; with an attention_mask or an
    explicit absorbed impl, the dense masked path (still equal)."""
    model = make_tiny(seed=9).double()
    mla = next(m for m in model.modules() if isinstance(m, MLAttention))
    x = torch.randn(2, 11, model.config.text_config.hidden_size, dtype=torch.float64)
    calls = []
    import k3.model.mla as mla_mod
    orig = mla_mod.causal_mask
    monkeypatch.setattr(mla_mod, "causal_mask", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    with torch.no_grad():
        new = mla(x)
        assert calls == []
        mla.attn_backend = "reference"
        ref = mla(x)
        assert len(calls) == 1
        mla.attn_backend = "auto"
        masked = mla(x, attention_mask=torch.ones(2, 11, dtype=torch.long))
        mla.attn_impl = "absorbed"
        absorbed = mla(x)
        assert len(calls) == 3
    for o in (ref, masked, absorbed):
        assert rel_rmse(new, o) < 1e-10


def test_bad_inputs_named():
    q, k, v, cu = make_inputs("many_short", dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        doc_causal_attention(q, k, v, 0.1, cu, backend="nope")
    with pytest.raises(ValueError, match=r"v \[B, T, H, Dv\]"):
        doc_causal_attention(q, k, v[:, :5], 0.1, cu)
    with pytest.raises(ValueError, match="end at the token count 600"):
        doc_causal_attention(q, k, v, 0.1, torch.tensor([0, 5, 500], dtype=torch.int32), backend="sdpa")
    with pytest.raises(ValueError, match="no backward on cpu"):
        doc_causal_attention(q.requires_grad_(), k, v, 0.1, cu, backend="flex")


MEM_SCRIPT = textwrap.dedent("""
    import resource, torch
    from k3.ops.attention import doc_causal_attention
    torch.manual_seed(0)
    T, H = 16384, 4
    q, k = (torch.randn(1, T, H, 24, requires_grad=True) for _ in range(2))
    v = torch.randn(1, T, H, 16, requires_grad=True)
    cu = torch.tensor([0, 3000, 3001, T], dtype=torch.int32)  # one 13K-token document among others
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    o, mx = doc_causal_attention(q, k, v, 0.2, cu, return_max_logit=True, backend="auto")
    o.square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(mx).all()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
""")


def test_cpu_path_memory_linear_in_t():
    """T 16384, H 4, Dq 24, Dv 16, fp32, forward + backward + max logit on the CPU path: the peak RSS
    growth stays far below one dense fp32 [H, T, T] score matrix (4.3 GB; the dense path needs several)."""
    res = subprocess.run([sys.executable, "-c", MEM_SCRIPT], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    grown = int(res.stdout.split()[-1])
    dense = 4 * 16384 ** 2 * 4
    assert grown < dense / 8, f"peak RSS grew by {grown / 2**20:.0f} MiB"


# ---- CUDA -------------------------------------------------------------------------------------------
def _cuda_case(seed: int, B=2, T=4096, H=12, Dq=192, Dv=128, mean_doc=2048):
    g = torch.Generator().manual_seed(seed)
    cu = random_cu(B, T, 2 * mean_doc, g).cuda()
    q, k = (torch.randn(B, T, H, Dq, generator=g).cuda().bfloat16() for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g).cuda().bfloat16()
    return q, k, v, cu


def _fwd_bwd(q, k, v, cu, backend, go):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o, mx = doc_causal_attention(qq, kk, vv, 192 ** -0.5, cu, return_max_logit=True, backend=backend)
    o.backward(go.to(o.dtype))
    return o.detach(), mx, qq.grad, kk.grad, vv.grad


@cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_cuda_bf16_matches_fp32_reference(backend):
    """bf16, B 2, T 4096, H 12, Dq 192, Dv 128 against the dense reference run in fp32 on the same inputs:
    o and grads rel RMS <= 1e-2, max_logit (flex: the kernel's max_scores) within 1e-2 relative."""
    q, k, v, cu = _cuda_case(0)
    go = torch.randn(*q.shape[:3], v.shape[-1], device="cuda")
    ref = _fwd_bwd(q.float(), k.float(), v.float(), cu, "reference", go)
    new = _fwd_bwd(q, k, v, cu, backend, go)
    assert new[0].dtype == torch.bfloat16 and new[1].dtype == torch.float32
    for name, a, b in zip(("o", "max_logit", "dq", "dk", "dv"), ref, new):
        assert rel_rmse(a, b) < 1e-2, name
    assert torch.allclose(new[1], ref[1], rtol=1e-2, atol=0)


@cuda
@needs_cuda
def test_cuda_flex_no_recompile_across_batches():
    from torch._dynamo.utils import counters

    go = torch.randn(2, 4096, 12, 128, device="cuda")
    q, k, v, cu = _cuda_case(1)
    _fwd_bwd(q, k, v, cu, "flex", go)  # compiles (or reuses the graph of an earlier test)
    graphs = counters["stats"]["unique_graphs"]
    q, k, v, cu = _cuda_case(2, mean_doc=300)  # new documents, same shapes
    with torch._dynamo.config.patch(error_on_recompile=True):
        o, mx, *_ = _fwd_bwd(q, k, v, cu, "flex", go)
    assert counters["stats"]["unique_graphs"] == graphs
    ref = doc_causal_attention(q.float(), k.float(), v.float(), 192 ** -0.5, cu, backend="reference")
    assert rel_rmse(ref, o) < 1e-2


@cuda
@needs_cuda
def test_cuda_tiny_model_autocast_flex_matches_reference():
    """k3-tiny (Dq 24, Dv 16) on CUDA under bf16 autocast with packed documents: "auto" (flex, T 256) vs
    the dense path: logits, a gradient and the QK-clip maxima within bf16 tolerance."""
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 4000, (2, 256), generator=g).cuda()
    cu = random_cu(2, 256, 90, g).cuda()
    res = {}
    for backend in ("reference", "auto"):
        model = make_tiny(seed=11).cuda().train()
        for m in model.modules():
            if hasattr(m, "loss_impl"):
                m.loss_impl = "plain"
        mlas = [m for m in model.modules() if isinstance(m, MLAttention)]
        for m in mlas:
            m.attn_backend, m.record_max_logit = backend, True
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, labels=ids, cu_seqlens=cu)
        out.loss.backward()
        w = mlas[0].kv_b_proj.weight.grad
        res[backend] = (out.logits.float(), w.clone(), torch.stack([m.max_logit for m in mlas]))
    for name, a, b in zip(("logits", "kv_b grad", "max_logit"), res["reference"], res["auto"]):
        assert rel_rmse(a, b) < 2e-2, name
