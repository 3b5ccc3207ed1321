"""Time Block AttnRes: the stacking reference against the fused op (triton and torch backends), in one run.

bf16 sources [B·T, D] (N candidates), fp32 query / norm_weight (as under autocast), CUDA events, median of
--reps after warm-up. Forward alone and forward + backward (every source, query and norm_weight get a
gradient). GB/s is against the bytes the op must move at least: forward N reads + 1 write of [B·T, D];
forward + backward that plus N + 1 reads (sources, dh) and N writes (dv). Also the peak memory above the
inputs of one forward + backward.

    python benchmarks/attn_res.py                          # B·T = 32768, D = 1536, N = 2..6
    python benchmarks/attn_res.py --D 7168 --N 6 10 --out attn_res.json
    python benchmarks/attn_res.py --sweep                  # triton launch settings (block_d, num_warps)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timing import median_ms  # noqa: E402

from k3.ops.attn_res import attn_res  # noqa: E402

EPS = 1e-5


def inputs(N, R, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    src = [(torch.randn(R, D, device="cuda", generator=g) * (0.5 + i)).to(dtype).requires_grad_() for i in range(N)]
    query = (0.1 * torch.randn(1, D, device="cuda", generator=g)).requires_grad_()
    norm_w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).requires_grad_()
    dh = torch.randn(R, D, device="cuda", generator=g).to(dtype)
    return src, query, norm_w, dh


def measure(name, fn, src, query, norm_w, dh, warmup, reps):
    """fwd ms, fwd+bwd ms, peak MiB above the inputs for one fwd+bwd."""
    def fwd():
        with torch.no_grad():
            fn(src, query, norm_w, EPS)

    def both():
        for t in (*src, query, norm_w):
            t.grad = None
        fn(src, query, norm_w, EPS).backward(dh)

    f = median_ms(fwd, warmup, reps)
    b = median_ms(both, warmup, reps)
    for t in (*src, query, norm_w):
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    both()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return dict(method=name, fwd_ms=f, fwd_bwd_ms=b, peak_mib=peak)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32768, help="B*T tokens")
    ap.add_argument("--D", type=int, default=1536)
    ap.add_argument("--N", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time triton launch settings")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attn_res.py needs CUDA")
    dtype = getattr(torch, a.dtype)
    el = torch.empty(0, dtype=dtype).element_size()
    methods = [("reference", lambda *x: attn_res(*x, backend="reference")),
               ("torch", lambda *x: attn_res(*x, backend="torch")),
               ("triton", lambda *x: attn_res(*x, backend="triton"))]
    if a.sweep:
        for bd in (128, 256, 512, 1024):
            for nw in (2, 4, 8):
                cfg = dict(block_d=bd, num_warps=nw)
                methods.append((f"triton bd={bd} w={nw}",
                                lambda *x, cfg=cfg: attn_res(*x, backend="triton", fwd=cfg, bwd=cfg)))
    rows = []
    print(f"{torch.cuda.get_device_name()}  rows={a.rows} D={a.D} {a.dtype}  median of {a.reps}")
    print(f"{'N':>3} {'method':<24} {'fwd ms':>8} {'GB/s':>7} {'fwd+bwd ms':>11} {'GB/s':>7} {'x ref':>6} "
          f"{'peak MiB':>9}")
    for N in a.N:
        x = inputs(N, a.rows, a.D, dtype, seed=N)
        unit = a.rows * a.D * el
        fwd_bytes, both_bytes = (N + 1) * unit, (N + 1) * unit + (2 * N + 1) * unit
        ref_both = None
        for name, fn in methods:
            try:
                r = measure(name, fn, *x, a.warmup, a.reps)
            except torch.OutOfMemoryError:
                print(f"{N:>3} {name:<24} out of memory")
                continue
            r.update(N=N, rows=a.rows, D=a.D, dtype=a.dtype, fwd_gbps=fwd_bytes / r["fwd_ms"] / 1e6,
                     fwd_bwd_gbps=both_bytes / r["fwd_bwd_ms"] / 1e6)
            ref_both = ref_both or (r["fwd_bwd_ms"] if name == "reference" else None)
            r["speedup_fwd_bwd"] = ref_both / r["fwd_bwd_ms"] if ref_both else None
            rows.append(r)
            sp = f"{r['speedup_fwd_bwd']:6.2f}" if ref_both else "     -"
            print(f"{N:>3} {name:<24} {r['fwd_ms']:8.3f} {r['fwd_gbps']:7.0f} {r['fwd_bwd_ms']:11.3f} "
                  f"{r['fwd_bwd_gbps']:7.0f} {sp} {r['peak_mib']:9.0f}", flush=True)
        del x
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
