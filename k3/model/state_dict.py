"""The model's state-dict adapter: the module tree's state dict ↔ the released Kimi-K3 checkpoint layout.

The model owns what the names and tensors mean; `k3.io.checkpoint` only moves bytes (safetensors shards,
index, headers) and `k3.io.mxfp4` packs codes. Here:
- names: the model's state-dict keys are the release's, except that routed experts are stacked inside the
  module (`….experts.w{1,2,3}` [E, out, in]) and written per expert as `….experts.{e}.w{1,2,3}.weight`,
  or MXFP4 `.weight_packed` / `.weight_scale` when the config's quantization_config says
  `mxfp4-pack-quantized` (on load the format is decided per tensor by which keys exist);
- fp32 parameters: `FP32_SUFFIXES` stay fp32 whatever the model dtype (checkpoint.md §2.8);
- KDA `A_log` is stored padded to `a_log_length(config)` entries with a zero tail.

Loading validates every shard header, key, shape and dtype *before* copying any data, then streams shard by
shard into the (already allocated) model, so there are never two copies of the weights.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from ..config import K3Config
from ..io.checkpoint import CheckpointError, iter_shard_tensors, parse_dtype, read_headers, write_sharded
from ..io.mxfp4 import mxfp4_pack, mxfp4_unpack

__all__ = ["FP32_SUFFIXES", "a_log_length", "checkpoint_tensors", "hf_tensors", "load_pretrained",
           "save_pretrained"]

_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<w>w[123])$")
# Tensors the release stores in fp32 whatever the model dtype (checkpoint.md §2.8).
FP32_SUFFIXES = ("A_log", "dt_bias", "o_norm.weight", "conv1d.weight", "e_score_correction_bias")


def _storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_SUFFIXES) else model_dtype


# ---- A_log padding -----------------------------------------------------------------------------
def a_log_length(config: K3Config) -> int:
    """Entries of the stored KDA `A_log`: the official modeling code keeps it at head_dim entries, the first
    num_heads used (one per head) and the rest zero (the release: 96 heads, head_dim 128 → [128]); never
    fewer than num_heads. Loading accepts any length ≥ num_heads whose tail is zero."""
    la = config.text_config.linear_attn_config
    return max(la.num_heads, la.head_dim)


def _is_a_log(name: str) -> bool:
    return name.endswith("self_attn.A_log")


def _a_log_to_disk(name: str, t: torch.Tensor, config: K3Config) -> torch.Tensor:
    """The model's A_log (any padding) as the official [a_log_length] tensor; a non-zero tail is an error."""
    H = config.text_config.linear_attn_config.num_heads
    tail = t[H:]
    if tail.numel() and tail.abs().max().item() != 0:
        raise CheckpointError(f"tensor {name}: entries past num_heads={H} must be 0 (found max |x| = "
                              f"{tail.abs().max().item():g}); the checkpoint format has no room for them")
    out = torch.zeros(a_log_length(config), dtype=torch.float32)
    out[:H] = t[:H].float().cpu()
    return out


def _load_a_log(dst: torch.Tensor, t: torch.Tensor, H: int, where: str) -> None:
    """Stored A_log [L ≥ H] → the model's padded parameter: the first H entries, zeros after; the stored
    tail must be zero (a non-zero tail means the file does not follow the format)."""
    tail = t[H:]
    if tail.numel() and tail.abs().max().item() != 0:
        raise CheckpointError(f"{where}: entries past num_heads={H} must be 0 (found max |x| = "
                              f"{tail.abs().max().item():g} among {tail.numel()} padding entries)")
    dst.zero_()
    dst[:H].copy_(t[:H].to(dst.dtype))


_MTP_HEAD = re.compile(r"^language_model\.model\.layers\.(?P<i>\d+)\.shared_head\.head\.weight$")


def _mtp_head_layer(key: str, config: K3Config) -> int | None:
    """The MTP layer index of an optional `shared_head.head.weight` key (vLLM loads it when present)."""
    m = _MTP_HEAD.match(key)
    t = config.text_config
    if m and t.num_hidden_layers <= int(m["i"]) < t.num_hidden_layers + t.num_nextn_predict_layers:
        return int(m["i"])
    return None


