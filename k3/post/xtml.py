"""K3's XTML chat format: render OpenAI-style conversations to token ids, parse generated ids back.

Layout (markers are single special tokens; everything else is plain BPE with specials *disallowed*, so no
user, tool, tag or attribute text can ever produce a marker id)::

    [BOS]
    <|open|>message role="system"<|sep|>You are …<|end_of_msg|>
    <|open|>message role="system" type="tool-declare"<|sep|>[{…tools, sorted keys…}]<|end_of_msg|>
    <|open|>message role="system" type="tool-choice"<|sep|>required<|end_of_msg|>
    <|open|>message role="system" type="response-format"<|sep|>{"type": "json_object"}<|end_of_msg|>
    <|open|>message role="system" type="thinking-effort"<|sep|>high<|end_of_msg|>
    <|open|>message role="user" name="bob"<|sep|>What's the weather?<|end_of_msg|>
    <|open|>message role="assistant"<|sep|>
        <|open|>think<|sep|>reasoning<|close|>think<|sep|>
        <|open|>response<|sep|>visible answer<|close|>response<|sep|>
        <|open|>tools<|sep|>
            <|open|>call tool="get_weather" index="0"<|sep|>
                <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
                <|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>
            <|close|>call<|sep|>
        <|close|>tools<|sep|>
    <|end_of_msg|>
    <|open|>message role="tool" tool="get_weather" index="0"<|sep|>{"temp": 21}<|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>          ← generation prompt

(whitespace above is for reading only; none is rendered between markers). A message is closed by
`<|end_of_msg|>`, which is also the generation stop. Argument types are string|number|boolean|null|object|
array; arguments that are not a JSON object go into one `<|open|>json type="object"<|sep|>raw<|close|>json<|sep|>`
block. Tool results are reordered to the order of the calls they answer. Attribute values escape `&` and `"`
as `&amp;` and `&quot;`. The per-request system messages (declarations, choice, format, effort) come right
after the leading system messages so that later turns of a conversation extend earlier prompts exactly
(prefix-cache friendly). Without `reasoning_effort` no effort message is rendered (the model's default is max).

`XTMLStreamParser` turns generated ids back into reasoning / content / tool-call deltas, one token at a
time (for SSE streaming); accumulating its deltas gives the complete message. It never raises on model
output: markup it cannot interpret is passed through as literal text, so nothing is silently dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

OPEN, CLOSE, SEP, END_OF_MSG, BOS = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[BOS]"
REASONING_EFFORTS = ("low", "high", "max")
ARGUMENT_TYPES = ("string", "number", "boolean", "null", "object", "array")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_HEADER_TOKENS = 256  # longer `<|open|>…` runs without `<|sep|>` are passed through as text


class Tokenizer(Protocol):
    special_tokens: dict[str, int]

    def encode(self, text: str, allow_special: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str: ...


class XTMLError(ValueError):
    """A conversation that cannot be rendered (bad role, dangling tool result, …); `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------------------------- rendering

def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _header(tag: str, **attrs: Any) -> str:
    parts = [tag] + [f'{k.replace("_", "-")}="{escape_attr(str(v))}"' for k, v in attrs.items() if v is not None]
    return " ".join(parts)


class _Builder:
    """Collects (is_marker, text) segments."""

    def __init__(self):
        self.segments: list[tuple[bool, str]] = []

    def marker(self, m: str) -> None:
        self.segments.append((True, m))

    def text(self, t: str) -> None:
        if t:
            self.segments.append((False, t))

    def open(self, tag: str, **attrs: Any) -> None:
        self.marker(OPEN)
        self.text(_header(tag, **attrs))
        self.marker(SEP)

    def close(self, tag: str) -> None:
        self.marker(CLOSE)
        self.text(tag)
        self.marker(SEP)

    def block(self, tag: str, body: str, **attrs: Any) -> None:
        self.open(tag, **attrs)
        self.text(body)
        self.close(tag)

    def message(self, body: str, **attrs: Any) -> None:
        self.open("message", **attrs)
        self.text(body)
        self.marker(END_OF_MSG)


def _content_text(content: Any, where: str) -> str:
    """OpenAI message content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise XTMLError(f"{where}[{i}]: only text content parts are supported, got {kind!r}",
                                f"{where}[{i}]")
            out.append(part["text"])
        return "".join(out)
    raise XTMLError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}", where)


def _argument_blocks(b: _Builder, arguments: str) -> None:
    """Typed `argument` children for a JSON-object argument string, else one raw `json` block."""
    try:
        parsed = json.loads(arguments, parse_constant=_reject_constant)
    except (ValueError, TypeError):
        parsed = None
    if not isinstance(parsed, dict):
        b.block("json", arguments, type="object")
        return
    for key, value in parsed.items():
        if isinstance(value, str):
            typ, text = "string", value
        elif isinstance(value, bool):
            typ, text = "boolean", "true" if value else "false"
        elif value is None:
            typ, text = "null", "null"
        elif isinstance(value, (int, float)):
            typ, text = "number", json.dumps(value)
        elif isinstance(value, dict):
            typ, text = "object", json.dumps(value, ensure_ascii=False)
        else:
            typ, text = "array", json.dumps(value, ensure_ascii=False)
        b.block("argument", text, key=key, type=typ)


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _tool_declarations(tools: list[dict]) -> str:
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise XTMLError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        name = t["function"].get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise XTMLError(f"tools[{i}].function.name: {name!r} must match [A-Za-z0-9_-]{{1,64}}",
                            f"tools[{i}].function.name")
    names = [t["function"]["name"] for t in tools]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise XTMLError(f"tools: duplicate function names {sorted(dup)}", "tools")
    return json.dumps(tools, sort_keys=True, ensure_ascii=False)


def build_segments(messages: list[dict], *, tools: list[dict] | None = None, tool_choice: Any = None,
                   response_format: dict | None = None, reasoning_effort: str | None = None,
                   thinking: bool = True, add_generation_prompt: bool = True,
                   add_bos: bool = True) -> list[tuple[bool, str]]:
    """The conversation as (is_marker, text) segments; raises XTMLError for an invalid conversation.

    `messages` are OpenAI chat messages as dicts (roles system, developer (= system), user, assistant, tool);
    assistant messages may carry `reasoning_content` (or `reasoning`) and `tool_calls`; tool messages carry
    `tool_call_id`, which must name a call of the closest preceding assistant message.
    """
    if not isinstance(messages, list) or not messages:
        raise XTMLError("messages: expected a non-empty list", "messages")
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise XTMLError(f"reasoning_effort: {reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)}",
                        "reasoning_effort")
    b = _Builder()
    if add_bos:
        b.marker(BOS)

    def role_of(i: int, m: Any) -> str:
        if not isinstance(m, dict):
            raise XTMLError(f"messages[{i}]: expected an object, got {type(m).__name__}", f"messages[{i}]")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise XTMLError(f"messages[{i}].role: {role!r} is not one of system, developer, user, assistant, tool",
                            f"messages[{i}].role")
        return "system" if role == "developer" else role

    roles = [role_of(i, m) for i, m in enumerate(messages)]
    n_lead = 0
    while n_lead < len(messages) and roles[n_lead] == "system":
        n_lead += 1
    for i in range(n_lead):
        _plain_message(b, messages[i], "system", i)

    names: list[str] = []
    if tools:
        if not isinstance(tools, list):
            raise XTMLError("tools: expected a list", "tools")
        b.message(_tool_declarations(tools), role="system", type="tool-declare")
        names = [t["function"]["name"] for t in tools]
    if tool_choice is not None and tool_choice != "auto":
        if tool_choice in ("required", "none"):
            if tool_choice == "required" and not tools:
                raise XTMLError("tool_choice: 'required' needs tools", "tool_choice")
            b.message(tool_choice, role="system", type="tool-choice")
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            name = (tool_choice.get("function") or {}).get("name")
            if name not in names:
                raise XTMLError(f"tool_choice: function {name!r} is not among the declared tools {names}",
                                "tool_choice")
            b.message(json.dumps({"function": {"name": name}, "type": "function"}, sort_keys=True),
                      role="system", type="tool-choice")
        else:
            raise XTMLError(f"tool_choice: {tool_choice!r} is not 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': …}}", "tool_choice")
    if response_format is not None and response_format.get("type") != "text":
        if response_format.get("type") not in ("json_object", "json_schema"):
            raise XTMLError(f"response_format.type: {response_format.get('type')!r} is not one of text, "
                            "json_object, json_schema", "response_format")
        b.message(json.dumps(response_format, sort_keys=True, ensure_ascii=False), role="system",
                  type="response-format")
    if reasoning_effort is not None:
        b.message(reasoning_effort, role="system", type="thinking-effort")

    i = n_lead
    pending_calls: dict[str, tuple[str, int]] = {}      # tool_call_id -> (name, index) of the last assistant
    while i < len(messages):
        role = roles[i]
        if role == "tool":
            j = i
            while j < len(messages) and roles[j] == "tool":
                j += 1
            _tool_results(b, messages, i, j, pending_calls)
            pending_calls = {}
            i = j
            continue
        if pending_calls:
            raise XTMLError(f"messages[{i}]: the assistant's tool calls {sorted(pending_calls)} have no tool "
                            "result messages", f"messages[{i}]")
        if role == "assistant":
            pending_calls = _assistant_message(b, messages[i], i)
        else:
            _plain_message(b, messages[i], role, i)
        i += 1
    if add_generation_prompt:
        if pending_calls:
            raise XTMLError(f"messages: the assistant's tool calls {sorted(pending_calls)} have no tool "
                            "result messages", "messages")
        b.open("message", role="assistant")
        b.open("think" if thinking else "response")
    return b.segments


def _plain_message(b: _Builder, m: dict, role: str, i: int) -> None:
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise XTMLError(f"messages[{i}].name: expected a string", f"messages[{i}].name")
    if "content" not in m or m["content"] is None:
        raise XTMLError(f"messages[{i}].content: a {role} message needs content", f"messages[{i}].content")
    b.message(_content_text(m["content"], f"messages[{i}].content"), role=role, name=name)


def _assistant_message(b: _Builder, m: dict, i: int) -> dict[str, tuple[str, int]]:
    content = _content_text(m.get("content"), f"messages[{i}].content")
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise XTMLError(f"messages[{i}].reasoning_content: expected a string", f"messages[{i}].reasoning_content")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise XTMLError(f"messages[{i}].tool_calls: expected a list", f"messages[{i}].tool_calls")
    name = m.get("name")
    b.open("message", role="assistant", name=name if isinstance(name, str) else None)
    if reasoning is not None:
        b.block("think", reasoning)
    if content or not calls:
        b.block("response", content)
    ids: dict[str, tuple[str, int]] = {}
    if calls:
        b.open("tools")
        for k, c in enumerate(calls):
            where = f"messages[{i}].tool_calls[{k}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise XTMLError(f"{where}.function.name: expected a non-empty string", f"{where}.function.name")
            args = fn.get("arguments", "")
            if not isinstance(args, str):
                raise XTMLError(f"{where}.function.arguments: expected a JSON string", f"{where}.function.arguments")
            cid = c.get("id")
            if not isinstance(cid, str) or not cid:
                raise XTMLError(f"{where}.id: expected a non-empty string", f"{where}.id")
            if cid in ids:
                raise XTMLError(f"{where}.id: duplicate tool call id {cid!r}", f"{where}.id")
            ids[cid] = (fn["name"], k)
            b.open("call", tool=fn["name"], index=k)
            _argument_blocks(b, args)
            b.close("call")
        b.close("tools")
    b.marker(END_OF_MSG)
    return ids


def _tool_results(b: _Builder, messages: list[dict], start: int, stop: int,
                  calls: dict[str, tuple[str, int]]) -> None:
    if not calls:
        raise XTMLError(f"messages[{start}]: a tool message must follow an assistant message with tool_calls",
                        f"messages[{start}]")
    seen: dict[str, int] = {}
    for i in range(start, stop):
        cid = messages[i].get("tool_call_id")
        if cid not in calls:
            raise XTMLError(f"messages[{i}].tool_call_id: {cid!r} is not one of the preceding assistant's tool "
                            f"call ids {sorted(calls)}", f"messages[{i}].tool_call_id")
        if cid in seen:
            raise XTMLError(f"messages[{i}].tool_call_id: {cid!r} already answered by messages[{seen[cid]}]",
                            f"messages[{i}].tool_call_id")
        seen[cid] = i
    missing = sorted(set(calls) - set(seen))
    if missing:
        raise XTMLError(f"messages[{stop - 1}]: tool calls {missing} have no tool result message",
                        f"messages[{stop - 1}]")
    for cid, _ in sorted(calls.items(), key=lambda kv: kv[1][1]):
        m = messages[seen[cid]]
        name, index = calls[cid]
        b.message(_content_text(m.get("content"), f"messages[{seen[cid]}].content"), role="tool", tool=name,
                  index=index)


def encode_segments(tokenizer: Tokenizer, segments: list[tuple[bool, str]]) -> list[int]:
    """Markers with specials allowed (each must be exactly one id); all other text with specials disallowed."""
    ids: list[int] = []
    for is_marker, text in segments:
        if is_marker:
            m = tokenizer.encode(text, allow_special=True)
            if len(m) != 1 or m[0] != tokenizer.special_tokens.get(text):
                raise ValueError(f"tokenizer does not encode marker {text!r} as one special token (got {m})")
            ids.extend(m)
        else:
            ids.extend(tokenizer.encode(text, allow_special=False))
    return ids


def render(tokenizer: Tokenizer, messages: list[dict], **kwargs: Any) -> list[int]:
    """Token ids of a conversation (see `build_segments` for the keyword arguments)."""
    return encode_segments(tokenizer, build_segments(messages, **kwargs))


def segments_to_text(segments: list[tuple[bool, str]]) -> str:
    return "".join(t for _, t in segments)


# ----------------------------------------------------------------------------------------------- parsing

@dataclass
class Delta:
    """One piece of parsed output. kind: "reasoning" | "content" (text), "tool_call" (a new call: index, id,
    name) or "arguments" (text appended to call `index`'s JSON arguments)."""
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

    def apply(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if d.kind == "reasoning":
                self.reasoning_content += d.text
            elif d.kind == "content":
                self.content += d.text
            elif d.kind == "tool_call":
                self.tool_calls.append(ToolCall(d.id, d.name))
            else:
                self.tool_calls[d.index].arguments += d.text


_ATTR = re.compile(r'\s+([A-Za-z_][\w-]*)="([^"]*)"')


def parse_header(text: str) -> tuple[str, dict[str, str]] | None:
    """`tag k="v" …` → (tag, attrs), or None if it is not of that form."""
    m = re.match(r"([A-Za-z_][\w-]*)", text)
    if not m:
        return None
    attrs: dict[str, str] = {}
    pos = m.end()
    while pos < len(text):
        a = _ATTR.match(text, pos)
        if not a:
            return None
        attrs[a.group(1)] = unescape_attr(a.group(2))
        pos = a.end()
    return m.group(1), attrs


def safe_decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """`tokenizer.decode(ids)`, dropping ids the tokenizer cannot decode (e.g. regular ids a small trained
    BPE left empty, which a random model may still sample) instead of raising."""
    try:
        return tokenizer.decode(ids)
    except (ValueError, KeyError):
        ok = []
        for i in ids:
            try:
                tokenizer.decode([i])
            except (ValueError, KeyError):
                continue
            ok.append(i)
        return tokenizer.decode(ok)


def decode_stable(tokenizer: Tokenizer, ids: list[int], final: bool = False) -> tuple[str, list[int]]:
    """(text, held ids): the text of `ids` except a tail of at most 3 ids that ends in an incomplete UTF-8
    sequence, which is held back for the next call (everything is emitted when `final`)."""
    if not ids:
        return "", []
    text = safe_decode(tokenizer, ids)
    if final or not text.endswith("\ufffd"):
        return text, []
    for k in range(1, min(3, len(ids) - 1) + 1):
        head = safe_decode(tokenizer, ids[:-k])
        if not head.endswith("\ufffd"):
            return head, list(ids[-k:])
    return ("", list(ids)) if len(ids) < 4 else (text, [])


class XTMLStreamParser:
    """Incremental parser of the ids generated after a generation prompt.

    `feed(ids)` returns the deltas those ids complete; `finish()` flushes held-back text and closes open tool
    calls. Text is held back only while it ends in an incomplete UTF-8 sequence (at most a few tokens) or
    sits inside markup not yet closed by `<|sep|>`. Regions: think → reasoning; response and anything
    outside known blocks → content; argument/json blocks inside `call` → the call's JSON arguments.
    """

    def __init__(self, tokenizer: Tokenizer, *, thinking: bool = True, id_prefix: str = "call_"):
        self.tok = tokenizer
        sp = tokenizer.special_tokens
        self.open_id, self.close_id, self.sep_id, self.eom_id = sp[OPEN], sp[CLOSE], sp[SEP], sp[END_OF_MSG]
        self.special_ids = set(sp.values())
        self.id_prefix = id_prefix
        self.stack: list[str] = ["message", "think" if thinking else "response"]
        self.pending: list[int] = []            # text ids not yet emitted
        self.markup: list[int] | None = None    # ids of an open/close marker up to (excluding) <|sep|>
        self.n_calls = 0
        self.call: dict | None = None           # {"index", "mode": None|"typed"|"json", "n_args"}
        self.arg: dict | None = None            # {"key", "type", "buf"} for a typed argument being read
        self.done = False
        self.num_reasoning_tokens = 0           # ids consumed while inside `think`
        self.message = ParsedMessage()

    # -- text sinks
    def _sink(self) -> str:
        top = self.stack[-1] if self.stack else "message"
        if top == "think":
            return "reasoning"
        if top in ("argument", "json"):
            return "arguments"
        return "content"

    def _emit_text(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        sink = self._sink()
        if sink == "arguments":
            if self.arg is not None and self.arg["type"] != "string":
                self.arg["buf"] += text
                return
            if self.arg is not None:
                text = json.dumps(text, ensure_ascii=False)[1:-1]
            out.append(Delta("arguments", text, index=self.call["index"]))
        elif out and out[-1].kind == sink:
            out[-1].text += text
        else:
            out.append(Delta(sink, text))

    def _flush(self, out: list[Delta], final: bool = False) -> None:
        text, self.pending = decode_stable(self.tok, self.pending, final)
        self._emit_text(text, out)

    # -- public API
    def feed(self, ids: Sequence[int]) -> list[Delta]:
        out: list[Delta] = []
        for t in ids:
            if self.done:
                break
            if self.stack[-1] == "think":
                self.num_reasoning_tokens += 1
            self._token(int(t), out)
        self._flush(out)
        self.message.apply(out)
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.markup is not None:
            self._literal_markup(out)
        self._flush(out, final=True)
        self._end(out)
        self.message.apply(out)
        return out

    # -- state machine
    def _token(self, t: int, out: list[Delta]) -> None:
        if self.markup is not None:
            if t == self.sep_id:
                self._markup_done(out)
            elif t in (self.open_id, self.close_id, self.eom_id):
                self._literal_markup(out)
                self._token(t, out)
            else:
                self.markup.append(t)
                if len(self.markup) > MAX_HEADER_TOKENS:   # no tag header is this long: it was text
                    self._literal_markup(out)
            return
        if t in (self.open_id, self.close_id):
            self._flush(out, final=True)
            self.markup = [t]
        elif t == self.eom_id:
            self._flush(out, final=True)
            self._end(out)
            self.done = True
        elif t == self.sep_id:
            self._flush(out, final=True)
            self._emit_text(SEP, out)
        elif t in self.special_ids:
            return                                  # BOS, PAD, media and reserved tokens carry no text
        else:
            self.pending.append(t)
            if len(self.pending) >= 64:
                self._flush(out)

    def _literal_markup(self, out: list[Delta]) -> None:
        ids, self.markup = self.markup, None
        marker = OPEN if ids[0] == self.open_id else CLOSE
        self._emit_text(marker + safe_decode(self.tok, [i for i in ids[1:] if i not in self.special_ids]), out)

    def _markup_done(self, out: list[Delta]) -> None:
        ids = self.markup
        text = safe_decode(self.tok, [i for i in ids[1:] if i not in self.special_ids])
        if ids[0] == self.open_id:
            ok = self._open(parse_header(text), out)
        else:
            ok = self._close(text.strip(), out)
        if ok:
            self.markup = None
        else:
            self._literal_markup(out)
            self._emit_text(SEP, out)

    def _open(self, header: tuple[str, dict[str, str]] | None, out: list[Delta]) -> bool:
        if header is None:
            return False
        tag, attrs = header
        top = self.stack[-1]
        if tag in ("think", "response", "tools") and top in ("message", "think", "response"):
            if top != "message":
                self.stack.pop()                    # a new block implicitly closes think / response
            self.stack.append(tag)
            return True
        if tag == "call" and top == "tools" and attrs.get("tool"):
            index = self.n_calls
            self.n_calls += 1
            self.call = {"index": index, "mode": None, "n_args": 0}
            out.append(Delta("tool_call", index=index, id=f"{self.id_prefix}{uuid.uuid4().hex[:24]}",
                             name=attrs["tool"]))
            self.stack.append("call")
            return True
        if top == "call" and tag == "argument" and "key" in attrs and self.call["mode"] in (None, "typed"):
            prefix = "{" if self.call["mode"] is None else ", "
            self.call["mode"] = "typed"
            self.call["n_args"] += 1
            typ = attrs.get("type", "string")
            self.arg = {"key": attrs["key"], "type": typ if typ in ARGUMENT_TYPES else "string", "buf": ""}
            key = json.dumps(attrs["key"], ensure_ascii=False)
            out.append(Delta("arguments", f"{prefix}{key}: " + ('"' if self.arg["type"] == "string" else ""),
                             index=self.call["index"]))
            self.stack.append("argument")
            return True
        if top == "call" and tag == "json" and self.call["mode"] is None:
            self.call["mode"] = "json"
            self.stack.append("json")
            return True
        return False

    def _close(self, tag: str, out: list[Delta]) -> bool:
        if tag not in self.stack[1:]:
            return False
        while self.stack[-1] != tag:
            self._pop(out)
        self._pop(out)
        return True

    def _pop(self, out: list[Delta]) -> None:
        tag = self.stack.pop()
        if tag == "argument":
            self._flush(out, final=True)
            arg, self.arg = self.arg, None
            out.append(Delta("arguments", _typed_value(arg["type"], arg["buf"]), index=self.call["index"]))
        elif tag == "call":
            if self.call["mode"] in (None, "typed"):
                out.append(Delta("arguments", "{}" if self.call["n_args"] == 0 else "}", index=self.call["index"]))
            self.call = None

    def _end(self, out: list[Delta]) -> None:
        self._flush(out, final=True)
        while len(self.stack) > 1:
            self._pop(out)


def _typed_value(typ: str, text: str) -> str:
    """The JSON text of a typed argument value (the closing quote for strings); a value that does not fit
    its type is kept as a JSON string."""
    if typ == "string":
        return '"'
    s = text.strip()
    try:
        v = json.loads(s, parse_constant=_reject_constant)
    except (ValueError, TypeError):
        v = _MISSING
    ok = {"number": lambda: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda: isinstance(v, bool),
          "null": lambda: v is None,
          "object": lambda: isinstance(v, dict),
          "array": lambda: isinstance(v, list)}[typ]()
    if typ == "null" and s == "":
        return "null"
    return json.dumps(v, ensure_ascii=False) if ok else json.dumps(text, ensure_ascii=False)


_MISSING = object()


def parse(tokenizer: Tokenizer, ids: Sequence[int], *, thinking: bool = True) -> ParsedMessage:
    """Parse a complete generation (see XTMLStreamParser)."""
    p = XTMLStreamParser(tokenizer, thinking=thinking)
    p.feed(ids)
    p.finish()
    return p.message
