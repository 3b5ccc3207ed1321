"""Training checkpoints: `run/checkpoints/step_NNNNNNN/` = the model in the release's HF layout (loadable by
`from_pretrained` and `k3 generate`), the tokenizer, and `trainer_state.pt` (optimizer, schedule, QK-clip,
balancing, data position, RNG states; ranks > 0 of a distributed run add `trainer_state.rank{r}.pt`).
`run/latest` names the newest complete one.

Atomic: rank 0 stages the model (`stage_checkpoint`), every rank writes its state (`write_state`), rank 0
flushes and renames the folder into place (`commit_checkpoint`), and only then does `latest` move. A crash at any point leaves the previous checkpoint and `latest` intact."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
LATEST = "latest"


def rng_state() -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def state_file(rank: int) -> str:
    """Each data-parallel rank keeps its own state (data position, RNG; optimizer shards under EP)."""
    return STATE_FILE if rank == 0 else f"trainer_state.rank{rank}.pt"


def staging_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f".staging-step_{step:07d}"


def stage_checkpoint(run_dir: Path, step: int, model, tokenizer) -> Path:
    """Rank 0, first: the model (HF layout) and tokenizer into a fresh staging folder."""
    staging = staging_dir(run_dir, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def write_state(staging: Path, rank: int, state: dict) -> None:
    """Every rank: its trainer state into the staging folder (temp file + rename)."""
    tmp = staging / (state_file(rank) + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, staging / state_file(rank))


def commit_checkpoint(run_dir: Path, step: int, keep: int = 2) -> Path:
    """Rank 0, last: flush, rename the staging folder into place, move `latest`, prune old checkpoints."""
    ck = run_dir / "checkpoints"
    staging, final = staging_dir(run_dir, step), ck / f"step_{step:07d}"
    _fsync_tree(staging)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    tmp = run_dir / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, run_dir / LATEST)
    for old in sorted(ck.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` points to, or None when the run has none yet."""
    p = Path(run_dir) / LATEST
    if not p.is_file():
        return None
    ck = Path(run_dir) / "checkpoints" / p.read_text().strip()
    if not (ck / STATE_FILE).is_file():
        raise FileNotFoundError(f"{p} points to {ck}, which is not a complete checkpoint")
    return ck


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A model directory from a checkpoint dir (has config.json) or a run dir (follows `latest`)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    ck = latest_checkpoint(p) if p.is_dir() else None
    if ck is None:
        raise FileNotFoundError(f"{str(p)!r} is neither a checkpoint (no config.json) nor a run directory "
                                f"with a '{LATEST}' checkpoint")
    return ck


def clean_staging(run_dir: Path) -> None:
    """Remove half-written checkpoints a crash left behind."""
    for p in (run_dir / "checkpoints").glob(".*staging-*"):  # ours and save_pretrained's temp dirs
        shutil.rmtree(p, ignore_errors=True)
