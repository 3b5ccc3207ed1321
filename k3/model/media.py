"""Media helpers for Kimi K3 (pure functions, no module state).

* `navit_resize` / `media_token_count` — the K3 image processor's NaViT size rule (`media_tokens_calculator`).
* `preprocess_image` / `preprocess_frames` / `preprocess_video` — tensors → patchified `pixel_values` + `grid_thws`
  for `MoonViTVisionTower`.
* `merge_media_embeddings` — expands every single `<|media_pad|>` placeholder into its media item's feature rows.

Processor facts (K3's `kimi_k3_vision_processing.py`, `_DEFAULT_MEDIA_PROC_CFG`; the same rule as Kimi-K2.5's
`media_utils.navit_resize_image`): patch 14, merge 2, in_patch_limit 65536 (= 256² patches, i.e. 3584×3584 px),
patch_limit_on_one_side 512, image_mean = image_std = (0.5, 0.5, 0.5) (pixels map to [-1, 1]).

    s = min(1, sqrt(in_patch_limit / (max(1, W // 14) * max(1, H // 14))), 512*14 / W, 512*14 / H)
    new_w, new_h = min(max(1, int(W * s)), 512*14), min(max(1, int(H * s)), 512*14)     # PIL bicubic resize
    pad right/bottom with 0 (black, *before* normalisation → -1 after) to multiples of 28
    tokens = ((new_h + pad_h) / 28) * ((new_w + pad_w) / 28)

so for images within the limit the count is ceil(W/28)·ceil(H/28) (611×437 → 352, 224×224 → 64, 1920×1080 → 2691).
The official processor is image-only; the video helpers here are our own (clips of ≤ 4 frames, see below).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "IMAGE_MEAN", "IMAGE_STD", "IN_PATCH_LIMIT", "PATCH_LIMIT_ON_ONE_SIDE",
    "navit_resize", "media_token_count", "preprocess_image", "preprocess_frames", "preprocess_video",
    "patchify", "merge_media_embeddings",
]

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
IN_PATCH_LIMIT = 65536
PATCH_LIMIT_ON_ONE_SIDE = 512
IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------------ size rule
def navit_resize(width: int, height: int, patch_size: int = 14, merge: int = 2,
                 in_patch_limit: int = IN_PATCH_LIMIT,
                 patch_limit_on_one_side: int = PATCH_LIMIT_ON_ONE_SIDE) -> dict[str, int]:
    """The K3 processor's resize/pad plan for a W×H image: new_width/new_height (resize target, never upscaled),
    pad_width/pad_height (right/bottom, to multiples of patch_size*merge), grid_h/grid_w (patches) and num_tokens."""
    width, height = int(width), int(height)
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    s1 = math.sqrt(in_patch_limit / (max(1.0, width // patch_size) * max(1.0, height // patch_size)))
    s2 = patch_limit_on_one_side * patch_size / width
    s3 = patch_limit_on_one_side * patch_size / height
    scale = min(1.0, s1, s2, s3)
    max_side = patch_limit_on_one_side * patch_size
    new_w = min(max(1, int(width * scale)), max_side)
    new_h = min(max(1, int(height * scale)), max_side)
    factor = merge * patch_size
    pad_w = (factor - new_w % factor) % factor
    pad_h = (factor - new_h % factor) % factor
    grid_h, grid_w = (new_h + pad_h) // patch_size, (new_w + pad_w) // patch_size
    if grid_h > patch_limit_on_one_side or grid_w > patch_limit_on_one_side:
        raise ValueError(f"{width}x{height} resizes to a {grid_h}x{grid_w} patch grid, over the one-side limit "
                         f"{patch_limit_on_one_side}")
    return {"new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h,
            "grid_h": grid_h, "grid_w": grid_w, "num_tokens": (grid_h // merge) * (grid_w // merge)}


def media_token_count(width: int, height: int, patch_size: int = 14, merge: int = 2,
                      in_patch_limit: int = IN_PATCH_LIMIT,
                      patch_limit_on_one_side: int = PATCH_LIMIT_ON_ONE_SIDE) -> int:
    """Number of LM positions one `<|media_pad|>` expands to for a W×H image (or one clip of such frames)."""
    return navit_resize(width, height, patch_size, merge, in_patch_limit, patch_limit_on_one_side)["num_tokens"]


# ------------------------------------------------------------------------------------------------ pixels
def _to_chw01(image: torch.Tensor, channels_last: bool | None) -> tuple[torch.Tensor, bool]:
    """→ (float32 [3, H, W] in [0, 255] if uint8 else [0, 1] scale, was_uint8)."""
    if not isinstance(image, torch.Tensor) or image.ndim != 3:
        raise ValueError(f"image must be a [3, H, W] or [H, W, 3] tensor, got "
                         f"{tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__}")
    if channels_last is None:
        if image.shape[0] == 3:
            channels_last = False                      # [3, H, W] wins when both dims are 3 (torch convention)
        elif image.shape[-1] == 3:
            channels_last = True
        else:
            raise ValueError(f"image must have 3 channels first or last, got shape {tuple(image.shape)}")
    if channels_last:
        image = image.permute(2, 0, 1)
    if image.shape[0] != 3:
        raise ValueError(f"expected 3 channels, got shape {tuple(image.shape)} (channels_last={channels_last})")
    is_u8 = image.dtype == torch.uint8
    if not (is_u8 or image.is_floating_point()):
        raise ValueError(f"image dtype must be uint8 or floating, got {image.dtype}")
    return image.float(), is_u8


def _resize(img: torch.Tensor, new_h: int, new_w: int, is_u8: bool) -> torch.Tensor:
    """Bicubic, antialiased downscale (the processor uses PIL BICUBIC on uint8; we round back to uint8 levels
    for uint8 input so the result stays on the same grid of values — close to, not bit-identical with, PIL)."""
    if tuple(img.shape[-2:]) == (new_h, new_w):
        return img
    out = F.interpolate(img.unsqueeze(0), size=(new_h, new_w), mode="bicubic", align_corners=False,
                        antialias=True).squeeze(0)
    return out.round().clamp(0, 255) if is_u8 else out.clamp(0, 1)


def patchify(frames: torch.Tensor, patch_size: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 3, H, W] (H, W multiples of patch_size) → pixel_values [T*h*w, 3, p, p] in (t, h, w) row-major order,
    grid_thw [1, 3] = (T, h, w)."""
    T, C, H, W = frames.shape
    if H % patch_size or W % patch_size:
        raise ValueError(f"frame size {H}x{W} is not a multiple of patch_size={patch_size}")
    h, w = H // patch_size, W // patch_size
    pv = frames.reshape(T, C, h, patch_size, w, patch_size).permute(0, 2, 4, 1, 3, 5)
    return pv.reshape(T * h * w, C, patch_size, patch_size).contiguous(), torch.tensor([[T, h, w]], dtype=torch.long)


