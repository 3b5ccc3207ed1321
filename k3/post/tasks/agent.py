"""General-agent tasks at two levels: look up values in the files of a sandbox with tools, answer (and sometimes
write the answer to a file).

- "standard": sales records spread over files, combined. Layout of a task's workspace: `/work/README.txt`
  (the record format) and `/work/data/<region>/<store>.txt`, one sale per line (`item=<name> price=<int>`).
  Kinds: `sum` (total price of an item), `count` (number of its sales), `max` (its highest price).
  A `_write` kind also requires `/work/answer.txt` to hold the answer, and the verifier reads it from the
  sandbox's final state.
- "easy": one to three one-line files `/work/<name>.txt` and the tools cat and grep. Kinds: `read` ("What
  number is stored in <name>.txt?", the scripted solver `cat`s it), `find` ("Which file under /work mentions
  <word>?", answered with the file's name, the solver `grep`s for the word). An episode is one tool call and
  the answer: a `cat` turn is at most 64 tokens with K3's chat markup (a one-argument tool call alone is ~52),
  a `grep` turn (two arguments, ~66) at most ~80, and the scripted reasoning is longer at a higher effort
  (`solve_easy`). There is no `_write` kind at this level: it would add a second two-argument call.
"""

from __future__ import annotations

import random

from .base import WORKDIR, Reward, Task, TaskError, answer_matches, by_effort, collect_level, normalise
from .sandbox_io import Script, task_sandbox
from .tools import AGENT_TOOLS, CAT, GREP

LEVELS = ("easy", "standard")

ITEMS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "onion", "pepper", "potato", "radish",
         "tomato", "carrot", "garlic", "ginger", "kiwi", "olive", "peach", "plum", "walnut")
REGIONS = ("north", "south", "east", "west", "central")
ANSWER_FILE = f"{WORKDIR}/answer.txt"
README = ("Sales records. Every file under data/ holds one sale per line, written as\n"
          "item=<name> price=<whole euros>\n")
SYSTEM = ("You are an agent with tools in a sandbox; the workspace is /work. Inspect the files with the tools, "
          "then end your final reply with a line 'Answer: <value>'.")
_QUESTION = {"sum": "What is the total price of all sales of {item} recorded under /work/data?",
             "count": "How many sales of {item} are recorded under /work/data?",
             "max": "What is the highest price paid in a single sale of {item}, over all files under /work/data?"}


