"""Rollouts for RL (k3.post.rollout): a paused-and-resumed trajectory is bitwise the uninterrupted one (real
engine, fp32 k3-tiny, seeded sampling, through a checkpoint round trip), and multi-turn tool use through the
runner (a scripted engine replaying a solved agent task) executes the calls in the sandbox, appends the
real results, masks them out of the loss and survives a pause (engine + sandbox snapshot) unchanged."""

import io

import pytest
import torch

from conftest import make_tiny
from k3.io import chat
from k3.io.tokenizer import default_tokenizer
from k3.post import tasks
from k3.post.rollout import RolloutRunner, from_state, to_state
from k3.post.tasks.budget import assistant_spans
from k3.serve import Engine, EngineConfig
from k3.serve.request import RequestOutput


def _roundtrip(d):
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny(seed=0).float().eval()
    return model, default_tokenizer(model.config.text_config)


def _engine(model):
    return Engine(model, EngineConfig(block_size=512, hash_block_size=64, num_pages=24, max_model_len=1024))


def test_paused_and_resumed_trajectory_is_exact(tiny):
    """Three seeded trajectories, uninterrupted vs paused after 5 engine steps (state saved with torch.save and
    loaded back, as a checkpoint would) and resumed in a fresh engine: same tokens and log-probs, bitwise."""
    model, tok = tiny
    ts = tasks.generate("general", "train", 3, seed=1)

    def trajs(runner):
        return [runner.start(t, f"g{i}", f"g{i}-s0", seed=100 + i) for i, t in enumerate(ts)]

    ra = RolloutRunner(_engine(model), tok, effort="low", max_turn_tokens=12, max_total_tokens=12)
    a = trajs(ra)
    ra.run(a)
    assert all(t.finished and t.num_generated == 12 for t in a)

    rb = RolloutRunner(_engine(model), tok, effort="low", max_turn_tokens=12, max_total_tokens=12)
    b = trajs(rb)
    steps = []
    stats = rb.run(b, stop_at=0, stop_when=lambda _: steps.append(1) or len(steps) > 5)
    assert stats.paused == 3 and not any(t.finished for t in b)
    assert all(0 < t.num_generated < 12 for t in b), [t.num_generated for t in b]
    saved = [_roundtrip(to_state(t)) for t in b]
    rc = RolloutRunner(_engine(model), tok, effort="low", max_turn_tokens=12, max_total_tokens=12)
    c = [from_state(d) for d in saved]
    assert all(t.paused is not None and t.paused.kda_slot is not None for t in c)
    rc.run(c)
    for x, y in zip(a, c):
        assert y.finished and x.tokens == y.tokens and x.logprobs == y.logprobs and x.gen == y.gen
        assert x.messages == y.messages


# ------------------------------------------------------------------------------ a scripted engine, real tools

class ScriptedEngine:
    """Engine double: request `…/tN` emits script[N] one token per step (log-prob −0.01·position); supports
    pause / resume like `Engine` (the paused object carries the position)."""

    max_model_len = 1 << 16

    def __init__(self, script):
        self.script, self.live, self.done = script, {}, []

    def submit(self, prompt, params, request_id, group=None):
        turn = int(request_id.rsplit("/t", 1)[1])
        self.live[request_id] = {"prompt": list(prompt), "out": [], "want": self.script[turn], "emitted": 0}
        return request_id

    def step(self):
        outs = []
        for rid, r in list(self.live.items()):
            r["out"].append(r["want"][len(r["out"])])
            fin = len(r["out"]) == len(r["want"])
            new = r["out"][r["emitted"]:]
            r["emitted"] = len(r["out"])
            outs.append(RequestOutput(rid, r["prompt"], list(r["out"]), new, [-0.01 * i for i in range(len(r["out"]))],
                                      fin, "stop" if fin else None, 0))
            if fin:
                del self.live[rid]
        return outs

    def has_unfinished(self):
        return bool(self.live)

    def flush(self):  # synchronous double: nothing in flight
        return []

    def pause(self, rid):
        return _Paused(rid, self.live.pop(rid))

    def resume(self, p):
        self.live[p.request_id] = p.state
        return p.request_id


class _Paused:
    def __init__(self, rid, state):
        self.request_id, self.state = rid, state


def _process_tier_ok():
    from k3.env.process import ProcessTier
    return ProcessTier.available()[0]


