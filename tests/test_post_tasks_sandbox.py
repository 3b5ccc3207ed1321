"""Built-in post-training tasks that run in a k3.env sandbox (process tier): the tool executor and its
confinement, agent and coding demonstrations (real tool results, chat rendering, verification) and the
verifiers' rejections. Skipped where the process tier cannot run."""

import os

import pytest

from k3.env import Sandbox, SandboxManager
from k3.io import chat
from k3.post import tasks
from k3.post.tasks import ToolExecutor
from k3.post.tasks.harness import run_hidden_tests
from test_post_tasks import assert_round_trip


def _process_tier_ok() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root"
    try:
        from k3.env.process import ProcessTier
        return ProcessTier.available()
    except Exception as e:  # noqa: BLE001
        return False, f"process tier not importable: {e}"


_OK, _WHY = _process_tier_ok()
pytestmark = pytest.mark.skipif(not _OK, reason=f"agent/coding tasks need the sandbox process tier: {_WHY}")


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    m = SandboxManager(tmp_path_factory.mktemp("post-tasks-sandboxes"))
    yield m
    for s in m.list():
        m.kill(s["sandbox_id"])
    m.shutdown()


@pytest.fixture
def fresh(manager):
    """fresh(task=None) -> a new sandbox holding the task's files; all are killed afterwards."""
    made = []

    def make(task=None):
        sb = Sandbox.create(manager=manager)
        made.append(sb)
        if task is not None:
            tasks.prepare(task, sb)
        return sb
    yield make
    for sb in made:
        sb.kill()


def _one_per_kind(domain, n=40, seed=0):
    by = {}
    for t in tasks.generate(domain, "train", n, seed):
        by.setdefault(t.kind, t)
    return by


# ------------------------------------------------------------------------------------------ tools

def test_tool_executor_runs_tools_and_stays_in_the_workspace(fresh, tmp_path):
    sb = fresh()
    sb.write_file("/work/a/x.txt", "item=fig price=3\nitem=kiwi price=4\n")
    sb.write_file("/work/b.txt", "item=fig price=9\n")
    sb.write_file("/etc/secret.txt", "not for the model")
    ex = ToolExecutor(sb)
    assert ex.execute("ls", {"path": "/work"}) == "a/\nb.txt"
    assert ex.execute("ls", '{"path": "a"}') == "x.txt"
    assert ex.execute("cat", {"path": "a/../b.txt"}) == "item=fig price=9\n"
    assert ex.execute("grep", {"pattern": "fig", "path": "."}) == \
        "/work/a/x.txt:1:item=fig price=3\n/work/b.txt:1:item=fig price=9"
    assert ex.execute("grep", {"pattern": "-v", "path": "b.txt"}) == "(no matches)"     # a pattern, not an option
    assert ex.execute("write_file", {"path": "out/new.txt", "content": "hé"}) == "wrote 3 bytes to /work/out/new.txt"
    assert sb.read_file("/work/out/new.txt") == "hé".encode()
    sb.write_file("/work/loop.py", "print('hi')\n")
    assert ex.execute("run_python", {"path": "loop.py"}).startswith("exit code 0\n--- stdout ---\nhi\n")

    host = tmp_path / "host.txt"
    escapes = ["../etc/secret.txt", "/etc/secret.txt", "/work/../etc/secret.txt", "//etc/secret.txt",
               "/workshop/x", "a/../../etc/secret.txt", str(host), f"../..{host}"]
    for p in escapes:
        for name, args in (("cat", {"path": p}), ("ls", {"path": p}), ("grep", {"pattern": "x", "path": p}),
                           ("write_file", {"path": p, "content": "pwned"})):
            out = ex.execute(name, args)
            assert out.startswith(f"error: {name}: path ") and "outside the workspace /work" in out, (name, p, out)
    assert not host.exists() and sb.read_file("/etc/secret.txt") == b"not for the model"

    bad = [(("rm", {"path": "b.txt"}), "error: unknown tool 'rm'"),
           (("cat", "{not json"), "error: cat: arguments are not valid JSON"),
           (("cat", "[1]"), "error: cat: arguments must be a JSON object, got list"),
           (("cat", {}), "missing path"),
           (("cat", {"path": "b.txt", "mode": "r"}), "unexpected mode"),
           (("cat", {"path": 3}), "argument 'path' must be a string, got int"),
           (("cat", {"path": "nope.txt"}), "error: cat: NotFound"),
           (("cat", {"path": "a"}), "error: cat: BadRequest"),
           (("ls", {"path": "b.txt"}), "error: ls: BadRequest"),
           (("cat", {"path": "a\0b"}), "NUL"),
           (("write_file", {"path": "/work", "content": "x"}), "is the workspace directory"),
           (("grep", {"pattern": "(", "path": "."}), "error: grep: grep:")]
    for (name, args), msg in bad:
        out = ex.execute(name, args)
        assert isinstance(out, str) and out.startswith("error:") and msg in out, (name, args, out)
    assert ToolExecutor(sb, tools=tasks.AGENT_TOOLS).execute("run_python", {"path": "loop.py"}).startswith(
        "error: unknown tool 'run_python'")
    call = {"id": "c", "type": "function", "function": {"name": "cat", "arguments": '{"path":"b.txt"}'}}
    assert ex.execute_call(call) == "item=fig price=9\n"
    assert ex.execute_call({"id": "c"}).startswith("error:")
    sb.pause()
    assert ex.execute("grep", {"pattern": "x", "path": "."}).startswith("error: grep: InvalidState")
    sb.resume()


