"""`k3 train` on several processes (gloo, CPU): data parallel (FSDP2, dp_shard 2), and MoonEP expert parallel
over the ranks (`expert_parallel`: ep 2, FSDP2 over the ep ranks for the rest).

Oracle: the expert-parallel run must follow the plain data-parallel run (replicated experts) step by step,
its checkpoint must hold every expert (gathered), and an interrupted EP run resumed must equal the
uninterrupted one."""

import json
from pathlib import Path

import pytest
import torch

from k3.parallel._launch import spawn_gloo
from k3.train.config import TrainConfig
from k3.train.metrics import read_log
from k3.train.trainer import Trainer


def cfg(out, **kw) -> TrainConfig:
    base = dict(preset="k3-tiny", seq_len=32, batch_size=2, steps=4, eval_every=2, eval_batches=1,
                sample_every=0, sample_tokens=4, save_every=2, out=str(out), tensorboard=False, progress=False,
                curriculum="none", lr=3e-3)
    base.update(kw)
    return TrainConfig(**base)


def _worker(rank, world, out, kw):
    Trainer(cfg(out, **kw)).fit()


def losses(run) -> dict[int, tuple[float, float]]:
    """step → (loss, gradient norm): the norm catches a gradient reduced with a wrong factor, which Muon's
    scale-free update would hide from the losses."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_log(Path(run) / "log.jsonl") if r["kind"] == "train"}


@pytest.mark.slow
def test_expert_parallel_training_matches_data_parallel_and_resumes(tmp_path):
    dp, ep, ep2 = tmp_path / "dp", tmp_path / "ep", tmp_path / "ep2"
    spawn_gloo(_worker, 2, str(dp), {}, timeout_s=600)
    spawn_gloo(_worker, 2, str(ep), {"expert_parallel": True}, timeout_s=600)
    a, b = losses(dp), losses(ep)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for k in a:
        for x, y in zip(a[k], b[k]):
            assert abs(x - y) <= 1e-5 * abs(x), (k, a[k], b[k])
    # the EP checkpoint is the full release layout: every expert, equal to the data-parallel weights
    from k3.model import K3ForConditionalGeneration
    from k3.train.state import latest_checkpoint
    wa = K3ForConditionalGeneration.from_pretrained(latest_checkpoint(dp)).state_dict()
    wb = K3ForConditionalGeneration.from_pretrained(latest_checkpoint(ep)).state_dict()
    assert wa.keys() == wb.keys()
    for n in wa:  # AdamW's g/√v amplifies fp32 reduction-order differences on near-zero gradients
        err = ((wa[n].double() - wb[n].double()).norm() / wa[n].double().norm().clamp_min(1e-30)).item()
        assert err < 1e-4, (n, err)
    # stop after 2 steps, resume: the same losses as the uninterrupted EP run (bitwise)
    spawn_gloo(_worker, 2, str(ep2), {"expert_parallel": True, "stop_after": 2}, timeout_s=600)
    assert sorted(losses(ep2)) == [1, 2]
    spawn_gloo(_worker, 2, str(ep2), {"expert_parallel": True}, timeout_s=600)
    assert losses(ep2) == b
    assert json.loads((ep2 / "summary.json").read_text())["resumed"]


def test_expert_parallel_needs_several_ranks(tmp_path):
    with pytest.raises(ValueError, match="expert_parallel needs several ranks"):
        Trainer(cfg(tmp_path / "r", expert_parallel=True))
