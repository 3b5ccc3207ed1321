"""Built-in post-training tasks (k3.post.tasks), the parts that need no sandbox: generators and splits, the
general domain's answers and verifier, chat rendering and parsing of solutions, effort-budget token counts,
the JSONL format and `k3 post data`. Agent / coding episodes: tests/test_post_tasks_sandbox.py."""

import ast
import json
import operator
import re
from decimal import Decimal

import pytest

from k3.io import chat
from k3.io.tokenizer import K3Tokenizer, k3_special_tokens
from k3.post import tasks
from k3.post.tasks import general
from k3.post.tasks.base import normalise, split_of
from k3.post.tasks.tools import CAT, GREP, WRITE_FILE


@pytest.fixture(scope="module")
def tok():
    """Byte-level tokenizer with K3's special block: one token per byte, one per marker."""
    return K3Tokenizer({bytes([b]): b for b in range(256)}, k3_special_tokens(256, 256 + 32))


def _key(t):
    return json.dumps([t.domain, t.kind, t.messages, t.files], sort_keys=True)


# ------------------------------------------------------------------------------------------ generators

@pytest.mark.parametrize("domain", tasks.DOMAINS)
def test_generate_is_deterministic_and_splits_are_disjoint(domain):
    a = tasks.generate(domain, "train", 40, seed=0)
    assert [t.to_record() for t in a] == [t.to_record() for t in tasks.generate(domain, "train", 40, seed=0)]
    b = tasks.generate(domain, "train", 40, seed=1)
    assert {_key(t) for t in a} != {_key(t) for t in b}            # the seed matters
    train = {_key(t) for s in (0, 1, 2) for t in tasks.generate(domain, "train", 40, seed=s)}
    test = {_key(t) for s in (0, 1, 2) for t in tasks.generate(domain, "test", 25, seed=s)}
    assert train and test and not train & test                     # no held-out prompt in any train seed
    # the split is a function of the prompt alone, whatever seed produced it
    test_prompts = {t.prompt_text for s in (0, 1) for t in tasks.generate(domain, "test", 25, seed=s)}
    for t in a:
        assert t.split == "train" and t.domain == domain and t.id.startswith(f"{domain}-{t.kind}-")
        assert t.prompt_text not in test_prompts or t.files          # agent prompts differ only in their files
    assert len({t.id for t in a}) == len(a) == 40


def test_generate_rejects_bad_requests():
    with pytest.raises(ValueError, match="'maths' is not one of general, agent, coding"):
        tasks.generate("maths", "train", 3, 0)
    with pytest.raises(ValueError, match="split 'dev'"):
        tasks.generate("general", "dev", 3, 0)
    for n in (-1, 1.5, True):
        with pytest.raises(ValueError, match="n must be a non-negative integer"):
            tasks.generate("general", "train", n, 0)
    with pytest.raises(ValueError, match="found only"):               # the QA-only pool is finite
        from k3.post.tasks.base import collect
        collect("general", "test", 10_000, 0, lambda rng: ("qa", [{"role": "user", "content": general._qa(rng)[1]}],
                                                             {}, {}), max_tries_per_task=2)


# ------------------------------------------------------------------------------------------ general

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _ast_eval(node):
    """An independent evaluator of the generated expressions (ints, + - *, brackets)."""
    if isinstance(node, ast.Expression):
        return _ast_eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_ast_eval(node.left), _ast_eval(node.right))
    raise AssertionError(f"unexpected node {ast.dump(node)}")


_TO_BASE = {"millimetres": 1, "centimetres": 10, "metres": 1000, "kilometres": 10 ** 6, "seconds": 1, "minutes": 60,
            "hours": 3600, "days": 86400, "weeks": 604800, "milligrams": 1, "grams": 1000, "kilograms": 10 ** 6,
            "tonnes": 10 ** 9, "millilitres": 1, "litres": 1000}


