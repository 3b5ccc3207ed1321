"""The built-in corpus: text that exists on every machine with Python, so training needs no download.

Documents are the running interpreter's standard-library `.py` sources (code; test suites, site-packages
and the machine-generated `_sysconfigdata*` left out) plus one document per topic of
`pydoc_data/topics.py` (English prose from the Python reference manual). Each document is assigned to
`train` or `validation` by a hash of its name (about `VALIDATION_PERCENT` % go to validation), and the list
is ordered by that hash too, so any prefix is a deterministic, well-mixed slice of code and prose. The corpus
therefore depends only on the Python version installed.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

from .sources import Document, split_of

VALIDATION_PERCENT = 3
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def _key(name: str) -> bytes:
    return hashlib.sha256(name.encode("utf-8")).digest()


def _walk_py(root: Path):
    """`*.py` files under `root`, pruning test suites and installed third-party packages."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                yield Path(dirpath) / f


@lru_cache(maxsize=1)
def _all_documents() -> tuple[Document, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    named: list[tuple[str, str]] = []
    for p in _walk_py(root):
        rel = p.relative_to(root)
        if p.name.startswith("_sysconfigdata") or rel.as_posix() == "pydoc_data/topics.py":
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # a few legacy files are not UTF-8; they are not needed
            continue
        if text.strip():
            named.append((f"stdlib/{rel.as_posix()}", text))
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    named += [(f"pydoc_data/topics.py#{k}", v) for k, v in topics.items() if v.strip()]
    if not named:
        raise FileNotFoundError(f"no Python sources under {root} to build the built-in corpus")
    named.sort(key=lambda kv: (_key(kv[0]), kv[0]))
    return tuple(Document(text, name, split_of(name, VALIDATION_PERCENT)) for name, text in named)


def builtin_corpus(max_bytes: int | None = None, split: str | None = None) -> list[Document]:
    """The built-in corpus in its deterministic (hash-of-name) order.

    `split`: "train", "validation" or None (both; each document's `.split` says which). `max_bytes`: keep
    whole documents, in order, until their UTF-8 size reaches `max_bytes` (the document that crosses the
    limit is included), so a bounded slice is a prefix of the full list.
    """
    if split not in (None, "train", "validation"):
        raise ValueError(f"split must be 'train', 'validation' or None, got {split!r}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    out, n = [], 0
    for d in _all_documents():
        if split is not None and d.split != split:
            continue
        if max_bytes is not None and n >= max_bytes:
            break
        out.append(d)
        n += len(d.text.encode("utf-8"))
    return out
