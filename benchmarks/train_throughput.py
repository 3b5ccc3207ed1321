"""Training throughput and MFU of a preset (default k3-small on one GPU), per KDA backend, in one run.

One optimizer step = forward + backward (LM + MTP loss) + Per-Head Muon/AdamW step + QK-clip + QB update,
on packed random documents (cu_seqlens), bf16 autocast over fp32 master weights — what `k3 train` does.
Timed with CUDA events after warm-up, median of the timed steps (each from an empty queue: a sync after every
step), then on a GPU the same steps back to back with no sync between them ("steady", as `k3 train` runs).

MFU = achieved model FLOP/s ÷ peak bf16 dense FLOP/s (H200: 989 TFLOP/s). Model FLOPs per token (the count behind
the MFU targets; the MTP layers' second pass through lm_head, 6·D·V per token, is reported separately):
  6·N_act                                  (N_act: activated parameters without the embedding table,
                                            LM head and MTP layers included; K routed experts per MoE layer)
+ Σ_MLA 6·H·(d_qk + d_v)·T̄                (causal attention: QKᵀ and PV, forward 2·, backward 4·,
                                            T̄ = mean attended length ≈ (doc length + 1)/2 over packed docs)
+ Σ_KDA 6·H·(4·K·V + 2·C·(K + V))          (chunked delta rule per token: state read for q and k, the
                                            rank-C state update and the intra-chunk C×C products, C = 64)
A few extra synced steps give the per-phase breakdown; --profile adds the top GPU kernels of one step. The
"before" of a change is measured by running the older checkout's copy of this script in the same device call
(benchmarks/run_train_gpu.sh).
Usage:
  python benchmarks/train_throughput.py --profile --out r.json                   # GPU: k3-small, 8 x 4096
  python benchmarks/train_throughput.py --batch 16 --grad-ckpt                   # activation checkpointing
  python benchmarks/train_throughput.py --smoke                                  # CPU: k3-tiny, a few steps
  python benchmarks/train_throughput.py --fp8                                    # projections in FP8 (k3.ops.fp8)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3.config import K3Config  # noqa: E402
from k3.info import model_info  # noqa: E402
from k3.model import K3ForConditionalGeneration  # noqa: E402
from k3.ops.varlen import bounds_to  # noqa: E402
from k3.train.balance import BalanceController  # noqa: E402
from k3.train.optim import OptimConfig, build_optimizer, grad_clip_scale  # noqa: E402
from k3.train.qkclip import QKClip  # noqa: E402
from timing import sync_sites  # noqa: E402

PEAK_BF16 = {"H200": 989e12, "H100": 989e12}


def flops_per_token(cfg, mean_ctx: float, chunk: int = 64) -> dict:
    t = cfg.text_config
    n_act = model_info(cfg)["active_params"] + mtp_active_params(cfg)  # embedding table already excluded
    la = t.linear_attn_config
    n_kda = sum(t.is_kda_layer(i) for i in range(t.num_hidden_layers))
    n_mla = t.num_hidden_layers - n_kda + t.num_nextn_predict_layers
    mla = 6 * t.num_attention_heads * (t.qk_nope_head_dim + t.qk_rope_head_dim + t.v_head_dim) * mean_ctx
    K = V = la.head_dim
    kda = 6 * la.num_heads * (4 * K * V + 2 * chunk * (K + V))
    # the MTP layers reuse lm_head: their logits are a second LM-head GEMM per token that 6·N_act (each parameter
    # counted once) leaves out. Reported beside the MFU, not inside it.
    mtp_head = 6 * t.hidden_size * t.vocab_size * t.num_nextn_predict_layers
    return {"dense": 6 * n_act, "mla": n_mla * mla, "kda": n_kda * kda,
            "total": 6 * n_act + n_mla * mla + n_kda * kda, "n_act": n_act, "mtp_head": mtp_head}


def mtp_active_params(cfg) -> int:
    """Parameters of the MTP layers a token passes through (K of the routed experts)."""
    t = cfg.text_config
    with torch.device("meta"):
        m = K3ForConditionalGeneration(cfg, init=False)
    total = 0
    for layer in m.language_model.model.mtp_layers:
        for name, p in layer.named_parameters():
            n = p.numel()
            if ".experts." in name or name.startswith("block_sparse_moe.experts"):
                n = n * t.num_experts_per_token // t.num_experts
            total += n
    return total


def random_docs(batch: int, seq: int, mean_doc: int, gen: torch.Generator) -> tuple[torch.Tensor, float]:
    """cu_seqlens over batch rows of seq tokens cut into exponential-length documents, and the mean
    attended context length T̄ (per token, (position in doc + 1) averaged)."""
    cuts, ctx, n = [0], 0.0, 0
    for r in range(batch):
        pos = 0
        while pos < seq:
            L = min(seq - pos, max(16, int(torch.empty(1).exponential_(1 / mean_doc, generator=gen).item())))
            pos += L
            cuts.append(r * seq + pos)
            ctx += L * (L + 1) / 2
            n += L
    return torch.tensor(cuts, dtype=torch.int32), ctx / n


def bench(cfg, args, device) -> dict:
    """One configuration: build, warm up, time `args.steps` optimizer steps (median), optionally profile."""
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(cfg).to(device).train()
    for m in model.modules():
        if type(m).__name__ == "KimiDeltaAttention":
            m.backend = args.kda_backend
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    if args.fp8:
        from k3.ops.fp8 import convert_to_float8_training
        print(f"fp8: {convert_to_float8_training(model)} projections converted", flush=True)
    if args.compile:  # regional compile: each decoder layer's body (one compiled graph per layer kind)
        torch._dynamo.config.cache_size_limit = 64
        for m in model.modules():
            if type(m).__name__ in ("KimiDecoderLayer", "MTPLayer") and hasattr(m, "forward_attn_res"):
                m.forward_attn_res = torch.compile(m.forward_attn_res, dynamic=False)
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    clip = QKClip(model, 100.0)
    bal = BalanceController(model, method="qb")
    gen = torch.Generator().manual_seed(0)
    V = cfg.text_config.vocab_size
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    batches = []
    ctx = 0.0
    for _ in range(3):
        cu, c = random_docs(args.batch, args.seq_len, args.mean_doc, gen)
        ids = torch.randint(0, V - 256, (args.batch, args.seq_len), generator=gen)
        batches.append((ids.to(device), bounds_to(cu, device)))  # as k3 train: cu's host values kept
        ctx += c / 3

    phases: dict[str, list[float]] = {}
    host: dict[str, list[float]] = {}  # the timed steps' host time to issue each phase (no sync)
    cuda = device.type == "cuda"

    def mark(name, t0, sync):
        """Phase wall time with a device sync (the phase-timing steps, where the sync is the point); without, the
        host's time to issue the phase: a phase whose issue time nears its GPU time is host-bound."""
        if sync and cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        (phases if sync else host).setdefault(name, []).append((t - t0) * 1e3)
        return t

    def step(i, sync=False, host_prof=None):
        ids, cu = batches[i % len(batches)]
        rf = torch.profiler.record_function  # phase ranges for --trace (no cost outside a profiler)
        t = time.perf_counter()
        if host_prof is not None:
            host_prof.enable()
        with rf("phase:forward"), amp:
            out = model(ids, labels=ids, cu_seqlens=cu)
        if host_prof is not None:
            host_prof.disable()
        t = mark("forward", t, sync)
        with rf("phase:backward"):
            (out.loss + 0.1 * out.mtp_loss).backward()
        t = mark("backward", t, sync)
        with rf("phase:optimizer"):
            if args.clip == "fold":  # the trainer's way: the coefficient applied inside the optimizer's kernels
                opt.step(grad_scale=grad_clip_scale(model.parameters(), 1.0)[1])
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            opt.zero_grad(set_to_none=True)
        t = mark("optimizer", t, sync)
        with rf("phase:qk-clip+qb"):
            if args.stats != "off":
                clip.step(sync=args.stats == "sync")
                bal.step(sync=args.stats == "sync")
        mark("qk-clip+qb", t, sync)
        return out.loss

    times = []
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup + args.steps):
            if cuda and i == args.warmup:
                alloc0 = allocator_counts()
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                step(i)
                e.record()
                torch.cuda.synchronize()
                ms = s.elapsed_time(e)
            else:
                t0 = time.perf_counter()
                step(i)
                ms = (time.perf_counter() - t0) * 1e3
            if i >= args.warmup:
                times.append(ms)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        alloc = ({k: v - alloc0[k] for k, v in allocator_counts().items()} if cuda and args.steps else None)
        steady = steady_steps(step, args.steps) if cuda and args.steady else None
        syncs = sync_sites(lambda: step(0), cuda) if args.sync_audit else None
        host_fwd = host_profile(lambda prof: step(0, host_prof=prof), args.host_profile) if args.host_profile else None
        for i in range(args.phase_steps):  # synced phase times (separate steps: the syncs cost a little)
            step(i, sync=True)
    except torch.OutOfMemoryError as e:
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
        return {"label": args.label, "error": "out of memory: " + str(e).split("\n")[0][:160]}
    kernels = None
    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.trace else [])
        with profile(activities=acts, record_shapes=bool(args.trace)) as prof:
            step(0)
            torch.cuda.synchronize()
        kernels = top_kernels(prof, args.top)
        if args.trace:  # a Chrome trace for benchmarks/probe/trace_breakdown.py (per phase, per op and shape)
            prof.export_chrome_trace(args.trace)
    med = statistics.median(times)
    tokens = args.batch * args.seq_len
    f = flops_per_token(cfg, ctx)
    tps = tokens / (med / 1e3)
    peak_flops = PEAK_BF16.get(args.gpu_name, None)
    res = {"label": args.label, "batch": args.batch, "seq_len": args.seq_len, "grad_ckpt": args.grad_ckpt,
           "compile": args.compile, "fp8": args.fp8, "stats": args.stats,
           "step_ms": med, "step_ms_all": times, "steady_step_ms": steady,
           "steady_mfu": (f["total"] * tokens / (steady / 1e3) / peak_flops) if steady and peak_flops else None,
           "tokens_per_s": tps, "model_tflops": f["total"] * tps / 1e12,
           "mfu": (f["total"] * tps / peak_flops) if peak_flops else None,
           "mfu_with_mtp_head": ((f["total"] + f["mtp_head"]) * tps / peak_flops) if peak_flops else None,
           "flops_per_token": f, "mean_ctx": ctx,
           "peak_mem_gib": peak,
           "phases_ms": {k: statistics.median(v) for k, v in phases.items()},
           "host_issue_ms": {k: statistics.median(v[args.warmup:args.warmup + args.steps] or v)
                             for k, v in host.items()},
           "syncs": syncs, "allocator": alloc, "top_kernels": kernels, "host_forward_profile": host_fwd}
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return res


