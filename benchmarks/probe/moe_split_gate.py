"""Exit 0 when `probe/moe_block.py`'s JSON shows the split MoE block (four launches, `LAUNCH_SPLIT`'s default
tiles) faster than the one-launch block by more than --margin µs per layer, else 1: a device call runs
`benchmarks/serve.py` (which times both forms in one run) only then.

    python benchmarks/probe/moe_split_gate.py moe_block.json --margin 1.0
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--margin", type=float, default=1.0)
    a = ap.parse_args()
    rows = json.load(open(a.json))["rows"]
    timed = {k: v["us_per_unit"] for k, v in rows.items() if "us_per_unit" in v}
    one = [v for k, v in timed.items() if k.startswith("bn8 bi8 bl4 ")]
    split = [v for k, v in timed.items() if k.startswith("split bn14 bn24 bn44 bi4 bl4 ch256 warps4")]
    if not one or not split:
        print(f"gate: missing rows (one-launch {len(one)}, split {len(split)})")
        return 1
    best_one, best_split = min(one), min(split)
    print(f"gate: one launch {best_one:.2f} µs, split {best_split:.2f} µs per layer")
    return 0 if best_split < best_one - a.margin else 1


if __name__ == "__main__":
    sys.exit(main())
