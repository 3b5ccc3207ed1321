"""Would a persistent decode kernel pay? A batch-1 decode step's dense projections as a chain of one-row GEMVs
(k3-small's shapes in order, 16 layers with their own weights: ≈ 620 MB, far more than L2), three ways:

  graph         the production GEMV (`k3.ops.gemv.triton.gemv`, PDL) one kernel per GEMV, in a CUDA graph;
  persist       ONE kernel of G programs (1, 2 or 4 per SM, a cooperative launch): each GEMV's row tiles are
                shared out, a grid-wide barrier (an atomic counter) separates consecutive GEMVs; a tile is summed
                in one of the forms of `VARIANTS` (chunk by chunk; the production GEMV's pipelined MMA form; the
                whole tile in one load), the table's offsets declared 16-byte aligned or not;
  persist+pf{A} the same, each program prefetching into L2 the tiles it will own A GEMVs later before it waits
                at the barrier (Hopper's `cp.async.bulk.prefetch.L2`: one instruction per contiguous tile).

Every mode's output is checked against an fp32 PyTorch chain (relative RMS error); prints µs per step, µs per
GEMV and the HBM rate, against the bytes' time at 4.3 TB/s. The chain: y_i = W_i x_i, x_{i+1} = y_i[:K_{i+1}].

    python benchmarks/probe/persistent_chain.py --out persistent_chain.json
    TRITON_INTERPRET=1 python benchmarks/probe/persistent_chain.py --check   # CPU: the math (one program), sm_90a build
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graph_us  # noqa: E402

from k3.ops._triton_jit import grid_barrier, grid_done  # noqa: E402

# one KDA + MoE layer of k3-small in decode order ([N, K]): the six projections (q‖k‖v‖f_a‖b‖g padded to 64),
# f_b, o_proj (norm + gate prologue in production), the MoE's joined input (latent down ‖ shared gate ‖ up ‖
# router), the shared experts' down and the latent up projection
LAYER = ((6336, 1536), (1536, 128), (1536, 1536), (2848, 1536), (1536, 1024), (1536, 768))
HBM = 4.3e12  # bytes/s: the H200's bandwidth as `benchmarks/serve.py` counts it


@triton.jit
def prefetch_l2(addr, nbytes):
    """Thread 0 of the program asks the TMA unit to bring `nbytes` (a multiple of 16) at `addr` (a pointer or an
    int64 address, 16-byte aligned) into L2 (`cp.async.bulk.prefetch.L2.global`, sm_90+; not in the interpreter)."""
    tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tile(w_ptr, x_ptr, y_ptr, rows, N, K, BN: tl.constexpr, CH: tl.constexpr, TILE: tl.constexpr,
          KP: tl.constexpr, S: tl.constexpr, IEEE: tl.constexpr):
    """y[rows] = W[rows, :K] · x[:K] for one tile of BN rows, fp32 sums, bf16 out (x read past L1: other programs
    wrote it). TILE 0: CH-column chunks one after another (each load waits for the sum before it); 1: the
    production GEMV's form, x padded to a 16-row MMA tile and W's chunks pipelined over S stages (cp.async into
    shared memory, several chunks in flight; IEEE: its product in fp32, for the CPU interpreter, whose bf16 dot is
    wrong); 2: the whole [BN, K ≤ KP] tile in one load (all of it in flight)."""
    rm = rows < N
    if TILE == 0:
        acc = tl.zeros([BN], tl.float32)
        for c0 in range(0, K, CH):
            cols = c0 + tl.arange(0, CH)
            cm = cols < K
            x = tl.load(x_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=rm[:, None] & cm[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], 1)
    elif TILE == 1:
        m = tl.arange(0, 16)
        acc2 = tl.zeros([16, BN], tl.float32)
        for c0 in tl.range(0, K, CH, num_stages=S):
            cols = c0 + tl.arange(0, CH)
            cm = cols < K
            x = tl.load(x_ptr + m[:, None] * 0 + cols[None, :], mask=(m[:, None] == 0) & cm[None, :], other=0.0,
                        cache_modifier=".cg")
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=rm[:, None] & cm[None, :],
                        other=0.0)
            if IEEE:
                acc2 += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc2 = tl.dot(x, tl.trans(w), acc2)
        acc = tl.sum(tl.where(m[:, None] == 0, acc2, 0.0), 0)
    else:
        cols = tl.arange(0, KP)
        cm = cols < K
        x = tl.load(x_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=rm[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.sum(w * x[None, :], 1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rm)


@triton.jit
def persistent_chain_kernel(w_ptr, act_ptr, tab_ptr, cnt_ptr, L, G, BN: tl.constexpr, CH: tl.constexpr,
                            AHEAD: tl.constexpr, SPINS: tl.constexpr = 1 << 20, TILE: tl.constexpr = 0,
                            KP: tl.constexpr = 2048, S: tl.constexpr = 3, TS: tl.constexpr = 1,
                            IEEE: tl.constexpr = False, ALIGNED: tl.constexpr = True):
    """Program p of G: for GEMV i = 0..L-1 (table row i: weight offset, N, K, input offset, output offset, all in
    elements), tiles p, p+G, … of BN rows; a grid barrier between GEMVs. AHEAD > 0: before each barrier, prefetch
    into L2 the program's tiles of GEMV i+AHEAD (and at the start those of GEMVs 0..AHEAD-1). The last program to
    finish resets the two counters (cnt[0]: barrier arrivals, cnt[1]: finished programs) for the next launch; cnt[2]
    is set if a barrier timed out (`grid_barrier`). TILE, KP, S: `_tile`'s form; TS > 1: the loop over a
    program's tiles pipelined over TS stages (the next tile's loads issued while this one is summed)."""
    p = tl.program_id(0)
    if AHEAD > 0:
        for j in range(0, AHEAD):
            _prefetch_tiles(w_ptr, tab_ptr, j, p, G, L, BN)
    for i in range(0, L):
        # offsets and K are multiples of 8 elements (16 bytes; `build`): saying so lets the loads be 16-byte vectors
        # and the pipeliner use asynchronous copies (without it TILE 1 runs unpipelined)
        wo = tl.load(tab_ptr + 5 * i)
        N = tl.load(tab_ptr + 5 * i + 1)
        K = tl.load(tab_ptr + 5 * i + 2)
        xo = tl.load(tab_ptr + 5 * i + 3)
        yo = tl.load(tab_ptr + 5 * i + 4)
        if ALIGNED:  # (False: what sessions 26-27 measured)
            wo = tl.multiple_of(wo, 8)
            K = tl.multiple_of(K, 8)
            xo = tl.multiple_of(xo, 8)
            yo = tl.multiple_of(yo, 8)
        for t in tl.range(p, tl.cdiv(N, BN), G, num_stages=TS):
            _tile(w_ptr + wo, act_ptr + xo, act_ptr + yo, t * BN + tl.arange(0, BN), N, K, BN, CH, TILE, KP, S, IEEE)
        if AHEAD > 0:
            _prefetch_tiles(w_ptr, tab_ptr, i + AHEAD, p, G, L, BN)
        if i + 1 < L:
            grid_barrier(cnt_ptr, G * (i + 1), SPINS)
    grid_done(cnt_ptr, G)


@triton.jit
def _prefetch_tiles(w_ptr, tab_ptr, i, p, G, L, BN: tl.constexpr):
    if i < L:
        wo = tl.load(tab_ptr + 5 * i)
        N = tl.load(tab_ptr + 5 * i + 1)
        K = tl.load(tab_ptr + 5 * i + 2)
        for t in range(p, tl.cdiv(N, BN), G):
            n = tl.minimum(BN, N - t * BN)
            prefetch_l2(w_ptr + wo + t.to(tl.int64) * BN * K, (n * K * 2).to(tl.int32))


def build(layers: int, device, seed: int = 0, layer=None):
    """`layers` copies of `layer`'s shapes (default `LAYER`) as flat bf16 weights (each GEMV's [N, K] block at a
    16-byte aligned offset), the activation buffer (the input at 0, output i at its own offset), the int64 table;
    also the shapes, the weights' offsets and the activation rows' width."""
    g = torch.Generator().manual_seed(seed)
    sh = [s for _ in range(layers) for s in (layer or LAYER)]
    offs, o = [], 0
    for n, k in sh:
        offs.append(o)
        o += -(-n * k // 8) * 8
    w = torch.empty(o, dtype=torch.bfloat16)
    for (n, k), off in zip(sh, offs):
        w[off:off + n * k] = (torch.randn(n, k, generator=g) / k ** 0.5).flatten().to(torch.bfloat16)
    width = max(n for n, _ in sh)
    act = torch.zeros((len(sh) + 1) * width, dtype=torch.bfloat16)
    x0 = torch.randn(sh[0][1], generator=g).to(torch.bfloat16)
    act[:x0.numel()] = x0
    tab = torch.tensor([[off, n, k, i * width, (i + 1) * width] for i, ((n, k), off) in enumerate(zip(sh, offs))],
                       dtype=torch.int64)
    return w.to(device), act.to(device), tab.flatten().to(device), sh, offs, width


def reference(w, act, sh, offs, width) -> torch.Tensor:
    """The chain in fp32 from the bf16 weights, each output rounded to bf16 as the kernels store it."""
    x = act[:sh[0][1]].float()
    for (n, k), off in zip(sh, offs):
        y = (w[off:off + n * k].float().view(n, k) @ x[:k]).to(torch.bfloat16).float()
        x = y
    return x


def step_error(ws: list[torch.Tensor], ys: list[torch.Tensor], x0: torch.Tensor) -> float:
    """The largest relative RMS error of one GEMV (outputs ys) against the fp32 product of its own bf16 input:
    bf16 rounding alone is ≈ 3e-3; a wrong tile, mask, barrier or prefetch gives O(1)."""
    errs, x = [], x0.view(-1, x0.shape[-1])
    for wt, y in zip(ws, ys):
        y = y.view(-1, wt.shape[0])
        errs.append(rel_rms(y, x[:, :wt.shape[1]].float() @ wt.float().T))
        x = y
    return max(errs)


def persistent_outputs(act, sh, width) -> list[torch.Tensor]:
    return [act[(i + 1) * width:(i + 1) * width + n] for i, (n, _) in enumerate(sh)]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


def run_persistent(w, act, tab, cnt, L, G, BN, CH, ahead, warps=4, **kw):
    persistent_chain_kernel[(G,)](w, act, tab, cnt, L, G, BN=BN, CH=CH, AHEAD=ahead, num_warps=warps, **kw)


# the persistent kernel's forms (`_tile`): name → launch settings (per_sm: programs per SM)
VARIANTS = {
    "serial BN16 unaligned": dict(TILE=0, BN=16, CH=256, warps=4, ALIGNED=False),
    "serial BN16": dict(TILE=0, BN=16, CH=256, warps=4),
    "dot BN16 CH512 s3": dict(TILE=1, BN=16, CH=512, S=3, warps=4),
    "dot BN32 CH256 s3": dict(TILE=1, BN=32, CH=256, S=3, warps=4),
    "dot BN64 CH128 s4": dict(TILE=1, BN=64, CH=128, S=4, warps=4),
    "dot BN16 CH256 s4 w8": dict(TILE=1, BN=16, CH=256, S=4, warps=8),
    "whole BN8 w8": dict(TILE=2, BN=8, CH=256, warps=8),
    "whole BN8 w8 ts2": dict(TILE=2, BN=8, CH=256, warps=8, TS=2),
    "whole BN16 w16": dict(TILE=2, BN=16, CH=256, warps=16),
    "whole BN16 w16 ts2": dict(TILE=2, BN=16, CH=256, warps=16, TS=2),
}


def run_variant(w, act, tab, cnt, L, G, v: dict, ahead: int, **kw):
    v = dict(v)
    BN, CH, warps = v.pop("BN"), v.pop("CH"), v.pop("warps")
    run_persistent(w, act, tab, cnt, L, G, BN, CH, ahead, warps, **{"KP": 2048, **v, **kw})


def run_graph_chain(ws, x0):
    """Production GEMVs, one per weight, on x0's rows (x0 [M, K]: M ≤ 64) → their outputs."""
    from k3.ops.gemv.triton import gemv
    x, ys = x0, []
    for wt in ws:
        x = gemv(x[:, :wt.shape[1]], wt)
        ys.append(x)
    return ys


