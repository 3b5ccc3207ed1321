"""Exit 0 when `probe/moe_block.py`'s JSON shows setting B faster than setting A by more than --margin µs per
layer (each the best of its rows whose key starts with the given prefix), else 1: a device call then runs
`benchmarks/serve.py`, which times the switch in one run, only when the probe found a gain.

    python benchmarks/probe/moe_split_gate.py moe_block.json --a "split bn14 bn24 bn44 bi4 bl4 ch256 warps4" \
        --b "split x2d bn14 bn24 bn44 bi4 bl4 ch256 warps4" --margin 1.0
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--a", default="bn8 bi8 bl4 ch256 warps4 per_sm4 coopTrue", help="the baseline's key")
    ap.add_argument("--b", default="split bn14 bn24 bn44 bi4 bl4 ch256 warps4", help="the candidate's key")
    ap.add_argument("--margin", type=float, default=1.0)
    a = ap.parse_args()
    rows = json.load(open(a.json))["rows"]
    timed = {k: v["us_per_unit"] for k, v in rows.items() if "us_per_unit" in v}
    base = [v for k, v in timed.items() if k.startswith(a.a)]
    cand = [v for k, v in timed.items() if k.startswith(a.b)]
    if not base or not cand:
        print(f"gate: missing rows ({a.a!r}: {len(base)}, {a.b!r}: {len(cand)})")
        return 1
    print(f"gate: {a.a!r} {min(base):.2f} µs, {a.b!r} {min(cand):.2f} µs per layer")
    return 0 if min(cand) < min(base) - a.margin else 1


if __name__ == "__main__":
    sys.exit(main())
