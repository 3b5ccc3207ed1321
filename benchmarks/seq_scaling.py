"""Time and peak memory of one training forward + backward against sequence length (does cost grow linearly?).

One sequence of T random tokens (one document), LM + 0.1·MTP loss, backward; train mode, the kernels of this
checkout, or of another one with --code DIR (the "before" of a change). Each length runs in its own subprocess,
so a length that runs out of memory (or is killed at the machine's limit) does not end the sweep, and the CPU
peak is the child's own peak resident set size.

    python benchmarks/seq_scaling.py --preset k3-tiny --lengths 1024,2048,4096,8192,16384,32768,65536   # CPU
    python benchmarks/seq_scaling.py --preset k3-small --lengths 8192,16384,32768,65536,131072 --grad-ckpt  # GPU

CPU peak = the child's max RSS (model, optimizer-free: weights and gradients included); GPU peak =
torch.cuda.max_memory_allocated. Time: CPU wall clock of the one step; GPU CUDA events, after one warm-up step
at that length (so Triton / compile warm-up is excluded) when --warmup is set.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--code" in sys.argv:  # before anything imports k3
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))
else:
    sys.path.insert(0, str(ROOT))


def run_one(args) -> dict:
    import torch

    from k3.config import K3Config
    from k3.model import K3ForConditionalGeneration

    dev = torch.device(args.device)
    torch.manual_seed(0)
    cfg = K3Config.preset(args.preset)
    cfg.vision_config = None
    model = K3ForConditionalGeneration(cfg).to(dev).train()
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    T = args.one
    V = cfg.text_config.vocab_size
    ids = torch.randint(0, V - 256, (1, T), generator=torch.Generator().manual_seed(1)).to(dev)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)

    def step():
        with amp:
            out = model(ids, labels=ids, cu_seqlens=cu)
        loss = out.loss + 0.1 * out.mtp_loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    if dev.type == "cuda":
        if args.warmup:
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loss = step()
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e)
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        t0 = time.perf_counter()
        loss = step()
        ms = (time.perf_counter() - t0) * 1e3
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"T": T, "ms": ms, "peak_gib": peak, "base_rss_gib": base_rss, "loss": float(loss),
            "tokens_per_s": T / (ms / 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--code", default=None, help="import k3 from this checkout instead (e.g. an older one: 'before')")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--warmup", action="store_true", help="GPU: one untimed step at each length first")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per length")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--plot", default=None, help="PNG: time and peak memory against T (log-log)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.one is not None:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        cmd = [sys.executable, __file__, "--one", str(T), "--preset", args.preset, "--device", args.device,
               ] + (["--code", args.code] if args.code else []) + (["--grad-ckpt"] if args.grad_ckpt else []) + (["--warmup"] if args.warmup else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ.copy())
            res = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
            if res is None:
                tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
                res = {"T": T, "error": tail[0][:200]}
        except subprocess.TimeoutExpired:
            res = {"T": T, "error": f"timeout after {args.timeout:.0f} s"}
        rows.append(res)
        if "error" in res:
            print(f"T={T:>7}  FAILED: {res['error']}", flush=True)
        else:
            print(f"T={T:>7}  {res['ms']:>10.1f} ms  {res['tokens_per_s']:>9,.0f} tok/s  peak {res['peak_gib']:6.2f} GiB"
                  f"  loss {res['loss']:.3f}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    ok = [r for r in rows if "error" not in r]
    if len(ok) >= 2:
        a, b = ok[-2], ok[-1]
        print(f"last doubling: time x{b['ms'] / a['ms']:.2f}, memory x{b['peak_gib'] / a['peak_gib']:.2f} "
              f"for T x{b['T'] / a['T']:.0f}  (linear: x2)")
    if args.plot and ok:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        Ts = [r["T"] for r in ok]
        ax[0].loglog(Ts, [r["ms"] / 1e3 for r in ok], "o-", label="measured")
        ax[0].loglog(Ts, [ok[0]["ms"] / 1e3 * t / Ts[0] for t in Ts], "k--", lw=0.8, label="linear")
        ax[0].set(xlabel="tokens in the sequence", ylabel="forward + backward (s)")
        ax[1].loglog(Ts, [r["peak_gib"] for r in ok], "o-", label="measured")
        ax[1].set(xlabel="tokens in the sequence", ylabel="peak memory (GiB)")
        for a_ in ax:
            a_.legend()
            a_.grid(True, which="both", alpha=0.3)
        fig.suptitle(f"{args.preset} on {args.device} ({args.code or 'this checkout'}{', grad ckpt' if args.grad_ckpt else ''})")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
