"""Sandbox plumbing shared by the agent and coding tasks: seeding a sandbox, scripted tool calls, cleanup."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

from .base import Task, TaskError
from .tools import ToolExecutor


def prepare(task: Task, sandbox) -> None:
    """Write the task's files into a fresh sandbox."""
    for path, text in sorted(task.files.items()):
        sandbox.write_file(path, text.encode())


@contextmanager
def task_sandbox(task: Task, sandbox=None, manager=None) -> Iterator:
    """`sandbox` as is, or a new one (prepared with the task's files, killed on exit) from `manager` (None:
    k3.env's default manager)."""
    if sandbox is not None:
        yield sandbox
        return
    from k3.env import Sandbox
    sb = Sandbox.create(manager=manager)
    try:
        prepare(task, sb)
        yield sb
    finally:
        sb.kill()


class Script:
    """Builds a scripted conversation whose tool results are real: each call runs through `ToolExecutor`."""

    def __init__(self, task: Task, sandbox):
        self.messages: list[dict] = [dict(m) for m in task.messages]
        self.tools = ToolExecutor(sandbox, tools=task.tools)
        self._n = 0

    def call(self, reasoning: str, *calls: tuple[str, dict]) -> list[str]:
        """One assistant message making `calls` [(name, arguments)]; returns their results in order."""
        tool_calls = []
        for name, args in calls:
            self._n += 1
            tool_calls.append({"id": f"call_{self._n}", "type": "function",
                               "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        self.messages.append({"role": "assistant", "reasoning_content": reasoning, "content": None,
                              "tool_calls": tool_calls})
        results = []
        for c in tool_calls:
            out = self.tools.execute_call(c)
            if out.startswith("error:"):
                raise TaskError(f"scripted solver's call {c['function']} failed: {out}")
            self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": out})
            results.append(out)
        return results

    def answer(self, reasoning: str, content: str) -> list[dict]:
        self.messages.append({"role": "assistant", "reasoning_content": reasoning, "content": content})
        return self.messages
