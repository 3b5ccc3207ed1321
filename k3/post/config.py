"""What `k3 sft` and `k3 rl` share on top of `TrainConfig`: they start from a checkpoint instead of a preset,
train on one stage of rows (no context-length curriculum), and use the checkpoint's tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..train.config import TrainConfig
from ..train.state import latest_step, resolve_checkpoint


@dataclass
class PostTrainConfig(TrainConfig):
    checkpoint: str = ""  # a checkpoint dir (config.json) or a run dir (its latest checkpoint)
    preset: str = "checkpoint"
    batch_size: int | None = 1
    curriculum: str = "none"
    long_context_frac: float = 0.0

    def checkpoint_dir(self) -> Path:
        """The checkpoint directory to start from (a run dir resolves to its latest); clear errors otherwise."""
        if not self.checkpoint:
            raise ValueError("checkpoint: expected a checkpoint directory or a run directory")
        if not Path(self.checkpoint).exists():
            raise FileNotFoundError(f"checkpoint {self.checkpoint!r} does not exist")
        return resolve_checkpoint(self.checkpoint)

    def from_checkpoint(self, ck: Path) -> "PostTrainConfig":
        """TrainConfig.resolved, starting from checkpoint `ck`: its weights, its tokenizer unless one is given,
        one stage of `batch_size` rows of `seq_len` tokens per micro-batch."""
        c = TrainConfig.resolved(self)
        c.init_from = str(ck)
        if c.tokenizer is None and (ck / "tiktoken.model").is_file():
            c.tokenizer = str(ck)
        c.tokens_per_step = c.batch_size * c.seq_len
        return c

    def saved_run_config(self) -> dict | None:
        """The `train_config.json` of the run already in `out` ({} if unreadable), or None when `out` holds no
        checkpoint: each command checks that the run it would resume is one of its own."""
        out = Path(self.out)
        if not (out.is_dir() and latest_step(out) is not None):
            return None
        tc = out / "train_config.json"
        try:
            return json.loads(tc.read_text()) if tc.is_file() else {}
        except ValueError:
            return {}
