"""Post-training measurements (issue 18 item 5), every stage in one run, every figure on held-out tasks.

    python benchmarks/post_train.py --out runs/bench-post                   # k3-tiny on the CPU (see docs)
    python benchmarks/post_train.py --preset k3-small --device cuda --no-checkpoints --time-budget 330 \
        --sft-steps 400 --sft-lr 1e-3 --rl-steps 10 --rl-lr 1e-4 --prompts 8 --samples 8 --pool 64 --eval-n 32

The chain: the starting model (a random init of --preset, or --base) → cold-start data from the built-in
tasks (scripted solutions whose reasoning length follows the effort: low < high < max) → `k3 sft` → rollout
throughput with and without partial rollout (two short RL runs from the SFT model; the first estimates the
cold-start budgets b₀ that the whole chain uses) → RL max → high → low on --rl-level tasks. After each stage
it evaluates one seeded sample per held-out task through the engine, per level and effort: pass rate, reward
(−1 over the effort budget, where the task has a b₀), counted length, generated tokens, the share of turns the
model ended itself (`<|end_of_msg|>`, not the token limit) and the share of answers in the `Answer: <value>`
format. Prints a table; writes post_train.json and the plots post_reward.png, post_pass.png, post_length.png
(and each RL run's rl.png) under --out.

--no-checkpoints: no trainer checkpoints and no optimizer state on disk; each stage hands its final weights
(bf16) to the next through one directory, and the previous stage's weights are deleted as soon as the next
stage has loaded them, so at most one model's weights are on disk (training runs on fp32 master weights).
--time-budget: the whole run's wall-clock seconds; each training stage gets a share of what is left and stops
early when it is spent (then still saves and is evaluated).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3 import K3Config, K3ForConditionalGeneration  # noqa: E402
from k3.io.tokenizer import K3Tokenizer, default_tokenizer  # noqa: E402
from k3.post import tasks  # noqa: E402
from k3.post.config import final_model_dir  # noqa: E402
from k3.post.effort import EFFORTS, BudgetTable, EffortBudget  # noqa: E402
from k3.post.rl import RLConfig, RLTrainer  # noqa: E402
from k3.post.rollout import RolloutRunner, derive_seed  # noqa: E402
from k3.post.sft import SFTConfig, SFTTrainer  # noqa: E402
from k3.post.tasks.base import has_answer_line  # noqa: E402
from k3.serve import Engine, EngineConfig  # noqa: E402
from k3.train.metrics import read_log  # noqa: E402
from k3.train.state import resolve_checkpoint  # noqa: E402

STAGES = ("before_sft", "after_sft", "after_rl_max", "after_rl_high", "after_rl_low")


def sandbox_ok() -> bool:
    """The agent and coding tasks need the sandbox process tier (Linux, root, cgroups, overlayfs)."""
    from k3.env.process import ProcessTier
    return ProcessTier.available()[0]


class Clock:
    """The run's deadline (--time-budget) and each training stage's share of what is left."""

    def __init__(self, budget_s: float | None):
        self.t0 = time.perf_counter()
        self.budget = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def share(self, weight: float, weights_left: float, reserve_s: float) -> float | None:
        """Seconds for a stage of `weight` among `weights_left` (its own included), `reserve_s` kept back for
        the evaluations and model loads still to come; None without a budget."""
        if self.budget is None:
            return None
        left = self.budget - self.elapsed() - reserve_s
        return max(5.0, left * weight / weights_left)


def evaluate(ck: Path, domain: str, level: str, effort: str, args, manager=None,
             budgets: BudgetTable | None = None) -> dict:
    """One seeded sample per held-out task of (domain, level) at `effort` through the engine."""
    ck = resolve_checkpoint(ck)
    model = K3ForConditionalGeneration.from_pretrained(ck).to(args.device).eval()
    if args.device.startswith("cuda"):
        model.cast(torch.bfloat16)
    tok = K3Tokenizer.from_pretrained(ck)
    n = args.eval_n
    eng = Engine(model, EngineConfig(max_num_seqs=max(n, 1), max_model_len=4096, gpu_memory_fraction=0.25))
    make = None
    if manager is not None:
        from k3.env import Sandbox
        make = lambda: Sandbox.create(manager=manager)  # noqa: E731
    r = RolloutRunner(eng, tok, effort=effort, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                      max_total_tokens=args.max_total_tokens, temperature=args.eval_temperature, sandboxes=make)
    ts = tasks.generate(domain, "test", n, args.task_seed, level)
    trajs = [r.start(t, f"e{i}", f"e{i}", derive_seed(args.seed, "bench-eval", t.id)) for i, t in enumerate(ts)]
    r.run(trajs)
    budget = EffortBudget.for_effort(effort)
    for t in trajs:
        b0 = budgets.b0.get(t.task.id) if budgets is not None else None
        r.score(t, budget if b0 else None, b0)
    k = len(trajs)
    del eng, model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"n": k, "pass_rate": sum(t.score > 0 for t in trajs) / k, "reward": sum(t.reward for t in trajs) / k,
            "length": sum(t.counted for t in trajs) / k, "gen_tokens": sum(t.num_generated for t in trajs) / k,
            "ended": sum(t.finish_reason in ("answer", "turns") for t in trajs) / k,
            "format": sum(has_answer_line(t.final_answer) for t in trajs) / k,
            "over_budget": sum(t.over_budget for t in trajs) / k,
            "example": trajs[0].final_answer[:120] if trajs else ""}


def build_base(args, out: Path) -> Path:
    """The starting checkpoint: --base as given, else a seeded random init of --preset (bf16 weights with
    --no-checkpoints, built on --device)."""
    if args.base:
        return resolve_checkpoint(args.base)
    base = out / "base"
    if not (base / "config.json").is_file():
        cfg = K3Config.preset(args.preset)
        cfg.vision_config = None
        torch.manual_seed(args.seed)
        with torch.device(args.device):
            m = K3ForConditionalGeneration(cfg)
        m.save_pretrained(base, **({"dtype": torch.bfloat16} if args.no_checkpoints else {}))
        default_tokenizer(cfg.text_config).save_pretrained(base)
        del m
    return base


def cold_start(domains: list[str], args, manager, path: Path) -> dict:
    """Scripted demonstrations of train tasks (every level of each domain), each written at every effort."""
    convs = []
    for d in domains:
        for level in tasks.LEVELS[d]:
            n = args.sft_n if level == "easy" else args.sft_n_standard
            for t in tasks.generate(d, "train", n, args.task_seed, level) if n else []:
                for e in EFFORTS:
                    convs.append(tasks.solve(t, manager=manager, effort=e) if d != "general"
                                 else tasks.solve(t, effort=e))
    tasks.write_jsonl(convs, path)
    return {"conversations": len(convs)}


def train_stage(trainer, drop: Path | None, args) -> dict:
    """Fit `trainer`; with --no-checkpoints, first delete `drop` (the weights it has just loaded)."""
    if args.no_checkpoints and drop is not None and drop.is_dir() and not args.base_is(drop):
        shutil.rmtree(drop)
    try:
        return trainer.fit()
    finally:
        if hasattr(trainer, "close"):
            trainer.close()
        del trainer
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def post_kw(args, limit: float | None) -> dict:
    kw = {"device": args.device, "seed": args.seed, "tensorboard": False, "progress": args.progress,
          "time_limit_s": limit, "save_every": 0}
    if args.no_checkpoints:
        kw.update(save_mode="weights", save_dtype="bfloat16", master_dtype="float32")
    return kw


def model_of(run: Path, args) -> Path:
    return final_model_dir(run) if args.no_checkpoints else resolve_checkpoint(run)


def rl_config(ck: Path, run: Path, domain: str, level: str, effort: str, steps: int, args, limit, save=True,
              **kw) -> RLConfig:
    pk = post_kw(args, limit)
    if not save:
        pk["save_mode"] = "none" if args.no_checkpoints else "full"
    return RLConfig(checkpoint=str(ck), out=str(run), domain=domain, level=level, effort=effort, steps=steps,
                    prompts=args.prompts, samples=args.samples, pool=args.pool, eval_prompts=args.eval_n,
                    eval_every=0, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                    max_total_tokens=args.max_total_tokens, budget_samples=args.budget_samples, lr=args.rl_lr,
                    temperature=args.temperature, task_seed=args.task_seed, **pk, **kw)


def rollout_rate(run: Path) -> dict:
    tr = [r for r in read_log(run / "log.jsonl") if r["kind"] == "train"]
    tok = sum(r["rollout_tokens"] for r in tr)
    sec = sum(r["rollout_s"] for r in tr)
    return {"tokens_per_s": tok / sec if sec else 0.0, "tokens": tok, "rollout_s": sec, "steps": len(tr),
            "paused": sum(r["paused"] for r in tr), "carried_last": tr[-1]["carried"] if tr else 0}


def plots(res: dict, out: Path) -> dict:
    """post_reward.png (RL train-batch reward and held-out reward per stage), post_pass.png (held-out pass
    rate per stage and level), post_length.png (counted length per effort after SFT and after RL)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = {}

    def save(fig, name: str) -> Path:
        fig.tight_layout()
        path = out / f"post_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    d = res["rl_domain"]
    fig, ax = plt.subplots(figsize=(8, 4))
    off = 0
    for e in EFFORTS:
        run = out / f"rl-{d}-{e}"
        tr = [r for r in read_log(run / "log.jsonl") if r["kind"] == "train"] if (run / "log.jsonl").is_file() else []
        xs = [off + r["step"] for r in tr]
        ax.plot(xs, [r["reward"] for r in tr], "o-", ms=3, label=f"RL {e}: train-batch reward")
        ax.plot(xs, [r["pass_rate"] for r in tr], ":", label=f"RL {e}: train-batch pass rate")
        off += len(tr)
    ax.set_xlabel("RL step (max → high → low)")
    ax.set_ylabel("reward / pass rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{res['preset']}: RL on {d}/{res['rl_level']} (budget rule: −1 over τ·b₀)")
    paths["reward"] = save(fig, "reward")

    fig, ax = plt.subplots(figsize=(8, 4))
    rows = [(dm, lv) for dm in res["domains"] for lv in tasks.LEVELS[dm]]
    w = 0.8 / max(len(rows), 1)
    for i, (dm, lv) in enumerate(rows):
        ys = [res["eval"][dm][lv].get(s, {}).get("pass_rate", 0.0) for s in STAGES]
        ax.bar([j + i * w for j in range(len(STAGES))], ys, w, label=f"{dm}/{lv}")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(STAGES))], [s.replace("_", " ") for s in STAGES], fontsize=8)
    ax.set_ylabel("held-out pass rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(f"{res['preset']}: held-out pass rate per stage (stage's own effort; before/after SFT: high)")
    paths["pass"] = save(fig, "pass")

    fig, ax = plt.subplots(figsize=(8, 4))
    ev = res["eval"][d][res["rl_level"]]
    sft = [ev["after_sft_by_effort"][e]["length"] for e in EFFORTS]
    rl = [ev[f"after_rl_{e}"]["length"] for e in EFFORTS]
    ax.bar([i - 0.2 for i in range(3)], sft, 0.4, label="after SFT")
    ax.bar([i + 0.2 for i in range(3)], rl, 0.4, label="after RL at that effort")
    ax.set_xticks(range(3), EFFORTS)
    ax.set_ylabel("mean counted tokens (thinking)" if d == "general" else "mean counted output tokens")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(f"{res['preset']}: length per effort, held-out {d}/{res['rl_level']}")
    paths["length"] = save(fig, "length")
    return {k: str(v) for k, v in paths.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-post")
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--base", default=None, help="start from this checkpoint or run dir (e.g. runs/demo) instead "
                                                "of a random init of --preset")
    p.add_argument("--domains", default="general", help="comma list of general, agent, coding (agent and "
                                                        "coding need the sandbox process tier)")
    p.add_argument("--rl-level", default=None, help="task level RL trains on (default: the domain's easiest)")
    p.add_argument("--sft-n", type=int, default=256, help="easy-level train tasks per domain, each at 3 efforts")
    p.add_argument("--sft-n-standard", type=int, default=64, help="standard-level train tasks, each at 3 efforts")
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-seq-len", type=int, default=2048)
    p.add_argument("--rl-steps", type=int, default=8)
    p.add_argument("--tput-steps", type=int, default=3, help="RL steps of each rollout-throughput run")
    p.add_argument("--rl-lr", type=float, default=3e-4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--eval-n", type=int, default=32)
    p.add_argument("--budget-samples", type=int, default=2)
    p.add_argument("--lam", type=float, default=0.5, help="λ of the partial-rollout run")
    p.add_argument("--temperature", type=float, default=1.0, help="RL sampling temperature")
    p.add_argument("--eval-temperature", type=float, default=0.0, help="held-out evaluation (0: greedy)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-turn-tokens", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--no-checkpoints", action="store_true",
                   help="no trainer checkpoints / optimizer state; at most one model's bf16 weights on disk")
    p.add_argument("--time-budget", type=float, default=None, help="wall-clock seconds for the whole run")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here")
    domains = args.domains.split(",")
    for d in domains:
        if d not in tasks.DOMAINS:
            p.error(f"--domains: {d!r} is not one of {', '.join(tasks.DOMAINS)}")
    rl_domain = domains[0]
    rl_level = args.rl_level or tasks.LEVELS[rl_domain][0]
    if rl_level not in tasks.LEVELS[rl_domain]:
        p.error(f"--rl-level {rl_level!r}: {rl_domain} has levels {', '.join(tasks.LEVELS[rl_domain])}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        p.error(f"--out {out} is not empty: every stage of this benchmark starts fresh (give a new --out)")
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.time_budget)
    manager = None
    if set(domains) - {"general"}:
        if not sandbox_ok():
            p.error("agent / coding need the sandbox process tier (k3.env), not available here")
        from k3.env import SandboxManager
        manager = SandboxManager(out / "sandboxes")
    base = build_base(args, out)
    args.base_is = lambda q: args.base is not None and Path(q).resolve() == base.resolve()  # never delete --base
    res: dict = {"preset": args.preset, "device": args.device, "domains": domains, "rl_domain": rl_domain,
                 "rl_level": rl_level, "settings": {k: v for k, v in vars(args).items() if k != "base_is"},
                 "eval": {d: {lv: {} for lv in tasks.LEVELS[d]} for d in domains}, "seconds": {}}
    levels = [(d, lv) for d in domains for lv in tasks.LEVELS[d]]
    t_eval = [0.0]

    def ev(stage: str, ck: Path, effort: str, budgets=None, key=None):
        t = time.perf_counter()
        for d, lv in levels:
            r = evaluate(ck, d, lv, effort, args, manager, budgets if (d, lv) == (rl_domain, rl_level) else None)
            if key is None:
                res["eval"][d][lv][stage] = {"effort": effort, **r}
            else:
                res["eval"][d][lv].setdefault(key, {})[effort] = r
        t_eval[0] = (time.perf_counter() - t) / max(len(levels), 1)   # seconds per level evaluation

    def reserve(evals_left: int) -> float:
        return 1.5 * t_eval[0] * evals_left * len(levels) + 5.0

    # 0. before SFT (effort high)
    ev("before_sft", base, "high")
    res["seconds"]["before_sft_eval"] = clock.elapsed()
    # 1. cold start and SFT
    data = out / "cold_start.jsonl"
    res["cold_start"] = cold_start(domains, args, manager, data)
    sft_run = out / "sft"
    weights = {"sft": 3.0, "tput": 0.5, "rl": 1.0}   # shares of the training time: SFT 3, each RL run 1
    left_w = weights["sft"] + 2 * weights["tput"] + 3 * weights["rl"]
    lim = clock.share(weights["sft"], left_w, reserve(1 + 3 + 3))
    t = time.perf_counter()
    s = train_stage(SFTTrainer(SFTConfig(checkpoint=str(base), sft_data=str(data), out=str(sft_run),
                                         steps=args.sft_steps, seq_len=args.sft_seq_len, lr=args.sft_lr,
                                         eval_every=0, effort=None, **post_kw(args, lim))), base, args)
    res["sft"] = {"steps": s.get("step"), "loss": s.get("loss"), "stopped_early": s.get("stopped_early"),
                  "seconds": time.perf_counter() - t, "time_limit_s": lim}
    sft_ck = model_of(sft_run, args)
    for e in EFFORTS:
        ev(None, sft_ck, e, key="after_sft_by_effort")
    for d, lv in levels:
        res["eval"][d][lv]["after_sft"] = {"effort": "high", **res["eval"][d][lv]["after_sft_by_effort"]["high"]}
    res["seconds"]["after_sft"] = clock.elapsed()
    # 2. rollout throughput with and without partial rollout, both from the SFT model (the first run
    #    estimates b₀ for the whole chain: the cold-start model's budgets)
    left_w -= weights["sft"]
    tput = {}
    for name, lam in (("full", 1.0), ("partial", args.lam)):
        lim = clock.share(weights["tput"], left_w, reserve(3))
        left_w -= weights["tput"]
        run = out / f"tput-{name}"
        kw = {} if name == "full" else {"budgets": str(out / "tput-full" / "budgets.json")}
        train_stage(RLTrainer(rl_config(sft_ck, run, rl_domain, rl_level, "max", args.tput_steps, args, lim,
                                        save=False, lam=lam, **kw)), None, args)
        tput[name] = {"lambda": lam, **rollout_rate(run)}
    tput["ratio"] = tput["partial"]["tokens_per_s"] / max(tput["full"]["tokens_per_s"], 1e-9)
    res["rollout_tokens_per_s"] = tput
    budgets_file = out / "tput-full" / "budgets.json"
    budgets = BudgetTable.load(budgets_file)
    # 3. RL chain max → high → low
    prev = sft_ck
    res["rl"] = {}
    for i, e in enumerate(EFFORTS):
        lim = clock.share(weights["rl"], left_w, reserve(3 - i))
        left_w -= weights["rl"]
        run = out / f"rl-{rl_domain}-{e}"
        t = time.perf_counter()
        s = train_stage(RLTrainer(rl_config(prev, run, rl_domain, rl_level, e, args.rl_steps, args, lim,
                                            budgets=str(budgets_file))), prev, args)
        tr = [r for r in read_log(run / "log.jsonl") if r["kind"] == "train"]
        res["rl"][e] = {"steps": s.get("step"), "stopped_early": s.get("stopped_early"), "time_limit_s": lim,
                        "seconds": time.perf_counter() - t, "plot": s.get("plot"),
                        "train_reward_first": tr[0]["reward"] if tr else None,
                        "train_reward_last": tr[-1]["reward"] if tr else None,
                        "train_reward_mean_first_half": sum(r["reward"] for r in tr[:len(tr) // 2]) / max(len(tr) // 2, 1),
                        "train_reward_mean_second_half": sum(r["reward"] for r in tr[len(tr) // 2:]) / max(len(tr) - len(tr) // 2, 1)}
        prev = model_of(run, args)
        ev(f"after_rl_{e}", prev, e, budgets)
    res["seconds"]["total"] = clock.elapsed()
    res["plots"] = plots(res, out)
    if manager is not None:
        manager.shutdown()
    (out / "post_train.json").write_text(json.dumps(res, indent=2) + "\n")
    print_table(res, args)
    return 0


def print_table(res: dict, args) -> None:
    print(f"\n{'domain/level':18} {'stage':16} {'effort':6} {'pass':>5} {'reward':>7} {'length':>7} {'gen':>6} "
          f"{'ended':>6} {'format':>6}")
    for d in res["domains"]:
        for lv in tasks.LEVELS[d]:
            ev = res["eval"][d][lv]
            rows = [(s, ev[s]) for s in ("before_sft", "after_sft")]
            rows += [(f"after_sft@{e}", ev["after_sft_by_effort"][e]) for e in EFFORTS]
            rows += [(s, ev[s]) for s in STAGES[2:]]
            for stage, v in rows:
                eff = v.get("effort", stage.split("@")[-1])
                print(f"{d + '/' + lv:18} {stage:16} {eff:6} {v['pass_rate']:5.2f} {v['reward']:7.3f} "
                      f"{v['length']:7.1f} {v['gen_tokens']:6.1f} {v['ended']:6.2f} {v['format']:6.2f}")
    for e, r in res["rl"].items():
        print(f"RL {e}: {r['steps']} steps{' (time limit)' if r['stopped_early'] else ''}, train-batch reward "
              f"first half {r['train_reward_mean_first_half']:.3f} → second half {r['train_reward_mean_second_half']:.3f}")
    t = res["rollout_tokens_per_s"]
    print(f"rollout tokens/s: λ=1 {t['full']['tokens_per_s']:.1f}, λ={args.lam} {t['partial']['tokens_per_s']:.1f} "
          f"(×{t['ratio']:.2f}, {t['partial']['paused']} pauses); SFT {res['sft']['steps']} steps, loss "
          f"{res['sft']['loss']}; {res['seconds']['total']:.0f} s; {Path(args.out) / 'post_train.json'}")


if __name__ == "__main__":
    sys.exit(main())
