"""Time k3's Triton KDA kernels against fla 0.6.0 in one run (issue "KDA kernels", list (a)-(e)).

Ours: `chunk_kda_gated_triton` (gate, beta sigmoid and q/k l2norm fused) and `kda_decode_triton`
(state pool, in place). fla: `chunk_kda(..., use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5)`, `chunk_gated_delta_rule` (scalar gate,
the speed floor KDA should approach; forward only) and `fused_recurrent_kda_fwd` with state indices.
bf16, K = V = 128, fresh random inputs per shape, CUDA events after warm-up, median of --reps.
Shapes: (a) B1 T8192 H96; (b) B1 T8192 H64, fixed and varlen [1300,547,2048,963,271,3063] and
1024x8; (c) H12 at T = 8K, 32K, 64K, 128K; (d) B2 T16384 H16; (e) decode, batch 1/32/256/1024 x
H12/H96. Also the bytes floor at (a): q, k, v, g read and o written once at the measured copy rate.

    python benchmarks/kda.py --out kda.json            # GPU, fla installed
    python benchmarks/kda.py --smoke --out smoke.json  # CPU, Triton interpreter, tiny shapes

fla autotunes every kernel on its first call per head count (minutes): --fla-budget-s caps the time
spent on fla (rows after that are marked "not measured"); --deadline-s stops the whole run cleanly.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_ms  # noqa: E402

VARLEN = [1300, 547, 2048, 963, 271, 3063]


def shapes(which, smoke):
    """(name, B, T, H, cu_seqlens list or None) for the chunked rows; decode rows separately."""
    if smoke:
        return [("a-smoke B1 T40 H2", 1, 40, 2, None), ("b-smoke varlen [5,20,15] H2", 1, 40, 2, [0, 5, 25, 40])]
    rows = []
    if "a" in which:
        rows.append(("(a) B1 T8192 H96", 1, 8192, 96, None))
    if "d" in which:
        rows.append(("(d) B2 T16384 H16", 2, 16384, 16, None))
    if "b" in which:
        cu = [0]
        for n in VARLEN:
            cu.append(cu[-1] + n)
        rows += [("(b) B1 T8192 H64", 1, 8192, 64, None),
                 ("(b) H64 varlen [1300,...,3063]", 1, 8192, 64, cu),
                 ("(b) H64 varlen 1024x8", 1, 8192, 64, list(range(0, 8193, 1024)))]
    if "c" in which:
        rows += [(f"(c) B1 T{t // 1024}K H12", 1, t, 12, None) for t in (8192, 32768, 65536, 131072)]
    return rows


def make_inputs(B, T, H, D, dev, dtype, seed):
    gen = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    return dict(q=r(B, T, H, D).to(dtype), k=r(B, T, H, D).to(dtype), v=r(B, T, H, D).to(dtype),
                f=r(B, T, H, D).to(dtype), beta=r(B, T, H).to(dtype),
                A_log=torch.linspace(-1, 1, H, device=dev), dt_bias=0.5 * r(H * D))


class Timer:
    """Median wall time of fn in ms: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, cuda, warmup, reps):
        self.cuda, self.warmup, self.reps = cuda, warmup, reps

    def __call__(self, fn):
        return median_ms(fn, self.warmup, self.reps, self.cuda)


def ours_fn(x, cu, grad):
    from k3.ops.kda.triton import chunk_kda_gated_triton
    names = ("q", "k", "v", "f", "beta", "A_log", "dt_bias")
    leaf = [x[n].detach().requires_grad_(grad) for n in names]
    do = torch.randn_like(x["v"]) if grad else None

    def fwd():
        return chunk_kda_gated_triton(*leaf, cu_seqlens=cu)[0]
    if not grad:
        return fwd, None
    return fwd, lambda o: o.backward(do)


