"""`k3 sft`: supervised fine-tuning of a checkpoint on chat conversations (K3_SPEC §8.1, the cold start).

The pre-training `Trainer` does the work — Muon/AdamW, the cosine schedule, QK-clip, router balancing, MTP,
atomic checkpoints, exact resume (weights, optimizer, data position, every RNG), metrics JSONL +
TensorBoard, the progress bar and the plot — and `SFTTrainer` swaps only what differs: the data (packed
conversations from `sft_data`, loss on assistant tokens only, via the trainer's `_enter_stage` hook), the
validation rows (a held-out JSONL, if given) and the sample (a chat turn). Weights and tokenizer come from a
`k3 train` run directory (its latest checkpoint) or any checkpoint directory, as `k3 generate` finds them;
the checkpoints written are loadable by `K3ForConditionalGeneration.from_pretrained` and `k3 serve`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .._atomic import atomic_write
from ..io.chat import THINKING_EFFORTS
from ..train.metrics import read_log
from ..train.state import latest_step
from ..train.trainer import Trainer, preflight
from .config import PostTrainConfig, PostTrainMixin
from .sft_data import Example, LoadStats, PackedSFT, example_options, load_examples


@dataclass
class SFTConfig(PostTrainConfig):
    """TrainConfig with SFT's defaults, plus where the weights and conversations come from."""

    sft_data: str = ""  # JSONL of conversations
    val_data: str | None = None  # held-out JSONL (validation loss on its assistant tokens); None: none
    effort: str | None = None  # reasoning effort for examples that name none (None: the chat default, max)
    drop_long: bool = False  # drop conversations longer than seq_len instead of truncating them
    # SFT defaults of TrainConfig's fields
    seq_len: int | None = 2048
    steps: int = 100
    lr: float | None = 3e-4
    warmup_frac: float = 0.03
    out: str = "runs/sft"
    eval_every: int = 25
    sample_every: int = 0
    sample_prompt: str = "What is 12 + 30? Answer with the number."
    sample_tokens: int = 64
    save_every: int = 50

    def resolved(self) -> "SFTConfig":
        """TrainConfig.resolved, plus: the checkpoint exists (a run dir resolves to its latest), the data
        file exists, the effort is known; `init_from` / `tokenizer` point at the checkpoint."""
        ck = self.checkpoint_dir()
        if not self.sft_data:
            raise ValueError("data: expected a JSONL file of conversations")
        for name in ("sft_data", "val_data"):
            v = getattr(self, name)
            if v and not Path(v).is_file():
                raise FileNotFoundError(f"{'data' if name == 'sft_data' else 'val-data'} {v!r} does not exist "
                                        "(expected a JSONL file of conversations)")
        if self.effort is not None and self.effort not in (*THINKING_EFFORTS, "none"):
            raise ValueError(f"effort={self.effort!r}: expected one of {', '.join(THINKING_EFFORTS)} or 'none'")
        self.check_post()
        c = self.from_checkpoint(ck)
        c.stages()
        return c


def load_tokenizer(cfg: SFTConfig):
    """The tokenizer `Trainer` will use: --tokenizer, else the checkpoint's, else the built-in BPE for its
    config (as `k3 serve` does, with a notice)."""
    from ..config import K3Config
    from ..io.tokenizer import K3Tokenizer, default_tokenizer
    if cfg.tokenizer:
        return K3Tokenizer.from_pretrained(cfg.tokenizer)
    print(f"k3 sft: {cfg.init_from} has no tiktoken.model; using the built-in BPE tokenizer for its config",
          file=sys.stderr)
    return default_tokenizer(K3Config.from_pretrained(cfg.init_from).text_config)


class _TimeUp(Exception):
    """Raised at the start of a step once `time_limit_s` has passed (caught by `SFTTrainer.fit`)."""


