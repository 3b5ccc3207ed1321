"""Synthetic long-context task: facts and sub-tasks scattered across the whole sequence, one question at
the end whose answer depends on tokens far away.

Each sample is one document of exactly `seq_len + 1` tokens: `[BOS] context question answer [EOS]`.
The context is filler text with inserted facts. Two kinds of task (mixed by `kinds`):
- `kv`:    `n_facts` facts "The value of key K is V." with distinct keys and values; the question asks
           for one key's value;
- `chain`: a pointer chain "K0 points to K1." … "K(h-1) points to Kh." plus "The value of key Kh is V.",
           its links shuffled and scattered, among distractor facts and pointers; the question asks for the
           value reached from K0, so answering needs every hop.
The facts the answer needs are placed at relative depths drawn from `needle_depth` (default: anywhere in
the first 90 % of the context), distractors anywhere. Filler is synthetic prose without digits (default) or
random slices of the token streams of `filler_docs`.

Labels (`label_mode`): "answer" (default) labels only the answer tokens (every other label −100), so the
loss measures retrieval alone; "all" labels every next token like ordinary text (the answer included).
Samples carry the `PackedDataset` keys (`input_ids`, `labels`, `doc_lens` = [seq_len]) plus
`answer_mask` (True at positions whose next token is an answer token), so they can be collated and mixed
into training. `sample(i)` is a pure function of (seed, i); iteration keeps an index for exact resume.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .packing import IGNORE_INDEX, collate

_WORDS = ("the", "a", "river", "stone", "quiet", "morning", "garden", "light", "old", "city", "walks", "under",
          "bright", "window", "summer", "wind", "carries", "small", "boat", "across", "green", "field", "slowly",
          "music", "rises", "over", "hills", "children", "read", "stories", "near", "warm", "fire", "birds",
          "sing", "softly", "in", "trees", "clouds", "drift", "toward", "sea", "people", "gather", "at", "market",
          "bread", "smells", "sweet", "road", "bends", "past", "library", "lamp", "glows", "evening", "falls")
_KEY_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ"


@dataclass
class Fact:
    text: str
    depth: float  # relative position in the context, in [0, 1)
    needed: bool = False


@dataclass
class SampleSpec:
    """Everything one sample is built from (so a test can change one fact and rebuild)."""

    kind: str
    facts: list[Fact]
    question: str
    answer: str
    filler_seed: int
    extra: dict = field(default_factory=dict)


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")


class LongContextTask:
    """Deterministic synthetic long-context samples (see the module docstring)."""

    def __init__(self, tokenizer, seq_len: int, *, seed: int = 0, n_facts: int = 16, hops: int = 3,
                 kinds: Sequence[str] = ("kv", "chain"), needle_depth: tuple[float, float] = (0.0, 0.9),
                 label_mode: str = "answer", filler_docs: Sequence[str] | None = None):
        if label_mode not in ("answer", "all"):
            raise ValueError(f"label_mode must be 'answer' or 'all', got {label_mode!r}")
        bad = [k for k in kinds if k not in ("kv", "chain")]
        if not kinds or bad:
            raise ValueError(f"kinds must be a non-empty subset of ('kv', 'chain'), got {list(kinds)}")
        lo, hi = needle_depth
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"needle_depth must satisfy 0 ≤ lo < hi ≤ 1, got {needle_depth}")
        if n_facts < 1 or hops < 1:
            raise ValueError(f"n_facts and hops must be ≥ 1, got n_facts={n_facts}, hops={hops}")
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.n_facts, self.hops, self.kinds = n_facts, hops, tuple(kinds)
        self.needle_depth, self.label_mode = (lo, hi), label_mode
        self._filler_docs = [d for d in (filler_docs or []) if d]
        self._filler_tokens: list[list[int]] | None = None
        self.index = 0
        min_len = self._min_len()
        if seq_len < min_len:
            raise ValueError(f"seq_len {seq_len} is too short for {n_facts} facts and {hops} hops "
                             f"(needs about {min_len} tokens)")

    # ---- specification --------------------------------------------------------------------------------
    def spec(self, index: int) -> SampleSpec:
        rng = random.Random(_seed("k3-longctx", self.seed, index))
        kind = rng.choice(self.kinds)
        n_keys = self.n_facts + self.hops + 1 if kind == "chain" else self.n_facts
        keys = self._distinct(rng, n_keys, lambda: "".join(rng.choice(_KEY_ALPHABET) for _ in range(4)))
        values = self._distinct(rng, n_keys, lambda: str(rng.randrange(1000, 10000)))
        depth = lambda: rng.uniform(*self.needle_depth)  # noqa: E731
        if kind == "kv":
            target = rng.randrange(self.n_facts)
            facts = [Fact(f"The value of key {k} is {v}.", depth() if i == target else rng.random(), i == target)
                     for i, (k, v) in enumerate(zip(keys, values))]
            return SampleSpec(kind, facts, f"Question: what is the value of key {keys[target]}? Answer:",
                              f" {values[target]}", rng.getrandbits(62), {"key": keys[target]})
        chain = keys[:self.hops + 1]
        facts = [Fact(f"{a} points to {b}.", depth(), True) for a, b in zip(chain, chain[1:])]
        facts.append(Fact(f"The value of key {chain[-1]} is {values[0]}.", depth(), True))
        # distractors: values for other keys and pointers that never lead into the chain
        others = keys[self.hops + 1:]
        for i, k in enumerate(others):
            if i % 2 == 0 or i + 1 >= len(others):
                facts.append(Fact(f"The value of key {k} is {values[i + 1]}.", rng.random()))
            else:
                facts.append(Fact(f"{k} points to {others[i + 1]}.", rng.random()))
        return SampleSpec(kind, facts, f"Question: start at key {chain[0]} and follow the pointers; what is the "
                                       f"value of the last key? Answer:", f" {values[0]}", rng.getrandbits(62),
                          {"chain": chain})

    @staticmethod
    def _distinct(rng: random.Random, n: int, draw: Callable[[], str]) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            x = draw()
            if x not in out:
                out.append(x)
        return out

    def _min_len(self) -> int:
        s = self.spec(0)
        return 2 + len(self._enc(s.question)) + len(self._enc(s.answer)) + \
            sum(len(self._enc(" " + f.text)) for f in s.facts) + 16

    def _enc(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    # ---- filler ---------------------------------------------------------------------------------------
    def _filler(self, n: int, seed: int) -> tuple[list[int], list[int]]:
        """`n` filler tokens and the sorted positions where a fact may go (sentence or line starts)."""
        rng = random.Random(seed)
        out: list[int] = []
        cuts = [0]
        if self._filler_docs:
            if self._filler_tokens is None:
                self._filler_tokens = [self._enc(d) for d in self._filler_docs]
            nl = self._newline_ids()
            while len(out) < n:
                d = rng.choice(self._filler_tokens)
                start = rng.randrange(len(d))
                piece = d[start:start + n - len(out)]
                cuts += [len(out) + j + 1 for j, t in enumerate(piece) if t in nl]
                out += piece
                cuts.append(len(out))
        else:
            while len(out) < n:
                words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
                out += self._enc(" " + " ".join(words).capitalize() + ".")
                cuts.append(len(out))
        return out[:n], sorted({c for c in cuts if c <= n})

    def _newline_ids(self) -> set[int]:
        if not hasattr(self, "_nl"):
            self._nl = {i for t in self._filler_tokens for i in set(t) if b"\n" in self.tokenizer.token_bytes(i)}
        return self._nl

    # ---- samples --------------------------------------------------------------------------------------
    def build(self, spec: SampleSpec) -> dict[str, torch.Tensor]:
        """Tokens of one sample from its spec: facts inserted into filler at their depths (token level)."""
        tok = self.tokenizer
        fact_toks = [(f.depth, self._enc(" " + f.text)) for f in spec.facts]
        q = self._enc(" " + spec.question)
        a = self._enc(spec.answer)
        n_ctx = self.seq_len + 1 - 2 - len(q) - len(a)
        n_fill = n_ctx - sum(len(t) for _, t in fact_toks)
        if n_fill < 0:
            raise ValueError(f"seq_len {self.seq_len} cannot hold this sample's facts ({n_ctx} context tokens)")
        filler, cuts = self._filler(n_fill, spec.filler_seed)
        body, prev = [], 0
        for d, t in sorted(fact_toks, key=lambda x: x[0]):
            cut = max(cuts[bisect.bisect_right(cuts, int(d * n_fill)) - 1], prev)  # last boundary ≤ the depth
            body += filler[prev:cut] + t
            prev = cut
        body += filler[prev:]
        row = [tok.bos_token_id, *body, *q, *a, tok.eod_token_id]
        assert len(row) == self.seq_len + 1
        ids = torch.tensor(row, dtype=torch.long)
        labels = ids[1:].clone()
        a0 = 1 + len(body) + len(q)  # index in `row` of the first answer token
        answer_mask = torch.zeros(self.seq_len, dtype=torch.bool)
        answer_mask[a0 - 1:a0 - 1 + len(a)] = True
        if self.label_mode == "answer":
            labels[~answer_mask] = IGNORE_INDEX
        return {"input_ids": ids[:-1], "labels": labels, "doc_lens": torch.tensor([self.seq_len]),
                "answer_mask": answer_mask}

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        return self.build(self.spec(index))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            s = self.sample(self.index)
            self.index += 1
            yield s

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["seed"] != self.seed:
            raise ValueError(f"long-context state was saved with seed {sd['seed']}, this task has seed {self.seed}")
        self.index = int(sd["index"])


def answer_counts(logits: torch.Tensor, input_ids: torch.Tensor, answer_mask: torch.Tensor) -> dict[str, int]:
    """Teacher-forced answer hits. logits [B, T, V] at the inputs; the target at position t is input t+1
    (answer positions never include the last position). A sample is an exact match when every answer token
    is the argmax — the same as greedy decoding producing the answer."""
    B, T = input_ids.shape
    if bool(answer_mask[:, -1].any()):
        raise ValueError("answer_mask marks the last position, whose target is not in input_ids")
    n = answer_mask.sum(1)
    if bool((n == 0).any()):
        raise ValueError("a sample has no answer positions")
    pred = logits.argmax(-1)
    target = torch.cat([input_ids[:, 1:], input_ids.new_full((B, 1), -1)], dim=1)
    ok = pred == target
    return {"samples": B, "exact": int((ok | ~answer_mask).all(1).sum()), "tokens": int(n.sum()),
            "token_hits": int((ok & answer_mask).sum())}


def answer_accuracy(logits: torch.Tensor, input_ids: torch.Tensor, answer_mask: torch.Tensor) -> dict[str, float]:
    """`exact_match` (fraction of samples answered exactly) and `token_accuracy` (fraction of answer tokens)."""
    c = answer_counts(logits, input_ids, answer_mask)
    return {"exact_match": c["exact"] / c["samples"], "token_accuracy": c["token_hits"] / c["tokens"]}


@torch.no_grad()
def evaluate(model: Callable, task: LongContextTask, n: int = 32, batch_size: int = 4, start: int = 10**9,
             device: torch.device | str | None = None) -> dict[str, float]:
    """Answer accuracy of `model` on samples start … start+n-1 (far from the training indices by default).
    `model(input_ids=…, cu_seqlens=…)` must return logits [B, T, V] or an object with `.logits`."""
    tot = {"samples": 0, "exact": 0, "tokens": 0, "token_hits": 0}
    for b in range(0, n, batch_size):
        samples = [task.sample(start + i) for i in range(b, min(n, b + batch_size))]
        batch = collate(samples)
        mask = torch.stack([s["answer_mask"] for s in samples])
        x = batch["input_ids"].to(device) if device is not None else batch["input_ids"]
        out = model(input_ids=x, cu_seqlens=batch["cu_seqlens"].to(x.device))
        logits = out.logits if hasattr(out, "logits") else out
        for k, v in answer_counts(logits.float().cpu(), batch["input_ids"], mask).items():
            tot[k] += v
    return {"exact_match": tot["exact"] / tot["samples"], "token_accuracy": tot["token_hits"] / tot["tokens"]}


__all__ = ["Fact", "LongContextTask", "SampleSpec", "answer_accuracy", "answer_counts", "evaluate"]
