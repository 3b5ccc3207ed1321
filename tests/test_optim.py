"""Per-Head Muon + AdamW, cosine schedule, QK-clip: against hand-written fp64 oracles."""

import copy
import math

import pytest
import torch
from torch import nn

from conftest import make_tiny, rel_rmse
from k3.config import K3Config
from k3.model.mla import MLAttention, causal_mask
from k3.train.optim import (NS_QUINTIC, CosineWarmup, MuonAdamW, OptimConfig, build_optimizer, build_scheduler,
                            classify_parameters, grad_clip_scale, muon_blocks, newton_schulz,
                            newton_schulz_flops)
from k3.train.qkclip import QKClip, clip_heads

CUBIC = (1.5, -0.5, 0.0)  # classic Newton–Schulz: converges to the exact polar factor U Vᵀ


def polar(m: torch.Tensor) -> torch.Tensor:
    """Exact orthogonal polar factor U Vᵀ by SVD (fp64)."""
    u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
    return u @ vh


def ns_ref(m: torch.Tensor, steps: int, coeffs=NS_QUINTIC) -> torch.Tensor:
    """Independent fp64 Newton–Schulz on one matrix (wide orientation)."""
    a, b, c = coeffs
    x = m.double()
    t = x.shape[0] > x.shape[1]
    if t:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + b * s @ x + c * s @ s @ x
    return x.T if t else x


def one_param_opt(p, head_rows=0, kind="muon", **cfg):
    c = OptimConfig(**cfg)
    return MuonAdamW([dict(params=[p], kind=kind, head_rows=head_rows)], c)


# ---- Newton–Schulz and per-head blocks ------------------------------------------------------------------

def test_newton_schulz_flops_equal_what_the_iterations_multiply():
    """`newton_schulz_flops` against torch's FLOP counter over `newton_schulz` on every Muon block of k3-tiny
    (per-head blocks, wide and tall matrices, stacked experts)."""
    from torch.utils.flop_counter import FlopCounterMode
    model = make_tiny()
    params = dict(model.named_parameters())
    counted = 0
    for name, (kind, head_rows) in classify_parameters(model).items():
        if kind != "muon":
            continue
        g = torch.randn(muon_blocks(params[name].shape, head_rows))
        with FlopCounterMode(display=False) as fc:
            newton_schulz(g, OptimConfig().ns_steps)
        counted += fc.get_total_flops()
    assert counted > 0 and newton_schulz_flops(model) == counted


def test_newton_schulz_matches_reference_and_polar():
    g = torch.Generator().manual_seed(0)
    for shape in [(16, 48), (48, 16), (32, 32)]:
        m = torch.randn(shape, generator=g)
        assert rel_rmse(ns_ref(m, 5), newton_schulz(m, 5)) < 1e-5
    m = torch.randn(3, 12, 40, generator=g)  # batched, well-conditioned (rectangular) blocks
    x = newton_schulz(m, 40, CUBIC, dtype=torch.float64)
    for i in range(3):
        assert rel_rmse(polar(m[i]), x[i]) < 1e-6
    m = torch.randn(4, 32, 96, generator=g)  # the bf16 path used on CUDA: close to the fp32 result
    assert rel_rmse(newton_schulz(m, 5), newton_schulz(m, 5, dtype=torch.bfloat16)) < 6e-2  # measured 3.6e-2
    # the default quintic iteration leaves singular values in a band around 1 (not exactly 1)
    sv = torch.linalg.svdvals(newton_schulz(torch.randn(8, 24, 96, generator=g), 5).double())
    assert sv.min() > 0.6 and sv.max() < 1.25, (sv.min(), sv.max())


def test_per_head_update_is_orthogonal_per_block_and_rms_scaled():
    H, r, cols = 4, 24, 64
    p = nn.Parameter(torch.randn(H * r, cols))
    grad = torch.randn(H * r, cols)
    grad[r:2 * r] *= 1000.0  # one head with a huge gradient must not shrink the others' update
    p.grad = grad.clone()
    before = p.detach().clone()
    opt = one_param_opt(p, head_rows=r, lr=0.5, momentum=0.0, weight_decay=0.0, ns_coefficients=CUBIC,
                        ns_steps=40, ns_dtype="float64")
    opt.step()
    upd = ((before - p.detach()) / 0.5).view(H, r, cols).double()
    scale = 0.2 * math.sqrt(max(r, cols))
    for h in range(H):
        o = upd[h] / scale
        assert (o @ o.T - torch.eye(r, dtype=torch.float64)).abs().max() < 1e-6  # orthogonal rows per head
        assert rel_rmse(polar(grad[h * r:(h + 1) * r]), o) < 1e-6
        assert abs(upd[h].pow(2).mean().sqrt().item() - 0.2) < 1e-6  # update RMS 0.2 (= AdamW's typical)
    # whole-matrix Muon on the same gradient is different (the big head dominates)
    whole = polar(grad) * 0.2 * math.sqrt(max(H * r, cols))
    assert rel_rmse(whole, upd.reshape(H * r, cols)) > 0.1


