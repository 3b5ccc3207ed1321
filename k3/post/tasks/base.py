"""The shared pieces of the built-in tasks: `Task`, `Reward`, `TaskError`, the split rule and answer checking.

Splits are a property of a task's *prompt*: a task is in "test" iff a hash of its domain, kind and prompt
text falls in the test fifth, whatever seed produced it, so no seed of "train" can ever yield a test prompt.
Answers are checked exactly after normalisation (case, whitespace, a trailing full stop, surrounding quotes
or backticks, thousands separators in numbers, and numbers compared by value: "4500" = "4500.0").
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

DOMAINS = ("general", "agent", "coding")
SPLITS = ("train", "test")
TEST_FRACTION_PER_256 = 52  # ≈ 20 % of prompts are held out
WORKDIR = "/work"           # the agent's workspace inside a sandbox; tools cannot leave it


class TaskError(Exception):
    """A task (not a model answer) is broken: its hidden tests cannot run, its data is missing, …"""


@dataclass
class Reward:
    """Verifier output: score 1.0 (correct) or 0.0, and a short human-readable reason."""
    score: float
    detail: str = ""


@dataclass
class Task:
    """One verifiable task. `messages`: the prompt (OpenAI chat messages); `tools`: OpenAI function tools or
    None; `files`: path → text to seed a fresh sandbox with (agent/coding); `hidden`: what the verifier needs
    (never shown to the model)."""
    id: str
    domain: str
    split: str
    kind: str
    messages: list[dict]
    tools: list[dict] | None = None
    files: dict[str, str] = field(default_factory=dict)
    hidden: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict:
        """JSON record (the SFT keys `messages`/`tools`/`task_id`/`domain`, plus what RL needs)."""
        d = asdict(self)
        return {"messages": d["messages"], "tools": d["tools"], "task_id": d["id"], "domain": d["domain"],
                "split": d["split"], "kind": d["kind"], "files": d["files"], "hidden": d["hidden"]}

    @classmethod
    def from_record(cls, r: dict) -> "Task":
        missing = [k for k in ("messages", "task_id", "domain", "split", "kind", "hidden") if k not in r]
        if missing:
            raise TaskError(f"task record {r.get('task_id', '?')!r} lacks {', '.join(missing)} (a prompt-only "
                            "record written from a Task has them; a conversation record does not)")
        return cls(r["task_id"], r["domain"], r["split"], r["kind"], r["messages"], r.get("tools"),
                   r.get("files") or {}, r["hidden"])

    @property
    def prompt_text(self) -> str:
        return "\n".join(str(m.get("content") or "") for m in self.messages)


def content_hash(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def split_of(domain: str, kind: str, prompt: str) -> str:
    """The split a prompt belongs to, from its content alone."""
    return "test" if int(content_hash(domain, kind, prompt)[:2], 16) < TEST_FRACTION_PER_256 else "train"


def check_request(domain: str, split: str, n: int, seed: int) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"domain {domain!r} is not one of {', '.join(DOMAINS)}")
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def collect(domain: str, split: str, n: int, seed: int,
            draw: Callable[[random.Random], tuple[str, list[dict], dict, dict] | None],
            tools: list[dict] | None = None, max_tries_per_task: int = 200, stream: str = "") -> list[Task]:
    """n distinct tasks of `split`: candidates from `draw(rng)` -> (kind, messages, hidden, files) (or None
    to skip), kept when their prompt hashes into `split`; the stream is seeded by (domain, seed, `stream`:
    a generator's own name, e.g. a level) only, so the same seed gives the same tasks. ValueError when the
    generator cannot supply n distinct tasks."""
    rng = random.Random(f"k3-post-tasks/{domain}/{seed}" + (f"/{stream}" if stream else ""))
    out: list[Task] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > max_tries_per_task * max(n, 1):
            raise ValueError(f"{domain}: found only {len(out)} distinct {split} tasks of the {n} asked for "
                             f"(seed {seed}); ask for fewer")
        got = draw(rng)
        if got is None:
            continue
        kind, messages, hidden, files = got
        prompt = "\n".join(str(m.get("content") or "") for m in messages) + json.dumps(files, sort_keys=True)
        key = content_hash(domain, kind, prompt)
        if key in seen or split_of(domain, kind, prompt) != split:
            continue
        seen.add(key)
        out.append(Task(f"{domain}-{kind}-{key[:12]}", domain, split, kind, messages, tools, files, hidden))
    return out


def collect_level(domain: str, split: str, n: int, seed: int, level: str,
                  draws: dict[str, tuple[Callable, list[dict] | None]]) -> list[Task]:
    """`collect` at `level` of a domain whose levels are `draws` ({level: (draw, tools)}); a level other than
    "standard" draws from its own stream."""
    if level not in draws:
        raise ValueError(f"{domain}: level {level!r} is not one of {', '.join(draws)}")
    draw, tools = draws[level]
    return collect(domain, split, n, seed, draw, tools=tools, stream="" if level == "standard" else level)


# ---------------------------------------------------------------------------------------------- answers

_ANSWER_LINE = re.compile(r"(?im)^\s*(?:final\s+)?answer\s*:\s*(.*?)\s*$")
_NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")


def final_answer(messages: list[dict]) -> str:
    """The content of the last assistant message of a conversation ("" if none): what `verify` checks."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return m.get("content") or ""
    return ""


def extract_answer(response: str) -> str:
    """The final answer of a response: the text after the last `Answer:` line, else the whole response."""
    hits = _ANSWER_LINE.findall(response or "")
    return hits[-1] if hits else (response or "")


def has_answer_line(response: str) -> bool:
    """Whether a response follows the answer format (an `Answer: <value>` line with a value), right or wrong."""
    return any(v.strip() for v in _ANSWER_LINE.findall(response or ""))


def normalise(text: str) -> str:
    t = " ".join(str(text).split()).lower()
    t = t.rstrip(".").strip()
    while len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'`":
        t = t[1:-1].strip()
    if _NUMBER.fullmatch(t):
        try:
            return format(Decimal(t.replace(",", "")).normalize(), "f")
        except InvalidOperation:
            pass
    return t


def answer_matches(response: str, answers: list[str]) -> tuple[bool, str]:
    """(the response's final answer equals one of `answers` after normalisation, the answer it gave)."""
    got = extract_answer(response)
    return normalise(got) in {normalise(a) for a in answers}, got


def format_number(x: Decimal | int) -> str:
    """An exact number without exponent or trailing zeros ("4500", "2.5")."""
    d = Decimal(x).normalize()
    s = format(d, "f")
    return s


def by_effort(effort: str | None, low: str, high: str, check: str = "") -> str:
    """A scripted reasoning step at a reasoning effort: `low` at "low", `high` at "high" (and None, the chat
    default), `high` followed by `check` at "max"."""
    if effort == "low":
        return low
    return f"{high} {check}" if effort == "max" and check else high
