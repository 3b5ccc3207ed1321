"""Greedy-token agreement of the serving engine with `model.generate()` on a (trained) checkpoint, and why
they part where they do (issue 15 item 4).

Two bf16 forwards that round differently (the engine's packed / paged / CUDA-graph path and generate's
contiguous-cache path) pick the same greedy token wherever the top two logits are clearly apart, and may pick
differently at a near-tie; after the first difference the two continuations are different texts. So this
reports, over chat prompts of held-out built-in tasks (the chat format the checkpoint was post-trained on):
  - the share of generated positions where both picked the same token, and of sequences identical throughout;
  - at each sequence's first difference: the gap between the top-1 and top-2 logits of generate's own forward
    (bf16 model, the logits in fp32), against the same gap at all agreeing positions: near-ties explain it;
  - the same comparison in fp32 (engine eager), where the tokens must agree exactly (the exactness check).

    python benchmarks/agreement.py --checkpoint runs/post/rl-general-low --device cuda --out agreement.json
    python benchmarks/agreement.py --checkpoint runs/demo --source corpus --device cuda  # `make demo`'s model
    python benchmarks/agreement.py --preset k3-tiny --device cpu --n 4 --new-tokens 16   # random weights, smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3 import K3Config, K3ForConditionalGeneration  # noqa: E402
from k3.io import chat  # noqa: E402
from k3.io.tokenizer import K3Tokenizer, default_tokenizer  # noqa: E402
from k3.post import tasks  # noqa: E402
from k3.post.config import final_model_dir  # noqa: E402
from k3.serve import Engine, EngineConfig, SamplingParams  # noqa: E402
from k3.train.state import resolve_checkpoint  # noqa: E402


def load(args):
    """(model, tokenizer, where from): --checkpoint (a model dir, a run dir with `model/` or checkpoints), else a
    seeded random init of --preset."""
    if args.checkpoint:
        p = Path(args.checkpoint)
        ck = final_model_dir(p) if (final_model_dir(p) / "config.json").is_file() else resolve_checkpoint(p)
        return K3ForConditionalGeneration.from_pretrained(ck), K3Tokenizer.from_pretrained(ck), str(ck)
    cfg = K3Config.preset(args.preset)
    cfg.vision_config = None
    torch.manual_seed(args.seed)
    return K3ForConditionalGeneration(cfg), default_tokenizer(cfg.text_config), f"random {args.preset}"


def prompts(tok, args) -> list[list[int]]:
    """--source tasks: chat prompts (generation prompt included) of held-out tasks of each --domains entry at its
    easiest level; --source corpus: the first 64 tokens of validation documents of the built-in corpus (for a
    pre-trained checkpoint such as `make demo`'s)."""
    if args.source == "corpus":
        from k3.data.corpus import builtin_corpus
        docs = [d for d in builtin_corpus(split="validation") if len(d.text) > 400][:args.n]
        return [tok.encode(d.text)[:64] for d in docs]
    out = []
    domains = args.domains.split(",")
    for d in domains:
        for t in tasks.generate(d, "test", -(-args.n // len(domains)), args.task_seed, tasks.LEVELS[d][0]):
            out.append(chat.encode(tok, [dict(m) for m in t.messages], t.tools, add_generation_prompt=True,
                                   thinking_effort=args.effort))
    return out[:args.n]


@torch.no_grad()
def compare(model, ps: list[list[int]], args, device) -> dict:
    """Engine vs generate, greedy; generate runs the prompts as one left-padded batch (each row gets the tokens
    it would get alone) and neither stops at an end token."""
    eng = Engine(model, EngineConfig(max_num_seqs=len(ps), max_model_len=4096, gpu_memory_fraction=0.3))
    outs = eng.generate(ps, SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True))
    del eng
    L = max(map(len, ps))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in ps], device=device)
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps], device=device)
    refs = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens)[:, L:].tolist()
    same_pos, first_gap, agree_gap, whole = 0, [], [], 0
    for p, o, ref in zip(ps, outs, refs):
        got = list(o.token_ids)
        same = [a == b for a, b in zip(got, ref)]
        same_pos += sum(same)
        whole += all(same) and len(got) == len(ref)
        # generate's own logits along its continuation: the top-1 / top-2 gap at each generated position
        logits = model(torch.tensor([p + ref[:-1]], device=device)).logits[0, len(p) - 1:].float()
        top2 = logits.topk(2, dim=-1).values
        gap = (top2[:, 0] - top2[:, 1]).tolist()
        k = next((i for i, s in enumerate(same) if not s), None)
        agree_gap += gap[:k] if k is not None else gap
        if k is not None:
            first_gap.append(gap[k])
    n = sum(len(o.token_ids) for o in outs)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"prompts": len(ps), "new_tokens": args.new_tokens, "token_agreement": same_pos / max(n, 1),
            "identical_sequences": whole / len(ps), "first_difference_gap_median": med(first_gap),
            "first_difference_gaps": first_gap, "agreeing_gap_median": med(agree_gap),
            "agreeing_gap_p10": sorted(agree_gap)[len(agree_gap) // 10] if agree_gap else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="model dir or run dir (default: a random init of --preset)")
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--source", default="tasks", choices=("tasks", "corpus"), help="where the prompts come from")
    ap.add_argument("--domains", default="general", help="comma list: held-out tasks whose chat prompts are used")
    ap.add_argument("--effort", default="high", choices=("low", "high", "max"))
    ap.add_argument("--n", type=int, default=32, help="prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--task-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 exactness comparison")
    ap.add_argument("--bf16", action="store_true", help="also compare in bf16 on the CPU (always on CUDA)")
    ap.add_argument("--out", default="agreement.json")
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.n < 1 or a.new_tokens < 1:
        ap.error(f"--n {a.n} and --new-tokens {a.new_tokens} must be ≥ 1")
    model, tok, src = load(a)
    model = model.to(device).eval()
    ps = prompts(tok, a)
    res = {"model": src, "device": device, "prompt_tokens_mean": sum(map(len, ps)) / len(ps)}
    if not a.no_fp32:
        res["fp32"] = compare(model.float(), ps, a, device)
    if device.startswith("cuda") or a.bf16:
        res["bf16"] = compare(model.cast(torch.bfloat16) or model, ps, a, device)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    for k in ("fp32", "bf16"):
        if k in res:
            r = res[k]
            print(f"{k}: token agreement {100 * r['token_agreement']:.1f} %, identical sequences "
                  f"{100 * r['identical_sequences']:.1f} % of {r['prompts']}; top-1/top-2 logit gap at the first "
                  f"difference: median {r['first_difference_gap_median']}, at agreeing positions: median "
                  f"{r['agreeing_gap_median']}, 10th percentile {r['agreeing_gap_p10']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