def test_general_answers_are_right():
    from pydoc_data.topics import topics
    ts = tasks.generate("general", "train", 150, seed=3) + tasks.generate("general", "test", 60, seed=3)
    kinds = {t.kind for t in ts}
    assert kinds == {"arith", "units", "qa"}
    for t in ts:
        q, ans = t.messages[-1]["content"], t.hidden["answers"][0]
        if t.kind == "arith":
            expr = re.fullmatch(r"Compute (.*)\.", q).group(1)
            assert int(ans) == _ast_eval(ast.parse(expr, mode="eval")) and len(t.hidden["steps"]) >= 2
        elif t.kind == "units":
            amount, src, dst = re.fullmatch(r"Convert (\S+) (\w+) to (\w+)\. Give the number only\.", q).groups()
            src = src if src in _TO_BASE else src + "s"                    # "1 hour"
            assert Decimal(ans) == Decimal(amount) * _TO_BASE[src] / _TO_BASE[dst]
        else:
            m = re.search(r"heading of the topic '([^']+)'", q)
            if m:
                assert topics[m.group(1)].split("\n", 1)[0].strip() == ans
            m = re.search(r"has the heading '(.+)'\?$", q)
            if m:
                assert topics[ans].split("\n", 1)[0].strip() == m.group(1)
            m = re.search(r"rule `(\w+)` start with", q)
            if m:
                assert any(re.search(rf'{m.group(1)}\s+::=\s+"{ans}"', v) for v in topics.values())


def test_general_verify_accepts_the_solution_and_rejects_wrong_answers():
    for t in tasks.generate("general", "train", 30, seed=5):
        conv = tasks.solve(t)
        assert tasks.verify(t, conv.final_answer).score == 1.0
        ans = t.hidden["answers"][0]
        assert tasks.verify(t, f"Some words first.\n  ANSWER:   {ans.upper()}. ").score == 1.0
        assert tasks.verify(t, f"Answer: {ans}\nwait, no.\nAnswer: 0{ans}x").score == 0.0   # the last line counts
        wrong = str(int(Decimal(ans)) + 1) if t.kind != "qa" else ans + "s"
        r = tasks.verify(t, f"Answer: {wrong}")
        assert r.score == 0.0 and repr(ans) in r.detail
        assert tasks.verify(t, "").score == 0.0


def test_answer_normalisation():
    assert normalise("  4,500. ") == normalise("4500.0") == "4500"
    assert normalise("`Coroutines`") == normalise("coroutines")
    assert normalise("2.50") == "2.5" and normalise("-0.5") == "-0.5"
    assert normalise("12 + 5") != normalise("17")


