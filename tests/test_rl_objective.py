"""RL math against hand-computed values (fp64): group-relative advantages, the clipped per-token objective with
its regulariser / mask for tokens of an older policy, and the effort-budget rule (boundary included)."""

import math

import pytest
import torch

from k3.post.effort import BudgetTable, EffortBudget, base_budget, expert_plan
from k3.post.rl import group_advantages, token_objective


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [-1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    a = group_advantages(r)
    want = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-1.5, 0.5, 0.5, 0.5], [0.0] * 4], dtype=torch.float64)
    assert torch.allclose(a, want, atol=1e-15, rtol=0)
    s = group_advantages(r, normalize_std=True, eps=0.0 + 1e-12)
    # group 2: mean 0.5, population std sqrt(0.75)
    assert abs(s[1, 0].item() - (-1.5 / math.sqrt(0.75))) < 1e-9
    assert abs(s[0, 0].item() - 1.0) < 1e-9 and torch.all(s[2] == 0)
    with pytest.raises(ValueError, match="groups, samples"):
        group_advantages(torch.zeros(4))


def test_token_objective_by_hand():
    """Five tokens chosen to hit each branch: inside the clip range, clipped above with A > 0 (no gradient),
    ratio below 1 − ε with A < 0 (clipped), ratio above with A < 0 (unclipped: pessimistic), and a stale token."""
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.2, -1.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.1, -1.0, -1.5, -0.6, -1.3], dtype=torch.float64)
    adv = torch.tensor([0.7, 1.0, -0.5, -2.0, 0.3], dtype=torch.float64)
    stale = torch.tensor([False, False, False, False, True])
    terms, w = token_objective(logp, old, adv, stale, clip_low=0.2, clip_high=0.28, kl_coef=0.1, stale_mode="kl")
    r = [math.exp(a - b) for a, b in zip([-1.0, -0.5, -2.0, -0.2, -1.0], [-1.1, -1.0, -1.5, -0.6, -1.3])]
    want = [
        -r[0] * 0.7,                         # 1.105: inside [0.8, 1.28]
        -1.28 * 1.0,                         # 1.649 > 1.28, A > 0: clipped
        -max(r[2], 0.8) * -0.5,              # 0.607 < 0.8, A < 0: −min(ρA, 0.8A) = 0.8·0.5
        -r[3] * -2.0,                        # 1.492 > 1.28, A < 0: −min(ρA, 1.28A) = ρ·2
        -min(r[4], 1.28) * 0.3 + 0.5 * 0.1 * 0.3 ** 2,  # stale: + ½β(log π − log μ)²
    ]
    assert torch.allclose(terms, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0), (terms, want)
    assert torch.all(w == 1)
    (terms * w).sum().backward()
    g = logp.grad
    assert g[1].item() == 0.0 and abs(g[0].item() - (-r[0] * 0.7)) < 1e-12
    assert abs(g[2].item()) == 0.0 and abs(g[3].item() - 2.0 * r[3]) < 1e-12
    assert r[4] > 1.28 and abs(g[4].item() - 0.1 * 0.3) < 1e-12   # clipped (A > 0): only the regulariser's pull
    # mask mode: the stale token gets weight 0 and no regulariser
    terms_m, w_m = token_objective(logp.detach(), old, adv, stale, 0.2, 0.28, 0.1, "mask")
    assert w_m.tolist() == [1, 1, 1, 1, 0] and abs(terms_m[4].item() - (-1.28 * 0.3)) < 1e-12
    with pytest.raises(ValueError, match="stale_mode"):
        token_objective(logp, old, adv, stale, stale_mode="drop")


def test_budget_rule_and_boundary():
    b = EffortBudget.for_effort("high")           # τ = 2, no cap
    assert b.limit(50) == 100
    assert b.reward(1.0, 100, 50) == 1.0           # exactly at the budget: kept
    assert b.reward(1.0, 101, 50) == -1.0          # one over: −1 even when correct
    assert b.reward(0.0, 10, 50) == 0.0
    m = EffortBudget.for_effort("max", cap=300)    # τ = 4 and an absolute cap
    assert m.limit(50) == 200 and m.limit(100) == 300
    assert not m.over(300, 100) and m.over(301, 100)
    lo = EffortBudget.for_effort("low")
    assert lo.limit(50) < b.limit(50) < EffortBudget.for_effort("max").limit(50)
    with pytest.raises(ValueError, match="effort 'medium'"):
        EffortBudget.for_effort("medium")
    with pytest.raises(ValueError, match="b0"):
        b.limit(0)


def test_base_budget_and_table(tmp_path):
    assert base_budget([10, 30, 50], [False, True, True], min_b0=1) == 40      # mean of the correct ones
    assert base_budget([10, 30, 50], [False, False, False], min_b0=1) == 30    # none correct: all
    assert base_budget([2, 4], [True, True], min_b0=16) == 16                  # floored
    t = BudgetTable({"a": 12.5})
    t.save(tmp_path / "b.json")
    assert BudgetTable.load(tmp_path / "b.json").b0 == {"a": 12.5}
    with pytest.raises(KeyError, match="'zz'"):
        t["zz"]
    with pytest.raises(ValueError, match="task 'x'"):
        t.update({"x": -1})
    with pytest.raises(FileNotFoundError, match="nope.json"):
        BudgetTable.load(tmp_path / "nope.json")


def test_expert_plan_is_nine_chained_runs():
    cmds = expert_plan("runs/sft")
    assert len(cmds) == 9
    assert cmds[0].startswith("k3 rl --checkpoint runs/sft --domain general --effort max")
    assert "--checkpoint runs/experts/general-max --domain general --effort high" in cmds[1]
    assert "--budgets runs/experts/general-max/budgets.json" in cmds[2]
