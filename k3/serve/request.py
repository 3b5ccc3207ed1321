"""Request-level types: `SamplingParams` (what the caller asks for), `RequestOutput` (what it gets back) and
the engine's internal per-request state `Sequence`."""

from __future__ import annotations

from array import array

import itertools
import math
import time
from dataclasses import asdict, dataclass, field

import torch


OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class SamplingParams:
    """Per-request generation settings.

    temperature 0 = greedy (any finite positive temperature samples; a tiny one, e.g. 1e-50, gives the
    argmax as its limit does); top_k 0 = off; seed makes the request's samples reproducible regardless of
    what else is batched with it. `stop_token_ids` and the model's EOS (unless `ignore_eos`) end generation
    with finish_reason "stop" (the stop token is kept in `token_ids`); `stop` strings need the engine's
    `detokenize` and end generation once the decoded output contains one (tokens are kept up to and
    including the one that completed it; trimming the text is the caller's job).
    `output_kind` (as vLLM's): "cumulative" — each step's `RequestOutput.token_ids` / `logprobs` hold everything
    generated so far; "delta" — only this step's (O(1) per token instead of O(output so far): long generations,
    RL rollouts); "final_only" — no output until the request finishes, then the cumulative one.
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    output_kind: str = "cumulative"

    def __post_init__(self):
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    """Progress of one request. `prompt_token_ids`: the prompt, one list shared by every output of the
    request (treat it as read-only); `token_ids` = every generated token so far, `new_token_ids` = those of
    this step; `logprobs` (when requested) has one entry per generated token: log p(token) under the
    model's distribution (log-softmax of the raw logits, before temperature / top-k / top-p)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (this request alone failed; stop_reason says why) | None
    num_cached_tokens: int
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the request


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Engine-internal state of one request (identity-compared). The prompt is kept as the int64 array
    `Engine.submit` checked (`prompt_ids`); `prompt`, its list, is built on first use only: a 16K-token prefix hit
    reads just its tail, and converting 16K ids to Python ints (0.2 ms) would sit on its time to first token."""
    request_id: str
    prompt_ids: array
    params: SamplingParams
    eos: tuple[int, ...]
    generator: torch.Generator | None = None
    group: str | None = None    # fairness group (e.g. the HTTP request of n choices); None = its own
    arrival: float = field(default_factory=time.monotonic)
    order: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    emitted: int = 0            # output tokens already returned by step()
    # pool state (valid while running)
    mla_pages: list[int] = field(default_factory=list)
    state_page: int | None = None
    snap_page: int | None = None  # KDA slot holding the state at `snap_pos` (latest fine boundary in decode)
    snap_pos: int = 0
    num_computed: int = 0       # tokens whose KV / state are in the pool
    num_registered: int = 0     # fine hash blocks registered in the prefix cache
    ckpt_positions: list[int] = field(default_factory=list)  # wanted KDA checkpoints (ascending)
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full fine blocks of `tokens`
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    preempted: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    restore: "PausedRequest | None" = None  # pool state to copy in at the next admission (Engine.resume)
    cacheable: bool = True      # False for a restored sequence: its state may come from older weights
    failures: int = 0           # failed forwards it was part of (Engine._forward_failed)
    prompt_copy: list[int] | None = field(default=None, repr=False)  # the outputs' shared prompt_token_ids
    _prompt: list[int] | None = field(default=None, repr=False)  # `prompt`, once built

    def __post_init__(self):
        if not isinstance(self.prompt_ids, array) or self.prompt_ids.typecode != "q":
            raise TypeError(f"Sequence.prompt_ids must be an array('q'), got {type(self.prompt_ids).__name__}")

    @property
    def prompt(self) -> list[int]:
        """The prompt as a list of ints (built from `prompt_ids` on first use; treat it as read-only)."""
        if self._prompt is None:
            self._prompt = self.prompt_ids.tolist()
        return self._prompt

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, n: int) -> list[int]:
        """tokens[start:start + n] without building the whole prompt + output list (a decode step needs one)."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.output[start - P:start - P + n]
        head = self._prompt[start:start + n] if self._prompt is not None else self.prompt_ids[start:start + n].tolist()
        return head if start + n <= P else head + self.output[:start + n - P]

    def input_ids(self, start: int, n: int) -> "array | list[int]":
        """tokens[start:start + n] as a forward's input: inside the prompt an int64 array slice (a memcpy: a prefill
        chunk's 8K ids reach the graph's input buffer without becoming Python ints, ≈ 0.2 ms of host work before
        the chunk's forward otherwise), else a list (`token_slice`)."""
        if start + n <= len(self.prompt_ids):
            return self.prompt_ids[start:start + n]
        return self.token_slice(start, n)

    def token_bytes(self, start: int, end: int):
        """tokens[start:end] as int64 bytes (a view of `prompt_ids` inside the prompt: no conversion)."""
        if end <= len(self.prompt_ids):
            return memoryview(self.prompt_ids)[start:end]
        return array("q", self.token_slice(start, end - start))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output)

    def output_prompt(self) -> list[int]:
        """The outputs' prompt_token_ids: one list per request, built once (a copy: a caller that edits it does
        not change the engine's prompt). `Engine._finish` builds it while the device computes the step."""
        if self.prompt_copy is None:  # a list copy is 10x cheaper than converting the array again
            self.prompt_copy = list(self._prompt) if self._prompt is not None else self.prompt_ids.tolist()
        return self.prompt_copy

    def to_output(self) -> RequestOutput:
        """This step's output (see `SamplingParams.output_kind`); marks the new tokens as emitted. The prompt
        is copied once per request and shared by its outputs (not once per step: O(prompt) per token)."""
        start, new = self.emitted, self.output[self.emitted:]
        self.emitted = len(self.output)
        first = start if self.params.output_kind == "delta" else 0  # delta: this step's tokens only
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.output_prompt(), token_ids=self.output[first:],
            new_token_ids=new, logprobs=self.logprobs[first:] if self.params.logprobs else None,
            finished=self.finished, finish_reason=self.finish_reason,
            num_cached_tokens=max(self.num_cached_tokens, 0), stop_reason=self.stop_reason)


