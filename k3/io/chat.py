"""K3's chat format (XTML), rendered as the release's `encoding_k3.py` renders it; parsing in `chat_parse`.

The rules below were written from reading the official encoder (the release's `encoding_k3.py`, vendored
by vLLM as `vllm/tokenizers/encoding_k3.py`); the tests pin them byte for byte. A conversation renders as
(whitespace for reading only; none is rendered between pieces, and there is no BOS)::

    <|open|>message role="system" type="tool-declare"<|sep|># Tools …```json\n[compact tools]\n```
        <|close|>message<|sep|><|end_of_msg|>                       ← if `tools`
    <|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides … `thinking_effort=max`.
        <|close|>message<|sep|><|end_of_msg|>                       ← always in thinking mode
    <|open|>message role="system"<|sep|>You are …<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user" name="bob"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|>
        <|open|>think<|sep|>reasoning<|close|>think<|sep|>          ← thinking mode only (even if empty)
        <|open|>response<|sep|>visible text<|close|>response<|sep|>  ← always (even if empty)
        <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
            <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
        <|close|>call<|sep|><|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="f" index="1"<|sep|>{"temp":21}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="system" type="tool-choice"<|sep|>…<|close|>message<|sep|><|end_of_msg|>   ← required/none
    <|open|>message role="system" type="response-format"<|sep|>…<|close|>message<|sep|><|end_of_msg|>   ← json
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>          ← generation prompt

Rules: tools and schemas are key-sorted recursively and dumped as compact JSON; argument values are raw
strings or `json.dumps` text (type string|number|boolean|null|object|array); arguments that are not JSON
render as one `json type="object"` block; call and tool-result `index` are 1-based; a run of tool results
is put in the order of the calls it answers when every `tool_call_id` matches one; a system message with
`tools` becomes a dynamic `## New Tools Available` declaration; image content parts become
`<|kimi_image_placeholder|>`. Each tag header is its own run of pieces (`message`, ` role`, `="`, value,
`"`), and `encode` tokenizes every piece separately, as the official encoder does: markers with specials
allowed, all other text (user text included) as plain text, so no content can forge a marker.

Two deliberate departures, both on inputs the official encoder mishandles silently: `developer` messages
render as `system` (the official encoder drops unknown roles), and inputs it would drop or render as
`null` (an unknown role, a system message with both `tools` and content, a named `tool_choice`, a
`json_schema` format without a schema) raise `ChatFormatError` instead.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, Sequence

from .chat_parse import CLOSE, END_OF_MSG, OPEN, SEP, ChatStreamParser, Delta, ParsedMessage, ToolCall, parse
from .tokenizer import decode_stable, safe_decode

__all__ = ["CLOSE", "END_OF_MSG", "IMAGE_PLACEHOLDER", "OPEN", "SEP", "THINKING_EFFORTS", "ChatFormatError",
           "ChatStreamParser", "Delta", "ParsedMessage", "ToolCall", "decode_stable", "encode", "encode_segments",
           "parse", "render", "safe_decode", "segments", "train_mask", "encode_with_mask"]

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "high", "max")
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)

Segment = tuple[str, bool]   # (text, allow_special)


class Tokenizer(Protocol):
    special_tokens: dict[str, int]

    def encode(self, text: str, allow_special: bool = False) -> list[int]: ...


class ChatFormatError(ValueError):
    """A conversation or option that cannot be rendered; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------------------------- pieces

class _Out:
    """Collects (text, allow_special) pieces; empty text is never emitted (as the official `_segment`)."""

    def __init__(self) -> None:
        self.segs: list[Segment] = []

    def ctrl(self, t: str) -> None:
        if t:
            self.segs.append((t, True))

    def text(self, t: str) -> None:
        if t:
            self.segs.append((t, False))

    def open(self, tag: str, *attrs: tuple[str, Any]) -> None:
        self.ctrl(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(str(value).replace("&", "&amp;").replace('"', "&quot;"))
            self.text('"')
        self.ctrl(SEP)

    def close(self, tag: str) -> None:
        self.ctrl(CLOSE)
        self.text(tag)
        self.ctrl(SEP)

    def end_message(self) -> None:
        self.close("message")
        self.ctrl(END_OF_MSG)

    def system(self, kind: str, body: str) -> None:
        """An internal system message (tool-declare, thinking-effort, tool-choice, response-format)."""
        self.open("message", ("role", "system"), ("type", kind))
        self.text(body.strip())
        self.end_message()


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _deep_sort(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_deep_sort(v) for v in obj]
    return obj


def _tool_declare(out: _Out, tools: Any, dynamic: bool) -> None:
    head = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
            if dynamic else "# Tools\nHere are the available tools, described in JSONSchema.\n\n")
    out.system("tool-declare", f"{head}```json\n{_compact(_deep_sort(tools))}\n```")


