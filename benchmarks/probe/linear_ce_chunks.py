"""Fused linear + cross-entropy at the training shape against its row-chunk size (GPU).

k3-small's LM head: N = 32,768 rows (8 x 4,096), D = 1,536, V = 163,840, bf16. Per chunk size: forward +
backward time (CUDA events, median), the GEMM rate it implies (6·N·D·V FLOPs) and the peak memory above the
inputs. Fewer, larger chunks accumulate the fp32 dW [V, D] (1 GiB) fewer times; larger chunks hold a larger
bf16 logits buffer. Then the row pass alone (`ce_rows_triton`, softmax - onehot in place) on one chunk of bf16
logits for launch settings (block_v, num_warps): HBM bytes are 3 passes
over the chunk (read, read, write) or 2 when pass 2 hits L2.
Usage: python benchmarks/probe/linear_ce_chunks.py [--chunks 1024,3200,...] [--rows 6400]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.timing import median_ms  # noqa: E402
from k3.ops.linear_ce import default_chunk_size, linear_cross_entropy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--chunks", default="1024,2048,3200,4096,6400,8192,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--row-chunk", type=int, default=3200, help="rows of the logits chunk in the row-pass sweep")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(a.rows, a.hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, device="cuda", generator=g) * a.hidden ** -0.5).bfloat16().requires_grad_()
    t = torch.randint(0, a.vocab, (a.rows,), device="cuda", generator=g)
    flops = 6 * a.rows * a.hidden * a.vocab
    rows, ref = [], None
    print(f"default chunk: {default_chunk_size(a.vocab, torch.bfloat16)} rows")
    for c in [int(x) for x in a.chunks.split(",")]:
        def step():
            h.grad = w.grad = None
            linear_cross_entropy(h, w, t, chunk_size=c).backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        dh = h.grad.float()
        ref = dh if ref is None else ref
        err = ((dh - ref).norm() / ref.norm()).item()
        ms = median_ms(step, 2, a.reps)
        rows.append(dict(chunk=c, ms=ms, tflops=flops / ms / 1e9, peak_gib=peak, dh_rel_vs_first=err))
        print(f"chunk {c:6d}: {ms:7.2f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  peak +{peak:.2f} GiB  "
              f"dh rel diff vs first {err:.1e}", flush=True)
    del h, w
    from k3.ops.linear_ce.triton import ce_rows_triton
    n = a.row_chunk
    x0 = torch.randn(n, a.vocab, device="cuda", generator=g).bfloat16()
    x, tt, loss = x0.clone(), t[:n], torch.empty(n, device="cuda")
    ref = x0.clone()
    ce_rows_triton(ref, tt, -100, True, loss)
    nbytes = x0.numel() * 2
    sweep = []
    for block, warps in [(4096, 8), (4096, 4), (8192, 8), (8192, 16), (16384, 16), (16384, 32)]:
        def rows_call():
            x.copy_(x0)
            ce_rows_triton(x, tt, -100, True, loss, block_v=block, num_warps=warps)
        rows_call()
        same = torch.equal(x, ref)
        copy_ms = median_ms(lambda: x.copy_(x0), 2, a.reps)
        ms = median_ms(rows_call, 2, a.reps) - copy_ms
        sweep.append(dict(block_v=block, num_warps=warps, ms=ms, equal_to_default=same,
                          tbps_3pass=3 * nbytes / ms / 1e9))
        print(f"rows {n} x {a.vocab}: block {block:5d} warps {warps:2d}: {ms:6.3f} ms "
              f"({3 * nbytes / ms / 1e9:5.2f} TB/s as 3 passes)  same result: {same}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(args=vars(a), rows=rows, rows_sweep=sweep), indent=2))


if __name__ == "__main__":
    main()
