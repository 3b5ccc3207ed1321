"""Host time of a prefix hit's engine phases, without the model's own work: the Python a 16K-token prefix hit runs
before its forward starts on the GPU (submit, scheduling, the extend graph's input tables) and after (sampling,
outputs). Runs anywhere: k3-tiny on the CPU, the graph paths on (on the CPU they run the same host code, the
forward eagerly), perf_counter around each phase, median over the hits (ms).

    python benchmarks/host_hit.py [--prefix 16384] [--tail 64] [--hits 20] [--out host_hit.json]
    python benchmarks/host_hit.py --stub-forward   # the forward replaced by its first result: the whole call's
                                                   # host time, and how much of it lies outside the timed phases
    python benchmarks/host_hit.py --stub-forward --cprofile   # and the hits' Python by function (cProfile)
    python benchmarks/host_hit.py --stub-forward --trace      # the hits' median timeline of engine calls
    python benchmarks/host_hit.py --stub-forward --trace --cold 8192   # a cold prompt's instead (prefill)
    python benchmarks/host_hit.py --stub-forward --array   # the prompts as int64 NumPy arrays instead of lists
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import gc
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve import build  # noqa: E402
from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402
from k3.serve import engine as engine_mod, pool as pool_mod, prefix_cache as prefix_cache_mod  # noqa: E402
from k3.serve import request as request_mod, runner as runner_mod  # noqa: E402
from k3.serve import scheduler as scheduler_mod  # noqa: E402

PHASES = ((engine_mod.Engine, "submit"), (scheduler_mod.Scheduler, "schedule"), (runner_mod.ExtendGraph, "fill"),
          (runner_mod.ModelRunner, "graph_for"), (engine_mod.Engine, "_sample"), (engine_mod.Engine, "_finish"),
          (runner_mod.ModelRunner, "logits"))
times: dict[str, list[float]] = collections.defaultdict(list)
# the methods a timeline stamps (`trace_all`), besides PHASES and `Engine.generate` / `step` / `ModelRunner.forward`
TRACED = ((engine_mod.Engine, "generate"), (engine_mod.Engine, "step"), (runner_mod.ModelRunner, "forward"),
          (scheduler_mod.Scheduler, "_admit"), (scheduler_mod.Scheduler, "_lookup"),
          (scheduler_mod.Scheduler, "on_token"), (scheduler_mod.Scheduler, "after_forward"),
          (scheduler_mod.Scheduler, "schedule_continuation"), (prefix_cache_mod.PrefixCache, "lookup"),
          (prefix_cache_mod.RecentPrompts, "extend"), (pool_mod.PagePool, "copy_slot"),
          (pool_mod.PagePool, "copy_tokens"), (runner_mod.ModelRunner, "published"), (runner_mod._Graph, "__call__"),
          (runner_mod.PrefillGraph, "fill"), (request_mod.Sequence, "output_prompt"),
          (request_mod.Sequence, "to_output"), (scheduler_mod.Scheduler, "remove"), (engine_mod.Engine, "_retire"),
          (engine_mod.Engine, "_check_stop"), (engine_mod, "_valid_ids"), (engine_mod, "sample_device"))
stamps: list = []  # (label, perf_counter) of the traced calls


def traced(owner, name: str) -> None:
    """Stamp `owner.name` (a class's method or a module's function) on entry (`name>`) and exit (`name<`)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        stamps.append((name + ">", time.perf_counter()))
        try:
            return fn(*a, **k)
        finally:
            stamps.append((name + "<", time.perf_counter()))
    setattr(owner, name, wrapper)


def trace_all(more=()) -> None:
    """Stamp PHASES, TRACED and `more` (each method once), and Python's garbage collections."""
    seen = set()
    for owner, name in PHASES + TRACED + tuple(more):
        if (owner, name) not in seen:
            seen.add((owner, name))
            traced(owner, name)
    gc.callbacks.append(lambda phase, info: stamps.append((f"gc{info['generation']}-{phase}", time.perf_counter())))


def stamped_request(eng, prompt: list[int], params) -> list[tuple[str, float]]:
    """One blocking request's stamps, ms from the call (the prompt built and the output freed outside)."""
    stamps.clear()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = eng.generate([prompt], params)
    stamps.append(("return", time.perf_counter()))
    del out
    return [(label, (s - t) * 1e3) for label, s in stamps]


def timeline(runs: list, what: str) -> str:
    """The median timeline of `runs` (`stamped_request`'s) that took the first one's path: at, gap, stamp."""
    labels = [label for label, _ in runs[0]]
    same = [r for r in runs if [label for label, _ in r] == labels]
    lines = [f"timeline of {len(same)} of {len(runs)} {what} (the others took another path), ms: at, gap, stamp"]
    prev = 0.0
    for i, label in enumerate(labels):
        at = statistics.median(r[i][1] for r in same)
        lines.append(f"  {at:7.3f} {at - prev:+7.3f}  {label}")
        prev = at
    others = [[label for label, _ in r] for r in runs if r not in same]
    if others:
        lines.append(f"  other paths' stamps: {others[:2]}")
    return "\n".join(lines)


