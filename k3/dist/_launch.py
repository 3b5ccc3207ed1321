"""Spawn a small gloo process group on CPU (tests and smoke runs of the distributed code)."""
from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world: int, init_file: str, timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn, world: int, *args, timeout_s: float = 120.0) -> None:
    """Run fn(rank, world, *args) in `world` fresh processes joined in a gloo group (one CPU thread each).

    fn must be importable by name (a module-level function). A worker's exception is re-raised here and the
    other workers are terminated; a collective that hangs fails after `timeout_s`.
    """
    if world < 1:
        raise ValueError(f"spawn_gloo: world must be >= 1, got {world}")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(fn, world, os.path.join(d, "init"), timeout_s, args), nprocs=world, join=True)
