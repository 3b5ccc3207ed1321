"""Parse a K3 assistant message (XTML) back into an OpenAI-shaped message, whole or streamed.

The input is what follows `<|open|>message role="assistant"<|sep|>`: `think` → reasoning_content,
`response` (and any text outside known blocks) → content, `tools` / `call` / `argument` → tool_calls with
JSON arguments (string arguments verbatim, other types JSON-decoded, a value that does not decode kept as a
string, a `json` block passed through). The message ends at `<|close|>message<|sep|>` or
`<|end_of_msg|>`; either may be missing (a cut generation).

`ChatStreamParser` takes text (`feed`) or token ids (`feed_ids`, the server's path) and returns deltas;
accumulating them gives exactly the whole-text result for every way of splitting the input. It never
raises on model output: markup it cannot interpret is passed through as literal text. On the token path
only special ids are markers, so text that merely looks like `<|open|>` stays text; on the text path the
marker strings are markers (the format has no escape for them).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .tokenizer import decode_stable

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
_MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in _MARKERS) + ")")
ARGUMENT_TYPES = ("string", "number", "boolean", "null", "object", "array")
MAX_HEADER_CHARS = 1024   # a longer `<|open|>…` without `<|sep|>` is passed through as text
_TAG = re.compile(r"([A-Za-z_][\w-]*)")
_ATTR = re.compile(r'\s+([A-Za-z_][\w-]*)="([^"]*)"')


@dataclass
class Delta:
    """One piece of parsed output. kind: "reasoning" | "content" (text), "tool_call" (a new call: index,
    id, name) or "arguments" (text appended to call `index`'s JSON arguments)."""
    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParsedMessage:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def apply(self, deltas: Sequence[Delta]) -> None:
        for d in deltas:
            if d.kind == "reasoning":
                self.reasoning_content += d.text
            elif d.kind == "content":
                self.content += d.text
            elif d.kind == "tool_call":
                self.tool_calls.append(ToolCall(d.id, d.name))
            else:
                self.tool_calls[d.index].arguments += d.text

    def to_dict(self) -> dict[str, Any]:
        """OpenAI assistant message: content (None when there are tool calls and no text),
        reasoning_content (None when empty), tool_calls (only when there are any)."""
        out: dict[str, Any] = {"role": "assistant",
                               "content": self.content if (self.content or not self.tool_calls) else None,
                               "reasoning_content": self.reasoning_content or None}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        return out


def parse_header(text: str) -> tuple[str, dict[str, str]] | None:
    """`tag k="v" …` → (tag, attrs with `&quot;` / `&amp;` undone), or None if it is not of that form."""
    m = _TAG.match(text)
    if not m:
        return None
    attrs: dict[str, str] = {}
    pos = m.end()
    while pos < len(text):
        a = _ATTR.match(text, pos)
        if not a:
            return None
        attrs[a.group(1)] = a.group(2).replace("&quot;", '"').replace("&amp;", "&")
        pos = a.end()
    return m.group(1), attrs


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _value_json(typ: str, raw: str) -> str:
    """The JSON text of a non-string argument: its decoded value, or the raw text as a JSON string."""
    if typ == "null" and not raw.strip():
        return "null"
    try:
        return json.dumps(json.loads(raw, parse_constant=_reject_constant), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


def _marker_prefix_len(s: str) -> int:
    """Length of the longest suffix of `s` that is a proper prefix of a marker (held back while streaming)."""
    for k in range(min(len(s), max(map(len, _MARKERS)) - 1), 0, -1):
        if any(m.startswith(s[-k:]) and m != s[-k:] for m in _MARKERS):
            return k
    return 0


class ChatStreamParser:
    """Incremental parser of one assistant message body.

    inside: the block the prompt left open ("think" or "response", as after the generation prompt), or
    None when the input starts at the message body. call_id: index → tool-call id (default: random
    `call_…` ids). `tokenizer` is needed only for `feed_ids`.
    """

    def __init__(self, tokenizer=None, *, inside: str | None = None, call_id: Callable[[int], str] | None = None):
        if inside not in (None, "think", "response"):
            raise ValueError(f"inside: {inside!r} is not None, 'think' or 'response'")
        self.tok = tokenizer
        self.stack: list[str] = [inside] if inside else []
        self.call_id = call_id or (lambda i: f"call_{uuid.uuid4().hex[:24]}")
        self.message = ParsedMessage()
        self.num_reasoning_tokens = 0           # token ids consumed while inside `think` (feed_ids)
        self.done = False
        self._tail = ""                         # text path: a held-back partial marker
        self._pending: list[int] = []           # token path: ids not yet decoded
        self._header: str | None = None         # text after <|open|> / <|close|>, before <|sep|>
        self._header_kind = OPEN
        self._n_calls = 0
        self._call: dict | None = None          # {"index", "mode": None | "typed" | "json", "n_args"}
        self._arg: dict | None = None           # {"type", "buf"} of the argument being read
        if tokenizer is not None:
            sp = tokenizer.special_tokens
            self._marker_ids = {sp[m]: m for m in _MARKERS if m in sp}

    # ---- front ends
    def feed(self, text: str) -> list[Delta]:
        """Deltas completed by `text` (a partial marker at its end waits for the next call)."""
        out: list[Delta] = []
        s = self._tail + text
        keep = _marker_prefix_len(s)
        self._tail = s[len(s) - keep:] if keep else ""
        for i, piece in enumerate(_SPLIT.split(s[:len(s) - keep])):
            if i % 2:
                self._marker(piece, out)
            elif piece:
                self._text(piece, out)
        return self._done(out)

    def feed_ids(self, ids: Sequence[int]) -> list[Delta]:
        """Deltas completed by generated token ids; only special ids are markers."""
        if self.tok is None:
            raise ValueError("feed_ids needs the parser to be built with a tokenizer")
        out: list[Delta] = []
        for t in ids:
            t = int(t)
            if self.done:
                break
            if self.stack and self.stack[-1] == "think":
                self.num_reasoning_tokens += 1
            if t in self._marker_ids:
                self._flush_ids(out, final=True)
                self._marker(self._marker_ids[t], out)
            else:
                self._pending.append(t)
        self._flush_ids(out, final=False)
        return self._done(out)

    def finish(self) -> list[Delta]:
        """Flush held-back input and close every open block (the message may have been cut)."""
        out: list[Delta] = []
        if self._tail:
            tail, self._tail = self._tail, ""
            self._text(tail, out)
        self._flush_ids(out, final=True)
        self._end(out)
        return self._done(out)

    def _done(self, out: list[Delta]) -> list[Delta]:
        self.message.apply(out)
        return out

    def _flush_ids(self, out: list[Delta], final: bool) -> None:
        if self._pending:
            text, self._pending = decode_stable(self.tok, self._pending, final)
            self._text(text, out)

    # ---- state machine
    def _text(self, t: str, out: list[Delta]) -> None:
        if self.done or not t:
            return
        if self._header is not None:
            self._header += t
            if len(self._header) > MAX_HEADER_CHARS:
                self._literal(out)
            return
        top = self.stack[-1] if self.stack else None
        if top == "think":
            self._emit("reasoning", t, out)
        elif top == "argument":
            if self._arg["type"] == "string":
                out.append(Delta("arguments", json.dumps(t, ensure_ascii=False)[1:-1], index=self._call["index"]))
            else:
                self._arg["buf"] += t
        elif top == "json":
            out.append(Delta("arguments", t, index=self._call["index"]))
        else:
            self._emit("content", t, out)

    @staticmethod
    def _emit(kind: str, t: str, out: list[Delta]) -> None:
        if out and out[-1].kind == kind:
            out[-1].text += t
        else:
            out.append(Delta(kind, t))

    def _marker(self, mk: str, out: list[Delta]) -> None:
        if self.done:
            return
        if self._header is not None:
            if mk == SEP:
                self._header_done(out)
                return
            self._literal(out)
        if mk in (OPEN, CLOSE):
            self._header_kind, self._header = mk, ""
        elif mk == END_OF_MSG:
            self._end(out)
            self.done = True
        else:
            self._text(SEP, out)          # a stray <|sep|> is text

    def _literal(self, out: list[Delta]) -> None:
        text, self._header = self._header_kind + self._header, None
        self._text(text, out)

    def _header_done(self, out: list[Delta]) -> None:
        text, self._header = self._header, None
        if self._header_kind == OPEN:
            h = parse_header(text)
            ok = h is not None and self._open(h[0], h[1], out)
        else:
            ok = self._close(text.strip(), out)
        if not ok:
            self._text(self._header_kind + text + SEP, out)

    def _open(self, tag: str, attrs: dict[str, str], out: list[Delta]) -> bool:
        top = self.stack[-1] if self.stack else None
        if tag in ("think", "response", "tools") and top in (None, "think", "response"):
            if top is not None:
                self.stack.pop()            # a new block implicitly closes think / response
            self.stack.append(tag)
            return True
        if tag == "call" and top == "tools" and attrs.get("tool"):
            index, self._n_calls = self._n_calls, self._n_calls + 1
            self._call = {"index": index, "mode": None, "n_args": 0}
            out.append(Delta("tool_call", index=index, id=self.call_id(index), name=attrs["tool"]))
            self.stack.append("call")
            return True
        if top == "call" and tag == "argument" and "key" in attrs and self._call["mode"] in (None, "typed"):
            typ = attrs.get("type", "string")
            self._arg = {"type": typ if typ in ARGUMENT_TYPES else "string", "buf": ""}
            lead = "{" if self._call["n_args"] == 0 else ", "
            self._call["mode"] = "typed"
            self._call["n_args"] += 1
            key = json.dumps(attrs["key"], ensure_ascii=False)
            out.append(Delta("arguments", f"{lead}{key}: " + ('"' if self._arg["type"] == "string" else ""),
                             index=self._call["index"]))
            self.stack.append("argument")
            return True
        if top == "call" and tag == "json" and self._call["mode"] is None:
            self._call["mode"] = "json"
            self.stack.append("json")
            return True
        return False

    def _close(self, tag: str, out: list[Delta]) -> bool:
        if tag == "message":
            self._end(out)
            self.done = True
            return True
        if tag not in self.stack:
            return False
        while self.stack[-1] != tag:
            self._pop(out)
        self._pop(out)
        return True

    def _pop(self, out: list[Delta]) -> None:
        tag = self.stack.pop()
        if tag == "argument":
            arg, self._arg = self._arg, None
            text = '"' if arg["type"] == "string" else _value_json(arg["type"], arg["buf"])
            out.append(Delta("arguments", text, index=self._call["index"]))
        elif tag == "call":
            if self._call["mode"] != "json":
                out.append(Delta("arguments", "}" if self._call["n_args"] else "{}", index=self._call["index"]))
            self._call = None

    def _end(self, out: list[Delta]) -> None:
        if self._header is not None:
            self._literal(out)
        while self.stack:
            self._pop(out)


def parse(body: str, *, call_id: Callable[[int], str] | None = None) -> dict[str, Any]:
    """The OpenAI assistant message of `body`, the text after `<|open|>message role="assistant"<|sep|>`
    (with or without the closing tags)."""
    p = ChatStreamParser(call_id=call_id)
    p.feed(body)
    p.finish()
    return p.message.to_dict()
