"""Time Block AttnRes: the stacking reference against the fused op (triton and torch backends), in one run.

bf16 sources [B·T, D] (N candidates), fp32 query / norm_weight (as under autocast), CUDA events, median of
--reps after warm-up. Forward alone and forward + backward (every source, query and norm_weight get a
gradient). GB/s is against the bytes the op must move at least: forward N reads + 1 write of [B·T, D];
forward + backward that plus N + 1 reads (sources, dh) and N writes (dv). Also the peak memory above the
inputs of one forward + backward.

--sweep then times the Triton kernels alone, each captured in a CUDA graph (replays: no host work in the
time), over the candidate launch settings `k3.ops.attn_res.triton.SWEEP` (block_r, block_d, num_warps,
num_stages, unroll) and `SWEEP_STREAM` (the one-pass forward: block_r, num_warps, num_stages): forwards against
N reads + 1 write, backward against N + 1 reads + N writes; each setting's outputs are checked against the
block kernels' at their defaults. It prints the best setting per kernel and N, and a `LAUNCH` table (the
setting with the least total time over the N given) to paste at the top of k3/ops/attn_res/triton.py.

    python benchmarks/attn_res.py                          # B·T = 32768, D = 1536, N = 2..6
    python benchmarks/attn_res.py --D 7168 --N 6 10 --out attn_res.json
    python benchmarks/attn_res.py --sweep --N 3 6          # triton launch settings
    python benchmarks/attn_res.py --regs                   # no GPU: registers / spills of every setting, sm_90
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timing import graphed, median_ms  # noqa: E402

from k3.ops.attn_res import attn_res  # noqa: E402
from k3.ops.attn_res.fused import fold_query  # noqa: E402

EPS = 1e-5


def inputs(N, R, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    src = [(torch.randn(R, D, device="cuda", generator=g) * (0.5 + i)).to(dtype).requires_grad_() for i in range(N)]
    query = (0.1 * torch.randn(1, D, device="cuda", generator=g)).requires_grad_()
    norm_w = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).requires_grad_()
    dh = torch.randn(R, D, device="cuda", generator=g).to(dtype)
    return src, query, norm_w, dh


def measure(name, fn, src, query, norm_w, dh, warmup, reps):
    """fwd ms, fwd+bwd ms, peak MiB above the inputs for one fwd+bwd."""
    def fwd():
        with torch.no_grad():
            fn(src, query, norm_w, EPS)

    def both():
        for t in (*src, query, norm_w):
            t.grad = None
        fn(src, query, norm_w, EPS).backward(dh)

    f = median_ms(fwd, warmup, reps)
    b = median_ms(both, warmup, reps)
    for t in (*src, query, norm_w):
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    both()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return dict(method=name, fwd_ms=f, fwd_bwd_ms=b, peak_mib=peak)


def rel_rmse(ref, x):
    ref, x = ref.double(), x.double()
    return ((ref - x).norm() / ref.norm().clamp_min(1e-30)).item()


def sweep(N, src, query, norm_w, dh, unit, warmup, reps):
    """Time attn_res_fwd_triton and attn_res_bwd_triton alone over SWEEP; rows of results."""
    from k3.ops.attn_res import triton as AT
    flat = [s.detach() for s in src]
    w = fold_query(query.detach(), norm_w.detach(), torch.float32)
    base_f = AT.attn_res_fwd_triton(flat, w, EPS, **AT.LAUNCH["fwd"])  # the block kernel
    base_b = AT.attn_res_bwd_triton(flat, w, *base_f[1:], dh, [True] * N, True)
    base_b = [*base_b[0], base_b[1]]
    out = []
    for kind in ("fwd", "bwd"):
        moved = (N + 1) * unit if kind == "fwd" else (2 * N + 1) * unit
        default = tuple(AT.LAUNCH[kind][k] for k in AT.SETTINGS)
        for setting in dict.fromkeys([default, *AT.SWEEP[kind]]):
            cfg = dict(zip(AT.SETTINGS, setting))
            if kind == "fwd":
                fn = lambda cfg=cfg: AT.attn_res_fwd_triton(flat, w, EPS, **cfg)  # noqa: E731
                got, ref = fn(), base_f
            else:
                fn = lambda cfg=cfg: AT.attn_res_bwd_triton(flat, w, *base_f[1:], dh, [True] * N, True,  # noqa: E731
                                                            **cfg)
                got, ref = fn(), base_b
                got = [*got[0], got[1]]
            out.append(_time_setting(kind, N, setting, fn, got, ref, moved, warmup, reps))
    moved = (N + 1) * unit  # the one-pass forward (whole rows, online softmax), against the block kernel's outputs
    default = tuple(AT.LAUNCH_STREAM[k] for k in AT.STREAM_SETTINGS)
    for setting in dict.fromkeys([default, *AT.SWEEP_STREAM]):
        fn = lambda setting=setting: AT.attn_res_fwd_triton(  # noqa: E731
            flat, w, EPS, stream=dict(zip(AT.STREAM_SETTINGS, setting)))
        out.append(_time_setting("stream", N, setting, fn, fn(), base_f, moved, warmup, reps))
    return out


def _time_setting(kind, N, setting, fn, got, ref, moved, warmup, reps):
    err = max(rel_rmse(r, g) for r, g in zip(ref, got))
    ms = median_ms(graphed(fn), warmup, reps)  # replays: no host work (pointer tables, launches) in the time
    r = dict(kind=kind, N=N, setting=setting, ms=ms, gbps=moved / ms / 1e6, err_vs_default=err)
    bad = "  MISMATCH" if err > 1e-2 else ""
    print(f"{N:>3} {kind:<6} {str(setting):<41} {ms:8.3f} {r['gbps']:7.0f} {err:9.1e}{bad}", flush=True)
    return r


def report_sweep(rows):
    """Best setting per kernel and N, and the LAUNCH table of the least total time over every N."""
    from k3.ops.attn_res import triton as AT
    launch = {}
    for kind in ("fwd", "bwd", "stream"):
        mine = [r for r in rows if r["kind"] == kind and r["err_vs_default"] <= 1e-2]
        for N in sorted({r["N"] for r in mine}):
            best = min((r for r in mine if r["N"] == N), key=lambda r: r["ms"])
            print(f"best {kind} N={N}: {best['setting']}  {best['ms']:.3f} ms  {best['gbps']:.0f} GB/s")
        Ns = {r["N"] for r in mine}
        total = {}
        for r in mine:
            total.setdefault(r["setting"], {})[r["N"]] = r["ms"]
        full = {s: sum(v.values()) for s, v in total.items() if set(v) == Ns}
        keys = AT.STREAM_SETTINGS if kind == "stream" else AT.SETTINGS
        launch[kind] = dict(zip(keys, min(full, key=full.get)))
    print("LAUNCH = {")
    for kind, cfg in launch.items():
        print(f'    "{kind}": dict(' + ", ".join(f"{k}={v}" for k, v in cfg.items()) + "),")
    print("}")


def _compile(fn, types, consts, num_warps):
    """`fn` compiled for sm_90a with the installed Triton (no GPU needed; arguments typed by `types`, i32 by
    default, pointers and D 16-divisible), and its registers and (spill store, spill load) bytes by `ptxas -v`
    (as scripts/kda_regs.py)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a == "D" or a.endswith(("_ptr", "_tab"))}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(k.asm["ptx"])
    txt = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", fh.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(fh.name)
    nreg = re.search(r"Used (\d+) registers", txt)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    return k, (nreg.group(1) if nreg else "?"), ((int(spill.group(1)), int(spill.group(2))) if spill else None)


