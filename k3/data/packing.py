"""Document packing into fixed-length rows, data-parallel sharding and exact resume.

Pipeline (per data-parallel rank):
1. documents come from `docs_factory()` (a fresh, deterministic iterator each call; `str` or `Document`);
   document number i (0-based, counting every document the factory yields) belongs to rank
   `i % world_size`, so ranks see disjoint documents that together cover the corpus;
2. a rank's documents are read in windows of `shuffle_buffer` and each window is permuted by an RNG seeded
   with (seed, rank, epoch, window) — a bounded-memory shuffle whose position is three integers;
3. each non-empty document becomes `[BOS] + encode(text) + [EOS]` (`tokenizer.eod_token_id`; the K3 [EOS]
   id, distinct from the chat stop <|end_of_msg|>), and documents are concatenated into one stream;
4. the stream is cut into disjoint rows of `seq_len + 1` tokens: `input_ids = row[:-1]`,
   `labels = row[1:]`, so every token of the stream lands in exactly one row. A label whose target lies in
   another document than its input position (the [EOS] → next [BOS] step) is −100, and `doc_lens` lists
   the lengths of the document pieces among the `seq_len` inputs (sum = seq_len); a document that does not
   fit continues at the start of the next row (a fresh piece: KDA state and MLA attention restart there).

With `loop=True` the stream runs forever, epoch after epoch (each epoch reshuffled). With `loop=False` it
stops after one pass; the last partial row is padded with [PAD] (labels −100, its own `doc_lens` piece) and
a final leftover of a single token (the last document's [EOS], which has no target) is dropped.

`state_dict()` captures the position after the last row handed out (epoch, window, position in the
window, and the < seq_len + 1 tokens carried into the next row); after `load_state_dict` a fresh iterator
continues with exactly the rows an uninterrupted one would have produced. `seq_len` may differ between
save and load (a context-length curriculum); rank, world size, seed and shuffle_buffer may not. Use it
from the training process (DataLoader `num_workers=0`; tokenising with tiktoken is fast), one iterator at a
time.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .sources import Document

IGNORE_INDEX = -100
_ENCODE_AHEAD = 32  # documents tokenised per batch (threads run in parallel; tiktoken releases the GIL)
_STATE_VERSION = 1

DocsFactory = Callable[[], Iterable["str | Document"]]


def _text(doc) -> str:
    if isinstance(doc, Document):
        return doc.text
    if isinstance(doc, str):
        return doc
    raise TypeError(f"documents must be str or Document, got {type(doc).__name__}")


def make_row(tokens: Sequence[int], segments: Sequence[int], pad_segment: bool = False) -> dict[str, torch.Tensor]:
    """One sample from `seq_len + 1` tokens and the lengths of their document pieces (sum = len(tokens)).
    With `pad_segment` the last piece is padding: its labels are −100 too."""
    T = len(tokens) - 1
    if T < 1 or sum(segments) != len(tokens) or any(s <= 0 for s in segments):
        raise ValueError(f"segments {list(segments)} must be positive and sum to the row length {len(tokens)}")
    row = torch.tensor(tokens, dtype=torch.long)
    labels = row[1:].clone()
    doc_lens, end = [], 0
    for j, s in enumerate(segments):
        start, end = end, end + s
        if start < T:
            doc_lens.append(min(end, T) - start)
        if end <= T:
            labels[end - 1] = IGNORE_INDEX  # target row[end] starts the next piece (another document)
        if pad_segment and j == len(segments) - 1:
            labels[max(start - 1, 0):] = IGNORE_INDEX
    return {"input_ids": row[:-1], "labels": labels, "doc_lens": torch.tensor(doc_lens, dtype=torch.long)}


def collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into `input_ids` / `labels` [B, T] and build `cu_seqlens` (int32 [N+1], fla convention)
    over the flattened B·T tokens from each sample's `doc_lens`; every row boundary is a boundary."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    T = samples[0]["input_ids"].shape[0]
    for i, s in enumerate(samples):
        if s["input_ids"].shape != (T,) or s["labels"].shape != (T,):
            raise ValueError(f"sample {i} has input_ids {tuple(s['input_ids'].shape)} / labels "
                             f"{tuple(s['labels'].shape)}, expected ({T},) like sample 0")
        if int(s["doc_lens"].sum()) != T:
            raise ValueError(f"sample {i}: doc_lens sum to {int(s['doc_lens'].sum())}, expected {T}")
    lens = torch.cat([s["doc_lens"] for s in samples])
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return {"input_ids": torch.stack([s["input_ids"] for s in samples]),
            "labels": torch.stack([s["labels"] for s in samples]), "cu_seqlens": cu}


def _window_seed(seed: int, rank: int, epoch: int, window: int) -> int:
    return int.from_bytes(hashlib.sha256(f"k3-pack:{seed}:{rank}:{epoch}:{window}".encode()).digest()[:8], "big")


class PackedDataset(torch.utils.data.IterableDataset):
    """Packed, sharded, shuffled training rows with exact resume (see the module docstring)."""

    def __init__(self, docs_factory: DocsFactory | Sequence, tokenizer, seq_len: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle_buffer: int = 256, loop: bool = True,
                 tokenizer_threads: int = 4):
        if seq_len < 1:
            raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 ≤ rank < world_size, got rank {rank}, world_size {world_size}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be ≥ 1 (1 = no shuffling), got {shuffle_buffer}")
        if not callable(docs_factory):
            seq = docs_factory
            docs_factory = lambda: iter(seq)  # noqa: E731  a re-iterable collection
        self.docs_factory = docs_factory
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle_buffer, self.loop = shuffle_buffer, loop
        self.tokenizer_threads = max(1, min(tokenizer_threads, os.cpu_count() or 1))
        self._reset()

    def _reset(self) -> None:
        self.epoch = self.window = self.window_pos = 0
        self.rows = 0
        self._carry: list[int] = []  # tokens not yet in a row: self._carry[self._off:]
        self._off = 0
        self._carry_segs: deque[int] = deque()  # their document-piece lengths
        self._done = False

    # ---- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "rank": self.rank, "world_size": self.world_size, "seed": self.seed,
                "shuffle_buffer": self.shuffle_buffer, "seq_len": self.seq_len, "epoch": self.epoch,
                "window": self.window, "window_pos": self.window_pos, "rows": self.rows, "done": self._done,
                "carry": torch.tensor(self._carry[self._off:], dtype=torch.long),
                "carry_segs": torch.tensor(list(self._carry_segs), dtype=torch.long)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("version") != _STATE_VERSION:
            raise ValueError(f"data state version {sd.get('version')!r}, expected {_STATE_VERSION}")
        for k in ("rank", "world_size", "seed", "shuffle_buffer"):
            if sd[k] != getattr(self, k):
                raise ValueError(f"data state was saved with {k}={sd[k]}, this dataset has {k}={getattr(self, k)}: "
                                 "the document order would differ")
        carry, segs = [int(x) for x in sd["carry"]], [int(x) for x in sd["carry_segs"]]
        if sum(segs) != len(carry):
            raise ValueError(f"corrupt data state: carry_segs sum to {sum(segs)}, carry holds {len(carry)} tokens")
        self.epoch, self.window, self.window_pos = int(sd["epoch"]), int(sd["window"]), int(sd["window_pos"])
        self.rows, self._done = int(sd["rows"]), bool(sd["done"])
        self._carry, self._off, self._carry_segs = carry, 0, deque(segs)

    # ---- iteration ----------------------------------------------------------------------------------------
    def _rank_docs(self) -> Iterator[str]:
        for i, d in enumerate(self.docs_factory()):
            if i % self.world_size == self.rank:
                yield _text(d)

    def _documents(self) -> Iterator[list[int]]:
        """Token lists from the current (epoch, window, window_pos) on; advances that position as it goes."""
        tok, W = self.tokenizer, self.shuffle_buffer
        while True:
            src = self._rank_docs()
            for _ in range(self.window * W):  # resume: skip whole windows without tokenising them
                if next(src, None) is None:
                    break
            seen_any = self.window > 0
            full_pass, produced = self.window == 0 and self.window_pos == 0, False
            while True:
                win = [t for _, t in zip(range(W), src)]
                if not win:
                    break
                seen_any = True
                order = list(range(len(win)))
                if W > 1:
                    random.Random(_window_seed(self.seed, self.rank, self.epoch, self.window)).shuffle(order)
                ahead: dict[int, list[int]] = {}  # tokenised a few documents ahead (not part of the state)
                while self.window_pos < len(win):
                    p = self.window_pos
                    if p not in ahead:
                        idx = range(p, min(len(win), p + _ENCODE_AHEAD))
                        ahead = dict(zip(idx, self._encode_many([win[order[q]] for q in idx])))
                    ids = ahead.pop(p)
                    self.window_pos += 1
                    if win[order[p]]:
                        produced = True
                        yield [tok.bos_token_id, *ids, tok.eod_token_id]
                self.window += 1
                self.window_pos = 0
            if not seen_any:
                raise ValueError(f"rank {self.rank} of {self.world_size} received no documents: the corpus has "
                                 f"fewer documents than data-parallel ranks")
            if full_pass and not produced:
                raise ValueError(f"rank {self.rank} of {self.world_size}: every document is empty")
            if not self.loop:
                return
            self.epoch += 1
            self.window = 0

    def _pending(self) -> int:
        return len(self._carry) - self._off

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        batch = getattr(self.tokenizer, "encode_batch", None)
        if batch is not None and self.tokenizer_threads > 1:
            return batch(texts, num_threads=self.tokenizer_threads)
        return [self.tokenizer.encode(t) for t in texts]

    def _take_row(self, n: int) -> tuple[list[int], list[int]]:
        row = self._carry[self._off:self._off + n]
        self._off += n
        if self._off > 65536 and 2 * self._off > len(self._carry):  # drop the consumed prefix now and then
            del self._carry[:self._off]
            self._off = 0
        segs, need = [], n
        while need:
            s = self._carry_segs[0]
            if s <= need:
                segs.append(s)
                self._carry_segs.popleft()
                need -= s
            else:
                segs.append(need)
                self._carry_segs[0] = s - need
                need = 0
        return row, segs

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError("PackedDataset keeps its position in the training process: use DataLoader "
                               "num_workers=0 (or 1); shard across ranks with rank/world_size instead")
        n = self.seq_len + 1
        docs = None if self._done else self._documents()
        while True:
            while self._pending() >= n:
                row, segs = self._take_row(n)
                self.rows += 1
                yield make_row(row, segs)
            nxt = next(docs, None) if docs is not None else None
            if nxt is None:
                break
            self._carry.extend(nxt)
            self._carry_segs.append(len(nxt))
        self._done = True
        if self._pending() > 1:  # loop=False: pad the last partial row
            row, segs = self._take_row(self._pending())
            pad = n - len(row)
            self.rows += 1
            yield make_row(row + [self.tokenizer.pad_token_id] * pad, segs + [pad], pad_segment=pad > 0)
        self._carry, self._off, self._carry_segs = [], 0, deque()


class Mixture(torch.utils.data.IterableDataset):
    """Interleave sample streams (e.g. packed text and `LongContextTask`) with the given weights.

    Row n comes from source j drawn by an RNG seeded with (seed, n), so the choice sequence is a pure
    function of the row index; `state_dict` holds that index and each source's own state, which makes
    resume exact whenever every source's is. Sources must yield rows of the same length to be collated.
    """

    def __init__(self, sources: Sequence, weights: Sequence[float], seed: int = 0):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"need one weight per source, got {len(sources)} sources and {len(weights)} weights")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be ≥ 0 with a positive sum, got {list(weights)}")
        self.sources, self.weights, self.seed = list(sources), [float(w) for w in weights], seed
        self.step = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        its = [iter(s) for s in self.sources]
        while True:
            j = random.Random(_window_seed(self.seed, -1, -1, self.step)).choices(range(len(its)), self.weights)[0]
            row = next(its[j])
            self.step += 1
            yield row

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["seed"] != self.seed or len(sd["sources"]) != len(self.sources):
            raise ValueError(f"mixture state (seed {sd['seed']}, {len(sd['sources'])} sources) does not match "
                             f"this mixture (seed {self.seed}, {len(self.sources)} sources)")
        self.step = int(sd["step"])
        for s, d in zip(self.sources, sd["sources"]):
            s.load_state_dict(d)
