"""The SFT data format (JSONL) and `k3 post data`, which writes solved conversations (or bare prompts).

One JSON object per line: {"messages": [...], "tools": [...] | null, "task_id": str, "domain": str}. Prompt
records (`--prompts`) add "split", "kind", "files" and "hidden" so RL and evaluation can rebuild the `Task`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from ...io.jsonl import iter_jsonl
from .base import DOMAINS, SPLITS, Task

REQUIRED = ("messages", "tools", "task_id", "domain")


def _record(x: Any) -> dict:
    if isinstance(x, Task):
        return x.to_record()
    if hasattr(x, "to_record"):
        return x.to_record()
    if isinstance(x, dict):
        return x
    raise TypeError(f"write_jsonl: expected Task, Conversation or dict records, got {type(x).__name__}")


def write_jsonl(items: Iterable[Any], path: str | os.PathLike) -> int:
    """Write tasks / conversations / records, one JSON object a line (atomically); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for x in items:
            r = _record(x)
            missing = [k for k in REQUIRED if k not in r]
            if missing:
                raise ValueError(f"write_jsonl: record {n} lacks {', '.join(missing)}")
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL file, each checked for the SFT keys; ValueError naming file:line otherwise."""
    out = []
    for lineno, r in iter_jsonl(path):
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ValueError(f"{path}:{lineno}: record lacks {', '.join(missing)} (expected keys: "
                             f"{', '.join(REQUIRED)})")
        if not isinstance(r["messages"], list) or (r["tools"] is not None and not isinstance(r["tools"], list)):
            raise ValueError(f"{path}:{lineno}: 'messages' must be a list and 'tools' a list or null")
        out.append(r)
    return out


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_data_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--domain", required=True, choices=[*DOMAINS, "all"], help="task domain, or all three")
    p.add_argument("--split", default="train", choices=SPLITS)
    p.add_argument("-n", type=_positive_int, required=True, help="tasks per domain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level", default="standard", choices=("easy", "standard"),
                   help="task level, in every domain (easy: copy a code or single-digit addition; read a number "
                        "from a named file or name the file that mentions a word; write a one-line function)")
    p.add_argument("--effort", default=None, choices=("low", "high", "max"),
                   help="reasoning effort the solutions are written and rendered at (low: the shortest reasoning, "
                        "max: with a check; agent/coding standard: the same at every effort); default: the chat "
                        "default, high-length reasoning")
    p.add_argument("--out", required=True, help="output .jsonl")
    p.add_argument("--sandbox-dir", default=None,
                   help="state dir of the sandboxes that solve agent/coding tasks (default: k3.env's default manager)")
    p.add_argument("--prompts", action="store_true",
                   help="write the task prompts (with hidden data for RL / evaluation) instead of solved conversations")
    return p


def cmd_data(args: argparse.Namespace) -> int:
    from . import generate, solve
    domains = list(DOMAINS) if args.domain == "all" else [args.domain]
    level = getattr(args, "level", "standard")
    tasks = [t for d in domains for t in generate(d, args.split, args.n, args.seed, level)]
    try:
        from tqdm import tqdm
        it = tqdm(tasks, desc=f"k3 post data {args.domain}/{args.split}",
                  disable=args.prompts or not sys.stderr.isatty())
    except ImportError:  # pragma: no cover - tqdm is a declared dependency
        it = tasks
    manager = None
    if args.sandbox_dir and not args.prompts:
        from k3.env import SandboxManager
        manager = SandboxManager(args.sandbox_dir)
    try:
        effort = getattr(args, "effort", None)
        n = write_jsonl(tasks if args.prompts else (solve(t, manager=manager, effort=effort) for t in it), args.out)
    finally:
        if manager is not None:
            manager.shutdown()
    print(f"wrote {n} {'prompts' if args.prompts else 'conversations'} to {args.out}")
    return 0


def main_data(argv: list[str] | None = None) -> int:
    """`k3 post data --domain general|agent|coding|all --split train|test -n N --seed S --out F.jsonl`."""
    p = add_data_args(argparse.ArgumentParser(prog="k3 post data",
                                              description="write built-in post-training tasks as JSONL"))
    args = p.parse_args(argv)
    try:
        return cmd_data(args)
    except Exception as e:  # noqa: BLE001 - e.g. k3.env.Unavailable: the sandbox tier cannot run here
        print(f"k3 post data: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
