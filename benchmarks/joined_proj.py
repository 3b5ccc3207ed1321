"""A training layer's forward + backward with its input projections joined (`K3_JOINED_PROJ`) and separate, in the
same run: the KDA attention, the MLA attention and the LatentMoE of a preset (k3-small by default).

Each layer runs B x T packed tokens (random documents) under bf16 autocast over fp32 weights, as in training. Per
layer and mode: the median time of forward + backward (CUDA events on a GPU, wall clock on a CPU), and the
operators the profiler saw (how many GEMMs, adds and copies), which is what the switch changes.

    python benchmarks/joined_proj.py                                  # GPU: k3-small, 8 x 4,096 tokens
    python benchmarks/joined_proj.py --preset k3-tiny --B 1 --T 512   # CPU
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import k3.ops.joined_linear as JL  # noqa: E402
from k3 import K3Config  # noqa: E402
from k3.model.kda import KimiDeltaAttention  # noqa: E402
from k3.model.mla import MLAttention  # noqa: E402
from k3.model.moe import LatentMoE  # noqa: E402
from timing import median_ms  # noqa: E402

OPS = ("aten::mm", "aten::addmm", "aten::add", "aten::add_", "aten::addmm_", "aten::copy_", "aten::cat")


def documents(B: int, T: int, mean: int, device) -> torch.Tensor:
    """cu_seqlens over B·T tokens: documents of random lengths around `mean`, cut at row ends."""
    g = torch.Generator().manual_seed(0)
    cu = [0]
    for r in range(B):
        pos = 0
        while pos < T:
            pos += int(torch.empty(1).exponential_(1.0 / mean, generator=g).clamp(1, T - pos).item())
            cu.append(r * T + pos)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def layers(cfg, device):
    t = cfg.text_config
    torch.manual_seed(0)
    out = {"kda": KimiDeltaAttention(t, 0), "mla": MLAttention(t, 0), "moe": LatentMoE(t)}
    for m in out.values():
        for p in m.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        m.to(device).train()
    return out


def step(layer, name, x, cu):
    """One forward + backward of `layer` on x (fp32 master weights, bf16 autocast, a fixed upstream gradient)."""
    xx = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = layer(xx.view(1, -1, x.shape[-1])) if name == "moe" else layer(xx.view(1, -1, x.shape[-1]), cu_seqlens=cu)
    y.float().backward(torch.ones_like(y, dtype=torch.float32))
    layer.zero_grad(set_to_none=True)


def op_counts(fn) -> dict:
    from torch.profiler import profile
    with profile() as prof:
        fn()
    c = collections.Counter({e.key: e.count for e in prof.key_averages() if e.key in OPS})
    return {k: c.get(k, 0) for k in OPS}


def layer_args(doc: str, out: str) -> argparse.ArgumentParser:
    """The options of the scripts that time a preset's layers at B x T packed tokens (this one, fp8_linear.py)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--mean-doc", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=out)
    return ap


def main():
    a = layer_args(__doc__, "joined_proj.json").parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = K3Config.preset(a.preset)
    D = cfg.text_config.hidden_size
    x = (torch.randn(a.B * a.T, D, device=dev) * 0.5).to(torch.bfloat16)
    cu = documents(a.B, a.T, a.mean_doc, dev)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "preset": a.preset,
           "tokens": a.B * a.T, "rows": {}}
    for name, layer in layers(cfg, dev).items():
        row = {}
        for on in (False, True):
            JL.ENABLED = on
            fn = lambda: step(layer, name, x, cu)  # noqa: E731
            ms = median_ms(fn, 2, a.reps, cuda=dev.type == "cuda")
            row["joined" if on else "separate"] = {"ms": ms, "ops": op_counts(fn)}
        JL.ENABLED = False
        s, j = row["separate"], row["joined"]
        row["speedup"] = s["ms"] / j["ms"]
        res["rows"][name] = row
        print(f"{name}: separate {s['ms']:.3f} ms, joined {j['ms']:.3f} ms ({row['speedup']:.2f}x); ops separate "
              f"{s['ops']} joined {j['ops']}", flush=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
