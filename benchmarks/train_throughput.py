"""Training throughput and MFU of a preset (default k3-small on one GPU), per KDA backend, in one run.

One optimizer step = forward + backward (LM + MTP loss) + Per-Head Muon/AdamW step + QK-clip + QB update,
on packed random documents (cu_seqlens), bf16 autocast over fp32 master weights — what `k3 train` does.
Timed with CUDA events after warm-up, median of the timed steps.

MFU = achieved model FLOP/s ÷ peak bf16 dense FLOP/s (H200: 989 TFLOP/s). Model FLOPs per token:
  6·N_act                                  (N_act: activated parameters without the embedding table,
                                            LM head and MTP layers included; K routed experts per MoE layer)
+ Σ_MLA 6·H·(d_qk + d_v)·T̄                (causal attention: QKᵀ and PV, forward 2·, backward 4·,
                                            T̄ = mean attended length ≈ (doc length + 1)/2 over packed docs)
+ Σ_KDA 6·H·(4·K·V + 2·C·(K + V))          (chunked delta rule per token: state read for q and k, the
                                            rank-C state update and the intra-chunk C×C products, C = 64)
Usage:
  python benchmarks/train_throughput.py --out results.json            # GPU: k3-small, backends auto,torch
  python benchmarks/train_throughput.py --smoke                        # CPU: k3-tiny, a few steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3.config import K3Config  # noqa: E402
from k3.info import model_info  # noqa: E402
from k3.model import K3ForConditionalGeneration  # noqa: E402
from k3.train.balance import BalanceController  # noqa: E402
from k3.train.optim import OptimConfig, build_optimizer  # noqa: E402
from k3.train.qkclip import QKClip  # noqa: E402

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
    return {"dense": 6 * n_act, "mla": n_mla * mla, "kda": n_kda * kda,
            "total": 6 * n_act + n_mla * mla + n_kda * kda, "n_act": n_act}


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


def bench_backend(cfg, backend: str, args, device) -> dict:
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(cfg).to(device).train()
    for m in model.modules():
        if hasattr(m, "backend") and type(m).__name__ == "KimiDeltaAttention":
            m.backend = backend
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
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
        batches.append((ids.to(device), cu.to(device)))
        ctx += c / 3

    phases: dict[str, list[float]] = {}

    def mark(name, t0):
        """Phase wall time with a device sync (only in --profile runs, where the sync is the point)."""
        if args.profile:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            phases.setdefault(name, []).append((t - t0) * 1e3)
            return t
        return t0

    def step(i):
        ids, cu = batches[i % len(batches)]
        t = time.perf_counter()
        with amp:
            out = model(ids, labels=ids, cu_seqlens=cu)
        t = mark("forward", t)
        (out.loss + 0.1 * out.mtp_loss).backward()
        t = mark("backward", t)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = mark("optimizer (clip + Muon/AdamW)", t)
        clip.step()
        bal.step()
        mark("QK-clip + QB", t)
        return out.loss

    times = []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
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
    med = statistics.median(times)
    if args.profile and cuda:
        print(f"[{backend}] phases (ms, median, synced): " +
              ", ".join(f"{k} {statistics.median(v[args.warmup:]):.1f}" for k, v in phases.items()), flush=True)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(0)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60),
              flush=True)
    tokens = args.batch * args.seq_len
    f = flops_per_token(cfg, ctx)
    tps = tokens / (med / 1e3)
    peak = PEAK_BF16.get(args.gpu_name, None)
    res = {"backend": backend, "step_ms": med, "tokens_per_s": tps, "model_tflops": f["total"] * tps / 1e12,
           "mfu": (f["total"] * tps / peak) if peak else None, "flops_per_token": f, "mean_ctx": ctx,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mean-doc", type=int, default=2048, help="mean packed document length")
    ap.add_argument("--backends", default="triton,torch,fla", help="KDA backends to compare, in order")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-phase synced times + a torch.profiler kernel table")
    ap.add_argument("--smoke", action="store_true", help="k3-tiny on CPU, 2 steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.seq_len, args.batch, args.mean_doc, args.warmup, args.steps = "k3-tiny", 64, 2, 24, 1, 2
        args.backends = "torch"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.gpu_name = ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        args.gpu_name = next((k for k in PEAK_BF16 if k in name), name)
    cfg = K3Config.preset(args.preset)
    cfg.vision_config = None
    rows = []
    for b in args.backends.split(","):
        r = bench_backend(cfg, b, args, device)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "flops_per_token"}), flush=True)
        if args.out:  # after every backend, so a time limit keeps what was measured
            Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    base = next((r for r in rows if r["backend"] == "torch"), rows[-1])
    print(f"\n{args.preset}  B={args.batch} T={args.seq_len} (packed docs, mean {args.mean_doc})  device={args.gpu_name or 'cpu'}")
    print(f"{'KDA backend':<12}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'vs ' + base['backend']:>12}{'mem GB':>8}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        mem = f"{r['peak_mem_gb']:.1f}" if r["peak_mem_gb"] else "-"
        print(f"{r['backend']:<12}{r['step_ms']:>10.1f}{r['tokens_per_s']:>12,.0f}{r['model_tflops']:>10.1f}{mfu:>8}"
              f"{base['step_ms'] / r['step_ms']:>11.2f}x{mem:>8}")
    f = rows[0]["flops_per_token"]
    print(f"FLOPs/token: 6·N_act {f['dense']:.3e} (N_act {f['n_act']:,}) + MLA {f['mla']:.3e} + KDA {f['kda']:.3e}")


if __name__ == "__main__":
    main()
