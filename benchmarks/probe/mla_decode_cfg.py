"""Launch settings of the paged MLA decode kernel for a decode step's rows (`k3.ops.mla_decode.triton`,
LAUNCH["decode"]): heads per program, history positions per block, warps, pipelining stages, at k3-small's
sizes (12 heads, latent 256 + 64, bf16) for 1, 8 and 32 sequences with short and long histories, the history
padded to the decode graph's bucket; then LAUNCH["groups"] for a prefix hit's tail (64 rows of one sequence in
runs of GROUP_ROWS after 16,384 cached; rows per run swept too). Each setting runs 20 calls (5 for the tail) in one CUDA graph; µs per
call (median of 30 replays), the default first; every setting's output is checked against the default's.

    python benchmarks/probe/mla_decode_cfg.py [--parts decode groups] --out mla_decode_cfg.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

from k3.ops.mla_decode import triton as mla  # noqa: E402


def _rel(err) -> str:
    """A setting's rel RMS against the default, or its error message when it did not run."""
    return err if isinstance(err, str) else f"{err:.5f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mla_decode_cfg.json")
    ap.add_argument("--parts", nargs="*", default=["decode", "groups"], choices=["decode", "groups"])
    a = ap.parse_args()
    H, C, R, PS = 12, 256, 64, 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    default = dict(mla.LAUNCH["decode"])
    cfgs = [default] + [dict(bh=bh, bs=bs, split=default["split"], warps=w, stages=st)
                        for bh, bs, w, st in itertools.product((4, 8, 16), (32, 64, 128), (4, 8), (None, 2))]
    rows = []
    for n, length in ((1, 200), (1, 2000), (8, 200), (32, 2000)) if "decode" in a.parts else ():
        S = max(256, 1 << (length - 1).bit_length())
        P = n * (S // PS + 1) + 4
        kv = torch.randn(P, PS, C + R, device="cuda", generator=gen).bfloat16()
        perm = torch.randperm(P, device="cuda", generator=gen)[:n * (S // PS + 1)].view(n, -1)
        pages = perm.repeat_interleave(PS, dim=1)[:, :S].contiguous()
        lens = torch.full((n,), length, device="cuda", dtype=torch.int32)
        ql = torch.randn(n, H, C, device="cuda", generator=gen).bfloat16()
        qp = torch.randn(n, H, R, device="cuda", generator=gen).bfloat16()
        ref = None
        res = []
        for cfg in cfgs:
            try:
                fn = lambda cfg=cfg: mla.paged_mla_decode_triton(ql, qp, kv, pages, lens, 0.07, launch=cfg)  # noqa
                out = fn().float()
                ref = out if ref is None else ref
                err = ((out - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
                us = median_ms(graphed(lambda fn=fn: [fn() for _ in range(20)]), 3, 30) * 1e3 / 20
            except Exception as e:  # a setting that does not compile (registers, shared memory)
                us, err = float("inf"), repr(e)[:80]
            res.append(dict(cfg={k: cfg[k] for k in ("bh", "bs", "warps", "stages")}, us=us, rel=err))
        best = sorted(res[1:], key=lambda r: r["us"])[:5]
        rows.append(dict(n=n, length=length, S=S, default=res[0], best=best))
        print(f"n {n:3d} history {length:5d} (S {S}): default {res[0]['us']:6.2f} us; best "
              + "; ".join(f"{r['cfg']['bh']}/{r['cfg']['bs']}/{r['cfg']['warps']}/{r['cfg']['stages']} "
                          f"{r['us']:.2f} (rel {_rel(r['rel'])})"
                          for r in best), flush=True)
    if "groups" not in a.parts:
        Path(a.out).write_text(json.dumps(rows, indent=1))
        return
    # a prefix hit's tail: 64 rows after 16,384 cached, runs of GROUP_ROWS rows sharing one read of each block
    T, hist = 64, 16384
    S = 1 << (hist + T - 1).bit_length()
    P = S // PS + 4
    kv = torch.randn(P, PS, C + R, device="cuda", generator=gen).bfloat16()
    page_row = torch.randperm(P, device="cuda", generator=gen)[:S // PS].repeat_interleave(PS)
    pages = page_row[None].expand(T, S).contiguous()
    lens = torch.arange(hist + 1, hist + T + 1, device="cuda", dtype=torch.int32)
    ql = torch.randn(T, H, C, device="cuda", generator=gen).bfloat16()
    qp = torch.randn(T, H, R, device="cuda", generator=gen).bfloat16()
    gdef = dict(mla.LAUNCH["groups"], g=mla.GROUP_ROWS)
    gcfgs = [gdef] + list(mla.SWEEP_GROUPS)
    ref, res = None, []
    for cfg in gcfgs:
        g = cfg["g"]  # rows per run: the runs are built for it
        groups = torch.tensor([[i, g] for i in range(0, T, g)], device="cuda", dtype=torch.int32)
        try:
            fn = lambda cfg=cfg, groups=groups: mla.paged_mla_decode_triton(  # noqa: E731
                ql, qp, kv, pages, lens, 0.07, groups=groups, group_rows=cfg["g"], launch=cfg)
            out = fn().float()
            ref = out if ref is None else ref
            err = ((out - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
            us = median_ms(graphed(lambda fn=fn: [fn() for _ in range(5)]), 3, 30) * 1e3 / 5
        except Exception as e:
            us, err = float("inf"), repr(e)[:80]
        res.append(dict(cfg={k: cfg[k] for k in ("g", "bh", "bs", "split", "warps", "stages")}, us=us, rel=err))
    best = sorted(res[1:], key=lambda r: r["us"])[:5]
    rows.append(dict(tail=T, cached=hist, default=res[0], best=best))
    print(f"tail {T} rows after {hist}: default {res[0]['us']:7.1f} us; best (g/bh/bs/split/warps/stages) "
          + "; ".join(f"{r['cfg']['g']}/{r['cfg']['bh']}/{r['cfg']['bs']}/{r['cfg']['split']}/{r['cfg']['warps']}/"
                      f"{r['cfg']['stages']} {r['us']:.1f} (rel {_rel(r['rel'])})"
                      for r in best), flush=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
