"""A 16K prefix hit under each combination of switches, interleaved: whether `serve.py`'s one-flip-at-a-time hit
figures (a median of 3, each switch after the other) are the switches or the order. k3-small bf16 engine built as
`serve.py` builds it; each round visits every combination in a rotated order, graphs captured afresh for each
(`serve.with_settings`), and times `--reps` hits (`serve.py`'s pattern: cold, junction, then the timed third
request on a fresh prefix): TTFT by CUDA events (`serve.timed_request`) and the GPU time of the hit's graph
replays, the host time before the first replay call and inside the replay calls (`serve.py --hit-detail`'s split).
Medians per combination over every round.

    python benchmarks/probe/hit_switches.py [--rounds 3] [--reps 5] [--only-default] [--gc-freeze] [--trace] \
        --out hit_switches.json

`--trace`: then 2 x reps more hits with every engine call on their path stamped, in the default combination (as
`host_hit.py --trace`): which call takes the host time that differs from one process to the next.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402
from host_hit import stamped_request, timeline, trace_all  # noqa: E402
from serve import build, rand_prompts, timed_request, with_settings  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
# (module, flag): every combination of these is timed (`--flags module:name ...` names others)
FLAGS = (("k3.ops.gemv", "WIDE_64"), ("k3.ops.mla_decode", "PAGE_TABLE"), ("k3.serve.runner", "HOST_TABLES"))


def third_requests(eng, V: int, reps: int, seed: int):
    """`serve.py`'s hit pattern: for each of `reps` fresh 16K prefixes, its cold and junction requests run, then
    the third (the hit) is yielded, its prompt built, for the caller to time."""
    for rep in range(reps):
        eng.reset_prefix_cache()
        prefix = rand_prompts(1, 16384, V, seed + 100 * rep)[0]
        tails = rand_prompts(3, 64, V, seed + 1 + 100 * rep)
        for tail in tails[:2]:
            eng.generate([prefix + tail], ONE)
        yield prefix + tails[2]


def hits(eng, V: int, reps: int, seed: int) -> list[tuple[float, ...]]:
    """(TTFT ms, host ms from the request to its first replay call, host ms in the replay calls, GPU ms of its graph
    replays) of each of `third_requests`' hits (`serve.timed_request`'s split, `serve.log_replays` on)."""
    for prompt in third_requests(eng, V, reps, seed):
        timed_request(eng, prompt, ONE, True, detail="hit")
    return serve.hit_detail.pop("hit")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only-default", action="store_true", help="time the default combination only")
    ap.add_argument("--gc-freeze", action="store_true", help="the engine freezes Python's GC (as `serve.py`)")
    ap.add_argument("--trace", action="store_true",
                    help="then the default combination's hits with every engine call on their path stamped "
                         "(`host_hit.trace_all`): their median timeline in this process")
    ap.add_argument("--flags", nargs="+", metavar="MODULE:NAME", help="the switches to combine (default: "
                    + " ".join(f"{m}:{n}" for m, n in FLAGS) + ")")
    ap.add_argument("--out", default="hit_switches.json")
    a = ap.parse_args()
    model = build("k3-small", "cuda", torch.bfloat16)
    V = model.config.text_config.vocab_size
    eng = Engine(model, EngineConfig(hash_block_size=512, block_size=6144, max_num_batched_tokens=8192,
                                     max_num_seqs=256, gpu_memory_fraction=0.5, enable_prefix_caching=True,
                                     gc_freeze=a.gc_freeze))
    eng.warm_up()
    flags = FLAGS if not a.flags else tuple(tuple(f.split(":")) for f in a.flags)
    if any(len(f) != 2 for f in flags):
        ap.error(f"--flags: each is MODULE:NAME, got {a.flags}")
    mods = [(importlib.import_module(m), n) for m, n in flags]
    default = tuple(bool(getattr(m, n)) for m, n in mods)
    combos = [default] if a.only_default else list(itertools.product((False, True), repeat=len(flags)))
    hits(eng, V, 2, 7)  # warm-up: the hit's graphs and kernels
    serve.log_replays()
    res = {c: [] for c in combos}
    for r in range(a.rounds):
        order = combos[r % len(combos):] + combos[:r % len(combos)]
        for c in order:
            settings = [(m, n, v) for (m, n), v in zip(mods, c)]
            res[c] += with_settings(eng, settings, lambda: hits(eng, V, a.reps, 1000 * r + 11))
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    rows = []
    print("  " + "  ".join(f"{n:>11}" for _, n in flags) + "   TTFT ms   GPU ms   pre ms  launch ms  (all TTFT)")
    for c in combos:
        ttft, pre, launch, gpu = (list(x) for x in zip(*res[c]))
        med = [statistics.median(x) for x in (ttft, gpu, pre, launch)]
        rows.append(dict(flags=dict(zip((n for _, n in flags), c)), default=c == default,
                         ttft_ms=med[0], gpu_ms=med[1], pre_ms=med[2], launch_ms=med[3], all_ttft_ms=ttft,
                         all_gpu_ms=gpu, all_pre_ms=pre, all_launch_ms=launch))
        mark = " (default)" if c == default else ""
        print("  " + "  ".join(f"{str(v):>11}" for v in c) + f"   {med[0]:7.3f}  {med[1]:7.3f}  {med[2]:7.3f}"
              f"  {med[3]:9.3f}  {' '.join(f'{t:.2f}' for t in ttft)}{mark}")
    print("per round (rounds x reps), default combination: pre ms " + " ".join(
        f"{x:.2f}" for x in rows[combos.index(default)]["all_pre_ms"]) + "; launch ms " + " ".join(
        f"{x:.2f}" for x in rows[combos.index(default)]["all_launch_ms"]))
    out = dict(device=torch.cuda.get_device_name(), rounds=a.rounds, reps=a.reps, rows=rows)
    if a.trace:  # which engine call takes the time that moves from one process to the next
        trace_all()
        runs = [stamped_request(eng, prompt, ONE) for prompt in third_requests(eng, V, 2 * a.reps, 5000)]
        out["timeline"] = timeline(runs, "hits")
        print(out["timeline"])
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
