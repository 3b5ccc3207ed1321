"""The memory-lean "torch" backends of the short conv and the RMSNorms (one autograd Function each, the CPU
training path) against their references: values and every gradient in fp64, and what they keep for the
backward (inputs and [rows] statistics only: that is what makes CPU training memory linear in T with a small
constant)."""
import pytest
import torch

from conftest import rel_rmse
from k3.ops.conv import short_conv, short_conv_split
from k3.ops.norm import rms_norm, rms_norm_gated

pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(fn, *leaves, seed=0):
    """fn(*leaves) → (out, grads of every leaf) for a random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in leaves]
    out = fn(*leaves)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 99), dtype=out.dtype)
    (out * dy).sum().backward()
    return out.detach(), [t.grad if t is not None else None for t in leaves]


def _saved_bytes(fn, *args) -> int:
    """Bytes of distinct storages autograd keeps for fn(*args)'s backward."""
    seen, total = set(), [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total[0]


@pytest.mark.parametrize("W", [4, 3, 2])
@pytest.mark.parametrize("docs", [None, [0, 1, 4, 24, 37, 50, 53, 74]])
def test_short_conv_torch_matches_reference_fp64(W, docs):
    gen = torch.Generator().manual_seed(W)
    x = torch.randn(2, 37, 24, generator=gen, dtype=torch.float64)
    w = torch.randn(24, 1, W, generator=gen, dtype=torch.float64)
    cu = None if docs is None else torch.tensor(docs, dtype=torch.int32)
    ref = _grads(lambda a, b: short_conv(a, b, cu_seqlens=cu, backend="reference")[0], x, w)
    got = _grads(lambda a, b: short_conv(a, b, cu_seqlens=cu, backend="torch")[0], x, w)
    assert rel_rmse(ref[0], got[0]) <= 1e-12
    for r, g in zip(ref[1], got[1]):
        assert rel_rmse(r, g) <= 1e-12
    # the split form is the same tensor cut into contiguous pieces
    parts = short_conv_split(x, w, (8, 16), cu_seqlens=cu, backend="torch")
    assert all(p.is_contiguous() for p in parts) and torch.equal(torch.cat(parts, -1), got[0])


def test_short_conv_torch_keeps_only_x():
    x = torch.randn(1, 512, 64, requires_grad=True)
    w = torch.randn(64, 1, 4, requires_grad=True)
    cu = torch.tensor([0, 100, 512], dtype=torch.int32)
    lean = _saved_bytes(lambda: short_conv(x, w, cu_seqlens=cu, backend="torch"))
    ref = _saved_bytes(lambda: short_conv(x, w, cu_seqlens=cu, backend="reference"))
    xb = x.numel() * 4
    assert lean <= xb + w.numel() * 4 + 512 * 8, lean  # x, the weight and the int64 positions
    assert ref >= 4 * xb, ref  # the reference keeps a masked shifted copy per tap and the pre-activation


def test_short_conv_torch_rejects_a_state():
    x, w = torch.randn(1, 5, 4), torch.randn(4, 1, 4)
    with pytest.raises(ValueError, match="conv state"):
        short_conv(x, w, state=torch.zeros(1, 4, 3), backend="torch")
    # auto falls back to the reference for the stateful (decode) case
    y, st = short_conv(x, w, state=torch.zeros(1, 4, 3), output_final_state=True)
    assert st is not None and y.shape == x.shape


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_torch_matches_reference_fp64(gated, with_weight):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 40, generator=gen, dtype=torch.float64) * 3
    w = (1 + 0.2 * torch.randn(40, generator=gen, dtype=torch.float64)) if with_weight else None
    gate = torch.randn(3, 7, 40, generator=gen, dtype=torch.float64) if gated else None
    if gated:
        ref = _grads(lambda a, b, c: rms_norm_gated(a, b, c, 1e-5, backend="reference"), x, w, gate)
        got = _grads(lambda a, b, c: rms_norm_gated(a, b, c, 1e-5, backend="torch"), x, w, gate)
    else:
        ref = _grads(lambda a, b: rms_norm(a, b, 1e-5, backend="reference"), x, w)
        got = _grads(lambda a, b: rms_norm(a, b, 1e-5, backend="torch"), x, w)
    assert rel_rmse(ref[0], got[0]) <= 1e-12
    for r, g in zip(ref[1], got[1]):
        assert (r is None) == (g is None)
        if r is not None:
            assert rel_rmse(r, g) <= 1e-12


def test_rms_norm_torch_keeps_inputs_and_rstd_only():
    x = torch.randn(256, 128, requires_grad=True)
    w = torch.randn(128, requires_grad=True)
    lean = _saved_bytes(lambda: rms_norm(x, w, 1e-5, backend="torch"))
    assert lean <= (x.numel() + w.numel() + 256) * 4, lean
    assert _saved_bytes(lambda: rms_norm(x, w, 1e-5, backend="reference")) >= 2 * x.numel() * 4


