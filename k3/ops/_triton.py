"""Shared helpers of the Triton kernel packages in `k3.ops` (each package imports triton only when used)."""
from __future__ import annotations

import functools
import importlib
import os


@functools.lru_cache(maxsize=None)
def importable(module: str) -> bool:
    """True when `module` (a package's Triton kernels) imports: tried once, on first use, not at k3 import time
    (an ImportError, or a broken triton / CUDA install, gives False)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def interpreted(kernel) -> bool:
    """True when a `@triton.jit` kernel was bound to Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def device_reason(x, package: str) -> str | None:
    """Why `package`'s Triton kernels (its `.triton` module, which defines `interpreted()`) cannot run on x's
    device, or None: not importable, or a CPU tensor without the interpreter."""
    if not importable(package + ".triton"):
        return "triton is not importable"
    if not x.is_cuda and not importlib.import_module(package + ".triton").interpreted():
        return f"needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {x.device}"
    return None


def runs_on(x, module: str, kernel: str) -> bool:
    """Whether the Triton kernel `module.kernel` can run where x lives: CUDA with the module importable, or a CPU
    tensor with the kernel bound to Triton's interpreter."""
    if not importable(module):
        return False
    return x.is_cuda or interpreted(getattr(importlib.import_module(module), kernel))


# Programmatic dependent launch (Hopper's `griddepcontrol`): a kernel launched with it may start while the one
# before it in the stream finishes; every program first waits for that kernel's completion and memory flush
# (`pdl_sync` in `_triton_jit`, the first statement of each kernel taking `PDL`), then lets the next kernel
# launch. What overlaps is the launch and the programs' start, ≈ 0.8 µs per kernel boundary inside a CUDA graph
# (`benchmarks/probe/pdl_chain.py`, H200: a chain of one-row GEMVs 5.17 → 4.40 µs per kernel, with a small norm
# kernel between them 3.50 → 2.65). K3_PDL=0, or `PDL = False` here, turns it off (taken at each launch).
PDL = os.environ.get("K3_PDL", "1") != "0"
_PDL_ON = {"PDL": True, "launch_pdl": True}


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    import torch
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """The streaming multiprocessors of a CUDA device (cached per device)."""
    import torch
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)


def pdl(x) -> dict:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` parameter whose tensors live where x does:
    {"PDL": True, "launch_pdl": True} on an sm90+ GPU with `PDL` on, else {} (the kernel's default PDL=False;
    the CPU interpreter has no `griddepcontrol`)."""
    if not (PDL and x.is_cuda):
        return {}
    return _PDL_ON if _pdl_capable(x.device.index if x.device.index is not None else 0) else {}


def cooperative(x, on: bool) -> dict:
    """Launch keywords of a persistent kernel (programs meeting at grid barriers) whose tensors live where x does:
    {"launch_cooperative_grid": True} with `on` on CUDA -- the driver then guarantees every program is resident at
    once, or refuses the launch with an error -- else {} (the CPU interpreter runs programs one by one)."""
    return {"launch_cooperative_grid": True} if on and x.is_cuda else {}


def grid_counters(owner, device):
    """A persistent kernel's barrier counters for one caller on `device`: an int32 [3] tensor of zeros (arrivals,
    finished programs, a timed-out barrier's flag: `k3.ops._triton_jit.grid_barrier`), made once and kept on
    `owner` (a module; outside its state dict). Made outside any CUDA graph capture (the graph's memory pool would
    own it): run the forward once before capturing it."""
    import torch
    cache = owner.__dict__.setdefault("_grid_counters", {})
    t = cache.get(device)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("grid_counters: run the forward once before capturing it in a CUDA graph (the barrier "
                               "counters must not come from the graph's memory pool)")
        t = cache[device] = torch.zeros(3, dtype=torch.int32, device=device)
    return t


def check_counters(counters, fn: str, device) -> None:
    """ValueError unless `counters` is an int32 [3] tensor on `device` (`grid_counters`)."""
    import torch
    if counters.dtype != torch.int32 or counters.numel() != 3 or counters.device != device:
        raise ValueError(f"{fn}: counters must be an int32 [3] tensor on {device} (`k3.ops._triton.grid_counters`), "
                         f"got {counters.dtype} {tuple(counters.shape)} on {counters.device}")
