"""MoonViT-V2 vision tower and the `patchmergerv2` projector of Kimi K3 (trainable, checkpoint-exact names).

Module tree (the parent model prefixes `vision_tower.` / `mm_projector.`)::

    MoonViTVisionTower
      patch_embed.proj.weight            Conv2d [hidden, 3, p, p], no bias
      patch_embed.pos_emb.weight         [init_pos_emb_height, init_pos_emb_width, hidden]
      encoder.blocks.{i}.wqkv.weight     [3 * qkv_hidden_size, hidden]   (q | k | v, each heads x head_dim)
      encoder.blocks.{i}.wo.weight       [hidden, qkv_hidden_size]
      encoder.blocks.{i}.norm0.weight    [hidden]
      encoder.blocks.{i}.norm1.weight    [hidden]
      encoder.blocks.{i}.mlp.fc0.weight  [intermediate, hidden]
      encoder.blocks.{i}.mlp.fc1.weight  [hidden, intermediate]
      encoder.final_layernorm.weight     [hidden]
    PatchMergerV2Projector
      proj.0.weight                      [4 * mm_hidden, 4 * mm_hidden]   (proj.1 is an exact GELU, no params)
      proj.2.weight                      [text_hidden, 4 * mm_hidden]
      post_norm.weight                   [text_hidden]

No other state: the 1-D sin-cos time table and the 2-D RoPE angles are computed on the fly (so the tower can be
built on the meta device and materialised with `to_empty` + `init_weights` without stale buffers).

Semantics (as the released HF `modeling_kimi_k3.py` vision stack, read through its public ports):

* **Patch embedding.** `pixel_values` are already patchified, [L, 3, p, p] in (t, h, w) row-major order per media
  item; the Conv2d with kernel = stride = p is a linear map of the flattened patch (computed as such here).
* **Position embedding (`divided_fixed`).** The learnable [H0, W0, D] grid is used as is when (h, w) == (H0, W0),
  else resized with `F.interpolate(mode=pos_emb_interpolation_mode)` (bilinear, align_corners=False). For t == 1 that
  is all; for t > 1 the fixed MAE-style 1-D sin-cos table `get_1d_sincos_pos_embed(D, init_pos_emb_time)` row f is
  added to every patch of frame f (so frame 0 of a clip gets [0…0, 1…1] added, unlike a single image).
  t > init_pos_emb_time (4) is an error: longer videos must be split into clips of ≤ 4 frames, each its own media
  item (see `k3.model.media.preprocess_video`).
* **2-D RoPE** on q and k in every block, head_dim/2 complex pairs: pair 2i rotates by col·θ_i, pair 2i+1 by row·θ_i,
  θ_i = 10000^(-4i/head_dim); the same (row, col) table is repeated for every frame of a clip (no temporal RoPE).
* **Blocks.** Pre-norm: x += wo(attn(rope(q, k), v)) on norm0(x); x += fc1(gelu_tanh(fc0(norm1(x)))). The norms are
  `nn.RMSNorm(hidden)` with eps=None, i.e. eps = torch.finfo(input dtype).eps (1.19e-7 in fp32, 7.8e-3 in bf16) — the
  release's (dtype-dependent) behaviour, kept deliberately. Attention is softmax(q kᵀ/√head_dim) v, non-causal, JOINT
  over all t·h·w patches of one media item (cu_seqlens in the release) and never across items.
* **sd2_tpool merge** after `final_layernorm`: view [t, h/2, 2, w/2, 2, D] → permute (t, h/2, w/2, 2, 2, D) → mean
  over t → [(h/2)(w/2), 4·D]; the 4 sub-rows of a merged token are in order (0,0), (0,1), (1,0), (1,1)
  (top-left, top-right, bottom-left, bottom-right), each D wide.
* **Projector (`patchmergerv2`).** post_norm(proj.2(GELU_exact(proj.0(x)))) with post_norm = RMSNorm(text_hidden,
  eps=projector_ln_eps). There is no pre-norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3VisionConfig

__all__ = [
    "MoonViTVisionTower",
    "PatchMergerV2Projector",
    "build_vision_modules",
    "sincos_time_embedding",
    "rope_2d_angles",
    "apply_rope_2d",
    "interpolate_pos_emb",
    "sd2_tpool_merge",
]

_INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------------- helpers
def _grid_list(grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    if isinstance(grid_thws, torch.Tensor):
        if grid_thws.ndim != 2 or grid_thws.shape[1] != 3:
            raise ValueError(f"grid_thws must be [N, 3] (t, h, w), got shape {tuple(grid_thws.shape)}")
        rows = grid_thws.tolist()
    else:
        rows = [list(r) for r in grid_thws]
        if any(len(r) != 3 for r in rows):
            raise ValueError(f"grid_thws must be rows of (t, h, w), got {rows}")
    out = [(int(t), int(h), int(w)) for t, h, w in rows]
    if any(t < 1 or h < 1 or w < 1 for t, h, w in out):
        raise ValueError(f"grid_thws entries must be >= 1, got grid_thws={out}")
    return out


def sincos_time_embedding(dim: int, num_frames: int, device=None) -> torch.Tensor:
    """MAE `get_1d_sincos_pos_embed(dim, num_frames)`: [num_frames, dim] = [sin(f·ω) | cos(f·ω)], ω_j = 10000^(-2j/dim)."""
    if dim % 2:
        raise ValueError(f"sin-cos time embedding needs an even dim, got {dim}")
    omega = torch.arange(dim // 2, dtype=torch.float32, device=device) / (dim / 2.0)
    omega = 1.0 / (10000.0 ** omega)
    pos = torch.arange(num_frames, dtype=torch.float32, device=device)
    out = pos[:, None] * omega[None, :]
    return torch.cat([out.sin(), out.cos()], dim=1)


def rope_2d_angles(h: int, w: int, head_dim: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """Angles [h*w, head_dim/2] of the MoonViT 2-D RoPE for a row-major (h, w) grid.

    Complex pair 2i (dims 4i, 4i+1) rotates by col·θ_i, pair 2i+1 (dims 4i+2, 4i+3) by row·θ_i, θ_i = theta^(-4i/head_dim).
    """
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {head_dim}")
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32, device=device)[: head_dim // 4] / head_dim))
    cols = torch.arange(w, dtype=torch.float32, device=device)
    rows = torch.arange(h, dtype=torch.float32, device=device)
    x_ang = (cols[:, None] * freqs[None, :])[None, :, :].expand(h, w, head_dim // 4)
    y_ang = (rows[:, None] * freqs[None, :])[:, None, :].expand(h, w, head_dim // 4)
    return torch.stack([x_ang, y_ang], dim=-1).reshape(h * w, head_dim // 2)


def apply_rope_2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2j], x[2j+1]) of x [..., L, H, head_dim] by angles [L, head_dim/2] (fp32 math).

    Identical to `view_as_complex(x) * polar(1, angles)` of the reference.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    cos = angles.cos()[:, None, :]
    sin = angles.sin()[:, None, :]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def interpolate_pos_emb(weight: torch.Tensor, h: int, w: int, mode: str = "bilinear") -> torch.Tensor:
    """[H0, W0, D] grid → [h*w, D] (row-major); the parameter itself when (h, w) == (H0, W0)."""
    if (h, w) == tuple(weight.shape[:2]):
        return weight.flatten(0, 1)
    kw = {"align_corners": False} if mode in ("bilinear", "bicubic") else {}
    out = F.interpolate(weight.permute(2, 0, 1).unsqueeze(0), size=(h, w), mode=mode, **kw)
    return out.squeeze(0).permute(1, 2, 0).flatten(0, 1)


def sd2_tpool_merge(x: torch.Tensor, t: int, h: int, w: int, kernel: Sequence[int] = (2, 2)) -> torch.Tensor:
    """One item's [t*h*w, D] (t, h, w row-major) → [(h/kh)*(w/kw), kh*kw*D]: mean over t, then kh×kw merge.

    The kh*kw sub-rows are in (dy, dx) row-major order: for 2×2, top-left, top-right, bottom-left, bottom-right.
    """
    kh, kw = int(kernel[0]), int(kernel[1])
    d = x.shape[-1]
    if x.shape[0] != t * h * w:
        raise ValueError(f"sd2_tpool: got {x.shape[0]} rows for grid (t, h, w)=({t}, {h}, {w})")
    if h % kh or w % kw:
        raise ValueError(f"sd2_tpool: grid (h, w)=({h}, {w}) not divisible by merge kernel ({kh}, {kw})")
    y = x.view(t, h // kh, kh, w // kw, kw, d).permute(0, 1, 3, 2, 4, 5).mean(dim=0)
    return y.reshape((h // kh) * (w // kw), kh * kw * d)


# ----------------------------------------------------------------------------------------------------- modules
class Learnable2DInterpPosEmbDivided(nn.Module):
    """`divided_fixed` position embedding: learnable [H0, W0, D] grid (interpolated) + fixed sin-cos time table."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, interpolation_mode: str = "bilinear"):
        super().__init__()
        self.height, self.width, self.num_frames, self.dim = height, width, num_frames, dim
        self.interpolation_mode = interpolation_mode
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The release inits N(0, 1); for from-scratch training a small normal keeps it on the patch-embed scale.
        nn.init.normal_(self.weight, std=_INIT_STD)

    def extra_repr(self) -> str:
        return (f"height={self.height}, width={self.width}, num_frames={self.num_frames}, dim={self.dim}, "
                f"mode={self.interpolation_mode}")

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        cache: dict[tuple[int, int], torch.Tensor] = {}
        time = None
        parts = []
        for t, h, w in grids:
            if t > self.num_frames:
                raise ValueError(f"media item with t={t} frames > init_pos_emb_time={self.num_frames}; split videos "
                                 f"into clips of <= {self.num_frames} frames (grid_thws row {(t, h, w)})")
            emb = cache.get((h, w))
            if emb is None:
                emb = cache[(h, w)] = interpolate_pos_emb(self.weight, h, w, self.interpolation_mode)
            if t == 1:
                parts.append(emb)
            else:
                if time is None:
                    time = sincos_time_embedding(self.dim, self.num_frames, device=x.device)
                parts.append((emb.unsqueeze(0) + time[:t, None, :].to(emb.dtype)).flatten(0, 1))
        return x + torch.cat(parts, dim=0).to(x.dtype)


