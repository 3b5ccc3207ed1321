"""The trainer behind `k3 train`: exact resume, atomic checkpoints (a kill mid-save), NaN stop, config files,
curriculum, `k3 generate` on the result."""

import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from k3.cli import main as k3_main
from k3.train.config import TrainConfig
from k3.train.metrics import read_log
from k3.train.state import latest_checkpoint
from k3.train.trainer import Trainer, TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="k3-tiny", seq_len=32, batch_size=2, steps=6, eval_every=3, eval_batches=1,
                sample_every=0, sample_tokens=6, save_every=3, out=str(out), tensorboard=False, progress=False,
                curriculum="0.5:1,0.5:4", long_context_frac=0.5, lr=3e-3)
    base.update(kw)
    return TrainConfig(**base)


def train_losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(Path(run) / "log.jsonl") if r["kind"] == "train"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "run"
    summary = Trainer(tiny(run)).fit()
    return run, summary


def test_run_writes_everything_and_generate_continues(uninterrupted, capsys):
    run, summary = uninterrupted
    assert summary["finished"] and summary["step"] == 6
    for name in ("log.jsonl", "summary.json", "training.png", "train_config.json", "latest"):
        assert (run / name).is_file(), name
    ck = latest_checkpoint(run)
    assert ck.name == "step_0000006" and (ck / "config.json").is_file() and (ck / "trainer_state.pt").is_file()
    recs = read_log(run / "log.jsonl")
    assert {r["seq_len"] for r in recs if r["kind"] == "train"} == {32, 128}  # the curriculum's two stages
    assert [r["step"] for r in recs if r["kind"] == "val"] == [0, 3, 6]
    assert k3_main(["generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_resume_is_bitwise_exact(uninterrupted, tmp_path):
    full, _ = uninterrupted
    run = tmp_path / "run"
    s = Trainer(tiny(run, stop_after=4)).fit()  # stops mid-stage 2 (after the curriculum switch at 3)
    assert s["step"] == 4 and not s["finished"] and latest_checkpoint(run).name == "step_0000004"
    s = Trainer(tiny(run)).fit()
    assert s["resumed"] and s["finished"]
    a, b = train_losses(full), train_losses(run)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # records after the checkpoint are not duplicated
    assert all(a[k] == b[k] for k in a), (a, b)  # bitwise equal floats


@pytest.mark.parametrize("save_every", [1, 2])
def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, save_every):
    """A step's loss is read one step late (the loop never waits for the GPU), but always before a checkpoint is
    written: with a checkpoint after every step, step 3's must not be written either."""
    run = tmp_path / "run"
    tr = Trainer(tiny(run, save_every=save_every, eval_every=0))
    calls = {"n": 0}

    def poison(mod, inp, out):
        if mod.training:
            calls["n"] += 1
            if calls["n"] == 3:  # the third training forward: step 3
                return out * float("nan")
        return out
    tr.model.language_model.model.norm.register_forward_hook(poison)  # once per forward
    with pytest.raises(TrainingDiverged, match=r"step 3: non-finite loss.*step_0000002"):
        tr.fit()
    assert latest_checkpoint(run).name == "step_0000002"
    assert not (run / "checkpoints" / "step_0000003").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_steps_issue_without_a_host_sync(tmp_path):
    """On a GPU the loop's steps never wait for the device (their losses are read a step late, batches go through
    pinned memory): the synchronizing calls CUDA's debug mode reports over a run do not grow with its steps."""
    import warnings

    def syncs(steps: int) -> int:
        tr = Trainer(tiny(tmp_path / f"run{steps}", steps=steps, eval_every=0, save_every=0, curriculum="none",
                          device="cuda"))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                tr.fit()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return collections.Counter(f"{w.filename}:{w.lineno}" for w in seen
                                   if "synchronizing CUDA operation" in str(w.message))

    syncs(2)  # the process's one-time syncs (first launches, lazy initialisation) land here
    few, more = syncs(3), syncs(8)
    assert not more - few and sum(more.values()) <= sum(few.values()), f"syncs that grow: {more - few}"
    rows = [r for r in read_log(tmp_path / "run8" / "log.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, 9))  # each row's step time is the GPU's, between events
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in rows), rows


def test_rows_carry_each_steps_clip_and_balance_statistics(tmp_path):
    """The trainer leaves QK-clip's and QB's statistics on the device and reads them with the next step's one
    sync: each train row must still hold its own step's values (recorded here by a synced read of the same
    tensors), including the last step's and those of the steps before a checkpoint."""
    run = tmp_path / "run"
    tr = Trainer(tiny(run, steps=5, eval_every=0, save_every=2, qk_clip_tau=1e-3))
    seen: dict = {"clip": [], "bal": []}
    clip_step, bal_step = tr.qkclip.step, tr.balance.step

    def clip_spy(sync=True):
        out = clip_step(sync=sync)
        seen["clip"].append({k: (v.item() if torch.is_tensor(v) else v) for k, v in out.items()})
        return out

    def bal_spy(sync=True):
        out = bal_step(sync=sync)
        seen["bal"].append([float(v) for v in out.values()])
        return out
    tr.qkclip.step, tr.balance.step = clip_spy, bal_spy
    tr.fit()
    rows = [r for r in read_log(run / "log.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r, c, b in zip(rows, seen["clip"], seen["bal"], strict=True):
        assert r["max_logit"] == pytest.approx(c["max_logit"], rel=1e-6) and r["clipped_heads"] == c["clipped_heads"]
        assert r["maxvio_mean"] == pytest.approx(sum(b) / len(b), rel=1e-9)
        assert r["maxvio_max"] == pytest.approx(max(b), rel=1e-9)
    assert any(r["clipped_heads"] > 0 for r in rows)  # a tiny τ clips: the counts are not all the trivial 0


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import k3.io.checkpoint as io
    from k3.train.trainer import Trainer
    from test_train import tiny
    real, n = io.save_file, {"calls": 0}
    def dying_save(tensors, path, metadata=None):
        n["calls"] += 1
        if n["calls"] == 2:  # the second checkpoint: write half a shard, then die
            with open(path, "wb") as f:
                f.write(b"\\0" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(tensors, path, metadata=metadata)
    io.save_file = dying_save
    Trainer(tiny(sys.argv[1], save_every=2, eval_every=0, steps=6)).fit()
""")


def test_kill_during_checkpoint_write_keeps_last_good(uninterrupted, tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    p = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(run)], env=env, capture_output=True, text=True)
    assert p.returncode == -9, p.stderr[-2000:]
    assert latest_checkpoint(run).name == "step_0000002"  # step 4's save died half-way
    assert list((run / "checkpoints").glob(".*staging-*"))  # the half-written one is only in staging
    s = Trainer(tiny(run, save_every=2, eval_every=0, steps=6)).fit()  # resumes from step 2 and finishes
    assert s["resumed"] and s["finished"]
    assert not list((run / "checkpoints").glob(".*staging-*"))
    assert train_losses(run) == train_losses(uninterrupted[0])  # same run as if nothing had happened


def test_config_file_and_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('steps = 2\nseq_len = 16\nbatch_size = 2\noptimizer = "adamw"\nbalance = "sign"\n'
                 f'out = "{tmp_path / "r"}"\neval_every = 0\nsample_every = 0\ntensorboard = false\n')
    assert k3_main(["train", "--config", str(f), "--no-progress", "--steps", "1"]) == 0
    cfg = json.loads((tmp_path / "r" / "train_config.json").read_text())
    assert cfg["steps"] == 1 and cfg["optimizer"] == "adamw" and cfg["seq_len"] == 16
    y = tmp_path / "c.yaml"
    y.write_text("steps: 2\nbogus: 1\n")
    assert k3_main(["train", "--config", str(y)]) == 2  # unknown key → clear error, exit code 2


@pytest.mark.parametrize("kw, msg", [
    (dict(optimizer="sgd"), "optimizer='sgd'"), (dict(balance="aux"), "balance='aux'"),
    (dict(curriculum="0.5:1"), "sum to 1"), (dict(steps=0), "steps=0"), (dict(min_lr_ratio=2.0), "min_lr_ratio"),
])
def test_bad_settings_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TrainConfig(**kw).resolved()


def test_auto_curriculum_scales_k3_schedule():
    st = TrainConfig(preset="k3-tiny", steps=1000).resolved().stages()
    assert [(s.start, s.seq_len, s.batch_size) for s in st] == [(0, 256, 8), (850, 2048, 1)]  # tokens/step constant
    st = TrainConfig(preset="k3-small", steps=1000, seq_len=8192, tokens_per_step=8192 * 128).resolved().stages()
    assert [s.seq_len for s in st] == [8192, 65536, 262144, 1048576]  # 8K → 64K → 256K → 1M