def _draw(rng: random.Random):
    item = rng.choice(ITEMS)
    others = [i for i in ITEMS if i != item]
    files: dict[str, str] = {f"{WORKDIR}/README.txt": README}
    prices: list[int] = []
    for region in rng.sample(REGIONS, rng.randint(2, 3)):
        for s in range(1, rng.randint(1, 3) + 1):
            lines = [f"item={rng.choice(others)} price={rng.randint(1, 60)}" for _ in range(rng.randint(2, 5))]
            for _ in range(rng.choice((0, 0, 1, 1, 2))):
                p = rng.randint(1, 60)
                prices.append(p)
                lines.insert(rng.randint(0, len(lines)), f"item={item} price={p}")
            files[f"{WORKDIR}/data/{region}/store_{s}.txt"] = "\n".join(lines) + "\n"
    if not prices:
        return None
    op = rng.choice(("sum", "count", "max"))
    value = sum(prices) if op == "sum" else len(prices) if op == "count" else max(prices)
    write = rng.random() < 0.5
    q = _QUESTION[op].format(item=item)
    if write:
        q += f" Also write the answer (just the number) to {ANSWER_FILE}."
    hidden = {"answers": [str(value)], "item": item, "op": op, "answer_file": ANSWER_FILE if write else None}
    return (op + ("_write" if write else ""), [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            hidden, files)


# --------------------------------------------------------------------------------------------- easy
WORDS = ("amber", "breeze", "canyon", "dune", "ember", "fjord", "glacier", "harbor", "island", "jungle", "lagoon",
         "meadow", "nebula", "orchid", "prairie", "quartz", "river", "summit", "tundra", "valley")  # none in another
EASY_KINDS = ("read", "find")
EASY_TOOLS = [CAT, GREP]
SYSTEM_EASY = "The workspace is /work. Use a tool, then end your reply with a line 'Answer: <value>'."


def _draw_easy(rng: random.Random):
    names = rng.sample(ITEMS, rng.randint(1, 3))
    target = rng.randrange(len(names))
    kind = rng.choice(EASY_KINDS)
    if kind == "find":
        words = rng.sample(WORDS, len(names))
        q = f"Which file under {WORKDIR} mentions {words[target]}? Answer with its name."
        name = names[target]
        hidden = {"answers": [f"{name}.txt", f"{WORKDIR}/{name}.txt", name], "word": words[target]}
    else:
        words = [str(v) for v in rng.sample(range(10, 1000), len(names))]
        q = f"What number is stored in {names[target]}.txt?"
        hidden = {"answers": [words[target]], "path": f"{names[target]}.txt"}
    files = {f"{WORKDIR}/{n}.txt": f"{w}\n" for n, w in zip(names, words)}
    return kind, [{"role": "system", "content": SYSTEM_EASY}, {"role": "user", "content": q}], hidden, files


def generate(split: str, n: int, seed: int, level: str = "standard") -> list[Task]:
    return collect_level("agent", split, n, seed, level, {"easy": (_draw_easy, EASY_TOOLS),
                                                          "standard": (_draw, AGENT_TOOLS)})


def verify(task: Task, response: str, sandbox=None) -> Reward:
    """The final answer, and for `_write` kinds the answer file in the sandbox's final state."""
    ok, got = answer_matches(response, task.hidden["answers"])
    if not ok:
        return Reward(0.0, f"answer {got!r}, expected {task.hidden['answers'][0]!r}")
    path = task.hidden.get("answer_file")
    if not path:
        return Reward(1.0, f"answer {got!r}")
    if sandbox is None:
        raise TaskError(f"task {task.id} checks the final sandbox state ({path}); pass the episode's sandbox")
    from k3.env import SandboxError
    try:
        text = sandbox.read_file(path).decode("utf-8", errors="replace")
    except SandboxError as e:
        return Reward(0.0, f"answer {got!r} but {path} is missing ({e})")
    if normalise(text) != normalise(task.hidden["answers"][0]):
        return Reward(0.0, f"answer {got!r} but {path} holds {text[:80]!r}")
    return Reward(1.0, f"answer {got!r} and {path} written")


def solve_easy(task: Task, sb, effort: str | None = None) -> list[dict]:
    """One `cat` (read) or `grep` (find), then `Answer: <value>`; the reasoning is a few words at effort low,
    a short sentence at high (None), and a check added at max (a `cat` turn ≤ 64 tokens, a `grep` turn ≤ ~80)."""
    s = Script(task, sb)
    ans = task.hidden["answers"][0]
    if task.kind == "find":
        (hits,) = s.call(by_effort(effort, "Search.", "Grep for it."), ("grep", {"pattern": task.hidden["word"],
                                                                                 "path": "."}))
        seen = [line.split(":", 1)[0] for line in hits.splitlines()]
        if seen != [f"{WORKDIR}/{ans}"]:
            raise TaskError(f"task {task.id}: grep for {task.hidden['word']!r} found {seen}, expected {ans}")
        return s.answer(by_effort(effort, ans, f"It is {ans}.", "Check: only that file matched."), f"Answer: {ans}")
    path = task.hidden["path"]
    (text,) = s.call(by_effort(effort, "Read it.", f"Read {path}."), ("cat", {"path": path}))
    if text.strip() != ans:
        raise TaskError(f"task {task.id}: {path} holds {text!r}, the task says {ans}")
    return s.answer(by_effort(effort, ans, f"The file holds {ans}.", "Check: it is the file asked for."),
                    f"Answer: {ans}")


def solve(task: Task, sandbox=None, manager=None, effort: str | None = None) -> list[dict]:
    """A scripted episode on a real sandbox. Standard: look around, grep the item, combine, (write), answer
    (the same at every effort); easy: `solve_easy`."""
    if task.kind in EASY_KINDS:
        with task_sandbox(task, sandbox, manager) as sb:
            return solve_easy(task, sb, effort)
    item, op = task.hidden["item"], task.hidden["op"]
    with task_sandbox(task, sandbox, manager) as sb:
        s = Script(task, sb)
        s.call("The data is spread over files. First see the workspace layout and the record format.",
               ("ls", {"path": WORKDIR}), ("cat", {"path": f"{WORKDIR}/README.txt"}))
        (listing,) = s.call("Records are 'item=<name> price=<n>' lines under data/. List the regions.",
                            ("ls", {"path": f"{WORKDIR}/data"}))
        regions = [x.rstrip("/") for x in listing.splitlines() if x.endswith("/")]
        (hits,) = s.call(f"There are {len(regions)} region directories ({', '.join(regions)}). Search all of them "
                         f"for sales of {item} at once.", ("grep", {"pattern": f"item={item} ", "path": "data"}))
        prices = [int(line.rsplit("price=", 1)[1]) for line in hits.splitlines() if "price=" in line]
        if not prices:
            raise TaskError(f"scripted solver found no sales of {item} in task {task.id}")
        where = sorted({line.split(":", 1)[0] for line in hits.splitlines()})
        seen = (f"The search found {len(prices)} sales of {item} in {len(where)} files, priced "
                f"{', '.join(map(str, prices))}.")
        if op == "sum":
            value = sum(prices)
            step = f"Total: {' + '.join(map(str, prices))} = {value}."
        elif op == "count":
            value = len(prices)
            step = f"Counting the matching lines gives {value}."
        else:
            value = max(prices)
            step = f"The largest of {', '.join(map(str, prices))} is {value}."
        if str(value) != task.hidden["answers"][0]:
            raise TaskError(f"scripted solver got {value} for task {task.id}, the task says "
                            f"{task.hidden['answers'][0]}")
        if task.hidden.get("answer_file"):
            s.call(f"{seen} {step} The task also asks for the answer in {task.hidden['answer_file']}.",
                   ("write_file", {"path": task.hidden["answer_file"], "content": f"{value}\n"}))
            return s.answer("The answer file is written; report the result.",
                            f"The {op} for {item} is {value}, and it is saved in {task.hidden['answer_file']}.\n"
                            f"Answer: {value}")
        return s.answer(f"{seen} {step}", f"The {op} for {item} is {value}.\nAnswer: {value}")
