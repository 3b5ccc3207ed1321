"""Streaming document readers for user data: plain text, JSONL (a `text` field) and Parquet (a `text` column).

Every reader yields `Document`s one at a time and never holds more than one Parquet record batch (or one
JSONL line, or one text file) in memory, so `--data` can point at corpora far larger than RAM. Order is
deterministic: files in the order given, directories and globs expanded in sorted order.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
KNOWN_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


@dataclass(frozen=True)
class Document:
    """One training document: its text and where it came from (`file`, `file:line`, `file#row`)."""

    text: str
    source: str = ""
    split: str = "train"


def split_of(name: str, validation_percent: float) -> str:
    """'validation' for about `validation_percent` % of names (by a hash of the name), else 'train'."""
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return "validation" if h % 10_000 < validation_percent * 100 else "train"


def expand_paths(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Files named by `paths`: files as given, directories walked recursively (sorted, known suffixes only),
    glob patterns expanded (sorted). A path that matches nothing is an error, not an empty corpus."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        s = str(p)
        if any(c in s for c in "*?["):
            hits = sorted(glob.glob(s, recursive=True))
            if not hits:
                raise FileNotFoundError(f"data glob {s!r} matches no file")
            out.extend(expand_paths(hits))
            continue
        path = Path(s)
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file() and _kind(f) is not None)
            if not files:
                raise FileNotFoundError(f"data directory {s!r} holds no {'/'.join(KNOWN_SUFFIXES)} file")
            out.extend(files)
        elif path.is_file():
            if _kind(path) is None:
                raise ValueError(f"data file {s!r}: unknown type, expected one of {', '.join(KNOWN_SUFFIXES)}")
            out.append(path)
        else:
            raise FileNotFoundError(f"data path {s!r} does not exist")
    return out


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    for kind, sufs in (("text", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(sufs):
            return kind
    return None


def read_text(path: str | os.PathLike) -> Iterator[Document]:
    """A text file is one document (UTF-8; undecodable bytes become U+FFFD)."""
    p = Path(path)
    yield Document(p.read_text(encoding="utf-8", errors="replace"), str(p))


def read_jsonl(path: str | os.PathLike, text_field: str = "text") -> Iterator[Document]:
    """One document per non-empty line, from the string field `text_field`."""
    p = Path(path)
    with p.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
                raise ValueError(f"{p}:{lineno}: expected a JSON object with a string field {text_field!r}")
            yield Document(rec[text_field], f"{p}:{lineno}")


def read_parquet(path: str | os.PathLike, text_field: str = "text", batch_rows: int = 1024) -> Iterator[Document]:
    """One document per row of the string column `text_field`, read `batch_rows` rows at a time.
    Null rows are skipped (they hold no text)."""
    import pyarrow.parquet as pq

    p = Path(path)
    pf = pq.ParquetFile(p)
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{p}: no column {text_field!r} (columns: {pf.schema_arrow.names})")
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"{p}#{row}: column {text_field!r} holds {type(value).__name__}, expected str")
                yield Document(value, f"{p}#{row}")
            row += 1


def open_sources(paths: str | os.PathLike | Iterable[str | os.PathLike], text_field: str = "text",
                 split: str | None = None, validation_percent: float = 1.0) -> Iterator[Document]:
    """Stream the documents of every file in `paths` (see `expand_paths`), file after file.

    Each document's `split` is drawn from a hash of its `source` (file, line or row), so train and
    validation are disjoint and stable; `split="train"` / `"validation"` keeps only that part."""
    if split not in (None, "train", "validation"):
        raise ValueError(f"split must be 'train', 'validation' or None, got {split!r}")
    if not 0 <= validation_percent <= 100:
        raise ValueError(f"validation_percent must be in [0, 100], got {validation_percent}")
    for f in expand_paths(paths):
        kind = _kind(f)
        if kind == "text":
            docs = read_text(f)
        elif kind == "jsonl":
            docs = read_jsonl(f, text_field)
        else:
            docs = read_parquet(f, text_field)
        for d in docs:
            part = split_of(d.source, validation_percent)
            if split is None or part == split:
                yield Document(d.text, d.source, part)
