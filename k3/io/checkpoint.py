"""Safetensors checkpoint files: sharded writing (atomic), header reading and validation, tensor reading.

On disk: `model-XXXXX-of-YYYYY.safetensors` shards and `model.safetensors.index.json` (a single
`model.safetensors` loads too), plus whatever the caller writes beside them (config.json). This module knows
bytes, shards and dtypes only: which keys a K3 model has, how stacked experts map to per-expert tensors and
which tensors stay fp32 is the model's state-dict adapter (`k3.model.state_dict`), so `io` never imports
`model`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .._atomic import replace_dir

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
           "F64": torch.float64, "I64": torch.int64}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor and the file."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a torch dtype, a config name ("bfloat16") or a safetensors name ("BF16")."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def parse_size(s: int | str) -> int:
    """Bytes from an int or a string such as '5GB' / '500MB' / '200KB' (decimal units, as HF counts)."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", s.upper())
    if not m:
        raise ValueError(f"bad max_shard_size {s!r}; use bytes or e.g. '5GB', '500MB'")
    return int(float(m[1]) * 1000 ** " KMGT".index(m[2] or " "))


# ---- write -------------------------------------------------------------------------------------
def write_sharded(tensors: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike,
                  max_shard_size: int | str = "5GB", write_extra: Callable[[Path], None] | None = None) -> Path:
    """Write (key, CPU tensor) pairs as safetensors shards of at most `max_shard_size` bytes (a tensor larger
    than that gets a shard of its own) plus the index; `write_extra(folder)` adds other files (config.json).
    Everything goes to a temporary folder that replaces `directory` at the end, so an interrupted save never
    leaves a half-written checkpoint behind. Tensors are consumed one shard at a time."""
    limit = parse_size(max_shard_size)
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
        for key, t in tensors:
            if key in current or any(key in ks for _, ks in files):
                raise ValueError(f"write_sharded: tensor {key} given twice")
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
        if write_extra is not None:
            write_extra(tmp)
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
        replace_dir(tmp, final)  # fsync'd, then swapped in: a kill leaves the old or the new folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ---- read --------------------------------------------------------------------------------------
def shard_files(directory: str | os.PathLike) -> dict[str, list[str] | None]:
    """{file: [keys]} from the index, or {model.safetensors: None} for a single unsharded file."""
    directory = Path(directory)
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


def read_headers(directory: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """{key: (file, shape, safetensors dtype)} from every shard header, no tensor data read; fails naming a
    missing or corrupt file, or a key the index lists but the shard lacks."""
    directory = Path(directory)
    table = {}
    for f, listed in shard_files(directory).items():
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


def iter_shard_tensors(directory: str | os.PathLike, keys_by_file: dict[str, list[str]],
                       header: dict[str, tuple[str, tuple[int, ...], str]]):
    """Yield (file, key, read) shard by shard (files in sorted order, each opened once): `read(k)` returns
    tensor `k` on the CPU, from the open shard when it lives there, else from its own file (per `header`,
    as `read_headers` gives it), so a caller can read a key together with a companion (MXFP4 scales)."""
    directory = Path(directory)
    for f in sorted(keys_by_file):
        with safe_open(str(directory / f), framework="pt", device="cpu") as h:
            def read(k: str, h=h, f=f) -> torch.Tensor:
                if header[k][0] == f:
                    return h.get_tensor(k)
                with safe_open(str(directory / header[k][0]), framework="pt", device="cpu") as h2:
                    return h2.get_tensor(k)
            for key in keys_by_file[f]:
                yield f, key, read
