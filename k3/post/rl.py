"""`k3 rl`: RL of one expert policy (domain × effort) with effort budgets and partial rollout (K3_SPEC §8.2–8.4).

One iteration (= one optimizer step):
1. top up to N groups in flight (a group = one train task × K samples; paused and finished-but-waiting
   trajectories of earlier iterations are carried over, paused ones resumed first);
2. roll out through the in-process `Engine` (its own copy of the policy, synced in place with
   `Engine.update_weights` after every step, never through disk) until ⌈λ·N·K⌉ trajectories have finished
   and at least one group is complete; the unfinished rest is paused (engine state to host, sandbox paused);
3. score each finished trajectory: the verifier's reward, −1 over the effort budget τ·b₀(x) (`effort.py`);
4. every complete group goes to the learner: advantages A = r − mean(r_group) (optionally / std), and the
   token-mean of a clipped PPO objective over model-generated tokens only (never prompts or tool results),
   the ratio taken against the behaviour log-probs the engine returned; tokens sampled by an older policy
   (the pre-pause part of a partial rollout) also get the local regulariser ½·β·(log π − log μ)² ("kl",
   default) or are left out ("mask").

The pre-training `Trainer` supplies the optimizer, schedule, QK-clip, router balancing, atomic checkpoints
and metrics; the RL state (task cursor, policy version, every carried trajectory with its paused engine
state and sandbox snapshot) is the checkpoint's "data" entry, so a resumed run continues bitwise (CPU, fp32).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .._atomic import atomic_write
from ..train.metrics import MetricsLog, read_log
from ..train.state import latest_checkpoint, latest_step
from ..train.trainer import Trainer, TrainingDiverged, finished_summary, preflight
from . import tasks
from .config import PostTrainConfig, PostTrainMixin
from .effort import EFFORTS, BudgetTable, EffortBudget, base_budget
from .rollout import RolloutRunner, Trajectory, derive_seed, from_state, to_state

STALE_MODES = ("kl", "mask")


# ---------------------------------------------------------------------------------------------- the objective

def group_advantages(rewards: torch.Tensor, normalize_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """[G, K] rewards → [G, K] advantages r − mean over the group (÷ (population std + eps) if asked)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    a = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        a = a / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return a


def token_objective(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, stale: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.28, kl_coef: float = 0.1,
                    stale_mode: str = "kl") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss terms and their weights (1 = counts, 0 = masked) for model-generated tokens.

    ratio ρ = exp(log π − log μ); pg = −min(ρ·A, clip(ρ, 1 − clip_low, 1 + clip_high)·A); stale tokens
    (sampled by an older policy than the one being updated) add ½·kl_coef·(log π − log μ)² ("kl") or get
    weight 0 ("mask"). The caller sums terms·weights and divides by the step's total weight."""
    if stale_mode not in STALE_MODES:
        raise ValueError(f"stale_mode {stale_mode!r} is not one of {', '.join(STALE_MODES)}")
    d = logp - old_logp
    ratio = torch.exp(d)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    stale = stale.to(logp.dtype)
    if stale_mode == "kl":
        return pg + 0.5 * kl_coef * d.square() * stale, torch.ones_like(logp)
    return pg, 1 - stale


# ---------------------------------------------------------------------------------------------- config

