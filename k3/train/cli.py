"""`k3 train` (flags and/or a TOML/YAML config file) and `k3 generate` (continue text from a checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .config import TrainConfig, load_config_file

_HELP = {  # every TrainConfig field; `k3 train --help` appends the default (and the choices where there are some)
    "preset": "model preset (k3-tiny: CPU demo; k3-small: one GPU)",
    "model_config": "a config.json or checkpoint dir instead of a preset",
    "init_from": "initial weights (a checkpoint dir in the HF layout)",
    "data": "text / JSONL (text field) / Parquet files, dirs or globs; a text file is cut into documents at blank "
            "lines (one input.txt works); empty: the built-in corpus",
    "text_field": "the JSONL field / Parquet column that holds the text",
    "tokenizer": "tokenizer dir (tiktoken.model + tokenizer_config.json, or ours); empty: BPE on the built-in corpus",
    "seq_len": "base context length (curriculum stages are multiples of it); empty: the preset's",
    "batch_size": "rows per micro-batch at the base length; empty: tokens-per-step / seq-len",
    "tokens_per_step": "tokens per optimizer step (constant across curriculum stages); empty: the preset's",
    "grad_accum": "micro-batches per optimizer step (per batch rank; under --pp the pipeline's micro-batches)",
    "curriculum": "'auto', 'none', or 'frac:mult,...' e.g. '0.85:1,0.15:8'",
    "long_context_frac": "share of long-stage rows drawn from the synthetic long-context task, in [0, 1]",
    "steps": "optimizer steps of the whole run (the schedule's length)",
    "optimizer": "Per-Head Muon + AdamW, or AdamW alone",
    "lr": "peak learning rate; empty: the preset's",
    "min_lr_ratio": "the cosine schedule ends at lr x this, in [0, 1]",
    "warmup_frac": "share of steps spent warming up linearly, in [0, 1)",
    "weight_decay": "decoupled weight decay",
    "grad_clip": "clip the global gradient norm to this (0: off)",
    "qk_clip_tau": "QK-clip threshold on MLA logits (0: off)",
    "balance": "router bias update: qb (Quantile Balancing, histogram), qb-exact, sign (DeepSeek-V3) or none",
    "balance_gamma": "step size of the 'sign' balancing rule",
    "mtp_weight": "weight of the multi-token-prediction loss (0: off)",
    "gradient_checkpointing": "recompute each decoder layer in the backward (long sequences, large batches)",
    "fp8": "projections as row-wise e4m3 GEMMs, forward and dx (dW in bf16): an sm_89+ GPU, or the CPU",
    "expert_parallel": "under torchrun: shard the routed experts over all ranks with MoonEP (a synonym of --ep WORLD)",
    "dp_shard": "under torchrun: FSDP2 data-parallel degree; empty: world / (ep·cp·pp)",
    "ep": "under torchrun: MoonEP expert-parallel degree (must divide the number of experts)",
    "cp": "under torchrun: context-parallel degree (each sequence split over cp ranks)",
    "pp": "under torchrun: pipeline stages (1F1B when grad-accum >= pp, else GPipe; no sampling)",
    "device": "cpu, cuda, cuda:N; empty: cuda when there is a GPU",
    "seed": "seed of the weights, data order and sampling",
    "out": "run directory (checkpoints, log.jsonl, tb/, training.png, summary.json); default: runs/<preset>",
    "resume": "continue from out/latest when there is one (--no-resume refuses an out that holds a run)",
    "stop_after": "stop after this many steps (resume later with the same command); empty: run to --steps",
    "eval_every": "validation loss every N steps (0: only at the start and the end)",
    "eval_batches": "validation micro-batches per evaluation",
    "sample_every": "print a sampled continuation every N steps (0: only at the end)",
    "sample_tokens": "tokens per sample",
    "sample_prompt": "the sample's prompt",
    "save_every": "checkpoint every N steps (0: only at the end); the last step is always saved",
    "keep_checkpoints": "checkpoints kept (the newest; older ones are deleted)",
    "tensorboard": "write TensorBoard event files under out/tb",
    "progress": "show a progress bar",
}
_CHOICES = {"optimizer": ("muon", "adamw"), "balance": ("qb", "qb-exact", "sign", "none")}


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", dest="config_file", help="a TOML, YAML or JSON file of settings (flags override it)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "" if default in (None, []) or f.name == "out" else f" (default: {default!r})"
        kw = dict(dest=f.name, default=None, help=_HELP[f.name] + shown)  # None: the config file's value stays
        if f.name in _CHOICES:
            kw["choices"] = _CHOICES[f.name]
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif f.name == "data":
            p.add_argument(flag, nargs="+", metavar="PATH", **kw)
        else:
            typ = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            p.add_argument(flag, type=typ, **kw)


def config_from_args(args) -> TrainConfig:
    values = load_config_file(args.config_file) if args.config_file else {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    if "out" not in values and "preset" in values:
        values["out"] = f"runs/{values['preset']}"
    return TrainConfig(**values)


def cmd_train(args) -> int:
    from .trainer import TrainingDiverged, train
    try:
        summary = train(config_from_args(args))
    except TrainingDiverged as e:
        print(f"k3 train: stopped: {e}", file=sys.stderr)
        return 3
    if summary.get("already_finished"):
        print(f"k3 train: the run already finished at step {summary['step']} (checkpoint {summary['checkpoint']}); "
              "nothing to do. Raise --steps to train on, or give a new --out to start over.")
        return 0
    if summary.get("finished"):
        print(f"\nvalidation loss {summary['first_val_loss']:.3f} → {summary['final_val_loss']:.3f} "
              f"(nats/token); checkpoint {summary['checkpoint']}; plot {summary['plot']}")
        print("sample:\n" + summary["sample"])
    else:
        print(json.dumps({k: summary[k] for k in ("step", "loss") if k in summary}))
    return 0


def cmd_generate(args) -> int:
    import torch

    from ..io.tokenizer import K3Tokenizer
    from ..model import K3ForConditionalGeneration
    from .state import resolve_checkpoint

    ck = resolve_checkpoint(args.checkpoint)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = K3ForConditionalGeneration.from_pretrained(ck).to(device).eval()
    tok = K3Tokenizer.from_pretrained(ck)
    ids = [tok.bos_token_id] + tok.encode(args.prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p,
                             eos_token_id=[tok.eod_token_id, tok.eos_token_id],
                             generator=torch.Generator(device).manual_seed(args.seed))
    print(args.prompt + tok.decode(out[0, len(ids):].tolist(), skip_special=True))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="pre-train a preset (default k3-tiny on the built-in corpus; CPU is enough)")
    _add_train_flags(p)
    p.set_defaults(func=cmd_train)
    g = sub.add_parser("generate", help="continue a prompt with a trained checkpoint")
    g.add_argument("--checkpoint", required=True, help="a checkpoint dir or a run dir (uses its latest)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None)
    g.set_defaults(func=cmd_generate)
