"""The GEMV prologues of a batch-1 decode step on the GPU, one use at a time: the input transform (RMSNorm of the
row or per head, the output gate, SiTU-GLU) inside the GEMV (`k3.ops.gemv.PROLOGUE = True`) against its own
kernel before a plain GEMV (the default), at k3-small's shapes, bf16, one row. Each path runs `R` calls in one
CUDA graph over enough weight copies that L2 holds none of them from the call before; µs per call (median of 50
replays). Every in-kernel result is checked against the separate kernels' (rel RMS).

    python benchmarks/probe/gemv_prologue.py --out gemv_prologue.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

from k3.ops import gemv  # noqa: E402


def uses(gen):
    """name → (N, K, x width, linear keywords but the weight) for the four prologues of k3-small's decode step."""
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    one = lambda n: (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).bfloat16()  # noqa: E731
    return {
        "kda o_proj: per-head norm + gate": (1536, 1536, 1536, dict(add=r(1, 1536), gate=r(1, 1536),
                                                                     norm=(one(128), 1e-6, 128))),
        "mla q_b: row norm": (2304, 512, 512, dict(norm=(one(512), 1e-6, None))),
        "moe up: row norm + add": (1536, 768, 768, dict(add=r(1, 1536), norm=(one(768), 1e-6, None))),
        "shared down: SiTU-GLU + add": (1536, 1024, 2048, dict(add=r(1, 1536), glu=(4.0, 25.0))),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_prologue.json")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (N, K, width, kw) in uses(gen).items():
        copies = max(8, -(-160_000_000 // (N * K * 2)))
        ws = [torch.randn(N, K, device="cuda", generator=gen).bfloat16() * K ** -0.5 for _ in range(copies)]
        x = torch.randn(1, width, device="cuda", generator=gen).bfloat16()
        res = {}
        with torch.no_grad():
            for mode in (False, True):
                gemv.PROLOGUE = mode
                y = gemv.linear(x, ws[0], **kw).double()
                rep = graphed(lambda: [gemv.linear(x, w, **kw) for w in ws])
                res[mode] = (median_ms(rep, 5, 50) * 1e3 / copies, y)
        gemv.PROLOGUE = False
        err = ((res[True][1] - res[False][1]).pow(2).mean() / res[False][1].pow(2).mean()).sqrt().item()
        rows.append(dict(use=name, N=N, K=K, separate_us=res[False][0], prologue_us=res[True][0], rel_rms=err))
        print(f"{name:32s} N {N:5d} K {K:5d}: separate kernels {res[False][0]:6.2f} us, in the GEMV "
              f"{res[True][0]:6.2f} us ({res[False][0] / res[True][0]:.2f}x), rel {err:.1e}", flush=True)
        del ws
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
