"""Where a prefill's small kernels come from: every aten op of one eager cold prefill (the ops its CUDA graph
records), counted by op and by the innermost `k3/` source line that called it, through a `TorchDispatchMode`
(the profiler's stack grouping shows no k3 frames under the ops' `eager_op` wrappers). The 8K prefill graph
holds 880 kernels, about 1.4 ms of its wall is not kernel time, and among them are 103 memsets and ~75 index /
arange / fill kernels (session 20's profile): this names the lines that launch them.

    python benchmarks/probe/small_ops.py [--tokens 8192] [--ops zero_ fill_ arange index] --out small_ops.json
    python benchmarks/probe/small_ops.py --device cpu --preset k3-tiny --tokens 256   # a dry run, no GPU
    python benchmarks/probe/small_ops.py --device cpu --preset k3-tiny --hit 4096 --tokens 64   # a hit's host ops
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve import build, rand_prompts  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
# aten ops that do no arithmetic worth a kernel of their own: what fusing or removing would save launches on
SMALL = ("zero_", "fill_", "zeros", "arange", "index", "index_select", "index_put", "gather", "scatter", "copy_",
         "cat", "stack", "where", "clone", "cumsum", "floor_divide", "remainder", "clamp", "masked_fill", "full")


class Sites(TorchDispatchMode):
    """Counts each aten op (overload packet name) and, for the ones matching `want`, its innermost k3 frame."""

    def __init__(self, want: tuple[str, ...]):
        super().__init__()
        self.want, self.ops, self.sites = want, collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if any(name == w or name.startswith(w + "_") or name == w + "_" for w in self.want):
            frames = [f for f in traceback.extract_stack()[:-1] if "/k3/" in f.filename]
            where = frames[-1] if frames else None
            site = f"{where.filename.split('/k3/')[-1]}:{where.lineno} {where.line}" if where else "(outside k3)"
            self.sites[(name, site)] += 1
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="small_ops.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ops", nargs="*", default=list(SMALL), help="aten ops whose call sites are listed")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--hit", type=int, default=0, metavar="PREFIX",
                    help="count a prefix hit instead: PREFIX cached tokens + --tokens new ones, through the extend "
                         "graph's code path run eagerly (the ops its graph records)")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = build(a.preset, a.device, dtype)
    V = model.config.text_config.vocab_size
    eng = Engine(model, EngineConfig(hash_block_size=512, block_size=6144, max_num_batched_tokens=8192,
                                     max_num_seqs=32, enable_prefix_caching=True,
                                     **(dict(gpu_memory_fraction=0.5) if a.device == "cuda" else dict(num_pages=16))))
    mode = Sites(tuple(a.ops))
    if a.hit:
        eng.runner.enable_graphs()
        prefix = rand_prompts(1, a.hit, V, 1)[0]
        for seed in (2, 3):  # the first computes the prefix, the second hits (warm-up, captures the graph)
            eng.generate([prefix + rand_prompts(1, a.tokens, V, seed)[0]], ONE)
        for g in eng.runner.graphs.values():  # replays would hide the ops: run each captured forward eagerly
            g.graph = None
        with mode:
            out = eng.generate([prefix + rand_prompts(1, a.tokens, V, 4)[0]], ONE)
        what = f"a prefix hit ({out[0].num_cached_tokens} cached + {a.tokens} new tokens)"
    else:
        eng.runner.use_prefill_graphs = False  # the eager forward: the ops its graph would record, visible here
        eng.generate([rand_prompts(1, a.tokens, V, 1)[0]], ONE)  # warm-up (compiles, caches)
        eng.reset_prefix_cache()
        with mode:
            eng.generate([rand_prompts(1, a.tokens, V, 2)[0]], ONE)
        what = f"one cold {a.tokens}-token prefill, eager"
    print(f"{a.preset} on {a.device}, {what}: {sum(mode.ops.values())} aten ops")
    for name, n in mode.ops.most_common(40):
        print(f"  {n:6d}  {name}")
    print(f"call sites of {', '.join(a.ops)}:")
    rows = [dict(op=op, site=site, calls=n) for (op, site), n in mode.sites.most_common(a.top)]
    for r in rows:
        print(f"  {r['calls']:5d}  {r['op']:<14} {r['site'][:120]}")
    Path(a.out).write_text(json.dumps(dict(ops=dict(mode.ops.most_common()), sites=rows), indent=1))


if __name__ == "__main__":
    main()
