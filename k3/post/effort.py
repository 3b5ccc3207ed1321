"""Reasoning-effort budgets for RL (K3_SPEC §8.2): per-question base budgets b₀(x) and the −1 length rule.

A trajectory y of question x gets task reward −1 when its counted tokens T(y) exceed τ·b₀(x) (and, for
effort "max", an absolute cap too); otherwise it keeps the verifier's reward. T(y) is
`k3.post.tasks.count_tokens`: thinking tokens for general tasks, every output token (tool-call arguments
included, tool results excluded) for agent / coding tasks. A trajectory exactly at the budget is within it.

b₀(x) is estimated ONCE per question by the starting (cold-start, i.e. SFT) model: the mean counted tokens of
its correct samples, or of all its samples when none is correct, floored at `min_b0` (so a question the cold
start answers without thinking still gets a usable budget). The estimates are cached as JSON
(`budgets.json` in the run dir, `{task_id: b0}`) and can be handed to later runs (`k3 rl --budgets FILE`), so
every effort of a domain is judged against the same cold-start budgets.

The 9 expert policies (3 domains × 3 efforts) come from three chains, one per domain, each trained in the
order max → high → low (`expert_plan` prints the commands):

    sft ─ k3 rl --domain D --effort max  (τ=4, cap)  ─▶ D-max ─ --effort high (τ=2) ─▶ D-high ─ --effort low (τ=1) ─▶ D-low

Every run of a chain passes the budgets of the chain's first (max) run, estimated by the SFT model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .._atomic import atomic_write
from .tasks import DOMAINS

EFFORTS = ("max", "high", "low")   # the training order of one domain's chain
DEFAULT_TAU = {"max": 4.0, "high": 2.0, "low": 1.0}
DEFAULT_MAX_CAP = 8192              # absolute cap (tokens) of effort "max"


@dataclass(frozen=True)
class EffortBudget:
    """The budget rule of one effort: T(y) ≤ min(τ·b₀(x), cap) keeps the reward, more gives −1."""
    effort: str
    tau: float
    cap: float = math.inf

    def __post_init__(self):
        if self.effort not in EFFORTS:
            raise ValueError(f"effort {self.effort!r} is not one of {', '.join(EFFORTS)}")
        if not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"tau must be a finite number > 0, got {self.tau!r}")
        if not self.cap > 0:
            raise ValueError(f"cap must be > 0 tokens, got {self.cap!r}")

    @classmethod
    def for_effort(cls, effort: str, tau: float | None = None, cap: float | None = None) -> "EffortBudget":
        """The default rule of `effort` (τ = 4 / 2 / 1 for max / high / low; a cap for max only)."""
        if effort not in EFFORTS:
            raise ValueError(f"effort {effort!r} is not one of {', '.join(EFFORTS)}")
        tau = DEFAULT_TAU[effort] if tau is None else tau
        cap = (DEFAULT_MAX_CAP if effort == "max" else math.inf) if cap is None else cap
        return cls(effort, float(tau), float(cap))

    def limit(self, b0: float) -> float:
        """The largest allowed count for a question of base budget b₀."""
        if not (b0 > 0 and math.isfinite(b0)):
            raise ValueError(f"base budget b0 must be a finite number > 0, got {b0!r}")
        return min(self.tau * b0, self.cap)

    def over(self, counted: int, b0: float) -> bool:
        return counted > self.limit(b0)

    def reward(self, score: float, counted: int, b0: float) -> float:
        """The task reward after the budget rule: −1 over budget, else the verifier's `score`."""
        return -1.0 if self.over(counted, b0) else float(score)


def base_budget(counts: list[int], correct: list[bool], min_b0: float = 16.0) -> float:
    """b₀ of one question from the cold-start model's samples: mean count of the correct ones (all when none
    is correct), at least `min_b0`."""
    if not counts or len(counts) != len(correct):
        raise ValueError(f"need one correctness flag per sample and at least one sample, got {len(counts)} "
                         f"counts and {len(correct)} flags")
    pick = [c for c, ok in zip(counts, correct) if ok] or list(counts)
    return max(float(min_b0), sum(pick) / len(pick))


class BudgetTable:
    """task id → b₀, cached as JSON. Missing ids are an error naming them (never a silent default)."""

    def __init__(self, b0: dict[str, float] | None = None):
        self.b0: dict[str, float] = dict(b0 or {})

    def __contains__(self, task_id: str) -> bool:
        return task_id in self.b0

    def __getitem__(self, task_id: str) -> float:
        try:
            return self.b0[task_id]
        except KeyError:
            raise KeyError(f"no base budget b0 for task {task_id!r}: estimate it with the cold-start model "
                           "first (k3 rl does so for its task pool)") from None

    def missing(self, task_ids) -> list[str]:
        return [t for t in task_ids if t not in self.b0]

    def update(self, other: dict[str, float]) -> None:
        for k, v in other.items():
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"base budget of task {k!r} must be a finite number > 0, got {v!r}")
            self.b0[k] = float(v)

    def save(self, path: str | Path) -> None:
        atomic_write(Path(path), json.dumps(dict(sorted(self.b0.items())), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "BudgetTable":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"budgets file {str(p)!r} does not exist (expected a JSON object "
                                    "{task_id: b0} such as a k3 rl run's budgets.json)")
        try:
            d = json.loads(p.read_text())
        except ValueError as e:
            raise ValueError(f"budgets file {str(p)!r} is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"budgets file {str(p)!r}: expected a JSON object {{task_id: b0}}, "
                             f"got {type(d).__name__}")
        t = cls()
        t.update(d)
        return t


def expert_plan(sft_checkpoint: str, out_root: str = "runs/experts", extra: str = "") -> list[str]:
    """The 9 `k3 rl` commands producing the expert policies: per domain, max from the SFT checkpoint, then
    high from max, then low from high, all with the max run's cold-start budgets."""
    cmds = []
    for d in DOMAINS:
        prev = sft_checkpoint
        for e in EFFORTS:
            out = f"{out_root}/{d}-{e}"
            budgets = "" if e == "max" else f" --budgets {out_root}/{d}-max/budgets.json"
            cmds.append(f"k3 rl --checkpoint {prev} --domain {d} --effort {e} --out {out}{budgets}"
                        + (f" {extra}" if extra else ""))
            prev = out
    return cmds
