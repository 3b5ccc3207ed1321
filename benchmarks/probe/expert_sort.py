"""The MoE dispatch order (`k3.ops.moe.sort_by_expert`) at prefill and training sizes on the GPU: the stable
`torch.sort` path (radix sort, scatter, searchsorted) against the counting sort in blocks (two Triton kernels),
k3-small's 32 experts, top 4. CUDA events, median of 50; the layouts are checked equal.

    python benchmarks/probe/expert_sort.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_ms  # noqa: E402

from k3.ops.moe import sort_by_expert  # noqa: E402
from k3.ops.moe_triton import expert_sort  # noqa: E402


def main():
    E, K = 32, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (1024, 4096, 8192, 32768):
        idx = torch.rand(tokens, E, device="cuda", generator=g).topk(K, dim=-1).indices
        a = sort_by_expert(idx, E, backend="torch")
        b = expert_sort(idx, E, False, one_program=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        t_sort = median_ms(lambda: sort_by_expert(idx, E, backend="torch"), 5, 50)
        t_one = median_ms(lambda: expert_sort(idx, E, False, one_program=True), 5, 50)
        t_blk = median_ms(lambda: expert_sort(idx, E, False, one_program=False), 5, 50)
        print(f"tokens {tokens:6d} x top-{K}: torch.sort path {t_sort * 1e3:7.1f} us, one program "
              f"{t_one * 1e3:7.1f} us, blocks {t_blk * 1e3:7.1f} us ({t_sort / t_blk:.2f}x)")


if __name__ == "__main__":
    main()
