"""Streaming document readers for user data: plain text, JSONL (a `text` field) and Parquet (a `text` column).

Every reader yields `Document`s one at a time and never holds more than one Parquet record batch (or one
JSONL line, or one piece of a text file) in memory, so `--data` can point at corpora far larger than RAM. Order is
deterministic: files in the order given, directories and globs expanded in sorted order. A text file is cut into
documents of a few KB at blank lines (`read_text`).
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from ..io.jsonl import iter_jsonl

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


def _chunk_target(size: int) -> int:
    """Bytes per document for a text file of `size` bytes: about 1/16 of the file, within [256, 8192]."""
    return min(max(size // 16, 256), 8192)


def read_text(path: str | os.PathLike, chunk_bytes: int | None = None) -> Iterator[Document]:
    """A text file as documents of about `chunk_bytes` (default: `_chunk_target` of the file's size), cut at
    blank lines (at any line end once a piece reaches 4x that, inside a line beyond that), so one big file such
    as nanoGPT's input.txt gives many documents and a held-out part. Joined, the documents are the file exactly;
    whitespace-only pieces are skipped. UTF-8; undecodable bytes become U+FFFD. Sources are `file:<first line>`."""
    p = Path(path)
    target = chunk_bytes or _chunk_target(p.stat().st_size)
    hard = 4 * target
    buf: list[str] = []
    size, start, lineno = 0, 1, 0

    def emit():
        text = "".join(buf)
        return Document(text, f"{p}:{start}") if text.strip() else None

    with p.open("r", encoding="utf-8", errors="replace", newline="") as fh:
        for lineno, line in enumerate(fh, start=1):
            while len(line) > hard:  # one huge line: cut it
                room = hard - size
                buf.append(line[:room])
                line = line[room:]
                if (d := emit()) is not None:
                    yield d
                buf, size, start = [], 0, lineno
            buf.append(line)
            size += len(line)
            if (size >= target and not line.strip()) or size >= hard:
                if (d := emit()) is not None:
                    yield d
                buf, size, start = [], 0, lineno + 1
    if buf and (d := emit()) is not None:
        yield d


def read_jsonl(path: str | os.PathLike, text_field: str = "text") -> Iterator[Document]:
    """One document per non-empty line, from the string field `text_field`."""
    for lineno, rec in iter_jsonl(path, errors="replace"):
        if not isinstance(rec.get(text_field), str):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field {text_field!r}")
        yield Document(rec[text_field], f"{path}:{lineno}")


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


def _documents(files: list[Path], text_field: str) -> Iterator[Document]:
    for f in files:
        kind = _kind(f)
        if kind == "text":
            yield from read_text(f)
        elif kind == "jsonl":
            yield from read_jsonl(f, text_field)
        else:
            yield from read_parquet(f, text_field)


def _fingerprint(files: list[Path]) -> tuple:
    out = []
    for f in files:
        st = f.stat()
        out.append((str(f), st.st_size, st.st_mtime_ns))
    return tuple(out)


@lru_cache(maxsize=16)
def _hash_split_has_validation(fingerprint: tuple, text_field: str, validation_percent: float) -> bool:
    """Whether the hash split holds out at least one document (reads until the first one, ~100/percent docs)."""
    files = [Path(f) for f, _, _ in fingerprint]
    return any(split_of(d.source, validation_percent) == "validation" for d in _documents(files, text_field))


def open_sources(paths: str | os.PathLike | Iterable[str | os.PathLike], text_field: str = "text",
                 split: str | None = None, validation_percent: float = 1.0) -> Iterator[Document]:
    """Stream the documents of every file in `paths` (see `expand_paths`), file after file.

    Each document's `split` is drawn from a hash of its `source` (file, line or row), so train and
    validation are disjoint and stable; `split="train"` / `"validation"` keeps only that part. With a split asked
    for, when the hash holds out nothing (a small corpus; found by reading up to the first held-out document) and
    `validation_percent` > 0, the corpus's last document is the validation split instead, so validation is never
    empty for a corpus of two or more documents. `split=None` streams every document with its hash label."""
    if split not in (None, "train", "validation"):
        raise ValueError(f"split must be 'train', 'validation' or None, got {split!r}")
    if not 0 <= validation_percent <= 100:
        raise ValueError(f"validation_percent must be in [0, 100], got {validation_percent}")
    files = expand_paths(paths)
    if split is None or validation_percent == 0 or _hash_split_has_validation(_fingerprint(files), text_field,
                                                            float(validation_percent)):
        for d in _documents(files, text_field):
            part = split_of(d.source, validation_percent)
            if split is None or part == split:
                yield Document(d.text, d.source, part)
        return
    prev = None  # no hashed validation document: hold back the last one
    for d in _documents(files, text_field):
        if prev is not None and split == "train":
            yield Document(prev.text, prev.source, "train")
        prev = d
    if prev is not None and split == "validation":
        yield Document(prev.text, prev.source, "validation")


def check_sources(paths: str | os.PathLike | Iterable[str | os.PathLike], text_field: str = "text",
                  validation_percent: float = 1.0) -> None:
    """Fail early, with a message naming the data, unless both splits of `paths` hold text: every path exists,
    there is at least one non-empty training document and one validation document."""
    files = expand_paths(paths)
    named = ", ".join(repr(str(f)) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    train = next((d for d in open_sources(files, text_field, "train", validation_percent) if d.text.strip()), None)
    if train is None:
        n = sum(1 for d in _documents(files, text_field) if d.text.strip())
        if n == 0:
            raise ValueError(f"data {named}: no text to train on (the files are empty or whitespace only)")
        raise ValueError(f"data {named}: only {n} document(s), all held out for validation: give more text "
                         "(a text file is cut into documents at blank lines)")
    if next(open_sources(files, text_field, "validation", validation_percent), None) is None:
        raise ValueError(f"data {named}: no validation document could be held out")