def _parse_each_assistant(messages, tools):
    """Each assistant message parsed back from the rendering of the conversation up to it."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        text = chat.render(messages[:i + 1], tools=tools, add_generation_prompt=False)
        body = text.rsplit('<|open|>message role="assistant"<|sep|>', 1)[1]
        out.append((m, chat.parse(body)))
    return out


def assert_round_trip(messages, tools):
    pairs = _parse_each_assistant(messages, tools)
    assert pairs
    for m, p in pairs:
        assert p["reasoning_content"] == (m.get("reasoning_content") or None)
        assert (p["content"] or None) == (m.get("content") or None)
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.get("tool_calls") or []]
        assert got == want


def test_general_solutions_render_and_round_trip(tok):
    for t in tasks.generate("general", "test", 12, seed=0):
        conv = tasks.solve(t)
        text = chat.render(conv.messages, tools=conv.tools)
        assert conv.render() in text and t.hidden["steps"][-1] in text
        assert len(chat.encode(tok, conv.messages, tools=conv.tools)) > 0
        assert_round_trip(conv.messages, conv.tools)


# ------------------------------------------------------------------------------------------ budgets

def _generated_by_string(text: str) -> int:
    """Independent count for a byte tokenizer: what follows each assistant header and its opening
    `<|open|>think<|sep|>`, up to and including `<|end_of_msg|>`: one token per marker, one per byte."""
    head = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    total = 0
    for part in text.split(head)[1:]:
        body = part[:part.index(chat.END_OF_MSG) + len(chat.END_OF_MSG)]
        n_markers = sum(body.count(mk) for mk in (chat.OPEN, chat.CLOSE, chat.SEP, chat.END_OF_MSG))
        for mk in (chat.OPEN, chat.CLOSE, chat.SEP, chat.END_OF_MSG):
            body = body.replace(mk, "")
        total += n_markers + len(body.encode())
    return total


HAND = [{"role": "user", "content": "list it"},
        {"role": "assistant", "reasoning_content": "r", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/w"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
        {"role": "assistant", "reasoning_content": "", "content": "A: 1"}]


def test_count_tokens_hand_built(tok):
    # general: thinking tokens only ("12 + 5 = 17" is 11 bytes, "ok" 2; responses and prompts do not count)
    conv = [{"role": "user", "content": "12 + 5?"},
            {"role": "assistant", "reasoning_content": "12 + 5 = 17", "content": "Answer: 17"},
            {"role": "user", "content": "sure?"}, {"role": "assistant", "reasoning_content": "ok", "content": "yes"}]
    assert tasks.count_tokens(conv, tok, "general") == 13
    # agentic: message 1 after `<|open|>think<|sep|>`: "r" + think close (7) + response open/close (20) + the
    # tools block with one call and one argument (103) = 131; message 2: empty think close (7) + response
    # with "A: 1" (24) + message close and end (10) = 41
    assert tasks.count_tokens(HAND, tok, "agent", tools=tasks.AGENT_TOOLS) == 172
    assert tasks.count_tokens(HAND, tok, "coding") == 172                     # tools declared or not: same
    assert _generated_by_string(chat.render(HAND, add_generation_prompt=False)) == 172
    longer = [dict(m, content="a much longer tool result" * 10) if m["role"] == "tool" else m for m in HAND]
    assert tasks.count_tokens(longer, tok, "agent") == 172                    # tool results are not output
    more_args = json.loads(json.dumps(HAND))
    more_args[1]["tool_calls"][0]["function"]["arguments"] = '{"path": "/w/abc"}'
    assert tasks.count_tokens(more_args, tok, "agent") == 176                 # tool arguments are (+4 bytes)
    assert tasks.count_tokens(HAND, tok, "general") == 1
    with pytest.raises(ValueError, match="'chat' is not one of"):
        tasks.count_tokens(HAND, tok, "chat")


def test_count_tokens_matches_the_rendering_on_solutions(tok):
    for t in tasks.generate("general", "train", 5, seed=9):
        conv = tasks.solve(t)
        assert tasks.count_tokens(conv, tok, "general") == len("\n".join(t.hidden["steps"]).encode())
        assert tasks.count_tokens(conv, tok, "agent") == _generated_by_string(conv.render())


# ------------------------------------------------------------------------------------------ data

def test_jsonl_round_trip(tmp_path):
    ts = tasks.generate("general", "train", 4, seed=0) + tasks.generate("agent", "test", 2, seed=0)
    convs = [tasks.solve(t) for t in ts[:4]]
    p = tmp_path / "d.jsonl"
    assert tasks.write_jsonl(convs + ts, p) == 10
    recs = tasks.read_jsonl(p)
    assert recs[:4] == [c.to_record() for c in convs]
    assert set(recs[0]) == {"messages", "tools", "task_id", "domain"}
    assert [tasks.Task.from_record(r) for r in recs[4:]] == ts
    with pytest.raises(tasks.TaskError, match="lacks split, kind, hidden"):
        tasks.Task.from_record(recs[0])
    p.write_text(p.read_text() + '{"messages": []}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:11: record lacks tools, task_id, domain"):
        tasks.read_jsonl(p)
    p.write_text("{nope\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: not valid JSON"):
        tasks.read_jsonl(p)


def test_main_data(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert tasks.main_data(["--domain", "general", "--split", "test", "-n", "5", "--seed", "2", "--out", str(out)]) == 0
    recs = tasks.read_jsonl(out)
    assert len(recs) == 5 and all(r["domain"] == "general" and r["messages"][-1]["role"] == "assistant" for r in recs)
    assert [r["task_id"] for r in recs] == [t.id for t in tasks.generate("general", "test", 5, 2)]
    assert tasks.main_data(["--domain", "all", "-n", "2", "--out", str(out), "--prompts"]) == 0
    assert [r["domain"] for r in tasks.read_jsonl(out)] == ["general"] * 2 + ["agent"] * 2 + ["coding"] * 2
    for argv, msg in ((["--domain", "maths", "-n", "2", "--out", str(out)], "invalid choice: 'maths'"),
                      (["--domain", "general", "-n", "0", "--out", str(out)], "expected a positive integer, got 0"),
                      (["--domain", "general", "-n", "x", "--out", str(out)], "expected a positive integer, got 'x'")):
        with pytest.raises(SystemExit) as e:
            tasks.main_data(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_hidden_tests_without_python_are_a_task_error():
    """A sandbox that cannot run the harness is the task's fault, not a reward of 0 (a stand-in sandbox)."""
    from k3.env import ExecResult
    from k3.post.tasks.harness import run_hidden_tests

    class NoPython:
        def write_file(self, path, data, mode=0o644):
            self.written = (path, data)

        def exec(self, cmd, **kw):
            return ExecResult("", "/bin/sh: 1: python3: not found\n", 127)

    sb = NoPython()
    with pytest.raises(tasks.TaskError, match="no python3"):
        run_hidden_tests(sb, ["assert 1 == 1"], "t")
    assert b"assert 1 == 1" in sb.written[1] and sb.written[0].startswith("/tmp/")


