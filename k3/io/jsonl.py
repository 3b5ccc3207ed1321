"""One JSONL reader for every file of records k3 reads (pre-training documents, SFT conversations, task sets)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator


def iter_jsonl(path: str | os.PathLike, errors: str = "strict") -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for every non-blank line of `path`. A line that is not JSON, or not a JSON
    object, is a ValueError naming `path:line`; `errors` is the text decoding's ("replace" for corpora)."""
    p = Path(path)
    with p.open("r", encoding="utf-8", errors=errors) as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{p}:{n}: expected a JSON object, got {type(obj).__name__}")
            yield n, obj