def _prepare_frame(image: torch.Tensor, plan: dict[str, int], channels_last: bool | None,
                   mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    img, is_u8 = _to_chw01(image, channels_last)
    img = _resize(img, plan["new_height"], plan["new_width"], is_u8)
    if is_u8:
        img = img / 255.0
    # Pad with black *before* normalising, as the processor does (padded pixels end up at (0 - mean) / std).
    img = F.pad(img, (0, plan["pad_width"], 0, plan["pad_height"]), value=0.0)
    m = torch.tensor(mean, dtype=img.dtype).view(3, 1, 1)
    s = torch.tensor(std, dtype=img.dtype).view(3, 1, 1)
    return (img - m) / s


def preprocess_image(image: torch.Tensor, *, patch_size: int = 14, merge: int = 2,
                     in_patch_limit: int = IN_PATCH_LIMIT, patch_limit_on_one_side: int = PATCH_LIMIT_ON_ONE_SIDE,
                     mean: Sequence[float] = IMAGE_MEAN, std: Sequence[float] = IMAGE_STD,
                     channels_last: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One RGB image → (pixel_values [h*w, 3, p, p] float32, grid_thw [1, 3] = (1, h, w)).

    `image`: uint8 (0..255) or float (assumed already in [0, 1]) tensor, [3, H, W] or [H, W, 3] (auto-detected;
    pass `channels_last` when ambiguous). Steps: NaViT downscale (only past 65536 patches or 512 patches a side),
    right/bottom black pad to multiples of 28, normalise with mean = std = 0.5, patchify row-major.
    The resulting h*w/4 equals `media_token_count(W, H)`.
    """
    H, W = _hw(image, channels_last)
    plan = navit_resize(W, H, patch_size, merge, in_patch_limit, patch_limit_on_one_side)
    frame = _prepare_frame(image, plan, channels_last, mean, std)
    return patchify(frame.unsqueeze(0), patch_size)


def _hw(image: torch.Tensor, channels_last: bool | None) -> tuple[int, int]:
    if not isinstance(image, torch.Tensor) or image.ndim != 3:
        raise ValueError("image must be a 3-D tensor")
    cl = channels_last if channels_last is not None else (image.shape[0] != 3 and image.shape[-1] == 3)
    return (int(image.shape[0]), int(image.shape[1])) if cl else (int(image.shape[1]), int(image.shape[2]))


def preprocess_frames(frames: torch.Tensor | Sequence[torch.Tensor], *, max_frames: int = 4, patch_size: int = 14,
                      merge: int = 2, in_patch_limit: int = IN_PATCH_LIMIT,
                      patch_limit_on_one_side: int = PATCH_LIMIT_ON_ONE_SIDE, mean: Sequence[float] = IMAGE_MEAN,
                      std: Sequence[float] = IMAGE_STD,
                      channels_last: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A clip of 1 ≤ T ≤ max_frames same-size frames → ONE media item (pixel_values [T*h*w, 3, p, p], grid [1, 3]).

    `frames`: [T, 3, H, W] / [T, H, W, 3] tensor or a list of per-frame tensors. Every frame gets the image size
    rule of the first frame (the official K3 processor is image-only; Kimi-K2.5 used a smaller per-frame budget for
    video — pass `in_patch_limit` to reproduce such a budget). The tower pools the T frames into one set of
    (h/2)(w/2) tokens, so a clip costs as many LM positions as one frame.
    """
    seq = list(frames.unbind(0)) if isinstance(frames, torch.Tensor) else list(frames)
    if not 1 <= len(seq) <= max_frames:
        raise ValueError(f"a clip holds 1..{max_frames} frames, got {len(seq)}; use preprocess_video to split")
    H, W = _hw(seq[0], channels_last)
    if any(_hw(f, channels_last) != (H, W) for f in seq):
        raise ValueError(f"all frames of a clip must share one size, got {[_hw(f, channels_last) for f in seq]}")
    plan = navit_resize(W, H, patch_size, merge, in_patch_limit, patch_limit_on_one_side)
    clip = torch.stack([_prepare_frame(f, plan, channels_last, mean, std) for f in seq])
    return patchify(clip, patch_size)


def preprocess_video(frames: torch.Tensor | Sequence[torch.Tensor], *, clip_len: int = 4,
                     **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Any number of frames → clips of ≤ clip_len (= init_pos_emb_time = 4) frames, each its own media item:
    (pixel_values [Σ t*h*w, 3, p, p], grid_thws [n_clips, 3]). Each clip needs its own placeholder in the text."""
    seq = list(frames.unbind(0)) if isinstance(frames, torch.Tensor) else list(frames)
    if not seq:
        raise ValueError("preprocess_video needs at least one frame")
    pvs, grids = [], []
    for i in range(0, len(seq), clip_len):
        pv, g = preprocess_frames(seq[i:i + clip_len], max_frames=clip_len, **kwargs)
        pvs.append(pv)
        grids.append(g)
    return torch.cat(pvs), torch.cat(grids)


# ------------------------------------------------------------------------------------------------ LM merge
def merge_media_embeddings(input_ids: torch.Tensor, inputs_embeds: torch.Tensor,
                           media_features: Sequence[torch.Tensor], placeholder_id: int,
                           attention_mask: torch.Tensor | None = None,
                           labels: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    """Expand each single placeholder token into its media item's whole feature block.

    Media items are consumed in reading order across the batch (row 0 left to right, then row 1, ...). Rows that
    end up shorter than the longest are LEFT-padded (embeds 0, attention_mask 0, labels -100). Media positions get
    label -100 and the placeholder's attention-mask value. Differentiable w.r.t. inputs_embeds and media_features
    (one gather from [embeds; features; 0]).

    Returns {"inputs_embeds" [B, T', D], "attention_mask" [B, T'], "labels" [B, T'] or None,
             "media_mask" [B, T'] bool (True on media rows)}.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if inputs_embeds.ndim != 3 or tuple(inputs_embeds.shape[:2]) != (B, T):
        raise ValueError(f"inputs_embeds must be [B, T, D] = [{B}, {T}, D], got {tuple(inputs_embeds.shape)}")
    D = inputs_embeds.shape[-1]
    feats = list(media_features)
    for i, f in enumerate(feats):
        if f.ndim != 2 or f.shape[-1] != D:
            raise ValueError(f"media_features[{i}] must be [n_i, {D}], got {tuple(f.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"attention_mask must be [{B}, {T}], got {tuple(attention_mask.shape)}")
    if labels is not None and tuple(labels.shape) != (B, T):
        raise ValueError(f"labels must be [{B}, {T}], got {tuple(labels.shape)}")

    device = inputs_embeds.device
    is_ph = input_ids == placeholder_id
    n_ph = int(is_ph.sum())
    if n_ph != len(feats):
        raise ValueError(f"{n_ph} placeholder tokens (id {placeholder_id}) in input_ids "
                         f"(per row {is_ph.sum(1).tolist()}) but {len(feats)} media items in media_features")

    sizes = torch.tensor([f.shape[0] for f in feats], dtype=torch.long, device=device)
    # item index of every placeholder, in row-major (reading) order
    item_of = (is_ph.flatten().long().cumsum(0) - 1).view(B, T)
    tok_len = torch.ones(B, T, dtype=torch.long, device=device)
    if n_ph:
        tok_len = torch.where(is_ph, sizes[item_of.clamp(min=0)], tok_len)
    row_len = tok_len.sum(1)
    T_new = int(row_len.max()) if B else 0
    start = tok_len.cumsum(1) - tok_len + (T_new - row_len)[:, None]  # first output slot of every input token

    n_feat = int(sizes.sum()) if n_ph else 0
    zero_row = B * T + n_feat
    src = torch.full((B, T_new), zero_row, dtype=torch.long, device=device)
    mask_src = torch.zeros(B, T_new, dtype=torch.long, device=device)
    media = torch.zeros(B, T_new, dtype=torch.bool, device=device)
    am = attention_mask.long() if attention_mask is not None else torch.ones(B, T, dtype=torch.long, device=device)

    tb, tt = torch.nonzero(~is_ph, as_tuple=True)                   # text tokens: one slot each
    src[tb, start[tb, tt]] = tb * T + tt
    mask_src[tb, start[tb, tt]] = am[tb, tt]
    if n_feat:
        pb, pt = torch.nonzero(is_ph, as_tuple=True)                # placeholders, reading order == item order
        item = torch.repeat_interleave(torch.arange(n_ph, device=device), sizes)
        offs = sizes.cumsum(0) - sizes
        within = torch.arange(n_feat, device=device) - offs[item]
        rb, rt = pb[item], start[pb, pt][item] + within
        src[rb, rt] = B * T + torch.arange(n_feat, device=device)
        mask_src[rb, rt] = am[pb, pt][item]
        media[rb, rt] = True

    parts = [inputs_embeds.reshape(B * T, D)]
    if n_feat:
        parts.append(torch.cat([f.to(inputs_embeds.dtype) for f in feats], dim=0))
    parts.append(inputs_embeds.new_zeros(1, D))
    table = torch.cat(parts, dim=0)
    out_embeds = table[src.flatten()].view(B, T_new, D)

    out_mask = mask_src
    if attention_mask is not None:
        out_mask = out_mask.to(attention_mask.dtype)
    out_labels = None
    if labels is not None:
        out_labels = torch.full((B, T_new), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
        out_labels[tb, start[tb, tt]] = labels[tb, tt]
    return {"inputs_embeds": out_embeds, "attention_mask": out_mask, "labels": out_labels, "media_mask": media}