def _content(out: _Out, content: Any, where: str) -> None:
    """A string, None, or a list of parts: image / image_url parts become the image placeholder (a marker
    piece), every other part contributes its `text`."""
    if content is None:
        return
    if isinstance(content, str):
        out.text(content)
        return
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}: expected a string, null or a list of content parts, got "
                              f"{type(content).__name__}", where)
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatFormatError(f"{where}[{i}]: expected a content part object, got {type(part).__name__}",
                                  f"{where}[{i}]")
        if part.get("type") in ("image", "image_url"):
            out.ctrl(IMAGE_PLACEHOLDER)
        elif isinstance(part.get("text"), str):
            out.text(part["text"])
        else:
            raise ChatFormatError(f"{where}[{i}]: a {part.get('type')!r} part needs a string 'text' (or type "
                                  "'image' / 'image_url')", f"{where}[{i}]")


# ----------------------------------------------------------------------------------------------- options

def _options(thinking, enable_thinking, reasoning_effort, thinking_effort) -> tuple[bool, str]:
    """(thinking, effort) by the official rules: thinking on unless turned off; reasoning_effort="none"
    turns it off; otherwise reasoning_effort stands in for thinking_effort; the effort defaults to max."""
    if thinking is None:
        thinking = True if enable_thinking is None else bool(enable_thinking)
    param = "thinking_effort"
    if reasoning_effort == "none":
        thinking = False
    elif thinking_effort is None and reasoning_effort is not None:
        thinking_effort, param = reasoning_effort, "reasoning_effort"
    if thinking_effort is None:
        thinking_effort = "max"
    if thinking_effort not in THINKING_EFFORTS:
        raise ChatFormatError(f"{param}: {thinking_effort!r} is not one of {', '.join(THINKING_EFFORTS)}"
                              + (" (or 'none' to turn thinking off)" if param == "reasoning_effort" else ""), param)
    return bool(thinking), thinking_effort


def _tool_choice(out: _Out, tool_choice: Any) -> None:
    if tool_choice is None or tool_choice == "auto":
        return
    if tool_choice in ("required", "none"):
        must = "call tools" if tool_choice == "required" else "NOT call any tools"
        out.system("tool-choice", f"The system is invoked with `tool_choice={tool_choice}`.\n"
                                  f"You MUST {must} in the next message.")
        return
    raise ChatFormatError(f"tool_choice: {tool_choice!r} is not 'auto', 'required' or 'none' (K3's chat format "
                          "has no rendering for a named function choice)", "tool_choice")


def _response_format(out: _Out, rf: Any) -> None:
    if rf is None:
        return
    kind = rf.get("type") if isinstance(rf, dict) else rf
    if kind == "text":
        return
    lead = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
            "formatting.")
    if kind == "json_object":
        out.system("response-format", f"The system is invoked with `response_format=json_object`.\n{lead}")
        return
    if kind == "json_schema":
        js = rf.get("json_schema") if isinstance(rf, dict) else None
        schema = js.get("schema", js.get("json_schema", js)) if isinstance(js, dict) else js
        if schema is None:
            raise ChatFormatError("response_format: type 'json_schema' needs a 'json_schema' object with a 'schema'",
                                  "response_format.json_schema")
        out.system("response-format", f"The system is invoked with `response_format=json_schema`.\n{lead}\n"
                                      f"The JSON data must match the following schema:\n"
                                      f"```json\n{_compact(_deep_sort(schema))}\n```")
        return
    raise ChatFormatError(f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
                          "response_format")


# ----------------------------------------------------------------------------------------------- messages

def _call_index(calls: Any) -> dict[str, tuple[int, Any]]:
    """tool_call id → (1-based position, function name); the first of duplicate ids wins."""
    index: dict[str, tuple[int, Any]] = {}
    for pos, call in enumerate(calls if isinstance(calls, list) else [], start=1):
        if isinstance(call, dict) and call.get("id") is not None:
            fn = call.get("function")
            name = fn.get("name") if isinstance(fn, dict) else call.get("name")
            index.setdefault(str(call["id"]), (pos, name))
    return index


