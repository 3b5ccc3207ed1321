"""Greedy agreement of the bf16 engine with bf16 `model.generate` (and of each with fp32) on a checkpoint.

usage: python benchmarks/probe/agreement.py CHECKPOINT [N_PROMPTS] [NEW_TOKENS]   (CPU is fine for k3-tiny)
Prompts are the starts of held-out documents of the built-in corpus (in-distribution for the demo model)."""
import sys
import torch
from k3.data.corpus import builtin_corpus
from k3.io.tokenizer import K3Tokenizer
from k3.model import K3ForConditionalGeneration
from k3.serve import Engine, EngineConfig, SamplingParams
from k3.train.state import resolve_checkpoint

ck = resolve_checkpoint(sys.argv[1])
n, new = (int(sys.argv[2]) if len(sys.argv) > 2 else 16), (int(sys.argv[3]) if len(sys.argv) > 3 else 32)
tok = K3Tokenizer.from_pretrained(ck)
docs = [d.text for d in builtin_corpus(split="validation") if len(d.text) > 400][:n]
prompts = [[tok.bos_token_id] + tok.encode(d[:300])[:48] for d in docs]
res = {}
for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    m = K3ForConditionalGeneration.from_pretrained(ck, dtype=dt).eval()
    eng = Engine(m, EngineConfig(block_size=64, hash_block_size=16, num_pages=256, max_model_len=512))
    outs = eng.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    res[name, "engine"] = [o.token_ids for o in outs]
    res[name, "generate"] = [m.generate(torch.tensor([p]), max_new_tokens=new)[0, len(p):].tolist() for p in prompts]


def agree(a, b):
    pos = sum(x == y for u, v in zip(a, b) for x, y in zip(u, v)) / sum(len(u) for u in a)
    first = sum(u[0] == v[0] for u, v in zip(a, b)) / len(a)
    return f"{100 * pos:.1f} % of tokens, {100 * first:.0f} % of first tokens"


print(f"{ck}: {n} prompts x {new} greedy tokens")
for a, b in [(("fp32", "engine"), ("fp32", "generate")), (("bf16", "engine"), ("bf16", "generate")),
             (("bf16", "engine"), ("fp32", "generate")), (("bf16", "generate"), ("fp32", "generate"))]:
    print(f"  {a[0]} {a[1]:>8} vs {b[0]} {b[1]:>8}: {agree(res[a], res[b])}")
