"""KDA context parallelism: correctness against one GPU and forward / backward time against CP=1.

GPU (NCCL, one process per GPU):
    torchrun --nproc_per_node=2 benchmarks/kda_cp.py --out kda_cp.json
CPU smoke (spawns 2 gloo processes, tiny sizes, torch backend):
    python benchmarks/kda_cp.py --smoke --out /tmp/kda_cp_smoke.json

Per case (global T tokens, H heads, D = K = V, bf16 q/k/v, fp32 g/β/states as the KDA layer passes them):
  * CP=1: `chunk_kda` on the whole stream (every GPU runs it; it is also the correctness reference);
  * local: `chunk_kda` on T/N tokens alone (the no-communication ideal for CP=N);
  * CP=N: `chunk_kda_cp` on T/N tokens per rank (max over ranks of each rank's median).
Forward is timed with inputs requiring grad (the training forward); fwd+bwd runs autograd.grad of
(o, final state) with random cotangents; bwd = fwd+bwd − fwd. CUDA events, warm-up, median of repeats,
a barrier before every repeat. Correctness: relative RMS error over the global tensors of o, the final
states, dq, dk, dv, dg, dβ and dh0, CP=N against CP=1 with the same backend.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# NVLink multicast stays off (before any process group exists).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from k3.parallel._launch import spawn_gloo  # noqa: E402
from k3.parallel.kda_cp import chunk_kda_cp  # noqa: E402
from k3.ops.kda import chunk_kda, kda_gate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_ms  # noqa: E402

GRADS = ("q", "k", "v", "g", "beta", "h0")


def varlen_cu(T: int) -> list[int]:
    """A packed mix: a short sequence (< one chunk), a boundary at T/4 (rank-aligned for CP=4), one long
    sequence over [T/4, 0.85T) (cut by the CP=2 boundary, spanning ranks for CP=4), tiny tail pieces."""
    cu = [0, 1000, 1063, T // 4, int(0.85 * T), int(0.85 * T) + 5, T - 100, T]
    return sorted(set(c for c in cu if 0 <= c <= T))


def make_inputs(T, H, D, N, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k, v = (r(1, T, H, D).to(dtype) for _ in range(3))
    A_log = torch.linspace(-1.0, 1.5, H, device=device)  # distinct per head
    g = kda_gate(r(1, T, H, D), A_log, 2 * r(H * D))
    beta = torch.sigmoid(r(1, T, H))
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=r(N, H, D, D), do=r(1, T, H, D).to(dtype), dht=r(N, H, D, D))


def timed(fn, warmup, reps, device, barrier):
    """Median milliseconds of fn() after warm-up; with `barrier`, all ranks start each repetition together."""
    return median_ms(fn, warmup, reps, device.type == "cuda", dist.barrier if barrier else None)


def all_ranks_ok(fn, device) -> str | None:
    """Run fn(); None when it succeeded on every rank, else the error (out of memory here or elsewhere)."""
    err = None
    try:
        fn()
    except torch.OutOfMemoryError as e:
        err = "out of memory: " + str(e).splitlines()[0]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = torch.tensor([0.0 if err else 1.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return err or (None if ok.item() == 1 else "out of memory on another rank")


def rel_rmse_global(ref: dict, got: dict, device) -> dict:
    """‖ref − got‖ / ‖ref‖ over the global tensors: token-sliced entries are summed over ranks first."""
    sums = torch.stack([torch.stack([((ref[n].double() - got[n].double()) ** 2).sum(), (ref[n].double() ** 2).sum()])
                        for n in ref])
    shared = sums.clone()
    dist.all_reduce(shared)
    sliced = torch.tensor([n not in ("ht", "h0") for n in ref], device=device)
    sums = torch.where(sliced[:, None], shared, sums).cpu()
    return {n: float((s[0] / s[1].clamp_min(1e-300)).sqrt()) for n, s in zip(ref, sums)}


def run_case(rank, world, args, device, T, varlen):
    H, D, w, r = args.heads, args.dim, args.warmup, args.reps
    if T % world:
        raise SystemExit(f"T={T} is not a multiple of the {world} ranks")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cu_list = varlen_cu(T) if varlen else None
    N = len(cu_list) - 1 if varlen else 1
    row = dict(T=T, varlen=varlen, cu_seqlens=cu_list, heads=H, dim=D, world=world, dtype=str(dtype)[6:])
    x = make_inputs(T, H, D, N, dtype, device, seed=1234 + T)
    cu = None if cu_list is None else torch.tensor(cu_list, device=device)
    Tl = T // world
    a, b = rank * Tl, (rank + 1) * Tl
    kw = dict(use_qk_l2norm_in_kernel=True, backend=args.backend, output_final_state=True)

    def leaves(lo, hi, h0):
        d = {n: x[n][:, lo:hi].detach().clone().requires_grad_() for n in GRADS[:5]}
        return dict(d, h0=h0.detach().clone().requires_grad_())

    def fwd_bwd(fn, lv, do, dht=x["dht"]):
        o, ht = fn(lv)
        return (o, ht) + torch.autograd.grad((o, ht), [lv[n] for n in GRADS], (do, dht))

    def single(lv):  # CP=1 on the whole stream (the reference)
        return chunk_kda(*(lv[n] for n in GRADS[:5]), initial_state=lv["h0"], cu_seqlens=cu, **kw)

    # local-only ideal: this rank's own pieces, no incoming state, no communication
    local_cu = None if not varlen else torch.tensor(sorted({0, Tl} | {c - a for c in cu_list if a < c < b}),
                                                    device=device)

    def local(lv):
        return chunk_kda(*(lv[n] for n in GRADS[:5]), initial_state=lv["h0"], cu_seqlens=local_cu, **kw)

    def cp(lv):
        return chunk_kda_cp(*(lv[n] for n in GRADS[:5]), initial_state=lv["h0"], cu_seqlens=cu,
                            transition=args.transition, **kw)

    ref = {}

    def phase_single():
        full = leaves(0, T, x["h0"])
        o, ht, *grads = fwd_bwd(single, full, x["do"])
        ref.update(o=o[:, a:b].detach().clone(), ht=ht.detach(),
                   **{n: (gr if n == "h0" else gr[:, a:b].clone()) for n, gr in zip(GRADS, grads)})
        del o, ht, grads
        row["cp1_fwd_ms"] = timed(lambda: single(full), w, r, device, False)
        row["cp1_fwdbwd_ms"] = timed(lambda: fwd_bwd(single, full, x["do"]), w, r, device, False)

    def phase_local():
        n_loc = 1 if local_cu is None else local_cu.numel() - 1
        lv = leaves(a, b, x["h0"][:1].expand(n_loc, -1, -1, -1))
        dht = x["dht"][:1].expand(n_loc, -1, -1, -1)
        row["local_fwd_ms"] = timed(lambda: local(lv), w, r, device, False)
        row["local_fwdbwd_ms"] = timed(lambda: fwd_bwd(local, lv, x["do"][:, a:b], dht), w, r, device, False)

    def phase_cp():
        lv = leaves(a, b, x["h0"])
        o, ht, *grads = fwd_bwd(cp, lv, x["do"][:, a:b])
        got = dict(o=o.detach(), ht=ht.detach(), **dict(zip(GRADS, grads)))
        del o, ht
        for n in ("ht", "h0"):  # per-sequence results: each rank holds its share
            got[n] = got[n].clone()
            dist.all_reduce(got[n])
        row["rel_rmse"] = rel_rmse_global(ref, got, device)
        ref.clear()
        t = torch.tensor([timed(lambda: cp(lv), w, r, device, True),
                          timed(lambda: fwd_bwd(cp, lv, x["do"][:, a:b]), w, r, device, True)],
                         dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row["cp_fwd_ms"], row["cp_fwdbwd_ms"] = float(t[0]), float(t[1])

    for phase in (phase_single, phase_local, phase_cp):
        err = all_ranks_ok(phase, device)
        if err:
            row = {k: v for k, v in row.items() if not k.endswith("_ms") and k != "rel_rmse"} | {"error": err}
            break
    else:
        for p in ("cp1", "local", "cp"):
            row[f"{p}_bwd_ms"] = row[f"{p}_fwdbwd_ms"] - row[f"{p}_fwd_ms"]
    ref.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def report(rows, args, world):
    hdr = (f"{'T':>8} {'varlen':>6} | {'CP=1 fwd':>9} {'fwd+bwd':>9} | {'local fwd':>9} {'fwd+bwd':>9} | "
           f"{'CP=' + str(world) + ' fwd':>9} {'fwd+bwd':>9} | {'speedup f/fb':>12} | {'max relRMS':>10} {'worst':>5}")
    lines = [f"KDA CP: H={args.heads} D={args.dim} backend={args.backend} transition={args.transition} "
             f"world={world} (ms, median of {args.reps} after {args.warmup} warm-up)", hdr, "-" * len(hdr)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['T']:>8} {str(r['varlen']):>6} | {r['error']}")
            continue
        worst = max(r["rel_rmse"], key=r["rel_rmse"].get)
        lines.append(
            f"{r['T']:>8} {str(r['varlen']):>6} | {r['cp1_fwd_ms']:9.2f} {r['cp1_fwdbwd_ms']:9.2f} | "
            f"{r['local_fwd_ms']:9.2f} {r['local_fwdbwd_ms']:9.2f} | {r['cp_fwd_ms']:9.2f} {r['cp_fwdbwd_ms']:9.2f} | "
            f"{r['cp1_fwd_ms'] / r['cp_fwd_ms']:5.2f}/{r['cp1_fwdbwd_ms'] / r['cp_fwdbwd_ms']:5.2f}x | "
            f"{r['rel_rmse'][worst]:10.2e} {worst:>5}")
    return "\n".join(lines)


def worker(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rows = []
    for i, T in enumerate(args.T):
        for varlen in ((False, True) if (args.varlen_all or i == 0) and not args.no_varlen else (False,)):
            rows.append(run_case(rank, world, args, device, T, varlen))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    failed = [r for r in rows if "rel_rmse" in r and max(r["rel_rmse"].values()) > args.tol]
    if rank == 0:
        print(report(rows, args, world))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(args={k: v for k, v in vars(args).items()}, world=world, rows=rows,
                               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               torch=torch.__version__, tolerance=args.tol,
                               passed=not failed), f, indent=1)
        print(f"correctness (rel-RMS <= {args.tol:g}): {'PASS' if not failed else 'FAIL'}")
    if failed:
        raise SystemExit(f"rank {rank}: rel-RMS above {args.tol:g} in {len(failed)} case(s)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[65536, 262144], help="global tokens per case")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--backend", default="auto", help="chunk_kda backend (auto = the CUDA default)")
    p.add_argument("--transition", default="auto", choices=("auto", "concat", "separate"),
                   help="how the K x K transition is computed (see chunk_kda_cp)")
    p.add_argument("--no-varlen", action="store_true", help="skip the packed-sequence case")
    p.add_argument("--varlen-all", action="store_true", help="packed case at every T (default: first T only)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tol", type=float, default=8e-3, help="rel-RMS bar for CP=N vs CP=1")
    p.add_argument("--out", default=None, help="JSON output path (written by rank 0)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run on 2 spawned gloo processes")
    p.add_argument("--world", type=int, default=2, help="processes for --smoke")
    args = p.parse_args()
    if args.smoke:
        args.T, args.heads, args.dim, args.backend = [256, 320], 2, 32, "torch"
        args.warmup, args.reps, args.device = 1, 3, "cpu"
        spawn_gloo(worker, args.world, args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("kda_cp benchmark: no CUDA device; use --smoke for the CPU check")
    args.device = "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        worker(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