class MoonVision3dPatchEmbed(nn.Module):
    def __init__(self, cfg: K3VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.patch_size = p
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias)
        if cfg.pos_emb_type != "divided_fixed":
            raise NotImplementedError(f"pos_emb_type={cfg.pos_emb_type!r} (K3 uses 'divided_fixed')")
        self.pos_emb = Learnable2DInterpPosEmbDivided(cfg.init_pos_emb_height, cfg.init_pos_emb_width,
                                                      cfg.init_pos_emb_time, cfg.vt_hidden_size,
                                                      cfg.pos_emb_interpolation_mode)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        p = self.patch_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [L, 3, {p}, {p}] patches, got {tuple(pixel_values.shape)}")
        w = self.proj.weight
        # Conv2d with kernel == stride == input size is exactly a linear map of the flattened (c, i, j) patch.
        x = F.linear(pixel_values.to(w.dtype).flatten(1), w.flatten(1), self.proj.bias)
        return self.pos_emb(x, grids)


class MLP2(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=bias)
        self.fc1 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))  # gelu_pytorch_tanh


class MoonViTEncoderLayer(nn.Module):
    def __init__(self, cfg: K3VisionConfig):
        super().__init__()
        d, qkv = cfg.vt_hidden_size, cfg.qkv_hidden_size
        self.num_heads = cfg.vt_num_attention_heads
        if qkv % self.num_heads:
            raise ValueError(f"qkv_hidden_size={qkv} not divisible by vt_num_attention_heads={self.num_heads}")
        self.head_dim = qkv // self.num_heads
        self.qkv_hidden_size = qkv
        if cfg.norm_type != "rmsnorm":
            raise NotImplementedError(f"norm_type={cfg.norm_type!r} (K3 uses 'rmsnorm')")
        # eps=None on purpose: torch.finfo(input dtype).eps, as the release's `nn.RMSNorm(dim)`.
        self.norm0 = nn.RMSNorm(d)
        self.norm1 = nn.RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * qkv, bias=cfg.attn_bias)
        self.wo = nn.Linear(qkv, d, bias=cfg.attn_bias)
        if cfg.mlp_type != "mlp2":
            raise NotImplementedError(f"mlp_type={cfg.mlp_type!r} (K3 uses 'mlp2')")
        self.mlp = MLP2(d, cfg.vt_intermediate_size, bias=cfg.linear_bias)

    def attention(self, x: torch.Tensor, angles: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        L = x.shape[0]
        qkv = self.wqkv(x).view(L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=1)                                   # [L, H, hd] each
        q = apply_rope_2d(q, angles)
        k = apply_rope_2d(k, angles)
        outs = []
        # One SDPA per media item: joint attention over its t*h*w patches, none across items.
        for qi, ki, vi in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens)):
            o = F.scaled_dot_product_attention(qi.transpose(0, 1).unsqueeze(0), ki.transpose(0, 1).unsqueeze(0),
                                               vi.transpose(0, 1).unsqueeze(0))
            outs.append(o.squeeze(0).transpose(0, 1).reshape(qi.shape[0], self.qkv_hidden_size))
        return self.wo(torch.cat(outs, dim=0) if len(outs) > 1 else outs[0])

    def forward(self, x: torch.Tensor, angles: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), angles, seqlens)
        return x + self.mlp(self.norm1(x))


