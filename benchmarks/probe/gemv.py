"""Dense projections of a decode step on the GPU: cuBLAS (`F.linear`, the head as `torch.mm(out_dtype=fp32)`)
against the GEMV kernel (`k3.ops.gemv`) in several launch settings, at every weight shape of a k3-small decode
step and 1 / 4 / 16 rows (`--rows 32 64`: the wide tiles of a prefix hit's tail or a decode batch). Each path runs
`R` calls in one CUDA graph over enough weight copies that the L2 cache (50 MB) holds none of them from the call
before; µs per call (median of 50 replays) and the weight bytes per call as a bandwidth. At one row also the
one-row CUDA-core form (`gemv_row_kernel`) in several launch settings ("gemv row ...").

    python benchmarks/probe/gemv.py --out gemv.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

from k3.ops.gemv import triton as gemv  # noqa: E402

SHAPES = {  # (N, K) of k3-small's projections in a decode step
    "lm_head": (163840, 1536), "kda_in (joined)": (6336, 1536), "kda f_b": (1536, 128), "o_proj / g_proj": (1536, 1536),
    "mla q_a": (512, 1536), "mla q_b": (2304, 512), "mla kv_a": (320, 1536), "moe latent down": (768, 1536),
    "moe latent up": (1536, 768), "shared gate_up": (2048, 1536), "shared down": (1536, 1024),
    "dense gate_up": (12288, 1536), "dense down": (1536, 6144),
}
CONFIGS = [(16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3),
           (128, 128, 8, 3),
           # 4 stages of 512 columns: every chunk of a K = 1,536 row in flight at once (with 3 stages the third
           # chunk's loads wait for the first chunk to land: the sm_90a code's LDGDEPBAR / DEPBAR order)
           (16, 512, 4, 4), (32, 512, 4, 4)]
# the one-row form (`gemv_row_kernel`, `ROW`): (BN, CH, warps), at one row on the shapes it takes (≤ 16,384 outputs)
ROW_CONFIGS = [(4, 256, 4), (8, 256, 4), (2, 256, 2), (4, 512, 4), (8, 512, 8)]
# for 17-64 rows (MMA tiles of 32 / 64 rows): narrower chunks (the x tile and the weight chunk per stage in shared
# memory)
CONFIGS_WIDE = [(16, 128, 4, 3), (32, 128, 4, 3), (32, 64, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3),
                (32, 256, 4, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (N, K) in SHAPES.items():
        nbytes = N * K * 2
        copies = max(1, min(64, -(-160_000_000 // nbytes)))
        R = max(copies, 8)
        ws = [torch.randn(N, K, device="cuda", generator=gen).bfloat16() * K ** -0.5 for _ in range(copies)]
        head = name == "lm_head"
        for M in a.rows:
            x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
            out = torch.float32 if head else None
            with torch.no_grad():
                ref = x.double() @ ws[0].double().t()
                if head:
                    paths = {"cublas": lambda w: torch.mm(x, w.t(), out_dtype=torch.float32)}
                else:
                    paths = {"cublas": lambda w: F.linear(x, w)}
                for c in CONFIGS if M <= 16 else CONFIGS_WIDE:
                    paths[f"gemv {c}"] = lambda w, c=c: gemv.gemv(x, w, out, config=c)
                if M == 1 and N <= 16384:  # every row setting, where `row_launch` takes the form or not
                    for c in ROW_CONFIGS:
                        paths[f"gemv row {c}"] = lambda w, c=c: gemv.gemv(x, w, out, row=c)
                r = dict(shape=name, N=N, K=K, M=M, mb=nbytes / 1e6)
                for p, fn in paths.items():
                    try:
                        y = fn(ws[0]).double()
                    except Exception as e:  # noqa: BLE001 (a setting that does not fit the shared memory: reported)
                        print(f"   {p}: {type(e).__name__}: {str(e)[:90]}")
                        continue
                    err = ((y - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
                    rep = graphed(lambda fn=fn: [fn(ws[i % copies]) for i in range(R)])
                    us = median_ms(rep, 5, 50) * 1e3 / R
                    r[p] = dict(us=round(us, 2), tb_s=round(nbytes / us / 1e6, 2), rel_rms=err)
                best = min((k for k in r if k.startswith("gemv")), key=lambda k: r[k]["us"])
                r["best"] = best
                dflt = r.get(f"gemv {gemv.launch(N, None, gemv.tile_rows(M))}", {}).get("us", "-")
                print(f"{name:18s} N {N:6d} K {K:5d} M {M:2d}: cublas {r['cublas']['us']:7.2f} us "
                      f"({r['cublas']['tb_s']:.2f} TB/s) | best {best} {r[best]['us']:7.2f} us "
                      f"({r[best]['tb_s']:.2f} TB/s) | default {dflt} | err {r[best]['rel_rms']:.1e}", flush=True)
                rows.append(r)
        del ws
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