class SFTTrainer(PostTrainMixin, Trainer):
    """`Trainer` on packed conversations; see the module docstring."""

    progress_desc = "k3 sft"

    def __init__(self, cfg: SFTConfig, train: tuple[list[Example], LoadStats] | None = None,
                 val: tuple[list[Example], LoadStats] | None = None):
        super().__init__(cfg)
        cfg = self.cfg
        if train is None:
            train = load_examples(cfg.sft_data, self.tokenizer, cfg.seq_len, drop_long=cfg.drop_long,
                                  effort=cfg.effort)
        if val is None and cfg.val_data:
            val = load_examples(cfg.val_data, self.tokenizer, cfg.seq_len, drop_long=cfg.drop_long,
                                effort=cfg.effort)
        self.train_examples, self.data_stats = train
        self.val_examples = val[0] if val else []
        self._post_init()

    def _batch(self, rows: int) -> dict:
        if self._time_up():
            raise _TimeUp
        return super()._batch(rows)

    def _packed(self, examples, **kw) -> PackedSFT:
        return PackedSFT(examples, self.cfg.seq_len, self.tokenizer.pad_token_id, seed=self.cfg.seed,
                         rank=self.rank, world_size=self.world, **kw)

    def _enter_stage(self, idx: int, data_state: dict | None = None) -> None:
        """The (single) stage's data: packed conversations, at the position `data_state` names."""
        ds = self._packed(self.train_examples, fingerprint=self.data_stats.fingerprint)
        if data_state is None and self.data is not None:
            data_state = {"packed": self.packed.state_dict()}
        if data_state is not None:
            ds.load_state_dict(data_state["packed"])
        self.stage_idx, self.packed, self.data = idx, ds, ds
        self.data_iter = iter(ds)

    def _val_batches(self) -> list[dict]:
        """The held-out conversations' rows (up to eval_batches × batch_size), unshuffled; [] without any."""
        if not hasattr(self, "_val"):
            from ..data.packing import collate
            self._val = []
            if self.val_examples:
                B, need = self.cfg.batch_size, self.cfg.eval_batches * self.cfg.batch_size
                rows = [r for _, r in zip(range(need), self._packed(self.val_examples, loop=False, shuffle=False))]
                self._val = [collate(rows[i:i + B]) for i in range(0, len(rows), B)]
        return self._val

    @torch.no_grad()
    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None, seed: int = 0) -> str:
        """The model's reply to a one-turn chat (rendered with a generation prompt, stopped at <|end_of_msg|>;
        the markers are kept so the structure shows). A fixed seed: the training RNG is not disturbed."""
        from ..io.chat import encode
        prompt = self.cfg.sample_prompt if prompt is None else prompt
        ids = encode(self.tokenizer, [{"role": "user", "content": prompt}],
                     **example_options({}, self.cfg.effort))
        self.model.eval()
        try:
            with self.autocast:
                out = self.model.generate(torch.tensor([ids], device=self.device),
                                          max_new_tokens=max_new_tokens or self.cfg.sample_tokens,
                                          temperature=0.8, top_p=0.95, eos_token_id=self.tokenizer.eos_token_id,
                                          generator=torch.Generator(self.device).manual_seed(seed))
        finally:
            self.model.train()
        return f"user: {prompt}\nassistant: " + self.tokenizer.decode(out[0, len(ids):].tolist())

    def fit(self) -> dict:
        if self.rank == 0:
            atomic_write(self.run_dir / "sft_data.json", json.dumps(
                {"data": self.cfg.sft_data, **self.data_stats.to_dict(), "notes": self.data_stats.notes},
                indent=2) + "\n")
        self._start_clock()
        try:
            summary = super().fit()
        except _TimeUp:   # time_limit_s: stop before this step; keep what was learned
            self.opt.zero_grad(set_to_none=True)
            self.save()
            tr = [r for r in read_log(self.run_dir / "log.jsonl") if r["kind"] == "train"] if self.rank == 0 else []
            summary = {**(tr[-1] if tr else {}), "step": self.step, "finished": False, "stopped_early": "time limit",
                       "resumed": False}
            summary.pop("kind", None)
            if self.rank == 0:
                atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        summary["data"] = self.data_stats.to_dict()
        return summary


def _check_out(cfg: SFTConfig) -> None:
    """`out` may hold an earlier run of `k3 sft` (resumed), not a `k3 train` run (its trainer state would be
    read as this run's)."""
    saved = cfg.saved_run_config()
    if saved is not None:
        if "sft_data" not in saved:
            raise ValueError(f"out={cfg.out!r} holds a `k3 train` run, not a `k3 sft` run: give a new --out "
                             "(and that run as --checkpoint)")


def sft(cfg: SFTConfig) -> dict:
    """`k3 sft`: check everything (checkpoint, data, out), load the conversations, then train. A run that
    fails before its first checkpoint leaves no `out` behind (when it created it)."""
    cfg = cfg.resolved()
    _check_out(cfg)
    done = preflight(cfg)
    if done is not None:
        return done
    tok = load_tokenizer(cfg)
    train = load_examples(cfg.sft_data, tok, cfg.seq_len, drop_long=cfg.drop_long, effort=cfg.effort)
    val = (load_examples(cfg.val_data, tok, cfg.seq_len, drop_long=cfg.drop_long, effort=cfg.effort)
           if cfg.val_data else None)
    out = Path(cfg.out)
    created = not out.exists()
    try:
        return SFTTrainer(cfg, train, val).fit()
    except BaseException:
        if created and int(os.environ.get("RANK", "0")) == 0 and latest_step(out) is None:
            shutil.rmtree(out, ignore_errors=True)
        raise
