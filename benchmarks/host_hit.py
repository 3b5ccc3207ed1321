"""Host time of a prefix hit's engine phases, without the model's own work: the Python a 16K-token prefix hit runs
before its forward starts on the GPU (submit, scheduling, the extend graph's input tables) and after (sampling,
outputs). Runs anywhere: k3-tiny on the CPU, the graph paths on (on the CPU they run the same host code, the
forward eagerly), perf_counter around each phase, median over the hits (ms).

    python benchmarks/host_hit.py [--prefix 16384] [--tail 64] [--hits 20] [--out host_hit.json]
    python benchmarks/host_hit.py --stub-forward   # the forward replaced by its first result: the whole call's
                                                   # host time, and how much of it lies outside the timed phases
    python benchmarks/host_hit.py --stub-forward --cprofile   # and the hits' Python by function (cProfile)
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve import build  # noqa: E402
from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402
from k3.serve import engine as engine_mod, runner as runner_mod, scheduler as scheduler_mod  # noqa: E402

PHASES = ((engine_mod.Engine, "submit"), (scheduler_mod.Scheduler, "schedule"), (runner_mod.ExtendGraph, "fill"),
          (runner_mod.ModelRunner, "graph_for"), (engine_mod.Engine, "_sample"), (engine_mod.Engine, "_finish"),
          (runner_mod.ModelRunner, "logits"))
times: dict[str, list[float]] = collections.defaultdict(list)


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
    for tail in tails[3:]:
        times.clear()
        cached.append(eng.generate([prefix + tail], one)[0].num_cached_tokens)
        for k, v in times.items():
            per[k].append(sum(v))
        per["outside the phases"].append(  # the call's host time in none of the timed phases
            sum(times["Engine.generate"]) - sum(sum(v) for k, v in times.items() if k != "Engine.generate"))
    if a.cprofile:
        prof = cProfile.Profile()
        for tail in tails[3:]:
            prof.enable()
            eng.generate([prefix + tail], one)
            prof.disable()
        print(cprofile_report(prof, len(tails) - 3))
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