class MoonViT3dEncoder(nn.Module):
    def __init__(self, cfg: K3VisionConfig):
        super().__init__()
        self.head_dim = cfg.qkv_hidden_size // cfg.vt_num_attention_heads
        self.rope_theta = 10000.0
        self.blocks = nn.ModuleList(MoonViTEncoderLayer(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = nn.RMSNorm(cfg.vt_hidden_size)  # eps=None, see above

    def rope_angles(self, grids: list[tuple[int, int, int]], device) -> torch.Tensor:
        cache: dict[tuple[int, int], torch.Tensor] = {}
        parts = []
        for t, h, w in grids:
            a = cache.get((h, w))
            if a is None:
                a = cache[(h, w)] = rope_2d_angles(h, w, self.head_dim, self.rope_theta, device=device)
            parts.append(a.repeat(t, 1) if t > 1 else a)             # same spatial RoPE for every frame
        return torch.cat(parts, dim=0)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        angles = self.rope_angles(grids, x.device)
        seqlens = [t * h * w for t, h, w in grids]
        for blk in self.blocks:
            x = blk(x, angles, seqlens)
        return self.final_layernorm(x)


class MoonViTVisionTower(nn.Module):
    """MoonViT-V2 (`MoonViT3d`): patches → per-media-item merged features [(h/2)(w/2), 4·hidden].

    forward(pixel_values [L, 3, p, p], grid_thws [N, 3]) -> list of N tensors. Each media item is an image (t = 1) or a
    clip of t ≤ init_pos_emb_time frames; h and w (in patches) must be multiples of the merge kernel (2).
    """

    def __init__(self, cfg: K3VisionConfig):
        super().__init__()
        if cfg.merge_type != "sd2_tpool":
            raise NotImplementedError(f"merge_type={cfg.merge_type!r} (K3 uses 'sd2_tpool')")
        self.config = cfg
        self.merge_kernel_size = tuple(int(k) for k in cfg.merge_kernel_size)
        self.patch_embed = MoonVision3dPatchEmbed(cfg)
        self.encoder = MoonViT3dEncoder(cfg)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """From-scratch init: trunc-normal(0.02) conv/linear, RMSNorm weights 1, pos-emb N(0, 0.02)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=_INIT_STD, a=-2 * _INIT_STD, b=2 * _INIT_STD)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, Learnable2DInterpPosEmbDivided):
                m.reset_parameters()

    def check_grids(self, pixel_values: torch.Tensor, grid_thws) -> list[tuple[int, int, int]]:
        grids = _grid_list(grid_thws)
        kh, kw = self.merge_kernel_size
        bad = [g for g in grids if g[1] % kh or g[2] % kw]
        if bad:
            raise ValueError(f"grid_thws={grids}: h and w must be multiples of the merge kernel {kh}x{kw} "
                             f"(offending rows {bad})")
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but grid_thws={grids} implies {n}")
        return grids

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> list[torch.Tensor]:
        grids = self.check_grids(pixel_values, grid_thws)
        x = self.patch_embed(pixel_values, grids)
        x = self.encoder(x, grids)
        seqlens = [t * h * w for t, h, w in grids]
        return [sd2_tpool_merge(xi, t, h, w, self.merge_kernel_size)
                for xi, (t, h, w) in zip(x.split(seqlens), grids)]


class PatchMergerV2Projector(nn.Module):
    """`patchmergerv2`: post_norm(Linear(GELU_exact(Linear(x)))) from 4·mm_hidden to text_hidden (no biases)."""

    def __init__(self, cfg: K3VisionConfig):
        super().__init__()
        if cfg.mm_projector_type != "patchmergerv2":
            raise NotImplementedError(f"mm_projector_type={cfg.mm_projector_type!r} (K3 uses 'patchmergerv2')")
        if cfg.projector_hidden_act != "gelu":
            raise NotImplementedError(f"projector_hidden_act={cfg.projector_hidden_act!r} (K3 uses exact 'gelu')")
        kh, kw = (int(k) for k in cfg.merge_kernel_size)
        self.in_features = cfg.mm_hidden_size * kh * kw
        self.proj = nn.Sequential(
            nn.Linear(self.in_features, self.in_features, bias=False),
            nn.GELU(),                                                 # exact (erf) GELU, unlike the ViT's tanh
            nn.Linear(self.in_features, cfg.text_hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_ln_eps)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        for m in self.proj:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=_INIT_STD, a=-2 * _INIT_STD, b=2 * _INIT_STD)
        nn.init.ones_(self.post_norm.weight)

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        """Tensor [..., 4·mm_hidden] → [..., text_hidden]; a list of per-item tensors → a list (one batched matmul)."""
        if isinstance(x, torch.Tensor):
            if x.shape[-1] != self.in_features:
                raise ValueError(f"projector expects last dim {self.in_features}, got {tuple(x.shape)}")
            return self.post_norm(self.proj(x))
        items = list(x)
        if not items:
            return []
        lens = [f.shape[0] for f in items]
        out = self.forward(torch.cat([f.reshape(f.shape[0], -1) for f in items], dim=0))
        return list(out.split(lens))


def build_vision_modules(cfg: K3VisionConfig) -> tuple[MoonViTVisionTower, PatchMergerV2Projector]:
    """(vision_tower, mm_projector) for a `K3VisionConfig`."""
    return MoonViTVisionTower(cfg), PatchMergerV2Projector(cfg)


def vision_param_count(cfg: K3VisionConfig) -> int:
    """Closed-form parameter count of tower + projector (no biases)."""
    d, qkv, f, p = cfg.vt_hidden_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size, cfg.patch_size
    kh, kw = cfg.merge_kernel_size
    block = 3 * qkv * d + qkv * d + 2 * d + 2 * d * f
    tower = d * 3 * p * p + cfg.init_pos_emb_height * cfg.init_pos_emb_width * d + cfg.vt_num_hidden_layers * block + d
    m = cfg.mm_hidden_size * kh * kw
    return tower + m * m + m * cfg.text_hidden_size + cfg.text_hidden_size