def timed(cls, name: str) -> None:
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            times[f"{cls.__name__}.{name}"].append((time.perf_counter() - t) * 1e3)
    setattr(cls, name, wrapper)


def cprofile_report(prof: cProfile.Profile, hits: int, top: int = 30) -> str:
    """The functions a profiled run of `hits` hits spent its host time in, in µs per hit: the top `top` by own time,
    then by cumulative time (cProfile's own overhead inflates every call alike: read the shares, not the µs)."""
    st = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = [(tt / hits * 1e6, ct / hits * 1e6, nc / hits, f"{Path(f).name}:{ln}({fn})")
            for (f, ln, fn), (_, nc, tt, ct, _) in st.items()]
    total = sum(r[0] for r in rows)
    out = [f"cProfile, per hit: {total:.0f} µs of own time in {sum(r[2] for r in rows):.0f} calls"]
    for key, label in ((0, "own"), (1, "cumulative")):
        out.append(f"  by {label} time:   own µs   cum µs   calls  function")
        out += [f"  {'':18s}{o:8.1f} {c:8.1f} {n:7.1f}  {name}"
                for o, c, n, name in sorted(rows, key=lambda r: -r[key])[:top]]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--hits", type=int, default=20)
    ap.add_argument("--out", default="host_hit.json")
    ap.add_argument("--stub-forward", action="store_true",
                    help="each captured step's graph returns its first forward's logits without running it again "
                         "(on a CPU the graph's work runs eagerly and would hide the host's)")
    ap.add_argument("--cprofile", action="store_true", help="also profile the hits' Python by function")
    ap.add_argument("--trace", action="store_true", help="then the median timeline of engine calls")
    ap.add_argument("--array", action="store_true",
                    help="the timed prompts as int64 NumPy arrays (built before each call), not lists of ints")
    ap.add_argument("--cold", type=int, default=0, metavar="TOKENS",
                    help="with --trace: cold prompts of this many tokens (a prefill) instead of hits")
    a = ap.parse_args()
    model = build("k3-tiny", "cpu", torch.float32)
    V = model.config.text_config.vocab_size
    eng = Engine(model, EngineConfig(hash_block_size=512, block_size=6144, max_num_batched_tokens=8192,
                                     max_num_seqs=32, num_pages=16, enable_prefix_caching=True))
    eng.runner.enable_graphs()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, V, (a.prefix,), generator=g).tolist()
    tails = torch.randint(0, V, (a.hits + 3, a.tail), generator=g).tolist()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    if a.stub_forward:
        run, first = runner_mod._Graph.run, {}

        def stub(self):
            if self not in first:
                first[self] = run(self)
            return first[self]
        runner_mod._Graph.run = stub
    for tail in tails[:3]:  # the first computes the prefix; the others hit
        eng.generate([prefix + tail], one)
    for cls, name in PHASES + ((engine_mod.Engine, "generate"),):
        timed(cls, name)
    per = collections.defaultdict(list)
    cached = []
    form = (lambda p: np.asarray(p, dtype=np.int64)) if a.array else (lambda p: p)
    for tail in tails[3:]:
        times.clear()
        prompt = form(prefix + tail)
        cached.append(eng.generate([prompt], one)[0].num_cached_tokens)
        for k, v in times.items():
            per[k].append(sum(v))
        per["outside the phases"].append(  # the call's host time in none of the timed phases
            sum(times["Engine.generate"]) - sum(sum(v) for k, v in times.items() if k != "Engine.generate"))
    if a.cprofile:
        prof = cProfile.Profile()
        for tail in tails[3:]:
            prompt = form(prefix + tail)
            prof.enable()
            eng.generate([prompt], one)
            prof.disable()
        print(cprofile_report(prof, len(tails) - 3))
    if a.trace:
        if a.cold:  # the cold shape's graph captured (and its forward stubbed) before the timed prompts
            eng.reset_prefix_cache()
            eng.generate([torch.randint(0, V, (a.cold,), generator=g).tolist()], one)
        trace_all()
        runs = []
        for i, tail in enumerate(tails[3:]):
            if a.cold:
                eng.reset_prefix_cache()
            prompt = (torch.randint(0, V, (a.cold,), generator=torch.Generator().manual_seed(100 + i)).tolist()
                      if a.cold else prefix + tail)
            prompt = form(prompt)
            runs.append(stamped_request(eng, prompt, one))
        print(timeline(runs, f"cold {a.cold}-token prompts" if a.cold else "hits"))
    res = {k: statistics.median(v) for k, v in per.items()}
    before = sum(res.get(k, 0.0) for k in ("Engine.submit", "Scheduler.schedule", "ExtendGraph.fill"))
    print(f"k3-tiny on {eng.device}, {a.prefix} cached + {a.tail} new tokens (cached {min(cached)}), "
          f"median of {a.hits} hits, ms:")
    for k, v in res.items():
        print(f"  {v:8.3f}  {k}{'  (the model forward: not host overhead)' if k.endswith('logits') else ''}")
    print(f"  {before:8.3f}  host before the forward (submit + schedule + fill)")
    Path(a.out).write_text(json.dumps(dict(phases_ms=res, host_before_forward_ms=before), indent=1))


if __name__ == "__main__":
    main()