def _order_tool_results(items: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """Put each run of tool messages in the order of the calls of the latest assistant message, matching
    `tool_call_id` (or `id`) to the calls' ids; a run with any unmatched message stays as given. Matched
    messages get the call's name as `tool` (and as `name` where they carry one)."""
    out: list[tuple[int, dict]] = []
    index: dict[str, tuple[int, Any]] = {}
    i = 0
    while i < len(items):
        m = items[i][1]
        if m.get("role") == "assistant":
            index = _call_index(m.get("tool_calls")) if m.get("tool_calls") else {}
        if m.get("role") != "tool":
            out.append(items[i])
            i += 1
            continue
        run = []
        while i < len(items) and items[i][1].get("role") == "tool":
            j, t = items[i]
            cid = t.get("tool_call_id", t.get("id"))
            run.append((index.get(str(cid)) if cid is not None else None, len(run), j, t))
            i += 1
        if any(hit is None for hit, *_ in run):
            out += [(j, t) for _, _, j, t in run]
            continue
        for (_, name), _, j, t in sorted(run, key=lambda r: (r[0][0], r[1])):
            if name is not None:
                t = dict(t, tool=name)
                if "name" in t:
                    t["name"] = name
            out.append((j, t))
    return out


def _arguments(args: Any, where: str) -> tuple[dict, str | None]:
    """(arguments object, raw text for a `json` block when the arguments are not JSON)."""
    if args is None:
        return {}, None
    if isinstance(args, dict):
        return args, None
    if isinstance(args, str):
        if not args.strip():
            return {}, None
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return {}, args
        if not isinstance(parsed, dict):
            raise ChatFormatError(f"{where}: tool call arguments must be a JSON object, got "
                                  f"{type(parsed).__name__} ({args[:60]!r})", where)
        return parsed, None
    raise ChatFormatError(f"{where}: expected a JSON object string or an object, got {type(args).__name__}", where)


def _value_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


def _assistant(out: _Out, m: dict, thinking: bool, where: str) -> None:
    if thinking:
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        out.open("think")
        if reasoning is not None and str(reasoning).strip():
            out.text(str(reasoning))
        out.close("think")
    out.open("response")
    _content(out, m.get("content"), f"{where}.content")
    out.close("response")
    calls = m.get("tool_calls")
    if not calls:
        return
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}.tool_calls: expected a list, got {type(calls).__name__}", f"{where}.tool_calls")
    out.open("tools")
    for k, call in enumerate(calls):
        w = f"{where}.tool_calls[{k}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatFormatError(f"{w}.function.name: expected a non-empty string", f"{w}.function.name")
        args, raw = _arguments(fn.get("arguments"), f"{w}.function.arguments")
        out.open("call", ("tool", fn["name"]), ("index", k + 1))
        if raw is not None:
            out.open("json", ("type", "object"))
            out.text(raw)
            out.close("json")
        else:
            for key, value in args.items():
                out.open("argument", ("key", key), ("type", _value_type(value)))
                out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                out.close("argument")
        out.close("call")
    out.close("tools")


def segments(messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
             thinking: bool | None = None, reasoning_effort: str | None = None, tool_choice: Any = None,
             response_format: Any = None, enable_thinking: bool | None = None,
             thinking_effort: str | None = None) -> list[Segment]:
    """The conversation as the official encoder's pieces: (text, allow_special) in order.

    `messages` are OpenAI chat messages (roles system, developer (= system), user, assistant, tool);
    assistant messages may carry `reasoning_content` (or `reasoning`) and `tool_calls`; tool messages are
    named by `tool` / `name` or by the call they answer (`tool_call_id`, else their position). Options as
    the official encoder's: thinking on by default (`enable_thinking` is its alias), effort `max` unless
    `thinking_effort` / `reasoning_effort` say otherwise, `reasoning_effort="none"` turns thinking off.
    """
    think, effort = _options(thinking, enable_thinking, reasoning_effort, thinking_effort)
    if not isinstance(messages, list):
        raise ChatFormatError(f"messages: expected a list, got {type(messages).__name__}", "messages")
    items = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"messages[{i}]: expected an object, got {type(m).__name__}", f"messages[{i}]")
        if m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ChatFormatError(f"messages[{i}].role: {m.get('role')!r} is not one of system, developer, user, "
                                  "assistant, tool", f"messages[{i}].role")
        items.append((i, m))
    if tools is not None and not isinstance(tools, list):
        raise ChatFormatError(f"tools: expected a list, got {type(tools).__name__}", "tools")

    out = _Out()
    if tools:
        _tool_declare(out, tools, dynamic=False)
    if think:
        out.system("thinking-effort",
                   "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                   "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                   f"Now the system is invoked with `thinking_effort={effort}`.")
    prior_calls: list = []
    n_results = 0
    for i, m in _order_tool_results(items):
        role, where = m["role"], f"messages[{i}]"
        name = m.get("name")
        if role in ("system", "developer") and m.get("tools"):
            if m.get("content"):
                raise ChatFormatError(f"{where}: a system message with 'tools' declares tools only; its content "
                                      "would be lost (send the text as its own system message)", f"{where}.content")
            _tool_declare(out, m["tools"], dynamic=True)
        elif role in ("system", "developer", "user"):
            out.open("message", ("role", "user" if role == "user" else "system"), *((("name", name),) if name else ()))
            _content(out, m.get("content"), f"{where}.content")
            out.end_message()
        elif role == "assistant":
            prior_calls = m.get("tool_calls") if isinstance(m.get("tool_calls"), list) else []
            n_results = 0
            out.open("message", ("role", "assistant"), *((("name", name),) if name else ()))
            _assistant(out, m, think, where)
            out.end_message()
        else:
            n_results += 1
            tool = m.get("tool", name)
            if tool is None and n_results <= len(prior_calls) and isinstance(prior_calls[n_results - 1], dict):
                call = prior_calls[n_results - 1]
                tool = call.get("function", call).get("name")
            if tool is None:
                raise ChatFormatError(f"{where}: a tool message needs a tool name: give 'tool' or 'name', or a "
                                      "'tool_call_id' / position matching a call of the preceding assistant "
                                      "message", where)
            out.open("message", ("role", "tool"), ("tool", tool), ("index", n_results))
            _content(out, m.get("content"), f"{where}.content")
            out.end_message()
    _tool_choice(out, tool_choice)
    _response_format(out, response_format)
    if add_generation_prompt:
        out.open("message", ("role", "assistant"))
        out.open("think" if think else "response")
    return out.segs


