"""The fast MoE / MLP path against the slow, obviously-correct one.

- SiTU-GLU: the Triton kernels (CPU: Triton's interpreter, fp32) and the torch Function against the fp64
  reference formula, values and both input gradients, with |g|, |u| far into the caps: rel RMS <= 1e-5.
- The router's bf16-split GEMM, the token permutation (sort / dispatch / combine) and the gate ‖ up weight.
- SituMLP and LatentMoE (loop and sorted-rows paths) in fp64 on CPU against today's code, copied below
  (separate gate/up GEMMs, the reference SiTU, index_add combine): outputs and every gradient, rel RMS <= 1e-10.
- CUDA: bf16 LatentMoE at k3-small sizes under autocast against the fp32 expert loop, rel RMS <= 2e-2 on the
  output and every gradient, with the sync debug mode set to "error" (no host sync).
"""
import functools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny, rel_rmse
from k3.config import K3Config
from k3.model import moe as model_moe
from k3.model.layers import SituMLP
from k3.model.moe import LatentMoE
from k3.ops import moe as moe_ops
from k3.ops.situ import gate_up_weight, situ_glu, situ_glu_fused
from k3.ops.situ.reference import situ_glu_reference

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
triton = pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("one_thread")


def rng(seed):
    return torch.Generator().manual_seed(seed)


