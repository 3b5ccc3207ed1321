"""MoonEP vs the usual all-to-all-v expert-parallel dispatcher, same run, across routing imbalance.

For each E and each target maxvio (max_e T_e / mean T − 1 of the global per-expert counts), routing comes
from lognormal expert popularities p_e = exp(σ·z_e) (z shared by all ranks, seed 1234), each of a token's K
entries drawn independently from p (with replacement, so maxvio up to E − 1 is reachable; without
replacement it would be capped at E/K − 1 = 3 for E = 64, K = 16); σ is solved by bisection in log space
on rank 0 and broadcast. Both methods run forward + backward of the routed-expert part of a LatentMoE
(latent width H, SiTU-GLU experts of width --ffn, bf16) on the same inputs and weights:

- MoonEP (`k3.parallel.moonep`, reference backend): plan, dispatch (all-gathered rows expanded into NvS static
  slots), prefetch (static all-to-all of E/R expert slots), grouped GEMM over 2·E/R groups, combine;
- MoonEP with `prefetch="sparse"`: the same, but prefetch / reduce_grad move only the planned experts;
- naive: counts all-to-all, splits to the host (sync), permute by expert, all_to_all_single with splits,
  regroup by local expert (padded to --padding), grouped GEMM, reverse (Megatron-core / torchtitan style).

Per stage: CUDA events, warm-up, median over --reps, max over ranks. Also received rows, peak memory per
rank, the two outputs' relative difference (the same function), and the planner alone on one GPU
(E = 896, R = 8 and 64, S·K = 131072; eager and CUDA-graph replay).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/moonep.py --out moonep.json --plot moonep.png
    python benchmarks/moonep.py --smoke --out /tmp/moonep_smoke.json   # CPU, 2 gloo processes
"""

from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # NVLink multicast stays off on these machines; set before any process group exists

import argparse
import json
import math
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3.parallel.moonep import MoonEPRuntime, grouped_situ_ffn, plan, plan_counts  # noqa: E402
from timing import graphed  # noqa: E402

TARGETS = (0.2, 1.0, 5.0, 10.0, 20.0)


