"""Optimal MoonEP plans on small cases, as an oracle for the greedy planner (needs scipy).

    minimise m  s.t.  Σ_r A[e, r] = T_e,  Σ_e A[e, r] = C,  A[e, r] ≤ T_e·Y[e, r],
                      Σ_{e not home on r} Y[e, r] ≤ m,  A ∈ ℤ≥0, Y ∈ {0, 1}

i.e. min over all balanced allocations of the largest number of remote experts a rank hosts (K3_SPEC §9).
"""

from __future__ import annotations

import numpy as np
import torch


def max_remote_experts(alloc: torch.Tensor) -> int:
    """alloc [E, R] → max over ranks of the remote experts (alloc > 0, not home) it hosts."""
    E, R = alloc.shape
    home = torch.arange(E, device=alloc.device) // (E // R)
    remote = (alloc > 0) & (home[:, None] != torch.arange(R, device=alloc.device))
    return int(remote.sum(0).max())


def milp_min_max_remote(counts: list[int], num_ranks: int, capacity: int) -> int:
    """The optimum m* of the integer program above (scipy.optimize.milp, HiGHS)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    E, R, C = len(counts), num_ranks, capacity
    if E % R or sum(counts) != R * C:
        raise ValueError(f"need E % R == 0 and Σ counts == R·C, got E={E}, R={R}, Σ={sum(counts)}, C={C}")
    epn, nA = E // R, E * R
    n = 2 * nA + 1  # A[e, r], Y[e, r], m
    rows, lo, hi = [], [], []

    def row(lb, ub, pairs):
        a = np.zeros(n)
        for i, v in pairs:
            a[i] = v
        rows.append(a), lo.append(lb), hi.append(ub)

    for e in range(E):
        row(counts[e], counts[e], [(e * R + r, 1) for r in range(R)])
    for r in range(R):
        row(C, C, [(e * R + r, 1) for e in range(E)])
        row(-np.inf, 0, [(nA + e * R + r, 1) for e in range(E) if e // epn != r] + [(n - 1, -1)])
    for e in range(E):
        for r in range(R):
            if e // epn != r:
                row(-np.inf, 0, [(e * R + r, 1), (nA + e * R + r, -counts[e])])
    c = np.zeros(n)
    c[-1] = 1
    ub = np.concatenate([np.repeat(np.asarray(counts, dtype=float), R), np.ones(nA), [E]])
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=np.ones(n),
               bounds=Bounds(np.zeros(n), ub))
    if not res.success:
        raise RuntimeError(f"milp failed: {res.message}")
    return int(round(res.fun))


def lognormal_counts(E: int, total: int, sigma: float, seed: int) -> torch.Tensor:
    """Per-expert counts of `total` entries drawn from popularities exp(σ·z), z ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.exp(sigma * torch.randn(E, generator=g, dtype=torch.float64))
    return torch.bincount(torch.multinomial(p, total, replacement=True, generator=g), minlength=E)


def milp_cases() -> list[tuple[int, int, int, float, int]]:
    """Small (R, E, C, σ, seed) cases shared by the test and benchmarks/moonep_milp.py."""
    return [(R, R * epn, C, sigma, seed) for R, epn, C in [(2, 4, 24), (4, 2, 16), (4, 3, 24)]
            for sigma in (0.5, 1.5, 3.0) for seed in range(2)]