def render(messages: list[dict], tools: list[dict] | None = None, **options: Any) -> str:
    """The conversation as text (see `segments` for the options)."""
    return "".join(t for t, _ in segments(messages, tools, **options))


def encode_segments(tokenizer: Tokenizer, segs: Sequence[Segment]) -> list[int]:
    """Token ids, one piece at a time: marker pieces with specials allowed (each structural marker must be
    one special id), all other pieces as plain text."""
    ids: list[int] = []
    for text, allow_special in segs:
        piece = tokenizer.encode(text, allow_special=allow_special)
        if allow_special and text in MARKERS and piece != [tokenizer.special_tokens.get(text)]:
            raise ValueError(f"the tokenizer does not encode the marker {text!r} as one special token (got {piece}); "
                             "K3's chat format needs <|open|>, <|close|>, <|sep|> and <|end_of_msg|> as specials")
        ids += piece
    return ids


def encode(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None, **options: Any) -> list[int]:
    """Token ids of the conversation, each piece encoded separately as the official encoder does."""
    return encode_segments(tokenizer, segments(messages, tools, **options))


# ----------------------------------------------------------------------------------------------- training

def train_mask(segs: Sequence[Segment]) -> list[bool]:
    """Per piece of `segments(...)`: True where supervised fine-tuning puts its loss, i.e. the body of every
    assistant message (think, response, tool calls) and its closing `<|close|>message<|sep|><|end_of_msg|>`
    (so the model learns to stop); False for the header `<|open|>message role="assistant" …<|sep|>`, every
    other message and an unclosed trailing message (the generation prompt).

    Read from the piece structure alone: markers are the only special pieces, a tag name always follows
    <|open|> / <|close|>, and content is never a special piece, so no content can shift these boundaries."""
    mask = [False] * len(segs)
    i, n = 0, len(segs)
    while i < n:
        if segs[i] != (OPEN, True) or i + 1 >= n or segs[i + 1] != ("message", False):
            i += 1
            continue
        j = i + 2  # the header's attribute pieces, up to its <|sep|>
        role = None
        while j < n and segs[j] != (SEP, True):
            if segs[j] == (" role", False) and j + 2 < n and segs[j + 1] == ('="', False):
                role = segs[j + 2][0]
            j += 1
        body, depth = j + 1, 0
        k = body
        while k < n:  # find this message's own <|close|>message<|sep|><|end_of_msg|>
            text, special = segs[k]
            if special and text == OPEN:
                depth += 1
            elif special and text == CLOSE:
                if depth == 0:
                    break
                depth -= 1
            k += 1
        if k >= n:  # unclosed: the generation prompt
            break
        end = k + 4 if k + 3 < n and segs[k + 3] == (END_OF_MSG, True) else k + 3
        if role == "assistant":
            for q in range(body, end):
                mask[q] = True
        i = end
    return mask


def encode_with_mask(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None,
                     **options: Any) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask): the ids are exactly `encode(...)`'s; the mask marks the tokens of the pieces
    `train_mask` selects (assistant bodies and their closing markers)."""
    segs = segments(messages, tools, **options)
    ids: list[int] = []
    mask: list[bool] = []
    for seg, m in zip(segs, train_mask(segs)):
        piece = encode_segments(tokenizer, [seg])
        ids += piece
        mask += [m] * len(piece)
    return ids, mask
