"""RMSNorm's Triton kernels at the training shape (32,768 x 1,536 bf16, weighted; and the gated form of the KDA
output) against their launch settings (`k3.ops.norm.triton.CFG`: tile elements, elements per thread, backward
programs). Forward and backward timed apart (CUDA events, median), with the bytes each moves as TB/s; every
setting's outputs are checked against the default's (bitwise; the weight gradient, summed over the programs'
partials in another grouping, to 1e-5).
Usage: python benchmarks/probe/norm_cfg.py [--rows 32768] [--dim 1536]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.timing import median_ms  # noqa: E402
from k3.ops.norm import triton as NT  # noqa: E402

SETTINGS = [dict(tile=2048, per_thread=16, bwd_programs=1024),  # the default
            dict(tile=2048, per_thread=16, bwd_programs=4096),
            dict(tile=2048, per_thread=16, bwd_programs=264),
            dict(tile=4096, per_thread=16, bwd_programs=1024),
            dict(tile=8192, per_thread=16, bwd_programs=1024),
            dict(tile=8192, per_thread=32, bwd_programs=528),
            dict(tile=4096, per_thread=8, bwd_programs=2048)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    R, D = a.rows, a.dim
    x = torch.randn(R, D, device="cuda", generator=g).bfloat16().requires_grad_()
    gate = torch.randn(R, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).requires_grad_()
    dy = torch.randn(R, D, device="cuda", generator=g).bfloat16()
    default = dict(NT.CFG)
    rows, ref = [], {}
    for gated in (False, True):
        for s in SETTINGS:
            NT.CFG.update(s)
            gt = gate if gated else None
            y = NT.rms_norm_triton(x, w, 1e-6, gt)
            grads = torch.autograd.grad(y, [x, w] + ([gate] if gated else []), dy)
            outs = [y] + list(grads)
            same = True  # y, dx, dgate bitwise; dweight (summed over programs in another grouping) to 1e-5
            if gated in ref:
                for i, (o, r) in enumerate(zip(outs, ref[gated])):
                    same &= (torch.equal(o, r) if i != 2 else
                             bool(((o - r).float().norm() <= 1e-5 * r.float().norm()).item()))
            ref.setdefault(gated, [o.detach().clone() for o in outs])
            fwd = median_ms(lambda: NT.rms_norm_triton(x, w, 1e-6, gt), 3, a.reps)
            full = median_ms(lambda: torch.autograd.grad(NT.rms_norm_triton(x, w, 1e-6, gt),
                                                         [x, w] + ([gate] if gated else []), dy), 3, a.reps)
            bwd = full - fwd
            nb_f = R * D * 2 * (3 if gated else 2)  # x (+ gate) read, y written
            nb_b = R * D * 2 * (5 if gated else 3)  # x, dy (+ gate) read, dx (+ dgate) written
            r = dict(gated=gated, **s, fwd_ms=fwd, bwd_ms=bwd, fwd_tbps=nb_f / fwd / 1e9, bwd_tbps=nb_b / bwd / 1e9,
                     equal_to_default=same)
            rows.append(r)
            print(f"{'gated' if gated else 'plain'} {s}: fwd {fwd:.3f} ms ({r['fwd_tbps']:.2f} TB/s)  bwd {bwd:.3f} ms "
                  f"({r['bwd_tbps']:.2f} TB/s)  same as default: {same}", flush=True)
    NT.CFG.update(default)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(args=vars(a), rows=rows), indent=2))


if __name__ == "__main__":
    main()