def steady_steps(step, n: int) -> float | None:
    """Median step time with no host sync between steps, as `k3 train` runs: an event at each step boundary, one
    sync after the last. The host issues step i+1 while the GPU still runs step i, so a forward whose host issue
    outruns its GPU work (the layer stack) no longer idles the GPU whenever the previous step left enough queued."""
    if n < 1:
        return None
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        step(i)
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(ev, ev[1:]))


def allocator_counts() -> dict[str, int]:
    """The caching allocator's counters that mean device-wide waits: cudaMalloc / cudaFree calls (a cudaFree
    synchronises the device) and the retries that free the cache to satisfy an allocation. Over the timed steps
    they should not move; if they do, the host stalls inside the forward where no sync shows in the audit."""
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                            "num_sync_all_streams")}


def host_profile(run, n: int) -> str:
    """The host's Python time in one training forward (cProfile around the model call; the GPU runs as usual),
    as pstats text: the top n functions by own time, then by cumulative time. Where the forward's layer stack
    issues kernels more slowly than the GPU runs them, this is what to cut."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    run(prof)
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).strip_dirs()
    st.sort_stats("tottime").print_stats(n)
    st.sort_stats("cumulative").print_stats(n)
    return buf.getvalue()


def top_kernels(prof, n: int) -> dict:
    """GPU time per kernel name over one profiled step: the top n, their share, and the launch count."""
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total = sum(r[1] for r in rows)
    rows.sort(key=lambda r: -r[1])
    return {"gpu_ms": total, "launches": sum(r[2] for r in rows),
            "top": [{"name": k[:90], "ms": ms, "share": ms / total, "calls": c} for k, ms, c in rows[:n]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mean-doc", type=int, default=2048, help="mean packed document length")
    ap.add_argument("--label", default="", help="a name for this configuration in the output")
    ap.add_argument("--kda-backend", default="auto", help="KDA backend of every layer (auto, triton, fla, torch)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--phase-steps", type=int, default=2, help="extra synced steps for the per-phase breakdown")
    ap.add_argument("--steady", action=argparse.BooleanOptionalAction, default=True,
                    help="also time --steps steps back to back without a sync between them (as k3 train runs)")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--fp8", action="store_true", default=os.environ.get("K3_FP8", "0") == "1",
                    help="projections as row-wise FP8 GEMMs (k3.ops.fp8; default from K3_FP8=1)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (regional compile)")
    ap.add_argument("--clip", choices=("fold", "torch"), default="fold",
                    help="gradient clipping: folded into the optimizer step (as k3 train) or clip_grad_norm_ first")
    ap.add_argument("--stats", choices=("sync", "async", "off"), default=os.environ.get("K3_BENCH_STATS", "async"),
                    help="QK-clip and QB after the step: as k3 train (async: their statistics stay on the device, "
                         "the trainer reads them with the next step's one sync), each reading its statistics back "
                         "(sync: one host sync each, k3 train before 2026-12-05), or not at all (off: what they "
                         "cost, an upper bound); default from K3_BENCH_STATS")
    ap.add_argument("--sync-audit", action="store_true",
                    help="list one step's host syncs by source line (CUDA sync debug mode)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="cProfile the host side of one training forward and print its top N functions")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler kernel table of one step")
    ap.add_argument("--trace", default=None, help="with --profile: also write a Chrome trace (CPU ops with shapes)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by --profile")
    ap.add_argument("--smoke", action="store_true", help="k3-tiny on CPU, 2 steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.seq_len, args.batch, args.mean_doc, args.warmup, args.steps = "k3-tiny", 64, 2, 24, 1, 2
        args.phase_steps = 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.gpu_name = ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        args.gpu_name = next((k for k in PEAK_BF16 if k in name), name)
    cfg = K3Config.preset(args.preset)
    cfg.vision_config = None
    r = bench(cfg, args, device)
    print(json.dumps({k: v for k, v in r.items()
                      if k not in ("flops_per_token", "top_kernels", "step_ms_all", "host_forward_profile")}),
          flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": [r]}, indent=2))
    print(f"\n{args.preset}  B={args.batch} T={args.seq_len} (packed docs, mean {args.mean_doc})"
          f"{'  grad ckpt' if args.grad_ckpt else ''}  device={args.gpu_name or 'cpu'}  [{args.label}]")
    if "error" in r:
        print(r["error"])
        return
    if r.get("top_kernels"):
        tk = r["top_kernels"]
        print(f"GPU busy {tk['gpu_ms']:.1f} ms in {tk['launches']} launches; top kernels:")
        for k in tk["top"]:
            print(f"  {k['ms']:8.2f} ms {100 * k['share']:5.1f} % {k['calls']:6d}x  {k['name']}")
    mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] else "-"
    mem = f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] else "-"
    print(f"step {r['step_ms']:.1f} ms  {r['tokens_per_s']:,.0f} tokens/s  {r['model_tflops']:.1f} TFLOP/s  MFU {mfu}"
          f"  peak {mem}")
    if r.get("steady_step_ms"):
        sm = f"{100 * r['steady_mfu']:.1f} %" if r["steady_mfu"] else "-"
        print(f"steady step {r['steady_step_ms']:.1f} ms  "
              f"{args.batch * args.seq_len / (r['steady_step_ms'] / 1e3):,.0f} tokens/s  MFU {sm}  "
              "(no sync between steps, as k3 train runs)")
    print("phases (ms, synced): " + ", ".join(f"{k} {v:.1f}" for k, v in r["phases_ms"].items()))
    print("host time to issue each phase (ms, timed steps): "
          + ", ".join(f"{k} {v:.1f}" for k, v in r["host_issue_ms"].items()))
    if r.get("allocator"):
        print("allocator over the timed steps: " + ", ".join(f"{k} {v}" for k, v in r["allocator"].items()))
    if r.get("host_forward_profile"):
        print("host profile of one forward (cProfile):\n" + r["host_forward_profile"])
    if r["syncs"] is not None:
        print(f"host syncs in one step: {sum(r['syncs'].values())}"
              + "".join(f"\n  {n:4d}  {k}" for k, n in r["syncs"].items()))
    f = r["flops_per_token"]
    print(f"FLOPs/token: 6·N_act {f['dense']:.3e} (N_act {f['n_act']:,}) + MLA {f['mla']:.3e} + KDA {f['kda']:.3e}")
    if r["mfu_with_mtp_head"]:
        print(f"(not in that count: the MTP head's second LM-head GEMM, {f['mtp_head']:.3e} FLOPs/token; with it, "
              f"MFU {100 * r['mfu_with_mtp_head']:.1f} %)")


if __name__ == "__main__":
    main()
