"""`@triton.jit` helpers shared by several kernel packages (imported only by their `triton` modules)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def token_range(cu_ptr, n, HAS_CU: tl.constexpr):
    """Sequence n's rows [bos, eos): cu[n]..cu[n+1] of a varlen batch, or row n alone without cu_seqlens."""
    if HAS_CU:
        bos = tl.load(cu_ptr + n)
        eos = tl.load(cu_ptr + n + 1)
    else:
        bos = n
        eos = n + 1
    return bos, eos


@triton.jit
def pdl_sync(PDL: tl.constexpr):
    """A kernel's first statement under programmatic dependent launch (`k3.ops._triton.pdl`): wait until the
    kernel before it in the stream has completed and flushed its writes (before ANY global read or write: the
    caching allocator may hand this kernel a buffer that one still reads), then let the next kernel launch.
    Every program runs it, so a kernel completes only after its predecessor did (the chain stays ordered)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def grid_barrier(cnt_ptr, target, SPINS: tl.constexpr = 1 << 20):
    """A barrier of a persistent kernel's programs (all resident at once): every program arrives at cnt[0]
    (release: its stores before it are visible to the others), then waits until it reaches `target` (= programs ×
    barriers so far; acquire). Data another program stored before the barrier must then be read past L1
    (`cache_modifier=".cg"`). A wait longer than SPINS polls (≈ a second: programs not all resident, or a bug)
    sets cnt[2] and goes on, so a wrong launch gives a flagged wrong result, not a hung GPU. Under the CPU
    interpreter programs run one after another: only one program works."""
    tl.debug_barrier()  # this program's threads have issued their stores
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    v = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    n = 0
    while (v < target) & (n < SPINS):
        v = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        n += 1
    if v < target:
        tl.atomic_xchg(cnt_ptr + 2, 1)
    tl.debug_barrier()


@triton.jit
def grid_done(cnt_ptr, programs):
    """A persistent kernel's last statement: the last program to get here zeroes the barrier counter cnt[0] and
    this one, cnt[1], so the next launch (a graph replay) starts from zero (cnt[2], a timed-out barrier's flag,
    stays for the caller to read)."""
    if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.atomic_xchg(cnt_ptr, 0)
        tl.atomic_xchg(cnt_ptr + 1, 0)