# ------------------------------------------------------------------------------------------ agent

def test_agent_demonstrations_are_real_and_verify(fresh, manager, tok):
    by = _one_per_kind("agent")
    assert {"sum", "count", "max", "sum_write", "count_write", "max_write"} <= set(by)
    for kind, t in sorted(by.items()):
        sb = fresh(t)
        conv = tasks.solve(t, sandbox=sb)
        assert conv.messages[:len(t.messages)] == t.messages
        assert tasks.verify(t, conv.final_answer, sandbox=sb).score == 1.0, kind
        # tool results are what the tools really return on the task's files
        calls = {c["id"]: c for m in conv.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []}
        results = [m for m in conv.messages if m["role"] == "tool"]
        assert len(results) == len(calls) >= 4
        replay = ToolExecutor(fresh(t), tools=t.tools)
        for m in results:
            assert replay.execute_call(calls[m["tool_call_id"]]) == m["content"]
        grep = next(m["content"] for m in results if calls[m["tool_call_id"]]["function"]["name"] == "grep")
        for line in grep.splitlines():
            path, _, text = line.split(":", 2)
            assert text in t.files[path].splitlines()
        # and a fresh sandbox from the manager gives the same conversation
        assert tasks.solve(t, manager=manager).messages == conv.messages
        chat.render(conv.messages, tools=conv.tools)
        assert_round_trip(conv.messages, conv.tools)
        assert tasks.count_tokens(conv, tok, "agent") > tasks.count_tokens(conv, tok, "general") > 0

        ans = t.hidden["answers"][0]
        assert tasks.verify(t, f"Answer: {int(ans) + 1}", sandbox=sb).score == 0.0
        if kind.endswith("_write"):
            untouched = fresh(t)
            r = tasks.verify(t, conv.final_answer, sandbox=untouched)
            assert r.score == 0.0 and "missing" in r.detail
            untouched.write_file(t.hidden["answer_file"], f"{int(ans) + 1}\n")
            assert tasks.verify(t, conv.final_answer, sandbox=untouched).score == 0.0
            untouched.write_file(t.hidden["answer_file"], f" {ans}\n")
            assert tasks.verify(t, conv.final_answer, sandbox=untouched).score == 1.0
            with pytest.raises(tasks.TaskError, match="final sandbox state"):
                tasks.verify(t, conv.final_answer)
        else:
            assert tasks.verify(t, conv.final_answer).score == 1.0


@pytest.fixture(scope="module")
def tok():
    from k3.io.tokenizer import K3Tokenizer, k3_special_tokens
    return K3Tokenizer({bytes([b]): b for b in range(256)}, k3_special_tokens(256, 256 + 32))


# ------------------------------------------------------------------------------------------ coding

def test_coding_demonstrations_pass_and_starters_fail(fresh, tok):
    by = {}
    for t in tasks.generate("coding", "train", 60, seed=0):
        by.setdefault(t.kind.split("_")[0] + "_" + t.kind.split("_")[1], t)   # one per template
    assert len(by) == 6, sorted(by)
    for name, t in sorted(by.items()):
        sb = fresh(t)
        r0 = run_hidden_tests(sb, t.hidden["tests"], t.id)           # the starter code is wrong
        assert r0.score == 0.0, (name, r0)
        conv = tasks.solve(t, sandbox=sb)
        r = tasks.verify(t, conv.final_answer, sandbox=sb)
        assert r.score == 1.0, (name, r)
        assert_round_trip(conv.messages, conv.tools)
        assert tasks.count_tokens(conv, tok, "coding") > len(t.hidden["reference"])   # the code is an argument
        # verification without the episode's sandbox: the response's code block
        ref = f"Here it is:\n```python\n{t.hidden['reference']}```\n"
        assert tasks.verify(t, ref, manager=sb._t.m).score == 1.0
        assert tasks.verify(t, f"```python\n{t.files[t.hidden['solution_path']]}```", manager=sb._t.m).score == 0.0


