"""L2 prefetch of the weights a captured forward reads next (a batch-1 decode step, a prefix hit's short tail).

Such a step is a chain of short projections whose time is mostly fixed cost: on the H200 a 1,536 × 1,536 GEMV
takes ≈ 4.4 µs where its 4.7 MB need 1.1 µs at the HBM rate (`benchmarks/probe/pdl_chain.py`). With a plan, the
graph also holds, on a side stream, one small kernel per projection that asks the TMA unit to bring the weight
`AHEAD` projections later into L2 (`cp.async.bulk.prefetch.L2`, a hint: no data moves through registers, nothing
is written), launched once the projection before the current one has finished. The weights then stream from HBM
while the chain runs, and each GEMV reads from L2.

How the plan knows the order: `k3.ops.gemv.linear` (every projection of a step) reports its weight to the plan in
use (`note`). The graph's eager warm-up run records the sequence (`recording`); while the graph is captured
(`capturing`) call j prefetches recorded weight j + AHEAD. A capture that departs from the recorded sequence stops
prefetching (the rest of the graph is captured as without the plan). Weights over `MAX_BYTES` (the LM head) are
not prefetched: their GEMV streams them at the HBM rate already, and they would evict everything else.

A prefetch changes no value: a graph with a plan computes bit for bit what it computes without one. `ON`
(K3_L2_PREFETCH=1) is read when a graph is captured; off by default until `benchmarks/serve.py` has timed it
(`benchmarks/probe/persistent_chain.py`'s `graph+pf` rows measure the idea on a chain of GEMVs alone).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

ON = os.environ.get("K3_L2_PREFETCH", "0") == "1"
AHEAD = int(os.environ.get("K3_L2_PREFETCH_AHEAD", "1"))  # projections between a weight's prefetch and its GEMV
MAX_BYTES = 32 << 20
SPAN = 64 << 10  # bytes per prefetch instruction (one program each: many SMs' TMA units share a large weight)

_active: "PrefetchPlan | None" = None


class PrefetchPlan:
    """The weights one captured forward reads, in order (`recording`), and the prefetches its capture adds
    (`capturing`). `issue(tensor)` launches one prefetch on the current stream (default: the Triton kernel)."""

    def __init__(self, ahead: int = AHEAD, issue: Callable[[torch.Tensor], None] | None = None):
        if not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"PrefetchPlan: ahead must be an integer >= 1, got {ahead!r}")
        self.ahead, self.issue = ahead, issue or l2_prefetch
        self.weights: list[torch.Tensor] = []
        self.mode: str | None = None
        self.calls = 0          # weights noted in the current capture
        self.issued = 0         # prefetches launched in it
        self.departed = False   # the capture left the recorded sequence: no more prefetches
        self._side: torch.cuda.Stream | None = None

    def note(self, w: torch.Tensor) -> None:
        if self.mode == "record":
            self.weights.append(w)
        elif self.mode == "capture" and not self.departed:
            j = self.calls
            self.calls += 1
            if j >= len(self.weights) or not _same(self.weights[j], w):
                self.departed = True
                return
            for i in range(1, self.ahead + 1) if j == 0 else (j + self.ahead,):  # call 0 starts 1..ahead
                self._prefetch(i)

    def _prefetch(self, i: int) -> None:
        if i >= len(self.weights) or not _worth(self.weights[i]):
            return
        self.issued += 1
        if self._side is None:  # CPU tests: the issuer is called in order on the current stream
            self.issue(self.weights[i])
            return
        main = torch.cuda.current_stream()
        self._side.wait_stream(main)  # after everything launched before the current call
        with torch.cuda.stream(self._side):
            self.issue(self.weights[i])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _worth(w: torch.Tensor) -> bool:
    return w.is_contiguous() and 0 < w.numel() * w.element_size() <= MAX_BYTES


def note(w: torch.Tensor) -> None:
    """A projection is about to read w (called by `k3.ops.gemv.linear`); a no-op without a plan in use."""
    if _active is not None:
        _active.note(w)


@contextlib.contextmanager
def recording(plan: PrefetchPlan | None):
    """Record the weights the forward inside reads (the graph's eager warm-up); plan None: nothing."""
    global _active
    if plan is None:
        yield
        return
    plan.weights, plan.mode, _active = [], "record", plan
    try:
        yield
    finally:
        plan.mode, _active = None, None


@contextlib.contextmanager
def capturing(plan: PrefetchPlan | None, side: bool = True):
    """Add the plan's prefetches to the work launched inside (a CUDA graph's capture): on a side stream forked from
    and joined back to the current one (side False: on the current stream, in order, for CPU tests)."""
    global _active
    if plan is None:
        yield
        return
    plan.calls, plan.issued, plan.departed, plan.mode = 0, 0, False, "capture"
    main = torch.cuda.current_stream() if side else None
    plan._side = torch.cuda.Stream(main.device) if side else None
    _active = plan
    try:
        yield
    finally:
        _active, plan.mode = None, None
        if main is not None:
            main.wait_stream(plan._side)  # a capture must end on its own stream
        plan._side = None


def l2_prefetch(w: torch.Tensor) -> None:
    """Ask for w's bytes in L2 (CUDA, sm_90+: one Triton program per `SPAN` bytes); nothing elsewhere."""
    if not (w.is_cuda and torch.cuda.get_device_capability(w.device)[0] >= 9):
        return
    from .l2_prefetch_triton import prefetch_bytes
    prefetch_bytes(w.data_ptr(), w.numel() * w.element_size(), SPAN)
