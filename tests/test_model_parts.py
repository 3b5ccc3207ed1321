"""Model components against direct, independent implementations on random inputs (fp64 where it helps)."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny, rel_rmse
from k3.model.mla import MLAttention
from k3.model.moe import LatentMoE
from k3.ops.attn_res import attn_res
from k3.ops.situ import situ_glu


# ---- SiTU ----------------------------------------------------------------------------------------
def test_situ_is_bounded_by_100():
    g = torch.randn(100_000) * 1e4
    u = torch.randn(100_000) * 1e4
    a = situ_glu(g, u)
    assert a.abs().max() <= 100.0 + 1e-4
    assert a.abs().max() > 90  # the cap is reached, not a shrunken activation


def test_situ_matches_swiglu_near_zero():
    g = torch.randn(10_000, dtype=torch.float64) * 0.05
    u = torch.randn(10_000, dtype=torch.float64) * 0.05
    swiglu = F.silu(g) * u
    assert rel_rmse(swiglu, situ_glu(g, u).double()) < 2e-3
    # and differs clearly for large inputs
    g, u = torch.full((4,), 20.0), torch.full((4,), 60.0)
    assert (situ_glu(g, u) - F.silu(g) * u).abs().min() > 100


def test_situ_formula():
    g, u = torch.randn(1000, dtype=torch.float64) * 8, torch.randn(1000, dtype=torch.float64) * 40
    ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(situ_glu(g, u, 4.0, 25.0).double(), ref, atol=1e-5)


# ---- AttnRes -------------------------------------------------------------------------------------
def attn_res_direct(sources, proj, norm_w, eps):
    """h = Σ_i softmax_i(w · RMSNorm(v_i)) v_i, written out per token with a weighted RMSNorm."""
    out = torch.zeros_like(sources[0], dtype=torch.float64)
    flat = [s.double().reshape(-1, s.shape[-1]) for s in sources]
    res = out.reshape(-1, out.shape[-1])
    for t in range(flat[0].shape[0]):
        scores = []
        for v in flat:
            n = v[t] / torch.sqrt((v[t] ** 2).mean() + eps) * norm_w.double()
            scores.append((n * proj.double().reshape(-1)).sum())
        a = torch.softmax(torch.stack(scores), 0)
        res[t] = sum(a[i] * flat[i][t] for i in range(len(flat)))
    return out


def test_attn_res_op_matches_formula():
    torch.manual_seed(0)
    D = 32
    sources = [torch.randn(2, 5, D) * (i + 1) for i in range(4)]
    proj, norm_w = torch.randn(1, D), torch.rand(D) + 0.5
    got = attn_res(sources, proj, norm_w, 1e-5)
    assert rel_rmse(attn_res_direct(sources, proj, norm_w, 1e-5), got) < 1e-6


def test_attn_res_zero_query_is_uniform_mean():
    sources = [torch.randn(3, 8) for _ in range(5)]
    got = attn_res(sources, torch.zeros(1, 8), torch.ones(8), 1e-5)
    assert torch.allclose(got, torch.stack(sources).mean(0), atol=1e-6)


def test_attn_res_block_bookkeeping_matches_release_order():
    """Re-implements the release's loop (checkpoint.md §5.4) with the model's own sub-layers."""
    model = make_tiny(seed=3).double()
    lm = model.language_model.model
    cfg = lm.config
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        h_model, _, _ = lm(x)
        blocks, prefix = [], x
        for l, layer in enumerate(lm.decoder_layers):
            h = attn_res_direct(blocks + [prefix], layer.self_attention_res_proj.weight,
                                layer.self_attention_res_norm.weight, cfg.rms_norm_eps) if blocks else prefix
            if l % cfg.attn_res_block_size == 0:
                blocks.append(prefix)
                prefix = None
            a = layer.self_attn(layer.input_layernorm(h))
            prefix = a if prefix is None else prefix + a
            h = attn_res_direct(blocks + [prefix], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight,
                                cfg.rms_norm_eps)
            prefix = prefix + layer.ffn(h)
        ref = attn_res_direct(blocks + [prefix], lm.output_attn_res_proj.weight, lm.output_attn_res_norm.weight,
                              cfg.rms_norm_eps)
    assert len(blocks) == 3  # embedding + 2 finished blocks; the 5th layer's block is still partial
    assert rel_rmse(ref, h_model) < 1e-10


# ---- MoE -----------------------------------------------------------------------------------------
def test_moe_matches_per_token_loop():
    model = make_tiny(seed=1).double()
    moe: LatentMoE = model.language_model.model.layers[1].block_sparse_moe
    cfg = moe.cfg
    x = torch.randn(3, 7, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        got = moe(x)
        ref = torch.empty_like(x)
        bias = moe.gate.e_score_correction_bias.double()
        for i, xt in enumerate(x.reshape(-1, cfg.hidden_size)):
            scores = torch.sigmoid(moe.gate.weight.double() @ xt)
            chosen = sorted(range(cfg.num_experts), key=lambda e: -(scores[e] + bias[e]).item())[:cfg.num_experts_per_token]
            w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
            lat = moe.routed_expert_down_proj.weight @ xt
            acc = torch.zeros_like(lat)
            for wk, e in zip(w, chosen):
                a, b = moe.experts.w1[e] @ lat, moe.experts.w3[e] @ lat
                act = 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)
                acc = acc + wk * (moe.experts.w2[e] @ act)
            acc = acc / torch.sqrt((acc ** 2).mean() + cfg.rms_norm_eps) * moe.routed_expert_norm.weight
            sh = moe.shared_experts
            sa, sb = sh.gate_proj.weight @ xt, sh.up_proj.weight @ xt
            shared = sh.down_proj.weight @ (4 * torch.tanh(sa / 4) * torch.sigmoid(sa) * 25 * torch.tanh(sb / 25))
            ref.view(-1, cfg.hidden_size)[i] = moe.routed_expert_up_proj.weight @ acc + shared
    assert rel_rmse(ref, got) < 1e-6


def test_selection_bias_changes_choice_not_weights():
    model = make_tiny(seed=2)
    moe = model.language_model.model.layers[1].block_sparse_moe
    x = torch.randn(64, moe.cfg.hidden_size)
    from k3.ops.moe import route
    bias = torch.zeros(moe.cfg.num_experts)
    bias[5] = 10.0  # expert 5 is always chosen, yet its weight comes from its raw score
    idx, w, scores = route(x, moe.gate.weight, bias, 2)
    assert (idx == 5).any(-1).all()
    raw = scores.gather(-1, idx)
    assert torch.allclose(w, raw / raw.sum(-1, keepdim=True))


def test_router_gets_gradient():
    model = make_tiny(seed=2).train()
    moe = model.language_model.model.layers[2].block_sparse_moe
    moe(torch.randn(4, 5, moe.cfg.hidden_size)).square().sum().backward()
    assert moe.gate.weight.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.experts.parameters())


# ---- MLA -----------------------------------------------------------------------------------------
def naive_mla(mla: MLAttention, x, mask=None):
    """Textbook MHA over the expanded latent, per head, fp64, NoPE (the 64-d slice is never rotated)."""
    B, T, _ = x.shape
    H, dn, dr, dv = mla.num_heads, mla.nope, mla.rope, mla.vdim
    q = mla.q_b_proj(mla.q_a_layernorm(mla.q_a_proj(x))).view(B, T, H, dn + dr)
    kv_a = mla.kv_a_proj_with_mqa(x)
    c, k_pe = kv_a[..., :mla.kv_lora_rank], kv_a[..., mla.kv_lora_rank:]
    c = mla.kv_a_layernorm(c)
    kv = mla.kv_b_proj(c).view(B, T, H, dn + dv)
    out = torch.zeros(B, T, H, dv, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            k = torch.cat([kv[b, :, h, :dn], k_pe[b]], -1)
            s = q[b, :, h] @ k.T / math.sqrt(dn + dr)
            allowed = torch.ones(T, T).tril().bool()
            if mask is not None:
                allowed &= mask[b].bool()[None, :]
            s = s.masked_fill(~allowed, float("-inf"))
            out[b, :, h] = torch.softmax(s, -1).nan_to_num() @ kv[b, :, h, dn:]
    o = out.reshape(B, T, H * dv) * torch.sigmoid(mla.g_proj(x))
    return mla.o_proj(o)


@pytest.mark.parametrize("impl", ["naive", "absorbed"])
def test_mla_paths_match_textbook_attention(impl):
    model = make_tiny(seed=4).double()
    mla = model.language_model.model.layers[3].self_attn
    assert isinstance(mla, MLAttention)
    mla.attn_impl = impl
    x = torch.randn(2, 11, model.config.text_config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        assert rel_rmse(naive_mla(mla, x), mla(x)) < 1e-10


def test_mla_expanded_keys_are_the_same_with_and_without_autograd():
    """`expand_kv` without autograd fills the per-head keys by two copies instead of `torch.cat`: bitwise the same
    keys and values, on fresh random latents."""
    model = make_tiny(seed=4)
    mla = model.language_model.model.layers[3].self_attn
    cfg = model.config.text_config
    c, k_pe = torch.randn(2, 13, cfg.kv_lora_rank), torch.randn(2, 13, cfg.qk_rope_head_dim)
    k_grad, v_grad = mla.expand_kv(c, k_pe)
    with torch.no_grad():
        k, v = mla.expand_kv(c, k_pe)
    assert k_grad.requires_grad and not k.requires_grad
    assert torch.equal(k, k_grad.detach()) and torch.equal(v, v_grad.detach())
    assert torch.equal(k[..., cfg.qk_nope_head_dim:], k_pe[:, :, None].expand_as(k[..., cfg.qk_nope_head_dim:]))


def test_mla_absorbed_decode_caches_only_latent():
    model = make_tiny(seed=5).double()
    mla = model.language_model.model.layers[4].self_attn
    cfg = model.config.text_config
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        full = naive_mla(mla, x)
        cache = {}
        outs = [mla(x[:, :4], cache=cache)]
        for t in range(4, 9):
            outs.append(mla(x[:, t:t + 1], cache=cache))  # auto → absorbed (past > 0)
        assert set(cache) == {"c", "k_pe"}
        assert cache["c"].shape == (2, 9, cfg.kv_lora_rank) and cache["k_pe"].shape == (2, 9, cfg.qk_rope_head_dim)
    assert rel_rmse(full, torch.cat(outs, 1)) < 1e-10


# ---- KDA layer -------------------------------------------------------------------------------------
def test_kda_layer_uses_per_head_a_log_and_lower_bound():
    model = make_tiny(seed=6)
    kda = model.language_model.model.layers[0].self_attn
    H = kda.num_heads
    assert kda.A_log.shape == (128,)
    with torch.no_grad():
        kda.A_log[:H] = torch.linspace(-1.0, 2.0, H)
        x = torch.randn(2, 33, model.config.text_config.hidden_size)
        ref = kda(x)
        kda.A_log[1] += 0.5  # changing one head's A_log changes only that head's output channels
        kda.backend = "reference"
        changed = kda(x)
        kda.A_log[1] -= 0.5
        same = kda(x)
    assert rel_rmse(ref, same) < 1e-5  # chunked (auto) vs token-recurrent reference
    assert rel_rmse(ref, changed) > 1e-4


# ---- residual folded into the output projections -------------------------------------------------
def test_sublayers_return_residual_plus_output():
    """Each sublayer (KDA, MLA, LatentMoE, the dense SiTU MLP) called with `residual` returns residual + its
    output within fp32 rounding, and with autograd the same gradients for x and the residual: the residual is
    added inside the output projection (`torch.addmm`'s epilogue in training and in inference here, the GEMV's
    on CUDA), not by an add kernel after it."""
    torch.manual_seed(0)
    model = make_tiny(seed=1).float()
    kinds = ("KimiDeltaAttention", "MLAttention", "LatentMoE", "SituMLP")
    subs = [next(m for m in model.language_model.model.modules() if type(m).__name__ == k) for k in kinds]
    D = model.config.text_config.hidden_size
    x0, r0 = torch.randn(1, 7, D), torch.randn(1, 7, D)
    dy = torch.randn(1, 7, D)
    for m in subs:
        kind = type(m).__name__
        outs, grads = [], []
        for fused in (False, True):
            x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
            y = m(x, residual=r) if fused else r + m(x)
            y.backward(dy)
            outs.append(y.detach())
            grads.append((x.grad, r.grad))
        assert rel_rmse(outs[0], outs[1]) <= 1e-6, kind
        assert rel_rmse(grads[0][0], grads[1][0]) <= 1e-6, kind
        assert torch.equal(grads[1][1], dy), kind  # the residual's gradient is the output's, unchanged
        with torch.no_grad():
            fused = m(x0, residual=r0)
        assert rel_rmse(outs[0], fused) <= 1e-6, kind


def test_inference_accumulates_the_residual_stream_in_place_without_changing_anything(monkeypatch):
    """Without autograd the decoder lets its sublayers' output GEMMs accumulate onto the running block sum
    (`linear(add_inplace=True)`: no copy of the residual first). Against the autograd path (which never does):
    the same hidden states and per-layer taps; with taps requested, no attention accumulates onto a tapped sum
    (the taps keep their values); a partial sum handed in by the caller (a pipeline stage's) stays unchanged."""
    from k3.model.decoder import run_decoder_layers, stream_embeddings
    model = make_tiny(seed=12)
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.enable_grad():
        ref = model(input_ids=ids, output_block_states=True)
    calls = []
    real = torch.Tensor.addmm_

    def spy(self, *a, **k):
        calls.append(self.data_ptr())
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "addmm_", spy)
    with torch.no_grad():
        tapped = model(input_ids=ids, output_block_states=True)
        n_tapped = len(calls)
        plain = model(input_ids=ids)
    n_plain = len(calls) - n_tapped
    assert n_plain > n_tapped > 0  # the attentions' accumulation only without taps; the MLPs' always
    tol = 1e-5  # cuBLAS-free CPU GEMMs: addmm against linear + add differ in rounding only
    assert (ref.hidden_states - plain.hidden_states).abs().max() <= tol
    assert (ref.hidden_states - tapped.hidden_states).abs().max() <= tol
    for a, b in zip(ref.block_states, tapped.block_states, strict=True):
        assert (a - b).abs().max() <= tol
    # a caller's partial sum: the layers from an MLA layer inside a block on, from the state before it (that
    # layer's output GEMM adds the residual: in place it would write into the caller's tensor)
    layers = model.language_model.model.decoder_layers
    bs = model.config.text_config.attn_res_block_size
    cut = next(i for i, layer in enumerate(layers) if not layer.is_kda and layer.layer_idx % bs)
    with torch.no_grad():
        emb = stream_embeddings(model.language_model.model.embed_tokens(ids), None)
        blocks, partial = run_decoder_layers(layers[:cut], [emb], None, bs)
        kept = partial.clone()
        run_decoder_layers(layers[cut:], blocks, partial, bs)
    assert torch.equal(partial, kept)
