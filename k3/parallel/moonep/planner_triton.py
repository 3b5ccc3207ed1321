"""`plan_counts` as one single-program Triton kernel (the GPU path): both greedy phases in registers, so
planning costs one launch instead of ~15 small kernels per greedy step. Same decisions as the torch path
(argmax / argmin with the lowest index on ties); checked against it in the tests (TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _plan_counts_kernel(cnt_ptr, alloc_ptr, R, EPN, C, BR: tl.constexpr, BE: tl.constexpr):
    rr = tl.arange(0, BR)
    jj = tl.arange(0, BE)
    rok = rr < R
    m2 = rok[:, None] & (jj[None, :] < EPN)
    cnt = tl.load(cnt_ptr + rr[:, None] * EPN + jj[None, :], mask=m2, other=0).to(tl.int64)
    bal = tl.sum(cnt, axis=1) - C
    big = 1 << 60
    z = tl.zeros([BR, BR], dtype=tl.int64)
    for _ in range(R - 1):  # phase A: the most overloaded group fills the emptiest rank to C
        bmax = tl.where(rok, bal, -big)
        bmin = tl.where(rok, bal, big)
        h = tl.argmax(bmax, 0, tie_break_left=True)
        u = tl.argmin(bmin, 0, tie_break_left=True)
        amt = tl.where(tl.max(bmax, 0) > 0, -tl.min(bmin, 0), 0)
        z += tl.where((rr[:, None] == h) & (rr[None, :] == u), amt, 0)
        bal = bal - tl.where(rr == h, amt, 0) + tl.where(rr == u, amt, 0)
    rem = cnt
    q = tl.where(rok[None, :], z, -big)
    for _ in range(EPN + R - 1):  # phase B in every group: biggest expert → biggest quota
        remv = tl.where(m2, rem, -1)
        ei = tl.argmax(remv, 1, tie_break_left=True)
        di = tl.argmax(q, 1, tie_break_left=True)
        take = tl.maximum(tl.minimum(tl.max(remv, 1), tl.max(q, 1)), 0)
        rem -= tl.where(jj[None, :] == ei[:, None], take[:, None], 0)
        q -= tl.where(rr[None, :] == di[:, None], take[:, None], 0)
        # a (expert, rank) pair moves at most once: afterwards one of the two is exhausted
        tl.store(alloc_ptr + (rr * EPN + ei) * R + di, take, mask=rok & (take > 0))
    tl.store(alloc_ptr + (rr[:, None] * EPN + jj[None, :]) * R + rr[:, None], rem, mask=m2)


def plan_counts_triton(tokens_per_expert: torch.Tensor, num_ranks: int, capacity: int) -> torch.Tensor:
    """tokens_per_expert [E] → alloc [E, R] int64 (see `planner.plan_counts`); one kernel, no host sync."""
    E = tokens_per_expert.numel()
    epn = E // num_ranks
    cnt = tokens_per_expert.reshape(-1).to(torch.int64).contiguous()
    alloc = torch.zeros(E, num_ranks, dtype=torch.int64, device=cnt.device)
    BR = max(2, triton.next_power_of_2(num_ranks))
    BE = max(2, triton.next_power_of_2(epn))
    _plan_counts_kernel[(1,)](cnt, alloc, num_ranks, epn, capacity, BR=BR, BE=BE,
                              num_warps=4 if BR * BE <= 2048 else 8)
    return alloc
