"""The KDA segment states of a long prefill chunk (`k3/ops/kda/triton/combine.py`): the one-kernel walk against
the PyTorch ops it replaces (index_select, copy, P − 1 batched fp32 GEMMs), each captured in a CUDA graph (as the
prefill graph runs them); k3-small's sizes (H 12, K = V 128), P = 2 … 16; every precision and launch setting of the
kernel; CUDA events, median of 50; relative RMS error against an fp64 walk.

    python benchmarks/probe/kda_combine.py --out kda_combine.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

from k3.ops.kda.triton.combine import combine_segments, combine_segments_torch  # noqa: E402

SETTINGS = [dict(precision=p, block_v=bv, num_warps=w, prefetch=f) for p in ("tf32x3", "tf32")
            for bv, w in ((16, 4), (16, 8), (32, 4), (32, 8), (64, 8)) for f in (False, True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kda_combine.json")
    a = ap.parse_args()
    H, K, V = 12, 128, 128
    pool = torch.randn(64, H, K, V, device="cuda")
    slot = torch.tensor([17], device="cuda")
    res = []
    for P in (4, 8, 16):
        g = torch.Generator(device="cuda").manual_seed(P)
        summ = torch.randn(P, H, K, V + K, device="cuda", generator=g)
        summ[..., V:] *= K ** -0.5
        exact = [pool[17].double()]
        for j in range(1, P):
            exact.append(summ[j - 1, ..., V:].double() @ exact[-1] + summ[j - 1, ..., :V].double())
        exact = torch.stack(exact)

        def err(h):
            return ((h.double() - exact).norm() / exact.norm()).item()
        row = dict(P=P, gemms_us=median_ms(graphed(lambda: combine_segments_torch(summ, pool, slot, P)), 5, 50) * 1e3,
                   gemms_err=err(combine_segments_torch(summ, pool, slot, P)), kernel=[])
        print(f"P {P:2d}: GEMMs {row['gemms_us']:6.1f} us (err {row['gemms_err']:.1e})", flush=True)
        for st in SETTINGS:
            try:
                us = median_ms(graphed(lambda: combine_segments(summ, pool, slot, P, **st)), 5, 50) * 1e3
                e = err(combine_segments(summ, pool, slot, P, **st))
            except Exception as ex:  # a setting that does not compile: reported, the sweep goes on
                print(f"    {st}: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                continue
            row["kernel"].append(dict(st, us=us, err=e))
            print(f"    {st}: {us:6.1f} us ({row['gemms_us'] / us:.2f}x), err {e:.1e}", flush=True)
        res.append(row)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
