"""MoonViT-V2 tower, patchmergerv2 projector and the media helpers (k3.model.vision / k3.model.media)."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.model.media import (media_token_count, merge_media_embeddings, navit_resize, preprocess_frames,
                            preprocess_image, preprocess_video)
from k3.model.vision import (MoonViTVisionTower, PatchMergerV2Projector, apply_rope_2d, build_vision_modules,
                             interpolate_pos_emb, rope_2d_angles, sd2_tpool_merge, sincos_time_embedding,
                             vision_param_count)


@pytest.fixture(scope="module")
def tiny_cfg():
    return K3Config.preset("k3-tiny").vision_config


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    torch.manual_seed(0)
    tower, proj = build_vision_modules(tiny_cfg)
    return tower.eval(), proj.eval()


def _patches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 14, 14, generator=g)


# ------------------------------------------------------------------------------------------- checkpoint names
def test_full_size_state_dict_names_shapes_and_count():
    cfg = K3Config.preset("k3").vision_config
    with torch.device("meta"):
        tower, proj = build_vision_modules(cfg)
    sd = {f"vision_tower.{k}": tuple(v.shape) for k, v in tower.state_dict().items()}
    sd.update({f"mm_projector.{k}": tuple(v.shape) for k, v in proj.state_dict().items()})
    want = {
        "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
        "vision_tower.encoder.final_layernorm.weight": (1024,),
        "mm_projector.proj.0.weight": (4096, 4096),
        "mm_projector.proj.2.weight": (7168, 4096),
        "mm_projector.post_norm.weight": (7168,),
    }
    for i in range(27):
        b = f"vision_tower.encoder.blocks.{i}."
        want.update({b + "wqkv.weight": (4608, 1024), b + "wo.weight": (1024, 1536), b + "norm0.weight": (1024,),
                     b + "norm1.weight": (1024,), b + "mlp.fc0.weight": (4096, 1024),
                     b + "mlp.fc1.weight": (1024, 4096)})
    assert sd == want
    assert len(sd) == 168
    n = sum(p.numel() for p in tower.parameters()) + sum(p.numel() for p in proj.parameters())
    assert n == 447_358_976 == vision_param_count(cfg)
    assert list(tower.buffers()) == [] and list(proj.buffers()) == []
    assert not any(m.bias is not None for m in list(tower.modules()) + list(proj.modules()) if hasattr(m, "bias"))


# ------------------------------------------------------------------------------------------- tower behaviour
def test_no_cross_item_leakage(tiny):
    tower, proj = tiny
    a, b = _patches(1 * 4 * 6, 1), _patches(1 * 8 * 4, 2)
    with torch.no_grad():
        both = tower(torch.cat([a, b]), torch.tensor([[1, 4, 6], [1, 8, 4]]))
        ya = tower(a, torch.tensor([[1, 4, 6]]))[0]
        yb = tower(b, torch.tensor([[1, 8, 4]]))[0]
    assert both[0].shape == (2 * 3, 4 * 64) and both[1].shape == (4 * 2, 4 * 64)
    torch.testing.assert_close(both[0], ya, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[1], yb, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        pa = proj(both)
    assert [p.shape for p in pa] == [(6, 128), (8, 128)]


def test_clip_joint_temporal_attention_and_shape(tiny):
    tower, _ = tiny
    f0, f1 = _patches(4 * 6, 3), _patches(4 * 6, 4)
    g1 = torch.tensor([[1, 4, 6]])
    with torch.no_grad():
        clip = tower(torch.cat([f0, f1]), torch.tensor([[2, 4, 6]]))[0]
        s0, s1 = tower(f0, g1)[0], tower(f1, g1)[0]
    assert clip.shape == (2 * 3, 256)
    assert not torch.allclose(clip, s0, atol=1e-3) and not torch.allclose(clip, (s0 + s1) / 2, atol=1e-3)
    # a clip is still independent of other items in the same call
    with torch.no_grad():
        mixed = tower(torch.cat([f0, f1, _patches(16, 5)]), torch.tensor([[2, 4, 6], [1, 4, 4]]))[0]
    torch.testing.assert_close(mixed, clip, atol=1e-5, rtol=1e-5)


def test_gradients_reach_every_parameter(tiny_cfg):
    torch.manual_seed(1)
    tower, proj = build_vision_modules(tiny_cfg)
    pv = _patches(2 * 4 * 6 + 8 * 4, 6)
    out = proj(tower(pv, torch.tensor([[2, 4, 6], [1, 8, 4]])))
    (sum((o * torch.randn_like(o)).sum() for o in out)).backward()
    for name, p in list(tower.named_parameters()) + list(proj.named_parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_grid_errors(tiny):
    tower, _ = tiny
    with pytest.raises(ValueError, match="grid_thws"):
        tower(_patches(15, 0), torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match="init_pos_emb_time"):
        tower(_patches(5 * 4, 0), torch.tensor([[5, 2, 2]]))
    with pytest.raises(ValueError, match="patches"):
        tower(_patches(7, 0), torch.tensor([[1, 2, 2]]))


def _reference_tower(tower, cfg, pv, grid_thws):
    """Independent transcription: conv2d patch embed, complex RoPE, block-diagonal mask over the packed sequence."""
    grids = grid_thws.tolist()
    x = F.conv2d(pv, tower.patch_embed.proj.weight, stride=14).flatten(1)
    pos = []
    W = tower.patch_embed.pos_emb.weight
    for t, h, w in grids:
        e = W.flatten(0, 1) if (h, w) == tuple(W.shape[:2]) else \
            F.interpolate(W.permute(2, 0, 1)[None], size=(h, w), mode="bilinear").squeeze(0).permute(1, 2, 0).flatten(0, 1)
        if t > 1:
            e = (e[None] + sincos_time_embedding(W.shape[-1], 4)[:t, None]).flatten(0, 1)
        pos.append(e)
    x = x + torch.cat(pos)
    hd = cfg.qkv_hidden_size // cfg.vt_num_attention_heads
    freqs = 1.0 / 10000 ** (torch.arange(0, hd, 4)[: hd // 4].float() / hd)
    cis = []
    for t, h, w in grids:
        flat = torch.arange(h * w).float()
        xs, ys = torch.outer(flat % w, freqs), torch.outer(torch.div(flat, w, rounding_mode="floor"), freqs)
        c = torch.stack([torch.polar(torch.ones_like(xs), xs), torch.polar(torch.ones_like(ys), ys)], -1).flatten(1)
        cis.append(c.repeat(t, 1))
    cis = torch.cat(cis)[:, None]
    L = x.shape[0]
    seg = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor([t * h * w for t, h, w in grids]))
    allowed = seg[:, None] == seg[None, :]
    H = cfg.vt_num_attention_heads

    def rms(v, wgt):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + torch.finfo(v.dtype).eps) * wgt

    for blk in tower.encoder.blocks:
        hN = rms(x, blk.norm0.weight)
        q, k, v = (blk.wqkv.weight @ hN.T).T.view(L, 3, H, hd).unbind(1)
        q = torch.view_as_real(torch.view_as_complex(q.reshape(L, H, -1, 2).contiguous()) * cis).flatten(-2)
        k = torch.view_as_real(torch.view_as_complex(k.reshape(L, H, -1, 2).contiguous()) * cis).flatten(-2)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        a = torch.einsum("hqk,khd->qhd", s, v).reshape(L, -1)
        x = x + a @ blk.wo.weight.T
        hN = rms(x, blk.norm1.weight)
        x = x + F.gelu(hN @ blk.mlp.fc0.weight.T, approximate="tanh") @ blk.mlp.fc1.weight.T
    x = rms(x, tower.encoder.final_layernorm.weight)
    out, o = [], 0
    for t, h, w in grids:
        seq = x[o:o + t * h * w].view(t, h // 2, 2, w // 2, 2, -1).permute(0, 1, 3, 2, 4, 5).mean(0)
        out.append(seq.reshape((h // 2) * (w // 2), -1))
        o += t * h * w
    return out


def test_matches_independent_reference(tiny, tiny_cfg):
    tower, _ = tiny
    with torch.no_grad():
        tower.patch_embed.pos_emb.weight.normal_()     # make position effects large
        grid = torch.tensor([[3, 4, 6], [1, 16, 16], [1, 2, 8]])
        pv = _patches(3 * 24 + 256 + 16, 7)
        got, ref = tower(pv, grid), _reference_tower(tower, tiny_cfg, pv, grid)
        tower.patch_embed.pos_emb.reset_parameters()
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("head_dim", [32, 128])
def test_rope_scores_depend_only_on_relative_offset(head_dim):
    g = torch.Generator().manual_seed(0)
    h, w = 12, 15
    ang = rope_2d_angles(h, w, head_dim)
    q, k = torch.randn(1, 1, head_dim, generator=g), torch.randn(1, 1, head_dim, generator=g)

    def score(pq, pk):
        rq = apply_rope_2d(q, ang[pq[0] * w + pq[1]][None])
        rk = apply_rope_2d(k, ang[pk[0] * w + pk[1]][None])
        return (rq * rk).sum().item()

    for (a, b), (dr, dc) in [(((1, 2), (4, 9)), (5, 3)), (((0, 0), (7, 1)), (3, 11)), (((6, 10), (2, 3)), (-2, -1))]:
        s1 = score(a, b)
        s2 = score((a[0] + dr, a[1] + dc), (b[0] + dr, b[1] + dc))
        assert s1 == pytest.approx(s2, rel=1e-4, abs=1e-4)
    # and it does depend on the offset, in both axes separately
    assert score((1, 1), (1, 4)) != pytest.approx(score((1, 1), (4, 1)), abs=1e-3)
    # no rotation at the origin; norms preserved everywhere
    torch.testing.assert_close(apply_rope_2d(q, ang[:1]), q)
    torch.testing.assert_close(apply_rope_2d(q.expand(1, 1, head_dim), ang[37:38]).norm(), q.norm())


def test_rope_layout_columns_then_rows():
    hd = 8
    ang = rope_2d_angles(3, 5, hd)                   # [15, 4]: pairs (x0, y0, x1, y1)
    th = 1.0 / 10000 ** (torch.tensor([0.0, 4.0]) / hd)
    r, c = 2, 3
    torch.testing.assert_close(ang[r * 5 + c], torch.stack([c * th[0], r * th[0], c * th[1], r * th[1]]))


# ------------------------------------------------------------------------------------------- positions
def test_pos_emb_interpolation(tiny):
    tower, _ = tiny
    W = tower.patch_embed.pos_emb.weight
    native = interpolate_pos_emb(W, 16, 16)
    assert torch.equal(native, W.flatten(0, 1)) and native.data_ptr() == W.data_ptr()
    for h, w in [(4, 6), (8, 4), (32, 20), (16, 8)]:
        ref = F.interpolate(W.detach().permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                            align_corners=False)[0].permute(1, 2, 0).reshape(h * w, -1)
        torch.testing.assert_close(interpolate_pos_emb(W.detach(), h, w), ref)


def test_time_embedding_only_for_clips(tiny):
    tower, _ = tiny
    pe = tower.patch_embed.pos_emb
    D = pe.dim
    z = torch.zeros(2 * 4 * 6, D)
    with torch.no_grad():
        one = pe(z[:24], [(1, 4, 6)])
        two = pe(z, [(2, 4, 6)])
    sp = interpolate_pos_emb(pe.weight.detach(), 4, 6)
    tt = sincos_time_embedding(D, 4)
    torch.testing.assert_close(one, sp)
    torch.testing.assert_close(two, torch.cat([sp + tt[0], sp + tt[1]]))
    # MAE get_1d_sincos_pos_embed: [sin | cos] halves, omega_j = 10000^(-j/(D/2))
    torch.testing.assert_close(tt[0], torch.cat([torch.zeros(D // 2), torch.ones(D // 2)]))
    assert tt[1, 1].item() == pytest.approx(math.sin(10000 ** (-1 / (D / 2))), rel=1e-6)
    assert tt[2, D // 2 + 3].item() == pytest.approx(math.cos(2 * 10000 ** (-3 / (D / 2))), rel=1e-6)


# ------------------------------------------------------------------------------------------- merge + projector
def test_sd2_tpool_layout():
    t, h, w = 2, 2, 4
    f = torch.arange(t).view(t, 1, 1)
    r = torch.arange(h).view(1, h, 1)
    c = torch.arange(w).view(1, 1, w)
    val = (100 * f + 10 * r + c).float()                               # frame f, row r, col c
    x = torch.stack([val, val + 0.5], dim=-1).reshape(t * h * w, 2)   # D = 2
    y = sd2_tpool_merge(x, t, h, w)
    # mean over frames → 50 + 10r + c; token (i, j) = [TL, TR, BL, BR] each [d0, d1]
    want = torch.tensor([[50, 50.5, 51, 51.5, 60, 60.5, 61, 61.5],
                         [52, 52.5, 53, 53.5, 62, 62.5, 63, 63.5]])
    torch.testing.assert_close(y, want)
    with pytest.raises(ValueError):
        sd2_tpool_merge(torch.zeros(6, 2), 1, 2, 3)


def test_projector_order(tiny, tiny_cfg):
    _, proj = tiny
    x = torch.randn(5, 4 * tiny_cfg.mm_hidden_size)
    with torch.no_grad():
        y = proj(x)
        hidden = F.gelu(x @ proj.proj[0].weight.T) @ proj.proj[2].weight.T      # exact GELU
        want = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5)  # post RMSNorm, weight 1
    assert isinstance(proj.proj[1], torch.nn.GELU) and proj.proj[1].approximate == "none"
    torch.testing.assert_close(y, want)
    with pytest.raises(ValueError):
        proj(torch.randn(2, 3))


# ------------------------------------------------------------------------------------------- media helpers
def test_media_token_count_goldens():
    assert media_token_count(611, 437) == 352
    assert media_token_count(224, 224) == 64
    assert media_token_count(1920, 1080) == 2691
    for w, h in [(1, 1), (28, 28), (29, 57), (3584, 3584)]:
        assert media_token_count(w, h) == math.ceil(w / 28) * math.ceil(h / 28)
    # above the 65536-patch budget / 512-patch side the image is downscaled (processor rule)
    plan = navit_resize(4000, 4000)
    assert (plan["new_width"], plan["new_height"], plan["num_tokens"]) == (3592, 3592, 129 * 129)
    plan = navit_resize(8000, 28)
    assert (plan["new_width"], plan["new_height"], plan["grid_w"], plan["grid_h"]) == (7168, 25, 512, 2)


def test_preprocess_image_consistent_with_count():
    g = torch.Generator().manual_seed(0)
    img = torch.randint(0, 256, (437, 611, 3), dtype=torch.uint8, generator=g)      # H, W, 3
    pv, grid = preprocess_image(img)
    assert grid.tolist() == [[1, 32, 44]] and pv.shape == (32 * 44, 3, 14, 14)
    assert grid[0, 1] * grid[0, 2] // 4 == media_token_count(611, 437)
    # first patch = normalised top-left 14x14 pixels
    torch.testing.assert_close(pv[0], img[:14, :14].permute(2, 0, 1).float() / 255 * 2 - 1)
    full = pv.view(32, 44, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 448, 616)      # un-patchify
    torch.testing.assert_close(full[:, :437, :611], img.permute(2, 0, 1).float() / 255 * 2 - 1)
    assert torch.all(full[:, 437:] == -1) and torch.all(full[:, :, 611:] == -1)        # black pad, then normalise
    # row-major (h, w): patch 1 is the next 14 columns
    torch.testing.assert_close(pv[1], img[:14, 14:28].permute(2, 0, 1).float() / 255 * 2 - 1)
    # channels-first float input in [0, 1] gives the same thing
    pv2, grid2 = preprocess_image(img.permute(2, 0, 1).float() / 255)
    assert torch.equal(grid2, grid)
    torch.testing.assert_close(pv2, pv)
    # a downscaled image still matches the counter
    wide = torch.randint(0, 256, (3, 28, 8000), dtype=torch.uint8, generator=g)
    pv3, grid3 = preprocess_image(wide)
    assert grid3.tolist() == [[1, 2, 512]] and pv3.shape[0] == 1024
    assert grid3[0, 1] * grid3[0, 2] // 4 == media_token_count(8000, 28)


def test_preprocess_frames_and_video(tiny):
    frames = torch.rand(6, 3, 50, 60)
    pv, grid = preprocess_frames(frames[:3])
    assert grid.tolist() == [[3, 4, 6]] and pv.shape == (72, 3, 14, 14)
    pvv, grids = preprocess_video(frames)
    assert grids.tolist() == [[4, 4, 6], [2, 4, 6]] and pvv.shape == (6 * 24, 3, 14, 14)
    with pytest.raises(ValueError):
        preprocess_frames(frames[:5])
    tower, _ = tiny
    with torch.no_grad():
        out = tower(pvv, grids)
    assert [o.shape[0] for o in out] == [media_token_count(60, 50)] * 2


def test_merge_media_embeddings():
    P, D = 99, 4
    ids = torch.tensor([[1, P, 2, 3, 4],
                        [P, 5, P, 6, 7]])
    emb = torch.randn(2, 5, D, requires_grad=True)
    feats = [torch.randn(n, D, requires_grad=True) for n in (3, 2, 4)]
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, 10, 11, 12, 13], [20, 21, 22, 23, 24]])
    out = merge_media_embeddings(ids, emb, feats, P, attention_mask=mask, labels=labels)
    e, m, lab = out["inputs_embeds"], out["attention_mask"], out["labels"]
    assert e.shape == (2, 9, D) and m.shape == (2, 9) and lab.shape == (2, 9)
    # row 0: 4 text + 3 media = 7 → 2 left pads
    z = torch.zeros(D)
    row0 = [z, z, emb[0, 0], feats[0][0], feats[0][1], feats[0][2], emb[0, 2], emb[0, 3], emb[0, 4]]
    row1 = [feats[1][0], feats[1][1], emb[1, 1], feats[2][0], feats[2][1], feats[2][2], feats[2][3], emb[1, 3],
            emb[1, 4]]
    torch.testing.assert_close(e[0], torch.stack(row0))
    torch.testing.assert_close(e[1], torch.stack(row1))
    assert m.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9]
    assert lab.tolist() == [[-100, -100, -100, -100, -100, -100, 11, 12, 13],
                            [-100, -100, 21, -100, -100, -100, -100, 23, 24]]
    assert out["media_mask"].sum().item() == 9
    # gradients flow to both inputs
    w = torch.randn_like(e)
    (e * w).sum().backward()
    torch.testing.assert_close(feats[2].grad, w[1, 3:7])
    torch.testing.assert_close(feats[0].grad, w[0, 3:6])
    torch.testing.assert_close(emb.grad[0, 2], w[0, 6])
    assert torch.all(emb.grad[0, 1] == 0) and torch.all(emb.grad[1, 0] == 0)      # placeholders are replaced
    # no labels / mask → labels None, mask of ones + pads
    out2 = merge_media_embeddings(ids, emb.detach(), [f.detach() for f in feats], P)
    assert out2["labels"] is None and out2["attention_mask"].tolist()[0] == [0, 0] + [1] * 7
    # errors
    with pytest.raises(ValueError, match="3 placeholder"):
        merge_media_embeddings(ids, emb, feats[:2], P)
    with pytest.raises(ValueError, match=r"\[n_i, 4\]"):
        merge_media_embeddings(ids, emb, [feats[0], feats[1], torch.randn(4, 5)], P)


def test_merge_without_placeholders_is_identity():
    emb = torch.randn(2, 3, 4)
    out = merge_media_embeddings(torch.ones(2, 3, dtype=torch.long), emb, [], 99)
    torch.testing.assert_close(out["inputs_embeds"], emb)
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]


def test_tower_is_a_module_tree_of_the_expected_classes(tiny):
    tower, proj = tiny
    assert isinstance(tower, MoonViTVisionTower) and isinstance(proj, PatchMergerV2Projector)
    for blk in tower.encoder.blocks:
        assert isinstance(blk.norm0, torch.nn.RMSNorm) and blk.norm0.eps is None      # dtype-dependent eps
    assert tower.encoder.final_layernorm.eps is None and proj.post_norm.eps == 1e-5
