"""Does the KDA decode step's short conv pay as the joined projection's GEMV epilogue (`k3.ops.gemv.CONV`)?

k3-small's 12 KDA layers at batch 1 and 4 (each layer its own weights, so L2 holds none across layers), bf16, one
CUDA graph per form, the two graphs replayed alternately (`--rounds` of `--reps` replays each) so that clock and
host drift hit both alike:

  separate   per layer: the joined input GEMV [6336, 1536], `short_conv_step` on its q ‖ k ‖ v columns, the f_b GEMV,
             the KDA decode step (today's default);
  epilogue   the same with the conv in the GEMV's epilogue (`linear(..., conv=)` with CONV on).

Prints µs per layer (median over rounds) and the difference, and checks that both forms give the same outputs.

    python benchmarks/probe/decode_conv.py --out decode_conv.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

import k3.ops.gemv as gemv_ops  # noqa: E402
from k3.ops.conv import short_conv_step  # noqa: E402
from k3.ops.gemv import linear  # noqa: E402
from k3.ops.kda import kda_decode_step_gated  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="decode_conv.json")
    a = ap.parse_args()
    H, K, D, L, P, W = 12, 128, 1536, 12, 64, 4
    HK, C = H * K, 3 * H * K
    N_OUT = 6336  # 4·H·K + K + H padded to 64, as `joined_weight`
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*s, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)

    layers = [dict(w=rnd(N_OUT, D, scale=D ** -0.5), taps=rnd(C, 1, W, scale=0.5, dtype=torch.float32),
                   fb=rnd(HK, K, scale=K ** -0.5), A_log=rnd(H, dtype=torch.float32),
                   dtb=rnd(HK, dtype=torch.float32)) for _ in range(L)]
    res = {"device": torch.cuda.get_device_name(), "rows": {}}
    for N in (1, 4):
        x = rnd(N, D)
        slots = torch.randperm(P, device="cuda", generator=g)[:N]
        win0 = rnd(P, L, C, W - 1)
        st0 = rnd(P, L, H, K, K, scale=0.01, dtype=torch.float32)
        outs = {}

        def step(epilogue: bool, win=win0.clone(), st=st0.clone(), outs=outs):
            gemv_ops.CONV = epilogue
            o = None
            for i, lw in enumerate(layers):
                conv = (lw["taps"], win[:, i], slots)
                if epilogue:
                    y = linear(x, lw["w"], conv=conv)
                    qkv = y[:, :C]
                else:
                    y = linear(x, lw["w"])
                    qkv = short_conv_step(y[:, :C], lw["taps"], win[:, i], slots)
                fa, beta = y[:, C:C + K], y[:, C + K:C + K + H]
                f = linear(fa, lw["fb"]).view(N, H, K)
                q, k, v = (t.reshape(N, H, K) for t in qkv.split(HK, dim=-1))
                o = kda_decode_step_gated(q, k, v, f, beta, lw["A_log"], lw["dtb"], st[:, i], slots, -5.0)
            outs[epilogue] = o
            return o

        with torch.no_grad():
            if not gemv_ops.conv_epilogue(x, layers[0]["w"], layers[0]["taps"], win0[:, 0], slots):
                gemv_ops.CONV = True
                if not gemv_ops.conv_epilogue(x, layers[0]["w"], layers[0]["taps"], win0[:, 0], slots):
                    print("the GEMV kernel does not take these shapes here")
                    return 1
            # one eager step of each form from the same windows and states: the same outputs
            o_sep = step(False, win0.clone(), st0.clone())
            o_epi = step(True, win0.clone(), st0.clone())
            rel = float((o_sep.float() - o_epi.float()).pow(2).mean().sqrt() / o_sep.float().pow(2).mean().sqrt())
            sep, epi = graphed(lambda: step(False)), graphed(lambda: step(True))
            t_sep, t_epi = [], []
            for _ in range(a.rounds):
                t_sep.append(1e3 * median_ms(sep, 2, a.reps) / L)
                t_epi.append(1e3 * median_ms(epi, 2, a.reps) / L)
        row = dict(separate_us_per_layer=statistics.median(t_sep), epilogue_us_per_layer=statistics.median(t_epi),
                   rel_rms_outputs=rel)
        row["saved_us_per_layer"] = row["separate_us_per_layer"] - row["epilogue_us_per_layer"]
        res["rows"][f"batch {N}"] = row
        print(f"batch {N}: separate {row['separate_us_per_layer']:.2f} us/layer, epilogue "
              f"{row['epilogue_us_per_layer']:.2f} (saved {row['saved_us_per_layer']:.2f}), outputs rel RMS {rel:.1e}",
              flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