# ---- timing ---------------------------------------------------------------------------------------------
class Stopwatch:
    """Stage marks: CUDA events on GPU (no sync until `read`), perf_counter on CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self, name: str) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((name, e))
        else:
            self.marks.append((name, time.perf_counter()))

    def read(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return out


def _median_max(samples: list[dict[str, float]], device) -> dict[str, float]:
    """Median over repetitions per stage, then the max over ranks (the slowest rank sets the step)."""
    keys = list(samples[0])
    med = torch.tensor([statistics.median(s[k] for s in samples) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return dict(zip(keys, med.tolist()))


def _max_over_ranks(v: float, device) -> float:
    t = torch.tensor([float(v)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ---- routing with a target imbalance --------------------------------------------------------------------
def popularity(E: int, sigma: float, device) -> torch.Tensor:
    z = torch.randn(E, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    return torch.exp(sigma * z).to(device)


def maxvio(counts: torch.Tensor) -> float:
    c = counts.double()
    return (c.max() / c.mean() - 1).item()


def solve_sigma(target: float, E: int, n: int, device) -> float:
    """Bisection in log σ on [1e-5, 10] until |maxvio − target| ≤ max(0.02·target, 0.005)."""
    g = torch.Generator(device=device)

    def mv(s):
        g.manual_seed(4321)
        idx = torch.multinomial(popularity(E, s, device), n, replacement=True, generator=g)
        return maxvio(torch.bincount(idx, minlength=E))

    lo, hi = math.log(1e-5), math.log(10.0)
    s = math.exp(hi)
    for _ in range(60):
        s = math.exp((lo + hi) / 2)
        m = mv(s)
        if abs(m - target) <= max(0.02 * target, 0.005):
            break
        lo, hi = (math.log(s), hi) if m < target else (lo, math.log(s))
    return s


# ---- the naive all-to-all-v baseline --------------------------------------------------------------------
class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAllV.apply(grad, out_splits, in_splits, ctx.group), None, None, None


def naive_step(x, idx, w, w1, w2, w3, E, R, padding, sw, use_gmm):
    """torchtitan / Megatron-style EP: counts a2a → host splits → permute → a2a-v → regroup → GEMM → back."""
    S, K = idx.shape
    epn, dev = E // R, x.device
    flat = idx.reshape(-1)
    tpe = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    recv_cnt = torch.empty_like(tpe)
    dist.all_to_all_single(recv_cnt, tpe)  # [R(src) · epn]: entries each source sends to my experts
    host = torch.cat([tpe, recv_cnt]).cpu()  # the device-to-host sync of this design
    in_splits = host[:E].view(R, epn).sum(1).tolist()
    rc = host[E:].view(R, epn)
    out_splits = rc.sum(1).tolist()
    n_e = rc.sum(0)
    pad_e = (n_e + padding - 1) // padding * padding
    cu = torch.cumsum(pad_e, 0)
    order = torch.argsort(flat, stable=True)
    sw.mark("plan")
    xs = x.index_select(0, order // K)  # one row per (token, expert) entry, no dedup
    xr = _AllToAllV.apply(xs, out_splits, in_splits, None)
    n = xr.shape[0]
    chunk_e = torch.repeat_interleave(torch.arange(R * epn, device=dev) % epn, rc.reshape(-1).to(dev), output_size=n)
    by_e = torch.argsort(chunk_e, stable=True)
    start_e = (cu - pad_e).to(dev)
    first_of_e = (torch.cumsum(n_e, 0) - n_e).to(dev)
    dest = torch.empty_like(by_e)
    dest[by_e] = start_e[chunk_e[by_e]] + torch.arange(n, device=dev) - first_of_e[chunk_e[by_e]]
    xp = xr.new_zeros(int(cu[-1]) if epn else 0, xr.shape[1]).index_put((dest,), xr)
    sw.mark("dispatch")
    yp = grouped_situ_ffn(xp, cu.to(dev), w1, w2, w3, use_grouped_mm=use_gmm)
    sw.mark("gemm")
    yb = _AllToAllV.apply(yp.index_select(0, dest), in_splits, out_splits, None)
    contrib = yb.float() * w.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros(S, x.shape[1], dtype=torch.float32, device=dev).index_add(0, order // K, contrib).to(x.dtype)
    sw.mark("combine")
    return out, {"recv_rows": n, "gemm_rows": int(cu[-1])}


def moonep_step(rt, x, idx, w, w1, w2, w3, E, sw, use_gmm):
    rp = rt.plan(idx, E)
    sw.mark("plan")
    xs = rt.dispatch(x, rp)
    ws = rt.dispatch_weights(w, rp)
    sw.mark("dispatch")
    W1, W2, W3 = rt.prefetch(rp, w1, w2, w3)
    sw.mark("prefetch")
    y = grouped_situ_ffn(xs, rp.plan.local_cu_seqlens, W1, W2, W3, use_grouped_mm=use_gmm).float() * ws[:, None]
    sw.mark("gemm")
    out = rt.combine(y, rp, x.dtype)
    sw.mark("combine")
    return out, rp


def measure(method, a, ctx) -> dict:
    dev, cuda, R = ctx["device"], ctx["cuda"], ctx["R"]
    x, idx, w, go, W = ctx["x"], ctx["idx"], ctx["w"], ctx["go"], ctx["W"]
    moon = method.startswith("moonep")
    rt = MoonEPRuntime(None, a.padding, "sparse" if method == "moonep_sparse" else "static") if moon else None
    samples, info = [], {}
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for it in range(a.warmup + a.reps):
        for t in (x, w, *W):
            t.grad = None
        dist.barrier()
        sw = Stopwatch(cuda)
        sw.mark("start")
        if moon:
            out, rp = moonep_step(rt, x, idx, w, *W, ctx["E"], sw, ctx["gmm"])
        else:
            out, info = naive_step(x, idx, w, *W, ctx["E"], R, a.padding, sw, ctx["gmm"])
        out.backward(go)
        sw.mark("backward")
        t = sw.read()
        if it >= a.warmup:
            samples.append(t)
    res = _median_max(samples, dev)
    res["total"] = sum(v for k, v in res.items())
    if moon:
        p = rp.plan
        real = int((rp.slot_entry < R * p.S * p.K).sum())
        if real != p.S * p.K:
            raise RuntimeError(f"rank executes {real} real entries, expected S·K = {p.S * p.K}")
        # reduce_grad alone (inside backward above): time it on a fresh fp32 replica buffer
        buf = torch.randn((p.epn,) + tuple(W[0].shape[1:]), dtype=torch.float32, device=dev)
        rs = []
        for i in range(a.warmup + a.reps):
            dist.barrier()
            sw = Stopwatch(cuda)
            sw.mark("s")
            rt.reduce_grad(rp, buf.normal_())
            sw.mark("reduce_grad")
            if i >= a.warmup:
                rs.append(sw.read())
        res.update(_median_max(rs, dev))
        res.update(recv_rows=R * p.S, slot_rows=p.nvs, real_entries=real,
                   remote_experts_max=int(p.remote_stats[:, 0].max()))
    else:
        res.update(recv_rows=int(_max_over_ranks(info["recv_rows"], dev)),
                   gemm_rows=int(_max_over_ranks(info["gemm_rows"], dev)))
    if cuda:
        res["peak_mem_gib"] = _max_over_ranks(torch.cuda.max_memory_allocated() / 2**30, dev)
        res["peak_mem_above_inputs_gib"] = _max_over_ranks((torch.cuda.max_memory_allocated() - base) / 2**30, dev)
    return res, out.detach()


def grouped_mm_works(device) -> bool:
    """torch._grouped_mm forward + backward against the per-group loop on a tiny bf16 case."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(64, 32, device=device, dtype=torch.bfloat16, generator=g)
        ws = [torch.randn(s, device=device, dtype=torch.bfloat16, generator=g).div(6).requires_grad_()
              for s in ((2, 16, 32), (2, 32, 16), (2, 16, 32))]
        cu = torch.tensor([32, 64], device=device)
        a = grouped_situ_ffn(x, cu, *ws, use_grouped_mm=True)
        a.float().square().sum().backward()
        ga = [t.grad.clone() for t in ws]
        for t in ws:
            t.grad = None
        b = grouped_situ_ffn(x, cu, *ws, use_grouped_mm=False)
        b.float().square().sum().backward()
        ok = all(((u.float() - v.float()).norm() / v.float().norm()).item() < 2e-2 for u, v in
                 [(a, b)] + [(t.grad, gg) for t, gg in zip(ws, ga)])
        return bool(ok)
    except Exception as e:  # noqa: BLE001 - any failure means: use the loop
        print(f"torch._grouped_mm unusable ({type(e).__name__}: {e}); using the per-group loop")
        return False