# ------------------------------------------------------------------------------------------ easy level, efforts

_EASY_KINDS = {"general": {"copy", "add"}, "agent": {"read", "find"}, "coding": {"add", "mul", "const"}}


@pytest.mark.parametrize("domain", tasks.DOMAINS)
def test_easy_level_is_deterministic_and_held_out_disjoint(domain):
    assert tasks.LEVELS[domain] == ("easy", "standard")
    a = tasks.generate(domain, "train", 60, seed=0, level="easy")
    assert [t.to_record() for t in a] == [t.to_record() for t in tasks.generate(domain, "train", 60, 0, level="easy")]
    assert {_key(t) for t in a} != {_key(t) for t in tasks.generate(domain, "train", 60, 1, level="easy")}
    train = {_key(t) for s in (0, 1, 2) for t in tasks.generate(domain, "train", 60, s, level="easy")}
    test = {_key(t) for s in (0, 1, 2) for t in tasks.generate(domain, "test", 15, s, level="easy")}
    assert train and test and not train & test                      # no held-out prompt in any train seed
    for t in a:                                                      # the split is the prompt's own
        prompt = t.prompt_text + json.dumps(t.files, sort_keys=True)
        assert t.split == "train" and split_of(domain, t.kind, prompt) == "train"
    assert {t.kind for t in a} == _EASY_KINDS[domain] and len({t.id for t in a}) == 60
    standard = {_key(t) for t in tasks.generate(domain, "train", 60, 0)}
    assert not standard & train                                      # the levels are different tasks


