"""The agent's tools (OpenAI function schemas) and `ToolExecutor`, which runs them in a `k3.env` sandbox.

Every path a tool takes is confined to the workspace (`/work` inside the sandbox): relative paths are taken
from it, and a path that leaves it (`..`, another absolute path) is refused. Files go through the sandbox's
file API; `grep` and `run_python` run as processes inside the sandbox (argv, no shell), with a timeout.
Whatever goes wrong (unknown tool, bad arguments, missing file, a sandbox error) comes back to the model as an
`error: …` string; the host never sees an exception from a tool call.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from .base import WORKDIR

MAX_TOOL_OUTPUT = 8000   # characters of one tool result; the rest is cut with a note
TOOL_TIMEOUT_S = 10.0


def _fn(name: str, description: str, **params: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                         for k, v in params.items()},
                       "required": list(params)}}}


LS = _fn("ls", "List a directory of the workspace (directories end with '/').",
         path="directory path, absolute under /work or relative to it")
CAT = _fn("cat", "Print a text file of the workspace.", path="file path, absolute under /work or relative to it")
GREP = _fn("grep", "Search files for lines matching an extended regular expression (recursive for a directory); "
                   "prints 'file:line:text'.", pattern="extended regular expression",
           path="file or directory path under /work")
WRITE_FILE = _fn("write_file", "Create or overwrite a text file of the workspace.",
                 path="file path under /work", content="the full new text of the file")
RUN_PYTHON = _fn("run_python", "Run a Python script of the workspace (cwd /work) and show its exit code and output.",
                 path="script path under /work")

AGENT_TOOLS = [LS, CAT, GREP, WRITE_FILE]
CODING_TOOLS = [LS, CAT, GREP, WRITE_FILE, RUN_PYTHON]
_PARAMS = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in CODING_TOOLS}


def resolve(path: Any, root: str = WORKDIR) -> str:
    """The absolute sandbox path of `path`, which must stay inside `root`; ValueError naming it otherwise."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"path must be a non-empty string, got {path!r}")
    if "\0" in path:
        raise ValueError("path contains a NUL byte")
    full = posixpath.normpath(path if path.startswith("/") else posixpath.join(root, path))
    if full.startswith("//"):
        full = "/" + full.lstrip("/")
    if full != root and not full.startswith(root.rstrip("/") + "/"):
        raise ValueError(f"path {path!r} is outside the workspace {root}")
    return full


def _cut(text: str) -> str:
    if len(text) <= MAX_TOOL_OUTPUT:
        return text
    return text[:MAX_TOOL_OUTPUT] + f"\n[... {len(text) - MAX_TOOL_OUTPUT} more characters cut]"


class ToolExecutor:
    """Runs tool calls against one sandbox. `execute(name, arguments)` -> the tool message content."""

    def __init__(self, sandbox, root: str = WORKDIR, tools: list[dict] | None = None, timeout: float = TOOL_TIMEOUT_S):
        self.sandbox = sandbox
        self.root = root
        self.allowed = [t["function"]["name"] for t in (tools if tools is not None else CODING_TOOLS)]
        self.timeout = timeout

    def execute(self, name: Any, arguments: Any) -> str:
        """`arguments`: a dict or its JSON text. Errors come back as 'error: …' strings."""
        if name not in self.allowed:
            return f"error: unknown tool {name!r}; the tools are {', '.join(self.allowed)}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return f"error: {name}: arguments are not valid JSON ({e.msg} at position {e.pos})"
        if not isinstance(arguments, dict):
            return f"error: {name}: arguments must be a JSON object, got {type(arguments).__name__}"
        want = _PARAMS[name]
        missing = [k for k in want if k not in arguments]
        extra = sorted(k for k in arguments if k not in want)
        if missing or extra:
            return (f"error: {name}: expected arguments {', '.join(want)}"
                    + (f"; missing {', '.join(missing)}" if missing else "")
                    + (f"; unexpected {', '.join(map(str, extra))}" if extra else ""))
        bad = [k for k in want if not isinstance(arguments[k], str)]
        if bad:
            return f"error: {name}: argument {bad[0]!r} must be a string, got {type(arguments[bad[0]]).__name__}"
        try:
            return _cut(getattr(self, "_" + name)(**arguments))
        except ValueError as e:
            return f"error: {name}: {e}"
        except Exception as e:  # noqa: BLE001 - a tool failure is the model's observation, never the host's crash
            return f"error: {name}: {type(e).__name__}: {e}"

    def execute_call(self, call: dict) -> str:
        """Run an OpenAI tool call ({"id", "type": "function", "function": {"name", "arguments"}})."""
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return "error: a tool call needs a 'function' object with 'name' and 'arguments'"
        return self.execute(fn.get("name"), fn.get("arguments", "{}"))

    # ---- the tools ------------------------------------------------------------------------------------
    def _ls(self, path: str) -> str:
        entries = sorted(self.sandbox.list_files(resolve(path, self.root)), key=lambda f: f.name)
        return "\n".join(f.name + ("/" if f.is_dir else "") for f in entries) or "(empty directory)"

    def _cat(self, path: str) -> str:
        return self.sandbox.read_file(resolve(path, self.root)).decode("utf-8", errors="replace")

    def _grep(self, pattern: str, path: str) -> str:
        full = resolve(path, self.root)
        r = self.sandbox.exec(["grep", "-rHnE", "-e", pattern, "--", full], timeout=self.timeout)
        if r.timed_out:
            return f"error: grep: timed out after {self.timeout:g} s"
        if r.exit_code == 1:
            return "(no matches)"
        if r.exit_code != 0:
            return f"error: grep: {r.stderr.strip() or f'exit code {r.exit_code}'}"

        def key(line: str):
            f, _, rest = line.partition(":")
            n, _, _ = rest.partition(":")
            return (f, int(n) if n.isdigit() else 0, line)
        return "\n".join(sorted(r.stdout.splitlines(), key=key))

    def _write_file(self, path: str, content: str) -> str:
        full = resolve(path, self.root)
        if full == self.root:
            raise ValueError(f"{full} is the workspace directory, not a file")
        data = content.encode()
        self.sandbox.write_file(full, data)
        return f"wrote {len(data)} bytes to {full}"

    def _run_python(self, path: str) -> str:
        # -B: no __pycache__ is written, so a later edit of the same size and second can never be shadowed
        r = self.sandbox.exec(["python3", "-B", resolve(path, self.root)], timeout=self.timeout, cwd=self.root,
                              env={"PYTHONDONTWRITEBYTECODE": "1"})
        head = f"timed out after {self.timeout:g} s" if r.timed_out else f"exit code {r.exit_code}"
        return f"{head}\n--- stdout ---\n{r.stdout}--- stderr ---\n{r.stderr}"
