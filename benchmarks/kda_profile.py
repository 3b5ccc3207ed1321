"""Per-kernel time breakdown of one KDA call (ours and/or fla), with torch.profiler on CUDA.

Shows where a chunked KDA forward / forward+backward spends its time, kernel by kernel, so kernel work
goes where it pays. Optional launch-parameter variants of ours (`--variants`, JSON list of CFG updates).

    python benchmarks/kda_profile.py --shape 1x8192x96 --impl ours,fla --out prof.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda import Timer, fla_fn, make_inputs, ours_fn  # noqa: E402


def breakdown(fn, reps):
    """{kernel name: mean µs per call} over `reps` calls of fn (after the caller's warm-up)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows[ev.key[:90]] = t / reps
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def recur_steps(shape, specs, reps):
    """Time the forward recurrence kernel alone at chunk sizes BT (sequential steps of BT tokens) on random
    per-chunk inputs of the right shapes: what longer chunks would buy the recurrence, before building the
    intra-chunk kernels they need. specs: list of dicts with BT, fwd_bv, fwd_warps, prefetch, stages."""
    from k3.ops.kda.triton.chunk import _layout, _recur_fwd, cfg_override
    B, T, H = shape
    D = 128
    timer = Timer(True, 3, reps)
    rows = []
    for spec in specs:
        bt = spec["BT"]
        cu, coff, _, cu_host, _, NC = _layout(None, B, T, "cuda", bt)
        r = lambda *s: 0.05 * torch.randn(*s, device="cuda")  # noqa: E731
        parts = (r(B * T, H, D).bfloat16(), r(B * T, H, D).bfloat16(), r(B * T, H, D).bfloat16(),
                 r(B * T, H, D).bfloat16(), r(B * T, H, bt), -r(NC, H, D).abs(), None)  # PRE: no Tb
        with cfg_override(**{k: v for k, v in spec.items() if k != "BT"}):
            try:
                ms = timer(lambda: _recur_fwd(parts, None, cu, coff, len(cu_host) - 1, H, D, D, torch.bfloat16))
            except Exception as e:  # e.g. out of shared memory / registers at this setting
                ms = repr(e)[:200]
        rows.append(dict(spec, ms=ms))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def cpu_profile(fn, reps=50, top=25):
    """Host-side cost of one call: wall µs per call measured on the CPU (after a warm-up, each call synchronised)
    and cProfile's top functions by own time -- the launch overhead that CUDA-event timings include."""
    import cProfile
    import io
    import pstats
    import time
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host_us = (time.perf_counter() - t0) / reps * 1e6  # enqueue only: the GPU runs behind
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        fn()
        torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return {"host_enqueue_us_per_call": host_us, "cprofile": buf.getvalue()}


def focus_lines(out, focus):
    """One line per run: its forward and forward + backward ms, and the µs per call of the kernels whose names
    contain `focus` (in the forward + backward, else the forward)."""
    lines = [f"== {out['shape']}: fwd ms, fwd+bwd ms, µs per call of the kernels with '{focus}'"]
    for run in out["runs"]:
        ks = {k.split("(")[0]: v for part in ("fwd_kernels_us", "fwd+bwd_kernels_us")
              for k, v in run.get(part, {}).items() if focus in k}
        lines.append(f"== {run['impl']} {json.dumps(run['cfg'])}: {run['fwd_ms']:.3f} {run.get('fwd+bwd_ms', 0):.3f} "
                     + " ".join(f"{k}={v:.0f}" for k, v in ks.items()))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1x8192x96", help="BxTxH (D = 128)")
    ap.add_argument("--impl", default="ours")
    ap.add_argument("--variants", default="[]", help='JSON list of CFG updates for ours, e.g. [{"intra_warps": 8}]')
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fwd-only", action="store_true", help="time and break down the forward only")
    ap.add_argument("--out", default="kda_profile.json")
    ap.add_argument("--cpu", action="store_true", help="also profile the host-side cost of our forward (cProfile)")
    ap.add_argument("--recur-steps", default="", help="JSON list of recurrence-only specs (see recur_steps)")
    ap.add_argument("--focus", default="", help="at the end, one line per run: its times and the µs per call of the "
                    "kernels whose names contain this")
    a = ap.parse_args()
    B, T, H = (int(s) for s in a.shape.split("x"))
    if a.recur_steps:
        with open(a.out, "w") as fh:
            json.dump({"shape": a.shape, "recur_steps": recur_steps((B, T, H), json.loads(a.recur_steps), a.reps)},
                      fh, indent=1)
        return
    x = make_inputs(B, T, H, 128, "cuda", torch.bfloat16, seed=7)
    timer = Timer(True, 3, a.reps)
    out = {"shape": a.shape, "runs": []}
    impls = [("ours", ours_fn, {})] if "ours" in a.impl else []
    if "ours" in a.impl:
        impls += [("ours", ours_fn, v) for v in json.loads(a.variants)]
    if "fla" in a.impl:
        impls.append(("fla", fla_fn, {}))
    from k3.ops.kda.triton.chunk import cfg_override
    for name, make, var in impls:
        run = {"impl": name, "cfg": var}
        with cfg_override(**var):
            fwd, _ = make(x, None, False)
            with torch.no_grad():
                run["fwd_ms"] = timer(fwd)
                run["fwd_kernels_us"] = breakdown(fwd, 3)
                if a.cpu and not var:
                    run["fwd_host"] = cpu_profile(fwd)
                    print(run["fwd_host"]["cprofile"], flush=True)
            if not a.fwd_only:
                f2, bwd = make(x, None, True)
                step = lambda: bwd(f2())  # noqa: E731
                run["fwd+bwd_ms"] = timer(step)
                run["fwd+bwd_kernels_us"] = breakdown(step, 3)
        out["runs"].append(run)
        print(json.dumps(run, indent=1), flush=True)
        if a.focus:  # as each run ends: a time limit keeps the lines of the runs before it
            print(focus_lines({"shape": a.shape, "runs": [run]}, a.focus)[1], flush=True)
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    if a.focus:
        print("\n".join(focus_lines(out, a.focus)), flush=True)

if __name__ == "__main__":
    main()