@pytest.mark.parametrize("shape", [(40, 16), (16, 40), (3, 20, 12)])
def test_update_rms_matches_02_sqrt_max_dims(shape):
    p = nn.Parameter(torch.randn(shape))
    p.grad = torch.randn(shape)
    before = p.detach().clone()
    one_param_opt(p, lr=1.0, momentum=0.0, weight_decay=0.0, ns_coefficients=CUBIC, ns_steps=40,
                  ns_dtype="float64").step()
    upd = (before - p.detach()).double()
    A, B = shape[-2:]
    mats = upd.reshape(-1, A, B)
    for i in range(mats.shape[0]):  # stacked experts: each its own matrix
        exp = polar(p.grad.reshape(-1, A, B)[i]) * 0.2 * math.sqrt(max(A, B))
        assert rel_rmse(exp, mats[i]) < 1e-6
    assert abs(upd.pow(2).mean().sqrt().item() - 0.2) < 1e-6


# ---- a toy problem by hand ---------------------------------------------------------------------------

def test_two_steps_on_toy_problem_match_hand_computation():
    """loss = ‖W x + b − y‖² with W per-head Muon (2 heads × 3 rows), b AdamW; two steps by hand in fp64."""
    g = torch.Generator().manual_seed(3)
    W0, b0 = torch.randn(6, 5, generator=g), torch.randn(6, generator=g)
    xs = [torch.randn(5, generator=g) for _ in range(2)]
    ys = [torch.randn(6, generator=g) for _ in range(2)]
    W, b = nn.Parameter(W0.clone()), nn.Parameter(b0.clone())
    lr, wd, mu, (b1, b2), eps = 0.05, 0.1, 0.9, (0.8, 0.9), 1e-8
    cfg = OptimConfig(lr=lr, weight_decay=wd, momentum=mu, adam_betas=(b1, b2), adam_eps=eps)
    opt = MuonAdamW([dict(params=[W], kind="muon", head_rows=3),
                     dict(params=[b], kind="adamw", weight_decay=0.0)], cfg)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        ((W @ x + b - y) ** 2).sum().backward()
        opt.step()

    Wr, br = W0.double(), b0.double()
    buf, m, v = torch.zeros(6, 5, dtype=torch.float64), torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    for t, (x, y) in enumerate(zip(xs, ys), start=1):
        x, y = x.double(), y.double()
        r = Wr @ x + br - y
        gW, gb = 2 * torch.outer(r, x), 2 * r
        buf = mu * buf + gW
        u = gW + mu * buf  # Nesterov
        o = torch.cat([ns_ref(u[0:3], 5), ns_ref(u[3:6], 5)])  # per head: two [3, 5] blocks
        Wr = Wr * (1 - lr * wd) - lr * 0.2 * math.sqrt(5) * o
        m = b1 * m + (1 - b1) * gb
        v = b2 * v + (1 - b2) * gb * gb
        br = br - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    assert rel_rmse(Wr, W.detach()) < 1e-5
    assert rel_rmse(br, b.detach()) < 1e-6


def test_weight_decay_is_decoupled():
    g = torch.Generator().manual_seed(4)
    p0, grad = torch.randn(8, 12, generator=g), torch.randn(8, 12, generator=g)
    res = {}
    for kind in ("muon", "adamw"):
        for wd in (0.0, 0.3):
            p = nn.Parameter(p0.clone())
            p.grad = grad.clone()
            one_param_opt(p, kind=kind, lr=0.1, weight_decay=wd).step()
            res[kind, wd] = p.detach().double()
        # p_wd = p0·(1 − lr·wd) − lr·update: differs from the wd=0 result by exactly −lr·wd·p0
        assert rel_rmse(-0.1 * 0.3 * p0.double(), res[kind, 0.3] - res[kind, 0.0]) < 1e-5
    q = nn.Parameter(p0.clone())  # no gradient: untouched (no decay either)
    one_param_opt(q, lr=0.1, weight_decay=0.3).step()
    assert torch.equal(q.detach(), p0)


# ---- grouping -----------------------------------------------------------------------------------------

