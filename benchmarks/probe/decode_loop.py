"""Where a batch-1 decode step's time goes between graph replays: k3-small bf16 engine, asynchronous scheduling,
`--steps` decode steps under torch.profiler. Prints the loop's time per step, the GPU's busy time per step (the
union of kernel and copy intervals), the idle gaps between them (count and sum above 5 µs), the host's time
inside `Engine.step()` per step, and the top kernels outside the forward graph's; then the same steps with
every projection through cuBLAS and with programmatic dependent launch off (graphs captured afresh).

    python benchmarks/probe/decode_loop.py --steps 40 --out decode_loop.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve import build, rand_prompts  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402


WAITED = [0.0]  # seconds the host spent in torch.cuda.Event.synchronize (waiting for the GPU)
_sync = torch.cuda.Event.synchronize


def _timed_sync(self):
    t = time.perf_counter()
    _sync(self)
    WAITED[0] += time.perf_counter() - t


torch.cuda.Event.synchronize = _timed_sync


def loop(eng, steps: int) -> tuple[float, float, float]:
    """(ms per step of the whole loop, ms of host time inside step() per step, of which waiting on events)."""
    host = 0.0
    torch.cuda.synchronize()
    WAITED[0] = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        host += time.perf_counter() - t
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps, host * 1e3 / steps, WAITED[0] * 1e3 / steps


def timeline(prof, steps: int) -> dict:
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    iv = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs)
    busy, gaps, end = 0.0, [], None
    for s, e, _ in iv:
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = iv[-1][1] - iv[0][0] if iv else 0.0
    big = [g for g in gaps if g > 5]
    names = {}
    for s, e, n in iv:
        names.setdefault(n[:70], [0, 0.0])
        names[n[:70]][0] += 1
        names[n[:70]][1] += e - s
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:25]
    return dict(span_us_per_step=span / steps, busy_us_per_step=busy / steps, gaps_over_5us_per_step=len(big) / steps,
                gap_us_per_step=sum(big) / steps, kernels_per_step=len(iv) / steps,
                top=[(k, c / steps, round(t / steps, 2)) for k, (c, t) in top])


def measure(eng, prompt, steps: int, label: str) -> dict:
    rid = eng.submit(prompt, SamplingParams(max_tokens=10 * steps, temperature=0, ignore_eos=True))
    while not eng.requests[rid].output:  # a KeyError here: the request failed (see the engine's log)
        eng.step()
    loop(eng, 5)  # graphs captured, steady state
    ms, host, waited = loop(eng, steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop(eng, steps)
    if label == "default":  # the host's own work per step, by function (own time)
        pr = cProfile.Profile()
        pr.enable()
        loop(eng, steps)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue()[-4000:])
    eng.abort(rid)
    eng.flush()
    r = dict(label=label, step_ms=ms, host_ms_in_step=host, host_wait_ms=waited, **timeline(prof, steps))
    print(f"== {label}: {ms:.3f} ms per step, host in step() {host:.3f} ms of which {waited:.3f} waiting on the GPU; "
          f"(profiled, CUDA only:) GPU busy {r['busy_us_per_step']:.1f} us, "
          f"span {r['span_us_per_step']:.1f} us, {r['kernels_per_step']:.0f} kernels and copies, "
          f"{r['gaps_over_5us_per_step']:.1f} gaps > 5 us = {r['gap_us_per_step']:.1f} us per step", flush=True)
    for k, c, t in r["top"]:
        print(f"   {t:8.2f} us {c:6.1f}x  {k}")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="decode_loop.json")
    a = ap.parse_args()
    model = build("k3-small", "cuda", torch.bfloat16)
    V = model.config.text_config.vocab_size
    eng = Engine(model, EngineConfig(block_size=6144, hash_block_size=512, max_num_seqs=8, gpu_memory_fraction=0.5))
    from k3.ops import _triton, gemv
    res = [measure(eng, rand_prompts(1, 128, V, 1)[0], a.steps, "default")]
    kept = [eng.runner.graphs]  # graphs stay referenced: freeing every graph of the shared pool breaks a capture
    for mod, name, value, label in ((_triton, "PDL", False, "no PDL"), (gemv, "MAX_ROWS", 0, "cuBLAS projections")):
        old = getattr(mod, name)
        setattr(mod, name, value)
        eng.runner.graphs = {}
        try:
            res.append(measure(eng, rand_prompts(1, 128, V, 2)[0], a.steps, label))
        finally:
            setattr(mod, name, old)
            kept.append(eng.runner.graphs)
            eng.runner.graphs = kept[0]
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
