"""`k3 train`: train a preset (default `k3-tiny`) on a built-in corpus that exists on every machine.

The corpus is the running Python's own standard-library sources, read as UTF-8 bytes (byte-level tokens
0–255, so it fits any preset's vocabulary without a tokenizer download). AdamW, cosine schedule with 1 %
warm-up, LM loss + 0.1 × MTP loss, a progress bar, and a checkpoint in the release's HF layout at the end
(and every `--save-every` steps). The full pre-training stack (Per-Head Muon, QB, data pipeline) builds on this.
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
from pathlib import Path

import torch


def builtin_corpus(max_bytes: int = 8_000_000) -> bytes:
    """Concatenated `*.py` files of the standard library (sorted, deterministic), up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for p in sorted(root.glob("*.py")):
        b = p.read_bytes()
        out.append(b)
        n += len(b)
        if n >= max_bytes:
            break
    if not out:
        raise FileNotFoundError(f"no Python sources under {root} to build the built-in corpus")
    return b"\n".join(out)[:max_bytes]


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """Endless random windows of seq + 1 tokens."""
    while True:
        ix = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[i:i + seq + 1] for i in ix.tolist()])


def train(args) -> dict:
    from tqdm import tqdm

    from ..config import K3Config
    from ..model import K3ForConditionalGeneration

    torch.manual_seed(args.seed)
    cfg = K3Config.preset(args.preset)
    cfg.vision_config = None  # text-only corpus
    if cfg.text_config.vocab_size < 256:
        raise ValueError(f"preset {args.preset} has vocab_size {cfg.text_config.vocab_size} < 256 (byte tokens)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = K3ForConditionalGeneration(cfg).to(device)
    data = torch.frombuffer(bytearray(builtin_corpus()), dtype=torch.uint8).long()
    split = int(0.98 * data.numel())
    train_data, val_data = data[:split], data[split:]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, args.steps // 100)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, args.steps - warm))))
    gen = torch.Generator().manual_seed(args.seed)
    it = batches(train_data, args.batch_size, args.seq_len, gen)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "log.jsonl").open("a")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    bar = tqdm(range(args.steps), desc="k3 train", unit="step")
    t0 = time.time()
    first = last = None
    for step in bar:
        x = next(it).to(device)
        with autocast:
            o = model(x, labels=x)
        loss = o.loss + (0.1 * o.mtp_loss if o.mtp_loss is not None else 0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        last = o.loss.item()
        first = last if first is None else first
        bar.set_postfix(loss=f"{last:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
        log.write(json.dumps({"step": step, "loss": last, "grad_norm": gn.item(), "lr": sched.get_last_lr()[0]}) + "\n")
        if args.save_every and (step + 1) % args.save_every == 0:
            model.save_pretrained(out / "checkpoint")
    model.eval()
    with torch.no_grad():
        v = batches(val_data, args.batch_size, args.seq_len, torch.Generator().manual_seed(0))
        val = sum(model(xv := next(v).to(device), labels=xv).loss.item() for _ in range(4)) / 4
    model.save_pretrained(out / "checkpoint")
    summary = {"preset": args.preset, "steps": args.steps, "first_loss": first, "final_loss": last,
               "val_loss": val, "val_bits_per_byte": val / math.log(2), "seconds": time.time() - t0,
               "params": model.num_parameters(), "checkpoint": str(out / "checkpoint")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a preset on the built-in corpus (default k3-tiny, CPU is enough)")
    p.add_argument("--preset", default="k3-tiny", choices=["k3-tiny", "k3-small"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--out", default="runs/k3-tiny")
    p.set_defaults(func=lambda a: (train(a), 0)[1])