def check_cpu() -> int:
    """Triton's interpreter (one program: the barrier never waits): the persistent chain against PyTorch."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--check runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    small = ((96, 64), (64, 16), (48, 64), (80, 48), (40, 80), (64, 40))  # the same chaining pattern
    w, act, tab, sh, offs, width = build(2, "cpu", seed=1, layer=small)
    ref = reference(w, act, sh, offs, width)
    cnt = torch.zeros(3, dtype=torch.int32)
    ws = [w[o:o + n * k].view(n, k) for (n, k), o in zip(sh, offs)]
    step = err = 0.0
    for name, v in VARIANTS.items():  # each form at the small shapes: CH 32, whole tiles of KP 128
        act[width:].zero_()
        run_variant(w, act, tab, cnt, len(sh), 1, dict(v, CH=32), 0, KP=128, IEEE=True)
        ys = persistent_outputs(act, sh, width)
        e, st = rel_rms(ys[-1], ref), step_error(ws, ys, act[:sh[0][1]])
        print(f"persistent chain ({name}), one program, {len(sh)} GEMVs: worst GEMV rel. RMS error {st:.1e} (bf16 "
              f"rounding ≈ 3e-3), the chain's end against PyTorch's {e:.1e}; counters {cnt.tolist()} (reset, no "
              f"barrier timed out: [0, 0, 0])")
        step, err = max(step, st), max(err, e)
    more = torch.randn(2, sh[0][1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x0 = torch.cat([act[:sh[0][1]].view(1, -1), more])
    # two programs in the interpreter run one after the other: the first waits at each barrier for the second,
    # which has not started, so every wait must time out and flag it (`grid_barrier`), not hang
    late = torch.zeros(3, dtype=torch.int32)
    run_persistent(w, act.clone(), tab, late, len(sh), 2, 16, 32, 0, SPINS=4)
    print(f"two programs in the interpreter: a barrier timed out and was flagged: {bool(late[2])}")
    gstep = step_error(ws, run_graph_chain(ws, x0), x0)
    print(f"production GEMV chain, 3 rows: worst GEMV rel. RMS error {gstep:.1e}")
    ok = step < 6e-3 and gstep < 6e-3 and err < 0.1 and cnt.tolist() == [0, 0, 0] and bool(late[2])
    return 0 if ok and compiles() else 1


def compiles() -> bool:
    """`--compile` in a process without the interpreter (whose kernels cannot be compiled)."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, os.path.abspath(__file__), "--compile"], env=env).returncode == 0