@dataclass(eq=False)
class PausedRequest:
    """A request taken out of the engine with its model state (`Engine.pause`), to be continued exactly by
    `Engine.resume`: the KDA slot bytes (fp32 states and conv windows of every KDA layer) and the MLA latent
    rows of positions [0, num_computed) of every MLA layer, in host memory. `prompt`, `output` and `logprobs`
    are the request's so far; its sampler generator travels with it."""
    seq: Sequence
    num_computed: int
    kda_slot: torch.Tensor | None      # uint8 [slot bytes] (None: nothing computed yet)
    mla_rows: torch.Tensor | None      # [n_mla, num_computed, C + R] in the pool dtype

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def prompt(self) -> list[int]:
        return self.seq.prompt_ids.tolist()

    @property
    def output(self) -> list[int]:
        return list(self.seq.output)

    @property
    def logprobs(self) -> list[float]:
        return list(self.seq.logprobs)

    def state_dict(self) -> dict:
        """Plain tensors, lists and strings (`torch.save(..., weights_only=True)` loads it): to keep a paused
        request in a checkpoint (RL carries its partial rollouts across a restart)."""
        s = self.seq
        return {"request_id": s.request_id, "prompt": s.prompt_ids.tolist(), "output": list(s.output),
                "logprobs": list(s.logprobs), "params": asdict(s.params), "eos": list(s.eos), "group": s.group,
                "generator": None if s.generator is None else s.generator.get_state(),
                "generator_device": None if s.generator is None else str(s.generator.device),
                "num_computed": self.num_computed, "kda_slot": self.kda_slot, "mla_rows": self.mla_rows}

    @classmethod
    def from_state_dict(cls, d: dict) -> "PausedRequest":
        """The paused request `state_dict` saved (its sampler generator state restored), for `Engine.resume`."""
        params = dict(d["params"])
        params["stop_token_ids"] = tuple(params.get("stop_token_ids", ()))
        params["stop"] = tuple(params.get("stop", ()))
        gen = None
        if d["generator"] is not None:
            gen = torch.Generator(device=d["generator_device"])
            gen.set_state(d["generator"])
        seq = Sequence(request_id=d["request_id"], prompt_ids=array("q", d["prompt"]), params=SamplingParams(**params),
                       eos=tuple(d["eos"]), generator=gen, group=d["group"])
        seq.output, seq.logprobs = list(d["output"]), list(d["logprobs"])
        seq.emitted = len(seq.output)
        return cls(seq, d["num_computed"], d["kda_slot"], d["mla_rows"])

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kda_slot, self.mla_rows) if t is not None)