# ---- SiTU-GLU ---------------------------------------------------------------------------------------------
def situ_inputs(M, I, seed):
    """g, u, dout [M, I] fp64: column bands at scales 0.01 (tanh's series range), 1, 8 and 60 (gate) / 300 (up)
    so both caps saturate; plus exact zeros and ±200 entries."""
    gen = rng(seed)
    sg = torch.tensor([0.01, 1.0, 8.0, 60.0]).repeat_interleave((I + 3) // 4)[:I]
    su = torch.tensor([0.01, 1.0, 25.0, 300.0]).repeat_interleave((I + 3) // 4)[:I]
    g = torch.randn(M, I, generator=gen, dtype=torch.float64) * sg
    u = torch.randn(M, I, generator=gen, dtype=torch.float64) * su
    g[0, :3], u[1, :3] = torch.tensor([0.0, 200.0, -200.0]), torch.tensor([0.0, 200.0, -200.0])
    return g, u, torch.randn(M, I, generator=gen, dtype=torch.float64)


def situ_run(fused, backend, g, u, do, dtype, device=DEV):
    """act and (dg, du) through situ_glu / situ_glu_fused on leaf copies in dtype."""
    if fused:
        gu = torch.cat([g, u], -1).to(device, dtype).requires_grad_()
        o = situ_glu_fused(gu, backend=backend)
        (d,) = torch.autograd.grad(o, gu, do.to(device, dtype))
        return o, *d.chunk(2, -1)
    gg, uu = g.to(device, dtype).requires_grad_(), u.to(device, dtype).requires_grad_()
    o = situ_glu(gg, uu, backend=backend)
    return o, *torch.autograd.grad(o, (gg, uu), do.to(device, dtype))


def situ_oracle(g, u, do):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    o = situ_glu_reference(g, u)
    return o, *torch.autograd.grad(o, (g, u), do)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("fused", [False, True], ids=["gate,up", "gate_up"])
@pytest.mark.parametrize("M,I", [(37, 45), (5, 300)])
def test_situ_fp32_matches_fp64_reference(backend, fused, M, I):
    """fp32 (Triton through the interpreter on CPU) vs the fp64 formula: out, d gate, d up rel RMS <= 1e-5."""
    g, u, do = situ_inputs(M, I, seed=M * I)
    ref = situ_oracle(g, u, do)
    got = situ_run(fused, backend, g, u, do, torch.float32)
    for name, r, t in zip(("out", "dg", "du"), ref, got):
        assert t.dtype == torch.float32 and torch.isfinite(t).all(), name
        assert rel_rmse(r, t.cpu()) <= 1e-5, (name, rel_rmse(r, t.cpu()))
    assert got[0].abs().max() <= 100.0  # |act| < β₁·β₂


def test_situ_torch_backend_is_exact_in_fp64():
    """The torch Function's hand-written backward equals autograd on the formula (fp64: 1e-12)."""
    g, u, do = situ_inputs(23, 40, seed=3)
    ref = situ_oracle(g, u, do)
    for fused in (False, True):
        got = situ_run(fused, "torch", g, u, do, torch.float64, device="cpu")
        for name, r, t in zip(("out", "dg", "du"), ref, got):
            assert t.dtype == torch.float64 and rel_rmse(r, t) <= 1e-12, (fused, name, rel_rmse(r, t))


def test_situ_triton_strided_3d_and_empty():
    """[B, T, 2I] input with a row stride (a slice of a wider tensor) and empty inputs."""
    g, u, do = situ_inputs(12, 16, seed=5)
    wide = torch.cat([g, u, torch.randn(12, 8, dtype=torch.float64)], -1).float().view(3, 4, 40)
    gu = wide.to(DEV)[..., :32]  # the slice on the device (a copy of the slice would be contiguous)
    assert not gu.is_contiguous()
    out = situ_glu_fused(gu, backend="triton")
    assert out.shape == (3, 4, 16)
    assert rel_rmse(situ_glu_reference(g, u), out.reshape(12, 16).cpu()) <= 1e-5
    e = torch.zeros(0, 6, device=DEV)
    assert situ_glu(e, e, backend="triton").shape == (0, 6)
    assert situ_glu_fused(torch.zeros(0, 6, device=DEV), backend="triton").shape == (0, 3)


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_situ_hardware_tanh_forward(dtype, monkeypatch):
    """The bf16 / fp16 forward through the hardware tanh (`situ_glu_value_approx`) against the fp64 formula on the
    same rounded inputs: every element within one output rounding plus 3 x 2^-10.9 (two tanh.approx, the
    approximate division and exp) relative, where the value is a normal number of the dtype; its rel RMS within
    1.5x that of the exact-in-fp32 kernel (K3_SITU_APPROX=0, taken here) plus 5e-4; the backward unchanged."""
    import k3.ops.situ.triton as ST
    g, u, do = situ_inputs(301, 512, seed=9)
    gd, ud = g.to(dtype), u.to(dtype)
    ref = situ_glu_reference(gd.double(), ud.double())
    assert ST.approx(gd.cuda())
    fast = situ_glu(gd.cuda(), ud.cuda(), backend="triton").cpu().double()
    monkeypatch.setattr(ST, "APPROX", False)
    exact = situ_glu(gd.cuda(), ud.cuda(), backend="triton").cpu().double()
    normal = ref.abs() > torch.finfo(dtype).tiny * 64
    rel = ((fast - ref).abs() / ref.abs())[normal]
    unit = torch.finfo(dtype).eps / 2  # one rounding
    assert rel.max() <= unit + 3 * 2 ** -10.9, rel.max()
    assert rel_rmse(ref, fast) <= 1.5 * rel_rmse(ref, exact) + 5e-4, (rel_rmse(ref, fast), rel_rmse(ref, exact))
    assert (fast[~normal].abs() <= torch.finfo(dtype).tiny * 128).all()


def test_situ_dispatch_errors():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        situ_glu(x, x, backend="fast")
    with pytest.raises(ValueError, match="same shape"):
        situ_glu(x, x[:, :5])
    with pytest.raises(ValueError, match="even last dim"):
        situ_glu_fused(x[:, :5])
    assert situ_glu(x, x, backend="auto").dtype == torch.float32


def test_gate_up_weight_converts_in_one_pass_with_gradients():
    gen = rng(7)
    a = torch.randn(3, 5, 4, generator=gen, requires_grad=True)
    b = torch.randn(3, 5, 4, generator=gen, requires_grad=True)
    w = gate_up_weight(a, b, torch.bfloat16)
    assert w.shape == (3, 10, 4) and w.dtype == torch.bfloat16
    assert torch.equal(w, torch.cat([a, b], 1).bfloat16())
    gw = torch.randn(3, 10, 4, generator=gen)
    (w.float() * gw).sum().backward()
    assert torch.equal(a.grad, gw[:, :5].bfloat16().float()) and torch.equal(b.grad, gw[:, 5:].bfloat16().float())
    assert torch.equal(gate_up_weight(a, b), torch.cat([a, b], 1))


# ---- router -------------------------------------------------------------------------------------------------
def test_router_bf16_split_matches_fp32_gemm():
    """RouterLogitsBf16 (bf16 x, fp32 weight): logits and dweight within fp32 rounding of the fp64 product
    (rel RMS <= 1e-6), dx within bf16 rounding (<= 4e-3). On CPU the GEMMs go through fp32 (same numbers)."""
    gen = rng(11)
    N, D, E = 300, 256, 16
    x = torch.randn(N, D, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(E, D, generator=gen) * D ** -0.5).requires_grad_()
    dz = torch.randn(N, E, generator=gen)
    z = moe_ops.RouterLogitsBf16.apply(x.to(DEV) if CUDA else x, w.to(DEV) if CUDA else w)
    assert z.dtype == torch.float32
    dx, dw = torch.autograd.grad(z, (x, w), dz.to(z.device))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z64 = x64 @ w64.T
    dx64, dw64 = torch.autograd.grad(z64, (x64, w64), dz.double())
    assert rel_rmse(z64, z.cpu()) <= 1e-6
    assert rel_rmse(dw64, dw.cpu()) <= 1e-6
    assert dx.dtype == torch.bfloat16 and rel_rmse(dx64, dx.cpu()) <= 4e-3
    # the plain bf16 GEMM (what autocast would run) is far off: the split is what makes it fp32
    assert rel_rmse(z64, (x.detach() @ w.detach().bfloat16().T).float()) > 1e-4


# ---- token permutation ----------------------------------------------------------------------------------------
def routing(N, K, E, seed, device="cpu"):
    gen = rng(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    idx[: N // 4] = 1  # a hot expert, duplicated within a token; some experts stay empty
    idx[N // 4: N // 2, 0] = E - 1
    return idx.to(device)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sort_by_expert_layout(backend):
    """Both backends (the counting-sort kernel through the CPU interpreter here) give the stable layout."""
    N, K, E = 50, 3, 9
    idx = routing(N, K, E, seed=1)
    pos, ends = moe_ops.sort_by_expert(idx.to(DEV if backend == "triton" else "cpu"), E, backend=backend)
    pos, ends = pos.cpu(), ends.cpu()
    flat = pos.reshape(-1)
    assert torch.equal(flat.sort().values, torch.arange(N * K))  # a permutation
    sorted_e = torch.empty(N * K, dtype=torch.long)
    sorted_e[flat] = idx.reshape(-1)
    assert torch.equal(sorted_e, idx.reshape(-1).sort(stable=True).values)  # grouped by expert
    assert torch.equal(ends, torch.bincount(idx.reshape(-1), minlength=E).cumsum(0))
    for e in range(E):  # stable: token order inside each expert's rows
        entries = (idx.reshape(-1) == e).nonzero().squeeze(1)
        assert torch.equal(flat[entries], flat[entries].sort().values)


@pytest.mark.parametrize("N,K,E", [(1, 4, 32), (256, 4, 32), (37, 8, 384), (2000, 2, 8), (700, 4, 32)])
@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "blocks"])
def test_sort_kernel_equals_the_stable_sort(N, K, E, one_program):
    """Token counts from one decode to a prefill chunk, K3's 384 experts (padded to 512 columns), int32 ends;
    the one-program sort and the two-kernel block sort (prefill and training batches: 11 and 13 blocks at
    (700, 4, 32) and (37, 8, 384); one partial block at (1, 4, 32))."""
    from k3.ops.moe_triton import expert_sort
    idx = routing(N, K, E, seed=N, device=DEV)  # the kernels on the GPU, else through the CPU interpreter
    a = moe_ops.sort_by_expert(idx, E, backend="torch", with_src=True)
    b = expert_sort(idx, E, out_int32=True, one_program=one_program, with_src=True)
    assert torch.equal(a[0], b[0]) and b[1].dtype == torch.int32 and torch.equal(a[1], b[1].long())
    assert torch.equal(a[2], b[2]) and torch.equal(b[2][b[0].reshape(-1)], torch.arange(N * K, device=idx.device))
    if torch.cuda.is_available() and not one_program:  # a training batch's size through the dispatch rule
        idx = routing(32768, 4, 32, seed=5, device="cuda")
        a, b = moe_ops.sort_by_expert(idx, 32, backend="torch"), moe_ops.sort_by_expert(idx, 32)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def perm_run(backend, x, ys, w, pos, dtype, device):
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (x, ys, w)]
    p = pos.to(device)
    xs = moe_ops.dispatch_rows(leaves[0], p, backend=backend)
    out = moe_ops.combine_rows(leaves[1], p, leaves[2], backend=backend)
    gen = rng(3)
    dxs = torch.randn(xs.shape, generator=gen, dtype=torch.float64)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ((xs.double() * dxs.to(device)).sum() + (out.double() * dout.to(device)).sum()).backward()
    return [xs, out] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dispatch_and_combine_match_loops(backend):
    """dispatch_rows / combine_rows and their gradients against per-entry loops in fp64 (torch backend: fp64,
    1e-12; Triton: fp32 through the interpreter on CPU, 1e-6)."""
    N, K, E, L = 40, 4, 6, 70
    idx = routing(N, K, E, seed=2)
    pos, _ = moe_ops.sort_by_expert(idx, E)
    gen = rng(4)
    x = torch.randn(N, L, generator=gen, dtype=torch.float64)
    ys = torch.randn(N * K, L, generator=gen, dtype=torch.float64)
    w = torch.rand(N, K, generator=gen, dtype=torch.float64)
    dtype, tol = (torch.float64, 1e-12) if backend == "torch" else (torch.float32, 1e-6)
    got = perm_run(backend, x, ys, w, pos, dtype, "cpu" if backend == "torch" else DEV)
    ref = perm_run("torch", x, ys, w, pos, torch.float64, "cpu")
    xs_loop = torch.empty(N * K, L, dtype=torch.float64)
    out_loop = torch.zeros(N, L, dtype=torch.float64)
    for n in range(N):
        for k in range(K):
            xs_loop[pos[n, k]] = x[n]
            out_loop[n] += w[n, k] * ys[pos[n, k]]
    assert torch.equal(ref[0], xs_loop) and rel_rmse(out_loop, ref[1]) <= 1e-14
    for name, r, t in zip(("xs", "out", "dx", "dys", "dw"), ref, got):
        assert t.dtype == dtype and rel_rmse(r, t.cpu()) <= tol, (name, rel_rmse(r, t.cpu()))


def test_permutation_backend_errors():
    x = torch.randn(4, 3)
    pos = torch.arange(8).view(4, 2)
    with pytest.raises(ValueError, match="unknown permutation backend 'gpu'"):
        moe_ops.dispatch_rows(x, pos, backend="gpu")
    with pytest.raises(ValueError, match=r"weight \(4, 3\) must match pos \(4, 2\)"):
        moe_ops.combine_rows(torch.randn(8, 3), pos, torch.rand(4, 3))


# ---- SituMLP and LatentMoE against today's code (fp64, CPU) ------------------------------------------------------
def old_situ_mlp(mlp: SituMLP, x):
    """SituMLP.forward before the fused gate/up GEMM."""
    return mlp.down_proj(situ_glu_reference(mlp.gate_proj(x), mlp.up_proj(x), mlp.beta, mlp.linear_beta))


def old_moe_forward(moe: LatentMoE, x):
    """LatentMoE.forward before this change: fp32 router on x.float(), per-expert loop with separate w1 / w3
    GEMMs and the reference SiTU, fp32 (fp64) index_add combine."""
    cfg = moe.cfg
    xf = x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(F.linear(xf.float(), moe.gate.weight.float()))
    idx = torch.topk(scores + moe.gate.e_score_correction_bias.float(), moe.top_k, dim=-1, sorted=True).indices
    w = scores.gather(-1, idx)
    if cfg.moe_renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    lat = moe.routed_expert_down_proj(xf)
    acc = torch.promote_types(lat.dtype, torch.float32)
    y = torch.zeros(lat.shape, dtype=acc, device=x.device)
    ex = moe.experts
    for e in range(ex.w1.shape[0]):
        tok, k = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            xe = lat[tok]
            h = situ_glu_reference(F.linear(xe, ex.w1[e]), F.linear(xe, ex.w3[e]), cfg.activation_situ_beta,
                                   cfg.activation_situ_linear_beta)
            y = y.index_add(0, tok, F.linear(h, ex.w2[e]).to(acc) * w[tok, k].unsqueeze(-1))
    y = y.to(lat.dtype)
    if moe.routed_expert_norm is not None:
        y = moe.routed_expert_norm(y)
    out = moe.routed_expert_up_proj(y)
    if moe.shared_experts is not None:
        out = out + old_situ_mlp(moe.shared_experts, xf)
    return out.reshape(x.shape)


def grads_of(module, fn, x, dout):
    """Output, input gradient and every parameter gradient of fn(module, x) against dout."""
    module.zero_grad(set_to_none=True)
    xl = x.detach().clone().requires_grad_()
    out = fn(module, xl)
    (out.double() * dout).sum().backward()
    return {"out": out.detach(), "dx": xl.grad} | {n: p.grad.clone() for n, p in module.named_parameters()}


def compare_grads(ref, got, tol):
    assert ref.keys() == got.keys()
    errs = {n: rel_rmse(ref[n], got[n]) for n in ref}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"over {tol}: {bad}"


def test_situ_mlp_fused_gemm_matches_old_fp64():
    torch.manual_seed(0)
    mlp = SituMLP(48, 80).double()
    x = torch.randn(3, 7, 48, dtype=torch.float64) * 3
    dout = torch.randn(3, 7, 48, dtype=torch.float64)
    ref = grads_of(mlp, old_situ_mlp, x, dout)
    got = grads_of(mlp, SituMLP.forward, x, dout)
    assert set(got) == {"out", "dx", "gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    compare_grads(ref, got, 1e-12)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "sorted-rows"])
def test_latent_moe_matches_old_fp64(grouped, monkeypatch):
    """The module (loop path, and the sorted-rows pipeline forced: torch permutation ops, per-expert GEMMs in
    fp64) against today's forward: output, dx and every parameter gradient, rel RMS <= 1e-10."""
    model = make_tiny(seed=1).double().train()
    moe: LatentMoE = model.language_model.model.layers[1].block_sparse_moe
    monkeypatch.setattr(model_moe, "experts_forward", functools.partial(moe_ops.experts_forward, grouped=grouped))
    gen = rng(5)
    x = torch.randn(4, 9, moe.cfg.hidden_size, generator=gen, dtype=torch.float64)
    dout = torch.randn(4, 9, moe.cfg.hidden_size, generator=gen, dtype=torch.float64)
    ref = grads_of(moe, old_moe_forward, x, dout)
    got = grads_of(moe, LatentMoE.forward, x, dout)
    assert {"gate.weight", "experts.w1", "experts.w2", "experts.w3", "shared_experts.gate_proj.weight"} <= set(got)
    compare_grads(ref, got, 1e-10)


@pytest.mark.parametrize("rows", [1, 9])
def test_latent_moe_inference_joins_the_input_projections(rows):
    """Inference (no autograd): the latent down projection and the shared experts' gate ‖ up run as one GEMM
    (GEMV for a decode step's row) over joined weights, the residual folded into the shared experts' down
    projection; the same output as the training path (separate projections, the residual added) in fp64, rel
    RMS <= 1e-12; the joined weight follows an in-place update of a part."""
    model = make_tiny(seed=2).double().eval()
    moe: LatentMoE = model.language_model.model.layers[1].block_sparse_moe
    gen = rng(6 + rows)
    x = torch.randn(rows, moe.cfg.hidden_size, generator=gen, dtype=torch.float64)
    res = torch.randn(rows, moe.cfg.hidden_size, generator=gen, dtype=torch.float64)
    for _ in range(2):
        with torch.enable_grad():
            ref = moe(x, res).detach()
        with torch.no_grad():
            got = moe(x, res)
        assert "in_proj" in moe.__dict__["_joined_weights"]
        assert rel_rmse(ref, got) <= 1e-12
        with torch.no_grad():  # a weight update: the cached joined weight is rebuilt
            moe.shared_experts.up_proj.weight.mul_(1.5)
    moe.gate.weight.data = moe.gate.weight.data.float()  # a router of another dtype: nothing joined, the shared
    moe.__dict__["_joined_weights"].clear()              # experts still folded into the up projection's sum
    with torch.enable_grad():
        ref = moe(x, res).detach()
    with torch.no_grad():
        got = moe(x, res)
    assert not moe.__dict__["_joined_weights"] and rel_rmse(ref, got) <= 1e-12


def test_experts_forward_grouped_matches_loop_fp32_cpu():
    """The sorted-rows pipeline in fp32 on CPU (torch._grouped_mm where torch has it on CPU) vs the loop."""
    N, K, E, L, I = 64, 3, 5, 16, 24
    idx = routing(N, K, E, seed=9)
    gen = rng(9)
    x = torch.randn(N, L, generator=gen)
    w = torch.rand(N, K, generator=gen)
    ws = [torch.randn(E, I, L, generator=gen) * L ** -0.5, torch.randn(E, L, I, generator=gen) * I ** -0.5,
          torch.randn(E, I, L, generator=gen) * L ** -0.5]
    a = moe_ops.experts_forward(x, idx, w, *ws, grouped=False)
    try:
        b = moe_ops.experts_forward(x, idx, w, *ws, grouped=True)
    except (RuntimeError, NotImplementedError) as e:  # torch builds without the CPU grouped GEMM
        pytest.skip(f"torch._grouped_mm on CPU: {e}")
    assert rel_rmse(a.double(), b) <= 1e-6


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-gate-up"])
@pytest.mark.parametrize("N,K", [(1, 4), (3, 2), (8, 4)])
def test_experts_decode_matches_the_fp64_loop(N, K, fused):
    """The few-token GEMV kernels (`moe_decode`; fp32, the CPU interpreter here, CUDA on the GPU) against the fp64
    loop: one token as in batch-1 decode, a duplicated expert, odd widths (I = 40, L = 24: masked column and row
    blocks, two column chunks with chunk 16), gate and up as the halves of one fused tensor or separate
    with different row strides."""
    from k3.ops import moe_decode
    E, I, L = 6, 40, 24
    gen = rng(N * 10 + K)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    idx[0, -1] = idx[0, 0]  # a token routed twice to one expert
    x = torch.randn(N, L, generator=gen, dtype=torch.float64)
    w = torch.rand(N, K, generator=gen, dtype=torch.float64)
    w13 = torch.randn(E, 2 * I, L, generator=gen, dtype=torch.float64) * L ** -0.5 * 3
    w2 = torch.randn(E, L, I, generator=gen, dtype=torch.float64) * I ** -0.5
    # separate: w3 a column slice of a wider tensor (row stride L + 5), so w1 and w3 have different strides
    w3_wide = torch.cat([w13[:, I:], torch.zeros(E, I, 5, dtype=torch.float64)], -1)
    w1, w3 = (w13[:, :I], w13[:, I:]) if fused else (w13[:, :I].clone(), w3_wide[..., :L])
    with torch.no_grad():
        ref = moe_ops.experts_forward(x, idx, w, w1, w2, w3, 4.0, 25.0, grouped=False)
        f = lambda t: t.to(DEV, torch.float32)  # noqa: E731
        w1k, w3k = (f(w13)[:, :I], f(w13)[:, I:]) if fused else (f(w1), f(w3_wide)[..., :L])
        assert (w1k.stride() == w3k.stride()) == fused
        old = dict(moe_decode.LAUNCH)
        moe_decode.LAUNCH.update(chunk=16)
        try:
            got = moe_decode.experts_decode(f(x), idx.to(DEV), f(w), w1k, f(w2), w3k, 4.0, 25.0)
        finally:
            moe_decode.LAUNCH.update(old)
        assert moe_decode.fits(f(x), idx, f(w1), f(w2), f(w3))
    assert got.dtype == torch.float32 and got.shape == (N, L)
    assert rel_rmse(ref, got.cpu().double()) <= 1e-6


@pytest.mark.parametrize("N,K,E,bias,renorm", [(1, 4, 32, True, True), (3, 2, 6, False, True),
                                                (8, 4, 20, True, False)])
def test_experts_decode_routed_equals_route_then_the_kernels(N, K, E, bias, renorm, monkeypatch):
    """`experts_decode_routed` (the experts chosen inside the two decode kernels from the router's fp32 logits;
    the CPU interpreter here, CUDA on the GPU) against `route`'s PyTorch ops followed by `experts_decode` with
    their choices: the same experts in the same order, weights and scores within 1e-6, outputs within 1e-6
    (fp32); E not a power of two; with and without the selection bias and the renormalisation."""
    from k3.ops import moe_decode
    monkeypatch.setitem(moe_decode.LAUNCH, "bi", 16)  # fewer programs through the interpreter
    I, L = 40, 24
    gen = rng(N * 100 + E)
    x = torch.randn(N, L, generator=gen).to(DEV)
    z = (torch.randn(N, E, generator=gen) * 2).to(DEV)
    b = (torch.randn(E, generator=gen) * 0.1).to(DEV) if bias else None
    w13 = (torch.randn(E, 2 * I, L, generator=gen) * L ** -0.5 * 3).to(DEV)
    w2 = (torch.randn(E, L, I, generator=gen) * I ** -0.5).to(DEV)
    w1, w3 = w13[:, :I], w13[:, I:]
    with torch.no_grad():
        ref_idx, ref_w, ref_s = moe_ops.route(None, None, b.cpu() if bias else None, K, renorm, 2.5,
                                              logits=z.cpu()) if not CUDA else moe_ops.route(
            None, None, b, K, renorm, 2.5, logits=z)
        ref = moe_decode.experts_decode(x, ref_idx.to(DEV), ref_w.to(DEV), w1, w2, w3, 4.0, 25.0)
        y, idx, w, sc = moe_decode.experts_decode_routed(x, z, b, K, renorm, 2.5, w1, w2, w3, 4.0, 25.0)
    assert torch.equal(idx.cpu(), ref_idx.cpu()) and idx.dtype == torch.long
    assert (w.cpu() - ref_w.cpu()).abs().max() <= 1e-6 and (sc.cpu() - ref_s.cpu()).abs().max() <= 1e-6
    assert rel_rmse(ref.cpu().double(), y.cpu()) <= 1e-6
    with pytest.raises(ValueError, match="logits must be fp32"):
        moe_decode.experts_decode_routed(x, z.double(), b, K, renorm, 2.5, w1, w2, w3, 4.0, 25.0)
    with pytest.raises(ValueError, match="top_k"):
        moe_decode.experts_decode_routed(x, z, b, E + 1, renorm, 2.5, w1, w2, w3, 4.0, 25.0)


@pytest.mark.parametrize("routed", [False, True], ids=["sorted", "routed"])
@pytest.mark.parametrize("N,K,E,bm,fused", [(20, 4, 32, 16, True), (50, 2, 6, 16, False), (40, 3, 5, 32, True)])
def test_expert_tiles_match_the_fp64_loop(N, K, E, bm, fused, routed, monkeypatch):
    """`moe_tiles` (two GEMM kernels over expert tiles, the rows read through the sort's `src`, or found by each
    program from the router's choices with `routed`, in chunks of 16 entries so that ranks carry across chunks;
    the CPU interpreter here, CUDA on the GPU) through `experts_forward` against the fp64 per-expert loop, fp32:
    relative RMS ≤ 1e-6. Experts with no rows, with one partial tile and with several tiles; I and L not multiples
    of the column blocks; w1 / w3 as the halves of one fused tensor (read in place) and as separate tensors."""
    from k3.ops import moe_decode, moe_tiles
    monkeypatch.setattr(moe_decode, "MAX_ENTRIES", 0)  # never the GEMV kernels
    monkeypatch.setattr(moe_tiles, "TILE_ROWS", ((1 << 30, bm),))
    monkeypatch.setattr(moe_tiles, "ROUTED", routed)
    monkeypatch.setattr(moe_tiles, "ROUTED_CHUNK", 16)
    for key, v in (("bn", 32), ("bk", 16)):  # fewer programs through the interpreter
        monkeypatch.setitem(moe_tiles.LAUNCH, key, v)
    I, L = 40, 24
    gen = rng(N + E)
    x = torch.randn(N, L, generator=gen, dtype=torch.float64)
    logits = torch.randn(N, E, generator=gen, dtype=torch.float64)
    logits[:, 0] -= 50  # expert 0 never chosen
    logits[:, 1] += 3 * (torch.arange(N) % 2)  # expert 1 in half the tokens: several tiles of 16
    idx = logits.topk(K, dim=-1).indices
    w = torch.rand(N, K, generator=gen, dtype=torch.float64)
    w13 = torch.randn(E, 2 * I, L, generator=gen, dtype=torch.float64) * L ** -0.5 * 3
    w2 = torch.randn(E, L, I, generator=gen, dtype=torch.float64) * I ** -0.5
    ref = moe_ops.experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:], grouped=False)
    w1, w3 = (w13[:, :I], w13[:, I:]) if fused else (w13[:, :I].contiguous(), w13[:, I:].contiguous())
    args = [t.to(DEV, torch.float32) for t in (x, idx, w, w1, w2, w3)]
    args[1] = idx.to(DEV)
    if fused:
        f = w13.to(DEV, torch.float32)
        args[3], args[5] = f[:, :I], f[:, I:]
    spy = mock.MagicMock(wraps=moe_tiles.experts_tiles)
    monkeypatch.setattr(moe_tiles, "experts_tiles", spy)
    with torch.no_grad():
        out = moe_ops.experts_forward(*args, grouped=True)
    assert spy.call_count == 1 and (spy.call_args.args[2] is None) == routed
    assert rel_rmse(ref, out.cpu().double()) <= 1e-6
    with pytest.raises(ValueError, match="experts_tiles: need"):
        moe_tiles.experts_tiles(args[0], torch.zeros(3, dtype=torch.long), torch.zeros(E, dtype=torch.long), K,
                                *args[3:], 4.0, 25.0)


def test_expert_tile_sizes():
    """Rows per tile by the mean rows per expert: 16 for a prefix hit's tail (256 entries on 32 experts), 32 for a
    decode batch of 256 at top 4 (1,024 entries), 64 above."""
    from k3.ops.moe_tiles import tile_rows
    assert (tile_rows(256, 32), tile_rows(1024, 32), tile_rows(4096, 32), tile_rows(3, 0)) == (16, 32, 64, 16)


def test_engine_with_routing_inside_the_expert_kernels_equals_the_default(monkeypatch):
    """The LatentMoE decode steps with the routing inside the expert kernels (forced; the interpreter here):
    the tiny engine's fp32 greedy tokens equal those of the path with `route`'s own kernel and its logits within
    1e-5; the routing that `record_routing` keeps is the one `route` gives."""
    from conftest import make_tiny
    from k3.ops import moe_decode
    from k3.serve import Engine, EngineConfig, SamplingParams
    model = make_tiny(seed=9).to(DEV)  # the kernels take device tensors (the interpreter only without CUDA)
    prompts = [[(7 * i + 3 * j) % 4000 for j in range(4 + 5 * i)] for i in range(2)]
    sp = SamplingParams(max_tokens=4, temperature=0)
    for key in ("bi", "bl"):  # whole expert rows per program: few programs through the interpreter
        monkeypatch.setitem(moe_decode.LAUNCH, key, 128)
    cfg = EngineConfig(block_size=8, hash_block_size=4, num_pages=64, record_logits=True)
    monkeypatch.setattr(moe_decode, "ROUTED", False)  # the reference: `route`'s kernel, then the expert kernels
    ref_eng = Engine(model, cfg)
    ref = ref_eng.generate(prompts, sp)
    calls = []
    real = moe_decode.experts_decode_routed

    def spy(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr("k3.model.moe.routed_decode_fits",
                        lambda x, k, *w: x.shape[0] * k <= moe_decode.MAX_ENTRIES and not torch.is_grad_enabled())
    monkeypatch.setattr(moe_decode, "experts_decode_routed", spy)
    eng = Engine(model, cfg)
    out = eng.generate(prompts, sp)
    assert calls and [o.token_ids for o in out] == [o.token_ids for o in ref]
    for a, b in zip(ref, out):
        assert (torch.stack(ref_eng.recorded_logits[a.request_id]) -
                torch.stack(eng.recorded_logits[b.request_id])).abs().max() <= 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_experts_decode_equals_the_grouped_path_bf16(monkeypatch):
    """k3-small's expert sizes in bf16: the GEMV kernels that `experts_forward` picks for a decode step (N 1, 8)
    and the expert-tile kernels it picks for a prefix hit's tail or a decode batch (N 64, 256, 700) against the
    sorted-rows pipeline (grouped GEMMs), which rounds its GEMM outputs to bf16 (within 1e-2)."""
    from k3.ops import moe_decode, moe_tiles
    E, I, L, K = 32, 512, 768, 4
    gen = rng(3)
    w13 = (torch.randn(E, 2 * I, L, generator=gen) * L ** -0.5).cuda().bfloat16()
    w2 = (torch.randn(E, L, I, generator=gen) * I ** -0.5).cuda().bfloat16()
    for N in (1, 8, 64, 256, 700):
        idx = routing(N, K, E, seed=N, device="cuda")
        x = torch.randn(N, L, generator=gen).cuda().bfloat16()
        w = torch.rand(N, K, generator=gen).cuda()
        spy = mock.MagicMock(wraps=moe_tiles.experts_tiles)
        with torch.no_grad(), mock.patch.object(moe_tiles, "experts_tiles", spy):
            a = moe_ops.experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:])  # auto: GEMV or tile kernels
            with mock.patch.object(moe_decode, "MAX_ENTRIES", 0), mock.patch.object(moe_tiles, "ON", False):
                b = moe_ops.experts_forward(x, idx, w, w13[:, :I], w2, w13[:, I:])  # the grouped GEMMs
        assert spy.call_count == (N * K > moe_decode.MAX_ENTRIES), N
        assert rel_rmse(b.double(), a.double()) <= 1e-2, N


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_experts_decode_routed_equals_route_then_the_kernels_bf16():
    """k3-small's router and experts in bf16 at 1 and 16 tokens: the routing inside the expert kernels against
    the route kernel + `experts_decode` (the same selection and arithmetic: equal ids, weights and outputs)."""
    from k3.ops import moe_decode
    E, I, L, K = 32, 768, 512, 4
    gen = rng(5)
    w13 = (torch.randn(E, 2 * I, L, generator=gen) * L ** -0.5).cuda().bfloat16()
    w2 = (torch.randn(E, L, I, generator=gen) * I ** -0.5).cuda().bfloat16()
    b = (torch.randn(E, generator=gen) * 0.05).cuda()
    for N in (1, 16):
        x = torch.randn(N, L, generator=gen).cuda().bfloat16()
        z = torch.randn(N, E, generator=gen).cuda()
        with torch.no_grad():
            idx, w, sc = moe_ops.route(None, None, b, K, True, 2.5, logits=z)
            ref = moe_decode.experts_decode(x, idx, w, w13[:, :I], w2, w13[:, I:], 4.0, 25.0)
            y, idx2, w2_, sc2 = moe_decode.experts_decode_routed(x, z, b, K, True, 2.5, w13[:, :I], w2, w13[:, I:],
                                                                 4.0, 25.0)
        assert torch.equal(idx, idx2) and torch.equal(w, w2_) and torch.equal(sc, sc2) and torch.equal(ref, y), N


