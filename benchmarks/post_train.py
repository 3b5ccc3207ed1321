"""Post-training measurements (issue 18 item 5): held-out reward / pass rate per domain before SFT, after SFT
and after RL; mean counted length per effort (max → high → low chain); rollout tokens/s with and without
partial rollout, both from the same starting checkpoint in this run. Prints a table, writes JSON and the RL
runs' plots (rl.png) under --out.

    python benchmarks/post_train.py --out runs/bench-post            # k3-tiny on CPU, a few minutes
    python benchmarks/post_train.py --preset k3-small --sft-steps 300 --rl-steps 40 ...   # the GPU numbers

A random k3-tiny learns little in CPU minutes: the point of the tiny run is that every stage runs and is
measured the same way as on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3 import K3Config, K3ForConditionalGeneration  # noqa: E402
from k3.io.tokenizer import K3Tokenizer, default_tokenizer  # noqa: E402
from k3.post import tasks  # noqa: E402
from k3.post.effort import EFFORTS, BudgetTable, EffortBudget  # noqa: E402
from k3.post.rl import RLConfig, rl  # noqa: E402
from k3.post.rollout import RolloutRunner, derive_seed  # noqa: E402
from k3.post.sft import SFTConfig, sft  # noqa: E402
from k3.serve import Engine, EngineConfig  # noqa: E402
from k3.train.metrics import read_log  # noqa: E402
from k3.train.state import resolve_checkpoint  # noqa: E402


def sandbox_ok() -> bool:
    """The agent and coding tasks need the sandbox process tier (Linux, root, cgroups, overlayfs)."""
    from k3.env.process import ProcessTier
    return ProcessTier.available()[0]


def evaluate(ck: Path, domain: str, n: int, args, manager=None, effort: str = "high",
             budgets: BudgetTable | None = None) -> dict:
    """One seeded sample per held-out task of `domain` through the engine: pass rate, reward, counted length."""
    ck = resolve_checkpoint(ck)
    model = K3ForConditionalGeneration.from_pretrained(ck).to(args.device).eval()
    tok = K3Tokenizer.from_pretrained(ck)
    eng = Engine(model, EngineConfig(max_num_seqs=max(n, 1), max_model_len=4096, gpu_memory_fraction=0.25))
    make = None
    if manager is not None:
        from k3.env import Sandbox
        make = lambda: Sandbox.create(manager=manager)  # noqa: E731
    r = RolloutRunner(eng, tok, effort=effort, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                      max_total_tokens=args.max_total_tokens, sandboxes=make)
    ts = tasks.generate(domain, "test", n, args.task_seed)
    trajs = [r.start(t, f"e{i}", f"e{i}", derive_seed(args.seed, "bench-eval", t.id)) for i, t in enumerate(ts)]
    r.run(trajs)
    budget = EffortBudget.for_effort(effort)
    for t in trajs:
        b0 = budgets.b0.get(t.task.id) if budgets is not None else None
        r.score(t, budget if b0 else None, b0)
    k = len(trajs)
    return {"pass_rate": sum(t.score > 0 for t in trajs) / k, "reward": sum(t.reward for t in trajs) / k,
            "length": sum(t.counted for t in trajs) / k, "gen_tokens": sum(t.num_generated for t in trajs) / k}


def rl_run(ck, out: Path, domain: str, effort: str, args, **kw) -> dict:
    c = RLConfig(checkpoint=str(ck), out=str(out), domain=domain, effort=effort, steps=args.rl_steps,
                 prompts=args.prompts, samples=args.samples, pool=args.pool, eval_prompts=args.eval_n,
                 eval_every=args.rl_steps, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                 max_total_tokens=args.max_total_tokens, budget_samples=args.budget_samples, lr=args.rl_lr,
                 save_every=0, tensorboard=False, progress=args.progress, device=args.device, seed=args.seed,
                 task_seed=args.task_seed, **kw)
    s = rl(c)
    tr = [r for r in read_log(out / "log.jsonl") if r["kind"] == "train"]
    tok = sum(r["rollout_tokens"] for r in tr)
    sec = sum(r["rollout_s"] for r in tr)
    s["rollout_tokens_per_s_run"] = tok / sec if sec else 0.0
    s["paused_total"] = sum(r["paused"] for r in tr)
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-post")
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--domains", default=None, help="comma list (default: general, plus agent,coding when the "
                                                   "sandbox process tier is available)")
    p.add_argument("--sft-n", type=int, default=64, help="cold-start conversations per domain")
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--rl-steps", type=int, default=3)
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--pool", type=int, default=8)
    p.add_argument("--eval-n", type=int, default=8)
    p.add_argument("--budget-samples", type=int, default=2)
    p.add_argument("--lam", type=float, default=0.5, help="λ of the partial-rollout run")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-turn-tokens", type=int, default=48)
    p.add_argument("--max-total-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    have_sb = sandbox_ok()
    domains = args.domains.split(",") if args.domains else (["general", "agent", "coding"] if have_sb else ["general"])
    manager = None
    if have_sb and set(domains) - {"general"}:
        from k3.env import SandboxManager
        manager = SandboxManager(out / "sandboxes")
    res: dict = {"preset": args.preset, "device": args.device, "domains": domains, "settings": vars(args)}
    t0 = time.perf_counter()

    # 0. the starting model (random init of the preset) = "before SFT"
    base = out / "base"
    if not (base / "config.json").is_file():
        cfg = K3Config.preset(args.preset)
        cfg.vision_config = None
        torch.manual_seed(args.seed)
        m = K3ForConditionalGeneration(cfg)
        m.save_pretrained(base)
        default_tokenizer(cfg.text_config).save_pretrained(base)
    # 1. cold-start data (scripted demonstrations, real tool results) and SFT
    data = out / "cold_start.jsonl"
    convs = []
    for d in domains:
        for t in tasks.generate(d, "train", args.sft_n, args.task_seed):
            convs.append(tasks.solve(t, manager=manager) if d != "general" else tasks.solve(t))
    tasks.write_jsonl(convs, data)
    sft_out = out / "sft"
    sft(SFTConfig(checkpoint=str(base), sft_data=str(data), out=str(sft_out), steps=args.sft_steps, seq_len=2048,
                  save_every=0, eval_every=0, tensorboard=False, progress=args.progress, device=args.device,
                  effort="high"))
    # 2. per domain: before SFT, after SFT, after RL (effort max); the chain max → high → low for lengths
    for d in domains:
        row = {"before_sft": evaluate(base, d, args.eval_n, args, manager),
               "after_sft": evaluate(sft_out, d, args.eval_n, args, manager)}
        prev, budgets = sft_out, None
        for e in EFFORTS:
            run = out / f"rl-{d}-{e}"
            kw = {"budgets": str(out / f"rl-{d}-max" / "budgets.json")} if e != "max" else {}
            s = rl_run(prev, run, d, e, args, **kw)
            table = BudgetTable.load(run / "budgets.json")
            row[f"after_rl_{e}"] = evaluate(run, d, args.eval_n, args, manager, effort=e, budgets=table)
            row[f"rl_{e}_plot"] = s.get("plot")
            prev, budgets = run, table
        res[d] = row
    # 3. rollout throughput with and without partial rollout, same start, same settings otherwise
    d = domains[0]
    full = rl_run(sft_out, out / "tput-full", d, "max", args, lam=1.0)
    part = rl_run(sft_out, out / "tput-partial", d, "max", args, lam=args.lam)
    res["rollout_tokens_per_s"] = {"lambda_1": full["rollout_tokens_per_s_run"],
                                   f"lambda_{args.lam}": part["rollout_tokens_per_s_run"],
                                   "ratio": part["rollout_tokens_per_s_run"] / max(full["rollout_tokens_per_s_run"], 1e-9),
                                   "paused_total": part["paused_total"]}
    res["seconds"] = time.perf_counter() - t0
    if manager is not None:
        manager.shutdown()
    (out / "post_train.json").write_text(json.dumps(res, indent=2) + "\n")

    print(f"\n{'domain':8} {'stage':14} {'pass':>6} {'reward':>7} {'length':>7} {'gen tok':>8}")
    for dname in domains:
        for stage, v in res[dname].items():
            if isinstance(v, dict):
                print(f"{dname:8} {stage:14} {v['pass_rate']:6.3f} {v['reward']:7.3f} {v['length']:7.1f} "
                      f"{v['gen_tokens']:8.1f}")
    r = res["rollout_tokens_per_s"]
    print(f"\nrollout tokens/s: λ=1 {r['lambda_1']:.1f}, λ={args.lam} {r[f'lambda_{args.lam}']:.1f} "
          f"(x{r['ratio']:.2f}, {r['paused_total']} pauses); {res['seconds']:.0f} s; {out / 'post_train.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