def test_every_parameter_of_k3_tiny_in_exactly_one_group():
    model = make_tiny(vision=True)
    opt = build_optimizer(model, OptimConfig())
    ids = [id(p) for grp in opt.param_groups for p in grp["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    kinds = classify_parameters(model)
    names = dict(model.named_parameters())
    assert set(kinds) == set(names)
    for n, (kind, rows) in kinds.items():
        leaf = n.rsplit(".", 1)[-1]
        if "embed_tokens" in n or "lm_head" in n or "pos_emb" in n or "conv1d" in n or "patch_embed.proj" in n:
            assert kind == "adamw", n
        elif "norm" in n or leaf in ("A_log", "dt_bias", "bias") or "_res_proj" in n:
            assert kind == "adamw_nodecay", n
        else:
            assert kind == "muon", n
        tc = model.config.text_config
        if n.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            assert rows == tc.linear_attn_config.head_dim, n
        elif n.endswith("q_b_proj.weight"):
            assert rows == tc.qk_nope_head_dim + tc.qk_rope_head_dim, n
        elif n.endswith("kv_b_proj.weight"):
            assert rows == tc.qk_nope_head_dim + tc.v_head_dim, n
        else:
            assert rows == 0, n
    assert not any("e_score_correction_bias" in n for n in kinds)  # a buffer: updated by QB, not the optimizer
    decay = {grp["kind"] + str(grp["weight_decay"]) for grp in opt.param_groups}
    assert decay == {"muon0.1", "adamw0.1", "adamw0.0"}


def test_state_dict_resume_is_bitwise():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    data = [(torch.randn(5, 6), torch.randn(5, 3)) for _ in range(6)]

    def run(model, opt, sched, batches):
        for x, y in batches:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            sched.step()

    cfg = OptimConfig(lr=0.02)
    a = copy.deepcopy(net)
    oa = build_optimizer(a, cfg)
    sa = build_scheduler(oa, 10, warmup_frac=0.2)
    run(a, oa, sa, data)
    b = copy.deepcopy(net)
    ob = build_optimizer(b, cfg)
    sb = build_scheduler(ob, 10, warmup_frac=0.2)
    run(b, ob, sb, data[:3])
    saved = copy.deepcopy((b.state_dict(), ob.state_dict(), sb.state_dict()))
    c = copy.deepcopy(net)
    oc = build_optimizer(c, cfg)
    sc = build_scheduler(oc, 10, warmup_frac=0.2)
    c.load_state_dict(saved[0])
    oc.load_state_dict(saved[1])
    sc.load_state_dict(saved[2])
    run(c, oc, sc, data[3:])
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(pa, pc)


def test_cosine_schedule_values():
    f = CosineWarmup(total_steps=200, warmup_frac=0.01, min_lr_ratio=0.1)
    assert f.warmup_steps == 2
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0) and f(2) == pytest.approx(1.0)
    assert f(2 + 99) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 99 / 198)))
    assert f(200) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    vals = [f(s) for s in range(2, 201)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    p = nn.Parameter(torch.randn(4, 4))
    opt = one_param_opt(p, lr=0.3)
    sched = build_scheduler(opt, 200)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: a no-op, keeps the optimizer-before-scheduler order
        sched.step()
    assert lrs == pytest.approx([0.3 * f(s) for s in range(4)])
    for bad in (dict(total_steps=0), dict(total_steps=10, warmup_frac=1.0), dict(total_steps=10, min_lr_ratio=2.0)):
        with pytest.raises(ValueError):
            CosineWarmup(**bad)


def test_bad_config_values_raise():
    p = nn.Parameter(torch.randn(10, 4))
    with pytest.raises(ValueError, match="head_rows"):
        one_param_opt(p, head_rows=3)
    with pytest.raises(ValueError, match="momentum"):
        one_param_opt(p, momentum=1.0)
    with pytest.raises(ValueError, match="kind"):
        MuonAdamW([dict(params=[p], kind="sgd")], OptimConfig())


# ---- QK-clip ------------------------------------------------------------------------------------------

def all_logits(attn: MLAttention, x: torch.Tensor) -> torch.Tensor:
    """Oracle: fp64 scaled logits [B, H, T, S] with expanded per-head keys [k_nope(head) | k_pe(shared)],
    masked positions −inf."""
    B, T, _ = x.shape
    with torch.no_grad():
        q = attn.project_q(x).double()
        c, k_pe = attn.project_latent(x)
        k_nope = attn.kv_b_proj(c).view(B, T, attn.num_heads, -1)[..., :attn.nope].double()
    k = torch.cat([k_nope, k_pe.double().unsqueeze(2).expand(-1, -1, attn.num_heads, -1)], dim=-1)
    s = torch.einsum("bthd,bshd->bhts", q, k) * attn.scale
    return s.masked_fill(~causal_mask(B, T, 0, None, x.device), float("-inf"))


def make_mla(seed=0):
    tc = K3Config.preset("k3-tiny").text_config
    torch.manual_seed(seed)
    attn = MLAttention(tc, 3)
    for p in attn.parameters():
        nn.init.normal_(p, std=0.3) if p.ndim == 2 else nn.init.normal_(p, mean=1.0, std=0.1)
    return attn.train()


def test_qkclip_brings_planted_logit_under_tau_and_touches_only_head_parts():
    attn = make_mla()
    H, nope, rope = attn.num_heads, attn.nope, attn.rope
    with torch.no_grad():  # plant: head 1's queries (nope and rope) ×6, head 3's k_nope ×5
        attn.q_b_proj.weight.view(H, nope + rope, -1)[1] *= 6.0
        attn.kv_b_proj.weight.view(H, -1, attn.kv_lora_rank)[3, :nope] *= 5.0
    clip = QKClip(attn, tau=8.0)
    xs = [torch.randn(2, 12, attn.o_proj.out_features) for _ in range(2)]
    with torch.no_grad():
        for x in xs:  # two micro-batches: the running max covers both
            attn(x)
    ref = torch.stack([all_logits(attn, x).amax(dim=(0, 2, 3)) for x in xs]).amax(0)
    assert rel_rmse(ref, clip.running[""]) < 1e-5  # the model's recorded max vs the expanded-key oracle
    assert ref[1] > 8.0 and ref[3] > 8.0, ref
    before = {n: p.detach().clone() for n, p in attn.named_parameters()}
    logits_before = [all_logits(attn, x) for x in xs]
    stats = clip.step()
    assert stats["clipped_heads"] == int((ref > 8.0).sum()) and stats["max_logit"] == pytest.approx(ref.max().item(), rel=1e-5)
    after = torch.stack([all_logits(attn, x).amax(dim=(0, 2, 3)) for x in xs]).amax(0)
    over = ref > 8.0
    assert torch.allclose(after[over], torch.full_like(after[over], 8.0), rtol=1e-5)  # max falls to τ
    assert torch.equal(after[~over], ref[~over].double()) or rel_rmse(ref[~over], after[~over]) < 1e-6
    gamma = torch.where(over, 8.0 / ref, torch.ones_like(ref)).double()
    for x, lb in zip(xs, logits_before):  # every logit of a clipped head is scaled by exactly γ_h
        la = all_logits(attn, x)
        fin = torch.isfinite(lb)
        assert rel_rmse((lb * gamma.view(1, -1, 1, 1))[fin], la[fin]) < 1e-5
    # untouched: shared k_pe slice (kv_a_proj_with_mqa), values, unclipped heads, everything else
    assert torch.equal(attn.kv_a_proj_with_mqa.weight, before["kv_a_proj_with_mqa.weight"])
    wkv, wkv0 = attn.kv_b_proj.weight.view(H, nope + attn.vdim, -1), before["kv_b_proj.weight"].view(H, nope + attn.vdim, -1)
    assert torch.equal(wkv[:, nope:], wkv0[:, nope:])
    wq, wq0 = attn.q_b_proj.weight.view(H, nope + rope, -1), before["q_b_proj.weight"].view(H, nope + rope, -1)
    assert torch.equal(wq[~over], wq0[~over]) and torch.equal(wkv[~over], wkv0[~over])
    for n in before:
        if n not in ("q_b_proj.weight", "kv_b_proj.weight"):
            assert torch.equal(before[n], dict(attn.named_parameters())[n]), n
    assert clip.running == {}  # reset for the next step


def test_qkclip_ignores_eval_and_k3_tiny_layers_found():
    attn = make_mla(1)
    clip = QKClip(attn, tau=1e-3)
    attn.eval()
    with torch.no_grad():
        attn(torch.randn(1, 6, attn.o_proj.out_features))
    assert clip.running == {} and clip.step() == {"max_logit": None, "clipped_heads": 0}
    model = make_tiny()
    clip = QKClip(model, tau=100.0)
    n_mla = sum(isinstance(m, MLAttention) for m in model.modules())
    assert len(clip.layers) == n_mla >= 2
    clip.remove()
    assert not any(m.record_max_logit for m in clip.layers.values())


def test_clip_heads_rejects_bad_gamma():
    with pytest.raises(ValueError, match="gamma"):
        clip_heads(make_mla(), torch.ones(3))


# ---- implementations: "foreach" and "fused" against the per-parameter "loop" reference -----------------------
# Same state, same arithmetic: after a few steps parameters and state agree to fp32 rounding (relative RMS error
# <= 1e-6 in fp32, <= 1e-12 in fp64; the Muon difference is Newton–Schulz's fused baddbmm products, measured
# ~1e-6 on an NS output, far less on the parameters). On CPU "foreach" runs the loop's per-tensor ops, so AdamW
# parameters come out bitwise equal. "fused" runs the Triton kernels (the interpreter on CPU, fp32).

CUDA = torch.cuda.is_available()


@pytest.fixture
def exact_fp32_matmul():
    """fp32 products in fp32, not TF32, on CUDA: the fp32 comparisons below need it."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _max_err(a: dict, b: dict) -> float:
    return max(rel_rmse(a[k], b[k]) for k in a)


def _run_impl(model, impl, steps=2, seed=1, grads_skip=(), **cfg):
    """Train a copy of `model` for `steps` steps of fresh random gradients; returns (params, flattened state)."""
    m = copy.deepcopy(model)
    dtype = next(m.parameters()).dtype
    opt = build_optimizer(m, OptimConfig(impl=impl, **cfg))
    g = torch.Generator().manual_seed(seed)
    names = dict(m.named_parameters())
    for s in range(steps):
        for n, p in names.items():
            grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
            p.grad = None if (s, n) in grads_skip else grad.to(p.device)
        opt.step()
    state = {}
    for n, p in names.items():
        for k, v in opt.state[p].items():
            state[f"{n}.{k}"] = v
    return {n: p.detach() for n, p in names.items()}, state, opt


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype, nesterov", [(torch.float64, True), (torch.float32, True), (torch.float32, False)])
def test_foreach_matches_loop_on_k3_tiny(dtype, nesterov):
    """Every parameter group of k3-tiny (per-head KDA / MLA blocks, matrices, stacked experts, AdamW with and
    without decay), a Muon and an AdamW parameter without gradient in the first step."""
    model = make_tiny().train().to(dtype)
    ns = "float64" if dtype == torch.float64 else "float32"
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    skip = {(0, "language_model.model.norm.weight"), (0, "language_model.model.layers.0.self_attn.q_proj.weight")}
    p_ref, s_ref, _ = _run_impl(model, "loop", grads_skip=skip, nesterov=nesterov, ns_dtype=ns)
    p_new, s_new, _ = _run_impl(model, "foreach", grads_skip=skip, nesterov=nesterov, ns_dtype=ns)
    assert s_ref.keys() == s_new.keys()
    assert _max_err(p_ref, p_new) <= tol and _max_err(s_ref, s_new) <= tol
    for k in s_ref:  # per-parameter step counts (one parameter skipped a step) and AdamW: bitwise
        if k.endswith(".step"):
            assert torch.equal(s_ref[k], s_new[k]), k
    adam = {n for n, (kind, _) in classify_parameters(model).items() if kind != "muon"}
    for n in adam:
        assert torch.equal(p_ref[n], p_new[n]), n
    assert s_ref["language_model.model.norm.weight.step"].item() == 1.0  # 2 steps, skipped once


def toy_model(dtype=torch.float32) -> nn.Module:
    """Every kind of parameter the optimizer sees, small, some with unaligned sizes (odd numel)."""
    torch.manual_seed(0)
    m = nn.Module()
    m.q = nn.Parameter(torch.randn(4 * 8, 20))  # per-head (head_rows = 8): 4 blocks [8, 20]
    m.wide = nn.Parameter(torch.randn(12, 40))
    m.tall = nn.Parameter(torch.randn(40, 12))
    m.odd = nn.Parameter(torch.randn(9, 7))  # 63 elements: unaligned chunk
    m.experts = nn.Parameter(torch.randn(3, 16, 10))  # stacked [E, out, in]: tall blocks
    m.unused = nn.Parameter(torch.randn(8, 8))  # never has a gradient
    m.emb = nn.Parameter(torch.randn(50, 16))
    m.vec = nn.Parameter(torch.randn(13))
    m.query = nn.Parameter(torch.randn(1, 24))
    return m.to(dtype)


def toy_groups(m: nn.Module) -> list[dict]:
    return [dict(params=[m.q], kind="muon", head_rows=8),
            dict(params=[m.wide, m.tall, m.odd, m.experts, m.unused], kind="muon", head_rows=0),
            dict(params=[m.emb], kind="adamw"),
            dict(params=[m.vec, m.query], kind="adamw", weight_decay=0.0)]


def run_toy(impl, steps=3, nesterov=True, ns_dtype="float32", device="cpu", dtype=torch.float32, start=None,
            clip=None, max_norm=4.0):
    """clip: None, "torch" (clip_grad_norm_ before each step) or "scale" (step(grad_scale=) with the coefficient
    of grad_clip_scale)."""
    m = toy_model(dtype).to(device)
    opt = MuonAdamW(toy_groups(m), OptimConfig(impl=impl, nesterov=nesterov, ns_dtype=ns_dtype, lr=0.02))
    if start is not None:
        opt.load_state_dict(start)
    g = torch.Generator().manual_seed(2)
    for s in range(steps):
        for n, p in m.named_parameters():
            grad = torch.randn(p.shape, generator=g).to(device, dtype)
            p.grad = None if n == "unused" or (n == "vec" and s == 0) else grad  # vec: a step behind
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            opt.step()
        elif clip == "scale":
            _, c = grad_clip_scale(m.parameters(), max_norm)
            opt.step(grad_scale=c)
        else:
            opt.step()
    state = {f"{n}.{k}": v for n, p in m.named_parameters() for k, v in opt.state[p].items()}
    return {n: p.detach().clone() for n, p in m.named_parameters()}, state, opt


@pytest.mark.usefixtures("exact_fp32_matmul")
@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_impls_match_loop_on_every_parameter_kind(impl, nesterov):
    """Per-head / wide / tall / stacked Muon blocks, unaligned sizes, a parameter without gradient (untouched),
    AdamW with and without decay and with step counts that differ between parameters."""
    dev = "cuda" if CUDA else "cpu"
    p_ref, s_ref, _ = run_toy("loop", nesterov=nesterov, device=dev)
    p_new, s_new, _ = run_toy(impl, nesterov=nesterov, device=dev)
    assert s_ref.keys() == s_new.keys() and "unused.momentum_buffer" not in s_new
    assert torch.equal(p_new["unused"], toy_model()._parameters["unused"].to(dev))
    assert s_new["vec.step"].item() == 2.0 and s_new["emb.step"].item() == 3.0
    assert s_new["vec.step"].device.type == "cpu" and s_new["vec.step"].dtype == torch.float32  # checkpoint format
    assert _max_err(p_ref, p_new) <= 1e-6, {n: rel_rmse(p_ref[n], p_new[n]) for n in p_ref}
    assert _max_err(s_ref, s_new) <= 1e-6, {n: rel_rmse(s_ref[n], s_new[n]) for n in s_ref}


@pytest.mark.usefixtures("exact_fp32_matmul")
@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
def test_grad_scale_equals_clipping_the_gradients_first(impl):
    """step(grad_scale=c) with (norm, c) from grad_clip_scale gives the parameters and state of clip_grad_norm_
    followed by step(), for every impl: bitwise, except the fused kernels compiled for CUDA (1e-6: FMA
    contraction of g·c with the next operation). The gradients' norm is ~9 and max_norm 4, so c < 1 applies;
    grad_clip_scale's norm and coefficient are clip_grad_norm_'s."""
    dev = "cuda" if CUDA else "cpu"
    p_ref, s_ref, _ = run_toy(impl, device=dev, clip="torch")
    p_new, s_new, _ = run_toy(impl, device=dev, clip="scale")
    p_off, _, _ = run_toy(impl, device=dev)
    assert max(rel_rmse(p_ref[n], p_off[n]) for n in p_ref) > 1e-5  # the clip changes the result (2e-4: Muon and
    # Adam are nearly scale-invariant; the momentum mixes steps of different scales)
    if impl == "fused" and dev == "cuda":  # compiled kernels may contract g·c into an FMA with the next op
        assert _max_err(p_ref, p_new) <= 1e-6 and _max_err(s_ref, s_new) <= 1e-6
    else:
        for n in p_ref:
            assert torch.equal(p_ref[n], p_new[n]), n
        for k in s_ref:
            assert torch.equal(s_ref[k], s_new[k]), k
    m = toy_model().to(dev)
    g = torch.Generator().manual_seed(3)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(dev)
    norm, c = grad_clip_scale(m.parameters(), 4.0)
    before = [p.grad.clone() for p in m.parameters()]
    ref = torch.nn.utils.clip_grad_norm_(m.parameters(), 4.0)
    assert torch.equal(norm, ref) and norm > 4.0
    for b, p in zip(before, m.parameters()):
        assert torch.equal(b * c, p.grad)
    with pytest.raises(ValueError, match="grad_scale"):
        MuonAdamW(toy_groups(m), OptimConfig()).step(grad_scale=torch.ones(2))


@pytest.mark.usefixtures("exact_fp32_matmul")
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_state_dict_moves_between_impls(impl):
    """A checkpoint written by the loop resumes under another implementation (and back): same state format."""
    dev = "cuda" if CUDA else "cpu"
    _, _, o_loop = run_toy("loop", steps=2, device=dev)
    saved = copy.deepcopy(o_loop.state_dict())
    p_ref, s_ref, _ = run_toy("loop", steps=2, device=dev, start=copy.deepcopy(saved))
    p_new, s_new, o_new = run_toy(impl, steps=2, device=dev, start=copy.deepcopy(saved))
    assert _max_err(p_ref, p_new) <= 1e-6 and _max_err(s_ref, s_new) <= 1e-6
    p_back, _, _ = run_toy("loop", steps=1, device=dev, start=copy.deepcopy(o_new.state_dict()))
    assert all(torch.isfinite(v).all() for v in p_back.values())


def test_newton_schulz_fused_products_match_plain_iteration():
    """The baddbmm form (tall matrices iterated as transposed views, the last product written back tall)
    against the plain one, wide / tall / square, 2-D to 4-D, every output dtype."""
    from k3.train.optim import _newton_schulz_reference
    g = torch.Generator().manual_seed(5)
    for shape in [(16, 48), (48, 16), (32, 32), (3, 20, 12), (2, 3, 12, 40)]:
        m = torch.randn(shape, generator=g)
        assert rel_rmse(_newton_schulz_reference(m.double(), 5, dtype=torch.float64),
                        newton_schulz(m.double(), 5, dtype=torch.float64)) < 1e-12
        x = newton_schulz(m, 5)
        assert x.shape == m.shape and x.dtype == m.dtype and x.is_contiguous()
        assert rel_rmse(_newton_schulz_reference(m, 5), x) < 1e-5  # measured <= 1.2e-6
        assert rel_rmse(_newton_schulz_reference(m.double(), 5, dtype=torch.float64),
                        newton_schulz(m, 5, dtype=torch.bfloat16)) < 6e-2  # bf16 Newton–Schulz noise (3.6e-2)
        assert newton_schulz(m, 5, dtype=torch.bfloat16, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    m = torch.randn(2, 30, 10, generator=g, dtype=torch.float64)
    assert rel_rmse(torch.stack([polar(m[0]), polar(m[1])]), newton_schulz(m, 40, CUBIC, dtype=torch.float64)) < 1e-6


def test_bad_impl_raises():
    with pytest.raises(ValueError, match="impl='sgd'"):
        OptimConfig(impl="sgd").validate()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.usefixtures("exact_fp32_matmul")
def test_fused_step_on_k3_tiny_cuda_matches_loop_without_host_sync():
    """k3-tiny on the GPU: the fused step (bf16 Newton–Schulz, the default) against the loop with the same
    Newton–Schulz dtype, and no host sync anywhere in the fused step (sync debug mode "error")."""
    model = make_tiny().train().cuda()
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    p_ref, s_ref, _ = _run_impl(model, "loop", ns_dtype="float32")
    p_new, s_new, _ = _run_impl(model, "fused", ns_dtype="float32")
    assert _max_err(p_ref, p_new) <= 1e-6 and _max_err(s_ref, s_new) <= 1e-6
    p_ref, _, _ = _run_impl(model, "loop")  # default: bf16 Newton–Schulz, two different bf16 roundings of it
    p_new, _, opt = _run_impl(model, "fused")
    for n in p0:  # the updates agree to bf16 Newton–Schulz noise (as bf16 vs fp32 above: <= 6e-2)
        assert rel_rmse(p_ref[n] - p0[n], p_new[n] - p0[n]) < 6e-2, n
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- QK-clip and balancing: the device-side steps against their first-written (host-read) references ----------

def _planted_clip(model, tau, seed):
    """QKClip on `model` with planted per-head maxima (about half the heads above τ, one layer left out)."""
    clip = QKClip(model, tau=tau)
    g = torch.Generator().manual_seed(seed)
    names = list(clip.layers)
    clip.running = {n: tau * (0.5 + torch.rand(clip.layers[n].num_heads, generator=g)) for n in names[1:]}
    return clip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkclip_step_matches_reference_bitwise(dtype):
    model = make_tiny(seed=4).train().to(dtype)
    twin = copy.deepcopy(model)
    new, ref = _planted_clip(model, 5.0, 0), _planted_clip(twin, 5.0, 0)
    assert len(new.layers) >= 2
    want = ref._step_reference()
    got = new.step()
    assert got == want and 0 < got["clipped_heads"] < sum(a.num_heads for a in new.layers.values())
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n  # clipped heads, untouched rows, and the layer with no maxima
    assert new.running == {}
    new = _planted_clip(model, 5.0, 1)  # sync=False: the same numbers as 0-dim tensors
    ref = _planted_clip(twin, 5.0, 1)
    lazy, want = new.step(sync=False), ref._step_reference()
    assert isinstance(lazy["max_logit"], torch.Tensor) and lazy["max_logit"].item() == want["max_logit"]
    assert lazy["clipped_heads"].item() == want["clipped_heads"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert QKClip(model, tau=5.0).step() == {"max_logit": None, "clipped_heads": 0}


def _fed_controllers(method, exact=False, ema=0.0, seed=0, scale=1.0):
    """Two BalanceControllers on twin k3-tiny models fed the same routing of two micro-batches."""
    from k3.train.balance import BalanceController
    model = make_tiny(seed=seed).train()
    twin = copy.deepcopy(model)
    a = BalanceController(model, method=method, exact=exact, ema=ema, gamma=0.01, bins=64)
    b = BalanceController(twin, method=method, exact=exact, ema=ema, gamma=0.01, bins=64)
    g = torch.Generator().manual_seed(seed + 10)
    for _ in range(2):
        for name, mod in a.layers.items():
            n = mod.gate.e_score_correction_bias.numel()
            scores = torch.sigmoid(torch.randn(40, n, generator=g) + torch.linspace(1.5, -1.5, n)) * scale
            idx = torch.topk(scores + mod.gate.e_score_correction_bias, mod.top_k, dim=-1).indices
            a.observe(name, idx, scores)
            b.observe(name, idx, scores)
    return a, b


@pytest.mark.parametrize("method, exact, ema", [("qb", False, 0.0), ("qb", False, 0.3), ("qb", True, 0.25),
                                                ("sign", False, 0.0)])
def test_balance_step_matches_reference_bitwise(method, exact, ema):
    """Batched device-side step (one host read) == the per-layer step with a host read per layer: the same
    maxvio floats and bit-identical biases, on CPU."""
    a, b = _fed_controllers(method, exact, ema)
    before = {n: m.gate.e_score_correction_bias.clone() for n, m in a.layers.items()}
    got, want = a.step(), b._step_reference()
    assert got == want and list(got) == list(want)
    for n, mod in a.layers.items():
        assert torch.equal(mod.gate.e_score_correction_bias, b.layers[n].gate.e_score_correction_bias), n
        assert not torch.equal(mod.gate.e_score_correction_bias, before[n]), n
    a, b = _fed_controllers(method, exact, ema, seed=1)
    lazy, want = a.step(sync=False), b._step_reference()
    assert {n: v.item() for n, v in lazy.items()} == want


def test_balance_range_check_moved_to_step_raises_before_writing():
    """Scores outside [0, 1] (margins outside the histogram range): the controller's observe no longer checks
    (no host read per call); step() raises, naming the layer, before any bias changes — also with sync=False
    on CPU. A standalone MarginHistogram still checks in add()."""
    from k3.train.balance import MarginHistogram, expert_loads
    for sync in (True, False):
        a, _ = _fed_controllers("qb", scale=3.0)
        before = {n: m.gate.e_score_correction_bias.clone() for n, m in a.layers.items()}
        with pytest.raises(ValueError, match=r"score_range.*" + next(iter(a.layers)).replace(".", r"\.")):
            a.step(sync=sync)
        assert all(torch.equal(before[n], m.gate.e_score_correction_bias) for n, m in a.layers.items())
    with pytest.raises(ValueError, match="score_range"):
        MarginHistogram(torch.zeros(4), 1).add(torch.rand(10, 4) * 3)
    idx = torch.randint(0, 12, (50, 3), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_loads(idx, 12), torch.bincount(idx.reshape(-1), minlength=12))


def test_balance_histogram_state_keeps_the_range_seen():
    a, b = _fed_controllers("qb", scale=3.0)
    sd = copy.deepcopy(a.state_dict())
    assert all(h["seen"] is not None for h in sd["hists"].values())
    b.load_state_dict(sd)
    with pytest.raises(ValueError, match="score_range"):
        b.step()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_controllers_on_cuda_without_host_sync():
    """QK-clip step(sync=False), balance observe + step(sync=False): no host sync (sync debug mode "error");
    with sync=True the same numbers as the references."""
    model = make_tiny(seed=4).train().cuda()
    twin = copy.deepcopy(model)
    from k3.train.balance import BalanceController
    ctl, ref_ctl = BalanceController(model, bins=64), BalanceController(twin, bins=64)
    clip, ref_clip = _planted_clip(model, 5.0, 0), _planted_clip(twin, 5.0, 0)
    clip.running = {n: v.cuda() for n, v in clip.running.items()}
    ref_clip.running = {n: v.cuda() for n, v in ref_clip.running.items()}
    g = torch.Generator().manual_seed(3)
    routing = {}
    for name, mod in ctl.layers.items():
        n = mod.gate.e_score_correction_bias.numel()
        s = torch.sigmoid(torch.randn(64, n, generator=g)).cuda()
        routing[name] = (torch.topk(s + mod.gate.e_score_correction_bias, mod.top_k, dim=-1).indices, s)
    for name, r in routing.items():
        ref_ctl.observe(name, *r)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, r in routing.items():
            ctl.observe(name, *r)
        lazy = ctl.step(sync=False)
        cl = clip.step(sync=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = ref_ctl._step_reference()
    assert {n: v.item() for n, v in lazy.items()} == pytest.approx(want, rel=1e-12)
    for n, mod in ctl.layers.items():
        assert torch.allclose(mod.gate.e_score_correction_bias, ref_ctl.layers[n].gate.e_score_correction_bias,
                              atol=1e-6), n
    ref = ref_clip._step_reference()
    assert cl["clipped_heads"].item() == ref["clipped_heads"] and cl["max_logit"].item() == ref["max_logit"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert ctl.step() == {}  # reads the deferred range check: nothing pending
