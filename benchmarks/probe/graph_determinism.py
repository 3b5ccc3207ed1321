"""Why a decode graph's replay can differ from its eager run (`test_cuda_graph_replay_equals_eager`): the test's
engine (optionally with `checkpoints_in_chunks`), then one decode step run eagerly twice and replayed twice
from the same pool bytes; prints which sequences' KDA state / conv pages differ from the first eager run, by
how much and in which layers.

    python benchmarks/probe/graph_determinism.py [--in-chunk] [--trace-kda]

--trace-kda: every call of the Triton KDA decode kernel also copies its inputs and the indexed states before
and after into side buffers (copies captured into the graph too), so the first differing tensor is named.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_tiny  # noqa: E402

from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402
from k3.serve.runner import SeqInput  # noqa: E402


TRACE: dict[int, dict[str, torch.Tensor]] = {}
CALL = [0]


def trace_decode_kernel():
    """Wrap the Triton decode launcher: copy q, k, v, f, beta and the indexed states (before / after) per call."""
    import k3.ops.kda.triton as kt
    inner = kt.kda_decode_triton

    def traced(q, k, v, g, beta, state, state_indices=None, **kw):
        i = CALL[0]
        CALL[0] += 1
        rows = state[state_indices] if state_indices is not None else state
        named = {"q": q, "k": k, "v": v, "f": g, "beta": beta, "state_before": rows}
        bufs = TRACE.setdefault(i, {n: torch.empty_like(x) for n, x in named.items()})
        for n, x in named.items():
            bufs[n].copy_(x)
        o = inner(q, k, v, g, beta, state, state_indices=state_indices, **kw)
        after = state[state_indices] if state_indices is not None else state
        bufs.setdefault("state_after", torch.empty_like(after)).copy_(after)
        bufs.setdefault("o", torch.empty_like(o)).copy_(o)
        return o
    kt.kda_decode_triton = traced


def main():
    if "--trace-kda" in sys.argv:
        trace_decode_kernel()
    model = make_tiny(seed=6).cuda().to(torch.bfloat16).eval()
    eng = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=128, max_num_batched_tokens=512,
                                     checkpoints_in_chunks="--in-chunk" in sys.argv))
    rng = random.Random(6)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(3, 300))] for _ in range(11)]
    rids = [eng.submit(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for p in prompts]
    while any(not eng.requests[r].output for r in rids):
        eng.step()
    print(f"checkpoints {eng.scheduler.checkpoints_saved}, steps {eng.num_steps}")
    seqs = [eng.requests[r] for r in rids]
    inputs = [SeqInput(tokens=[s.tokens[-1]], start=s.num_tokens - 1, state_page=s.state_page,
                       mla_pages=s.mla_pages, want_logits=True) for s in seqs]
    eng.runner.graphs.clear()  # capture now, with the trace in place
    g, pool = eng.runner.graph_for(inputs), eng.pool
    before = pool.storage.clone()
    runs, traces = [], []
    for mode in ("eager", "eager", "replay", "replay"):
        pool.storage.copy_(before)
        CALL[0] = 0
        if mode == "eager":
            g.fill(inputs, eng.runner.scratch)
            g.buf.copy_(g.host)
            logits = g.run()[:len(seqs)].clone()
        else:
            logits = g(inputs, eng.runner.scratch).clone()
        torch.cuda.synchronize()
        runs.append((mode, logits, pool.state.clone(), pool.conv.clone()))
        traces.append({i: {n: x.clone() for n, x in b.items()} for i, b in TRACE.items()})
    _, ref_logits, ref_state, ref_conv = runs[0]
    n = len(seqs)
    for (mode, *_), tr in zip(runs[1:], traces[1:]):
        for i in sorted(tr):
            diff = [f"{name} {(x[:n].float() - traces[0][i][name][:n].float()).abs().max().item():.2e}"
                    for name, x in tr[i].items() if not torch.equal(x[:n], traces[0][i][name][:n])]
            print(f"{mode}: decode call {i}: " + (", ".join(diff) if diff else "inputs and outputs equal"))
    for mode, logits, state, conv in runs[1:]:
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


if __name__ == "__main__":
    main()