def test_easy_agent_and_coding_tasks_are_what_they_say():
    """Agent: the asked-for file holds the answer (read) or is the only one mentioning the word (find); coding:
    the reference one-liner passes the hidden asserts on the host and the starter does not define it."""
    for t in tasks.generate("agent", "train", 40, 3, level="easy") + tasks.generate("agent", "test", 10, 3, "easy"):
        assert t.tools == [CAT, GREP] and 1 <= len(t.files) <= 3
        q, ans = t.messages[-1]["content"], t.hidden["answers"][0]
        if t.kind == "read":
            name = re.fullmatch(r"What number is stored in (\w+\.txt)\?", q).group(1)
            assert t.files[f"/work/{name}"] == f"{ans}\n" and len(set(t.files.values())) == len(t.files)
        else:
            word = re.fullmatch(r"Which file under /work mentions (\w+)\? Answer with its name\.", q).group(1)
            assert [p for p, text in t.files.items() if word in text] == [f"/work/{ans}"]
            assert tasks.verify(t, f"Answer: /work/{ans}").score == 1.0
        assert tasks.verify(t, f"Answer: {ans}").score == 1.0
        assert tasks.verify(t, "Answer: 0").score == tasks.verify(t, "Answer: x.txt").score == 0.0
    for t in tasks.generate("coding", "train", 40, 3, level="easy") + tasks.generate("coding", "test", 10, 3, "easy"):
        assert t.tools == [WRITE_FILE] and len(t.hidden["tests"]) == 5 and not t.hidden["examples"]
        ns: dict = {}
        exec(t.hidden["reference"], ns)                              # our own one-liner
        for test in t.hidden["tests"]:
            exec(test, dict(ns))
        assert len(t.hidden["reference"].splitlines()) == 1 and t.hidden["expr"] in t.messages[-1]["content"]
        assert "NotImplementedError" in t.files["/work/solution.py"]


def test_easy_answers_are_right_and_verified():
    for t in tasks.generate("general", "train", 40, 4, level="easy") + tasks.generate("general", "test", 10, 4, "easy"):
        q, ans = t.messages[-1]["content"], t.hidden["answers"][0]
        if t.kind == "copy":
            assert re.fullmatch(r"Repeat this code: (\d+)\.", q).group(1) == ans
        else:
            a, b = map(int, re.fullmatch(r"What is (\d) \+ (\d)\?", q).groups())
            assert int(ans) == a + b
        for e in ("low", "high", "max"):
            assert tasks.verify(t, tasks.solve(t, effort=e).final_answer).score == 1.0
        assert tasks.verify(t, f"Answer: {int(ans) + 1}").score == 0.0


def test_bad_level_is_named():
    with pytest.raises(ValueError, match="level 'hard' is not one of easy, standard"):
        tasks.generate("general", "train", 3, 0, level="hard")
    with pytest.raises(ValueError, match="level 'hard' is not one of easy, standard .domain 'agent'"):
        tasks.generate("agent", "train", 3, 0, level="hard")
    with pytest.raises(ValueError, match="effort 'huge' is not one of low, high, max"):
        tasks.solve(tasks.generate("general", "train", 1, 0)[0], effort="huge")


def test_reasoning_length_follows_the_effort(tok):
    """Counted thinking tokens: low < high < max on easy tasks, low <= high < max on standard ones (a one-step
    conversion has nothing to drop); the record carries the effort and renders it into the prompt."""
    for level in ("easy", "standard"):
        for t in tasks.generate("general", "train", 20, 6, level=level):
            n = {e: tasks.count_tokens(tasks.solve(t, effort=e), tok, "general") for e in ("low", "high", "max")}
            assert n["low"] <= n["high"] < n["max"], (t.id, n)
            if level == "easy" or len(t.hidden["steps"]) > 1:
                assert n["low"] < n["high"], (t.id, n)
            assert tasks.count_tokens(tasks.solve(t), tok, "general") == n["high"]   # no effort: high-length
    conv = tasks.solve(tasks.generate("general", "train", 1, 0, level="easy")[0], effort="low")
    rec = conv.to_record()
    assert rec["reasoning_effort"] == "low" and "thinking_effort=low" in conv.render()
    from k3.post.sft_data import encode_example
    ids, _ = encode_example(tok, rec)
    assert "thinking_effort=low" in tok.decode(ids)


def test_has_answer_line():
    from k3.post.tasks.base import has_answer_line
    assert has_answer_line("Answer: 12") and has_answer_line("some text\n  final answer:  x ")
    assert not has_answer_line("Answer:   ") and not has_answer_line("the answer is 12") and not has_answer_line("")
