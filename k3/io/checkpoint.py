"""Checkpoint I/O in the exact Hugging Face layout of the released Kimi-K3 checkpoint.

On disk: `config.json`, `model-XXXXX-of-YYYYY.safetensors` shards and `model.safetensors.index.json`
(a single `model.safetensors` loads too). Routed experts are written per expert as
`experts.{e}.w{1,2,3}.weight`, or MXFP4 `.weight_packed` / `.weight_scale` when the config's
quantization_config says `mxfp4-pack-quantized`; on load the format is decided per tensor by which
keys exist. Inside the model the experts are stacked; this module is the only place that remaps.

Loading validates every shard header, key, shape and dtype *before* copying any data, then streams
shard by shard into the (already allocated) model, so there are never two copies of the weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .._atomic import replace_dir
from ..config import K3Config
from .mxfp4 import mxfp4_pack, mxfp4_unpack

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<w>w[123])$")
_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.(?P<kind>weight|weight_packed|weight_scale)$")
# Tensors the release stores in fp32 whatever the model dtype (checkpoint.md §2.8).
FP32_SUFFIXES = ("A_log", "dt_bias", "o_norm.weight", "conv1d.weight", "e_score_correction_bias")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
           "F64": torch.float64, "I64": torch.int64}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor and the file."""


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


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
            mxfp4: bool) -> Iterator[tuple[str, tuple, torch.dtype, int | None, str]]:
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
    from ..model.k3 import K3ForConditionalGeneration
    with torch.device("meta"):
        return K3ForConditionalGeneration(config, init=False)  # shapes only: no (slow on meta) init


