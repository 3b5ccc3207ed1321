"""Probe: which bf16 path is far from fp32 on random k3-small (CUDA): fast forward, step-by-step forward, engine."""
import sys, torch
sys.path.insert(0, "benchmarks")
from serve import build, rand_prompts
from k3.serve import Engine, EngineConfig, SamplingParams
DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
m32 = build("k3-small", DEV, torch.float32)
m16 = build("k3-small", DEV, torch.bfloat16)
V = m16.config.text_config.vocab_size
p = rand_prompts(1, int(sys.argv[2]) if len(sys.argv) > 2 else 128, V, 10)[0]
ids = torch.tensor([p], device=DEV)
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
with torch.no_grad():
    r32 = m32(ids).logits[0, -1].float()
    f16 = m16(ids).logits[0, -1]
    print("fp32 logits std %.4f mean %.4f" % (r32.std().item(), r32.mean().item()))
    print("bf16 fast forward vs fp32 %.4f" % rel(f16, r32))
    for l in m16.language_model.model.decoder_layers:
        if l.is_kda: l.self_attn.fast = False
    s16 = m16(ids).logits[0, -1]
    print("bf16 step-by-step forward vs fp32 %.4f" % rel(s16, r32))
    for l in m16.language_model.model.decoder_layers:
        if l.is_kda: l.self_attn.fast = True
    h = m32.language_model.model(m32.language_model.model.embed_tokens(ids))[0]
    print("fp32 pre-norm hidden rms per position (first, last)", h[0, 0].pow(2).mean().sqrt().item(), h[0, -1].pow(2).mean().sqrt().item())
eng = Engine(m16, EngineConfig(hash_block_size=512, block_size=6144, max_num_batched_tokens=8192, max_num_seqs=4,
                               gpu_memory_fraction=0.3, record_logits=True))
o = eng.generate([p], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
print("bf16 engine vs fp32 %.4f" % rel(eng.recorded_logits[o.request_id][0].to(DEV), r32))
eng32 = Engine(m32, EngineConfig(hash_block_size=512, block_size=6144, max_num_batched_tokens=8192, max_num_seqs=4,
                                 gpu_memory_fraction=0.3, record_logits=True))
o = eng32.generate([p], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
print("fp32 engine vs fp32 forward %.6f" % rel(eng32.recorded_logits[o.request_id][0].to(DEV), r32))
