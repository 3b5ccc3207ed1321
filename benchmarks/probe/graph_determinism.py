"""Why a decode graph replay can differ from its eager run: the test engine of test_cuda_graph_replay_equals_eager
(optionally with checkpoints_in_chunks), then eager twice and replay twice from the same pool bytes; prints
which state / conv pages differ, by how much and in which layers.

    python benchmarks/probe/graph_determinism.py [--in-chunk]
"""
import random, sys, torch
sys.path.insert(0, "tests")
from conftest import make_tiny
from k3.serve import Engine, EngineConfig, SamplingParams
from k3.serve.runner import SeqInput
model = make_tiny(seed=6).cuda().to(torch.bfloat16).eval()
eng = Engine(model, EngineConfig(block_size=64, hash_block_size=16, num_pages=128, max_num_batched_tokens=512,
                                 checkpoints_in_chunks="--in-chunk" in sys.argv))
rng = random.Random(6)
prompts = [[rng.randrange(4000) for _ in range(rng.randrange(3, 300))] for _ in range(11)]
rids = [eng.submit(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for p in prompts]
while any(not eng.requests[r].output for r in rids):
    eng.step()
print("ckpts", eng.scheduler.checkpoints_saved, "steps", eng.num_steps)
seqs = [eng.requests[r] for r in rids]
inputs = [SeqInput(tokens=[s.tokens[-1]], start=s.num_tokens - 1, state_page=s.state_page, mla_pages=s.mla_pages, want_logits=True) for s in seqs]
g = eng.runner.graph_for(inputs)
P = eng.pool
before = P.storage.clone()
outs = []
for mode in ("eager", "eager", "replay", "replay"):
    P.storage.copy_(before)
    if mode == "eager":
        g.fill(inputs, eng.runner.scratch); g.buf.copy_(g.host); lg = g.run()[:11].clone()
    else:
        lg = g(inputs, eng.runner.scratch).clone()
    torch.cuda.synchronize()
    outs.append((mode, lg, P.state.clone(), P.conv.clone()))
ref = outs[0]
for mode, lg, st, cv in outs[1:]:
    print(mode, "logits equal", torch.equal(lg, ref[1]))
    for s in seqs:
        p = s.state_page
        d = (st[p] - ref[2][p]).abs()
        if d.max() > 0:
            nz = d.nonzero()
            print(f"  page {p}: state max diff {d.max().item():.3e} (ref max {ref[2][p].abs().max().item():.3e}), layers {sorted(set(nz[:,0].tolist()))}, n {len(nz)}")
        dc = (cv[p].float() - ref[3][p].float()).abs()
        if dc.max() > 0:
            print(f"  page {p}: conv max diff {dc.max().item():.3e}, layers {sorted(set(dc.nonzero()[:,0].tolist()))}")
