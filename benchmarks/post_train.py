"""Post-training measurements (issue 18 item 5), every stage in one run, every figure on held-out tasks.

    python benchmarks/post_train.py --out runs/bench-post                   # k3-tiny on the CPU (see docs)
    OMP_NUM_THREADS=2 python benchmarks/post_train.py --out runs/bench-post-3dom --domains general,agent,coding \
        --levels easy --sft-steps 300 --sft-seq-len 768 --sft-n 96 --sft-n-standard 0 --eval-n 8 --pool 16 \
        --rl-steps 3 --tput-steps 1 --time-budget 660             # every domain, 2-core CPU: 390 s
    python benchmarks/post_train.py --preset k3-small --device cuda --no-checkpoints --time-budget 440 \
        --domains general,agent,coding --levels easy --sft-steps 400 --sft-lr 1e-3 --sft-n 192 \
        --sft-n-standard 0 --rl-steps 6 --rl-lr 1e-4 --prompts 8 --samples 8 --pool 64 --eval-n 32
                        # one H200, 457 s (benchmarks/run_post_gpu.sh; docs/benchmarks.md: too short to learn)

The chain: the starting model (a random init of --preset, or --base) → cold-start data from the built-in
tasks (scripted solutions whose reasoning length follows the effort: low < high < max) → `k3 sft` → rollout
throughput with and without partial rollout (two short RL runs from the SFT model on the first RL domain; the
first estimates that domain's cold-start budgets b₀) → RL in every --rl-domains domain on --rl-level tasks:
for each effort max → high → low, one RL run per domain in turn (general, agent, coding), each starting from
the previous run's weights; every domain's budgets b₀ come from the SFT (cold-start) model, as K3's recipe
has it: the first domain's from the λ = 1 throughput run, the others' from an estimate right after it (before
any RL), and every run of a domain uses them. After each stage (before SFT, after SFT, after each effort's runs) it evaluates one seeded sample
per held-out task of every domain and level through the engine (one engine for all of them), at the stage's
effort: pass rate, reward (−1 over the effort budget, for the RL domains' levels), counted length, generated
tokens, the share of episodes the model ended itself (an answer, or tool calls up to the turn limit; not a
token limit) and the share of answers in the `Answer: <value>` format. Prints a table; writes post_train.json
and the plots post_reward.png (train-batch reward of every RL run, one line per domain), post_pass.png
(held-out pass rate per stage, domain and level) and post_length.png (counted length per effort, one panel
per RL domain) under --out, and each RL run's rl.png.

Held-out tasks are the "test" split (a hash of the prompt, never in any train seed) of --task-seed. The SFT
data are "train" tasks of --task-seed; the RL pool is drawn with --rl-task-seed (default --task-seed + 1) and
its prompts are left out of the SFT data, so RL trains on prompts the SFT model has not seen.

Episode limits: turns of --max-turn-tokens (128) and --max-total-tokens (256) generated tokens per episode.
An easy agent episode (one cat or grep call and the answer) is 90–125 generated tokens, an easy coding one (one
write_file call and a one-line reply) 120–155 with turns of up to ~93: K3's chat markup of a tool call alone
is ~52 tokens with one argument and ~66 with two, so a 64-token turn (the old default) holds no grep or
write_file call.

--levels: the task levels to make cold-start data for and to evaluate (default: every level of each domain).
--rl-domains: the domains RL trains on, in this order (default: every domain of --domains).
--no-checkpoints: no trainer checkpoints and no optimizer state on disk; each stage hands its final weights
(bf16) to the next through one directory, and the previous stage's weights are deleted as soon as the next
stage has loaded them, so at most one model's weights are on disk (training runs on fp32 master weights).
--time-budget: the whole run's wall-clock seconds; each training stage gets a share of what is left (SFT 3,
each throughput run 0.5, each effort's RL runs 1 together, split evenly over the domains) after keeping back
the estimated time of the evaluations still to come, and stops early when it is spent (then still saves and
is evaluated).
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


def load_model(ck: Path, args):
    ck = resolve_checkpoint(ck)
    model = K3ForConditionalGeneration.from_pretrained(ck).to(args.device).eval()
    if args.device.startswith("cuda"):
        model.cast(torch.bfloat16)
    return model, K3Tokenizer.from_pretrained(ck)


def evaluate(model, tok, levels: list[tuple[str, str]], efforts: tuple[str, ...], args, manager=None,
             budgets: dict[str, BudgetTable] | None = None, budget_levels: set | None = None) -> dict:
    """One seeded sample per held-out task of every (domain, level) of `levels` at each of `efforts`, all
    through one engine run (a decode step costs about the same at any batch size on a GPU); the budget rule
    applies to the (domain, level) pairs of `budget_levels` with `budgets[domain]`.
    Returns {(domain, level, effort): metrics}."""
    n = args.eval_n
    eng = Engine(model, EngineConfig(max_num_seqs=max(n * len(levels) * len(efforts), 1), max_model_len=4096,
                                     gpu_memory_fraction=0.25))
    make = None
    if manager is not None:
        from k3.env import Sandbox
        make = lambda: Sandbox.create(manager=manager)  # noqa: E731
    r = RolloutRunner(eng, tok, effort=efforts[0], max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                      max_total_tokens=args.max_total_tokens, temperature=args.eval_temperature, sandboxes=make)
    trajs = {(d, lv, e): [r.start(t, f"e-{d}-{lv}-{e}-{i}", f"e-{d}-{lv}-{e}-{i}",
                                  derive_seed(args.seed, "bench-eval", t.id), effort=e)
                          for i, t in enumerate(tasks.generate(d, "test", n, args.task_seed, lv))]
             for d, lv in levels for e in efforts}
    r.run([t for ts in trajs.values() for t in ts])
    out = {}
    for (d, lv, e), ts in trajs.items():
        budget = EffortBudget.for_effort(e)
        table = budgets.get(d) if budgets is not None and (d, lv) in (budget_levels or ()) else None
        for t in ts:
            b0 = table.b0.get(t.task.id) if table is not None else None
            r.score(t, budget if b0 else None, b0)
        k = max(len(ts), 1)
        out[(d, lv, e)] = {
            "n": len(ts), "pass_rate": sum(t.score > 0 for t in ts) / k, "reward": sum(t.reward for t in ts) / k,
            "length": sum(t.counted for t in ts) / k, "gen_tokens": sum(t.num_generated for t in ts) / k,
            "ended": sum(t.finish_reason in ("answer", "turns") for t in ts) / k,
            "format": sum(has_answer_line(t.final_answer) for t in ts) / k,
            "over_budget": sum(t.over_budget for t in ts) / k,
            "example": ts[0].final_answer[:120] if ts else ""}
    del eng, r
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


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


def cold_start(levels: list[tuple[str, str]], args, manager, path: Path, exclude: set[str]) -> dict:
    """Scripted demonstrations of train tasks (--sft-n per easy level, --sft-n-standard per standard level of
    `levels`), each written at every effort; tasks whose id is in `exclude` (the RL pools) are left out."""
    convs, left_out = [], 0
    for d, level in levels:
        n = args.sft_n if level == "easy" else args.sft_n_standard
        for t in tasks.generate(d, "train", n, args.task_seed, level) if n else []:
            if t.id in exclude:
                left_out += 1
                continue
            for e in EFFORTS:
                convs.append(tasks.solve(t, manager=manager, effort=e))
    tasks.write_jsonl(convs, path)
    return {"conversations": len(convs), "rl_pool_tasks_left_out": left_out}


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
                    temperature=args.temperature, task_seed=args.rl_task_seed, eval_task_seed=args.task_seed,
                    **pk, **kw)


def train_log(run: Path) -> list[dict]:
    """The train records of an RL run's log ([] when it has none)."""
    return [r for r in read_log(run / "log.jsonl") if r["kind"] == "train"] if (run / "log.jsonl").is_file() else []