# ---- name/shape table --------------------------------------------------------------------------
def _expert_entries(base: str, e: int, out: int, inp: int, dtype: torch.dtype, mxfp4: bool):
    """The checkpoint tensors of one routed expert matrix `{base}` = `...experts.{e}.w{1,2,3}`."""
    if mxfp4:
        yield f"{base}.weight_packed", (out, inp // 2), torch.uint8, e, "weight_packed"
        yield f"{base}.weight_scale", (out, inp // 32), torch.uint8, e, "weight_scale"
    else:
        yield f"{base}.weight", (out, inp), dtype, e, "weight"


def _expand(name: str, shape: tuple[int, ...], dtype: torch.dtype,
            mxfp4) -> Iterator[tuple[str, tuple, torch.dtype, int | None, str]]:
    """Model state-dict entry → checkpoint entries (key, shape, dtype, expert index, kind).

    `mxfp4` is a bool, or a predicate on the expert's key base (loading decides per tensor)."""
    m = _EXPERTS.match(name)
    if not m:
        yield name, tuple(shape), dtype, None, "weight"
        return
    E, out, inp = shape
    for e in range(E):
        base = f"{m['prefix']}.{e}.{m['w']}"
        yield from _expert_entries(base, e, out, inp, dtype, mxfp4(base) if callable(mxfp4) else mxfp4)


def _meta_model(config: K3Config):
    from .k3 import K3ForConditionalGeneration
    with torch.device("meta"):
        return K3ForConditionalGeneration(config, init=False)  # shapes only: no (slow on meta) init


def _experts_mxfp4(config: K3Config, experts_format: str | None) -> bool:
    if experts_format is None:
        return config.text_config.routed_experts_mxfp4
    if experts_format not in ("mxfp4", "dense"):
        raise ValueError(f"experts_format must be 'mxfp4' or 'dense', got {experts_format!r}")
    return experts_format == "mxfp4"


def checkpoint_tensors(config: K3Config, dtype: torch.dtype | str | None = None,
                       experts_format: str | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor `save_pretrained` writes for `config`: {key: (shape, dtype)}; no weights allocated.

    dtype: the model dtype (default: the config's `dtype`); experts_format: "mxfp4" or "dense"
    (default: MXFP4 exactly when the config's quantization_config says so).
    """
    mdtype = parse_dtype(dtype or config.dtype)
    mx = _experts_mxfp4(config, experts_format)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, t in _meta_model(config).state_dict().items():
        for key, shape, dt, _, _ in _expand(name, tuple(t.shape), _storage_dtype(name, mdtype), mx):
            out[key] = ((a_log_length(config),) if _is_a_log(name) else shape, dt)
    return out


# ---- save --------------------------------------------------------------------------------------
def hf_tensors(model, dtype: torch.dtype, mxfp4: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict in the release layout: (checkpoint key, CPU tensor), one expert at a time."""
    for name, t in model.state_dict().items():
        t = t.detach()
        for key, _, dt, e, kind in _expand(name, tuple(t.shape), _storage_dtype(name, dtype), mxfp4):
            if _is_a_log(name):
                yield key, _a_log_to_disk(key, t, model.config)
            elif e is None:
                yield key, t.to(dt).contiguous().cpu()
            elif kind == "weight":
                yield key, t[e].to(dt).cpu().clone()
            elif kind == "weight_packed":
                packed, scale = mxfp4_pack(t[e].float())
                yield key, packed.cpu()
                yield key.replace("weight_packed", "weight_scale"), scale.cpu()


def save_pretrained(model, directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | str | None = None, experts_format: str | None = None) -> Path:
    """Write config.json, safetensors shards and the index (atomically, see `k3.io.checkpoint.write_sharded`)."""
    config: K3Config = model.config
    if any(getattr(m, "expert_parallel", None) is not None for m in model.modules()):
        raise ValueError("save_pretrained: the model runs expert parallel and holds only this rank's experts; "
                         "save inside `k3.parallel.moonep.gathered_experts(model)` (a collective) instead")
    mdtype = parse_dtype(dtype) if dtype is not None else next(
        p.dtype for n, p in model.named_parameters() if not n.endswith(FP32_SUFFIXES))
    mx = _experts_mxfp4(config, experts_format)
    cfg = K3Config.from_dict(config.to_dict())
    cfg.dtype = str(mdtype).removeprefix("torch.")
    if mx and not cfg.text_config.routed_experts_mxfp4:
        raise ValueError("experts_format='mxfp4' needs a quantization_config in the config (as the release has)")
    if not mx:
        cfg.text_config.quantization_config = None
    return write_sharded(hf_tensors(model, mdtype, mx), directory, max_shard_size, write_extra=cfg.save_pretrained)


# ---- load --------------------------------------------------------------------------------------
def load_pretrained(directory: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: str | torch.device = "cpu"):
    """Build the model from `directory` (config.json + safetensors) and load its weights.

    dtype defaults to the config's `dtype`; the release's fp32 tensors (A_log, dt_bias, o_norm, convs,
    router bias) stay fp32. Raises CheckpointError (naming tensor and file) before touching any weight if
    a key is missing or unexpected, a shape or dtype is wrong, or a shard is corrupt.
    """
    from .k3 import K3ForConditionalGeneration

    directory = Path(directory)
    config = K3Config.from_pretrained(directory)
    mdtype = parse_dtype(dtype or config.dtype)
    header = read_headers(directory)

    # map every checkpoint key to (model name, expert index, kind) and validate shapes up front
    expected = {}
    meta = _meta_model(config).state_dict()
    packed = lambda base: f"{base}.weight_packed" in header or f"{base}.weight_scale" in header  # noqa: E731
    for name, t in meta.items():
        for key, shape, dt, e, _ in _expand(name, tuple(t.shape), mdtype, packed):
            expected[key] = (name, e, shape, ("U8",) if dt == torch.uint8 else ("BF16", "F16", "F32"))
    text = config.text_config
    H = text.linear_attn_config.num_heads
    heads = {key: i for key in header if (i := _mtp_head_layer(key, config)) is not None}
    for key, i in heads.items():   # optional per-MTP-layer output head (else the MTP layer uses lm_head)
        expected[key] = (key, None, (text.vocab_size, text.hidden_size), ("BF16", "F16", "F32"))
    missing = sorted(set(expected) - set(header))
    if missing:
        raise CheckpointError(f"checkpoint in {directory} lacks tensor {missing[0]} ({len(missing)} missing)")
    unexpected = sorted(set(header) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} in {header[unexpected[0]][0]} "
                              f"({len(unexpected)} not used by this config)")
    for key, (name, e, shape, dts) in expected.items():
        f, hshape, hdt = header[key]
        if _is_a_log(name):
            if len(hshape) != 1 or hshape[0] < H:
                raise CheckpointError(f"tensor {key} in {f} has shape {list(hshape)}, expected [L] with L >= "
                                      f"num_heads={H} (the first {H} entries used, the rest zero)")
        elif hshape != shape:
            raise CheckpointError(f"tensor {key} in {f} has shape {list(hshape)}, the config needs {list(shape)}")
        if hdt not in dts:
            raise CheckpointError(f"tensor {key} in {f} has dtype {hdt}, expected one of {list(dts)}")

    # allocate once, then stream shard by shard
    prev = torch.get_default_dtype()
    try:  # build directly in the target dtype: no transient fp32 copy of a bf16 model
        torch.set_default_dtype(mdtype if mdtype.is_floating_point else prev)
        with torch.device(device):
            model = K3ForConditionalGeneration(config, init=False, dtype=mdtype)
    finally:
        torch.set_default_dtype(prev)
    for key, i in heads.items():
        sh = model.language_model.model.layers[i].shared_head
        if getattr(sh, "head", None) is None:
            with torch.device(device):
                sh.head = torch.nn.Linear(text.hidden_size, text.vocab_size, bias=False, dtype=mdtype)
    state = model.state_dict(keep_vars=True)
    by_file: dict[str, list[str]] = {}
    for key, (f, _, _) in header.items():
        if not key.endswith("weight_scale"):  # consumed with its weight_packed
            by_file.setdefault(f, []).append(key)
    with torch.no_grad():
        for f, key, read in iter_shard_tensors(directory, by_file, header):
            name, e, _, _ = expected[key]
            t = read(key)
            if key.endswith("weight_packed"):
                t = mxfp4_unpack(t, read(key.replace("weight_packed", "weight_scale")), dtype=torch.float32)
            dst = state[name] if e is None else state[name][e]
            if _is_a_log(name):
                _load_a_log(dst, t, H, f"tensor {key} in {directory / f}")
            else:
                dst.copy_(t.to(dst.dtype))
            del t
    return model
