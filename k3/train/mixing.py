"""Mix synthetic long-context rows into the packed corpus rows at a fixed rate, deterministically."""

from __future__ import annotations

import math


class MixedRows:
    """Row i comes from `task` when ⌊(i+1)·frac⌋ > ⌊i·frac⌋ (an even spread), else from `packed`.
    State = the row counter + both sources' states, so resume is exact."""

    def __init__(self, packed, task, frac: float):
        if not 0 < frac < 1:
            raise ValueError(f"long-context fraction {frac}: expected in (0, 1)")
        self.packed, self.task, self.frac = packed, task, frac
        self.rows = 0

    def __iter__(self):
        p, t = iter(self.packed), iter(self.task)
        while True:
            i = self.rows
            self.rows += 1
            yield next(t) if math.floor((i + 1) * self.frac) > math.floor(i * self.frac) else next(p)

    def state_dict(self) -> dict:
        return {"rows": self.rows, "packed": self.packed.state_dict(), "task": self.task.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.packed.load_state_dict(sd["packed"])
        if "task" in sd:
            self.task.load_state_dict(sd["task"])
            self.rows = sd["rows"]
