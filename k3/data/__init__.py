"""Training data: the built-in corpus, streaming readers for user files, document packing with exact
resume and data-parallel sharding, and a synthetic long-context task."""

from .corpus import builtin_corpus
from .longctx import LongContextTask, answer_accuracy, evaluate
from .packing import IGNORE_INDEX, Mixture, PackedDataset, collate, make_row
from .sources import (Document, check_sources, expand_paths, open_sources, read_jsonl, read_parquet, read_text,
                      split_of)

__all__ = ["Document", "IGNORE_INDEX", "LongContextTask", "Mixture", "PackedDataset", "answer_accuracy",
           "builtin_corpus", "check_sources", "collate", "evaluate", "expand_paths", "make_row", "open_sources",
           "read_jsonl", "read_parquet", "read_text", "split_of"]
