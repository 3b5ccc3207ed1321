"""The optimizer phase of a training step and the per-step controllers: old (reference) vs new, in one run.

Builds a preset (default k3-small on CUDA, k3-tiny on CPU) with fp32 master weights and random gradients, then
times, as the median of --reps calls after --warmup (CUDA events; perf_counter on CPU):

- clip_grad_norm_ (torch's foreach path) and `grad_clip_scale` (its norm and coefficient only: `k3 train` passes the
  coefficient to the fused step, `step(grad_scale=)`, timed after the plain fused step),
- `MuonAdamW.step()` for each --impls: "loop" (the per-parameter reference, today's optimizer), "foreach",
  "fused" (the Triton kernels; CUDA only),
- `QKClip.step()` vs its `_step_reference()` on planted per-head maxima (about half of the heads above τ),
- `BalanceController.observe()` for every MoE layer (one micro-batch of --tokens routed tokens; the old
  bincount / per-check host reads transcribed below as the baseline) and `step()` vs `_step_reference()`.

For each it prints milliseconds, the ratio to the baseline, the number of device kernels (torch.profiler; on
CPU: top-level aten ops) and the number of host syncs (CUDA sync debug mode), and writes JSON with --out.

    python benchmarks/optim_step.py --out optim_step.json          # GPU: k3-small
    python benchmarks/optim_step.py --preset k3-tiny --reps 3      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import median_ms, sync_sites  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.model import K3ForConditionalGeneration  # noqa: E402
from k3.train.balance import BalanceController, qb_margins  # noqa: E402
from k3.train.optim import OptimConfig, build_optimizer, grad_clip_scale, newton_schulz_flops  # noqa: E402
from k3.train.qkclip import QKClip  # noqa: E402


def count_launches(fn, cuda: bool) -> int:
    """Device kernels (and copies / memsets) of one call of fn; on CPU the aten ops not inside another one."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    evs = prof.events()
    if cuda:
        return sum(1 for e in evs if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in evs if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def count_syncs(fn, cuda: bool) -> int | None:
    """Host syncs of one call of fn (CUDA sync debug mode warnings); None on CPU."""
    sites = sync_sites(fn, cuda)
    return None if sites is None else sum(sites.values())


def measure(fn, args, cuda, before=None) -> dict:
    ms = median_ms(fn, args.warmup, args.reps, cuda=cuda, before=before)
    if before:
        before()
    launches = count_launches(fn, cuda)
    if before:
        before()
    return {"ms": ms, "launches": launches, "syncs": count_syncs(fn, cuda)}


def observe_reference(ctl: BalanceController, name: str, topk_idx: torch.Tensor, scores: torch.Tensor,
                      store: dict) -> None:
    """The controller's observe() as first written (bincount loads; histogram range read back from the bias and
    checked per call; bincount counts): the baseline for the new, sync-free observe."""
    mod = ctl.layers[name]
    bias = mod.gate.e_score_correction_bias
    n = bias.numel()
    loads = torch.bincount(topk_idx.reshape(-1), minlength=n).double()
    store["loads"] = loads if "loads" not in store else store["loads"] + loads
    b = bias.detach().double()
    lo, hi = -1.0 - b.max().item(), 1.0 - b.min().item()
    width = (hi - lo) / ctl.bins
    marg = qb_margins(scores, bias, mod.top_k).double()
    if marg.numel() and (marg.min() < lo - 1e-9 or marg.max() > hi + 1e-9):
        raise ValueError("margins outside the histogram range")
    idx = ((marg - lo) / width).floor().long().clamp_(0, ctl.bins - 1)
    flat = idx + torch.arange(n, device=idx.device) * ctl.bins
    counts = torch.bincount(flat.reshape(-1), minlength=n * ctl.bins).view(n, ctl.bins).double()
    store["counts"] = counts if "counts" not in store else store["counts"] + counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help="default: k3-small on CUDA, k3-tiny on CPU")
    ap.add_argument("--device", default=None)
    ap.add_argument("--impls", default=None, help="comma list of loop,foreach,fused (default: all that run here)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=None, help="routed tokens per micro-batch (default 8·4096 / 256)")
    ap.add_argument("--profile", action="store_true", help="CUDA: the top kernels of the last --impls step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    preset = args.preset or ("k3-small" if cuda else "k3-tiny")
    impls = (args.impls or ("loop,foreach,fused" if cuda else "loop,foreach")).split(",")
    tokens = args.tokens or (8 * 4096 if cuda else 256)

    cfg = K3Config.preset(preset)
    cfg.vision_config = None
    torch.manual_seed(0)
    with torch.device(dev):
        model = K3ForConditionalGeneration(cfg).train()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n_params = sum(p.numel() for p in params)
    gpu = torch.cuda.get_device_name(dev) if cuda else "cpu"
    ns_flop = newton_schulz_flops(model)
    print(f"{preset}: {n_params / 1e9:.3f} B parameters ({len(params)} tensors) on {gpu}; Newton–Schulz "
          f"{ns_flop / 1e12:.2f} TFLOP per step; median of {args.reps} after {args.warmup} warm-up")
    rows = []

    def report(phase, impl, r, base=None):
        r = dict(phase=phase, impl=impl, **r)
        r["speedup"] = base["ms"] / r["ms"] if base else None
        rows.append(r)
        sp = f"{r['speedup']:6.2f}x" if r["speedup"] else "   base"
        sy = "-" if r["syncs"] is None else r["syncs"]
        print(f"  {phase:<18} {impl:<10} {r['ms']:10.3f} ms  {sp}  launches {r['launches']:6d}  syncs {sy}")

    # ---- optimizer phase ------------------------------------------------------------------------------------
    clip = measure(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), args, cuda)
    report("clip_grad_norm_", "foreach", clip)
    report("grad_clip_scale", "foreach", measure(lambda: grad_clip_scale(params, 1.0), args, cuda), clip)
    base = None
    for impl in impls:
        opt = build_optimizer(model, OptimConfig(impl=impl))
        r = measure(opt.step, args, cuda)
        report("optimizer.step", impl, r, base)
        base = base or r
        if impl == "fused":  # clipping folded in: the coefficient read by the kernels (what k3 train runs)
            c = grad_clip_scale(params, 1.0)[1]
            report("step(grad_scale)", impl, measure(lambda: opt.step(grad_scale=c), args, cuda), base)
        if args.profile and cuda and impl == impls[-1]:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                opt.step()
                torch.cuda.synchronize()
            rows_k = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                             if e.device_time_total > 0), key=lambda r: -r[1])
            for k, ms, c in rows_k[:12]:
                print(f"      {ms:8.2f} ms {c:5d}x  {k[:100]}")
        del opt
        if cuda:
            torch.cuda.empty_cache()

    # ---- QK-clip -------------------------------------------------------------------------------------------
    clip = QKClip(model, tau=100.0)
    if clip.layers:
        g = torch.Generator().manual_seed(1)
        clip.running = {n: (100.0 * (0.5 + torch.rand(a.num_heads, generator=g))).to(dev)
                        for n, a in clip.layers.items()}
        saved = clip.state_dict()
        restore = lambda: clip.load_state_dict(saved)  # noqa: E731
        r0 = measure(clip._step_reference, args, cuda, restore)
        report("qkclip.step", "reference", r0)
        report("qkclip.step", "new", measure(clip.step, args, cuda, restore), r0)
    clip.remove()

    # ---- balance -------------------------------------------------------------------------------------------
    ctl = BalanceController(model, method="qb")
    if ctl.layers:
        g = torch.Generator().manual_seed(2)
        routing = {}
        for name, mod in ctl.layers.items():
            n = mod.gate.e_score_correction_bias.numel()
            scores = torch.sigmoid(torch.randn(tokens, n, generator=g) + torch.linspace(1, -1, n)).to(dev)
            idx = torch.topk(scores + mod.gate.e_score_correction_bias.float(), mod.top_k, dim=-1).indices
            routing[name] = (idx, scores)

        def observe_new():
            for name, (idx, scores) in routing.items():
                ctl.observe(name, idx, scores)

        def observe_old():
            for name, (idx, scores) in routing.items():
                observe_reference(ctl, name, idx, scores, {})

        r0 = measure(observe_old, args, cuda, ctl._reset)
        report("balance.observe", "reference", r0)
        report("balance.observe", "new", measure(observe_new, args, cuda, ctl._reset), r0)
        ctl._reset()
        observe_new()
        saved = ctl.state_dict()
        restore = lambda: ctl.load_state_dict(saved)  # noqa: E731
        r0 = measure(ctl._step_reference, args, cuda, restore)
        report("balance.step", "reference", r0)
        report("balance.step", "new", measure(ctl.step, args, cuda, restore), r0)
    ctl.remove()

    if args.out:
        Path(args.out).write_text(json.dumps({"preset": preset, "device": gpu, "params": n_params,
                                              "newton_schulz_flop": ns_flop, "tokens": tokens, "rows": rows},
                                             indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