def fla_fn(x, cu, grad, **extra):
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    names = ("q", "k", "v", "f", "beta")
    leaf = [x[n].detach().requires_grad_(grad) for n in names]
    A_log, dt_bias = x["A_log"].detach().requires_grad_(grad), x["dt_bias"].detach().requires_grad_(grad)
    do = torch.randn_like(x["v"]) if grad else None
    cu64 = None if cu is None else cu.long()

    def fwd():
        return fla_chunk_kda(*leaf, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                             lower_bound=-5.0, cu_seqlens=cu64, **extra)[0]
    return fwd, (lambda o: o.backward(do)) if grad else None


def gdn_fwd(x, cu):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    g = torch.nn.functional.logsigmoid(x["f"][..., 0].float())
    cu64 = None if cu is None else cu.long()
    return lambda: chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, torch.sigmoid(x["beta"].float()).to(x["q"].dtype),
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu64)[0]


def time_modes(timer, make, x, cu, modes):
    """{mode: ms} for fwd (no grad), and fwd+bwd / bwd (bwd = fwd+bwd minus a grad-enabled fwd)."""
    res = {}
    if "fwd" in modes:
        fwd, _ = make(x, cu, False)
        with torch.no_grad():
            res["fwd"] = timer(fwd)
    if "fwd+bwd" in modes:
        fwd, bwd = make(x, cu, True)
        res["fwd+bwd"] = timer(lambda: bwd(fwd()))
        res["bwd"] = res["fwd+bwd"] - timer(fwd)
    return res


