"""Launch settings of a short extend step's KDA and short-conv kernels (a prefix hit's 64-token tail: one sequence,
4 chunks of 16 tokens, so only 48 intra programs and 24 recurrence programs), at k3-small's shapes (H 12, K = V 128,
bf16 inputs, an fp32 state pool; conv over 3 x 1,536 channels, window 3). Each setting is timed inside a captured
CUDA graph (20 calls per replay, median of 30 replays, µs per call) and checked against the default's output
(relative RMS). Parts:

- `intra`: `kda_intra_fwd_kernel` alone by column block and warps, at the tail's length and at 256 to 32,768 tokens
  (where the short-step settings, `CFG["small_programs"]`, should stop, and where the mid-size band's 128 columns x
  2 warps, `CFG["mid_programs_*"]`, beats the default 32 x 2: the grid runs without either override);
- `recur`: the whole `kda_extend_triton` (intra at its default) by the recurrence's value block and warps;
- `conv`: `short_conv_step` over the tail (`short_conv_extend_kernel`): channels per program, tokens per tile, the
  parts a sequence's tiles are dealt to, warps.

    python benchmarks/probe/kda_small.py [--parts intra recur conv] [--tokens 64] --out kda_small.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import graphed, median_ms  # noqa: E402

from k3.model.paged_cache import token_runs  # noqa: E402
from k3.ops.conv import short_conv_step, triton_step  # noqa: E402
from k3.ops.kda.triton import chunk, kda_extend_triton  # noqa: E402

CALLS = 20


def per_call_us(fn) -> float:
    """µs per call of fn, CALLS calls per graph replay (inf, reported, for a setting that does not run)."""
    try:
        with torch.no_grad():
            return median_ms(graphed(lambda: [fn() for _ in range(CALLS)]), 3, 30) * 1e3 / CALLS
    except Exception as e:  # noqa: BLE001 (a setting that does not compile: reported)
        print(f"   {type(e).__name__}: {str(e)[:120]}")
        return float("inf")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean() / b.pow(2).mean().clamp_min(1e-30)).sqrt().item()


def sweep(name: str, settings: list[dict], apply, fn, out: list, T: int, reset=None) -> None:
    """Time fn under each setting (apply(setting) is a context manager), the first being the default; reset():
    restores what fn updates in place before the checked call (the timed calls run on whatever it holds)."""
    ref = None
    res = []
    for s in settings:
        with apply(s):
            if reset is not None:
                reset()
            y = fn()
            y = y[0] if isinstance(y, tuple) else y
            ref = y.clone() if ref is None else ref
            res.append(dict(part=name, tokens=T, setting=s, us=per_call_us(fn), rel=rel(y, ref)))
    out.extend(res)
    best = sorted(res, key=lambda r: r["us"])[:5]
    print(f"{name} T {T}: default {res[0]['us']:.2f} us; best " + "; ".join(
        f"{r['setting']} {r['us']:.2f} (rel {r['rel']:.1e})" for r in best), flush=True)


class _Dict:
    """Temporarily update a module-level dict of launch settings."""

    def __init__(self, d: dict, s: dict):
        self.d, self.s = d, s

    def __enter__(self):
        self.old = dict(self.d)
        self.d.update(self.s)

    def __exit__(self, *exc):
        self.d.clear()
        self.d.update(self.old)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kda_small.json")
    ap.add_argument("--parts", nargs="*", default=["intra", "recur", "conv"], choices=["intra", "recur", "conv"])
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    H, K, P, dev = 12, 128, 64, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn(P, H, K, K, device=dev, generator=g) * 0.01
    A_log, dtb = torch.randn(H, device=dev, generator=g), torch.randn(H * K, device=dev, generator=g)
    out: list = []

    def inputs(T):
        q, k, f, v = (torch.randn(T, H, K, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
        bl = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0, T], device=dev)
        return q, k, f, v, bl, cu, token_runs(cu, T, 16, first=True)

    cfg = lambda s: chunk.cfg_override(**s)  # noqa: E731
    if "intra" in a.parts:  # the settings as given (no short-step or mid-size override), by length
        for T in (a.tokens, 256, 1024, 2048, 4096, 8192, 16384, 32768):  # 8K: a prefill chunk; 32K: a training batch
            q, k, f, v, bl, cu, (chunks, _) = inputs(T)
            flags = dict(GATE=True, BETA_SIG=True, L2=True)
            NC = chunks.shape[0]

            def intra():
                return chunk._intra_fwd(q, k, v, f, bl, A_log, dtb, chunks, NC, K ** -0.5, -5.0, flags,
                                        pre=T < chunk.FOLD_BELOW_TOKENS)[3]  # kg (Tb folded in when pre)

            grid = [dict(small_programs=0, mid_programs_max=0, intra_kb=kb, intra_warps=w)
                    for kb, w in itertools.product((32, 64, 128), (2, 4, 8))]
            sweep("intra", [{}] + grid, cfg, intra, out, T)
    q, k, f, v, bl, cu, (chunks, coff) = inputs(a.tokens)
    slots = torch.tensor([5], device=dev)
    if "recur" in a.parts:
        def extend():
            return kda_extend_triton(q, k, v, f, bl, A_log, dtb, pool, slots, cu, chunks, coff,
                                     use_qk_l2norm_in_kernel=True)

        grid = [dict(small_programs=0, fwd_bv=bv, fwd_warps=w) for bv, w in
                itertools.product((16, 32, 64), (4, 8))]
        saved = pool.clone()
        sweep("extend", [{}] + grid, cfg, extend, out, a.tokens, reset=lambda: pool.copy_(saved))
    if "conv" in a.parts:
        C, W = 3 * H * K, 4
        x = torch.randn(a.tokens, C, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(C, 1, W, device=dev, generator=g).bfloat16()
        windows = torch.randn(P, C, W - 1, device=dev, generator=g).bfloat16()
        saved_w = windows.clone()

        def conv():
            return short_conv_step(x, w, windows, slots, backend="triton", cu_seqlens=cu)

        base = dict(triton_step.EXTEND_LAUNCH)
        grid = [dict(bc=bc, bt=bt, parts=p, warps=wp) for bc, bt, p, wp in
                itertools.product((16, 32, 64), (16, 32), (1, 8), (2, 4))]
        sweep("conv", [base] + grid, lambda s: _Dict(triton_step.EXTEND_LAUNCH, s), conv, out, a.tokens,
              reset=lambda: windows.copy_(saved_w))
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
