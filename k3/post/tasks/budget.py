"""Counted tokens for effort budgets (K3_SPEC §8): a trajectory whose count exceeds τ·b₀(x) gets reward −1.

- general tasks: thinking tokens, i.e. the tokens of every assistant message's `reasoning_content` as the
  chat format renders it (one text piece inside `<|open|>think<|sep|> … <|close|>think<|sep|>`);
- agent / coding tasks: every token the model emits in its assistant turns: each assistant message as
  rendered by `k3.io.chat`, from just after the generation prompt (`<|open|>message role="assistant"<|sep|>`
  and the `<|open|>think<|sep|>` that opens the turn) up to and including its `<|end_of_msg|>`, so reasoning,
  response, tool-call markup and tool arguments all count, and tool results and prompts do not.
Tokens are counted piece by piece exactly as `k3.io.chat.encode` tokenizes them.
"""

from __future__ import annotations

from typing import Any

from k3.io import chat

from .base import DOMAINS


def _messages_tools(conversation: Any, tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    if isinstance(conversation, list):
        return conversation, tools
    if isinstance(conversation, dict) and "messages" in conversation:
        return conversation["messages"], tools if tools is not None else conversation.get("tools")
    if hasattr(conversation, "messages"):
        return conversation.messages, tools if tools is not None else getattr(conversation, "tools", None)
    raise TypeError(f"conversation: expected a list of messages, a record with 'messages' or a Conversation, "
                    f"got {type(conversation).__name__}")


def assistant_spans(segs: list[chat.Segment]) -> list[tuple[int, int]]:
    """[start, end) piece ranges of what the model generates in each assistant message of `segs`."""
    spans = []
    i = 0
    while i < len(segs):
        if (segs[i] == (chat.OPEN, True) and i + 4 < len(segs) and segs[i + 1] == ("message", False)
                and segs[i + 2] == (" role", False) and segs[i + 4] == ("assistant", False)):
            h = next(j for j in range(i + 5, len(segs)) if segs[j] == (chat.SEP, True))
            start = h + 1
            if (start + 2 < len(segs) and segs[start] == (chat.OPEN, True) and segs[start + 2] == (chat.SEP, True)
                    and segs[start + 1][0] in ("think", "response")):
                start += 3   # the generation prompt opens the first block; the model writes from here
            end = next((j for j in range(start, len(segs)) if segs[j] == (chat.END_OF_MSG, True)), len(segs) - 1)
            spans.append((start, end + 1))
            i = end + 1
        else:
            i += 1
    return spans


def count_tokens(conversation: Any, tokenizer, domain: str, tools: list[dict] | None = None,
                 thinking: bool = True) -> int:
    """Tokens that count against the effort budget of `domain` (see the module docstring)."""
    if domain not in DOMAINS:
        raise ValueError(f"domain {domain!r} is not one of {', '.join(DOMAINS)}")
    messages, tools = _messages_tools(conversation, tools)
    if domain == "general":
        total = 0
        for m in messages:
            r = m.get("reasoning_content") or m.get("reasoning") if m.get("role") == "assistant" else None
            if thinking and r is not None and str(r).strip():
                total += len(tokenizer.encode(str(r), allow_special=False))
        return total
    segs = chat.segments(messages, tools, add_generation_prompt=False, thinking=thinking)
    return sum(len(chat.encode_segments(tokenizer, segs[a:b])) for a, b in assistant_spans(segs))
