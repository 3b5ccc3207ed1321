"""MoonEP's greedy planner vs the integer-program optimum of max remote experts per rank (small cases).

For lognormal loads (σ ∈ {0.5, 1.5, 3}) and a few pathological ones, compare the greedy plan's largest number
of remote experts on one rank with the optimum of `k3.parallel.moonep.milp.milp_min_max_remote`
(scipy.optimize.milp / HiGHS), and the Theorem-2 lower bound where it applies. CPU only.

    python benchmarks/moonep_milp.py --out moonep_milp.json
    python benchmarks/moonep_milp.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3.parallel.moonep import plan_counts  # noqa: E402
from k3.parallel.moonep.milp import lognormal_counts, max_remote_experts, milp_cases, milp_min_max_remote  # noqa: E402


def cases(smoke: bool):
    out = [(f"lognormal σ={s}", R, E, C, lognormal_counts(E, R * C, s, seed)) for R, E, C, s, seed in milp_cases()]
    if not smoke:  # larger groups, where splitting experts across ranks gets harder
        out += [(f"lognormal σ={s}", R, R * epn, C, lognormal_counts(R * epn, R * C, s, seed))
                for R, epn, C in [(2, 8, 64), (4, 4, 32), (8, 2, 16), (4, 6, 48), (8, 4, 32)]
                for s in (0.5, 1.0, 2.0) for seed in range(3)]
    for R, epn, C in ([(2, 4, 24), (4, 2, 16), (4, 3, 24), (4, 4, 24), (8, 4, 56), (4, 6, 36)]
                      if not smoke else [(2, 4, 24)]):
        E = R * epn
        hot = torch.zeros(E, dtype=torch.long)
        hot[-1] = R * C
        out.append(("single hot expert", R, E, C, hot))
        grp = torch.zeros(E, dtype=torch.long)
        grp[:epn] = R * C // epn
        grp[0] += R * C - int(grp.sum())
        out.append(("one hot home group", R, E, C, grp))
        n_hot = E - epn
        if (R * C) % n_hot == 0:
            t2 = torch.zeros(E, dtype=torch.long)
            t2[epn:] = R * C // n_hot
            out.append(("Theorem 2 instance", R, E, C, t2))
    return out[:4] if smoke else out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    print("| case | R | E | C | greedy max remote | optimum | ratio | MILP s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, R, E, C, cnt in cases(a.smoke):
        greedy = max_remote_experts(plan_counts(cnt, R, C, backend="torch"))
        t = time.perf_counter()
        opt = milp_min_max_remote(cnt.tolist(), R, C)
        dt = time.perf_counter() - t
        ratio = greedy / opt if opt else (1.0 if greedy == 0 else float("inf"))
        rows.append(dict(case=name, R=R, E=E, C=C, counts=cnt.tolist(), greedy=greedy, optimum=opt, ratio=ratio,
                         milp_s=dt))
        print(f"| {name} | {R} | {E} | {C} | {greedy} | {opt} | {ratio:.2f} | {dt:.2f} |")
    fin = [r["ratio"] for r in rows if r["ratio"] != float("inf")]
    summary = dict(cases=len(rows), optimal=sum(r["greedy"] == r["optimum"] for r in rows),
                   mean_ratio=statistics.mean(fin), max_ratio=max(fin))
    print(f"\n{summary['optimal']}/{summary['cases']} cases optimal; mean ratio {summary['mean_ratio']:.3f}, "
          f"max {summary['max_ratio']:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
