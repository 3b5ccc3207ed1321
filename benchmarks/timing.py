"""Median wall time of a callable for the benchmark scripts: CUDA events on GPU, perf_counter on CPU."""
from __future__ import annotations

import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parents[1])


def median_ms(fn, warmup: int, reps: int, cuda: bool = True, before=None) -> float:
    """Median milliseconds of fn() over `reps` calls after `warmup` calls; `before()` runs ahead of each
    timed call (e.g. a barrier across ranks), outside the timed region."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph (one warm-up run on a side stream first: Triton compiles, cuBLAS picks its
    kernels) → the graph's `replay`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def graph_us(fn, reps: int, warmup: int = 3) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph (`graphed`), over `reps` replays."""
    return 1e3 * median_ms(graphed(fn), warmup, reps)


def launch_sweep(launch: dict, settings: list[dict], fn, reps: int, per: int, base_us: float, floor_us: float,
                 check=None) -> dict:
    """{setting: row} of fn's CUDA graph (`graph_us`) timed with each of `settings` applied to the `launch` dict
    (a kernel's launch settings: each setting on top of its defaults, which are restored after): µs per unit
    (÷ `per`), with the speed-up over `base_us` and the share of `floor_us` printed; `check()` → extra fields of
    the row (errors, flags: a True one is printed in capitals). A setting that fails is reported in its row, not
    raised."""
    default, rows = dict(launch), {}
    try:
        for c in settings:
            launch.update(default, **c)  # each setting on top of the defaults
            key = " ".join(f"{k}{v}" for k, v in launch.items())
            try:
                t = graph_us(fn, reps) / per
                row = {"us_per_unit": t, **(check() if check else {})}
                extra = "".join(f"  {k} {v:.1e}" if isinstance(v, float) else f"  {k.upper()}" if v is True else ""
                                for k, v in row.items() if k != "us_per_unit")
                print(f"{key:40s} {t:7.2f} µs ({base_us / t:4.2f}x, {100 * floor_us / t:4.1f} % of HBM){extra}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                row = {"error": repr(e)[:500]}
                print(f"{key}: failed {e!r}"[:500], flush=True)
            rows[key] = row
    finally:
        launch.clear()
        launch.update(default)
    return rows


def sync_sites(fn, cuda: bool) -> dict[str, int] | None:
    """The host syncs of one call of fn by the Python line that asked for them, most first (CUDA's sync debug mode,
    "warn": each synchronizing call warns from its caller's frame); None off CUDA. Where that line is in torch, the
    key also names the innermost frame of this repository's code on the stack (` <- k3/...py:line`)."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    where: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):  # runs inside the warning's call
        if "synchronizing CUDA operation" not in str(message):  # (not the mode's own "prototype" warning)
            return
        key = f"{Path(filename).name}:{lineno}"
        if "/torch/" in filename:
            ours = [f for f in traceback.extract_stack()[:-1] if _ROOT in f.filename and "/.venv/" not in f.filename]
            if ours:
                key += f" <- {Path(ours[-1].filename).relative_to(_ROOT)}:{ours[-1].lineno}"
        where[key] = where.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return dict(sorted(where.items(), key=lambda kv: -kv[1]))
