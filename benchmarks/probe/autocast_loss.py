"""The loss curve of `tests/test_cuda.py::test_bf16_autocast_training_reduces_loss` (k3-tiny, bf16 autocast,
AdamW 3e-3, one batch of 4 x 128 repeated 30 steps) under the current switches: which kernel change moves it.

    K3_SITU_APPROX=0 K3_ATTN_RES_STREAM=0 SEED=1 python benchmarks/probe/autocast_loss.py
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_tiny, overfit_losses  # noqa: E402

SEED = int(os.environ.get("SEED", "0"))  # 0: the test's seeds
torch.manual_seed(SEED)
model = make_tiny(seed=3 + SEED).cuda().train()
losses = overfit_losses(model, torch.randint(0, 4000, (4, 128), device="cuda"), 30, torch.bfloat16)
sw = {k: os.environ.get(k, "default") for k in ("K3_SITU_APPROX", "K3_ATTN_RES_STREAM")}
print(sw, f"seed {SEED}", " ".join(f"{x:.2f}" for x in losses[::5]), f"last {losses[-1]:.3f} ratio "
      f"{losses[-1] / losses[0]:.3f}")