def estimate_b0(ck: Path, run: Path, domain: str, level: str, args) -> Path:
    """The cold-start budgets b₀ of `domain`'s RL pool and held-out tasks from the model at `ck` (the RL
    trainer's own estimate, without training); returns the budgets.json written under `run`."""
    trainer = RLTrainer(rl_config(ck, run, domain, level, "max", 1, args, None, save=False))
    try:
        trainer.estimate_budgets()
    finally:
        trainer.close()
        del trainer
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return run / "budgets.json"


def rollout_rate(run: Path) -> dict:
    tr = train_log(run)
    tok = sum(r["rollout_tokens"] for r in tr)
    sec = sum(r["rollout_s"] for r in tr)
    return {"tokens_per_s": tok / sec if sec else 0.0, "tokens": tok, "rollout_s": sec, "steps": len(tr),
            "paused": sum(r["paused"] for r in tr), "carried_last": tr[-1]["carried"] if tr else 0}


def plots(res: dict, out: Path) -> dict:
    """post_reward.png (train-batch reward and pass rate of every RL run: one panel per effort, one line per
    domain), post_pass.png (held-out pass rate per stage, domain and level), post_length.png (counted length
    per effort after SFT and after RL, one panel per RL domain)."""
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

    doms = res["rl_domains"]
    fig, axes = plt.subplots(1, len(EFFORTS), figsize=(12, 4), sharey=True)
    for ax, e in zip(axes, EFFORTS):
        for i, d in enumerate(doms):
            tr = train_log(out / f"rl-{d}-{e}")
            xs = [r["step"] for r in tr]
            ax.plot(xs, [r["reward"] for r in tr], "o-", ms=3, color=f"C{i}", label=f"{d}: reward")
            ax.plot(xs, [r["pass_rate"] for r in tr], ":", color=f"C{i}", label=f"{d}: pass rate")
        ax.set_xlabel("RL step")
        ax.set_title(f"RL {e}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("train-batch reward / pass rate")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{res['preset']}: RL max → high → low, one run per domain (budget rule: −1 over τ·b₀)")
    paths["reward"] = save(fig, "reward")

    fig, ax = plt.subplots(figsize=(8, 4))
    rows = [tuple(x) for x in res["levels"]]
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

    fig, axes = plt.subplots(1, len(doms), figsize=(4 * len(doms), 4), squeeze=False)
    for ax, d in zip(axes[0], doms):
        lv = res["rl_levels"][d]
        ev = res["eval"][d][lv]
        sft = [ev["after_sft_by_effort"][e]["length"] for e in EFFORTS]
        rl = [ev.get(f"after_rl_{e}", {}).get("length", 0.0) for e in EFFORTS]
        ax.bar([i - 0.2 for i in range(3)], sft, 0.4, label="after SFT")
        ax.bar([i + 0.2 for i in range(3)], rl, 0.4, label="after RL at that effort")
        ax.set_xticks(range(3), EFFORTS)
        ax.set_ylabel("mean counted tokens (thinking)" if d == "general" else "mean counted output tokens")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        ax.set_title(f"held-out {d}/{lv}", fontsize=9)
    fig.suptitle(f"{res['preset']}: length per effort")
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
    p.add_argument("--levels", default=None, help="comma list of the task levels (easy, standard) to make cold-start "
                                                  "data for and to evaluate (default: every level)")
    p.add_argument("--rl-domains", default=None, help="comma list of the domains RL trains on, in this order, "
                                                      "each a domain of --domains (default: all of --domains)")
    p.add_argument("--rl-level", default=None, help="task level RL trains on (default: each domain's easiest)")
    p.add_argument("--sft-n", type=int, default=256, help="easy-level train tasks per domain, each at 3 efforts")
    p.add_argument("--sft-n-standard", type=int, default=64, help="standard-level train tasks, each at 3 efforts")
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-seq-len", type=int, default=2048)
    p.add_argument("--rl-steps", type=int, default=8, help="steps of each RL run (one per domain and effort)")
    p.add_argument("--tput-steps", type=int, default=3, help="RL steps of each rollout-throughput run")
    p.add_argument("--rl-lr", type=float, default=3e-4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--pool", type=int, default=32, help="RL train tasks per domain (left out of the SFT data)")
    p.add_argument("--eval-n", type=int, default=32, help="held-out tasks per domain and level")
    p.add_argument("--budget-samples", type=int, default=2)
    p.add_argument("--lam", type=float, default=0.5, help="λ of the partial-rollout run")
    p.add_argument("--temperature", type=float, default=1.0, help="RL sampling temperature")
    p.add_argument("--eval-temperature", type=float, default=0.0, help="held-out evaluation (0: greedy)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-turn-tokens", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-seed", type=int, default=0, help="seed of the SFT data and the held-out tasks")
    p.add_argument("--rl-task-seed", type=int, default=None, help="seed of the RL pools (default: --task-seed + 1)")
    p.add_argument("--device", default=None)
    p.add_argument("--no-checkpoints", action="store_true",
                   help="no trainer checkpoints / optimizer state; at most one model's bf16 weights on disk")
    p.add_argument("--time-budget", type=float, default=None, help="wall-clock seconds for the whole run")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here")
    if args.rl_task_seed is None:
        args.rl_task_seed = args.task_seed + 1
    domains = args.domains.split(",")
    for d in domains:
        if d not in tasks.DOMAINS:
            p.error(f"--domains: {d!r} is not one of {', '.join(tasks.DOMAINS)}")
    rl_domains = args.rl_domains.split(",") if args.rl_domains else list(domains)
    for d in rl_domains:
        if d not in domains:
            p.error(f"--rl-domains: {d!r} is not one of --domains ({', '.join(domains)})")
    wanted = args.levels.split(",") if args.levels else None
    levels = [(d, lv) for d in domains for lv in tasks.LEVELS[d] if wanted is None or lv in wanted]
    for d in domains:
        if not any(dm == d for dm, _ in levels):
            p.error(f"--levels {args.levels}: {d} has levels {', '.join(tasks.LEVELS[d])}")
    rl_levels = {d: args.rl_level or tasks.LEVELS[d][0] for d in rl_domains}
    for d, lv in rl_levels.items():
        if lv not in tasks.LEVELS[d]:
            p.error(f"--rl-level {lv!r}: {d} has levels {', '.join(tasks.LEVELS[d])}")
        if (d, lv) not in levels:
            p.error(f"--rl-level {lv!r} is not evaluated: add it to --levels")
    first = rl_domains[0]
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
    res: dict = {"preset": args.preset, "device": args.device, "domains": domains, "levels": levels,
                 "rl_domains": rl_domains, "rl_levels": rl_levels, "rl_domain": first, "rl_level": rl_levels[first],
                 "settings": {k: v for k, v in vars(args).items() if k != "base_is"},
                 "eval": {d: {lv: {} for dm, lv in levels if dm == d} for d in domains}, "seconds": {}}
    rl_pairs = set(rl_levels.items())
    t_eval = [0.0]

    def ev(stage: str, ck: Path, efforts: tuple[str, ...], budgets=None):
        """Evaluate every level at each of `efforts` (one model load); more than one effort: the results go
        under `<stage>_by_effort`, else under `stage`."""
        t = time.perf_counter()
        model, tok = load_model(ck, args)
        for (d, lv, effort), r in evaluate(model, tok, levels, efforts, args, manager, budgets, rl_pairs).items():
            if len(efforts) == 1:
                res["eval"][d][lv][stage] = {"effort": effort, **r}
            else:
                res["eval"][d][lv].setdefault(f"{stage}_by_effort", {})[effort] = r
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        t_eval[0] = (time.perf_counter() - t) / (len(levels) * len(efforts))   # seconds per level evaluation

    def reserve(evals_left: int) -> float:
        return 1.5 * t_eval[0] * evals_left * len(levels) + 5.0

    # 0. before SFT (effort high)
    ev("before_sft", base, ("high",))
    res["seconds"]["before_sft_eval"] = clock.elapsed()
    # 1. cold start (without the RL pools' prompts) and SFT
    data = out / "cold_start.jsonl"
    pools = {t.id for d in rl_domains for t in tasks.generate(d, "train", args.pool, args.rl_task_seed, rl_levels[d])}
    res["cold_start"] = cold_start(levels, args, manager, data, pools)
    sft_run = out / "sft"
    # shares of the training time: SFT 3, each throughput run 0.5, each effort's RL runs 1 (split over domains)
    weights = {"sft": 3.0, "tput": 0.5, "rl": 1.0 / len(rl_domains)}
    left_w = weights["sft"] + 2 * weights["tput"] + 3 * len(rl_domains) * weights["rl"]
    lim = clock.share(weights["sft"], left_w, reserve(1 + 3 + 3))
    t = time.perf_counter()
    s = train_stage(SFTTrainer(SFTConfig(checkpoint=str(base), sft_data=str(data), out=str(sft_run),
                                         steps=args.sft_steps, seq_len=args.sft_seq_len, lr=args.sft_lr,
                                         eval_every=0, effort=None, **post_kw(args, lim))), base, args)
    res["sft"] = {"steps": s.get("step"), "loss": s.get("loss"), "stopped_early": s.get("stopped_early"),
                  "seconds": time.perf_counter() - t, "time_limit_s": lim}
    sft_ck = model_of(sft_run, args)
    ev("after_sft", sft_ck, EFFORTS)
    for d, lv in levels:
        res["eval"][d][lv]["after_sft"] = {"effort": "high", **res["eval"][d][lv]["after_sft_by_effort"]["high"]}
    res["seconds"]["after_sft"] = clock.elapsed()
    # 2. rollout throughput with and without partial rollout, both from the SFT model on the first RL domain
    #    (the first run estimates that domain's b₀: the cold-start model's budgets)
    left_w -= weights["sft"]
    tput = {}
    for name, lam in (("full", 1.0), ("partial", args.lam)):
        lim = clock.share(weights["tput"], left_w, reserve(3))
        left_w -= weights["tput"]
        run = out / f"tput-{name}"
        kw = {} if name == "full" else {"budgets": str(out / "tput-full" / "budgets.json")}
        train_stage(RLTrainer(rl_config(sft_ck, run, first, rl_levels[first], "max", args.tput_steps, args, lim,
                                        save=False, lam=lam, **kw)), None, args)
        tput[name] = {"lambda": lam, **rollout_rate(run)}
    tput["ratio"] = tput["partial"]["tokens_per_s"] / max(tput["full"]["tokens_per_s"], 1e-9)
    res["rollout_tokens_per_s"] = tput
    # 3. b₀ of every other RL domain, also from the SFT (cold-start) model, before any RL changes it
    budget_files = {first: out / "tput-full" / "budgets.json"}
    t = time.perf_counter()
    for d in rl_domains[1:]:
        budget_files[d] = estimate_b0(sft_ck, out / f"b0-{d}", d, rl_levels[d], args)
    res["seconds"]["b0_other_domains"] = time.perf_counter() - t
    # 4. RL max → high → low; at each effort one run per domain in turn, each from the previous run's weights
    prev = sft_ck
    res["rl"] = {d: {} for d in rl_domains}
    for i, e in enumerate(EFFORTS):
        for d in rl_domains:
            lim = clock.share(weights["rl"], left_w, reserve(3 - i))
            left_w -= weights["rl"]
            run = out / f"rl-{d}-{e}"
            kw = {"budgets": str(budget_files[d])} if budget_files[d].is_file() else {}
            t = time.perf_counter()
            s = train_stage(RLTrainer(rl_config(prev, run, d, rl_levels[d], e, args.rl_steps, args, lim, **kw)),
                            prev, args)
            tr = train_log(run)
            h = len(tr) // 2
            res["rl"][d][e] = {"steps": s.get("step"), "stopped_early": s.get("stopped_early"), "time_limit_s": lim,
                               "seconds": time.perf_counter() - t, "plot": s.get("plot"),
                               "budgets": str(budget_files[d]),
                               "train_reward_first": tr[0]["reward"] if tr else None,
                               "train_reward_last": tr[-1]["reward"] if tr else None,
                               "train_reward_mean_first_half": sum(r["reward"] for r in tr[:h]) / max(h, 1),
                               "train_reward_mean_second_half": sum(r["reward"] for r in tr[h:]) / max(len(tr) - h, 1)}
            prev = model_of(run, args)
        ev(f"after_rl_{e}", prev, (e,), {d: BudgetTable.load(f) for d, f in budget_files.items()})
        res["seconds"][f"after_rl_{e}"] = clock.elapsed()
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
    for d, lv in res["levels"]:
        ev = res["eval"][d][lv]
        rows = [(s, ev[s]) for s in ("before_sft", "after_sft")]
        rows += [(f"after_sft@{e}", ev["after_sft_by_effort"][e]) for e in EFFORTS]
        rows += [(s, ev[s]) for s in STAGES[2:]]
        for stage, v in rows:
            eff = v.get("effort", stage.split("@")[-1])
            print(f"{d + '/' + lv:18} {stage:16} {eff:6} {v['pass_rate']:5.2f} {v['reward']:7.3f} "
                  f"{v['length']:7.1f} {v['gen_tokens']:6.1f} {v['ended']:6.2f} {v['format']:6.2f}")
    for d, runs in res["rl"].items():
        for e, r in runs.items():
            print(f"RL {d}/{res['rl_levels'][d]} {e}: {r['steps']} steps{' (time limit)' if r['stopped_early'] else ''}"
                  f", {r['seconds']:.0f} s, train-batch reward first half {r['train_reward_mean_first_half']:.3f} → "
                  f"second half {r['train_reward_mean_second_half']:.3f}")
    t = res["rollout_tokens_per_s"]
    c = res["cold_start"]
    print(f"rollout tokens/s ({res['rl_domain']}): λ=1 {t['full']['tokens_per_s']:.1f}, λ={args.lam} "
          f"{t['partial']['tokens_per_s']:.1f} (×{t['ratio']:.2f}, {t['partial']['paused']} pauses); cold start "
          f"{c['conversations']} conversations ({c['rl_pool_tasks_left_out']} RL-pool tasks left out); SFT "
          f"{res['sft']['steps']} steps, loss {res['sft']['loss']}; {res['seconds']['total']:.0f} s; "
          f"{Path(args.out) / 'post_train.json'}")


if __name__ == "__main__":
    sys.exit(main())
