"""`k3 train` on a device mesh (gloo, CPU, k3-tiny fp32): FSDP2 (+ MoonEP) from --dp-shard/--ep, the global
data stream, distributed checkpoints (`torch.distributed.checkpoint`) resumed at another layout.

Oracle: the single-process run with grad_accum = G reads the same G micro-batches per step as a layout with
batch ranks P = dp_shard·ep and grad_accum G/P (see `k3.train.trainer`), so the step losses agree to rounding
(1e-5 relative; fp32 reduction order differs). The step includes everything that must see the whole
batch: gradient clipping (active: the norm is ≈8 > 1), Per-Head Muon on gathered FSDP2 updates, QK-clip with
τ low enough that heads are clipped (row-sharded weights), Quantile Balancing. Resuming a checkpoint — at the same layout or another one with
the same G — continues with the losses of the uninterrupted run (1e-5).

CI: 2 processes (dp_shard 2 vs one process, resumed at 1 process; cp 2 vs one process). K3_LONG_TESTS=1 adds 4 processes: dp2×ep2
vs one process, resumed at the same layout and at ep2 on 2 ranks."""

import json
import os
from pathlib import Path

import pytest
import torch

from k3.parallel._launch import spawn_gloo
from k3.train.config import TrainConfig
from k3.train.metrics import read_log
from k3.train.trainer import Trainer

TOL = 1e-5
LONG = pytest.mark.skipif(os.environ.get("K3_LONG_TESTS") != "1", reason="4-process run: set K3_LONG_TESTS=1")


def cfg(out, **kw) -> TrainConfig:
    base = dict(preset="k3-tiny", seq_len=32, batch_size=1, steps=3, eval_every=0, eval_batches=2,
                sample_every=0, sample_tokens=2, save_every=2, out=str(out), tensorboard=False, progress=False,
                curriculum="none", lr=3e-3, qk_clip_tau=0.1)  # τ below k3-tiny's max logits (≈0.11): heads clip
    base.update(kw)
    return TrainConfig(**base)


def _worker(rank, world, out, kw):
    os.environ["OMP_NUM_THREADS"] = "1"
    Trainer(cfg(out, **kw)).fit()


def losses(run) -> dict[int, tuple[float, float]]:
    """step → (loss, gradient norm before clipping): Muon's update is blind to the gradient's scale, the
    norm is not (a gradient reduced with the wrong factor shows here)."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_log(Path(run) / "log.jsonl") if r["kind"] == "train"}


def vals(run) -> list[float]:
    return [r["loss"] for r in read_log(Path(run) / "log.jsonl") if r["kind"] == "val"]


def close(a: dict, b: dict, steps) -> None:
    for k in steps:
        for x, y in zip(a[k], b[k]):
            assert abs(x - y) <= TOL * abs(x), (k, a[k], b[k])


def test_fsdp_run_equals_one_process_and_resumes_at_one_process(tmp_path, one_thread):
    ref, dp = tmp_path / "ref", tmp_path / "dp"
    Trainer(cfg(ref, grad_accum=2)).fit()
    spawn_gloo(_worker, 2, str(dp), {"dp_shard": 2, "stop_after": 2}, timeout_s=300)
    a, b = losses(ref), losses(dp)
    assert sorted(a) == [1, 2, 3] and sorted(b) == [1, 2]
    close(a, b, [1, 2])
    train = [r for r in read_log(ref / "log.jsonl") if r["kind"] == "train"]
    assert any(r["clipped_heads"] > 0 for r in train) and all(r["grad_norm"] > 1 for r in train)
    assert abs(vals(ref)[0] - vals(dp)[0]) <= TOL * vals(ref)[0]  # the same held-out rows, dealt out
    ck = dp / "checkpoints" / "step_0000002"
    assert (ck / "dcp" / ".metadata").is_file() and (ck / "trainer_state.rank1.pt").is_file()
    # the HF export of the distributed run: the full release layout, loadable by one process
    from k3.model import K3ForConditionalGeneration
    m = K3ForConditionalGeneration.from_pretrained(ck)
    assert m.language_model.model.embed_tokens.weight.shape[0] == m.config.text_config.vocab_size
    # resume the 2-rank checkpoint with one process (grad_accum 2: the same global batch): step 3 as the reference
    Trainer(cfg(dp, grad_accum=2)).fit()
    c = losses(dp)
    assert sorted(c) == [1, 2, 3]
    close(a, c, [3])
    assert json.loads((dp / "summary.json").read_text())["resumed"]


def test_context_parallel_run_equals_one_process(tmp_path, one_thread):
    """cp 2 (FSDP2 over the cp ranks, each holding two of the four segments of every row): the same losses and
    validation loss as one process; the end-of-run sample (generated with cp suspended) is the same text."""
    ref, cp = tmp_path / "ref", tmp_path / "cp"
    Trainer(cfg(ref, steps=2, save_every=0)).fit()
    spawn_gloo(_worker, 2, str(cp), {"cp": 2, "steps": 2, "save_every": 0}, timeout_s=300)
    a, b = losses(ref), losses(cp)
    assert sorted(a) == sorted(b) == [1, 2]
    close(a, b, a)
    va, vb = vals(ref), vals(cp)
    assert len(va) == len(vb) == 2 and all(abs(x - y) <= TOL * x for x, y in zip(va, vb))
    sa, sb = ([r["text"] for r in read_log(Path(d) / "log.jsonl") if r["kind"] == "sample"] for d in (ref, cp))
    assert sa == sb and len(sa) == 1


def test_layout_errors_name_the_values(tmp_path):
    with pytest.raises(ValueError, match=r"ep·cp·pp = 2·1·1 = 2 must divide the world size 1"):
        Trainer(cfg(tmp_path / "a", ep=2))
    with pytest.raises(ValueError, match=r"= 2 must equal the world size 1"):
        Trainer(cfg(tmp_path / "b", dp_shard=2))
    with pytest.raises(ValueError, match=r"ep=0: expected an integer >= 1"):
        cfg(tmp_path / "c", ep=0).resolved()
    with pytest.raises(ValueError, match="conflicts with ep=3"):
        cfg(tmp_path / "d", expert_parallel=True, ep=3).layout(4)
    assert cfg(tmp_path / "e", expert_parallel=True).layout(4).sizes == (1, 1, 1, 4)
    assert cfg(tmp_path / "f", ep=2).layout(8).sizes == (1, 4, 1, 2)


@LONG
def test_dp2_ep2_equals_one_process_and_resumes_at_same_and_other_layout(tmp_path, one_thread):
    ref, full, same, other = (tmp_path / n for n in ("ref", "full", "same", "other"))
    Trainer(cfg(ref, grad_accum=4, steps=4)).fit()
    lay = {"dp_shard": 2, "ep": 2, "steps": 4}
    spawn_gloo(_worker, 4, str(full), lay, timeout_s=600)
    a, b = losses(ref), losses(full)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    close(a, b, a)
    spawn_gloo(_worker, 4, str(same), {**lay, "stop_after": 2}, timeout_s=600)
    spawn_gloo(_worker, 4, str(same), lay, timeout_s=600)  # same layout: the uninterrupted 4-rank run
    close(b, losses(same), b)
    spawn_gloo(_worker, 4, str(other), {**lay, "stop_after": 2}, timeout_s=600)
    spawn_gloo(_worker, 2, str(other), {"ep": 2, "grad_accum": 2, "steps": 4}, timeout_s=600)  # 4 → 2 ranks
    close(a, losses(other), a)
