"""Crash-safe writes of state files: the one helper every state file of the project goes through.

`atomic_write(path, data)` writes a temporary file in the same directory, fsyncs it, renames it over `path`
and fsyncs the directory, so after a crash or kill at any instant `path` holds either the old or the new
complete content, never a mix (and the rename itself survives a power cut). `replace_dir` does the same for a
directory built aside (a checkpoint). Temporary names start with '.' and end with '.tmp'.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

Writer = Callable[[BinaryIO], None]


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (renames, creations) to disk; a no-op where directories cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every regular file and directory under `path` (and `path` itself)."""
    root = Path(path)
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(dirpath)


def atomic_write(path: str | os.PathLike, data: bytes | str | Writer, mode: int | None = None) -> Path:
    """Replace `path` with `data` (bytes; str is UTF-8; a callable gets the open binary file and writes to it)
    all at once: temp file + fsync + rename + directory fsync. `mode`: the file's permission bits (default:
    what mkstemp gives, 0600). On any error the temp file is removed and `path` is untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any, **dumps_kw: Any) -> Path:
    """`atomic_write` of `json.dumps(obj, **dumps_kw)` (NaN/Infinity refused: they are not JSON)."""
    dumps_kw.setdefault("allow_nan", False)
    return atomic_write(path, json.dumps(obj, **dumps_kw))


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Move the finished directory `src` to `dst` (same filesystem) after flushing everything in it. An existing
    `dst` is swapped out first and removed only once `src` is in its place, so a kill leaves either the old or the
    new directory at `dst` (or, in the instant between the two renames, the old one beside it as `.<name>.old.tmp`)."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():  # checked before dst is touched
        raise FileNotFoundError(f"replace_dir: {str(src)!r} is not a directory")
    fsync_tree(src)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old.tmp")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dst
