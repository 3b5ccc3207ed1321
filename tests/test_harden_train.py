"""Issue 17, training side: a finished run re-run is kill-safe and says it is done (items 5, 12); trainer state is
read with weights_only=True and a damaged one gives a one-line error (item 7); `k3 train --data input.txt` works
and missing/empty data fails before anything is built or written (item 12); every `k3 train` flag is documented."""

import argparse
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from k3.cli import main as k3_main
from k3.data.sources import check_sources, open_sources, read_text
from k3.train import state as state_mod
from k3.train.cli import _add_train_flags
from k3.train.config import TrainConfig
from k3.train.metrics import read_log
from k3.train.state import latest_checkpoint, load_state, rng_state, set_rng_state
from k3.train.trainer import Trainer


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="k3-tiny", seq_len=16, batch_size=1, steps=3, eval_every=0, eval_batches=1, sample_every=0,
                sample_tokens=4, save_every=2, out=str(out), tensorboard=False, progress=False, curriculum="none")
    base.update(kw)
    return TrainConfig(**base)


def _flags(cfg: TrainConfig) -> list[str]:
    out = []
    for k in ("preset", "seq_len", "batch_size", "steps", "eval_every", "eval_batches", "sample_every",
              "sample_tokens", "save_every", "out", "curriculum"):
        out += ["--" + k.replace("_", "-"), str(getattr(cfg, k))]
    return out + ["--no-tensorboard", "--no-progress"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 3 steps with save_every=2: checkpoints at 2 and 3 (3 is not a multiple of save_every)."""
    run = tmp_path_factory.mktemp("fin") / "run"
    s = Trainer(tiny(run)).fit()
    assert s["finished"] and latest_checkpoint(run).name == "step_0000003"
    return run


def _snapshot(run: Path) -> dict:
    return {str(p.relative_to(run)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))
            if p.is_file()}


# ---- item 5: re-running a finished run ------------------------------------------------------------------
def test_rerun_of_finished_run_changes_nothing(finished, monkeypatch):
    before = _snapshot(finished)

    def killed(*a, **k):  # a kill at any rename or delete would show up as this exception
        raise SystemExit("killed")
    monkeypatch.setattr(state_mod.os, "replace", killed)
    monkeypatch.setattr(state_mod.shutil, "rmtree", killed)
    s = Trainer(tiny(finished)).fit()
    assert s["already_finished"] and s["step"] == 3
    assert _snapshot(finished) == before  # not re-saved, no final evaluation appended to the log
    assert latest_checkpoint(finished).name == "step_0000003"


def test_commit_never_deletes_what_latest_names(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ck = run / "checkpoints"
    ino = (ck / "step_0000003" / "trainer_state.pt").stat().st_ino
    staging = state_mod.staging_dir(run, 3)
    shutil.copytree(ck / "step_0000003", staging)
    (staging / "marker").write_text("new")
    state_mod.commit_checkpoint(run, 3, keep=1)  # the step exists: the staged copy is dropped
    assert (ck / "step_0000003" / "trainer_state.pt").stat().st_ino == ino
    assert not (ck / "step_0000003" / "marker").exists()
    assert not staging.exists() and latest_checkpoint(run).name == "step_0000003"
    # a later step that latest does not name yet: pruning (keep=1) must keep what latest names until it moves
    (run / "latest").write_text("step_0000002\n")
    shutil.copytree(ck / "step_0000003", ck / "step_0000002")
    staging = state_mod.staging_dir(run, 4)
    shutil.copytree(ck / "step_0000003", staging)
    real = state_mod.atomic_write

    def dies_on_latest(path, data, mode=None):
        if Path(path).name == "latest":
            raise SystemExit("killed before latest moved")
        return real(path, data, mode)
    state_mod.atomic_write = dies_on_latest
    try:
        with pytest.raises(SystemExit):
            state_mod.commit_checkpoint(run, 4, keep=1)
    finally:
        state_mod.atomic_write = real
    assert latest_checkpoint(run).name == "step_0000002"  # still complete
    # the resumed run (from step 2) reaches step 4 again: its new folder replaces the stale one latest never named
    shutil.copytree(ck / "step_0000003", staging)
    (staging / "marker").write_text("second")
    state_mod.commit_checkpoint(run, 4, keep=1)
    assert (ck / "step_0000004" / "marker").read_text() == "second"
    assert latest_checkpoint(run).name == "step_0000004"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000004"]


def test_cli_says_a_finished_run_is_done(finished, capsys):
    log = (finished / "log.jsonl").read_text()
    assert k3_main(["train", *_flags(tiny(finished))]) == 0
    out = capsys.readouterr().out
    assert "already finished at step 3" in out and "step_0000003" in out
    assert (finished / "log.jsonl").read_text() == log


def test_no_resume_refuses_a_run_dir(finished, capsys):
    assert k3_main(["train", *_flags(tiny(finished)), "--no-resume"]) == 2
    assert "already holds a run" in capsys.readouterr().err


# ---- item 7: trainer state is data, not code ----------------------------------------------------------------
def test_truncated_state_is_a_one_line_error(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    st = run / "checkpoints" / "step_0000003" / "trainer_state.pt"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 3])
    with pytest.raises(ValueError, match="cannot be read.*truncated"):
        load_state(st)
    assert k3_main(["train", *_flags(tiny(run, steps=5))]) == 2
    err = capsys.readouterr().err
    assert "trainer_state.pt" in err and "cannot be read" in err and "Traceback" not in err


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_state_with_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    f = tmp_path / "trainer_state.pt"
    torch.save({"step": 1, "x": _Payload(str(marker))}, f)
    with pytest.raises(ValueError, match="cannot be read"):
        load_state(f)
    assert not marker.exists()


@pytest.mark.parametrize("old_numpy_format", [False, True])
def test_rng_state_round_trips_through_weights_only(tmp_path, old_numpy_format):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    s = rng_state()
    if old_numpy_format:  # how runs written before the tensor format stored it
        s["numpy"] = np.random.get_state()
    f = tmp_path / "s.pt"
    torch.save({"step": 0, "rng": s}, f)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_state(f)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


# ---- item 12: first-hour paths ----------------------------------------------------------------------------------
def _input_txt(path: Path, n_paragraphs: int = 150) -> str:
    rng = random.Random(0)
    words = ["the", "king", "sword", "night", "river", "crown", "ghost", "speak", "heart", "storm", "gold"]
    paras = []
    for i in range(n_paragraphs):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(rng.randint(1, 5))]
        paras.append(f"SPEAKER{i % 7}:\n" + "\n".join(lines) + "\n")
    text = "\n".join(paras)
    path.write_text(text)
    return text


def test_one_text_file_gives_documents_and_a_validation_split(tmp_path):
    f = tmp_path / "input.txt"
    text = _input_txt(f)
    docs = list(read_text(f))
    assert len(docs) >= 8 and "".join(d.text for d in docs) == text  # cut at blank lines, nothing lost
    assert all(d.text.endswith("\n\n") for d in docs[:-1])
    tr = list(open_sources(f, split="train"))
    va = list(open_sources(f, split="validation"))
    assert tr and va and not {d.source for d in tr} & {d.source for d in va}
    assert len(tr) + len(va) == len(docs)
    check_sources([f])
    long_line = tmp_path / "one_line.txt"  # no line breaks at all: cut inside the line
    long_line.write_text("x" * 5000)
    assert "".join(d.text for d in read_text(long_line, chunk_bytes=300)) == "x" * 5000
    assert len(list(read_text(long_line, chunk_bytes=300))) == 5


def test_train_on_one_text_file(tmp_path, capsys):
    f = tmp_path / "input.txt"
    _input_txt(f)
    out = tmp_path / "run"
    cfg = tiny(out, steps=1, save_every=0)
    assert k3_main(["train", *_flags(cfg), "--data", str(f)]) == 0
    assert latest_checkpoint(out).name == "step_0000001"
    assert [r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "val"] == [0, 1]


@pytest.mark.parametrize("content, msg", [(None, "does not exist"), ("", "no text to train on"),
                                          ("   \n\n", "no text to train on"),
                                          ("one line only\n", "only 1 document")])
def test_bad_data_fails_before_anything_is_written(tmp_path, capsys, content, msg):
    f = tmp_path / "input.txt"
    if content is not None:
        f.write_text(content)
    out = tmp_path / "run"
    assert k3_main(["train", *_flags(tiny(out)), "--progress", "--data", str(f)]) == 2
    err = capsys.readouterr().err
    assert msg in err and str(f) in err and "k3 train:" in err and "it/s" not in err and "step/s" not in err
    assert not out.exists()  # no half-made --out


def test_failed_run_removes_the_out_it_created(tmp_path, monkeypatch):
    out = tmp_path / "run"

    def boom(self):
        raise RuntimeError("simulated failure before the first checkpoint")
    monkeypatch.setattr(Trainer, "fit", boom)
    from k3.train.trainer import train
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny(out))
    assert not out.exists()


def test_every_train_flag_is_documented():
    p = argparse.ArgumentParser()
    _add_train_flags(p)
    acts = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(acts) == 1 + len(TrainConfig.__dataclass_fields__)
    for a in acts:
        assert a.help and len(a.help) > 10, a.option_strings
    fields = TrainConfig.__dataclass_fields__
    for name, f in fields.items():
        a = next(a for a in acts if a.dest == name)
        if f.default not in (None, [], __import__("dataclasses").MISSING) and name != "out":
            assert f"(default: {f.default!r})" in a.help, name
    assert next(a for a in acts if a.dest == "optimizer").choices == ("muon", "adamw")
    assert next(a for a in acts if a.dest == "balance").choices == ("qb", "qb-exact", "sign", "none")


# ---- the shared atomic writer (item 11) ----------------------------------------------------------------------------
def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    from k3 import _atomic
    p = tmp_path / "state.json"
    _atomic.atomic_write_json(p, {"v": 1})

    def dying(f):
        f.write(b'{"v": 2, "half')
        raise KeyboardInterrupt  # a kill in the middle of writing
    with pytest.raises(KeyboardInterrupt):
        _atomic.atomic_write(p, dying)
    assert p.read_text() == '{"v": 1}' and [q.name for q in tmp_path.iterdir()] == ["state.json"]
    with pytest.raises(ValueError):  # NaN is not JSON: refused before anything is written
        _atomic.atomic_write_json(p, {"v": float("nan")})
    synced = []
    monkeypatch.setattr(_atomic.os, "fsync", lambda fd: synced.append(fd))
    _atomic.atomic_write(p, "new")
    assert p.read_text() == "new" and len(synced) == 2  # the file, then its directory


def test_replace_dir_swaps_and_refuses_a_missing_source(tmp_path):
    from k3 import _atomic
    old, new = tmp_path / "ck", tmp_path / ".ck.tmp-1"
    old.mkdir()
    (old / "a").write_text("old")
    with pytest.raises(FileNotFoundError):
        _atomic.replace_dir(tmp_path / "missing", old)
    assert (old / "a").read_text() == "old"
    new.mkdir()
    (new / "a").write_text("new")
    _atomic.replace_dir(new, old)
    assert (old / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
