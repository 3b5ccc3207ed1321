"""Why a decode graph's replay can differ from its eager run (`test_cuda_graph_replay_equals_eager`): the test's
engine (optionally with `checkpoints_in_chunks`), then one decode step run eagerly twice, replayed from the graph
the engine's own steps captured, and replayed from a graph captured afresh now, each from the same pool bytes.
Prints which sequences' KDA state / conv pages differ from the first eager run (by how much, in which layers),
the global numerics flags at each capture and now, and the kernels a replay runs that the eager run does not.

    python benchmarks/probe/graph_determinism.py [--in-chunk]

What it found (2026-12-02): the test's eager run had autograd on, so the fused inference kernels (Triton KDA
decode, Triton router, grouped MoE) fell back to their differentiable paths: a different computation from the
graph the engine had captured under no_grad (with in-chunk checkpoints the engine's own steps capture the first
graph; without, the test did, also with grad on). `DecodeGraph.run` now always runs without autograd.
"""

from __future__ import annotations

import collections
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_tiny  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402
from k3.serve import runner as runner_mod  # noqa: E402
from k3.serve.runner import SeqInput  # noqa: E402


def flags() -> dict:
    b = torch.backends
    return {"tf32": b.cuda.matmul.allow_tf32, "fp32_prec": torch.get_float32_matmul_precision(),
            "bf16_red": b.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "fp16_red": b.cuda.matmul.allow_fp16_reduced_precision_reduction, "cudnn_tf32": b.cudnn.allow_tf32,
            "det": torch.are_deterministic_algorithms_enabled(), "blas": str(b.cuda.preferred_blas_library())}


CAPTURES = []


def log_captures(eng):
    init = runner_mod.DecodeGraph.__init__

    def logged(self, runner, batch, history, mempool):
        CAPTURES.append((eng.num_steps, batch, history, flags()))
        init(self, runner, batch, history, mempool)
    runner_mod.DecodeGraph.__init__ = logged


def kernels(fn) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main():
    model = make_tiny(seed=6).cuda().to(torch.bfloat16).eval()
    eng = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=128, max_num_batched_tokens=512,
                                     checkpoints_in_chunks="--in-chunk" in sys.argv))
    log_captures(eng)
    rng = random.Random(6)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(3, 300))] for _ in range(11)]
    rids = [eng.submit(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for p in prompts]
    while any(not eng.requests[r].output for r in rids):
        eng.step()
    print(f"checkpoints {eng.scheduler.checkpoints_saved}, steps {eng.num_steps}; flags now {flags()}")
    seqs = [eng.requests[r] for r in rids]
    inputs = [SeqInput(tokens=[s.tokens[-1]], start=s.num_tokens - 1, state_page=s.state_page,
                       mla_pages=s.mla_pages, want_logits=True) for s in seqs]
    r, pool = eng.runner, eng.pool
    old = r.graph_for(inputs)
    old_graphs = dict(r.graphs)  # kept alive: a fresh capture below, in a new memory pool
    r.graphs.clear()
    r._mempool = None
    fresh = r.graph_for(inputs)
    for step, b, h, f in CAPTURES:
        print(f"capture at engine step {step}: batch {b}, history {h}, flags {f}")
    before = pool.storage.clone()

    def eager():
        fresh.fill(inputs, r.scratch)
        fresh.buf.copy_(fresh.host)
        return fresh.run()[:len(seqs)].clone()

    modes = {"eager": eager, "eager again": eager, "replay (engine's graph)": lambda: old(inputs, r.scratch).clone(),
             "replay (fresh graph)": lambda: fresh(inputs, r.scratch).clone()}
    runs = {}
    for name, fn in modes.items():
        pool.storage.copy_(before)
        logits = fn()
        torch.cuda.synchronize()
        runs[name] = (logits, pool.state.clone(), pool.conv.clone())
    ref_logits, ref_state, ref_conv = runs["eager"]
    for mode, (logits, state, conv) in list(runs.items())[1:]:
        print(f"{mode}: logits equal to the first eager run: {torch.equal(logits, ref_logits)}")
        for s in seqs:
            p = s.state_page
            for name, a, b in (("state", state[p].float(), ref_state[p].float()),
                               ("conv", conv[p].float(), ref_conv[p].float())):
                d = (a - b).abs()
                if d.max() > 0:
                    layers = sorted(set(d.nonzero()[:, 0].tolist()))
                    print(f"  page {p} {name}: max diff {d.max().item():.3e} (max |x| {b.abs().max().item():.3e}), "
                          f"{int((d > 0).sum())} entries, KDA layers {layers}")
    ke = kernels(eager)
    for mode in ("replay (engine's graph)", "replay (fresh graph)"):
        pool.storage.copy_(before)
        kr = kernels(modes[mode])
        print(f"{mode}: {sum(kr.values())} kernels (eager {sum(ke.values())}); only in the replay: "
              f"{dict(kr - ke)}; only eager: {dict(ke - kr)}")
    del old_graphs


if __name__ == "__main__":
    main()
