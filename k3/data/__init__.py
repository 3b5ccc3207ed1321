"""Training data: the built-in corpus, streaming readers for user files, document packing with exact
resume and data-parallel sharding, and a synthetic long-context task."""

from .corpus import builtin_corpus
from .sources import Document, expand_paths, open_sources, read_jsonl, read_parquet, read_text

__all__ = ["Document", "builtin_corpus", "expand_paths", "open_sources", "read_jsonl", "read_parquet", "read_text"]
