"""`apply_page_ops`' Triton kernel (see `page_ops.py`): PROGRAMS programs, each taking every PROGRAMS-th block of
BLOCK words of every segment in turn; the segment count is read first, so a table with none (most steps) costs one
scalar load per program."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import pdl, runs_on
from ._triton_jit import pdl_sync

BLOCK, PROGRAMS = 1024, 264  # words per load (8 KB), programs (2 per H200 SM): a 9.3 MiB slot in ≈ 5 loads each


@triton.jit
def page_ops_kernel(w_ptr, t_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_sync(PDL)
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK).to(tl.int64)
    count = tl.load(t_ptr)
    for i in range(count):
        src = tl.load(t_ptr + 1 + 3 * i)
        dst = tl.load(t_ptr + 2 + 3 * i)
        n = tl.load(t_ptr + 3 + 3 * i)
        for c in range(pid * BLOCK, n, step):
            o = c + offs
            m = o < n
            if src >= 0:
                x = tl.load(w_ptr + src + o, mask=m)
            else:
                x = tl.zeros([BLOCK], tl.int64)
            tl.store(w_ptr + dst + o, x, mask=m)


def page_ops_triton(words: torch.Tensor, table: torch.Tensor) -> None:
    if not runs_on(words, __name__, "page_ops_kernel"):
        raise ValueError(f"page_ops_triton: needs CUDA tensors (or TRITON_INTERPRET=1), got {words.device}")
    page_ops_kernel[(PROGRAMS,)](words, table, BLOCK=BLOCK, num_warps=4, **pdl(words))
