"""FP8 projections for training (`k3.ops.fp8`) against bf16, in the same run: each projection shape of a preset, the
quantisation kernel alone, and whole KDA / MLA / MoE layers (forward + backward, as `joined_proj.py` times them).

Shapes: M = B·T tokens (8 x 4,096 by default) times each distinct projection of the preset's layers (the joined
input projections padded as `k3.ops.joined_linear` pads them). Per shape, forward + backward of x Wᵀ with an fp32
master weight under bf16 autocast (what training runs): `F.linear` (bf16 GEMMs, the weight cast per call) against
`fp8_linear` (row-wise e4m3 GEMMs forward and for dx, quantisation included; dW in bf16; then also dW in FP8, and the
forward alone in FP8; dx in FP8 at every input width, whatever `K3_FP8_DGRAD_MIN_K` says, so that these rows can set
it). Then the quantisation of
x's rows, of the weight's rows and of its columns alone, in GB/s of bytes moved. Then each layer of the preset
with its projections in bf16 (joined) and converted to FP8 (the production rules). CUDA events, median of `--reps`
after warm-up.

    python benchmarks/fp8_linear.py                                   # GPU: k3-small, 8 x 4,096 tokens
    python benchmarks/fp8_linear.py --preset k3-tiny --B 1 --T 512    # CPU (oneDNN's _scaled_mm; not a speed claim)
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from joined_proj import documents, layer_args, layers, step  # noqa: E402
from k3 import K3Config  # noqa: E402
from k3.ops import fp8  # noqa: E402
from k3.ops.joined_linear import MULTIPLE  # noqa: E402
from timing import median_ms  # noqa: E402


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """names → (N, K) of the preset's distinct projection shapes in a training step (the KDA layer's joined input
    projection padded to MULTIPLE rows, as `k3.ops.joined_linear` pads it)."""
    t = cfg.text_config
    seen: dict[str, tuple[int, int]] = {}
    built = layers(cfg, "meta")
    for name, layer in built.items():
        for mname, m in layer.named_modules():
            if isinstance(m, torch.nn.Linear) and m.in_features % fp8.ALIGN == 0 and m.out_features % fp8.ALIGN == 0:
                seen.setdefault(f"{name}.{mname}", (m.out_features, m.in_features))
    D = t.hidden_size
    pad = lambda n: -(-n // MULTIPLE) * MULTIPLE  # noqa: E731
    kda = built["kda"]
    HK = kda.q_proj.out_features
    seen["kda.joined"] = (pad(3 * HK + kda.f_a_proj.out_features + kda.b_proj.out_features + HK), D)
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name, nk in seen.items():
        by_shape.setdefault(nk, []).append(name)
    return {",".join(names): nk for nk, names in by_shape.items()}  # one row per distinct shape


def bench_shape(N, K, M, dev, reps):
    """One projection shape: forward + backward in bf16 and in FP8, and the quantisation kernel alone."""
    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    act = torch.bfloat16 if cuda else torch.float32  # the CPU has no bf16 autocast worth timing: fp32 there
    x = (torch.randn(M, K, device=dev, generator=g) * 0.5).to(act)
    w = (torch.randn(N, K, device=dev, generator=g) * K ** -0.5).requires_grad_()
    dy = torch.randn(M, N, device=dev, generator=g).to(act)

    def run(f):
        def fn():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                y = f(x.detach().requires_grad_(), w)
            y.backward(dy)
            w.grad = None
        return fn

    row = {"N": N, "K": K, "M": M}
    row["bf16_ms"] = median_ms(run(F.linear), 3, reps, cuda=cuda)
    min_k, fp8.DGRAD_MIN_K = fp8.DGRAD_MIN_K, 0  # dx in FP8 at every width here: the rows that set the threshold
    row["fp8_ms"] = median_ms(run(fp8.fp8_linear), 3, reps, cuda=cuda)
    fp8.WGRAD = True  # dW in FP8 too (K3_FP8_WGRAD)
    row["fp8_wgrad_ms"] = median_ms(run(fp8.fp8_linear), 3, reps, cuda=cuda)
    fp8.WGRAD, fp8.DGRAD = False, False  # the forward alone in FP8 (K3_FP8_DGRAD=0)
    row["fp8_fwd_only_ms"] = median_ms(run(fp8.fp8_linear), 3, reps, cuda=cuda)
    fp8.DGRAD, fp8.DGRAD_MIN_K = True, min_k
    row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
    flop = 6 * M * N * K
    row["bf16_tflops"] = flop / row["bf16_ms"] / 1e9
    row["fp8_tflops"] = flop / row["fp8_ms"] / 1e9
    wd = w.detach()
    for what, t, nbytes in (("quant_x", x, M * K * (x.element_size() + 1)),
                            ("quant_w_rows", wd, N * K * 5), ("quant_w_cols", wd.t(), N * K * 5)):
        ms = median_ms(lambda: fp8.quantize_rows(t), 3, reps, cuda=cuda)
        row[what + "_us"] = 1e3 * ms
        row[what + "_gbs"] = nbytes / ms / 1e6
    return row


def main():
    ap = layer_args(__doc__, "fp8_linear.json")
    ap.add_argument("--no-layers", action="store_true", help="projection shapes only")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = K3Config.preset(a.preset)
    M = a.B * a.T
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "preset": a.preset,
           "tokens": M, "shapes": {}, "layers": {}}
    tot_b = tot_f = tot_w = tot_o = 0.0
    for name, (N, K) in shapes(cfg).items():
        r = bench_shape(N, K, M, dev, a.reps)
        res["shapes"][name] = r
        tot_b, tot_f, tot_w = tot_b + r["bf16_ms"], tot_f + r["fp8_ms"], tot_w + r["fp8_wgrad_ms"]
        tot_o += r["fp8_fwd_only_ms"]
        print(f"{name[:40]:40s} N {N:5d} K {K:5d}: bf16 {r['bf16_ms']:7.3f} ms ({r['bf16_tflops']:5.0f} TFLOP/s), fp8 "
              f"{r['fp8_ms']:7.3f} ms ({r['fp8_tflops']:5.0f}), {r['speedup']:.2f}x, dW in fp8 too "
              f"{r['fp8_wgrad_ms']:7.3f}, forward only {r['fp8_fwd_only_ms']:7.3f}; quantise x {r['quant_x_us']:.1f} "
              f"us ({r['quant_x_gbs']:.0f} GB/s), W rows {r['quant_w_rows_us']:.1f}, "
              f"W cols {r['quant_w_cols_us']:.1f} us",
              flush=True)
    print(f"== shapes: bf16 {tot_b:.3f} ms, fp8 {tot_f:.3f} ms ({tot_b / tot_f:.2f}x), dW in fp8 too {tot_w:.3f} ms "
          f"({tot_b / tot_w:.2f}x), forward only {tot_o:.3f} ms ({tot_b / tot_o:.2f}x)")
    if not a.no_layers:
        D = cfg.text_config.hidden_size
        x = (torch.randn(M, D, device=dev) * 0.5).to(torch.bfloat16)
        cu = documents(a.B, a.T, a.mean_doc, dev)
        for name, layer in layers(cfg, dev).items():
            conv = copy.deepcopy(layer)
            n = fp8.convert_to_float8_training(conv)
            row = {"converted": n}
            for mode, m, wg, dg in (("bf16", layer, False, True), ("fp8", conv, False, True),
                                    ("fp8_wgrad", conv, True, True), ("fp8_fwd_only", conv, False, False)):
                fp8.WGRAD, fp8.DGRAD = wg, dg
                row[mode + "_ms"] = median_ms(lambda: step(m, name, x, cu), 2, a.reps, cuda=dev.type == "cuda")
            fp8.WGRAD, fp8.DGRAD = False, True
            row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
            res["layers"][name] = row
            print(f"== {name}: bf16 {row['bf16_ms']:.3f} ms, fp8 {row['fp8_ms']:.3f} ms ({row['speedup']:.2f}x), "
                  f"dW in fp8 too {row['fp8_wgrad_ms']:.3f} ms, forward only {row['fp8_fwd_only_ms']:.3f} ms; "
                  f"{n} modules "
                  f"converted", flush=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
