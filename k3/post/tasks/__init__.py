"""Built-in verifiable post-training tasks (no download) in K3's three domains, for SFT and RL.

    from k3.post import tasks
    ts = tasks.generate("agent", "train", n=8, seed=0)     # deterministic; "test" prompts never in "train"
    easy = tasks.generate("general", "test", 8, 0, level="easy")   # copy a code, single-digit addition
    conv = tasks.solve(ts[0])                               # scripted demo, tool calls run in a real sandbox
    conv = tasks.solve(easy[0], effort="low")               # easy levels: reasoning length follows the effort
    text = conv.render()                                    # k3.io.chat rendering
    tasks.verify(ts[0], conv.final_answer, sandbox=sb)      # Reward(score 0/1, detail)
    tasks.count_tokens(conv, tokenizer, "agent")            # tokens counted against the effort budget
    tasks.write_jsonl([conv], "sft.jsonl")

Domains and their levels (`LEVELS`, easiest first):
- "general": "standard" arithmetic, unit conversions, QA over pydoc_data; "easy" copy a code, single-digit
  addition;
- "agent": "standard" find and combine values over files in a k3.env sandbox with ls/cat/grep/write_file,
  sometimes leaving an answer file; "easy" read the number in a named note (`cat`), name the note that
  mentions a word (`grep`);
- "coding": "standard" fix or write a function in /work/solution.py; "easy" write a one-line function
  (x + K, x * K, the constant K); hidden asserts run in the sandbox.
An easy episode is one tool call and a short answer (≈ 80–155 generated tokens with K3's chat markup, a tool
call alone being ≈ 52–66), so it fits in a few turns of 128 tokens. The scripted solutions of the easy levels (and of general's standard one) are longer at a
higher reasoning effort (low < high < max); agent and coding standard solutions are the same at every effort.
Agent and coding need the sandbox's process tier (`k3.env`) to solve or verify; generating them does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import agent, coding, general
from .base import DOMAINS, SPLITS, WORKDIR, Reward, Task, TaskError, check_request, final_answer, split_of
from .budget import count_tokens
from .data import add_data_args, cmd_data, main_data, read_jsonl, write_jsonl
from .sandbox_io import prepare
from .tools import AGENT_TOOLS, CODING_TOOLS, ToolExecutor, resolve

__all__ = ["AGENT_TOOLS", "CODING_TOOLS", "DOMAINS", "LEVELS", "SPLITS", "WORKDIR", "Conversation", "Reward", "Task", "TaskError",
           "ToolExecutor", "add_data_args", "cmd_data", "count_tokens", "generate", "main_data", "prepare",
           "read_jsonl", "resolve", "solve", "split_of", "verify", "write_jsonl"]

_MODULES = {"general": general, "agent": agent, "coding": coding}
LEVELS = {"general": general.LEVELS, "agent": agent.LEVELS, "coding": coding.LEVELS}  # per domain, easiest first


@dataclass
class Conversation:
    """A full training conversation for one task (OpenAI messages, the tools they were rendered with)."""
    messages: list[dict]
    tools: list[dict] | None
    task_id: str
    domain: str
    options: dict[str, Any] = field(default_factory=dict)   # chat options, e.g. {"reasoning_effort": "low"}

    def to_record(self) -> dict:
        return {"messages": self.messages, "tools": self.tools, "task_id": self.task_id, "domain": self.domain,
                **self.options}

    def render(self, **options: Any) -> str:
        from k3.io import chat
        return chat.render(self.messages, tools=self.tools, add_generation_prompt=False,
                           **{**self.options, **options})

    @property
    def final_answer(self) -> str:
        """The content of the last assistant message ("" if none)."""
        return final_answer(self.messages)


def generate(domain: str, split: str, n: int, seed: int, level: str = "standard") -> list[Task]:
    """n distinct tasks of `domain` in `split` at `level` (`LEVELS[domain]`), the same for the same seed (and
    Python version, for QA)."""
    check_request(domain, split, n, seed)
    if level not in LEVELS[domain]:
        raise ValueError(f"level {level!r} is not one of {', '.join(LEVELS[domain])} (domain {domain!r})")
    return _MODULES[domain].generate(split, n, seed, level)


def _module(task: Task):
    if not isinstance(task, Task):
        raise TypeError(f"expected a Task, got {type(task).__name__}")
    if task.domain not in _MODULES:
        raise TaskError(f"task {task.id}: domain {task.domain!r} is not one of {', '.join(DOMAINS)}")
    return _MODULES[task.domain]


def verify(task: Task, response: str, sandbox=None, manager=None, timeout: float = 10.0) -> Reward:
    """Check a final response (and, for agent/coding, the episode's sandbox state). `manager`: where coding
    verification makes a fresh sandbox when `sandbox` is None; `timeout`: seconds for its hidden tests."""
    mod = _module(task)
    if task.domain == "general":
        return mod.verify(task, response)
    if task.domain == "agent":
        return mod.verify(task, response, sandbox)
    return mod.verify(task, response, sandbox, manager, timeout)


def solve(task: Task, sandbox=None, manager=None, effort: str | None = None) -> Conversation:
    """The scripted, correct demonstration of `task`. Agent/coding tool calls run for real on `sandbox` (it
    must hold the task's files: see `prepare`) or on a fresh sandbox from `manager` that is killed after.
    `effort` (low / high / max): rendered as the conversation's reasoning effort; the reasoning of a general
    task or an easy agent / coding task is as long as that effort asks (`general.reasoning`, `base.by_effort`).
    None: the chat default, high-length."""
    mod = _module(task)
    if effort is not None:
        from k3.io.chat import THINKING_EFFORTS
        if effort not in THINKING_EFFORTS:
            raise ValueError(f"effort {effort!r} is not one of {', '.join(THINKING_EFFORTS)}")
    msgs = mod.solve(task, effort) if task.domain == "general" else mod.solve(task, sandbox, manager, effort)
    return Conversation(msgs, task.tools, task.id, task.domain,
                        {"reasoning_effort": effort} if effort is not None else {})
