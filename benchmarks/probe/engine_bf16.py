"""Probe: engine vs model.generate vs the full forward, k3-small bf16 on CUDA (first tokens + logits error)."""
import sys, torch
sys.path.insert(0, "benchmarks")
from serve import build, rand_prompts
from k3.serve import Engine, EngineConfig, SamplingParams
m = build("k3-small", "cuda", torch.bfloat16)
V = m.config.text_config.vocab_size
ps = rand_prompts(4, 128, V, 10)
eng = Engine(m, EngineConfig(hash_block_size=512, block_size=6144, max_num_batched_tokens=8192, max_num_seqs=8,
                             gpu_memory_fraction=0.3, record_logits=True))
outs = eng.generate(ps, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
gen = m.generate(torch.tensor(ps, device="cuda"), max_new_tokens=4)[:, 128:].tolist()
for p, o, g in zip(ps, outs, gen):
    ids = torch.tensor([p + o.token_ids], device="cuda")
    with torch.no_grad():
        ref = m(ids).logits[0, 127:131].float()
    el = torch.stack(eng.recorded_logits[o.request_id]).float().cuda()
    err = ((el - ref).norm() / ref.norm()).item()
    print("engine", o.token_ids, "generate", g, "forward argmax", ref.argmax(-1).tolist(), "rel err engine-vs-forward %.4f" % err,
          "top2 gap %.4f" % (ref[0].topk(2).values.diff().abs().item()))
