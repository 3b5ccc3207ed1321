"""General tasks at two levels, every answer exact and checked after normalisation (`base.answer_matches`).

- "standard": multi-step integer arithmetic, exact unit conversions, factual QA over `pydoc_data.topics`;
- "easy": copy a code back (2–4 digits) and single-digit addition: what a model of a few million
  parameters can learn in CPU minutes, so that learning is measurable on held-out prompts.

The QA pool comes from the running Python's `pydoc_data` (its text changes between Python versions, so QA
tasks are deterministic per seed *and* Python version; the expected answer travels with the task). The
scripted solver writes the intermediate steps as its reasoning and ends its response with `Answer: <value>`;
how much it writes depends on the reasoning effort (`reasoning`): low keeps only the last step, high all
steps, max adds a check, so a cold start teaches the lengths that the effort budgets then hold.
"""

from __future__ import annotations

import random
import re
from decimal import Decimal
from functools import lru_cache

from .base import Reward, Task, answer_matches, collect_level, format_number

SYSTEM = "You are a careful assistant. Think step by step, then end your reply with a line 'Answer: <value>'."
SYSTEM_EASY = "End your reply with a line 'Answer: <value>'."
LEVELS = ("easy", "standard")

# --------------------------------------------------------------------------------------------- arithmetic
_PREC = {"+": 1, "-": 1, "*": 2}


def _expr(rng: random.Random, n_ops: int):
    """A random expression tree: an int leaf or (op, left, right)."""
    if n_ops == 0:
        return rng.randint(1, 30)
    k = rng.randint(0, n_ops - 1)
    op = rng.choice("+-*")
    return (op, _expr(rng, k), _expr(rng, n_ops - 1 - k))


def _render(e, parent: str | None = None, right: bool = False) -> str:
    if isinstance(e, int):
        return str(e)
    op, a, b = e
    s = f"{_render(a, op, False)} {op} {_render(b, op, True)}"
    if parent is not None and (_PREC[op] < _PREC[parent] or (right and _PREC[op] == _PREC[parent])):
        s = f"({s})"   # a right operand of equal precedence keeps its brackets: the steps follow the tree
    return s


def _eval_steps(e, steps: list[str]) -> int:
    """Value of `e`, appending one 'a op b = c' line per operation in evaluation order."""
    if isinstance(e, int):
        return e
    op, a, b = e
    x, y = _eval_steps(a, steps), _eval_steps(b, steps)
    v = x + y if op == "+" else x - y if op == "-" else x * y
    steps.append(f"{x} {op} {y if y >= 0 else f'({y})'} = {v}")
    return v


def _arithmetic(rng: random.Random):
    e = _expr(rng, rng.randint(2, 4))
    steps: list[str] = []
    value = _eval_steps(e, steps)
    if abs(value) > 100_000:
        return None
    text = _render(e)
    return ("arith", f"Compute {text}.", {"answers": [str(value)], "steps": steps, "expression": text})


# --------------------------------------------------------------------------------------------- units
# (unit, next larger unit, factor): 1 larger = factor × unit; chains give two-step conversions
_CHAINS = [
    [("millimetres", "mm", 1), ("centimetres", "cm", 10), ("metres", "m", 100), ("kilometres", "km", 1000)],
    [("seconds", "s", 1), ("minutes", "min", 60), ("hours", "h", 60), ("days", "d", 24), ("weeks", "wk", 7)],
    [("milligrams", "mg", 1), ("grams", "g", 1000), ("kilograms", "kg", 1000), ("tonnes", "t", 1000)],
    [("millilitres", "mL", 1), ("litres", "L", 1000)],
]


def _units(rng: random.Random):
    chain = rng.choice(_CHAINS)
    i = rng.randrange(len(chain))
    j = rng.choice([j for j in range(len(chain)) if j != i and abs(i - j) <= 2])   # one or two steps
    lo, hi = min(i, j), max(i, j)
    factor = 1
    for k in range(lo + 1, hi + 1):
        factor *= chain[k][2]
    src, dst = chain[i], chain[j]
    if i > j:   # larger → smaller: an integer or one-decimal amount, multiplied
        amount = Decimal(rng.randint(1, 99)) / (10 if rng.random() < 0.3 else 1)
    else:       # smaller → larger: a multiple of half the factor (exact, at most one decimal)
        amount = Decimal(rng.randint(1, 40) * factor) / (2 if factor % 2 == 0 and rng.random() < 0.3 else 1)
    steps, cur = [], amount
    rng_k = range(i, j, -1) if i > j else range(i, j)
    for k in rng_k:
        if i > j:
            f = chain[k][2]
            nxt = cur * f
            steps.append(f"{format_number(cur)} {_unit(chain[k][0], cur)} = {format_number(cur)} × {f} = "
                         f"{format_number(nxt)} {_unit(chain[k - 1][0], nxt)}")
        else:
            f = chain[k + 1][2]
            nxt = cur / f
            steps.append(f"{format_number(cur)} {_unit(chain[k][0], cur)} = {format_number(cur)} / {f} = "
                         f"{format_number(nxt)} {_unit(chain[k + 1][0], nxt)}")
        cur = nxt
    ans = format_number(cur)
    prompt = f"Convert {format_number(amount)} {_unit(src[0], amount)} to {dst[0]}. Give the number only."
    return ("units", prompt, {"answers": [ans, f"{ans} {dst[1]}", f"{ans} {_unit(dst[0], cur)}"], "steps": steps})