def regs(dtypes, NPs=(2, 4, 8, 16)):
    """Compile the kernels for sm_90a at every LAUNCH / SWEEP / SWEEP_STREAM setting (`_compile`) and print
    registers, spill bytes and shared memory; True if none spills."""
    import triton

    from k3.ops.attn_res import triton as AT
    fp = {n: "*fp32" for n in ("w_ptr", "alpha_ptr", "rstd_ptr", "s_ptr", "c_ptr", "e_ptr", "dwp_ptr")}
    clean = True
    print(f"triton {triton.__version__}, sm_90a")
    for kind, fn in (("fwd", AT.attn_res_fwd_kernel), ("bwd", AT.attn_res_bwd_kernel)):
        default = tuple(AT.LAUNCH[kind][k] for k in AT.SETTINGS)
        for dt in dtypes:
            types = dict(fp, src_tab="*i64", dv_tab="*i64", h_ptr="*" + dt, dh_ptr="*" + dt, eps="fp32",
                         q_ptr="*fp32", nw_ptr="*fp32", out_eps="fp32")
            for NP in NPs:
                for setting in dict.fromkeys([default, *AT.SWEEP[kind]]):
                    BR, BD, W, S, U = setting
                    consts = dict(BR=BR, BD=BD, NP=NP, STAGES=S, UNROLL=U)
                    consts.update(HAS_DW=True) if kind == "bwd" else consts.update(NORM=True, FOLD=True)
                    k, nreg, spill = _compile(fn, types, consts, W)
                    clean &= spill == (0, 0)
                    mark = " (LAUNCH)" if setting == default else ""
                    print(f"{kind} {dt:<4} NP={NP:<2} {str(setting):<21} regs={nreg:>3} "
                          f"spill={spill} smem={k.metadata.shared}{mark}", flush=True)
    fn = AT.attn_res_stream_kernel  # the one-pass forward at D = 1536 (2048 columns) and 7168 (8192), worst flags
    default = tuple(AT.LAUNCH_STREAM[k] for k in AT.STREAM_SETTINGS)
    for dt in dtypes:
        types = dict(fp, src_tab="*i64", h_ptr="*" + dt, q_ptr="*fp32", nw_ptr="*fp32", eps="fp32", out_eps="fp32")
        for D in (1536, 7168):
            for NP in NPs:
                for setting in dict.fromkeys([default, *AT.SWEEP_STREAM]):
                    cfg = AT.stream_config(D, *setting)
                    consts = dict(BR=cfg["block_r"], BD=cfg["block_d"], NP=NP, STAGES=cfg["num_stages"], STATS=True,
                                  NORM=True, FOLD=True)
                    k, nreg, spill = _compile(fn, types, consts, cfg["num_warps"])
                    clean &= spill == (0, 0)
                    mark = " (LAUNCH_STREAM)" if setting == default else ""
                    print(f"stream {dt:<4} D={D} NP={NP:<2} {str(setting):<11} regs={nreg:>3} spill={spill} "
                          f"smem={k.metadata.shared}{mark}", flush=True)
    print("no spills" if clean else "SPILLS (see above)")
    return clean


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32768, help="B*T tokens")
    ap.add_argument("--D", type=int, default=1536)
    ap.add_argument("--N", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time the triton kernels' launch settings (SWEEP)")
    ap.add_argument("--regs", action="store_true", help="only compile every setting for sm_90 (no GPU) with "
                    "--dtype sources and print registers and spills")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    a = ap.parse_args()
    if a.regs:
        sys.exit(0 if regs(({"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[a.dtype],)) else 1)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attn_res.py needs CUDA")
    dtype = getattr(torch, a.dtype)
    el = torch.empty(0, dtype=dtype).element_size()
    methods = [("reference", lambda *x: attn_res(*x, backend="reference")),
               ("torch", lambda *x: attn_res(*x, backend="torch")),
               ("triton", lambda *x: attn_res(*x, backend="triton"))]
    rows, sweep_rows = [], []
    print(f"{torch.cuda.get_device_name()}  rows={a.rows} D={a.D} {a.dtype}  median of {a.reps}")
    print(f"{'N':>3} {'method':<24} {'fwd ms':>8} {'GB/s':>7} {'fwd+bwd ms':>11} {'GB/s':>7} {'x ref':>6} "
          f"{'peak MiB':>9}")
    for N in a.N:
        x = inputs(N, a.rows, a.D, dtype, seed=N)
        unit = a.rows * a.D * el
        fwd_bytes, both_bytes = (N + 1) * unit, (N + 1) * unit + (2 * N + 1) * unit
        ref_both = None
        for name, fn in methods:
            try:
                r = measure(name, fn, *x, a.warmup, a.reps)
            except torch.OutOfMemoryError:
                print(f"{N:>3} {name:<24} out of memory")
                continue
            r.update(N=N, rows=a.rows, D=a.D, dtype=a.dtype, fwd_gbps=fwd_bytes / r["fwd_ms"] / 1e6,
                     fwd_bwd_gbps=both_bytes / r["fwd_bwd_ms"] / 1e6)
            ref_both = ref_both or (r["fwd_bwd_ms"] if name == "reference" else None)
            r["speedup_fwd_bwd"] = ref_both / r["fwd_bwd_ms"] if ref_both else None
            rows.append(r)
            sp = f"{r['speedup_fwd_bwd']:6.2f}" if ref_both else "     -"
            print(f"{N:>3} {name:<24} {r['fwd_ms']:8.3f} {r['fwd_gbps']:7.0f} {r['fwd_bwd_ms']:11.3f} "
                  f"{r['fwd_bwd_gbps']:7.0f} {sp} {r['peak_mib']:9.0f}", flush=True)
        if a.sweep:
            print(f"{'N':>3} {'kern':<4} {'(block_r, block_d, warps, stages, unroll)':<41} {'ms':>8} {'GB/s':>7} "
                  f"{'err':>9}")
            sweep_rows += sweep(N, *x, unit, a.warmup, a.reps)
        del x
        torch.cuda.empty_cache()
    if sweep_rows:
        report_sweep(sweep_rows)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows + sweep_rows, fh, indent=1)


if __name__ == "__main__":
    main()
