"""Host → device copies that do not wait for the device's queue."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: staged through pinned memory and copied asynchronously (a
    non-blocking copy from pageable memory may still wait for the stream: measured once per KDA layer in an eager
    prefill). The caching host allocator keeps the pinned block until the copy has run. Non-CUDA: a plain `.to`.
    The staging copy is contiguous: `pin_memory` keeps the source's strides, so an expanded view (stride 0) would
    fail its own copy ("more than one element of the written-to tensor refers to a single memory location")."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":  # (a device tensor: a plain `.to`)
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)
