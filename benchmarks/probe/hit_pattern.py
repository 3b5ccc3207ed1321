"""Why `serve.py`'s 16K prefix hit (the third request on a fresh prefix) takes longer than `graph_launch.py`'s hits
(many hits on one prefix): k3-small bf16 engine (as `prefill_profile.py`), rounds of reset → cold prompt (16,384 +
64 tokens) → five more requests with new 64-token tails on the same prefix. For each position in the round: wall
ms (synchronised perf_counter), the engine phases (`host_hit.py`'s wrappers) and the GPU time of each graph replay
(CUDA events around `CUDAGraph.replay`), medians over the rounds.

    python benchmarks/probe/hit_pattern.py [--rounds 4] [--cprofile] --out hit_pattern.json

`--trace`: then more rounds with every engine method on the hit's path stamped on entry and exit (and Python's
garbage collections): the median timeline of the 3rd-6th requests, ms from the call, the gaps between stamps.
`--cprofile`: then more rounds with the hits (3rd to 6th request) under cProfile, their Python by function in µs per
hit (`host_hit.cprofile_report`).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_hit import PHASES, cprofile_report, stamped_request, timed, timeline, times  # noqa: E402
from host_hit import trace_all  # noqa: E402
from prefill_profile import engine_and_prompts  # noqa: E402
from serve import log_replays, rand_prompts, replay_log  # noqa: E402

from k3.serve import SamplingParams  # noqa: E402
from k3.serve import engine as engine_mod, request as request_mod, runner as runner_mod  # noqa: E402
from k3.serve import scheduler as scheduler_mod  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
NAMES = ("cold", "junction", "hit3", "hit4", "hit5", "hit6")
sampled: list = []  # (the sampled step's copy-done event, host time when `_finish` saw it done)
# more of the engine's steps, timed like `host_hit.PHASES` (the hit's time outside those phases: ~0.4 ms on the
# H200 host against ~0.05 ms on a CPU)
MORE = ((engine_mod.Engine, "step"), (engine_mod.Engine, "generate"), (runner_mod.ModelRunner, "forward"),
        (scheduler_mod.Scheduler, "schedule_continuation"), (scheduler_mod.Scheduler, "after_forward"),
        (scheduler_mod.Scheduler, "remove"), (request_mod.Sequence, "to_output"))


def event_replay():
    """Wrap CUDAGraph.replay (`serve.log_replays`: CUDA events around each replay, the host times of the call) and
    `Engine._finish` (the host time its wait for the sampled tokens returns: the event's synchronize)."""
    log_replays()
    sample = engine_mod.Engine._sample

    class Stamped:
        """The step's copy-done event for `_finish`: its synchronize also stamps the host time it returns."""

        def __init__(self, event):
            self.event, self.timing = event, torch.cuda.Event(enable_timing=True)
            self.timing.record()  # right after the engine's own: the sampled tokens' copy is done

        def synchronize(self):
            self.event.synchronize()
            sampled.append((self.timing, time.perf_counter()))

    def sample_timed(self, done, logits):
        inf = sample(self, done, logits)
        if inf is not None and inf.event is not None:
            inf.event = Stamped(inf.event)
        return inf
    engine_mod.Engine._sample = sample_timed


def trace_rounds(eng, V: int, rounds: int) -> str:
    """The hits' median timeline (see the module docstring)."""
    trace_all(PHASES + MORE)
    runs = []
    for rep in range(rounds):
        eng.reset_prefix_cache()
        prefix = rand_prompts(1, 16384, V, 5 + 100 * rep)[0]
        for i, tail in enumerate(rand_prompts(len(NAMES), 64, V, 4 + 100 * rep)):
            run = stamped_request(eng, prefix + tail, ONE)
            if i >= 2:
                runs.append(run)
    return timeline(runs, "hits")


def copy_costs(eng, reps: int = 30) -> str:
    """Host µs of the admission's device copies (a KDA slot, an MLA page's rows) right after a synchronize (as in a
    hit) and right after another copy, and of a one-element zero_ after a synchronize: whether the first CUDA call
    after a wait costs more than the copy itself."""
    pool, free = eng.pool, [p for p in range(eng.pool.num_pages) if eng.pool.refcount[p] == 0][:2]
    if len(free) < 2:
        return "copy costs: fewer than 2 free pages"
    x = torch.empty(1, device=pool.device)
    res = collections.defaultdict(list)
    for _ in range(reps):
        for name, fn in (("copy_slot after sync", lambda: pool.copy_slot(*free)),
                         ("copy_slot after a copy", lambda: pool.copy_slot(*free)),
                         ("copy_tokens 64 rows after a copy", lambda: pool.copy_tokens(free[0], free[1], 64)),
                         ("zero_ of 1 element after sync", x.zero_)):
            if "sync" in name:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            res[name].append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return f"copy costs (slot {pool.slot_bytes / 2**20:.1f} MiB), median host µs: " + ", ".join(
        f"{k} {statistics.median(v):.1f}" for k, v in res.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cprofile", action="store_true", help="then profile the hits' Python by function")
    ap.add_argument("--trace", action="store_true", help="then the hits' timeline of engine calls")
    ap.add_argument("--out", default="hit_pattern.json")
    a = ap.parse_args()
    eng, V, _, _, _ = engine_and_prompts()
    for seed in (1, 2):  # warm-up: prefill graphs, then the hit's extend graph
        eng.reset_prefix_cache()
        p = rand_prompts(1, 16384, V, seed)[0]
        for t in rand_prompts(2, 64, V, seed + 50):
            eng.generate([p + t], ONE)
    event_replay()
    for cls, name in PHASES + MORE:
        timed(cls, name)
    res = collections.defaultdict(lambda: collections.defaultdict(list))
    for rep in range(a.rounds):
        eng.reset_prefix_cache()
        prefix = rand_prompts(1, 16384, V, 8 + 100 * rep)[0]
        for name, tail in zip(NAMES, rand_prompts(len(NAMES), 64, V, 9 + 100 * rep)):
            times.clear()
            replay_log.clear()
            sampled.clear()
            prompt, out = prefix + tail, None  # built / freed outside the clock (`serve.timed_request`)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = eng.generate([prompt], ONE)[0]
            t_end = time.perf_counter()
            torch.cuda.synchronize()
            res[name]["wall"].append((t_end - t) * 1e3)
            res[name]["cached"].append(out.num_cached_tokens)
            res[name]["replay_gpu"].append(sum(s.elapsed_time(e) for _, _, s, e in replay_log))
            if replay_log and sampled:  # the last replay (the sampled step's) against the copy-done event
                t_call, _, s, e = replay_log[-1]
                ev, t_wake = sampled[-1]
                res[name]["host_to_replay_call"].append((t_call - t) * 1e3)  # host work before the graph
                res[name]["gpu_replay_to_copied"].append(s.elapsed_time(ev))  # graph + sampling + copy
                res[name]["host_replay_call_to_wake"].append((t_wake - t_call) * 1e3)
                res[name]["host_wake_to_return"].append((t_end - t_wake) * 1e3)
            for k, v in times.items():
                res[name][k].append(sum(v))
    summary = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in res.items()}
    for name, d in summary.items():
        print(f"{name:9s} " + " ".join(f"{k.split('.')[-1]}={v:.3f}" for k, v in d.items()), flush=True)
    report = None
    if a.cprofile:
        prof, hits = cProfile.Profile(), 0
        for rep in range(a.rounds):
            eng.reset_prefix_cache()
            prefix = rand_prompts(1, 16384, V, 7 + 100 * rep)[0]
            for i, tail in enumerate(rand_prompts(len(NAMES), 64, V, 6 + 100 * rep)):
                if i >= 2:
                    prof.enable()
                eng.generate([prefix + tail], ONE)
                prof.disable()
                hits += i >= 2
        report = cprofile_report(prof, hits, top=40)
        print(report, flush=True)
    timeline = None
    if a.trace:
        timeline = trace_rounds(eng, V, a.rounds) + "\n" + copy_costs(eng)
        print(timeline, flush=True)
    Path(a.out).write_text(json.dumps(dict(summary=summary, all={n: dict(d) for n, d in res.items()},
                                           cprofile=report, timeline=timeline), indent=1))


if __name__ == "__main__":
    main()