def compile_sm90() -> int:
    """The GPU-only parts (barrier atomics, the bulk L2 prefetch's inline PTX) compiled for sm_90a by the local
    Triton and ptxas (`scripts/kda_regs.py`'s `report`): registers and spills, or a skip without ptxas."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from kda_regs import PTXAS, report
    if not os.path.exists(PTXAS):
        print(f"sm_90a compile check skipped: no {PTXAS}")
        return 0
    types = dict(w_ptr="*bf16", act_ptr="*bf16", tab_ptr="*i64", cnt_ptr="*i32")
    for name, v in VARIANTS.items():
        v = dict(v)
        warps = v.pop("warps")
        consts = dict(S=3, TS=1, IEEE=False, ALIGNED=True, SPINS=1 << 20, AHEAD=2, KP=2048)
        r = report(persistent_chain_kernel, types, {**consts, **v}, num_warps=warps)
        print(f"sm_90a persistent kernel, {name}, AHEAD 2: {r}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variants", nargs="*", default=[],
                    help=f"persistent forms to time (default all: {list(VARIANTS)})")
    ap.add_argument("--ahead", type=int, nargs="*", default=[2])
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 4], help="persistent programs per SM")
    ap.add_argument("--rows", type=int, nargs="+", default=[1],
                    help="rows of x for the graph modes (1: a batch-1 decode; 64: a prefix hit's tail; the persistent "
                         "kernel takes one)")
    ap.add_argument("--out", default="persistent_chain.json")
    ap.add_argument("--check", action="store_true",
                    help="CPU: the kernels' math in the interpreter, then --compile")
    ap.add_argument("--compile", action="store_true", help="CPU: compile the GPU kernels for sm_90a (no interpreter)")
    a = ap.parse_args()
    if a.check:
        return check_cpu()
    if a.compile:
        return compile_sm90()
    dev = torch.device("cuda")
    w, act, tab, sh, offs, width = build(a.layers, dev)
    ref = reference(w, act, sh, offs, width)
    nbytes = sum(n * k * 2 for n, k in sh)
    floor = nbytes / HBM * 1e6
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = dict(device=torch.cuda.get_device_name(), gemvs=len(sh), weight_bytes=nbytes, hbm_floor_us=floor,
               sms=sms, rows={})
    print(f"{len(sh)} GEMVs, {nbytes / 1e6:.0f} MB of weights: {floor:.1f} µs at 4.3 TB/s; {sms} SMs", flush=True)

    def report(name, fn, outs, x0):
        try:
            act[width:].zero_()
            t = graph_us(fn, a.reps)
            ys = outs()
            # the chain's end (row 0): rounding differences grow along it (≈ 3e-2 over 12 GEMVs)
            err = rel_rms(ys[-1].reshape(-1, sh[-1][0])[0], ref)
            step = step_error(ws, ys, x0)
            row = dict(us=t, us_per_gemv=t / len(sh), tb_s=nbytes / t / 1e6, of_floor=floor / t, end_rel_rms=err,
                       worst_gemv_rel_rms=step, ok=bool(step < 6e-3))
            print(f"{name:24s} {t:8.1f} µs  {t / len(sh):5.2f} µs/GEMV  {nbytes / t / 1e6:5.2f} TB/s  "
                  f"{100 * floor / t:5.1f} % of HBM  end err {err:.1e}  GEMV err {step:.1e}"
                  f"{'' if row['ok'] else '  WRONG'}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            row = dict(error=repr(e)[:600])
            print(f"{name:24s} failed: {e!r}"[:600], flush=True)
        res["rows"][name] = row

    ws = [w[o:o + n * k].view(n, k) for (n, k), o in zip(sh, offs)]
    x1 = act[:sh[0][1]].clone().view(1, -1)
    last = {}
    for rows in a.rows:  # row 0 is the persistent kernel's input, the others fresh random rows
        x0 = torch.cat([x1, torch.randn(rows - 1, x1.shape[1], device=dev).to(x1.dtype)])

        def fn(x0=x0):
            last["ys"] = run_graph_chain(ws, x0)
        report(f"graph M{rows}", fn, lambda: last["ys"], x0)
    cnt = torch.zeros(3, dtype=torch.int32, device=dev)
    out = lambda: persistent_outputs(act, sh, width)  # noqa: E731
    for name, v in VARIANTS.items():
        if a.variants and name not in a.variants:
            continue
        for per_sm in a.per_sm:
            for ahead in [0] + a.ahead:
                G = sms * per_sm
                row = f"persist {name} G{G}" + (f"+pf{ahead}" if ahead else "")
                cnt.zero_()  # in case a run before failed half-way (each launch leaves them at 0 itself)
                # cooperative: the driver refuses a grid that cannot be resident at once (shared memory, registers)
                # instead of its barriers timing out
                report(row, lambda G=G, v=v, ahead=ahead: run_variant(w, act, tab, cnt, len(sh), G, v, ahead,
                                                                      launch_cooperative_grid=True), out, x1)
                if int(cnt[2]):  # a barrier timed out: the row's time and values mean nothing
                    res["rows"][row]["barrier_timed_out"] = True
                    print(f"{row}: a grid barrier TIMED OUT", flush=True)
    # the barrier alone: as many GEMVs of one 16 x 16 tile each (one program works, all wait)
    bw, bact, btab, bsh, _, _ = build(a.layers, dev, layer=((16, 16),) * len(LAYER))
    for per_sm in a.per_sm:
        G = sms * per_sm
        cnt.zero_()
        try:
            t = graph_us(lambda G=G: run_persistent(bw, bact, btab, cnt, len(bsh), G, 16, 16, 0), a.reps)
            res["rows"][f"barrier G{G}"] = dict(us=t, us_per_barrier=t / (len(bsh) - 1))
            name = f"barrier G{G}"
            print(f"{name:24s} {t:8.1f} µs  {t / (len(bsh) - 1):5.2f} µs per grid barrier", flush=True)
        except Exception as e:  # noqa: BLE001
            res["rows"][f"barrier G{G}"] = dict(error=repr(e)[:600])
            print(f"barrier G{G} failed: {e!r}"[:600], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
