"""Token ids ↔ text for the server: the chat prompt, incremental detokenization, and each choice's output
state (streaming chat parse or plain text, stop strings, log-probs, finish reason).

This is the only module of `k3.serve` that knows the chat format (`k3.io.chat`): swapping the format
touches this file alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..io import chat
from .request import RequestOutput
from .stop import StopChecker

ChatFormatError = chat.ChatFormatError   # a conversation the format cannot express (a ValueError with `.param`)


def render_chat(tokenizer, messages: list[dict], *, tools: list[dict] | None = None, tool_choice: Any = None,
                response_format: dict | None = None, reasoning_effort: str | None = None,
                thinking: bool = True) -> list[int]:
    """Prompt ids of a conversation, ending with the assistant's generation prompt (the official K3
    encoding: thinking mode always carries a thinking-effort message, `max` by default)."""
    return chat.encode(tokenizer, messages, tools, tool_choice=tool_choice, response_format=response_format,
                       reasoning_effort=reasoning_effort, thinking=thinking)


def end_of_message_id(tokenizer) -> int:
    """The id that ends an assistant message (a chat request stops on it unless `ignore_eos`)."""
    return tokenizer.special_tokens[chat.END_OF_MSG]


def decode_text(tokenizer, ids: list[int]) -> str:
    """Text of `ids`, dropping ids the tokenizer cannot decode (e.g. a prompt echo)."""
    return chat.safe_decode(tokenizer, ids)


def token_str(tokenizer, t: int) -> tuple[str, list[int]]:
    """(text, UTF-8 bytes) of one token, for log-prob entries; undecodable ids give ("", [])."""
    try:
        b = tokenizer.decode_bytes([t]) if hasattr(tokenizer, "decode_bytes") else tokenizer.decode([t]).encode()
    except (ValueError, KeyError):
        b = b""
    return b.decode("utf-8", errors="replace"), list(b)


class IncrementalText:
    """Incremental detokenizer (special ids skipped): holds ids that end in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok = tokenizer
        self.specials = set(tokenizer.special_tokens.values()) if skip_special else set()
        self.pending: list[int] = []

    def feed(self, ids, final: bool = False) -> str:
        self.pending += [i for i in ids if i not in self.specials]
        text, self.pending = chat.decode_stable(self.tok, self.pending, final)
        return text


def _apply_stop(stop: StopChecker, deltas: list[chat.Delta], final: bool) -> list[chat.Delta]:
    """Run chat deltas through the stop checker (content only; a content region ends at any other delta)."""
    out: list[chat.Delta] = []

    def add(kind, text):
        if text:
            if out and out[-1].kind == kind:
                out[-1].text += text
            else:
                out.append(chat.Delta(kind, text))

    for d in deltas:
        if stop.hit:
            break
        if d.kind == "content":
            add("content", stop.feed(d.text))
        else:
            add("content", stop.flush())
            if d.kind == "reasoning":
                add("reasoning", d.text)
            else:
                out.append(d)
    if final and not stop.hit:
        add("content", stop.flush())
    return out


@dataclass
class Choice:
    """One choice of a response, built from its engine request's outputs.

    Chat choices (`chat=True`) parse the stream into deltas (kind "reasoning" / "content" / "tool_call" /
    "arguments", see `chat.Delta`) and accumulate `message`; completion choices detokenize into `completion`.
    Stop strings cut the visible text (chat content, not reasoning); a hit sets finish_reason "stop" and
    `stop_hit` (the caller then aborts the engine request)."""
    index: int
    rid: str
    stop: StopChecker
    prompt_index: int = 0
    parser: Any = None                   # chat: the streaming parser
    text: IncrementalText | None = None  # completions
    message: chat.ParsedMessage = field(default_factory=chat.ParsedMessage)
    completion: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0
    finish_reason: str | None = None

    @classmethod
    def for_chat(cls, tokenizer, index: int, rid: str, stops: list[str], thinking: bool = True) -> "Choice":
        return cls(index, rid, StopChecker(stops),
                   parser=chat.ChatStreamParser(tokenizer, inside="think" if thinking else "response"))

    @classmethod
    def for_completion(cls, tokenizer, index: int, rid: str, stops: list[str], prompt_index: int) -> "Choice":
        return cls(index, rid, StopChecker(stops), prompt_index=prompt_index, text=IncrementalText(tokenizer))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_hit(self) -> bool:
        return self.stop.hit

    @property
    def reasoning_tokens(self) -> int:
        return self.parser.num_reasoning_tokens if self.parser is not None else 0

    def update(self, out: RequestOutput) -> tuple[Any, list[tuple[int, float]]]:
        """Apply one engine output: (deltas (chat) or text (completion) now visible, new (token, logprob))."""
        self.cached = out.num_cached_tokens
        new = list(out.new_token_ids)
        self.token_ids += new
        lp_new: list[tuple[int, float]] = []
        if out.logprobs is not None:  # the new tokens' (the tail: cumulative and delta outputs alike)
            lps = out.logprobs[len(out.logprobs) - len(new):] if new else []
            self.logprobs += lps
            lp_new = list(zip(new[-len(lps):] if lps else [], lps))
        if self.parser is not None:
            deltas = self.parser.feed_ids(new)
            if out.finished:
                deltas += self.parser.finish()
            payload: Any = _apply_stop(self.stop, deltas, out.finished)
            self.message.apply(payload)
        else:
            text = self.stop.feed(self.text.feed(new, final=out.finished))
            if out.finished and not self.stop.hit:
                text += self.stop.flush()
            self.completion += text
            payload = text
        if self.stop.hit:
            self.finish_reason = "stop"
        elif out.finished:
            reason = out.finish_reason or "stop"
            if reason == "stop" and self.message.tool_calls:
                reason = "tool_calls"
            self.finish_reason = reason
        return payload, lp_new
