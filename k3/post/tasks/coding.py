"""Coding-agent tasks: fix or write a small Python function in `/work/solution.py`; hidden asserts decide.

Two levels: "standard" (fix a bug or write a function of a few lines: median, polynomial, character count,
moving sums, Caesar shift, digit sum; the scripted solver reads the file, rewrites it and runs the prompt's
examples) and "easy" (write a one-line function of x: `x + K`, `x * K` or the constant K, with K in the
prompt; the scripted solver writes the file with one `write_file` call and gives a one-line final reply,
its reasoning a few words at effort low, a sentence at high, a sentence and a worked check at max). An easy
episode is 120–150 generated tokens; its `write_file` turn alone is up to ~93 (a two-argument tool call is ~66
tokens of K3's chat markup before the path and code), so it needs turns of more than 64 tokens.

Each template is parameterised (the numbers appear in the spec, so different parameters are different
prompts). The expected values of the hidden asserts come from a host-side Python reference; the scripted
solver writes a separate reference *source*, so a test that the solver passes checks the two against each
other. The hidden tests run inside the sandbox under a harness (`harness.py`) with a timeout.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from .base import WORKDIR, Reward, Task, TaskError, by_effort, collect_level
from .harness import run_hidden_tests
from .sandbox_io import Script, task_sandbox
from .tools import CODING_TOOLS, WRITE_FILE

LEVELS = ("easy", "standard")

SOLUTION = f"{WORKDIR}/solution.py"
SYSTEM = ("You are a coding agent with tools in a sandbox; the workspace is /work. Edit /work/solution.py so "
          "that the function is correct (hidden tests import it), then give a short final reply.")


@dataclass
class Spec:
    kind: str               # "fix_…" or "write_…"
    func: str               # function name
    text: str               # what the user asks
    starter: str            # /work/solution.py before the episode
    reference: str          # a correct solution.py (what the scripted solver writes)
    oracle: Callable        # host-side reference for the expected values
    inputs: list[tuple]     # argument tuples for hidden tests (the first two are shown as examples)
    diagnosis: str          # the solver's reasoning about what to change


def _lists(rng, n, lo=-20, hi=20, min_len=1, max_len=7):
    return [([rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))],) for _ in range(n)]


def _median(rng: random.Random) -> Spec:
    name = rng.choice(("median", "middle_value", "med"))
    bug = rng.choice(("no_average", "no_sort", "upper"))
    body = {"no_average": "    s = sorted(xs)\n    return s[len(s) // 2]\n",
            "no_sort": "    s = list(xs)\n    n = len(s)\n    if n % 2:\n        return s[n // 2]\n"
                       "    return (s[n // 2 - 1] + s[n // 2]) / 2\n",
            "upper": "    s = sorted(xs)\n    n = len(s)\n    if n % 2:\n        return s[n // 2]\n"
                     "    return (s[n // 2] + s[n // 2 + 1]) / 2\n"}[bug]
    why = {"no_average": "it returns the upper middle element for even lengths instead of the mean of the two",
           "no_sort": "it never sorts the values", "upper": "it averages the wrong pair for even lengths"}[bug]
    good = ("    s = sorted(xs)\n    n = len(s)\n    if n % 2:\n        return s[n // 2]\n"
            "    return (s[n // 2 - 1] + s[n // 2]) / 2\n")
    head = f"def {name}(xs):\n    \"\"\"The median of a non-empty list of numbers.\"\"\"\n"

    def oracle(xs):
        s, n = sorted(xs), len(xs)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    inputs = [([3, 1, 2],), ([4, 1, 3, 2],)] + _lists(rng, 6, min_len=2, max_len=8)
    return Spec(f"fix_median_{bug}", name, f"`{name}(xs)` in /work/solution.py should return the median of a "
                f"non-empty list (the mean of the two middle values for an even length), but it is buggy. Fix it.",
                head + body, head + good, oracle, inputs, f"The bug: {why}.")


def _poly(rng: random.Random) -> Spec:
    a, b, c = rng.randint(2, 9), rng.randint(-9, 9), rng.randint(-9, 9)
    name = rng.choice(("poly", "evaluate", "f"))
    head = f"def {name}(x):\n    \"\"\"{a}*x**2 + ({b})*x + ({c}).\"\"\"\n"

    def oracle(x):
        return a * x * x + b * x + c
    return Spec("fix_poly", name, f"`{name}(x)` in /work/solution.py must return {a}*x**2 + ({b})*x + ({c}) for an "
                "integer x, but it computes the square wrongly. Fix it.",
                head + f"    return {a} * x * 2 + ({b}) * x + ({c})\n",
                head + f"    return {a} * x * x + ({b}) * x + ({c})\n",
                oracle, [(3,), (-2,)] + [(rng.randint(-50, 50),) for _ in range(6)],
                "It multiplies by 2 (x*2) where the square x*x is meant.")


def _count_chars(rng: random.Random) -> Spec:
    chars = "".join(sorted(rng.sample("abcdefghijklmnopqrstuvwxyz", 3)))
    name = rng.choice(("count_chars", "tally"))
    head = f"def {name}(s):\n    \"\"\"How many characters of s are one of {chars!r}, ignoring case.\"\"\"\n"

    def oracle(s):
        return sum(ch in chars for ch in s.lower())
    words = ["".join(rng.choice(chars.upper() + chars + "xyzQW ") for _ in range(rng.randint(3, 12))) for _ in range(6)]
    return Spec("fix_count_chars", name, f"`{name}(s)` in /work/solution.py must count the characters of s that "
                f"are one of {chars!r}, ignoring case, but it misses upper-case letters. Fix it.",
                head + f"    return sum(1 for ch in s if ch in {chars!r})\n",
                head + f"    return sum(1 for ch in s.lower() if ch in {chars!r})\n",
                oracle, [(chars.upper(),), ("x" + chars[0],)] + [(w,) for w in words],
                "It compares characters case-sensitively; lower-casing s first fixes it.")


def _moving_sum(rng: random.Random) -> Spec:
    k = rng.randint(2, 5)
    name = rng.choice(("moving_sum", "window_sums"))

    def oracle(xs):
        return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]
    head = f"def {name}(xs):\n    \"\"\"Sums of every window of {k} consecutive values.\"\"\"\n"
    return Spec("write_moving_sum", name, f"Write `{name}(xs)` in /work/solution.py: the list of sums of every "
                f"window of {k} consecutive elements of xs, in order (an empty list if xs has fewer than {k}).",
                head + "    raise NotImplementedError\n",
                head + f"    return [sum(xs[i:i + {k}]) for i in range(len(xs) - {k} + 1)]\n",
                oracle, [(list(range(1, k + 3)),), ([1] * (k - 1),)] + _lists(rng, 6, min_len=0, max_len=9),
                f"Slide a window of {k} over the list; there are len(xs) - {k} + 1 windows (none if that is <= 0).")


def _caesar(rng: random.Random) -> Spec:
    k = rng.randint(1, 25)
    name = rng.choice(("shift", "caesar"))

    def oracle(s):
        return "".join(chr((ord(c) - 97 + k) % 26 + 97) if "a" <= c <= "z" else c for c in s)
    head = f"def {name}(s):\n    \"\"\"Shift lower-case letters {k} places forward, wrapping z to a.\"\"\"\n"
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz -!A") for _ in range(rng.randint(1, 10))) for _ in range(6)]
    return Spec("write_caesar", name, f"Write `{name}(s)` in /work/solution.py: shift every lower-case letter a-z "
                f"{k} places forward in the alphabet, wrapping around after z; other characters stay as they are.",
                head + "    raise NotImplementedError\n",
                head + f"    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)\n",
                oracle, [("abc",), ("xyz!",)] + [(w,) for w in words],
                f"Map each letter c to chr((ord(c) - 97 + {k}) % 26 + 97); leave the rest.")


def _digit_sum(rng: random.Random) -> Spec:
    base = rng.randint(2, 16)
    name = rng.choice(("digit_sum", "base_digit_sum"))

    def oracle(n):
        t = 0
        while n:
            n, r = divmod(n, base)
            t += r
        return t
    head = f"def {name}(n):\n    \"\"\"Sum of the digits of n >= 0 written in base {base}.\"\"\"\n"
    return Spec("write_digit_sum", name, f"Write `{name}(n)` in /work/solution.py: the sum of the digits of the "
                f"non-negative integer n written in base {base}.",
                head + "    raise NotImplementedError\n",
                head + f"    total = 0\n    while n:\n        n, r = divmod(n, {base})\n        total += r\n"
                "    return total\n",
                oracle, [(0,), (base + 1,)] + [(rng.randint(0, 100_000),) for _ in range(6)],
                f"Repeatedly take n mod {base} as the last digit and divide by {base}.")


TEMPLATES = (_median, _poly, _count_chars, _moving_sum, _caesar, _digit_sum)


def _call(func: str, args: tuple) -> str:
    return f"{func}({', '.join(repr(a) for a in args)})"


def _pack(sp: Spec, system: str, examples: int):
    """(kind, messages, hidden, files) of a spec: its first `examples` inputs shown in the prompt, the rest
    hidden tests."""
    cases = [(args, sp.oracle(*args)) for args in sp.inputs]
    ex = "; ".join(f"{_call(sp.func, a)} == {v!r}" for a, v in cases[:examples])
    prompt = f"{sp.text} For example: {ex}." if ex else sp.text
    hidden = {"func": sp.func, "tests": [f"assert {_call(sp.func, a)} == {v!r}" for a, v in cases[examples:]],
              "examples": [f"assert {_call(sp.func, a)} == {v!r}" for a, v in cases[:examples]],
              "reference": sp.reference, "diagnosis": sp.diagnosis, "solution_path": SOLUTION}
    return (sp.kind, [{"role": "system", "content": system}, {"role": "user", "content": prompt}], hidden,
            {SOLUTION: sp.starter})


def _draw(rng: random.Random):
    return _pack(rng.choice(TEMPLATES)(rng), SYSTEM, 2)


# --------------------------------------------------------------------------------------------- easy
EASY_TOOLS = [WRITE_FILE]
SYSTEM_EASY = "The workspace is /work. Write solution.py with the tool (hidden tests import it), then reply."
_EASY = {"add": (("add_k", "plus", "inc"), range(1, 100), "x + {k}", lambda k: lambda x: x + k),
         "mul": (("mul_k", "times", "scale"), range(2, 13), "x * {k}", lambda k: lambda x: x * k),
         "const": (("const_k", "constant", "fixed"), range(0, 1000), "{k}", lambda k: lambda x: k)}


def _draw_easy(rng: random.Random):
    kind = rng.choice(tuple(_EASY))
    names, ks, form, make = _EASY[kind]
    name, k = rng.choice(names), rng.choice(ks)
    expr = form.format(k=k)
    text = f"Write `{name}(x)` in solution.py: it returns {expr}" + (" for any x." if kind == "const" else ".")
    xs = [rng.randint(-99, 99) for _ in range(5)]
    sp = Spec(kind, name, text, f"def {name}(x):\n    raise NotImplementedError\n",
              f"def {name}(x): return {expr}\n", make(k), [(x,) for x in xs], f"It returns {expr}.")
    kind, messages, hidden, files = _pack(sp, SYSTEM_EASY, 0)
    worked = f"{expr.replace('x', f'({xs[0]})' if xs[0] < 0 else str(xs[0]))} = " if "x" in expr else ""
    hidden.update(expr=expr, check=f"Check: {name}({xs[0]}) = {worked}{sp.oracle(xs[0])}.")
    return kind, messages, hidden, files


def generate(split: str, n: int, seed: int, level: str = "standard") -> list[Task]:
    return collect_level("coding", split, n, seed, level, {"easy": (_draw_easy, EASY_TOOLS),
                                                           "standard": (_draw, CODING_TOOLS)})


def extract_code(response: str) -> str | None:
    """The last ```python (or bare ```) block of a response, or None."""
    parts = (response or "").split("```")
    blocks = [parts[i] for i in range(1, len(parts), 2)]
    if not blocks:
        return None
    b = blocks[-1]
    return b[len("python"):].lstrip("\n") if b.startswith("python") else b.lstrip("\n")


def verify(task: Task, response: str, sandbox=None, manager=None, timeout: float = 10.0) -> Reward:
    """1 iff every hidden assert passes against /work/solution.py of the episode's `sandbox`; without one, a
    fresh sandbox gets the task's files and the response's last ```python block as the solution."""
    tests: list[str] = task.hidden.get("tests") or []
    if not tests:
        raise TaskError(f"task {task.id} has no hidden tests")
    if sandbox is None:
        code = extract_code(response)
        if code is None:
            return Reward(0.0, "no sandbox and no ```python block in the response")
        with task_sandbox(task, None, manager) as sb:
            sb.write_file(task.hidden["solution_path"], code.encode())
            return run_hidden_tests(sb, tests, task.id, timeout, task.hidden["solution_path"])
    return run_hidden_tests(sandbox, tests, task.id, timeout, task.hidden["solution_path"])


