"""A batch-1 decode step's LatentMoE at k3-small's width, bf16: the composed path (the engine's default: the joined
GEMV, the routed experts' two kernels, the shared SiTU and down projection, the latent norm, the up projection)
against `k3.ops.moe_block`'s one persistent kernel under several launch settings. Each in a CUDA graph of 16
layers' MoEs (their own weights: ≈ 16 × 24 MB read per replay, more than L2 holds), CUDA events around replays,
median of --reps; checks every setting's output against the composed path's (relative RMS, bf16) and prints
µs per layer with the weight bytes' time at 4.3 TB/s; also the block split into four launches (`moe_block.SPLIT`,
its tiles swept).
--floor 1 (default): the three forms again at widths 128 / 64 / 64 (the same kernels, phases and barriers over
≈ 1 % of the bytes), the time a layer costs besides its reads. --phases 1 (default): the split form's phases
timed as prefixes (1, 1-2, 1-3, 1-4), each phase's µs and the rate its weights stream at, full width and tiny.

    python benchmarks/probe/moe_block.py --out moe_block.json
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

from k3.config import K3Config  # noqa: E402
from k3.model.moe import LatentMoE  # noqa: E402
from k3.ops import moe_block  # noqa: E402


def layers(n: int, **shrink):
    """n k3-small LatentMoE layers with random bf16 weights; `shrink`: text-config fields overridden (the
    latency floor's tiny widths)."""
    cfg = K3Config.preset("k3-small").text_config
    for k, v in shrink.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    out = []
    for _ in range(n):
        m = LatentMoE(cfg).cuda()
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(std=p.shape[-1] ** -0.5)
            m.gate.e_score_correction_bias.normal_(std=0.05)
        out.append(m.to(torch.bfloat16).eval())
    return cfg, out


def read_bytes(cfg) -> int:
    """Weight bytes one row's MoE reads: the joined input, K experts, the shared down and the up projection."""
    D, L, I, IS, E, K = (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size,
                         cfg.num_shared_experts * cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_token)
    return 2 * ((L + 2 * IS + E) * D + K * 3 * I * L + D * IS + D * L)


def phase_bytes(cfg) -> list[int]:
    """Weight bytes of the split form's four phases at one row (they sum to `read_bytes`)."""
    D, L, I = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    IS, E, K = cfg.num_shared_experts * cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_token
    return [2 * (L + 2 * IS + E) * D, 2 * (K * 2 * I * L + D * IS), 2 * K * L * I, 2 * D * L]


def phase_times(chain, reps: int, layers: int, cfg) -> dict:
    """µs per layer of the split form run up to phase p (p = 1..4) and each phase's difference from the prefix
    before it, with the rate its weight bytes then stream at."""
    split0, phases0 = moe_block.SPLIT, moe_block.PHASES
    out, prev = {}, 0.0
    try:
        moe_block.SPLIT = True
        for p, nbytes in zip(range(1, 5), phase_bytes(cfg)):
            moe_block.PHASES = p
            t = graph_us(chain, reps) / layers
            out[f"phases 1-{p}"] = {"us_per_layer": t, "phase_us": t - prev, "phase_bytes": nbytes,
                                    "tb_per_s": nbytes / max(t - prev, 1e-3) / 1e6}
            print(f"split, phases 1-{p}: {t:6.2f} µs per layer; phase {p} "
                  f"{t - prev:5.2f} µs for {nbytes / 1e6:4.1f} MB ({nbytes / max(t - prev, 1e-3) / 1e6:4.2f} TB/s)",
                  flush=True)
            prev = t
    finally:
        moe_block.SPLIT, moe_block.PHASES = split0, phases0
    return out


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--floor", type=int, default=1, help="1: also time both paths at tiny widths (the latency floor)")
    ap.add_argument("--split-only", action="store_true", help="of the one-launch settings, only the default")
    ap.add_argument("--phases", type=int, default=1, help="1: also time the split form's phases (prefixes)")
    ap.add_argument("--out", default="moe_block.json")
    a = ap.parse_args()
    cfg, mods = layers(a.layers)
    x = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    outs = [None] * len(mods)

    def chain():  # each layer on the same input (no chaining: the routing stays the same from replay to replay)
        for i, m in enumerate(mods):
            outs[i] = m(x, residual=res)
    floor = read_bytes(cfg) / 4.3e12 * 1e6
    result = {"device": torch.cuda.get_device_name(), "layers": a.layers, "bytes_per_layer": read_bytes(cfg),
              "hbm_floor_us_per_layer": floor, "rows": {}}
    moe_block.ON = False
    base = graph_us(chain, a.reps) / a.layers
    ref = [o.float().clone() for o in outs]
    result["rows"]["composed"] = {"us_per_unit": base}
    print(f"{a.layers} MoE layers, {read_bytes(cfg) / 1e6:.1f} MB each ({floor:.2f} µs at 4.3 TB/s)\n"
          f"composed path: {base:6.2f} µs per layer", flush=True)
    moe_block.ON = True
    default = moe_block.LAUNCH
    tiles = [(default["bn"], default["bi"], default["bl"]), (16, 8, 8), (4, 4, 4)]  # one compile each

    def check() -> dict:
        err = max(float((o.float() - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()) for o, r in zip(outs, ref))
        cnts = [t for m in mods for t in m.__dict__.get("_grid_counters", {}).values()]
        return {"rel_rms": err, "barrier_timed_out": any(int(t[2]) for t in cnts)}
    # the one-launch block (the default first and last: the drift over the sweep), its tiles at 2 and 4 programs
    # per SM; then the split form: the four phases as four launches (kernel boundaries instead of grid barriers)
    settings = [dict(bn=bn, bi=bi, bl=bl, per_sm=ps) for (bn, bi, bl), ps in itertools.product(tiles, (2, 4))]
    # the split form's tiles one phase at a time around its defaults (session 34 on an H100, all phases together:
    # 4 / 4 / 4 23.71 µs, 8 / 8 / 4 25.08, 2 / 4 / 4 31.08, 4 / 4 / 2 26.18, 4 / 2 / 4 29.08; 2 warps or CH 512 slower)
    split = [{}, dict(bn1=8), dict(bn1=2), dict(bn2=8), dict(bn2=2), dict(bn4=8), dict(bn4=2), dict(bi=8),
             dict(bl=8), dict(bn1=8, bn2=8, bn4=8, bi=8)]
    if a.split_only:
        settings = []
    result["rows"].update(launch_sweep(moe_block.LAUNCH, settings, chain, a.reps, a.layers, base, floor, check))
    split0, moe_block.SPLIT = moe_block.SPLIT, True
    print("split into four launches:")
    rows = launch_sweep(moe_block.LAUNCH_SPLIT, split, chain, a.reps, a.layers, base, floor, check)
    result["rows"].update({"split " + k: v for k, v in rows.items()})
    moe_block.SPLIT = split0
    result["rows"].update(launch_sweep(moe_block.LAUNCH, [{}], chain, a.reps, a.layers, base, floor, check))
    if a.phases:  # the split form's phases 1, 1-2, 1-3, 1-4: each phase's time and its bytes' share of it
        result["rows"]["phases"] = phase_times(chain, a.reps, a.layers, cfg)
    if a.floor:  # the same phases and barriers over ≈ 1 % of the bytes: what the block costs besides reading
        tiny, tmods = layers(a.layers, hidden_size=128, routed_expert_hidden_size=64, moe_intermediate_size=64)
        tx = torch.randn(1, 128, device="cuda", dtype=torch.bfloat16)
        touts = [None] * len(tmods)

        def tiny_chain():
            for i, m in enumerate(tmods):
                touts[i] = m(tx, residual=tx)
        row = {"bytes_per_layer": read_bytes(tiny)}
        for name, on, sp in (("composed_us", False, False), ("block_us", True, False), ("split_us", True, True)):
            moe_block.ON, moe_block.SPLIT = on, sp
            row[name] = graph_us(tiny_chain, a.reps) / a.layers
        moe_block.SPLIT = split0
        result["rows"]["latency_floor"] = row
        print(f"latency floor (widths 128 / 64 / 64, {row['bytes_per_layer'] / 1e3:.0f} KB per layer): composed "
              f"{row['composed_us']:.2f} µs, block {row['block_us']:.2f} µs, split block {row['split_us']:.2f} µs "
              "per layer", flush=True)
        if a.phases:
            result["rows"]["latency_floor_phases"] = phase_times(tiny_chain, a.reps, a.layers, tiny)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
