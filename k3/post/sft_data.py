"""SFT data: chat conversations (JSONL) → token ids + loss mask → packed rows with document boundaries.

One JSON object per line: `{"messages": [...], "tools": [...] | null, "task_id": str, "domain": str}`
(OpenAI-style messages; assistant turns may carry `reasoning_content` and `tool_calls`). Per-example chat
options (`reasoning_effort`, `thinking_effort`, `thinking`, `enable_thinking`, `tool_choice`,
`response_format`) pass through to `k3.io.chat`; the effort defaults to `max` as in the chat format.

A conversation is rendered with the official encoding (`k3.io.chat.encode_with_mask`, no generation
prompt, no BOS): the loss covers the assistant bodies and their closing markers only. Conversations are
never split across rows: each epoch shuffles them, packs them by best fit into rows of `seq_len` input
positions (the rest is [PAD]) and shuffles the rows. Labels follow `k3.data.packing`: `labels[t]` is the
target of position t (the next token when it is in the loss mask, else −100), −100 at every document
boundary, and `doc_lens` gives the pieces so `collate` builds `cu_seqlens`. A conversation longer than
`seq_len` is truncated (counted, with a warning) or dropped (`drop_long`); one with no loss token left is
dropped (counted).
"""

from __future__ import annotations

import bisect
import hashlib
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..data.packing import IGNORE_INDEX, make_row
from ..io.chat import ChatFormatError, encode_with_mask
from ..io.jsonl import iter_jsonl

CHAT_OPTIONS = ("reasoning_effort", "thinking_effort", "thinking", "enable_thinking", "tool_choice",
                "response_format")
_STATE_VERSION = 1


@dataclass
class Example:
    """One tokenised conversation: `ids` int64 [L], `mask` bool [L] (True: a loss target)."""

    ids: torch.Tensor
    mask: torch.Tensor
    task_id: str


@dataclass
class LoadStats:
    conversations: int = 0  # lines read
    kept: int = 0
    truncated: int = 0
    dropped_long: int = 0
    dropped_no_loss: int = 0
    tokens: int = 0  # kept tokens
    loss_tokens: int = 0
    fingerprint: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "notes"}


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(1-based line number, conversation) for every non-blank line; a bad line is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data {str(path)!r} does not exist (expected a JSONL file of conversations)")
    for n, obj in iter_jsonl(path):
        if not isinstance(obj.get("messages"), list):
            raise ValueError(f"{path}:{n}: expected an object with a 'messages' list, got "
                             f"messages={type(obj.get('messages')).__name__}")
        yield n, obj


def example_options(obj: dict, default_effort: str | None = None) -> dict[str, Any]:
    """The chat options an example carries; `default_effort` fills `reasoning_effort` when it names no
    effort (except "none", thinking off, for an example that sets `thinking` / `enable_thinking` itself)."""
    opts = {k: obj[k] for k in CHAT_OPTIONS if obj.get(k) is not None}
    named = {"reasoning_effort", "thinking_effort"} & opts.keys()
    if default_effort is not None and not named and not (
            default_effort == "none" and {"thinking", "enable_thinking"} & opts.keys()):
        opts["reasoning_effort"] = default_effort
    return opts


def encode_example(tokenizer, obj: dict, default_effort: str | None = None) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of one conversation (the official rendering, no generation prompt)."""
    return encode_with_mask(tokenizer, obj["messages"], obj.get("tools"), add_generation_prompt=False,
                            **example_options(obj, default_effort))


def load_examples(path: str | Path, tokenizer, seq_len: int, *, drop_long: bool = False,
                  effort: str | None = None, warn: bool = True) -> tuple[list[Example], LoadStats]:
    """Read, render and tokenise every conversation of `path`; errors name the line and the task_id."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: expected ≥ 2")
    st, out = LoadStats(), []
    h = hashlib.sha256(f"k3-sft:{seq_len}:{drop_long}".encode())
    for n, obj in read_jsonl(path):
        st.conversations += 1
        tid = str(obj.get("task_id", f"line {n}"))
        try:
            ids, mask = encode_example(tokenizer, obj, effort)
        except ChatFormatError as e:
            raise ValueError(f"{path}:{n}: conversation {tid!r} cannot be rendered in the chat format: "
                             f"{e}") from None
        if len(ids) > seq_len:
            if drop_long:
                st.dropped_long += 1
                continue
            st.truncated += 1
            ids, mask = ids[:seq_len], mask[:seq_len]
        if not any(mask[1:]):
            st.dropped_no_loss += 1
            continue
        ex = Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), tid)
        h.update(ex.ids.numpy().tobytes())
        h.update(ex.mask.numpy().tobytes())
        out.append(ex)
        st.tokens += len(ids)
        st.loss_tokens += int(ex.mask[1:].sum())
    st.kept, st.fingerprint = len(out), h.hexdigest()[:16]
    if st.truncated:
        st.notes.append(f"{st.truncated} of {st.conversations} conversations are longer than seq_len={seq_len} "
                        "and were truncated (raise --seq-len, or --drop-long to skip them)")
    if st.dropped_long:
        st.notes.append(f"{st.dropped_long} of {st.conversations} conversations are longer than seq_len={seq_len} "
                        "and were dropped")
    if st.dropped_no_loss:
        st.notes.append(f"{st.dropped_no_loss} of {st.conversations} conversations have no assistant token "
                        f"within seq_len={seq_len} (nothing to learn) and were dropped")
    if warn:
        for note in st.notes:
            warnings.warn(f"{path}: {note}", stacklevel=2)
    if not out:
        why = f" ({'; '.join(st.notes)})" if st.notes else ""
        raise ValueError(f"SFT data {str(path)!r} holds no usable conversation: {st.conversations} read{why}")
    return out, st


