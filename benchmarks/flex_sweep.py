"""Launch settings of the compiled flex attention for K3's MLA shapes (CUDA): forward and forward+backward time
per `kernel_options` setting, with the document BlockMask that training uses (k3.ops.attention.flex).

    python benchmarks/flex_sweep.py --out flex_sweep.json        # B 8, T 4096, H 12, Dq 192, Dv 128, mean doc 2048

CUDA events, median of --reps after a warm-up (each setting compiles once). Useful FLOPs count only allowed
(query, key) pairs: 2·H·(Dq + Dv) per pair forward, 2.5x that for the backward.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3.ops.attention.flex import doc_block_mask  # noqa: E402
from k3.ops.varlen import doc_ids  # noqa: E402
from train_throughput import random_docs  # noqa: E402

SETTINGS = [
    {},
    {"BLOCK_M": 64, "BLOCK_N": 64},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
    {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 8},
    {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 8},
    {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8, "num_stages": 2},
]


def timed(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--mean-doc", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import flex_attention
    dev = "cuda"
    B, T, H = args.batch, args.seq, args.heads
    cu, _ = random_docs(B, T, args.mean_doc, torch.Generator().manual_seed(0))
    cu = cu.to(dev)
    docs = doc_ids(cu, B, T)
    bm = doc_block_mask(docs)
    lens = (cu[1:] - cu[:-1]).double()
    flops = 2 * H * (192 + 128) * float((lens * (lens + 1) / 2).sum())
    g = torch.Generator(dev).manual_seed(0)
    q = torch.randn(B, H, T, 192, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(B, H, T, 192, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(B, H, T, 128, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(B, H, T, 128, device=dev, dtype=torch.bfloat16, generator=g)
    fa = torch.compile(flex_attention, dynamic=False)
    rows = []
    ref = None
    for opts in SETTINGS:
        kw = dict(block_mask=bm, scale=192 ** -0.5, kernel_options=opts or None)
        try:
            o = fa(q, k, v, **kw)
            if ref is None:
                ref = o.detach().float()
            err = ((o.float() - ref).norm() / ref.norm()).item()
            tf = timed(lambda: fa(q, k, v, **kw), args.reps)
            tfb = timed(lambda: fa(q, k, v, **kw).backward(do), args.reps)
            r = {"options": opts, "fwd_ms": tf, "fwd_bwd_ms": tfb, "fwd_tflops": flops / tf / 1e9,
                 "fwd_bwd_tflops": 3.5 * flops / tfb / 1e9, "rel_err_vs_default": err}
            print(f"{json.dumps(opts):<95} fwd {tf:6.2f} ms ({r['fwd_tflops']:4.0f} TF/s)  fwd+bwd {tfb:6.2f} ms "
                  f"({r['fwd_bwd_tflops']:4.0f} TF/s)  err {err:.1e}", flush=True)
        except Exception as e:  # an invalid setting for this shape: say so, keep sweeping
            r = {"options": opts, "error": str(e).splitlines()[0][:200]}
            print(f"{json.dumps(opts):<95} FAILED: {r['error']}", flush=True)
        rows.append(r)
        torch._dynamo.reset()
    ok = [r for r in rows if "error" not in r]
    if ok:
        best = min(ok, key=lambda r: r["fwd_bwd_ms"])
        print(f"best fwd+bwd: {best['options']} {best['fwd_bwd_ms']:.2f} ms (default {ok[0]['fwd_bwd_ms']:.2f} ms)")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
