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
                            classify_parameters, newton_schulz)
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
