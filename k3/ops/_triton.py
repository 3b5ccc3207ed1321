"""Shared helpers of the Triton kernel packages in `k3.ops` (each package imports triton only when used)."""
from __future__ import annotations

import functools
import importlib


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