@dataclass
class RLConfig(PostTrainConfig):
    """TrainConfig with RL's defaults, plus the rollout, budget and objective settings; `checkpoint`: the SFT
    (cold-start) checkpoint dir or a run dir (its latest)."""

    domain: str = "general"
    effort: str = "max"
    level: str = "standard"       # task level (`tasks.LEVELS[domain]`) of the pool and the held-out tasks
    prompts: int = 4              # N: groups in flight per iteration
    samples: int = 4              # K: samples per prompt
    lam: float = 1.0              # λ: stop once ⌈λ·N·K⌉ trajectories finished (1: no partial rollout)
    tau: float | None = None      # budget multiplier (None: the effort's default)
    budget_cap: float | None = None  # absolute token cap (None: the effort's default; max only)
    budgets: str | None = None    # budgets JSON from an earlier run of the chain (b₀ of the cold-start model)
    budget_samples: int = 4       # cold-start samples per question for b₀
    min_b0: float = 16.0
    pool: int = 64                # train tasks drawn from the generator
    task_seed: int = 0
    eval_task_seed: int | None = None  # seed of the held-out (test) tasks (None: task_seed)
    max_turns: int = 4
    max_turn_tokens: int = 256
    max_total_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.1
    stale: str = "kl"
    adv_std: bool = False
    micro_tokens: int = 4096      # tokens per learner forward (trajectories packed with document boundaries)
    eval_prompts: int = 8         # held-out tasks for the pass rate (0: no evaluation)
    engine_dtype: str | None = None  # None: bfloat16 on CUDA, the policy's dtype on CPU
    # RL defaults of TrainConfig's fields
    seq_len: int | None = 1024
    steps: int = 20
    lr: float | None = 1e-4
    warmup_frac: float = 0.0
    weight_decay: float = 0.0
    mtp_weight: float = 0.0
    out: str = "runs/rl"
    eval_every: int = 10
    sample_every: int = 0
    save_every: int = 10

    def resolved(self) -> "RLConfig":
        ck = self.checkpoint_dir()
        if self.domain not in tasks.DOMAINS:
            raise ValueError(f"domain {self.domain!r} is not one of {', '.join(tasks.DOMAINS)}")
        if self.effort not in EFFORTS:
            raise ValueError(f"effort {self.effort!r} is not one of {', '.join(EFFORTS)}")
        if self.level not in tasks.LEVELS[self.domain]:
            raise ValueError(f"level {self.level!r} is not one of {', '.join(tasks.LEVELS[self.domain])} "
                             f"(domain {self.domain!r})")
        self.check_post()
        if not 0 < self.lam <= 1:
            raise ValueError(f"lambda={self.lam}: expected in (0, 1]")
        if self.stale not in STALE_MODES:
            raise ValueError(f"stale={self.stale!r}: expected one of {', '.join(STALE_MODES)}")
        for n in ("prompts", "samples", "pool", "budget_samples", "max_turns", "max_turn_tokens",
                  "max_total_tokens", "micro_tokens"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{n}={v!r}: expected an integer >= 1")
        for n in ("clip_low", "clip_high", "kl_coef", "eval_prompts"):
            if getattr(self, n) < 0:
                raise ValueError(f"{n}={getattr(self, n)}: expected >= 0")
        if self.budgets and not Path(self.budgets).is_file():
            raise FileNotFoundError(f"budgets {self.budgets!r} does not exist (expected a JSON file such as "
                                    "a k3 rl run's budgets.json)")
        EffortBudget.for_effort(self.effort, self.tau, self.budget_cap)  # checks tau / cap
        return self.from_checkpoint(ck)


# ---------------------------------------------------------------------------------------------- the trainer

class RLTrainer(PostTrainMixin, Trainer):
    """`Trainer` whose step is one RL iteration; see the module docstring. `reward_fn(trajectory) -> float`
    replaces the verifier (tests, custom rewards); the budget rule still applies."""

    progress_desc = "k3 rl"

    def __init__(self, cfg: RLConfig, reward_fn: Callable[[Trajectory], float] | None = None):
        from ..serve import Engine
        from ..serve.engine import EngineConfig
        super().__init__(cfg)
        cfg = self.cfg
        if self.world > 1:
            raise ValueError(f"k3 rl runs on one process (got WORLD_SIZE={self.world}): the learner does not "
                             "synchronise gradients across ranks yet")
        self._post_init()
        self.reward_fn = reward_fn
        self.budget = EffortBudget.for_effort(cfg.effort, cfg.tau, cfg.budget_cap)
        self.pool = tasks.generate(cfg.domain, "train", cfg.pool, cfg.task_seed, cfg.level)
        eval_seed = cfg.task_seed if cfg.eval_task_seed is None else cfg.eval_task_seed
        self.eval_tasks = tasks.generate(cfg.domain, "test", cfg.eval_prompts, eval_seed, cfg.level) \
            if cfg.eval_prompts else []
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(
            cfg.engine_dtype or "", torch.bfloat16 if self.device.type == "cuda" else None)
        emodel = copy.deepcopy(self.model).eval().requires_grad_(False)
        if dtype is not None:
            emodel.cast(dtype)  # the serving dtype; the release's fp32 parameters (gates, norms, convs) stay fp32
        emodel.gradient_checkpointing_enable(False)
        n = cfg.prompts * cfg.samples
        # the pool takes a quarter of the free GPU memory: the learner's forward / backward needs the rest
        self.engine = Engine(emodel, EngineConfig(gpu_memory_fraction=0.25,
                                                  max_num_seqs=max(n, cfg.budget_samples * 8, cfg.eval_prompts, 1),
                                                  max_model_len=min(emodel.config.text_config.max_position_embeddings,
                                                                    cfg.seq_len + cfg.max_total_tokens + 1024)))
        self.manager = None
        if cfg.domain != "general":
            from ..env import SandboxManager
            self.manager = SandboxManager(self.run_dir / "sandboxes")
            for s in self.manager.list():   # leftovers of a crashed process: snapshots are what we resume from
                self.manager.kill(s["sandbox_id"])
        self.runner = RolloutRunner(self.engine, self.tokenizer, effort=cfg.effort, max_turns=cfg.max_turns,
                                    max_turn_tokens=cfg.max_turn_tokens, max_total_tokens=cfg.max_total_tokens,
                                    temperature=cfg.temperature, top_p=cfg.top_p,
                                    sandboxes=self._new_sandbox if self.manager else None)
        self.cursor = 0                    # groups drawn so far
        self.carry: list[Trajectory] = []  # paused and finished-but-waiting trajectories
        self.budgets = BudgetTable()
        self.stage_idx = 0

    def _new_sandbox(self):
        from ..env import Sandbox
        return Sandbox.create(manager=self.manager)

    def _restore_sandbox(self, snapshot_id: str):
        from ..env import Sandbox
        return Sandbox.restore(snapshot_id, manager=self.manager)

    # ---- Trainer hooks: the "data" of a checkpoint is the RL state ---------------------------------------
    def _enter_stage(self, idx: int, data_state: dict | None = None) -> None:
        self.stage_idx = idx
        if data_state is not None:
            self.cursor = data_state["cursor"]
            self.runner.version = data_state["version"]
            for t in self.carry:
                self.runner.release(t)
            self.carry = [from_state(d, self._restore_sandbox) for d in data_state["carry"]]

    def _data_state(self) -> dict:
        return {"cursor": self.cursor, "version": self.runner.version, "carry": [to_state(t) for t in self.carry]}

    def evaluate(self) -> dict | None:
        """Held-out pass rate, mean reward (budget rule included) and mean counted length: one sample per
        test task with fixed seeds."""
        if not self.eval_tasks:
            return None
        trajs = [self.runner.start(t, f"eval-{i}", f"eval-{self.step}-{i}", derive_seed(self.cfg.seed, "eval", t.id))
                 for i, t in enumerate(self.eval_tasks)]
        self.runner.run(trajs)
        for t in trajs:
            self.runner.score(t, self.budget, self.budgets.b0.get(t.task.id), self.reward_fn)
        return {"pass_rate": sum(t.score > 0 for t in trajs) / len(trajs),
                "reward": sum(t.reward for t in trajs) / len(trajs),
                "length": sum(t.counted for t in trajs) / len(trajs),
                "gen_tokens": sum(t.num_generated for t in trajs) / len(trajs)}

    # ---- budgets ---------------------------------------------------------------------------------------
    def estimate_budgets(self) -> None:
        """b₀ for every pool / eval task without one, from the current (= starting) model; cached."""
        path = self.run_dir / "budgets.json"
        if path.is_file():
            self.budgets = BudgetTable.load(path)
        elif self.cfg.budgets:
            self.budgets = BudgetTable.load(self.cfg.budgets)
        todo = [t for t in self.pool + self.eval_tasks if t.id not in self.budgets]
        if todo:
            K = self.cfg.budget_samples
            trajs = [self.runner.start(t, f"b0-{t.id}", f"b0-{t.id}-{k}", derive_seed(self.cfg.seed, "b0", t.id, k))
                     for t in todo for k in range(K)]
            self.runner.run(trajs)
            for t in trajs:
                self.runner.score(t, reward_fn=self.reward_fn)
            est = {}
            for i, task in enumerate(todo):
                g = trajs[i * K:(i + 1) * K]
                est[task.id] = base_budget([t.counted for t in g], [t.score > 0 for t in g], self.cfg.min_b0)
            self.budgets.update(est)
        if self.rank == 0:
            self.budgets.save(path)

    # ---- one iteration ---------------------------------------------------------------------------------
    def _draw(self) -> list[Trajectory]:
        """New groups topping the carried ones up to N; task order: a seeded permutation of the pool per epoch."""
        cfg = self.cfg
        have = len({t.group for t in self.carry})
        new = []
        for _ in range(max(0, cfg.prompts - have)):
            g = self.cursor
            epoch, pos = divmod(g, len(self.pool))
            order = list(range(len(self.pool)))
            random.Random(derive_seed(cfg.seed, "epoch", epoch)).shuffle(order)
            task = self.pool[order[pos]]
            for k in range(cfg.samples):
                uid = f"g{g}-s{k}"
                new.append(self.runner.start(task, f"g{g}", uid, derive_seed(cfg.seed, "traj", uid)))
            self.cursor += 1
        return new

    def rollout(self) -> tuple[list[list[Trajectory]], dict]:
        """Steps 1–3 of the module docstring: complete groups (in group order) and rollout metrics."""
        cfg = self.cfg
        trajs = self.carry + self._draw()
        K = cfg.samples

        def groups_done(ts) -> bool:
            by: dict[str, int] = {}
            for t in ts:
                by[t.group] = by.get(t.group, 0) + t.finished
            return any(v == K for v in by.values())
        target = math.ceil(cfg.lam * len(trajs) - 1e-9)
        stats = self.runner.run(trajs, stop_at=target, stop_when=groups_done)
        for t in trajs:
            if t.finished and t.reward is None:
                self.runner.score(t, self.budget, self.budgets[t.task.id], self.reward_fn)
        by: dict[str, list[Trajectory]] = {}
        for t in trajs:
            by.setdefault(t.group, []).append(t)
        done = [g for g in by.values() if all(t.finished for t in g)]
        done.sort(key=lambda g: int(g[0].group[1:]))
        self.carry = [t for g in by.values() if not all(t.finished for t in g) for t in g]
        return done, {"rollout_tokens": stats.generated_tokens, "rollout_s": stats.seconds,
                      "rollout_tokens_per_s": stats.tokens_per_s, "paused": stats.paused,
                      "carried": len(self.carry)}

    def _micro_batches(self, items: list[tuple[Trajectory, float]]):
        cur, n = [], 0
        for it in items:
            L = len(it[0].tokens)
            if cur and n + L > self.cfg.micro_tokens:
                yield cur
                cur, n = [], 0
            cur.append(it)
            n += L
        if cur:
            yield cur

    def learn(self, groups: list[list[Trajectory]]) -> dict:
        """Step 4: accumulate the objective's gradient over micro-batches (token mean over the step)."""
        cfg = self.cfg
        rewards = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float64)
        adv = group_advantages(rewards, cfg.adv_std)
        items = [(t, adv[i, k].item()) for i, g in enumerate(groups) for k, t in enumerate(g)]
        version = self.runner.version

        def weight_of(t: Trajectory) -> int:
            if cfg.stale == "kl":
                return sum(t.gen[1:])
            return sum(1 for j in range(1, len(t.tokens)) if t.gen[j] and t.versions[j] >= version)
        total = sum(weight_of(t) for t, _ in items)
        acc = torch.zeros(6, dtype=torch.float64)  # loss, ratio sum, clipped, stale, sq log-ratio, tokens
        if total == 0:
            return {"loss": 0.0, "loss_tokens": 0}
        for mb in self._micro_batches(items):
            ids = torch.tensor([x for t, _ in mb for x in t.tokens], device=self.device)[None]
            lens = [len(t.tokens) for t, _ in mb]
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=self.device)
            with self.autocast:
                logits = self.model(ids, cu_seqlens=cu).logits
            logp_all = torch.log_softmax(logits[0].float(), dim=-1)
            pos, tgt, old, a, st = [], [], [], [], []
            off = 0
            for (t, A), L in zip(mb, lens):
                for j in range(1, L):
                    if t.gen[j]:
                        pos.append(off + j - 1)
                        tgt.append(t.tokens[j])
                        old.append(t.logprobs[j])
                        a.append(A)
                        st.append(t.versions[j] < version)
                off += L
            if not pos:
                continue
            dev = logp_all.device
            logp = logp_all[torch.tensor(pos, device=dev), torch.tensor(tgt, device=dev)]
            old_t = torch.tensor(old, dtype=logp.dtype, device=dev)
            adv_t = torch.tensor(a, dtype=logp.dtype, device=dev)
            stale = torch.tensor(st, device=dev)
            terms, w = token_objective(logp, old_t, adv_t, stale, cfg.clip_low, cfg.clip_high, cfg.kl_coef, cfg.stale)
            loss = (terms * w).sum() / total
            loss.backward()
            with torch.no_grad():
                d = (logp - old_t).double()
                r = d.exp()
                clipped = ((r < 1 - cfg.clip_low) & (adv_t < 0)) | ((r > 1 + cfg.clip_high) & (adv_t > 0))
                acc += torch.stack([loss.detach().double().cpu(), r.sum().cpu(), clipped.sum().double().cpu(),
                                    stale.sum().double().cpu(), d.square().sum().cpu(),
                                    torch.tensor(float(len(pos)), dtype=torch.float64)])
        n = max(acc[5].item(), 1.0)
        return {"loss": acc[0].item(), "loss_tokens": int(total), "ratio_mean": acc[1].item() / n,
                "clip_frac": acc[2].item() / n, "stale_frac": acc[3].item() / n, "sq_log_ratio": acc[4].item() / n}

    # ---- the loop --------------------------------------------------------------------------------------
    def fit(self) -> dict:
        from tqdm import tqdm
        cfg = self.cfg
        resumed = self.try_resume()
        if resumed and self.step >= cfg.steps:
            return finished_summary(self.run_dir, self.step)
        self._start_clock()
        self.estimate_budgets()
        log = MetricsLog(self.run_dir, cfg.tensorboard, resume_step=self.step) if self.rank == 0 else None
        if self.rank == 0:
            atomic_write(self.run_dir / "train_config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, self.step + cfg.stop_after)
        bar = tqdm(total=cfg.steps, initial=self.step, desc=self.progress_desc, unit="step", dynamic_ncols=True,
                   disable=not cfg.progress or self.rank != 0)
        params = [p for p in self.model.parameters() if p.requires_grad]
        last: dict = {}
        v = None
        try:
            if self.step == 0 and cfg.eval_every:
                v = self.evaluate()
                if v is not None:
                    log.write("val", 0, **v)
            while self.step < end and not self._time_up():
                t0 = time.perf_counter()
                groups, rstats = self.rollout()
                flat = [t for g in groups for t in g]
                t1 = time.perf_counter()
                lstats = self.learn(groups)
                max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
                gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
                if not (math.isfinite(lstats["loss"]) and math.isfinite(gnorm)):
                    raise TrainingDiverged(f"step {self.step + 1}: non-finite loss or gradient norm (loss="
                                           f"{lstats['loss']}, grad_norm={gnorm}); the last good checkpoint is kept "
                                           f"({latest_checkpoint(self.run_dir) or 'none written yet'})")
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                if self.qkclip:  # their statistics are not logged here: no host read of them
                    self.qkclip.step(sync=False)
                if self.balance:  # (a QB histogram range error is raised by the next step, or below at the end)
                    self.balance.step(sync=False)
                self.step += 1
                self.runner.version += 1
                self.engine.update_weights(self.model)
                n = len(flat)
                last = {"reward": sum(t.reward for t in flat) / n, "pass_rate": sum(t.score > 0 for t in flat) / n,
                        "over_budget": sum(t.over_budget for t in flat) / n,
                        "length": sum(t.counted for t in flat) / n,
                        "gen_tokens": sum(t.num_generated for t in flat) / n,
                        "turns": sum(t.turns for t in flat) / n, "groups": len(groups), "trajectories": n,
                        "grad_norm": gnorm, "lr": self.sched.get_last_lr()[0], "learn_s": time.perf_counter() - t1,
                        "step_time_s": time.perf_counter() - t0, **rstats, **lstats}
                if self.rank == 0:
                    log.write("train", self.step, **last)
                bar.update(1)
                bar.set_postfix(reward=f"{last['reward']:.3f}", len=f"{last['length']:.0f}",
                                tok_s=f"{rstats['rollout_tokens_per_s']:,.0f}", refresh=False)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    v = self.evaluate()
                    if v is not None:
                        log.write("val", self.step, **v)
                        bar.write(f"step {self.step}: held-out pass rate {v['pass_rate']:.3f}, reward "
                                  f"{v['reward']:.3f}")
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save()
            if self.balance:
                self.balance.raise_pending()  # the last step's deferred range check
            if not cfg.save_every or self.step % cfg.save_every != 0:
                self.save()
            finished = self.step >= cfg.steps
            stopped = self.step < end   # time_limit_s: trained less, evaluated and reported all the same
            if (finished or stopped) and cfg.eval_every:
                v = self.evaluate()
                if v is not None:
                    log.write("val", self.step, **v)
        finally:
            bar.close()
            if log is not None:
                log.close()
        summary = {"step": self.step, "finished": finished, "resumed": resumed, **last}
        if stopped:
            summary["stopped_early"] = "time limit"
        if (finished or stopped) and self.rank == 0:
            summary.update(final_eval=v, checkpoint=str(latest_checkpoint(self.run_dir)),
                           plot=str(plot_rl(self.run_dir)), budgets=str(self.run_dir / "budgets.json"))
            atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def close(self) -> None:
        for t in self.carry:
            self.runner.release(t)
        if self.manager is not None:
            self.manager.shutdown()


def plot_rl(run_dir: Path) -> Path:
    """`rl.png`: reward, pass rate (train batch and held-out) and counted length against step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = read_log(Path(run_dir) / "log.jsonl")
    tr = [r for r in recs if r["kind"] == "train"]
    va = [r for r in recs if r["kind"] == "val"]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for ax, key, label in zip(axes, ("reward", "pass_rate", "length"),
                              ("reward", "pass rate", "counted tokens")):
        ax.plot([r["step"] for r in tr], [r[key] for r in tr], lw=0.8, label=f"train batch {label}")
        if va:
            ax.plot([r["step"] for r in va], [r[key] for r in va], "o-", label=f"held-out {label}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1].set_xlabel("step")
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(run_dir) / "rl.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _check_out(cfg: RLConfig) -> None:
    saved = cfg.saved_run_config()
    if saved is not None:
        if "samples" not in saved or "domain" not in saved:
            raise ValueError(f"out={cfg.out!r} holds a run of another command, not a `k3 rl` run: give a new --out")
        if saved["domain"] != cfg.domain or saved["effort"] != cfg.effort:
            raise ValueError(f"out={cfg.out!r} holds a k3 rl run of domain {saved['domain']!r} / effort "
                             f"{saved['effort']!r}, not {cfg.domain!r} / {cfg.effort!r}: give a new --out")


def rl(cfg: RLConfig, reward_fn: Callable[[Trajectory], float] | None = None) -> dict:
    """`k3 rl`: check everything, then train. A run that fails before its first checkpoint leaves no `out`."""
    cfg = cfg.resolved()
    _check_out(cfg)
    done = preflight(cfg)
    if done is not None:
        return done
    out = Path(cfg.out)
    created = not out.exists()
    tr = None
    try:
        tr = RLTrainer(cfg, reward_fn)
        return tr.fit()
    except BaseException:
        if created and int(os.environ.get("RANK", "0")) == 0 and latest_step(out) is None:
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        if tr is not None:
            tr.close()
