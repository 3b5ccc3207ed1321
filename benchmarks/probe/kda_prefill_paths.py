"""The chunked KDA forward of a one-sequence prefill without autograd (k3-small: H 12, K = V 128, bf16, 8,192
tokens, an initial state, states kept every 512 tokens as the engine's prefix cache asks): Tb folded into Aqk
and kg (`pre`) or not, and q, k, v, beta read in place as row slices of the conv / projection outputs or as
contiguous copies made first (the copies timed too). CUDA events, median of 30; outputs against the first.

Then the engine's prefill-graph form captured in a CUDA graph, unsplit and in 2-16 static segments, the
segments' states combined by P - 1 fp32 GEMMs or by one kernel (`combine.py`).

    python benchmarks/probe/kda_prefill_paths.py [--graph-only]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_ms  # noqa: E402

import k3.ops.kda.triton.chunk as CH  # noqa: E402
from k3.ops.kda.triton import chunk_kda_gated_triton  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph-only", action="store_true", help="only the prefill-graph form")
    a = ap.parse_args()
    T, H, K = 8192, 12, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    conv = torch.randn(T, 3 * H * K, device="cuda", generator=g).bfloat16()       # the short conv's output
    proj = torch.randn(T, 6336, device="cuda", generator=g).bfloat16()            # the joined projection
    q, k, v = (t.view(1, T, H, K) for t in conv.split(H * K, -1))
    beta = proj[:, 4 * H * K + K:4 * H * K + K + H].view(1, T, H)
    f = torch.randn(1, T, H, K, device="cuda", generator=g).bfloat16()
    A_log, dtb = torch.randn(H, device="cuda") * 0.3, torch.randn(H * K, device="cuda") * 0.5
    h0 = torch.randn(1, H, K, K, device="cuda") * 0.1
    kw = dict(initial_state=h0, output_final_state=True, states_at=torch.arange(512, T, 512),
              cu_seqlens=torch.tensor([0, T], dtype=torch.int32))
    intra = CH._intra_fwd
    ref = None
    for pre in (() if a.graph_only else (True, False)):
        CH._intra_fwd = lambda *a, pre_=pre, **k_: intra(*a, pre=pre_)
        for inplace in (True, False):
            def run():
                args = (q, k, v, f, beta) if inplace else tuple(t.contiguous() for t in (q, k, v, f, beta))
                with torch.no_grad():
                    return chunk_kda_gated_triton(*args, A_log, dtb, **kw)
            ms = median_ms(run, 5, 30)
            o = run()[0].float()
            ref = o if ref is None else ref
            rel = ((o - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
            how = "in place" if inplace else "copies  "
            print(f"pre {pre!s:5} {how}: {ms * 1e3:7.1f} us  rel {rel:.1e}", flush=True)
    CH._intra_fwd = intra
    in_graph_split(T, H, K, conv, proj, f, A_log, dtb)


def in_graph_split(T, H, K, conv, proj, f, A_log, dtb):
    """The engine's prefill-graph form (`kda_decode_step_gated` with device chunk tables, the state in a pool slot,
    a checkpoint) captured in a CUDA graph, unsplit and cut into P static segments (`CFG["extend_split"]`)."""
    from k3.model.paged_cache import _int32, token_runs
    from k3.ops.kda import kda_decode_step_gated
    from timing import graphed
    q, k, v = (t.view(T, H, K) for t in conv.split(H * K, -1))
    beta = proj[:, 4 * H * K + K:4 * H * K + K + H]
    pool = torch.randn(4, 2, H, K, K, device="cuda") * 0.1
    slots = torch.tensor([2], device="cuda")
    cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
    chunks = _int32(token_runs(cu.long(), T, 16, first=True))
    pos = torch.tensor([T - 512], device="cuda")
    ref = None
    CH.EXTEND_SPLIT_MIN_TOKENS = 1024  # no cap on the segment count below (segments of >= 256 tokens)
    default_kernel = CH.COMBINE_KERNEL
    for P, kernel in [(0, False)] + [(P, kernel) for P in (2, 4, 8, 16) for kernel in (False, True)]:
        CH.COMBINE_KERNEL = kernel
        how = f"{P or 1:2d} segment(s), {'kernel' if kernel else 'GEMMs '}"

        def run():
            with torch.no_grad(), CH.cfg_override(extend_split=P):
                return kda_decode_step_gated(q, k, v, f[0], beta, A_log, dtb, pool[:, 1], slots, -5.0, cu_seqlens=cu,
                                             chunks=chunks, states_at=pos)
        before = pool.clone()
        o = run()[0].float()
        pool.copy_(before)
        ref = o if ref is None else ref
        rel = ((o - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        try:
            ms = median_ms(graphed(run), 5, 30)
        except Exception as e:  # report and go on with the next setting
            print(f"in a graph, {how}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        pool.copy_(before)
        print(f"in a graph, {how}: {ms * 1e3:7.1f} us  rel {rel:.1e}", flush=True)
    CH.COMBINE_KERNEL = default_kernel


if __name__ == "__main__":
    main()