def _unit(name: str, amount: Decimal) -> str:
    """'1 hour', '2 hours' (every unit name of the table is a plural in -s)."""
    return name[:-1] if amount == 1 else name


# --------------------------------------------------------------------------------------------- QA
@lru_cache(maxsize=1)
def qa_pool() -> tuple[tuple[str, str, str], ...]:
    """(question, answer, reasoning) from `pydoc_data.topics`: topic titles, the keyword that starts a
    grammar rule, and the section a subsection heading belongs to. Ambiguous items are left out."""
    from pydoc_data.topics import topics

    titles = {k: v.split("\n", 1)[0].strip() for k, v in topics.items()}
    title_count: dict[str, int] = {}
    for t in titles.values():
        title_count[t] = title_count.get(t, 0) + 1
    items = []
    for k in sorted(titles):
        t = titles[k]
        items.append((f"In Python's reference topics (pydoc_data.topics), what is the heading of the topic '{k}'?",
                      t, f"The topic '{k}' starts with the heading line '{t}'."))
        if title_count[t] == 1:
            items.append((f"Which pydoc topic key has the heading '{t}'?", k,
                          f"The heading '{t}' is the first line of the topic '{k}'."))
    rule = re.compile(r"^\s+([a-z_]+_(?:stmt|expr))\s+::=\s+\"([a-z]+)\"", re.M)
    firsts: dict[str, set[str]] = {}
    for k, v in sorted(topics.items()):
        for m in rule.finditer(v):
            firsts.setdefault(m.group(1), set()).add(m.group(2))
    for name, kws in sorted(firsts.items()):
        if len(kws) == 1:
            kw = next(iter(kws))
            items.append((f"In Python's grammar, which keyword does the rule `{name}` start with?", kw,
                          f"The rule reads `{name} ::= \"{kw}\" ...`, so it starts with the keyword {kw}."))
    sub = re.compile(r"\n\n([A-Z][^\n]{3,70})\n(=+)\n")
    owners: dict[str, set[str]] = {}
    for k, v in sorted(topics.items()):
        for m in sub.finditer(v):
            if len(m.group(2)) == len(m.group(1)):
                owners.setdefault(m.group(1), set()).add(titles[k])
    for head, ts in sorted(owners.items()):
        if len(ts) == 1:
            t = next(iter(ts))
            items.append((f"In Python's reference topics, the subsection '{head}' appears under which section "
                          "heading?", t, f"The subsection '{head}' is part of the topic headed '{t}'."))
    return tuple(items)


def _qa(rng: random.Random):
    q, a, why = rng.choice(qa_pool())
    return ("qa", q, {"answers": [a], "steps": [why]})


# --------------------------------------------------------------------------------------------- easy
def _copy(rng: random.Random):
    v = str(rng.randint(10, 9999))
    return ("copy", f"Repeat this code: {v}.", {"answers": [v], "steps": [f"The code is {v}."], "short": v,
                                               "check": f"Digit by digit: {' '.join(v)}. It matches."})


def _add(rng: random.Random):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return ("add", f"What is {a} + {b}?", {"answers": [str(a + b)], "steps": [f"{a} + {b} = {a + b}"], "short": str(a + b),
                                           "check": f"Check: {a + b} - {b} = {a}."})


def _draw(rng: random.Random):
    got = rng.choice((_arithmetic, _units, _qa))(rng)
    if got is None:
        return None
    kind, prompt, hidden = got
    return kind, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}], hidden, {}


def _draw_easy(rng: random.Random):
    kind, prompt, hidden = rng.choice((_copy, _add))(rng)
    return kind, [{"role": "system", "content": SYSTEM_EASY}, {"role": "user", "content": prompt}], hidden, {}


def generate(split: str, n: int, seed: int, level: str = "standard") -> list[Task]:
    return collect_level("general", split, n, seed, level, {"easy": (_draw_easy, None), "standard": (_draw, None)})


def verify(task: Task, response: str) -> Reward:
    ok, got = answer_matches(response, task.hidden["answers"])
    return Reward(1.0 if ok else 0.0, f"answer {got!r}" + ("" if ok else f", expected {task.hidden['answers'][0]!r}"))


def reasoning(task: Task, effort: str | None = None) -> str:
    """The scripted reasoning of `task` at `effort`: "low" the last step only (an easy task: the bare value),
    "high" (or None) every step, "max" every step plus a check line."""
    steps = list(task.hidden["steps"])
    if effort == "low":
        steps = [task.hidden["short"]] if "short" in task.hidden else steps[-1:]
    elif effort == "max":
        steps.append(task.hidden.get("check") or f"Check: the last step gives {task.hidden['answers'][0]}.")
    return "\n".join(steps)


def solve(task: Task, effort: str | None = None) -> list[dict]:
    """The prompt plus one assistant message: the reasoning at `effort`, `Answer: <value>` as response."""
    return [*task.messages, {"role": "assistant", "reasoning_content": reasoning(task, effort),
                             "content": f"Answer: {task.hidden['answers'][0]}"}]
