"""Run metrics: one JSON object per line in `log.jsonl`, the same scalars as TensorBoard events
(`tb/`), and a PNG of loss and throughput at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int = 0):
        self.path = run_dir / "log.jsonl"
        if self.path.exists():  # drop records after the checkpoint we resume from (they will be redone)
            keep = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)
            except ImportError:  # tensorboard not installed: JSONL only
                self.tb = None

    def write(self, kind: str, step: int, **values) -> None:
        rec = {"kind": kind, "step": step, **values}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)
            if kind == "sample":
                self.tb.add_text("sample", values.get("text", ""), step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_log(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def plot_run(run_dir: Path) -> Path:
    """`training.png`: train/validation loss and tokens/s against step, curriculum stages shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_log(run_dir / "log.jsonl")
    tr = [r for r in recs if r["kind"] == "train"]
    va = [r for r in recs if r["kind"] == "val"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    a1.plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=0.8, label="train LM loss")
    if any("mtp_loss" in r for r in tr):
        a1.plot([r["step"] for r in tr if "mtp_loss" in r], [r["mtp_loss"] for r in tr if "mtp_loss" in r],
                lw=0.6, alpha=0.6, label="train MTP loss")
    if va:
        a1.plot([r["step"] for r in va], [r["loss"] for r in va], "o-", label="validation loss")
    a1.set_ylabel("loss (nats/token)")
    a1.legend()
    a1.grid(alpha=0.3)
    a2.plot([r["step"] for r in tr], [r["tokens_per_s"] for r in tr], lw=0.8, color="C2")
    a2.set_ylabel("tokens / s")
    a2.set_xlabel("step")
    a2.grid(alpha=0.3)
    prev = None
    for r in tr:
        if prev is not None and r["seq_len"] != prev:
            for a in (a1, a2):
                a.axvline(r["step"], color="gray", ls="--", lw=0.8)
            a1.annotate(f"seq {r['seq_len']}", (r["step"], a1.get_ylim()[1]), fontsize=8, va="top")
        prev = r["seq_len"]
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "training.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
