"""`k3 sft --checkpoint DIR --data FILE.jsonl [...]` (the command line of `k3.post.sft`) and `k3 post data`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .sft import SFTConfig

# flag → (SFTConfig field, type, help); every flag's default is SFTConfig's
_FLAGS = {
    "--out": ("out", str, "run directory (checkpoints, log.jsonl, tb/, training.png, summary.json)"),
    "--steps": ("steps", int, "optimizer steps of the whole run (the schedule's length)"),
    "--seq-len": ("seq_len", int, "row length in tokens; longer conversations are truncated (or --drop-long)"),
    "--batch": ("batch_size", int, "rows per micro-batch"),
    "--grad-accum": ("grad_accum", int, "micro-batches per optimizer step"),
    "--lr": ("lr", float, "peak learning rate (cosine schedule with warmup)"),
    "--min-lr-ratio": ("min_lr_ratio", float, "the schedule ends at lr x this"),
    "--warmup-frac": ("warmup_frac", float, "share of steps spent warming up"),
    "--weight-decay": ("weight_decay", float, "decoupled weight decay"),
    "--grad-clip": ("grad_clip", float, "clip the global gradient norm to this (0: off)"),
    "--optimizer": ("optimizer", str, "muon (Per-Head Muon + AdamW) or adamw"),
    "--mtp-weight": ("mtp_weight", float, "weight of the MTP loss (on the same assistant tokens; 0: off)"),
    "--val-data": ("val_data", str, "held-out JSONL of conversations for the validation loss"),
    "--tokenizer": ("tokenizer", str, "tokenizer dir; default: the checkpoint's"),
    "--effort": ("effort", str, "reasoning effort (low|high|max|none) for conversations that name none; "
                                "default: the chat format's (max)"),
    "--save-every": ("save_every", int, "checkpoint every N steps (0: only at the end)"),
    "--keep-checkpoints": ("keep_checkpoints", int, "checkpoints kept (the newest)"),
    "--stop-after": ("stop_after", int, "stop after this many steps (resume later with the same command)"),
    "--eval-every": ("eval_every", int, "validation loss every N steps (needs --val-data)"),
    "--eval-batches": ("eval_batches", int, "validation micro-batches per evaluation"),
    "--sample-every": ("sample_every", int, "print the reply to --sample-prompt every N steps (0: only at the end)"),
    "--sample-prompt": ("sample_prompt", str, "the user message of the sample"),
    "--sample-tokens": ("sample_tokens", int, "tokens per sample"),
    "--seed": ("seed", int, "seed of the data order and sampling"),
    "--device": ("device", str, "cpu, cuda, cuda:N; default: cuda when there is a GPU"),
}
_BOOLS = {
    "--resume": ("resume", "continue from out/latest when there is one (--no-resume refuses an out that holds a run)"),
    "--drop-long": ("drop_long", "drop conversations longer than --seq-len instead of truncating them"),
    "--gradient-checkpointing": ("gradient_checkpointing", "recompute each decoder layer in the backward"),
    "--tensorboard": ("tensorboard", "write TensorBoard event files under out/tb"),
    "--progress": ("progress", "show a progress bar"),
}


def _default(name: str):
    f = next(f for f in dataclasses.fields(SFTConfig) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def config_from_args(args) -> SFTConfig:
    values = {"checkpoint": args.checkpoint, "sft_data": args.data}
    for name, *_ in list(_FLAGS.values()) + list(_BOOLS.values()):
        v = getattr(args, name)
        if v is not None:
            values[name] = v
    return SFTConfig(**values)


def cmd_sft(args) -> int:
    from ..train.trainer import TrainingDiverged
    from .sft import sft
    try:
        summary = sft(config_from_args(args))
    except TrainingDiverged as e:
        print(f"k3 sft: stopped: {e}", file=sys.stderr)
        return 3
    if summary.get("already_finished"):
        print(f"k3 sft: the run already finished at step {summary['step']} (checkpoint {summary['checkpoint']}); "
              "nothing to do. Raise --steps to train on, or give a new --out to start over.")
        return 0
    if summary.get("finished"):
        d = summary.get("data", {})
        val = ""
        if summary.get("final_val_loss") is not None:
            val = f"validation loss {summary['first_val_loss']:.3f} → {summary['final_val_loss']:.3f}; "
        print(f"\n{d.get('kept')} conversations ({d.get('loss_tokens')} assistant tokens); train loss "
              f"{summary.get('loss', float('nan')):.3f}; {val}checkpoint {summary['checkpoint']}; "
              f"plot {summary['plot']}")
        print("sample:\n" + summary["sample"])
    else:
        print(json.dumps({k: summary[k] for k in ("step", "loss") if k in summary}))
    return 0


def add_parser(sub) -> None:
    """Register `k3 sft` and `k3 post data` on an argparse subparsers object."""
    from .tasks.data import add_data_args, cmd_data
    post = sub.add_parser("post", help="post-training data: `k3 post data` writes the built-in tasks as JSONL")
    psub = post.add_subparsers(dest="post_cmd", required=True)
    add_data_args(psub.add_parser("data", help="built-in tasks (general / agent / coding) as prompts or solved "
                                               "conversations (the SFT cold-start data)")).set_defaults(func=cmd_data)
    p = sub.add_parser("sft", help="supervised fine-tuning of a checkpoint on chat conversations (JSONL)")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint dir (config.json + weights) or a `k3 train` run dir (uses its latest)")
    p.add_argument("--data", required=True, metavar="FILE.jsonl",
                   help='one conversation per line: {"messages": [...], "tools": [...] | null, "task_id", ...}')
    for flag, (name, typ, help_) in _FLAGS.items():
        kw = {"choices": ("muon", "adamw")} if name == "optimizer" else {}
        p.add_argument(flag, dest=name, type=typ, default=None, help=f"{help_} (default: {_default(name)!r})", **kw)
    for flag, (name, help_) in _BOOLS.items():
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                       help=f"{help_} (default: {_default(name)!r})")
    p.set_defaults(func=cmd_sft)