def copy_rate(dev):
    """Device-to-device copy rate in bytes/s (bytes read + written), the floor's bandwidth."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = Timer(True, 3, 10)(lambda: b.copy_(a))
    return 2 * n / (ms * 1e-3)


def decode_rows(args, timer, dev, dtype, fla_ok, log):
    from k3.ops.kda.triton import kda_decode_triton
    batches, heads = ((1, 4), (2,)) if args.smoke else ((1, 32, 256, 1024), (12, 96))
    D = 16 if args.smoke else 128
    rows = []
    for H in heads:
        for N in batches:
            x = make_inputs(1, N, H, D, dev, dtype, seed=N + H)
            P = 2 * N
            pool = torch.randn(P, H, D, D, device=dev)
            idx = torch.randperm(P, device=dev)[:N]
            cu = torch.arange(N + 1, device=dev, dtype=torch.int32)
            flat = [x[n][0] for n in ("q", "k", "v", "f", "beta")]
            ours = timer(lambda: kda_decode_triton(*flat, pool, state_indices=idx, cu_seqlens=cu,
                                                   use_qk_l2norm_in_kernel=True, A_log=x["A_log"],
                                                   dt_bias=x["dt_bias"], beta_logits=True))
            row = {"shape": f"(e) decode N{N} H{H}", "ours_ms": ours}
            for var in json.loads(os.environ.get("K3_KDA_DECODE_TUNE", "[]")):  # launch settings to compare
                row[f"ours_{var}"] = timer(lambda: kda_decode_triton(
                    *flat, pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, A_log=x["A_log"],
                    dt_bias=x["dt_bias"], beta_logits=True, **var))
            if fla_ok:
                try:
                    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
                    pool2 = pool.clone()
                    row["fla_ms"] = timer(lambda: fused_recurrent_kda_fwd(
                        x["q"], x["k"], x["v"], x["f"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                        initial_state=pool2, output_final_state=True, inplace_final_state=True,
                        cu_seqlens=cu.long(), ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0))
                    row["fla_over_ours"] = row["fla_ms"] / ours
                except Exception as e:  # report, do not hide
                    row["fla_error"] = repr(e)[:200]
            # bytes: the state read and written (fp32) dominates
            row["state_bytes"] = 2 * N * H * D * D * 4
            rows.append(row)
            log(row)
    return rows


# Launch-parameter candidates, tried in order at the first shape; each stage keeps its fastest setting.
SWEEP_FWD = [{}, {"intra_kb": 16, "intra_warps": 2}, {"intra_kb": 32, "intra_warps": 4}, {"fwd_warps": 8}]
SWEEP_BWD = [{}, {"intra_bwd_vb": 128}, {"intra_bwd_warps": 8}, {"intra_bwd_vb": 128, "intra_bwd_warps": 8},
             {"intra_bwd_vb": 32}, {"bwd_prefetch": False}, {"bwd_bv": 32}]
if os.environ.get("K3_KDA_SWEEP") == "short":  # the backward's settings only
    SWEEP_FWD, SWEEP_BWD = [{}], SWEEP_BWD[:4]
ENV = {"fwd_bv": "K3_KDA_FWD_BV", "fwd_warps": "K3_KDA_FWD_WARPS", "intra_warps": "K3_KDA_INTRA_WARPS",
       "intra_kb": "K3_KDA_INTRA_KB", "bwd_bv": "K3_KDA_BWD_BV", "bwd_warps": "K3_KDA_BWD_WARPS",
       "intra_bwd_warps": "K3_KDA_INTRA_BWD_WARPS", "intra_bwd_vb": "K3_KDA_INTRA_BWD_VB",
       "bwd_prefetch": "K3_KDA_BWD_PREFETCH", "save_states": "K3_KDA_SAVE_STATES",
       "prefetch": "K3_KDA_PREFETCH"}


def sweep(timer, shape, D, dev, dtype, log, out_path):
    """Time our kernels under the SWEEP_* launch settings at one shape (forward settings by forward time,
    backward settings by forward+backward time), keep the fastest in CFG and write them as an env file."""
    from k3.ops.kda.triton.chunk import CFG, cfg_override
    name, B, T, H, cu_list = shape
    x = make_inputs(B, T, H, D, dev, dtype, seed=1)
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.int32, device=dev)
    res = []
    for stage, mode in ((SWEEP_FWD, "fwd"), (SWEEP_BWD, "fwd+bwd")):
        best = None
        for var in stage:
            with cfg_override(**var):
                ms = time_modes(timer, ours_fn, x, cu, (mode,))[mode]
            res.append({"variant": var, f"{mode}_ms": ms})
            log(res[-1])
            if best is None or ms < best[0]:
                best = (ms, var)
        CFG.update(best[1])
    log({"chosen": dict(CFG)})
    lines = [f"export {v}={int(CFG[k]) if isinstance(CFG[k], bool) else CFG[k]}" for k, v in ENV.items()]
    with open(os.path.join(os.path.dirname(os.path.abspath(out_path)), "kda_cfg.env"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU through TRITON_INTERPRET=1")
    ap.add_argument("--shapes", default="abcde", help="subset of the issue's list (a)-(e)")
    ap.add_argument("--fla", choices=("all", "decode", "none"), default="all",
                    help="which fla baselines to time (chunked ones autotune for minutes per head count)")
    ap.add_argument("--fla-budget-s", type=float, default=240.0)
    ap.add_argument("--deadline-s", type=float, default=1e9)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--match", default="", help="only the chunked shapes whose name contains this")
    ap.add_argument("--sweep", action="store_true", help="tune our launch parameters at the first shape first")
    ap.add_argument("--split", default="", help="also time ours with sequences cut into this many parallel "
                    "segments (comma list, e.g. 4,8; CFG seq_split), on every chunked shape")
    ap.add_argument("--keep-states", action="store_true", help="also time forward+backward with the forward's "
                    "states kept for the backward: ours with CFG save_states, fla with disable_recompute=True")
    ap.add_argument("--out", default="kda_bench.json")
    a = ap.parse_args()
    t_start = time.time()
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.warmup, a.reps = 1, 2
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = Timer(cuda, a.warmup, a.reps)
    fla_ok = cuda and a.fla != "none"
    if fla_ok:
        try:
            import fla  # noqa: F401
            from fla.ops.kda import chunk_kda  # noqa: F401
        except Exception as e:
            print(f"fla not importable ({e!r}): timing ours only", flush=True)
            fla_ok = False
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import triton
        info["triton"] = triton.__version__
        import fla
        info["fla"] = fla.__version__
    except Exception:
        pass
    out = {"info": info, "rows": [], "decode": []}

    def save():
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=2)

    def log(row):
        print(json.dumps(row), flush=True)
        save()

    fla_spent = 0.0
    D = 16 if a.smoke else 128
    if a.sweep:
        out["sweep"] = sweep(timer, shapes(a.shapes, a.smoke)[0], D, dev, dtype, log, a.out)
    for name, B, T, H, cu_list in shapes(a.shapes, a.smoke):
        if a.match not in name:
            continue
        if time.time() - t_start > a.deadline_s:
            print(f"deadline reached before {name}", flush=True)
            break
        x = make_inputs(B, T, H, D, dev, dtype, seed=T + H)
        cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.int32, device=dev)
        row = {"shape": name}
        for mode, ms in time_modes(timer, ours_fn, x, cu, ("fwd", "fwd+bwd")).items():
            row[f"ours_{mode}_ms"] = ms
        from k3.ops.kda.triton.chunk import cfg_override
        for P in (int(p) for p in a.split.split(",") if p):
            with cfg_override(seq_split=P):
                for mode, ms in time_modes(timer, ours_fn, x, cu, ("fwd", "fwd+bwd")).items():
                    row[f"ours_split{P}_{mode}_ms"] = ms
        if a.keep_states:
            with cfg_override(save_states=True):
                row["ours_keep_fwd+bwd_ms"] = time_modes(timer, ours_fn, x, cu, ("fwd+bwd",))["fwd+bwd"]
        log(row)
        if fla_ok and a.fla == "all" and fla_spent < a.fla_budget_s:
            t0 = time.time()
            try:
                for mode, ms in time_modes(timer, fla_fn, x, cu, ("fwd", "fwd+bwd")).items():
                    row[f"fla_{mode}_ms"] = ms
                    row[f"speedup_{mode}"] = ms / row[f"ours_{mode}_ms"]
                row["gdn_fwd_ms"] = timer(gdn_fwd(x, cu))
                if a.keep_states:
                    keep = lambda x_, cu_, grad: fla_fn(x_, cu_, grad, disable_recompute=True)  # noqa: E731
                    row["fla_keep_fwd+bwd_ms"] = time_modes(timer, keep, x, cu, ("fwd+bwd",))["fwd+bwd"]
            except Exception as e:
                row["fla_error"] = repr(e)[:300]
            fla_spent += time.time() - t0
        elif fla_ok and a.fla == "all":
            row["fla"] = "not measured (fla autotune budget spent)"
        if name.startswith("(a)") or a.smoke:
            nbytes = 5 * B * T * H * D * x["q"].element_size()
            row["floor_bytes"] = nbytes
            if cuda:
                rate = copy_rate(dev)
                row["copy_rate_TBps"] = rate / 1e12
                row["floor_ms"] = nbytes / rate * 1e3
                row["ours_fwd_floor_fraction"] = row["floor_ms"] / row["ours_fwd_ms"]
        out["rows"].append(row)
        log(row)
        del x
    if ("e" in a.shapes or a.smoke) and time.time() - t_start < a.deadline_s:
        out["decode"] = decode_rows(a, timer, dev, dtype, fla_ok, log)
    save()
    print("\n| shape | ours fwd | fla fwd | x | ours fwd+bwd | fla fwd+bwd | x | ours bwd | fla bwd | GDN fwd "
          "| ours keep fwd+bwd | fla keep fwd+bwd |")
    f = lambda r, k: f"{r[k]:.3f}" if k in r else "-"  # noqa: E731
    for r in out["rows"]:
        print(f"| {r['shape']} | {f(r, 'ours_fwd_ms')} | {f(r, 'fla_fwd_ms')} | {f(r, 'speedup_fwd')} | "
              f"{f(r, 'ours_fwd+bwd_ms')} | {f(r, 'fla_fwd+bwd_ms')} | {f(r, 'speedup_fwd+bwd')} | "
              f"{f(r, 'ours_bwd_ms')} | {f(r, 'fla_bwd_ms')} | {f(r, 'gdn_fwd_ms')} | "
              f"{f(r, 'ours_keep_fwd+bwd_ms')} | {f(r, 'fla_keep_fwd+bwd_ms')} |")
    for r in out["decode"]:
        print(f"| {r['shape']} | {f(r, 'ours_ms')} | {f(r, 'fla_ms')} | {f(r, 'fla_over_ours')} |")
    print(f"total {time.time() - t_start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