# ---------------------------------------------------------------------------------------------- packing

def pack_row(examples: Sequence[Example], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row of `seq_len` positions from whole conversations (total length ≤ seq_len) and [PAD]:
    `input_ids`, `labels` (next token where it is in the loss mask, −100 elsewhere and across every
    boundary), `doc_lens` (the conversations, then the padding)."""
    used = sum(len(e.ids) for e in examples)
    if not examples or used > seq_len:
        raise ValueError(f"a row of seq_len={seq_len} cannot hold conversations of {used} tokens")
    pad = seq_len + 1 - used  # ≥ 1: make_row wants seq_len + 1 tokens (the extra one is only ever a target)
    tokens = torch.cat([e.ids for e in examples] + [torch.full((pad,), pad_id, dtype=torch.long)])
    row = make_row(tokens.tolist(), [len(e.ids) for e in examples] + [pad], pad_segment=True)
    target_ok = torch.cat([e.mask for e in examples] + [torch.zeros(pad, dtype=torch.bool)])[1:]
    row["labels"] = row["labels"].masked_fill(~target_ok, IGNORE_INDEX)
    return row


def _seed(seed: int, epoch: int, what: str) -> int:
    return int.from_bytes(hashlib.sha256(f"k3-sft:{seed}:{epoch}:{what}".encode()).digest()[:8], "big")


def plan_epoch(lengths: Sequence[int], seq_len: int, seed: int, epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Rows of example indices for one epoch: the examples in a seeded random order, each put into the open
    row with the least room that still fits it (best fit; a new row when none does), then the rows shuffled.
    A pure function of its arguments, so a data position is just (epoch, row)."""
    order = list(range(len(lengths)))
    if shuffle:
        random.Random(_seed(seed, epoch, "order")).shuffle(order)
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (free positions, row index)
    for i in order:
        L = lengths[i]
        if L > seq_len:
            raise ValueError(f"example {i} has {L} tokens, more than seq_len={seq_len}")
        k = bisect.bisect_left(room, (L, -1))
        if k < len(room):
            free, r = room.pop(k)
        else:
            free, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if free - L > 0:
            bisect.insort(room, (free - L, r))
    if shuffle:
        random.Random(_seed(seed, epoch, "rows")).shuffle(rows)
    return rows


class PackedSFT(torch.utils.data.IterableDataset):
    """Packed SFT rows (see the module docstring), sharded over data-parallel ranks (row n of an epoch goes
    to rank n % world_size), with exact resume: the position is (epoch, row) and the state carries a
    fingerprint of the data so a changed file is refused rather than silently resumed."""

    def __init__(self, examples: Sequence[Example], seq_len: int, pad_id: int, *, seed: int = 0,
                 rank: int = 0, world_size: int = 1, loop: bool = True, shuffle: bool = True,
                 fingerprint: str = ""):
        if not examples:
            raise ValueError("PackedSFT needs at least one example")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 ≤ rank < world_size, got rank {rank}, world_size {world_size}")
        self.examples, self.seq_len, self.pad_id = list(examples), seq_len, pad_id
        self.seed, self.rank, self.world_size, self.loop, self.shuffle = seed, rank, world_size, loop, shuffle
        self.fingerprint = fingerprint
        self.lengths = [len(e.ids) for e in self.examples]
        self.epoch = self.row = self.rows = 0
        self._plan: tuple[int, list[list[int]]] | None = None

    def plan(self, epoch: int) -> list[list[int]]:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, plan_epoch(self.lengths, self.seq_len, self.seed, epoch, self.shuffle))
        return self._plan[1]

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "epoch": self.epoch, "row": self.row, "rows": self.rows,
                "seq_len": self.seq_len, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "n_examples": len(self.examples), "fingerprint": self.fingerprint}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("version") != _STATE_VERSION:
            raise ValueError(f"SFT data state version {sd.get('version')!r}, expected {_STATE_VERSION}")
        mine = self.state_dict()
        for k in ("seq_len", "seed", "rank", "world_size", "n_examples", "fingerprint"):
            if sd.get(k) != mine[k]:
                raise ValueError(f"the checkpoint's SFT data state has {k}={sd.get(k)!r}, this run has "
                                 f"{mine[k]!r}: the data or packing changed since it was saved (use the same "
                                 "--data, --seq-len and --seed to resume, or a new --out to start over)")
        self.epoch, self.row, self.rows = int(sd["epoch"]), int(sd["row"]), int(sd["rows"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            rows = self.plan(self.epoch)
            while self.row < len(rows):
                r = self.row
                self.row += 1
                if r % self.world_size == self.rank:
                    self.rows += 1
                    yield pack_row([self.examples[i] for i in rows[r]], self.seq_len, self.pad_id)
            if not self.loop:
                return
            self.epoch, self.row = self.epoch + 1, 0
