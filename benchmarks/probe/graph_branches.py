"""Do independent kernels of a batch-1 decode step gain from running side by side in its CUDA graph? A step has
such pairs in every layer: a KDA layer's f_b projection beside its short conv step, a MoE layer's routed experts
beside the shared experts' down projection. This probe times a chain of layers of four production GEMVs
(`k3.ops.gemv.triton.gemv`, PDL as in the engine), each layer

    a = A x;  b = B a[:Kb];  c = C a[:Kc];  x' = D (b + c)

with b and c computed one after the other on the graph's stream (`serial`) or c on a second stream forked after A
and joined before D (`branches`). Shapes from k3-small: A the KDA input projection, B f_b, C the shared experts'
down projection, D o_proj. Checks both against each other (bitwise: the same kernels on the same inputs) and
prints µs per layer.

    python benchmarks/probe/graph_branches.py --out graph_branches.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graph_us  # noqa: E402

A, B, C, D = (6336, 1536), (1536, 128), (1536, 1024), (1536, 1536)


def layer(x, w, side: torch.cuda.Stream | None):
    from k3.ops.gemv.triton import gemv
    wa, wb, wc, wd = w
    a = gemv(x, wa)
    if side is None:
        b = gemv(a[:, :wb.shape[1]], wb)
        c = gemv(a[:, :wc.shape[1]], wc)
    else:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            c = gemv(a[:, :wc.shape[1]], wc)
        b = gemv(a[:, :wb.shape[1]], wb)
        main.wait_stream(side)
    return gemv(b + c, wd)


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="graph_branches.json")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [[(torch.randn(*s, device="cuda", generator=g) / s[1] ** 0.5).to(torch.bfloat16) for s in (A, B, C, D)]
          for _ in range(a.layers)]
    side = torch.cuda.Stream()
    res = {"device": torch.cuda.get_device_name(), "layers": a.layers, "rows": {}}
    for rows in a.rows:
        x0 = torch.randn(rows, A[1], device="cuda", generator=g).to(torch.bfloat16)
        outs, times, last = {}, {}, {}
        for mode in ("serial", "branches") * 2:  # each twice, interleaved
            s = side if mode == "branches" else None

            def step(s=s):
                x = x0
                for w in ws:
                    x = layer(x, w, s)
                last["out"] = x
            times.setdefault(mode, []).append(graph_us(step, a.reps))
            outs[mode] = last["out"].clone()
        same = bool(torch.equal(outs["serial"], outs["branches"]))
        row = {m: min(v) for m, v in times.items()}
        row.update(us_per_layer={m: min(v) / a.layers for m, v in times.items()}, equal=same)
        res["rows"][rows] = row
        print(f"rows {rows:3d}: serial {row['serial']:8.1f} µs, branches {row['branches']:8.1f} µs "
              f"({(row['serial'] - row['branches']) / a.layers:+.2f} µs per layer saved); outputs equal: {same}",
              flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