# ---- CUDA: k3-small sizes, bf16 under autocast, no host sync -------------------------------------------------------
def small_moe(seed=0):
    cfg = K3Config.preset("k3-small").text_config
    torch.manual_seed(seed)
    moe = LatentMoE(cfg).cuda()
    D, L, I = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    with torch.no_grad():
        moe.gate.weight.normal_(0, D ** -0.5)
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
        moe.experts.w1.normal_(0, L ** -0.5)
        moe.experts.w3.normal_(0, L ** -0.5)
        moe.experts.w2.normal_(0, I ** -0.5)
        if moe.routed_expert_norm is not None:
            moe.routed_expert_norm.weight.normal_(1, 0.1)
    return moe


@cuda
@needs_cuda
def test_latent_moe_bf16_k3_small_matches_fp32_loop_without_sync():
    """D 1536, latent 768, I 512, E 32, top-4, N 8192: the module under bf16 autocast (fp32 master weights)
    vs today's forward in fp32 (TF32 off) on the same bf16-rounded input; output and all gradients
    rel RMS <= 2e-2; the fast forward + backward runs with torch.cuda.set_sync_debug_mode("error")."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    moe = small_moe().train()
    cfg = moe.cfg
    assert (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
            cfg.num_experts_per_token) == (1536, 768, 512, 32, 4)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    dout = torch.randn(8192, cfg.hidden_size, device="cuda", generator=g)

    def fast(m, xl):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = LatentMoE.forward(m, xl)
        assert out.dtype == torch.bfloat16
        return out

    grads_of(moe, fast, x, dout)  # warm-up: Triton compilation, cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grads_of(moe, fast, x, dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = grads_of(moe, old_moe_forward, x.float(), dout)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    compare_grads(ref, got, 2e-2)


@cuda
@needs_cuda
def test_situ_triton_bf16_cuda():
    """bf16 in and out (fp32 inside): within bf16 rounding of the fp64 formula."""
    g, u, do = situ_inputs(4096, 512, seed=1)
    ref = situ_oracle(g.bfloat16().double(), u.bfloat16().double(), do.bfloat16().double())
    for fused in (False, True):
        got = situ_run(fused, "triton", g, u, do, torch.bfloat16)
        for name, r, t in zip(("out", "dg", "du"), ref, got):
            assert t.dtype == torch.bfloat16 and rel_rmse(r, t.cpu()) <= 8e-3, (fused, name, rel_rmse(r, t.cpu()))


@cuda
@needs_cuda
def test_router_logits_is_fp32_under_autocast():
    """route() under bf16 autocast: fp32 logits from bf16 x equal the fp32 GEMM of x.float() to fp32 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4096, 1536, device="cuda", generator=gen).bfloat16()
    w = torch.randn(32, 1536, device="cuda", generator=gen) * 1536 ** -0.5
    with torch.autocast("cuda", dtype=torch.bfloat16):
        z = moe_ops.router_logits(x, w)
    assert z.dtype == torch.float32
    ref = x.double() @ w.double().T
    with torch.autocast("cuda", enabled=False):
        plain = torch.nn.functional.linear(x.float(), w)  # what an fp32 router GEMM gives (TF32 off by default)
    # fp32-level agreement: measured 1.5e-6 on the H200 (cuBLAS's split-K fp32 reductions), against the plain fp32
    # GEMM's own error; a bf16 router would be ~2e-3 off
    assert rel_rmse(ref, z) <= max(4e-6, 4 * rel_rmse(ref, plain)), (rel_rmse(ref, z), rel_rmse(ref, plain))


