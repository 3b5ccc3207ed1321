"""The KDA segment states of a long prefill chunk (`k3/ops/kda/triton/combine.py`): one Triton kernel against the
PyTorch ops it replaces (index_select, copy, P − 1 batched fp32 GEMMs with their addend copies), each captured in
a CUDA graph (as the prefill graph runs them) and eagerly; k3-small's sizes (H 12, K = V 128), P = 2 … 16; CUDA
events, median of 50; the kernel's relative error against the ops.

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kda_combine.json")
    a = ap.parse_args()
    H, K, V = 12, 128, 128
    pool = torch.randn(64, H, K, V, device="cuda")
    slot = torch.tensor([17], device="cuda")
    res = []
    for P in (2, 4, 8, 16):
        g = torch.Generator(device="cuda").manual_seed(P)
        summ = torch.randn(P, H, K, V + K, device="cuda", generator=g)
        summ[..., V:] *= K ** -0.5
        ref, got = combine_segments_torch(summ, pool, slot, P), combine_segments(summ, pool, slot, P)
        err = ((ref - got).norm() / ref.norm()).item()
        row = dict(P=P, rel_err=err)
        for name, fn in (("kernel", lambda: combine_segments(summ, pool, slot, P)),
                         ("torch_ops", lambda: combine_segments_torch(summ, pool, slot, P))):
            row[f"{name}_graph_us"] = median_ms(graphed(fn), 5, 50) * 1e3
            row[f"{name}_eager_us"] = median_ms(fn, 5, 50) * 1e3
        res.append(row)
        print(f"P {P:2d}: kernel {row['kernel_graph_us']:7.1f} us in a graph ({row['kernel_eager_us']:7.1f} eager), "
              f"torch ops {row['torch_ops_graph_us']:7.1f} ({row['torch_ops_eager_us']:7.1f}); "
              f"{row['torch_ops_graph_us'] / row['kernel_graph_us']:.2f}x in a graph; rel err {err:.1e}", flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
