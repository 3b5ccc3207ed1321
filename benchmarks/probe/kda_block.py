"""A batch-1 decode step's KDA attention at k3-small's width (D 1,536, 12 heads of 128, conv 4), bf16: the composed
ops (the engine's default: the joined GEMV, f_b, the conv step, the recurrent step, the gated norm + o_proj) against
`k3.ops.kda_block`'s one persistent kernel under several launch settings. Each in a CUDA graph of 12 layers (their
own weights and pool slots), CUDA events around replays, median of --reps; the first replay's outputs checked
against the composed ops' (relative RMS, bf16); µs per layer with the weight bytes' time at 4.3 TB/s.

    python benchmarks/probe/kda_block.py --out kda_block.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graph_us, launch_sweep  # noqa: E402

from k3.ops import kda_block  # noqa: E402
from k3.ops.kda_block import kda_block_decode, kda_block_reference  # noqa: E402

D, H, K, W = 1536, 12, 128, 4


def layer_inputs(i: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(i)

    def r(*shape, s=1.0, dtype=torch.bfloat16):
        return (s * torch.randn(*shape, device="cuda", generator=g)).to(dtype)
    HK = H * K
    return dict(x=r(1, D), w_in=r(4 * HK + K + H + 52, D, s=D ** -0.5), w_fb=r(HK, K, s=K ** -0.5),
                w_conv=r(3 * HK, 1, W, s=0.5, dtype=torch.float32), conv_pool=r(4, 3 * HK, W - 1),
                state_pool=r(4, H, K, K, s=0.1, dtype=torch.float32), slot=torch.tensor([2], device="cuda"),
                A_log=r(H, s=0.3, dtype=torch.float32), dt_bias=r(H * K, s=0.5, dtype=torch.float32),
                lower_bound=-5.0, o_norm=(r(K, s=0.1) + 1, 1e-6), w_o=r(D, HK, s=HK ** -0.5), residual=r(1, D),
                counters=torch.zeros(3, dtype=torch.int32, device="cuda"))


def weight_bytes() -> int:
    HK = H * K
    return 2 * ((4 * HK + K + H) * D + HK * K + D * HK)


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="kda_block.json")
    a = ap.parse_args()
    layers = [layer_inputs(i) for i in range(a.layers)]
    floor = weight_bytes() / 4.3e12 * 1e6
    res = {"device": torch.cuda.get_device_name(), "layers": a.layers, "bytes_per_layer": weight_bytes(),
           "hbm_floor_us_per_layer": floor, "rows": {}}
    # correctness first, on fresh copies of layer 0 (the timed runs keep updating the pools)
    fresh = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in layers[0].items()} for _ in range(2)]
    want = kda_block_reference(**fresh[0])
    got = kda_block_decode(**fresh[1])
    err = float((got.float() - want.float()).pow(2).mean().sqrt() / want.float().pow(2).mean().sqrt())
    res["rel_rms_vs_composed"] = err
    base = graph_us(lambda: [kda_block_reference(**lay) for lay in layers], a.reps) / a.layers
    res["rows"]["composed"] = {"us_per_unit": base}
    print(f"{a.layers} KDA layers, {weight_bytes() / 1e6:.1f} MB each ({floor:.2f} µs at 4.3 TB/s); block against "
          f"composed: rel. RMS {err:.1e}\ncomposed ops: {base:6.2f} µs per layer", flush=True)
    default = kda_block.LAUNCH
    tiles = [(default["bn"], default["bc"], default["bv"]), (16, 64, 16), (4, 32, 16), (8, 128, 32)]
    settings = [dict(bn=bn, bc=bc, bv=bv, per_sm=ps) for (bn, bc, bv), ps in itertools.product(tiles, (1, 2, 4))]
    # the projections' tensor-core form, cooperative (the driver refuses a grid that cannot all be resident)
    settings += [dict(bn=16, mma=True, ch=ch, per_sm=ps, coop=True) for ch, ps in itertools.product((128, 256), (2, 4))]
    settings += [dict(per_sm=ps, coop=True) for ps in (2, 4)]  # last: a refused launch cannot spoil the others
    res["rows"].update(launch_sweep(
        kda_block.LAUNCH, settings, lambda: [kda_block_decode(**lay) for lay in layers], a.reps, a.layers, base, floor,
        lambda: {"barrier_timed_out": any(int(lay["counters"][2]) for lay in layers)}))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