@pytest.mark.skipif(not _process_tier_ok(), reason="agent tasks need the sandbox process tier (root)")
def test_multi_turn_tools_in_sandbox_survive_a_pause(tiny, tmp_path):
    from k3.env import Sandbox, SandboxManager
    _, tok = tiny
    mgr = SandboxManager(tmp_path / "sb")
    try:
        task = next(t for t in tasks.generate("agent", "train", 8, seed=0) if t.kind)
        with Sandbox.create(manager=mgr) as sb:
            tasks.prepare(task, sb)
            ref = tasks.solve(task, sandbox=sb)
        segs = chat.segments(ref.messages, ref.tools, add_generation_prompt=False, thinking_effort="high")
        script = [chat.encode_segments(tok, segs[a:b]) for a, b in assistant_spans(segs)]
        ref_results = [m["content"] for m in ref.messages if m["role"] == "tool"]
        assert len(script) >= 2 and ref_results

        def runner():
            return RolloutRunner(ScriptedEngine(script), tok, effort="high", max_turns=len(script),
                                 max_turn_tokens=4096, max_total_tokens=1 << 15,
                                 sandboxes=lambda: Sandbox.create(manager=mgr))
        ra = runner()
        a = ra.start(task, "g0", "g0-s0", seed=1)
        ra.run([a])
        assert a.finished and a.finish_reason == "answer" and a.turns == len(script)
        assert a.tool_results == ref_results
        assert [x for x, g in zip(a.tokens, a.gen) if g] == [x for s in script for x in s]   # only model tokens
        ra.score(a)
        assert a.score == 1.0 and a.reward == 1.0 and a.sandbox is None, a.detail
        # the whole conversation the runner built renders to exactly the token history
        assert chat.encode(tok, a.messages, task.tools, add_generation_prompt=False,
                           thinking_effort="high") == a.tokens

        rb = runner()
        b = rb.start(task, "g0", "g0-s0", seed=1)
        first = len(script[0]) + 3   # inside the second turn: after a tool result
        n = []
        rb.run([b], stop_at=0, stop_when=lambda _: n.append(1) or len(n) > first)
        assert b.paused is not None and b.turns == 1 and b.sandbox.state == "paused"
        # the sandbox goes through its snapshot, as a checkpoint would take it (to_state / from_state)
        snap = b.sandbox.checkpoint()
        b.sandbox.kill()
        b.sandbox = Sandbox.restore(snap, manager=mgr)
        b.sandbox.pause()
        rb.run([b])
        assert b.finished and b.tokens == a.tokens and b.logprobs == a.logprobs and b.gen == a.gen
        assert b.tool_results == a.tool_results and b.messages == a.messages
        rb.score(b)
        assert b.score == 1.0, b.detail
    finally:
        for s in mgr.list():
            mgr.kill(s["sandbox_id"])
        mgr.shutdown()


def test_samples_at_several_efforts_share_one_run(tiny):
    """A trajectory started with its own effort renders (and keeps, through a pause) that effort's chat prompt;
    one run at mixed efforts gives each sample exactly the tokens a run at its effort alone gives."""
    model, tok = tiny
    ts = tasks.generate("general", "test", 2, seed=3, level="easy")
    alone = {}
    for e in ("low", "max"):
        r = RolloutRunner(_engine(model), tok, effort=e, max_turn_tokens=8, max_total_tokens=8, temperature=0)
        alone[e] = [r.start(t, f"{e}{i}", f"{e}{i}", seed=i) for i, t in enumerate(ts)]
        r.run(alone[e])
    r = RolloutRunner(_engine(model), tok, effort="high", max_turn_tokens=8, max_total_tokens=8, temperature=0)
    mixed = {e: [r.start(t, f"m{e}{i}", f"m{e}{i}", seed=i, effort=e) for i, t in enumerate(ts)]
             for e in ("low", "max")}
    for e, trajs in mixed.items():
        for t, task in zip(trajs, ts):
            want = chat.encode(tok, [dict(m) for m in task.messages], task.tools, add_generation_prompt=True,
                               thinking_effort=e)
            assert t.tokens == list(want) and t.effort == e
    assert from_state(_roundtrip(to_state(mixed["low"][0]))).effort == "low"
    r.run([t for trajs in mixed.values() for t in trajs])
    for e in ("low", "max"):
        assert [t.tokens for t in mixed[e]] == [t.tokens for t in alone[e]]
    assert mixed["low"][0].tokens[:len(mixed["max"][0].tokens)] != mixed["max"][0].tokens  # efforts differ
