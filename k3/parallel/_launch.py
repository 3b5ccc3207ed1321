"""Spawn a small process group: gloo on CPU, or NCCL with one GPU per process (tests and smoke runs)."""
from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _entry(rank: int, fn, world: int, backend: str, init_file: str, timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)
    kw = {}
    if backend == "nccl":
        os.environ.update(NO_MULTICAST)
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_group(fn, world: int, *args, backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """Run fn(rank, world, *args) in `world` fresh processes joined in one process group.

    backend "gloo" (CPU, one thread per process) or "nccl" (process r on GPU r, NVLink multicast off).
    fn must be importable by name (a module-level function). A worker's exception is re-raised here and the
    other workers are terminated; a collective that hangs fails after `timeout_s`.
    """
    if world < 1:
        raise ValueError(f"spawn_group: world must be >= 1, got {world}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"spawn_group: backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"spawn_group: nccl with {world} processes needs {world} GPUs, "
                         f"found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(fn, world, backend, os.path.join(d, "init"), timeout_s, args), nprocs=world,
                 join=True)


def spawn_gloo(fn, world: int, *args, timeout_s: float = 120.0) -> None:
    """`spawn_group` on gloo (CPU)."""
    spawn_group(fn, world, *args, backend="gloo", timeout_s=timeout_s)