@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_kda_torch_segments_recompute_exactly(varlen):
    """The torch KDA path recomputes segments of chunks in the backward (memory linear in T): cutting into
    segments of 2 chunks gives the values and gradients of one segment, and both match the fp64 oracle."""
    from k3.ops.kda import chunk_kda_torch, recurrent_kda
    gen = torch.Generator().manual_seed(5)
    T, H, K, V = 300, 2, 16, 8
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V),
             g=-torch.rand(1, T, H, K, generator=gen, dtype=torch.float64) * 2,
             beta=torch.rand(1, T, H, generator=gen, dtype=torch.float64), h0=r(3 if varlen else 1, H, K, V))
    cu = torch.tensor([0, 40, 231, 300], dtype=torch.int32) if varlen else None

    def run(fn, **kw):
        leaf = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, ht = fn(leaf["q"], leaf["k"], leaf["v"], leaf["g"], leaf["beta"], initial_state=leaf["h0"],
                   output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, **kw)
        (o * 1.3).sum().backward(inputs=list(leaf.values()), retain_graph=True)
        (ht * 0.7).sum().backward(inputs=list(leaf.values()))
        return [o.detach(), ht.detach()] + [leaf[n].grad for n in x]

    seg = run(chunk_kda_torch, chunk_size=64, segment_chunks=2)
    whole = run(chunk_kda_torch, chunk_size=64, segment_chunks=64)
    oracle = run(recurrent_kda)
    for a, b, c in zip(seg, whole, oracle):
        assert rel_rmse(b, a) <= 1e-12
        assert rel_rmse(c, a) <= 1e-9


def _experts_per_token(x, idx, w, w1, w2, w3, beta=4.0, linear_beta=25.0):
    """Independent oracle: Σ_k w[n, k] · expert_{idx[n, k]}(x[n]), one token and route at a time."""
    from k3.ops.situ import situ_glu_reference
    rows = []
    for n in range(x.shape[0]):
        acc = 0
        for k in range(idx.shape[1]):
            e = int(idx[n, k])
            h = situ_glu_reference(w1[e] @ x[n], w3[e] @ x[n], beta, linear_beta)
            acc = acc + w[n, k] * (w2[e] @ h)
        rows.append(acc)
    return torch.stack(rows)


def test_experts_loop_recompute_matches_per_token_fp64():
    """The CPU experts path (`ExpertsLoop`: recompute in the backward) equals a per-token oracle in values and in
    the gradients of x, the routing weights and all expert weights (fp64); an unused expert gets zero grads."""
    from k3.ops.moe import experts_forward
    g = torch.Generator().manual_seed(7)
    N, L, I, E, K = 23, 12, 10, 6, 2
    x = torch.randn(N, L, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(N)])  # expert E-1 never routed
    w = torch.rand(N, K, generator=g, dtype=torch.float64)
    w1, w3 = (torch.randn(E, I, L, generator=g, dtype=torch.float64) * 0.3 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=g, dtype=torch.float64) * 0.3
    got, ggot = _grads(lambda a, b, c, d, e: experts_forward(a, idx, b, c, d, e), x, w, w1, w2, w3)
    ref, gref = _grads(lambda a, b, c, d, e: _experts_per_token(a, idx, b, c, d, e), x, w, w1, w2, w3)
    assert rel_rmse(got, ref) < 1e-12
    for name, a, b in zip(["x", "weight", "w1", "w2", "w3"], ggot, gref):
        assert rel_rmse(a, b) < 1e-12, name
    assert ggot[2][E - 1].abs().max() == 0 and ggot[3][E - 1].abs().max() == 0


def test_experts_loop_keeps_only_its_inputs():
    """What the CPU experts path saves for the backward does not grow with the intermediate size or top-k
    (x, routing weights, expert weights and the sort order only)."""
    from k3.ops.moe import experts_forward
    g = torch.Generator().manual_seed(8)

    def saved(I, K):
        N, L, E = 512, 16, 8
        x = torch.randn(N, L, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
        w = torch.rand(N, K, generator=g, requires_grad=True)
        ws = [torch.randn(E, I, L, requires_grad=True), torch.randn(E, L, I, requires_grad=True),
              torch.randn(E, I, L, requires_grad=True)]
        weights = sum(t.numel() * 4 for t in ws)
        return _saved_bytes(lambda: experts_forward(x, idx, w, *ws)) - weights
    small, big = saved(8, 1), saved(64, 4)
    assert small == 512 * 16 * 4 + 512 * 1 * 4 + 512 * 1 * 8      # x, routing weights, int64 order
    assert big == 512 * 16 * 4 + 512 * 4 * 4 + 512 * 4 * 8
