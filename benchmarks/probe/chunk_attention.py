"""MLA attention of a prefill chunk after cached history, as a prefill graph needs it (static shapes: the history
padded at its front to a bucket, the padding masked), against the eager form (exact history, causal aligned to the
last key). k3-small shapes: 16 heads, q/k 192 and v 128 dims, bf16, one H200. Each variant: CUDA events, median
of 20 after 3 warm-ups, its relative RMS error against the exact form on the real rows, and the SDPA kernel the
profiler saw.

    python benchmarks/probe/chunk_attention.py --out chunk_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_ms  # noqa: E402


def kernel_of(fn) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"), key=lambda e: -e.self_device_time_total)
    return evs[0].key[:100] if evs else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="chunk_attention.json")
    a = ap.parse_args()
    H, DQ, DV, T, scale = 16, 192, 128, 8192, 192 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    res = []
    for start, hb in ((8192, 8192), (5000, 8192)):
        S = hb + T
        q = torch.randn(1, H, T, DQ, device="cuda", dtype=torch.bfloat16, generator=g)
        kr = torch.randn(1, H, start + T, DQ, device="cuda", dtype=torch.bfloat16, generator=g)
        vr = torch.randn(1, H, start + T, DV, device="cuda", dtype=torch.bfloat16, generator=g)
        pad = hb - start
        k = torch.cat([torch.randn(1, H, pad, DQ, device="cuda", dtype=torch.bfloat16, generator=g), kr], 2)
        v = torch.cat([torch.randn(1, H, pad, DV, device="cuda", dtype=torch.bfloat16, generator=g), vr], 2)
        valid = torch.arange(S, device="cuda") >= pad
        allowed = valid[None, :] & (torch.arange(S, device="cuda")[None, :] <= torch.arange(T, device="cuda")[:, None] + hb)

        def exact():
            return F.scaled_dot_product_attention(q, kr, vr, attn_mask=causal_lower_right(T, start + T), scale=scale)

        def bias_dim(extra):
            qx = torch.zeros(1, H, T, extra, device="cuda", dtype=q.dtype)
            qx[..., 0] = 1
            kx = torch.zeros(1, H, S, extra, device="cuda", dtype=q.dtype)
            kx[..., 0] = torch.where(valid, 0.0, -2.0 ** 14).to(q.dtype)
            qq, kk = torch.cat([q, qx], -1), torch.cat([k, kx], -1)
            return lambda: F.scaled_dot_product_attention(qq, kk, v, attn_mask=causal_lower_right(T, S), scale=scale)

        fbias = torch.zeros(T, S, device="cuda", dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
        # varlen kernels: the keys packed from position 0 (no front padding), garbage after start + T up to S rows;
        # the key length is a device tensor, the shapes static
        qt, kt, vt = (x[0].transpose(0, 1).contiguous() for x in (q, torch.cat([kr, k[:, :, :pad]], 2),
                                                                   torch.cat([vr, v[:, :, :pad]], 2)))
        vt192 = F.pad(vt, (0, DQ - DV))
        cq = torch.tensor([0, T], device="cuda", dtype=torch.int32)
        ck = torch.tensor([0, start + T], device="cuda", dtype=torch.int32)

        def flash_varlen():  # FA2 needs one head dim: v zero-padded to 192
            o = torch.ops.aten._flash_attention_forward(qt, kt, vt192, cq, ck, T, S, 0.0, True, False, scale=scale)[0]
            return o[..., :DV].transpose(0, 1)[None]

        def efficient_varlen():  # causal from the bottom right (custom_mask_type 2)
            o = torch.ops.aten._efficient_attention_forward(qt[None], kt[None], vt[None], None, cq, ck, T, S, 0.0, 2,
                                                            scale=scale)[0]
            return o[0].transpose(0, 1)[None]

        variants = {
            "exact history, causal lower-right (eager)": exact,
            "bias dimension, 200": bias_dim(8),
            "bias dimension, 256": bias_dim(64),
            "bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale),
            "bf16 additive mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fbias, scale=scale),
            "varlen flash (v padded to 192)": flash_varlen,
            "varlen memory-efficient": efficient_varlen,
        }
        if hasattr(torch.ops.aten, "_cudnn_attention_forward"):  # ragged cuDNN (its causal alignment: the error says)
            def cudnn_varlen():
                o = torch.ops.aten._cudnn_attention_forward(qt, kt, vt, None, cq, ck, T, S, False, 0.0, True,
                                                            scale=scale)[0]
                return o.transpose(0, 1)[None]
            variants["varlen cuDNN"] = cudnn_varlen
        ref = exact().float()
        for name, fn in variants.items():
            try:
                ms = median_ms(fn, 3, 20)
                err = ((fn().float() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
                row = dict(start=start, history_bucket=hb, variant=name, ms=ms, rel_rmse=err, kernel=kernel_of(fn))
            except Exception as e:  # a backend that refuses the shape
                row = dict(start=start, history_bucket=hb, variant=name, error=f"{type(e).__name__}: {e}"[:300])
            res.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