def solve_easy(task: Task, sb, effort: str | None = None) -> list[dict]:
    """One `write_file` of the one-line function, then a one-line reply; the reasoning is a few words at
    effort low, a sentence at high (None), a sentence and a worked example at max."""
    h = task.hidden
    s = Script(task, sb)
    s.call(by_effort(effort, "Write it.", h["diagnosis"]),
           ("write_file", {"path": "solution.py", "content": h["reference"]}))
    return s.answer(by_effort(effort, "Done.", "The file is written.", h["check"]),
                    f"`{h['func']}(x)` returns {h['expr']}.")


def solve(task: Task, sandbox=None, manager=None, effort: str | None = None) -> list[dict]:
    """A scripted episode. Standard: read the file, write the fix, check the prompt's examples, report (the
    same at every effort); easy: `solve_easy`."""
    if task.kind in _EASY:
        with task_sandbox(task, sandbox, manager) as sb:
            return solve_easy(task, sb, effort)
    path, func = task.hidden["solution_path"], task.hidden["func"]
    with task_sandbox(task, sandbox, manager) as sb:
        s = Script(task, sb)
        (src,) = s.call(f"Read the current {path} first.", ("cat", {"path": path}))
        if f"def {func}(" not in src:
            raise TaskError(f"task {task.id}: {path} does not define {func}")
        s.call(f"{task.hidden['diagnosis']} Rewrite the function.",
               ("write_file", {"path": path, "content": task.hidden["reference"]}))
        check = "from solution import *\n" + "\n".join(task.hidden["examples"]) + "\nprint('examples pass')\n"
        (_, out) = s.call("Check the examples from the request with a small script.",
                          ("write_file", {"path": f"{WORKDIR}/check.py", "content": check}),
                          ("run_python", {"path": f"{WORKDIR}/check.py"}))
        if not out.startswith("exit code 0"):
            raise TaskError(f"task {task.id}: the reference fails the examples:\n{out}")
        return s.answer("The examples pass, so the function is done.",
                        f"`{func}` in {path} is now correct; the examples from the request pass.")
