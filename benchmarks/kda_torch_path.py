"""Time the pure-PyTorch chunked KDA (`backend="torch"`, the fla-free fallback) against fla's `chunk_kda`
(safe gate, lower bound −5, gate/β/l2norm in the kernel) in the same run.

CUDA events after warm-up, median of `--reps` runs, fresh random bf16 inputs, K = V = 128.
Prints a table and writes JSON to --out. Run on a GPU machine with fla installed:
    python benchmarks/kda_torch_path.py --out kda_torch_path.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from k3.ops.kda import chunk_kda, kda_gate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_ms  # noqa: E402


def timed(fn, warmup: int, reps: int) -> float:
    return median_ms(fn, warmup, reps)


def inputs(B, T, H, D, grad):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, D, device=dev, dtype=dt, requires_grad=grad)
    k = torch.randn(B, T, H, D, device=dev, dtype=dt, requires_grad=grad)
    v = torch.randn(B, T, H, D, device=dev, dtype=dt, requires_grad=grad)
    graw = torch.randn(B, T, H, D, device=dev, dtype=dt)
    A_log = torch.linspace(-1, 2, H, device=dev)
    dt_bias = torch.randn(H * D, device=dev) * 0.5
    beta = torch.rand(B, T, H, device=dev, dtype=dt).requires_grad_(grad)
    return q, k, v, graw, A_log, dt_bias, beta


def run_ours(x, fwd_only):
    q, k, v, graw, A_log, dt_bias, beta = x
    g = kda_gate(graw, A_log, dt_bias)
    o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="torch")
    if not fwd_only:
        o.sum().backward()


def run_fla(x, fwd_only):
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    q, k, v, graw, A_log, dt_bias, beta = x
    o, _ = fla_chunk_kda(q, k, v, graw, beta, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    if not fwd_only:
        o.sum().backward()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x8192x16,1x8192x96")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="kda_torch_path.json")
    a = ap.parse_args()
    rows = []
    for s in a.shapes.split(","):
        B, T, H = map(int, s.split("x"))
        for mode in ("fwd", "fwd+bwd"):
            fwd_only = mode == "fwd"
            res = {}
            for name, fn in (("torch", run_ours), ("fla", run_fla)):
                x = inputs(B, T, H, 128, not fwd_only)
                ctx = torch.no_grad() if fwd_only else torch.enable_grad()
                with ctx:
                    torch.cuda.reset_peak_memory_stats()
                    res[name] = timed(lambda: fn(x, fwd_only), a.warmup, a.reps)
                    res[name + "_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row = {"shape": f"B{B} T{T} H{H} D128", "mode": mode, "torch_ms": res["torch"], "fla_ms": res["fla"],
                   "torch_over_fla": res["torch"] / res["fla"], "torch_peak_gib": res["torch_peak_gib"]}
            rows.append(row)
            print(f"{row['shape']:<20} {mode:<8} torch {row['torch_ms']:9.2f} ms   fla {row['fla_ms']:7.2f} ms   "
                  f"ratio {row['torch_over_fla']:6.1f}x   torch peak {row['torch_peak_gib']:.1f} GiB", flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import fla
        info["fla"] = fla.__version__
    except Exception:
        pass
    json.dump({"info": info, "rows": rows}, open(a.out, "w"), indent=2)


if __name__ == "__main__":
    main()
