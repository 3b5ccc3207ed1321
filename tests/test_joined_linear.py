"""`k3.ops.joined_linear` against separate `F.linear` calls: values and gradients (fp64 exact up to summation
order; bf16 autocast within its rounding), unused pieces, grouped pieces, and bad inputs."""
import pytest
import torch
import torch.nn.functional as F

from conftest import rel_rmse
from k3.ops.joined_linear import MULTIPLE, joined_linear

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(dtype, seed=0, D=24, rows=(10, 7, 1, 12)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, D, generator=gen, dtype=dtype).requires_grad_()
    ws = [torch.randn(n, D, generator=gen, dtype=dtype).requires_grad_() for n in rows]
    return gen, x, ws


def _grads(outs, dys, x, ws):
    loss = sum((o.double() * dy.double()).sum() for o, dy in zip(outs, dys) if dy is not None)
    return torch.autograd.grad(loss, [x, *ws], allow_unused=True)


@pytest.mark.parametrize("unused", [None, 1], ids=["all-used", "piece-unused"])
def test_equals_separate_linears_fp64(unused):
    """Pieces [W0, W1] (one output), W2, W3: values equal, and gradients to fp64 rounding; an unused piece gives
    its weights no gradient and x none of its term."""
    gen, x, ws = _setup(torch.float64)
    outs = joined_linear(x, [[ws[0], ws[1]], ws[2], ws[3]])
    assert [o.shape[-1] for o in outs] == [17, 1, 12]
    ref = [F.linear(x, torch.cat([ws[0], ws[1]])), F.linear(x, ws[2]), F.linear(x, ws[3])]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=1e-12)
    dys = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    if unused is not None:
        dys[unused] = None
    got = _grads(outs, dys, x, ws)
    want = _grads(ref, dys, x, ws)
    for name, g, w in zip(["x", "W0", "W1", "W2", "W3"], got, want):
        if w is None:
            assert g is None, name
        else:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


def test_outputs_are_views_of_one_aligned_gemm_output():
    """No copy per piece: every output lies in one buffer whose row stride is the joined width padded to
    MULTIPLE."""
    _, x, ws = _setup(torch.float32)
    outs = joined_linear(x, ws)
    width = -(-sum(w.shape[0] for w in ws) // MULTIPLE) * MULTIPLE
    base = outs[0].untyped_storage().data_ptr()
    assert all(o.untyped_storage().data_ptr() == base for o in outs)
    assert all(o.stride()[-2:] == (width, 1) for o in outs)


def test_bf16_autocast_like_f_linear():
    """Under bf16 autocast (fp32 masters): bf16 outputs equal F.linear's (the same GEMM in bf16), fp32 gradients
    of the masters within bf16 rounding of the separate path's."""
    gen, x, ws = _setup(torch.float32, seed=1, D=64, rows=(48, 16, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = joined_linear(x, ws)
        ref = [F.linear(x, w) for w in ws]
    assert all(o.dtype == torch.bfloat16 for o in outs)
    for o, r in zip(outs, ref):
        assert rel_rmse(r.float(), o.float()) < 1e-2
    dys = [torch.randn(o.shape, generator=gen).bfloat16() for o in outs]
    got = torch.autograd.grad(sum((o * dy).sum() for o, dy in zip(outs, dys)), [x, *ws])
    want = torch.autograd.grad(sum((r * dy).sum() for r, dy in zip(ref, dys)), [x, *ws])
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        assert rel_rmse(w, g) < 1e-2


def test_only_weights_or_only_x_need_grad():
    gen, x, ws = _setup(torch.float64, seed=2)
    xd = x.detach()
    outs = joined_linear(xd, ws)
    g = torch.autograd.grad(sum(o.sum() for o in outs), ws)
    for gi, w in zip(g, ws):
        torch.testing.assert_close(gi, xd.reshape(-1, xd.shape[-1]).sum(0).expand_as(w))
    outs = joined_linear(x, [w.detach() for w in ws])
    (gx,) = torch.autograd.grad(sum(o.sum() for o in outs), [x])
    torch.testing.assert_close(gx, sum(w.detach().sum(0) for w in ws).expand_as(x))


def test_bad_inputs():
    _, x, ws = _setup(torch.float32)
    with pytest.raises(ValueError, match="at least one weight"):
        joined_linear(x, [])
    with pytest.raises(ValueError, match="at least one weight"):
        joined_linear(x, [[]])
    with pytest.raises(ValueError, match=r"\[n, 24\]"):
        joined_linear(x, [torch.randn(3, 23)])
    with pytest.raises(ValueError, match="dtype"):
        joined_linear(x, [ws[0].double()])


@pytest.mark.parametrize("q_lora", [True, False], ids=["q-lora", "q-proj"])
def test_model_training_step_equal_with_joined_projections(monkeypatch, q_lora):
    """k3-tiny in fp64 on packed documents: the loss and every parameter's gradient are the same with the KDA,
    MLA and LatentMoE input projections joined (`K3_JOINED_PROJ`) as without, and the joined paths ran."""
    import k3.ops.joined_linear as JL
    from conftest import make_tiny
    model = make_tiny(seed=3, **({} if q_lora else {"q_lora_rank": None})).double().train()
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 200, (1, 40), generator=gen)
    cu = torch.tensor([0, 13, 29, 40], dtype=torch.int32)
    calls = []
    real = JL.joined_linear
    monkeypatch.setattr(JL, "joined_linear", lambda x, pieces: calls.append(len(pieces)) or real(x, pieces))
    res = {}
    for on in (False, True):
        monkeypatch.setattr(JL, "ENABLED", on)
        model.zero_grad()
        out = model(ids, labels=ids, cu_seqlens=cu)
        (out.loss + 0.1 * out.mtp_loss).backward()
        res[on] = (out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    # MoE (latent, shared gate | up), MLA (q or q_a, latent, gate) and KDA (qkv, f_a, beta, gate)
    assert sorted(set(calls)) == [2, 3, 4], calls
    torch.testing.assert_close(res[True][0], res[False][0], rtol=1e-12, atol=0)
    assert res[True][1].keys() == res[False][1].keys()
    for n, g in res[False][1].items():
        torch.testing.assert_close(res[True][1][n], g, rtol=1e-9, atol=1e-12, msg=n)
