"""Time the KDA layer's fused path against its step-by-step path in the same run, and the fused elementwise ops
(Triton short conv, RMSNorm, gated RMSNorm) against their PyTorch references.

k3-small sizes (D 1536, H 12, K 128), B x T tokens packed into random documents (cu_seqlens), bf16 autocast over
fp32 weights as in training. CUDA events, median of --reps runs after warm-up. "fwd" runs with autograd recording
(the training forward); "bwd" times the backward alone (through a retained graph); "fwd+bwd" both. Prints a table
and writes JSON to --out.
    python benchmarks/kda_layer.py                      # B 8, T 4096
    python benchmarks/kda_layer.py --sweep              # also time the ops over launch settings
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from k3 import K3Config
from k3.model.kda import KimiDeltaAttention
from k3.ops.conv import short_conv_reference, short_conv_split
from k3.ops.conv import triton as conv_triton
from k3.ops.norm import rms_norm, rms_norm_gated, rms_norm_gated_reference, rms_norm_reference
from k3.ops.norm import triton as norm_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_ms  # noqa: E402


def documents(B, T, mean_len, seed=0):
    """cu_seqlens int32 over B·T tokens: exponential-ish random document lengths, cut at row ends."""
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for r in range(B):
        pos = 0
        while pos < T:
            n = int(torch.empty(1).exponential_(1.0 / mean_len, generator=g).clamp(1, T - pos).item())
            pos += n
            cu.append(r * T + pos)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def timed(fn, mode, args, warmup, reps):
    """Median ms of `mode` -- "fwd": fn(*args); "fwd+bwd": and its backward with a fixed upstream gradient;
    "bwd": that backward alone, through a graph kept from one forward -- and the peak memory above the start."""
    leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]

    def outputs():
        out = fn(*args)
        return out if isinstance(out, tuple) else (out,)

    def backward(outs, grads=None, keep=False):
        grads = [torch.ones_like(o) for o in outs] if grads is None else grads
        torch.autograd.backward(outs, grads, retain_graph=keep)
        for a in leaves:
            a.grad = None

    if mode == "bwd":  # the upstream gradients made once too: only the backward's own kernels are timed
        kept = outputs()
        ones = [torch.ones_like(o) for o in kept]
        step = lambda: backward(kept, ones, keep=True)  # noqa: E731
    elif mode == "fwd+bwd":
        step = lambda: backward(outputs())  # noqa: E731
    else:
        step = outputs
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, warmup, reps)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def layer_rows(B, T, cu, a):
    cfg = K3Config.preset("k3-small").text_config
    torch.manual_seed(0)
    kda = KimiDeltaAttention(cfg, 1).cuda()
    kda.reset_gate_parameters()
    x = torch.randn(B, T, cfg.hidden_size, device="cuda", requires_grad=True)

    def run(xx):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return kda(xx, cu_seqlens=cu)
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        res = {}
        for name, fast in (("old", False), ("fast", True)):  # old: today's code (PyTorch conv and norms)
            kda.fast = fast
            kda.elementwise_backend = "auto" if fast else "reference"
            res[name] = timed(run, mode, (x,), a.warmup, a.reps)
            kda.zero_grad(set_to_none=True)
        rows.append(dict(op="KDA layer", mode=mode, ref="step-by-step", ref_ms=res["old"][0], fast_ms=res["fast"][0],
                         ref_peak_gib=res["old"][1], fast_peak_gib=res["fast"][1]))
    return rows


def op_rows(B, T, cu, a, only=None, modes=("fwd", "bwd", "fwd+bwd"), with_ref=True):
    """The per-op comparisons (reference vs Triton), timed per mode; `only`: op names to run."""
    HK, D, H, K = 3 * 1536, 1536, 12, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    xc = torch.randn(B, T, HK, generator=g, **bf).requires_grad_()
    wc = (0.5 * torch.randn(HK, 1, 4, generator=g, device="cuda")).requires_grad_()
    h = torch.randn(B, T, D, generator=g, **bf).requires_grad_()
    wh = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).requires_grad_()
    o = torch.randn(B, T, H, K, generator=g, **bf).requires_grad_()
    gate = torch.randn(B, T, H, K, generator=g, **bf).requires_grad_()
    wo = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).requires_grad_()
    cases = [
        ("short conv q|k|v", "3 x reference",
         lambda x, w: tuple(short_conv_reference(xi, wi, cu_seqlens=cu)[0]
                            for xi, wi in zip(x.split(HK // 3, -1), w.split(HK // 3))),
         lambda x, w: short_conv_split(x, w, (HK // 3,) * 3, cu_seqlens=cu, backend="triton"), (xc, wc)),
        ("rms_norm D1536", "reference",
         lambda x, w: rms_norm_reference(x, w, 1e-5), lambda x, w: rms_norm(x, w, 1e-5, backend="triton"), (h, wh)),
        ("rms_norm_gated K128", "old expression",
         lambda x, z, w: rms_norm_gated_reference(x, w, z, 1e-5),
         lambda x, z, w: rms_norm_gated(x, w, z, 1e-5, backend="triton"), (o, gate, wo)),
    ]
    rows = []
    for name, ref_name, ref, fast, args in cases:
        if only is not None and name not in only:
            continue
        for mode in modes:
            r = timed(ref, mode, args, a.warmup, a.reps) if with_ref else (float("nan"),) * 2
            f = timed(fast, mode, args, a.warmup, a.reps)
            rows.append(dict(op=name, mode=mode, ref=ref_name, ref_ms=r[0], fast_ms=f[0], ref_peak_gib=r[1],
                             fast_peak_gib=f[1]))
    return rows


# Per kind: (CFG dict, forward settings, backward settings, the mode timing the backward settings). A space is
# a dict of value lists (all combinations) or a list of settings.
SWEEP = {
    "conv": (conv_triton.CFG, dict(fwd_bt=(8, 16, 32), fwd_bc=(64, 128), fwd_warps=(4, 8)),
             # (tokens per program, channels per program, warps, groups of 4 tokens loaded ahead, channel-fast grid)
             [dict(bwd_bt=bt, bwd_bc=bc, bwd_warps=w, bwd_ahead=ah, bwd_cfast=cf) for bt, bc, w, ah, cf in (
                 (256, 64, 1, 2, 1), (256, 64, 1, 2, 0), (256, 64, 1, 1, 1), (128, 64, 1, 2, 1),
                 (512, 64, 1, 2, 1), (1024, 64, 1, 2, 1), (256, 128, 2, 2, 1), (512, 128, 2, 2, 1),
                 (256, 128, 1, 1, 1), (256, 256, 4, 2, 1))], "bwd"),
    "norm": (norm_triton.CFG, dict(tile=(1024, 2048, 4096), per_thread=(8, 16)),
             dict(tile=(1024, 2048, 4096), per_thread=(8, 16), bwd_programs=(264, 1024, 4096)), "fwd+bwd"),
}


def _settings(space):
    if isinstance(space, dict):
        return [dict(zip(space, values)) for values in itertools.product(*space.values())]
    return list(space)


def sweep(B, T, cu, a):
    """Forward settings timed on the forward, backward settings on the backward (conv: alone; norm: with the
    forward), each with the other's defaults; prints every setting (the fastest three of longer lists)."""
    rows = []
    for kind, (cfg, fwd_space, bwd_space, bwd_mode) in SWEEP.items():
        names = {"conv": ("short conv q|k|v",), "norm": ("rms_norm D1536", "rms_norm_gated K128")}[kind]
        default = dict(cfg)
        for mode, space in (("fwd", fwd_space), (bwd_mode, bwd_space)):
            for setting in _settings(space):
                cfg.update(default, **setting)
                try:
                    res = op_rows(B, T, cu, a, only=names, modes=(mode,), with_ref=False)
                except Exception as e:  # an illegal launch shape: report and go on
                    print(f"{kind} {mode} {setting}: {type(e).__name__}: {e}")
                    continue
                for r in res:
                    rows.append(dict(kind=kind, op=r["op"], mode=mode, setting=setting, ms=r["fast_ms"]))
        cfg.clear()
        cfg.update(default)
    for (kind, op, mode), grp in itertools.groupby(sorted(rows, key=lambda r: (r["kind"], r["op"], r["mode"], r["ms"])),
                                                   key=lambda r: (r["kind"], r["op"], r["mode"])):
        grp = list(grp)
        print(f"{'all' if len(grp) <= 10 else 'fastest'} {op} {mode}:")
        for r in grp[:10 if len(grp) <= 10 else 3]:
            print(f"    {r['ms']:8.3f} ms  {r['setting']}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--doc-len", type=int, default=1024, help="mean packed document length (0: one per row)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="kda_layer.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kda_layer.py needs a CUDA GPU")
    B, T = a.batch, a.seq
    cu = documents(B, T, a.doc_len) if a.doc_len > 0 else None
    rows = layer_rows(B, T, cu, a) + op_rows(B, T, cu, a)
    print(f"B {B}  T {T}  documents {0 if cu is None else cu.numel() - 1}  (bf16; ms = median of {a.reps})")
    print(f"{'op':<22}{'mode':<9}{'reference':<16}{'ref ms':>10}{'fast ms':>10}{'speed-up':>10}{'ref GiB':>9}"
          f"{'fast GiB':>9}")
    for r in rows:
        r["speedup"] = r["ref_ms"] / r["fast_ms"]
        print(f"{r['op']:<22}{r['mode']:<9}{r['ref']:<16}{r['ref_ms']:10.3f}{r['fast_ms']:10.3f}{r['speedup']:9.2f}x"
              f"{r['ref_peak_gib']:9.2f}{r['fast_peak_gib']:9.2f}", flush=True)
    out = {"info": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "T": T,
                    "documents": 0 if cu is None else cu.numel() - 1, "conv_cfg": dict(conv_triton.CFG),
                    "norm_cfg": dict(norm_triton.CFG)}, "rows": rows}
    if a.sweep:
        out["sweep"] = sweep(B, T, cu, a)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
