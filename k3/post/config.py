"""What `k3 sft` and `k3 rl` share on top of `TrainConfig`: they start from a checkpoint instead of a preset,
train on one stage of rows (no context-length curriculum), and use the checkpoint's tokenizer; what they
write (`save_mode`), the master weights' dtype and an optional wall-clock limit.

`save_mode="weights"` is for chains of stages on a small disk (a k3-small benchmark on one GPU): no trainer
checkpoints at all (so no resume), only the final weights in `save_dtype` plus the tokenizer, in `out/model`
(`final_model_dir`), loadable by `from_pretrained`; `master_dtype="float32"` then trains on fp32 master weights
even though the checkpoint it starts from is bf16.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..train.config import TrainConfig
from ..train.state import latest_step, resolve_checkpoint

SAVE_MODES = ("full", "weights", "none")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PostTrainConfig(TrainConfig):
    checkpoint: str = ""  # a checkpoint dir (config.json) or a run dir (its latest checkpoint)
    preset: str = "checkpoint"
    batch_size: int | None = 1
    curriculum: str = "none"
    long_context_frac: float = 0.0
    save_mode: str = "full"        # "full": trainer checkpoints (exact resume); "weights": final weights only; "none"
    save_dtype: str = "bfloat16"   # dtype of the weights written by save_mode="weights"
    master_dtype: str | None = None  # cast the loaded weights to this dtype to train (None: as loaded)
    time_limit_s: float | None = None  # stop training after this many seconds of fit (then save / evaluate)

    def check_post(self) -> None:
        """The checks of the fields above (each command calls it from `resolved`)."""
        if self.save_mode not in SAVE_MODES:
            raise ValueError(f"save_mode={self.save_mode!r}: expected one of {', '.join(SAVE_MODES)}")
        for name in ("save_dtype", "master_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _DTYPES:
                raise ValueError(f"{name}={v!r}: expected one of {', '.join(_DTYPES)}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s={self.time_limit_s!r}: expected a number of seconds > 0")

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


def final_model_dir(out: str | Path) -> Path:
    """Where save_mode="weights" puts a run's final weights."""
    return Path(out) / "model"


class PostTrainMixin:
    """What SFTTrainer and RLTrainer add to `Trainer` for the fields of `PostTrainConfig` (call
    `_post_init` at the end of `__init__`, `_time_up` where a step may start)."""

    def _post_init(self) -> None:
        cfg = self.cfg
        if cfg.master_dtype is not None:
            # in place (`.data`): the optimizer, QK-clip and balancing keep the same Parameter objects; the
            # release's fp32 parameters stay fp32
            self.model.cast(_DTYPES[cfg.master_dtype])
        self._t_start: float | None = None

    def _start_clock(self) -> None:
        self._t_start = time.monotonic()

    def _time_up(self) -> bool:
        lim = self.cfg.time_limit_s
        return lim is not None and self._t_start is not None and time.monotonic() - self._t_start >= lim

    def save(self):
        """"full": the trainer's checkpoint; "weights": the model (`save_dtype`) and tokenizer into
        `final_model_dir(out)`, replacing what was there; "none": nothing."""
        mode = self.cfg.save_mode
        if mode == "full":
            return super().save()
        if mode == "none" or self.rank != 0:
            return None
        dst = final_model_dir(self.run_dir)
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, dtype=_DTYPES[self.cfg.save_dtype])
        self.tokenizer.save_pretrained(tmp)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
        return dst
