"""`k3 rl --checkpoint DIR --domain general|agent|coding --effort low|high|max [...]` (the command line of
`k3.post.rl`). Register with `add_parser(sub)` from k3/cli.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .rl import RLConfig

# flag → (RLConfig field, type, help); every flag's default is RLConfig's
_FLAGS = {
    "--out": ("out", str, "run directory (checkpoints, log.jsonl, tb/, rl.png, budgets.json, summary.json)"),
    "--steps": ("steps", int, "RL iterations (one optimizer step each)"),
    "--prompts": ("prompts", int, "N: prompt groups in flight per iteration"),
    "--samples": ("samples", int, "K: samples per prompt (the group of the group-relative advantage)"),
    "--lambda": ("lam", float, "partial rollout: stop generating once ceil(lambda*N*K) trajectories finished "
                               "(and a group is complete); the rest is paused and resumed next iteration (1: off)"),
    "--tau": ("tau", float, "budget multiplier: reward -1 when counted tokens > tau*b0 (default: 4/2/1 for "
                            "max/high/low)"),
    "--budget-cap": ("budget_cap", float, "absolute token cap of the budget (default: 8192 for max, none else)"),
    "--budgets": ("budgets", str, "b0 JSON of an earlier run of the chain (its budgets.json), instead of "
                                  "estimating it with --checkpoint's model"),
    "--budget-samples": ("budget_samples", int, "cold-start samples per question to estimate b0"),
    "--level": ("level", str, "task level: easy (general: copy a code, single-digit addition; agent: read a number "
                              "from a named file, name the file that mentions a word; coding: a one-line function) "
                              "or standard"),
    "--pool": ("pool", int, "train tasks drawn from the built-in generator"),
    "--task-seed": ("task_seed", int, "seed of the task generator"),
    "--eval-task-seed": ("eval_task_seed", int, "seed of the held-out tasks (default: --task-seed)"),
    "--max-turns": ("max_turns", int, "assistant turns per episode (tool round trips + the answer)"),
    "--max-turn-tokens": ("max_turn_tokens", int, "tokens per assistant turn"),
    "--max-total-tokens": ("max_total_tokens", int, "generated tokens per episode"),
    "--temperature": ("temperature", float, "sampling temperature (log-probs are the raw model's: keep 1)"),
    "--top-p": ("top_p", float, "nucleus sampling"),
    "--clip-low": ("clip_low", float, "PPO ratio clip below 1"),
    "--clip-high": ("clip_high", float, "PPO ratio clip above 1"),
    "--kl-coef": ("kl_coef", float, "weight of the local regulariser on tokens of an older policy"),
    "--stale": ("stale", str, "tokens sampled by an older policy: kl (regularised) or mask (no loss)"),
    "--micro-tokens": ("micro_tokens", int, "tokens per learner forward"),
    "--eval-prompts": ("eval_prompts", int, "held-out tasks for the pass rate (0: none)"),
    "--eval-every": ("eval_every", int, "held-out evaluation every N steps (0: never)"),
    "--engine-dtype": ("engine_dtype", str, "rollout engine dtype (default: bfloat16 on CUDA, else the policy's)"),
    "--lr": ("lr", float, "peak learning rate"),
    "--optimizer": ("optimizer", str, "muon (Per-Head Muon + AdamW) or adamw"),
    "--grad-clip": ("grad_clip", float, "clip the global gradient norm to this (0: off)"),
    "--tokenizer": ("tokenizer", str, "tokenizer dir; default: the checkpoint's"),
    "--save-every": ("save_every", int, "checkpoint every N steps (0: only at the end)"),
    "--keep-checkpoints": ("keep_checkpoints", int, "checkpoints kept (the newest)"),
    "--stop-after": ("stop_after", int, "stop after this many steps (resume later with the same command)"),
    "--time-limit": ("time_limit_s", float, "stop training after this many seconds, then save and evaluate"),
    "--save-mode": ("save_mode", str, "full (checkpoints, exact resume), weights (final weights only, in "
                                      "out/model, save dtype bf16, no optimizer state) or none"),
    "--seed": ("seed", int, "seed of the task order and sampling"),
    "--device": ("device", str, "cpu, cuda, cuda:N; default: cuda when there is a GPU"),
}
_BOOLS = {
    "--resume": ("resume", "continue from out/latest when there is one"),
    "--adv-std": ("adv_std", "divide the group-relative advantage by the group's reward std"),
    "--gradient-checkpointing": ("gradient_checkpointing", "recompute each decoder layer in the backward"),
    "--tensorboard": ("tensorboard", "write TensorBoard event files under out/tb"),
    "--progress": ("progress", "show a progress bar"),
}
_CHOICES = {"optimizer": ("muon", "adamw"), "stale": ("kl", "mask"), "level": ("easy", "standard"),
            "save_mode": ("full", "weights", "none"),
            "engine_dtype": ("bfloat16", "float16", "float32")}


def _default(name: str):
    f = next(f for f in dataclasses.fields(RLConfig) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def config_from_args(args) -> RLConfig:
    values = {"checkpoint": args.checkpoint, "domain": args.domain, "effort": args.effort}
    for name, *_ in list(_FLAGS.values()) + list(_BOOLS.values()):
        v = getattr(args, name)
        if v is not None:
            values[name] = v
    return RLConfig(**values)


def cmd_rl(args) -> int:
    from ..train.trainer import TrainingDiverged
    from .rl import rl
    from .tasks import TaskError
    try:
        s = rl(config_from_args(args))
    except TrainingDiverged as e:
        print(f"k3 rl: stopped: {e}", file=sys.stderr)
        return 3
    except TaskError as e:
        print(f"k3 rl: error: a task is broken: {e}", file=sys.stderr)
        return 2
    if s.get("already_finished"):
        print(f"k3 rl: the run already finished at step {s['step']} (checkpoint {s['checkpoint']}); nothing to do. "
              "Raise --steps to train on, or give a new --out to start over.")
    elif s.get("finished"):
        ev = s.get("final_eval") or {}
        print(f"\nreward {s.get('reward', float('nan')):.3f}, train pass rate {s.get('pass_rate', float('nan')):.3f}"
              + (f", held-out pass rate {ev['pass_rate']:.3f}" if ev else "")
              + f"; checkpoint {s['checkpoint']}; plot {s['plot']}; budgets {s['budgets']}")
    else:
        print(json.dumps({k: s[k] for k in ("step", "reward", "pass_rate") if k in s}))
    return 0


def add_parser(sub) -> None:
    """Register `k3 rl` on an argparse subparsers object."""
    p = sub.add_parser("rl", help="RL of one expert policy (domain x effort): group rollouts through the engine, "
                                  "sandbox tools, effort budgets, partial rollout")
    p.add_argument("--checkpoint", required=True,
                   help="the SFT (cold-start) checkpoint dir or run dir, or the previous run of the chain")
    p.add_argument("--domain", required=True, choices=("general", "agent", "coding"))
    p.add_argument("--effort", required=True, choices=("low", "high", "max"))
    for flag, (name, typ, help_) in _FLAGS.items():
        p.add_argument(flag, dest=name, type=typ, default=None, choices=_CHOICES.get(name),
                       help=f"{help_} (default: {_default(name)!r})")
    for flag, (name, help_) in _BOOLS.items():
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                       help=f"{help_} (default: {_default(name)!r})")
    p.set_defaults(func=cmd_rl)
