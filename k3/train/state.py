"""Training checkpoints: `run/checkpoints/step_NNNNNNN/` = the model in the release's HF layout (loadable by
`from_pretrained` and `k3 generate`), the tokenizer, and `trainer_state.pt` (optimizer, schedule, QK-clip,
balancing, data position, RNG states; ranks > 0 of a distributed run add `trainer_state.rank{r}.pt`, and a
distributed run writes its weights and optimizer state to `dcp/` with `torch.distributed.checkpoint`, so that
it resumes at another layout).
`run/latest` names the newest complete one.

Atomic and kill-safe: rank 0 stages the model (`stage_checkpoint`), every rank writes its state (`write_state`),
rank 0 flushes and renames the folder into place (`commit_checkpoint`), and only then does `latest` move (one
atomic file write). A step whose folder exists is never written again, and pruning never touches what `latest`
names, so a kill at any instant leaves `latest` pointing at a complete checkpoint.

Trainer state is read with `torch.load(weights_only=True)`: only tensors and plain containers (plus the few
numpy types older runs stored their RNG state as) can come out of it, never code.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch

from .._atomic import atomic_write, replace_dir

STATE_FILE = "trainer_state.pt"
DCP_DIR = "dcp"  # distributed runs: weights + optimizer state, `torch.distributed.checkpoint` (any layout)
LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d{7,})\Z")


def rng_state() -> dict:
    """Every RNG the trainer draws from, as tensors and plain Python values (loadable with weights_only)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    s = {"python": random.getstate(), "torch": torch.get_rng_state(),
         "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    name, keys, pos, has_gauss, cached = s["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _numpy_globals() -> list:
    """numpy's array reconstruction: what trainer states written before the tensor RNG format need."""
    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out.append(dtypes.UInt32DType)
    return out


def load_state(path: str | os.PathLike) -> dict:
    """A trainer state file, read with weights_only=True (no code runs). A damaged or foreign file is a
    ValueError naming the file and what to do, not a traceback from the unpickler."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            st = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"trainer state {str(path)!r} cannot be read ({type(e).__name__}: {first}): the file is "
                         "truncated, damaged or not a k3 trainer state; resume from an earlier checkpoint (write its "
                         f"folder name into {path.parent.parent.parent / LATEST}) or start a new --out") from None
    if not isinstance(st, dict) or "step" not in st:
        raise ValueError(f"trainer state {str(path)!r}: expected a k3 trainer state (a dict with 'step'), "
                         f"got {type(st).__name__}")
    return st


def state_file(rank: int) -> str:
    """Each data-parallel rank keeps its own state (data position, RNG; optimizer shards under EP)."""
    return STATE_FILE if rank == 0 else f"trainer_state.rank{rank}.pt"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def staging_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f".staging-step_{step:07d}"


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
    """Every rank: its trainer state into the staging folder (temp file + fsync + rename)."""
    atomic_write(staging / state_file(rank), lambda f: torch.save(state, f))


def _point_latest(run_dir: Path, final: Path) -> None:
    atomic_write(Path(run_dir) / LATEST, final.name + "\n")


def commit_checkpoint(run_dir: Path, step: int, keep: int = 2) -> Path:
    """Rank 0, last: flush, rename the staging folder into place, move `latest`, prune old checkpoints.

    The step `latest` names is never written again (the staging copy is dropped); a stale folder of this step that
    `latest` does not name (a run continued from an earlier checkpoint) is swapped out by `replace_dir`. Pruning
    keeps the newest `keep` and always what `latest` names."""
    run_dir = Path(run_dir)
    ck = run_dir / "checkpoints"
    staging, final = staging_dir(run_dir, step), checkpoint_dir(run_dir, step)
    if final.exists() and latest_step(run_dir) == step:
        shutil.rmtree(staging, ignore_errors=True)
    else:
        replace_dir(staging, final)
    _point_latest(run_dir, final)
    steps = sorted(p for p in ck.glob("step_*") if _STEP_DIR.match(p.name))
    for old in steps[:-keep]:
        if old.name != final.name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_step(run_dir: str | os.PathLike) -> int | None:
    """The step `latest` names (from its folder name; nothing is loaded), or None when there is none."""
    p = Path(run_dir) / LATEST
    if not p.is_file():
        return None
    m = _STEP_DIR.match(p.read_text().strip())
    return int(m.group(1)) if m else None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` points to, or None when the run has none yet."""
    p = Path(run_dir) / LATEST
    if not p.is_file():
        return None
    name = p.read_text().strip()
    if not _STEP_DIR.match(name):
        raise ValueError(f"{p} holds {name[:80]!r}: expected the name of a folder checkpoints/step_NNNNNNN")
    ck = Path(run_dir) / "checkpoints" / name
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
    """Remove half-written checkpoints a crash left behind (ours, save_pretrained's and replace_dir's temp dirs)."""
    for p in (Path(run_dir) / "checkpoints").glob(".*"):
        if p.name.startswith(".staging-") or p.name.endswith(".tmp") or ".tmp-" in p.name:
            shutil.rmtree(p, ignore_errors=True)
