"""Training with FP8 projections (`k3 train --fp8`) against the same run without, step by step: loss curves and the
final training and validation losses. Same preset, data order, seed and schedule; only `--fp8` differs.

    python benchmarks/fp8_convergence.py --steps 200 --out runs/fp8_conv --plot docs/img/fp8_convergence.png

Each run is `k3 train --preset PRESET --steps N --out OUT/{plain,fp8}`; a finished run is read, not rerun (the
trainer resumes an unfinished one). On a CPU this checks the numerics of the recipe, not its speed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3.train.metrics import read_log  # noqa: E402


def run(mode: str, a) -> list[dict]:
    out = Path(a.out) / mode
    log = out / "log.jsonl"
    done = log.exists() and any(r["kind"] == "train" and r["step"] == a.steps for r in read_log(log))
    if not done:
        cmd = [sys.executable, "-m", "k3.cli", "train", "--preset", a.preset, "--steps", str(a.steps),
               "--out", str(out),
               "--no-progress", "--no-tensorboard", "--sample-every", "0", *(["--fp8"] if mode == "fp8" else []),
               *a.extra]
        subprocess.run(cmd, check=True, cwd=ROOT)
    return read_log(log)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="runs/fp8_conv")
    ap.add_argument("--plot", default=None, help="write the loss curves here (PNG)")
    ap.add_argument("extra", nargs="*", help="more `k3 train` flags (after --)")
    a = ap.parse_args()
    logs = {m: run(m, a) for m in ("plain", "fp8")}
    res = {}
    for m, rows in logs.items():
        train = {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
        val = [(r["step"], r["loss"]) for r in rows if r["kind"] == "val"]
        last = sorted(train)[-10:]
        res[m] = {"train": train, "val": val, "final_train_mean10": sum(train[s] for s in last) / len(last),
                  "final_val": val[-1][1] if val else None}
    p, f = res["plain"], res["fp8"]
    common = sorted(set(p["train"]) & set(f["train"]))
    gap = [abs(f["train"][s] - p["train"][s]) / p["train"][s] for s in common]
    summary = {"preset": a.preset, "steps": a.steps,
               "plain_final_train_mean10": p["final_train_mean10"], "fp8_final_train_mean10": f["final_train_mean10"],
               "plain_final_val": p["final_val"], "fp8_final_val": f["final_val"],
               "max_rel_gap": max(gap), "mean_rel_gap": sum(gap) / len(gap)}
    print(json.dumps(summary, indent=1))
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for m, style in (("plain", "-"), ("fp8", "--")):
            st = sorted(res[m]["train"])
            ax[0].plot(st, [res[m]["train"][s] for s in st], style, label=f"{m} train")
            if res[m]["val"]:
                ax[0].plot(*zip(*res[m]["val"]), style, marker="o", label=f"{m} validation")
        ax[0].set_xlabel("step")
        ax[0].set_ylabel("loss")
        ax[0].set_title(f"{a.preset}: bf16/fp32 projections vs FP8 (row-wise e4m3)")
        ax[0].legend()
        ax[1].plot(common, [100 * (f["train"][s] - p["train"][s]) / p["train"][s] for s in common])
        ax[1].axhline(0, color="grey", lw=0.5)
        ax[1].set_xlabel("step")
        ax[1].set_ylabel("FP8 − plain training loss (%)")
        fig.tight_layout()
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(a.plot, dpi=110)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