@cuda
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_inference_router_logits_bf16_gemm_is_fp32_exact(rows):
    """Inference with bf16 x and a bf16 router weight: one bf16 GEMM with an fp32 output, which must equal the
    fp32 GEMM of the upcast operands to fp32 rounding (products of bf16 values are exact in fp32)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1536, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(32, 1536, device="cuda", generator=gen) * 1536 ** -0.5).bfloat16()
    with torch.no_grad():
        z = moe_ops.router_logits(x, w)
        plain = torch.nn.functional.linear(x.float(), w.float())
    ref = x.double() @ w.double().T
    assert z.dtype == torch.float32 and z.shape == (rows, 32)
    assert rel_rmse(ref, z) <= max(4e-6, 4 * rel_rmse(ref, plain)), (rel_rmse(ref, z), rel_rmse(ref, plain))


@pytest.mark.parametrize("E,k,renorm,bias", [(32, 4, True, True), (8, 2, False, False), (896, 16, True, True)])
def test_route_kernel_equals_the_reference_route(E, k, renorm, bias):
    """The inference router kernel (Triton; the interpreter on CPU) against `route`'s PyTorch ops: the same
    experts in the same order, weights and scores to fp32 rounding; a NaN row still gives in-range experts."""
    from k3.ops.route_triton import route_topk_triton

    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(E + k)
    N, D = 7, 24
    x = torch.randn(N, D, generator=g).to(dev)
    gw = torch.randn(E, D, generator=g).to(dev)
    b = (torch.randn(E, generator=g) * 0.1).to(dev) if bias else None
    with torch.enable_grad():  # the reference path (with autograd route takes the PyTorch ops)
        ref_idx, ref_w, ref_s = moe_ops.route(x, gw, b, k, renorm, 2.5)
    logits = moe_ops.router_logits(x, gw)
    idx, w, s = route_topk_triton(logits, b, k, renorm, 2.5)
    assert torch.equal(idx, ref_idx)
    assert (w - ref_w.detach()).abs().max() <= 1e-5 and (s - ref_s.detach()).abs().max() <= 1e-6
    logits[3] = float("nan")
    idx, _, _ = route_topk_triton(logits, b, k, renorm, 2.5)
    assert int(idx.min()) >= 0 and int(idx.max()) < E


# ---- experts' gate / up weights laid out as one tensor (inference: one grouped GEMM, no copy) ----------------
def test_fuse_gate_up_keeps_parameters_values_and_names():
    """`fuse_gate_up` re-lays w1, w3 as halves of one storage: same Parameter objects, values and state-dict
    tensors; `gate_up_view` then gives w1 ‖ w3 without a copy (and None for separate tensors); an in-place load
    keeps the layout; the model's output does not change."""
    from k3.ops.situ import gate_up_view
    model = make_tiny(seed=3).eval()
    ids = torch.randint(0, 4000, (1, 24), generator=rng(3))
    with torch.no_grad():
        before = model(ids).logits
    exp = next(m for m in model.modules() if isinstance(m, model_moe.StackedExperts))
    w1, w3 = exp.w1, exp.w3
    assert gate_up_view(w1, w3) is None
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert model_moe.fuse_gate_up(model) == sum(isinstance(m, model_moe.StackedExperts) for m in model.modules())
    assert exp.w1 is w1 and exp.w3 is w3 and w1.untyped_storage().data_ptr() == w3.untyped_storage().data_ptr()
    v = gate_up_view(w1, w3)
    assert v is not None and v.data_ptr() == w1.data_ptr() and torch.equal(v, gate_up_weight(w1, w3))
    assert all(torch.equal(sd[k], t) for k, t in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
        model.load_state_dict({k: t + 1 if k.endswith("w3") else t for k, t in sd.items()})
    assert gate_up_view(w1, w3) is not None and torch.equal(w3, sd[[k for k in sd if k.endswith("w3")][0]] + 1)
    assert gate_up_view(w1.clone(), w3) is None and gate_up_view(w3, w1) is None  # not adjacent / swapped


@pytest.mark.parametrize("grouped_mm", [False, True] if CUDA else [False])
def test_grouped_ffn_on_fused_weights_equals_separate(grouped_mm):
    """Without autograd, the experts on fused w1 ‖ w3 (one GEMM) equal the experts on separate w1, w3: fp64
    on the loop path (1e-12), bf16 grouped GEMMs on CUDA (within one bf16 rounding, 1e-2)."""
    E, I, L, N = 5, 24, 16, 40
    dt = torch.bfloat16 if grouped_mm else torch.float64
    g = rng(11)
    w13 = torch.randn(E, 2 * I, L, generator=g, dtype=torch.float64).to(DEV, dt) * L ** -0.5
    w1f, w3f = w13[:, :I], w13[:, I:]
    w1s, w3s = w1f.clone(), w3f.clone()
    from k3.ops.situ import gate_up_view
    assert gate_up_view(w1f, w3f) is not None and gate_up_view(w1s, w3s) is None  # the two paths differ
    w2 = (torch.randn(E, L, I, generator=g, dtype=torch.float64) * I ** -0.5).to(DEV, dt)
    x = torch.randn(N, L, generator=g, dtype=torch.float64).to(DEV, dt)
    ends = torch.tensor([7, 7, 20, 31, N], device=DEV)  # one empty group
    with torch.no_grad():
        fused = moe_ops.grouped_situ_ffn(x, ends, w1f, w2, w3f, use_grouped_mm=grouped_mm)
        sep = moe_ops.grouped_situ_ffn(x, ends, w1s, w2, w3s, use_grouped_mm=grouped_mm)
    assert rel_rmse(sep.double(), fused.double()) <= (1e-2 if grouped_mm else 1e-12)