def test_coding_failures_are_reward_zero_and_broken_tests_are_task_errors(fresh):
    t = tasks.generate("coding", "test", 1, seed=4)[0]
    sb = fresh(t)
    path, func = t.hidden["solution_path"], t.hidden["func"]
    sb.write_file(path, t.hidden["reference"])
    assert tasks.verify(t, "", sandbox=sb).score == 1.0
    cases = {f"def {func}(x:\n": "does not import: SyntaxError",
             f"def {func}(*a):\n    raise ValueError('no')\n": "ValueError: no",
             "import os\nos._exit(0)\n": "did not finish",
             "print('K3-HIDDEN-RESULT 0 {\"passed\": 99, \"failed\": []}')\nimport sys\nsys.exit(0)\n":
                 "does not import",
             f"def {func}(*a):\n    while True:\n        pass\n": "timed out"}
    for code, why in cases.items():
        sb.write_file(path, code)
        r = tasks.verify(t, "", sandbox=sb, timeout=2.0) if "while" in code else tasks.verify(t, "", sandbox=sb)
        assert r.score == 0.0 and why in r.detail, (code, r)
    sb.write_file(path, t.hidden["reference"])
    with pytest.raises(tasks.TaskError, match="hidden test 1 cannot run, it does not compile"):
        run_hidden_tests(sb, [t.hidden["tests"][0], "assert f(1 == 2"], t.id)
    broken = tasks.Task(**{**vars(t), "hidden": {**t.hidden, "tests": []}})
    with pytest.raises(tasks.TaskError, match="no hidden tests"):
        tasks.verify(broken, "", sandbox=sb)
    assert tasks.verify(t, "no code here", manager=sb._t.m).score == 0.0


def test_main_data_solves_sandbox_domains(tmp_path):
    out = tmp_path / "c.jsonl"
    argv = ["--domain", "coding", "--split", "test", "-n", "2", "--out", str(out), "--sandbox-dir", str(tmp_path / "s")]
    assert tasks.main_data(argv) == 0
    recs = tasks.read_jsonl(out)
    assert [r["task_id"] for r in recs] == [t.id for t in tasks.generate("coding", "test", 2, 0)]
    assert all(r["tools"] == tasks.CODING_TOOLS and any(m["role"] == "tool" for m in r["messages"]) for r in recs)


# ------------------------------------------------------------------------------------------ easy levels

@pytest.fixture(scope="module")
def bpe():
    """The tokenizer the models use (k3-tiny's BPE): what the episode lengths are measured in."""
    from k3 import K3Config
    from k3.io.tokenizer import default_tokenizer
    return default_tokenizer(K3Config.preset("k3-tiny").text_config)


def _turn_tokens(conv, tok) -> list[int]:
    from k3.post.tasks.budget import assistant_spans
    segs = chat.segments(conv.messages, conv.tools, add_generation_prompt=False)
    return [len(chat.encode_segments(tok, segs[a:b])) for a, b in assistant_spans(segs)]


@pytest.mark.parametrize("domain", ["agent", "coding"])
def test_easy_demonstrations_verify_and_are_short(domain, fresh, manager, bpe):
    """Every easy scripted solution passes its verifier on a real sandbox at every effort with one tool call;
    its generated tokens grow with the effort (low < high < max) and stay short: at most 150 at low (4 turns
    of 64 would hold it), every turn at most 96 (a one-argument call, `cat`, within 64); wrong answers fail."""
    ts = tasks.generate(domain, "train", 10, 5, level="easy") + tasks.generate(domain, "test", 4, 5, level="easy")
    assert {t.kind for t in ts} == ({"read", "find"} if domain == "agent" else {"add", "mul", "const"})
    for t in ts:
        n = {}
        for e in ("low", "high", "max"):
            sb = fresh(t)
            conv = tasks.solve(t, sandbox=sb, effort=e)
            assert conv.options == {"reasoning_effort": e} and conv.messages[:len(t.messages)] == t.messages
            assert tasks.verify(t, conv.final_answer, sandbox=sb).score == 1.0, (t.id, e)
            calls = [c for m in conv.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
            assert len(calls) == 1 and len(conv.messages) == len(t.messages) + 3
            assert_round_trip(conv.messages, conv.tools)
            n[e] = tasks.count_tokens(conv, bpe, domain)
            turns = _turn_tokens(conv, bpe)
            assert sum(turns) == n[e] and max(turns) <= (64 if t.kind == "read" else 96), (t.id, e, turns)
            if e == "low":
                low = conv
        assert n["low"] < n["high"] < n["max"] and n["low"] <= 150, (t.id, n)
        assert tasks.solve(t, manager=manager, effort="low").messages == low.messages   # a fresh sandbox: the same
        ans = t.hidden["answers"][0] if domain == "agent" else None
        if domain == "agent":
            assert tasks.verify(t, low.final_answer).score == 1.0                      # no sandbox state to check
            assert tasks.verify(t, "Answer: 1").score == tasks.verify(t, f"{ans}?").score == 0.0
        else:
            untouched = fresh(t)                                                      # the starter fails
            assert tasks.verify(t, low.final_answer, sandbox=untouched).score == 0.0
            untouched.write_file("/work/solution.py", t.hidden["reference"].replace("return", "return 1 +").encode())
            assert tasks.verify(t, low.final_answer, sandbox=untouched).score == 0.0
            ref = f"```python\n{t.hidden['reference']}```"
            assert tasks.verify(t, ref, manager=manager).score == 1.0
