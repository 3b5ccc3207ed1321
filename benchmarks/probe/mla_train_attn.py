"""Would another attention kernel pay in training? The MLA layers' document-causal attention at the training shape
(k3-small: B 8 × T 4,096 packed documents of mean 2,048 tokens, H 12, d_qk 192, d_v 128, bf16), forward and
forward + backward, two ways in one run:

  flex     `k3.ops.attention.doc_causal_attention(..., backend="flex")`, today's path, with the per-head max logit
           that QK-clip reads (from the same kernel);
  varlen   `torch.nn.attention.varlen.varlen_attn` (PyTorch's FlashAttention kernels over cu_seqlens): v zero-padded
           to d_qk (the kernel takes one head dim), causal, no max logit;
  varlen+max  the production backend, `doc_causal_attention(..., backend="varlen", return_max_logit=True)`: the
           same kernel over the documents cut at rows on the device, plus QK-clip's max logit from its Triton kernel
           (`k3.ops.attention.doc_max_logit`, also timed alone, forward only).

Checks varlen's output against flex's (relative RMS) and prints ms and the causal FLOP rate
(2·H·(d_qk + d_v) per attended pair forward, 3.5× that forward + backward).

    python benchmarks/probe/mla_train_attn.py --out mla_train_attn.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_ms  # noqa: E402
from train_throughput import random_docs  # noqa: E402

from k3.ops.attention import doc_causal_attention  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--mean-doc", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="mla_train_attn.json")
    ap.add_argument("--ml-configs", type=lambda c: tuple(int(x) for x in c.split("x")), nargs="*",
                    default=[(64, 64, 8, 3), (64, 64, 4, 3), (64, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2),
                             (128, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3),
                             (128, 64, 8, 4)],
                    help="max-logit kernel launches to time, as ROWSxKEYSxWARPSxSTAGES")
    a = ap.parse_args()
    B, T, H, DQ, DV = a.batch, a.seq, a.heads, 192, 128
    cu, _ = random_docs(B, T, a.mean_doc, torch.Generator().manual_seed(0))
    cu = cu.cuda()
    lens = (cu[1:] - cu[:-1]).tolist()
    pairs = sum(n * (n + 1) / 2 for n in lens)
    fwd_flop = 2 * H * (DQ + DV) * pairs
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, DQ, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, DV, device="cuda", generator=g).bfloat16().requires_grad_()
    do = torch.randn(B, T, H, DV, device="cuda", generator=g).bfloat16()
    scale = DQ ** -0.5
    res = {"device": torch.cuda.get_device_name(), "shape": [B, T, H, DQ, DV], "docs": len(lens),
           "fwd_tflop": fwd_flop / 1e12, "rows": {}}

    def flex():
        return doc_causal_attention(q, k, v, scale, cu, return_max_logit=True, backend="flex")[0]

    def varlen():
        from torch.nn.attention.varlen import varlen_attn
        causal = "is_causal" in inspect.signature(varlen_attn).parameters
        kw = {"is_causal": True} if causal else {"window_size": (-1, 0)}
        o = varlen_attn(q.reshape(B * T, H, DQ), k.reshape(B * T, H, DQ), F.pad(v, (0, DQ - DV)).reshape(B * T, H, DQ),
                        cu, cu, max(lens), max(lens), scale=scale, **kw)
        return o[..., :DV].reshape(B, T, H, DV)

    def varlen_max():
        return doc_causal_attention(q, k, v, scale, cu, return_max_logit=True, backend="varlen")[0]

    ref = None
    for name, fn in (("flex", flex), ("varlen", varlen), ("varlen+max", varlen_max)):
        try:
            with torch.no_grad():
                o = fn()
            err = None if ref is None else float((o.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
            ref = o.float() if ref is None else ref
            with torch.no_grad():
                f_ms = median_ms(fn, 3, a.reps)

            def step(fn=fn):
                q.grad = k.grad = v.grad = None
                fn().backward(do)
            fb_ms = median_ms(step, 3, a.reps)
            row = dict(fwd_ms=f_ms, fwd_bwd_ms=fb_ms, fwd_tflops=fwd_flop / f_ms / 1e9,
                       fwd_bwd_tflops=3.5 * fwd_flop / fb_ms / 1e9, rel_rms_vs_flex=err)
        except Exception as e:  # noqa: BLE001 - a path that does not run here is reported
            row = dict(error=f"{type(e).__name__}: {e}"[:400])
        res["rows"][name] = row
        print(name, json.dumps(row), flush=True)
    try:  # the max-logit kernel alone, and its value against flex's
        from k3.ops.attention import doc_max_logit
        with torch.no_grad():
            ml = doc_max_logit(q, k, scale, cu)
            ref_ml = doc_causal_attention(q, k, v, scale, cu, return_max_logit=True, backend="flex")[1]
            ms = median_ms(lambda: doc_max_logit(q, k, scale, cu), 3, a.reps)
        row = dict(ms=ms, max_abs_diff_vs_flex=float((ml - ref_ml).abs().max()))
    except Exception as e:  # noqa: BLE001
        row = dict(error=f"{type(e).__name__}: {e}"[:400])
    res["rows"]["max_logit_kernel"] = row
    print("max_logit_kernel", json.dumps(row), flush=True)
    from k3.ops.attention.varlen import MAX_LOGIT_LAUNCH
    res["max_logit_launch"] = {}
    for cfg in a.ml_configs:  # the kernel's launch settings: (query rows, key rows, warps, stages)
        try:
            with torch.no_grad():
                ml = doc_max_logit(q, k, scale, cu, config=cfg)
                ms = median_ms(lambda: doc_max_logit(q, k, scale, cu, config=cfg), 3, a.reps)
            row = dict(ms=ms, max_abs_diff_vs_flex=float((ml - ref_ml).abs().max()))
        except Exception as e:  # noqa: BLE001 - a launch that does not fit here is reported
            row = dict(error=f"{type(e).__name__}: {e}"[:200])
        res["max_logit_launch"]["x".join(map(str, cfg))] = row
        print("max_logit", "x".join(map(str, cfg)), "(default)" if tuple(cfg) == MAX_LOGIT_LAUNCH else "",
              json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