def checkpoint_tensors(config: K3Config, dtype: torch.dtype | str | None = None,
                       experts_format: str | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor `save_pretrained` writes for `config`: {key: (shape, dtype)}; no weights allocated.

    dtype: the model dtype (default: the config's `dtype`); experts_format: "mxfp4" or "dense"
    (default: MXFP4 exactly when the config's quantization_config says so).
    """
    mdtype = _dtype(dtype or config.dtype)
    mx = _experts_mxfp4(config, experts_format)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, t in _meta_model(config).state_dict().items():
        for key, shape, dt, _, _ in _expand(name, tuple(t.shape), _storage_dtype(name, mdtype), mx):
            out[key] = ((a_log_length(config),) if _is_a_log(name) else shape, dt)
    return out


def _experts_mxfp4(config: K3Config, experts_format: str | None) -> bool:
    if experts_format is None:
        return config.text_config.routed_experts_mxfp4
    if experts_format not in ("mxfp4", "dense"):
        raise ValueError(f"experts_format must be 'mxfp4' or 'dense', got {experts_format!r}")
    return experts_format == "mxfp4"


# ---- save --------------------------------------------------------------------------------------
def _iter_checkpoint(model, mdtype: torch.dtype, mxfp4: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in model.state_dict().items():
        t = t.detach()
        for key, _, dt, e, kind in _expand(name, tuple(t.shape), _storage_dtype(name, mdtype), mxfp4):
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
    """Write config.json, safetensors shards and the index. Written to a temporary folder and moved into
    place at the end, so an interrupted save never leaves a half-written checkpoint behind."""
    config: K3Config = model.config
    if any(getattr(m, "expert_parallel", None) is not None for m in model.modules()):
        raise ValueError("save_pretrained: the model runs expert parallel and holds only this rank's experts; "
                         "save inside `k3.dist.moonep.gathered_experts(model)` (a collective) instead")
    mdtype = _dtype(dtype) if dtype is not None else next(
        p.dtype for n, p in model.named_parameters() if not n.endswith(FP32_SUFFIXES))
    mx = _experts_mxfp4(config, experts_format)
    limit = _parse_size(max_shard_size)
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        files: list[tuple[Path, list[str]]] = []  # (temporary shard path, its keys)
        current: dict[str, torch.Tensor] = {}
        size = 0

        def flush():
            path = tmp / f"shard-{len(files):05d}.safetensors"
            save_file(current, str(path), metadata={"format": "pt"})
            files.append((path, list(current)))

        total = 0  # the index's total_size: tensor bytes only, as the release counts (no file headers)
        for key, t in _iter_checkpoint(model, mdtype, mx):
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > limit:
                flush()
                current, size = {}, 0
            current[key] = t
            size += nbytes
            total += nbytes
        if current:
            flush()
        n = len(files)
        weight_map = {}
        for i, (path, ks) in enumerate(files, start=1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(tmp / name)
            for k in ks:
                weight_map[k] = name
        cfg = K3Config.from_dict(config.to_dict())
        cfg.dtype = str(mdtype).removeprefix("torch.")
        if mx and not cfg.text_config.routed_experts_mxfp4:
            raise ValueError("experts_format='mxfp4' needs a quantization_config in the config (as the release has)")
        if not mx:
            cfg.text_config.quantization_config = None
        cfg.save_pretrained(tmp)
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
        replace_dir(tmp, final)  # fsync'd, then swapped in: a kill leaves the old or the new folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _parse_size(s: int | str) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", s.upper())
    if not m:
        raise ValueError(f"bad max_shard_size {s!r}; use bytes or e.g. '5GB', '500MB'")
    return int(float(m[1]) * 1000 ** " KMGT".index(m[2] or " "))


# ---- load --------------------------------------------------------------------------------------
def _shard_files(directory: Path) -> dict[str, list[str]]:
    """{file: [keys]} from the index (or the single unsharded file)."""
    idx = directory / INDEX_NAME
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{idx} is not a valid safetensors index: {e}") from None
        files: dict[str, list[str]] = {}
        for k, f in wm.items():
            files.setdefault(f, []).append(k)
        return files
    single = directory / SINGLE_NAME
    if single.is_file():
        return {SINGLE_NAME: None}  # keys read from the header
    raise FileNotFoundError(f"no {INDEX_NAME} or {SINGLE_NAME} in {directory}")


def _read_headers(directory: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """{key: (file, shape, dtype)} from every shard header; fails naming a missing or corrupt file."""
    table = {}
    for f, listed in _shard_files(directory).items():
        path = directory / f
        if not path.is_file():
            raise CheckpointError(f"shard {f} listed in the index is missing from {directory}")
        try:
            with safe_open(str(path), framework="pt") as h:
                keys = list(h.keys())
                for k in keys:
                    sl = h.get_slice(k)
                    table[k] = (f, tuple(sl.get_shape()), sl.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for bad headers / truncation
            raise CheckpointError(f"corrupt shard {path}: {e}") from None
        if listed is not None:
            miss = sorted(set(listed) - set(keys))
            if miss:
                raise CheckpointError(f"tensor {miss[0]} is listed in the index for {f} but not stored in it "
                                      f"({len(miss)} such)")
    return table


def load_pretrained(directory: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: str | torch.device = "cpu"):
    """Build the model from `directory` (config.json + safetensors) and load its weights.

    dtype defaults to the config's `dtype`; the release's fp32 tensors (A_log, dt_bias, o_norm, convs,
    router bias) stay fp32. Raises CheckpointError (naming tensor and file) before touching any weight if
    a key is missing or unexpected, a shape or dtype is wrong, or a shard is corrupt.
    """
    from ..model.k3 import K3ForConditionalGeneration

    directory = Path(directory)
    config = K3Config.from_pretrained(directory)
    mdtype = _dtype(dtype or config.dtype)
    header = _read_headers(directory)

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
        expected[key] = (key, None, (text.vocab_size, text.hidden_size),
                         ("BF16", "F16", "F32"))
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
        by_file.setdefault(f, []).append(key)
    with torch.no_grad():
        for f in sorted(by_file):
            with safe_open(str(directory / f), framework="pt", device="cpu") as h:
                for key in by_file[f]:
                    name, e, _, _ = expected[key]
                    if key.endswith("weight_scale"):
                        continue  # consumed with its weight_packed
                    t = h.get_tensor(key)
                    if key.endswith("weight_packed"):
                        sk = key.replace("weight_packed", "weight_scale")
                        sf = header[sk][0]
                        if sf == f:
                            s = h.get_tensor(sk)
                        else:
                            with safe_open(str(directory / sf), framework="pt", device="cpu") as h2:
                                s = h2.get_tensor(sk)
                        t = mxfp4_unpack(t, s, dtype=torch.float32)
                    dst = state[name] if e is None else state[name][e]
                    if _is_a_log(name):
                        _load_a_log(dst, t, H, f"tensor {key} in {directory / f}")
                    else:
                        dst.copy_(t.to(dst.dtype))
                    del t
    return model


def _load_a_log(dst: torch.Tensor, t: torch.Tensor, H: int, where: str) -> None:
    """Stored A_log [L ≥ H] → the model's padded parameter: the first H entries, zeros after; the stored
    tail must be zero (a non-zero tail means the file does not follow the format)."""
    tail = t[H:]
    if tail.numel() and tail.abs().max().item() != 0:
        raise CheckpointError(f"{where}: entries past num_heads={H} must be 0 (found max |x| = "
                              f"{tail.abs().max().item():g} among {tail.numel()} padding entries)")
    dst.zero_()
    dst[:H].copy_(t[:H].to(dst.dtype))
