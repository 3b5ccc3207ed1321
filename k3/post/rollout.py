"""Multi-turn rollouts through the in-process `k3.serve.Engine`, tools run in sandboxes, partial rollout.

A `Trajectory` is one sample of one task, kept at the token level: `tokens` is exactly what the model saw
(prompt, its own sampled tokens, tool-result tokens), with per token whether the model generated it
(`gen`), the behaviour log-probability the engine returned (`logprobs`, 0 elsewhere) and the policy version
that sampled it (`versions`, −1 elsewhere). A turn: the engine samples until `<|end_of_msg|>` (or the turn's
token limit); the turn's ids are parsed with `k3.io.chat.ChatStreamParser`; its tool calls run with
`ToolExecutor` in the task's sandbox; the tool messages plus the next generation prompt are appended as
the chat format renders them, and the whole history is submitted as the next request (the prefix cache
serves it). The episode ends at an answer (no tool calls), the turn limit or the token limit.

Partial rollout (K3_SPEC §8.3): `RolloutRunner.run(trajs, stop_at=m)` steps the engine until m of them
have finished, then pauses every unfinished one (`Engine.pause`: KDA state and MLA rows to host memory;
its sandbox paused too). The next `run` resumes paused ones first (`Engine.resume`), so the continuation
is exactly what an uninterrupted run would have produced under the same weights; after a weight update
the earlier tokens keep their older version for the learner's regulariser. `to_state` / `from_state`
turn a paused trajectory into plain tensors and lists (a sandbox snapshot id for its files) for the
trainer checkpoint, so a resumed run continues it bitwise.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable

from ..io import chat
from ..serve.request import PausedRequest, SamplingParams
from .tasks import Task, TaskError, ToolExecutor, count_tokens, prepare, verify
from .tasks.base import final_answer


def derive_seed(*parts) -> int:
    """A 63-bit seed from any printable parts (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


@dataclass
class Trajectory:
    """One sample of one task; see the module docstring for the token-level fields."""
    uid: str
    task: Task
    group: str
    seed: int
    tokens: list[int] = field(default_factory=list)
    gen: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    tool_results: list[str] = field(default_factory=list)
    turns: int = 0
    turn_start: int = 0             # index in `tokens` where the current turn's generation began
    finished: bool = False
    finish_reason: str | None = None  # "answer" | "turns" (tool calls at the turn limit) | "length" | "error"
    rid: str | None = None          # the engine request of the current turn
    paused: PausedRequest | None = None
    sandbox: object | None = None
    effort: str | None = None       # the chat format's thinking effort of this sample (None: the runner's)
    # filled when scored
    score: float | None = None
    reward: float | None = None
    counted: int | None = None
    over_budget: bool = False
    detail: str = ""

    @property
    def num_generated(self) -> int:
        return sum(self.gen)

    @property
    def final_answer(self) -> str:
        return final_answer(self.messages)


@dataclass
class RolloutStats:
    finished: int = 0
    paused: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class RolloutRunner:
    """Drives `engine` for trajectories. `sandboxes`: a callable returning a new `k3.env.Sandbox` (needed for
    agent / coding tasks); `effort`: the chat format's thinking effort of every prompt (a trajectory started
    with its own `effort` keeps that one, so samples at several efforts can share one engine run)."""

    def __init__(self, engine, tokenizer, *, effort: str = "max", max_turns: int = 4, max_turn_tokens: int = 256,
                 max_total_tokens: int = 1024, temperature: float = 1.0, top_p: float = 1.0,
                 sandboxes: Callable[[], object] | None = None, tool_timeout: float = 10.0):
        for name, v in (("max_turns", max_turns), ("max_turn_tokens", max_turn_tokens),
                        ("max_total_tokens", max_total_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.engine, self.tok = engine, tokenizer
        self.effort = effort
        self.max_turns, self.max_turn_tokens, self.max_total_tokens = max_turns, max_turn_tokens, max_total_tokens
        self.temperature, self.top_p = temperature, top_p
        self.sandboxes = sandboxes
        self.tool_timeout = tool_timeout
        self.stop_ids = (tokenizer.special_tokens[chat.END_OF_MSG],)
        self.version = 0   # policy version of the engine's weights (the trainer bumps it after each update)

    # ---- building ------------------------------------------------------------------------------------
    def _effort(self, t: Trajectory | None) -> str:
        return t.effort if t is not None and t.effort is not None else self.effort

    def _chat_options(self, t: Trajectory | None = None) -> dict:
        return {"thinking_effort": self._effort(t)}

    def start(self, task: Task, group: str, uid: str, seed: int, effort: str | None = None) -> Trajectory:
        """A fresh trajectory: its prompt encoded (generation prompt included) and, for tasks with files, a new
        sandbox holding them. `effort`: this sample's thinking effort (default: the runner's)."""
        messages = [dict(m) for m in task.messages]
        ids = chat.encode(self.tok, messages, task.tools, add_generation_prompt=True,
                          thinking_effort=effort or self.effort)
        sb = None
        if task.domain != "general" or task.files:
            if self.sandboxes is None:
                raise ValueError(f"task {task.id} ({task.domain}) needs a sandbox: give the runner a sandbox factory")
            sb = self.sandboxes()
            try:
                prepare(task, sb)
            except Exception as e:
                sb.kill()
                raise TaskError(f"task {task.id}: its files could not be written into a sandbox: {e}") from e
        return Trajectory(uid=uid, task=task, group=group, seed=seed, tokens=list(ids), gen=[False] * len(ids),
                          logprobs=[0.0] * len(ids), versions=[-1] * len(ids), messages=messages, sandbox=sb,
                          turn_start=len(ids), effort=effort)

    def _params(self, t: Trajectory) -> SamplingParams:
        used = t.num_generated
        return SamplingParams(max_tokens=max(1, min(self.max_turn_tokens, self.max_total_tokens - used)),
                              temperature=self.temperature, top_p=self.top_p,
                              seed=derive_seed(t.seed, "turn", t.turns), stop_token_ids=self.stop_ids,
                              logprobs=True, output_kind="delta")

    def _submit(self, t: Trajectory) -> None:
        t.rid = self.engine.submit(t.tokens, self._params(t), request_id=f"{t.uid}/t{t.turns}", group=t.group)

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self, trajs: list[Trajectory], stop_at: int | None = None,
            stop_when: Callable[[list[Trajectory]], bool] | None = None) -> RolloutStats:
        """Continue `trajs` (paused ones resumed first, new ones submitted) until every one has finished or,
        with `stop_at`, until that many of them have (and `stop_when(trajs)` holds, when given); the unfinished
        rest is then paused."""
        stats = RolloutStats()
        t0 = time.perf_counter()
        live: dict[str, Trajectory] = {}
        for t in sorted((t for t in trajs if not t.finished), key=lambda t: t.paused is None):
            if t.paused is not None:
                if t.sandbox is not None:
                    t.sandbox.resume()
                t.rid = self.engine.resume(t.paused)
                t.paused = None
            elif t.rid is None:
                self._submit(t)
            live[t.rid] = t
        done = sum(t.finished for t in trajs)
        def stop() -> bool:
            return stop_at is not None and done >= stop_at and (stop_when is None or stop_when(trajs))
        def handle(outs) -> None:
            nonlocal done
            for o in outs:
                t = live.get(o.request_id)
                if t is None:
                    continue
                n = len(o.new_token_ids)
                if n:
                    t.tokens += o.new_token_ids
                    t.gen += [True] * n
                    t.logprobs += o.logprobs[len(o.logprobs) - n:]  # the new tokens' (delta outputs)
                    t.versions += [self.version] * n
                    stats.generated_tokens += n
                if o.finished:
                    del live[o.request_id]
                    if o.finish_reason in ("abort", "error"):
                        t.finished, t.finish_reason, t.detail = True, "error", str(o.stop_reason or o.finish_reason)
                    else:
                        self._end_turn(t, o.finish_reason)
                    if t.finished:
                        done += 1
                        stats.finished += 1
                    else:
                        live[t.rid] = t

        while live and not stop():
            outs = self.engine.step()
            if not outs and not self.engine.has_unfinished():
                raise RuntimeError(f"the engine went idle with {len(live)} trajectories unfinished")
            handle(outs)
        if live:
            handle(self.engine.flush())  # the step in flight (asynchronous scheduling): its tokens are ours
        for rid, t in live.items():   # partial rollout: stop here, keep their state for the next iteration
            t.paused = self.engine.pause(rid)
            if t.sandbox is not None:
                t.sandbox.pause()
            stats.paused += 1
        stats.seconds = time.perf_counter() - t0
        return stats

    def _end_turn(self, t: Trajectory, reason: str) -> None:
        """The current turn's request ended: parse it, run its tool calls and submit the next turn, or finish."""
        ids = t.tokens[t.turn_start:]
        turn = t.turns
        parser = chat.ChatStreamParser(self.tok, inside="think" if self._thinking(t) else "response",
                                       call_id=lambda i: f"call_{turn}_{i}")
        parser.feed_ids(ids)
        parser.finish()
        msg = parser.message.to_dict()
        t.messages.append(msg)
        t.turns += 1
        t.rid = None
        calls = msg.get("tool_calls") or []
        if reason == "length" or t.num_generated >= self.max_total_tokens:
            t.finished, t.finish_reason = True, "length"
            return
        if not calls:
            t.finished, t.finish_reason = True, "answer"
            return
        if t.turns >= self.max_turns:
            t.finished, t.finish_reason = True, "turns"
            return
        if t.sandbox is None:
            results = ["error: this task has no tools"] * len(calls)
        else:
            ex = ToolExecutor(t.sandbox, tools=t.task.tools, timeout=self.tool_timeout)
            results = [ex.execute_call(c) for c in calls]
        before = chat.segments(t.messages, t.task.tools, add_generation_prompt=False, **self._chat_options(t))
        for c, r in zip(calls, results):
            t.messages.append({"role": "tool", "tool_call_id": c["id"], "content": r})
            t.tool_results.append(r)
        after = chat.segments(t.messages, t.task.tools, add_generation_prompt=True, **self._chat_options(t))
        if after[:len(before)] != before:
            raise AssertionError("chat rendering is not prefix-stable across a tool round trip")
        tail = chat.encode_segments(self.tok, after[len(before):])
        if len(t.tokens) + len(tail) + 1 >= self.engine.max_model_len:
            t.finished, t.finish_reason = True, "length"
            return
        t.tokens += tail
        t.gen += [False] * len(tail)
        t.logprobs += [0.0] * len(tail)
        t.versions += [-1] * len(tail)
        t.turn_start = len(t.tokens)
        self._submit(t)

    def _thinking(self, t: Trajectory | None = None) -> bool:
        return self._effort(t) != "none"

    # ---- scoring -------------------------------------------------------------------------------------
    def score(self, t: Trajectory, budget=None, b0: float | None = None,
              reward_fn: Callable[[Trajectory], float] | None = None) -> None:
        """Verifier reward (or `reward_fn`), counted tokens and the budget rule; kills the sandbox."""
        try:
            if reward_fn is not None:
                t.score, t.detail = float(reward_fn(t)), "custom reward"
            else:
                try:
                    r = verify(t.task, t.final_answer, sandbox=t.sandbox)
                except TaskError as e:
                    msg = str(e)
                    raise TaskError(msg if t.task.id in msg else f"task {t.task.id}: {msg}") from e
                t.score, t.detail = float(r.score), r.detail
            t.counted = count_tokens(t.messages, self.tok, t.task.domain, t.task.tools, thinking=self._thinking(t))
            t.over_budget = budget is not None and b0 is not None and budget.over(t.counted, b0)
            t.reward = -1.0 if t.over_budget else t.score
        finally:
            self.release(t)

    @staticmethod
    def release(t: Trajectory) -> None:
        if t.sandbox is not None:
            try:
                t.sandbox.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
            t.sandbox = None


# ---- checkpointing paused trajectories --------------------------------------------------------------------

def to_state(t: Trajectory) -> dict:
    """A paused, unstarted or finished-and-scored trajectory as tensors, lists and strings (torch.save,
    weights_only)."""
    if (t.finished and t.reward is None) or (not t.finished and t.rid is not None and t.paused is None):
        raise ValueError(f"trajectory {t.uid}: only paused, unstarted or scored trajectories can be saved")
    snap = None
    if t.sandbox is not None:
        snap = t.sandbox.checkpoint()
    return {"uid": t.uid, "task": t.task.to_record(), "group": t.group, "seed": t.seed, "tokens": list(t.tokens),
            "gen": list(t.gen), "logprobs": list(t.logprobs), "versions": list(t.versions),
            "messages": t.messages, "tool_results": list(t.tool_results), "turns": t.turns,
            "turn_start": t.turn_start, "paused": None if t.paused is None else t.paused.state_dict(),
            "snapshot": snap, "finished": t.finished, "finish_reason": t.finish_reason, "score": t.score,
            "reward": t.reward, "counted": t.counted, "over_budget": t.over_budget, "detail": t.detail,
            "effort": t.effort}


def from_state(d: dict, restore_sandbox: Callable[[str], object] | None = None) -> Trajectory:
    """The trajectory `to_state` saved; its sandbox restored (paused) from the snapshot by `restore_sandbox`."""
    sb = None
    if d["snapshot"] is not None:
        if restore_sandbox is None:
            raise ValueError(f"trajectory {d['uid']} has a sandbox snapshot but no way to restore it was given")
        sb = restore_sandbox(d["snapshot"])
        sb.pause()
    paused = None if d["paused"] is None else PausedRequest.from_state_dict(d["paused"])
    return Trajectory(uid=d["uid"], task=Task.from_record(d["task"]), group=d["group"], seed=d["seed"],
                      tokens=list(d["tokens"]), gen=list(d["gen"]), logprobs=list(d["logprobs"]),
                      versions=list(d["versions"]), messages=d["messages"], tool_results=list(d["tool_results"]),
                      turns=d["turns"], turn_start=d["turn_start"], rid=None if paused is None else paused.request_id,
                      paused=paused, sandbox=sb, finished=d["finished"], finish_reason=d["finish_reason"],
                      score=d["score"], reward=d["reward"], counted=d["counted"], over_budget=d["over_budget"],
                      effort=d.get("effort"),
                      detail=d["detail"])