# ---- planner alone --------------------------------------------------------------------------------------
def planner_timing(a, device) -> list[dict]:
    cuda = device.type == "cuda"
    rows = []
    E, S, K = (896, 8192, 16) if not a.smoke else (32, 64, 4)
    for R in ((8, 64) if not a.smoke else (4, 8)):
        g = torch.Generator(device=device).manual_seed(R)
        p = popularity(E, 1.0, device)
        tpe = torch.stack([torch.bincount(torch.multinomial(p, S * K, replacement=True, generator=g), minlength=E)
                           for _ in range(R)])
        idx = torch.multinomial(p, S * K, replacement=True, generator=g).view(S, K)
        tpe[0] = torch.bincount(idx.reshape(-1), minlength=E)
        fns = {"plan_counts[torch]": lambda: plan_counts(tpe.sum(0), R, S * K, backend="torch"),
               "plan[torch]": lambda: plan(idx, tpe, 0, a.padding, backend="torch")}
        if cuda:
            fns.update({"plan_counts[triton]": lambda: plan_counts(tpe.sum(0), R, S * K, backend="triton"),
                        "plan[auto]": lambda: plan(idx, tpe, 0, a.padding)})
        for name, fn in fns.items():
            row = {"E": E, "R": R, "SK": S * K, "fn": name}
            try:
                for _ in range(3):
                    fn()
            except Exception as e:  # noqa: BLE001 - report, keep going
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                continue
            ts = []
            for _ in range(a.reps * 2):
                sw = Stopwatch(cuda)
                sw.mark("a")
                fn()
                sw.mark("eager")
                ts.append(sw.read()["eager"])
            row["eager_us"] = statistics.median(ts) * 1e3
            if cuda:
                try:
                    replay = graphed(fn)
                    ts = []
                    for _ in range(a.reps * 2):
                        sw = Stopwatch(True)
                        sw.mark("a")
                        replay()
                        sw.mark("graph")
                        ts.append(sw.read()["graph"])
                    row["graph_us"] = statistics.median(ts) * 1e3
                except Exception as e:  # noqa: BLE001 - report, keep going
                    row["graph_error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
    return rows


# ---- driver ---------------------------------------------------------------------------------------------
def run(a) -> dict | None:
    rank, R = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    S, H, K, I = a.tokens, a.hidden, a.topk, a.ffn
    gmm = grouped_mm_works(device)
    result = {"config": {"R": R, "S": S, "H": H, "K": K, "ffn": I, "padding": a.padding, "dtype": str(dtype),
                         "warmup": a.warmup, "reps": a.reps, "grouped_mm": gmm, "device":
                         torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__},
              "sweep": []}
    for E in a.experts:
        epn = E // R
        g = torch.Generator(device=device).manual_seed(7777 + rank)
        W = [(torch.randn(s, device=device, generator=g) / math.sqrt(s[-1])).to(dtype).requires_grad_()
             for s in ((epn, I, H), (epn, H, I), (epn, I, H))]
        x = torch.randn(S, H, device=device, generator=g).to(dtype).requires_grad_()
        go = torch.randn(S, H, device=device, generator=g).to(dtype)
        for target in a.targets:
            sig = torch.tensor([solve_sigma(target, E, R * S * K, device) if rank == 0 else 0.0],
                               dtype=torch.float64, device=device)
            dist.broadcast(sig, 0)
            sigma = sig.item()
            gr = torch.Generator(device=device).manual_seed(1000 + rank)
            idx = torch.multinomial(popularity(E, sigma, device), S * K, replacement=True, generator=gr).view(S, K)
            w = (torch.rand(S, K, device=device, generator=gr) + 0.1).requires_grad_()
            tpe = torch.bincount(idx.reshape(-1), minlength=E)
            dist.all_reduce(tpe)
            ctx = dict(device=device, cuda=cuda, R=R, E=E, x=x, idx=idx, w=w, go=go, W=W, gmm=gmm)
            row = {"E": E, "target_maxvio": target, "sigma": sigma, "maxvio": maxvio(tpe),
                   "max_group_entries": int(tpe.view(R, epn).sum(1).max()), "SK": S * K,
                   "planner_auto_equals_torch": torch.equal(plan_counts(tpe, R, S * K),
                                                            plan_counts(tpe, R, S * K, backend="torch"))}
            if not row["planner_auto_equals_torch"]:
                print(f"WARNING: planner backends disagree at E={E}, target {target}", flush=True)
            row["moonep"], out_m = measure("moonep", a, ctx)
            row["moonep_sparse"], _ = measure("moonep_sparse", a, ctx)
            row["naive"], out_n = measure("naive", a, ctx)
            diff = ((out_m.float() - out_n.float()).norm() ** 2).reshape(1)
            ref = (out_n.float().norm() ** 2).reshape(1)
            both = torch.cat([diff, ref]).double()
            dist.all_reduce(both)
            row["rel_diff_outputs"] = math.sqrt(both[0].item() / max(both[1].item(), 1e-30))
            result["sweep"].append(row)
            if rank == 0:
                m, n = row["moonep"], row["naive"]
                print(f"E={E:4d} maxvio {row['maxvio']:6.2f} (σ={sigma:.3f}) | moonep total {m['total']:8.2f} ms "
                      f"(sparse prefetch {row['moonep_sparse']['total']:8.2f}) recv {m['recv_rows']:7d} | "
                      f"naive total {n['total']:8.2f} ms recv {n['recv_rows']:7d} "
                      f"| out diff {row['rel_diff_outputs']:.1e}", flush=True)
        del W, x, go
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    from k3.parallel.moonep.planner import _TRITON
    result["config"]["triton_planner"] = _TRITON["status"]
    if rank == 0:
        result["planner"] = planner_timing(a, device)
    dist.barrier()
    return result if rank == 0 else None


STAGES_M = ["plan", "dispatch", "prefetch", "gemm", "combine", "backward", "total", "reduce_grad"]


def report(res: dict, a) -> None:
    c = res["config"]
    print(f"grouped_mm: {c['grouped_mm']}; MoonEP planner Triton kernel: {c.get('triton_planner')}")
    print(f"\nMoonEP vs naive all-to-all-v: R={c['R']} S={c['S']} H={c['H']} K={c['K']} ffn={c['ffn']} "
          f"padding={c['padding']} {c['dtype']} on {c['device']} (ms, median of {c['reps']}, max over ranks)")
    hdr = "| E | maxvio | method | " + " | ".join(STAGES_M) + " | recv rows | peak GiB |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in res["sweep"]:
        for meth in ("moonep", "moonep_sparse", "naive"):
            m = r[meth]
            vals = " | ".join(f"{m[s]:.2f}" if s in m else "–" for s in STAGES_M)
            print(f"| {r['E']} | {r['maxvio']:.2f} | {meth} | {vals} | {m['recv_rows']} | "
                  f"{m.get('peak_mem_gib', float('nan')):.2f} |")
    print("\nPlanner alone (rank 0):")
    for p in res.get("planner", []):
        if "error" in p:
            print(f"  {p['fn']:20s} E={p['E']} R={p['R']}: failed: {p['error']}")
            continue
        print(f"  {p['fn']:20s} E={p['E']} R={p['R']} S·K={p['SK']}: eager {p['eager_us']:.0f} µs"
              + (f", CUDA graph {p['graph_us']:.0f} µs" if "graph_us" in p else "")
              + (f", graph failed: {p['graph_error']}" if "graph_error" in p else ""))


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for E in sorted({r["E"] for r in res["sweep"]}):
        rows = [r for r in res["sweep"] if r["E"] == E]
        mv = [r["maxvio"] for r in rows]
        for meth, ls in (("moonep", "-"), ("moonep_sparse", "-."), ("naive", "--")):
            axes[0].plot(mv, [r[meth]["total"] for r in rows], ls, marker="o", label=f"{meth} E={E}")
            axes[1].plot(mv, [r[meth]["recv_rows"] for r in rows], ls, marker="o", label=f"{meth} E={E}")
    c = res["config"]
    axes[0].set(xscale="log", xlabel="maxvio", ylabel="fwd + bwd time (ms)",
                title=f"R={c['R']} S={c['S']} H={c['H']} K={c['K']} ffn={c['ffn']}")
    axes[1].set(xscale="log", xlabel="maxvio", ylabel="peak received rows per rank")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _spawned(rank: int, R: int, port: int, a, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(R))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=R)
    try:
        res = run(a)
        if rank == 0:
            q.put(res)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU/gloo run with 2 spawned processes")
    ap.add_argument("--tokens", type=int, default=8192, help="S per rank")
    ap.add_argument("--hidden", type=int, default=3584, help="latent width H")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=512, help="expert FFN width (K3: 3072; smaller to fit time)")
    ap.add_argument("--experts", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--targets", type=float, nargs="+", default=list(TARGETS))
    ap.add_argument("--padding", type=int, default=16, help="per-expert row padding (both methods)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="PNG of time and received rows vs maxvio")
    a = ap.parse_args()
    if a.smoke:
        a.tokens, a.hidden, a.topk, a.ffn, a.experts, a.padding, a.warmup, a.reps = 32, 16, 4, 8, [8, 16], 4, 1, 2
    if "RANK" in os.environ:  # torchrun
        cuda = torch.cuda.is_available() and not a.smoke
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            res = run(a)
        finally:
            dist.destroy_process_group()
    else:
        if not a.smoke:
            sys.exit("launch with torchrun --nproc_per_node=N (or use --smoke for the CPU check)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_spawned, args=(2, port, a, q), nprocs=2)
        res = q.get()
    if res is None:
        return
    report(res, a)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    if a.plot:
        plot(res, a.plot)


if __name__ == "__main__":
    main()
