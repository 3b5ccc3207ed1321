"""What `k3 sft` / `k3 rl` write between the stages of a chain, and when they stop (k3.post.config):
save_mode="weights" leaves only the final weights (bf16, loadable, no optimizer state, no checkpoints) while
training runs on fp32 master weights; time_limit_s stops a run early and it still saves and reports; bad
settings are named. k3-tiny on CPU."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny
from k3 import K3ForConditionalGeneration
from k3.io.tokenizer import default_tokenizer
from k3.post import tasks
from k3.post.config import final_model_dir
from k3.post.rl import RLConfig, RLTrainer
from k3.post.sft import SFTConfig, SFTTrainer
from k3.model.state_dict import FP32_SUFFIXES
from k3.train.state import latest_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A k3-tiny checkpoint stored in bf16 (as a hand-over between stages is) and a few easy conversations."""
    d = tmp_path_factory.mktemp("stages")
    model = make_tiny(seed=1)
    model.save_pretrained(d / "ck", dtype=torch.bfloat16)
    default_tokenizer(model.config.text_config).save_pretrained(d / "ck")
    convs = [tasks.solve(t, effort=e) for t in tasks.generate("general", "train", 4, 0, level="easy")
             for e in ("low", "max")]
    tasks.write_jsonl(convs, d / "data.jsonl")
    return d / "ck", d / "data.jsonl"


def sft_cfg(setup, out, **kw) -> SFTConfig:
    ck, data = setup
    base = dict(checkpoint=str(ck), sft_data=str(data), out=str(out), seq_len=512, steps=2, eval_every=0,
                sample_every=0, sample_tokens=4, tensorboard=False, progress=False, lr=3e-3, device="cpu")
    base.update(kw)
    return SFTConfig(**base)


def test_weights_mode_writes_only_bf16_weights_and_trains_fp32_masters(setup, tmp_path):
    tr = SFTTrainer(sft_cfg(setup, tmp_path / "run", steps=1, seq_len=256, save_mode="weights", master_dtype="float32"))
    dtypes = {p.dtype for p in tr.model.parameters()}
    assert dtypes == {torch.float32}, dtypes                       # bf16 on disk, fp32 master weights
    start = {k: v.clone() for k, v in tr.model.state_dict().items()}
    s = tr.fit()
    assert s["finished"] and s["step"] == 1
    run = tmp_path / "run"
    assert latest_checkpoint(run) is None and not (run / "checkpoints").exists()   # no trainer state at all
    assert not list(run.rglob("*.pt"))
    model_dir = final_model_dir(run)
    assert model_dir == run / "model" and (model_dir / "tiktoken.model").is_file()
    disk = {}
    for f in model_dir.glob("*.safetensors"):
        disk.update(load_file(f))
    for k, t in disk.items():
        want = torch.float32 if k.endswith(FP32_SUFFIXES) else torch.bfloat16
        assert t.dtype == want, (k, t.dtype)
    loaded = K3ForConditionalGeneration.from_pretrained(model_dir)
    sd, now = loaded.state_dict(), tr.model.state_dict()
    changed = 0
    for k, v in now.items():                                        # what was saved is the trained model, rounded
        if v.is_floating_point():
            torch.testing.assert_close(sd[k].float(), v.to(sd[k].dtype).float(), rtol=0, atol=0)
            changed += not torch.equal(v, start[k])
    assert changed > 10


def test_time_limit_stops_sft_early_and_still_saves(setup, tmp_path):
    tr = SFTTrainer(sft_cfg(setup, tmp_path / "run", steps=50, save_mode="weights", time_limit_s=1e-6))
    s = tr.fit()
    assert s["stopped_early"] == "time limit" and not s["finished"] and s["step"] < 50
    assert (final_model_dir(tmp_path / "run") / "config.json").is_file()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped_early"] == "time limit"


def test_time_limit_stops_rl_early_and_none_mode_writes_no_weights(setup, tmp_path):
    ck, _ = setup
    cfg = RLConfig(checkpoint=str(ck), out=str(tmp_path / "rl"), domain="general", level="easy", effort="low",
                   steps=20, prompts=1, samples=2, pool=2, eval_prompts=0, budget_samples=1, max_turn_tokens=4,
                   max_total_tokens=4, tensorboard=False, progress=False, device="cpu", save_mode="none",
                   time_limit_s=1e-6, master_dtype="float32")
    tr = RLTrainer(cfg)
    try:
        assert {t.kind for t in tr.pool} <= {"copy", "add"}          # the pool is the level's
        s = tr.fit()
    finally:
        tr.close()
    assert s["stopped_early"] == "time limit" and s["step"] < 20
    assert not list((tmp_path / "rl").rglob("*.safetensors")) and latest_checkpoint(tmp_path / "rl") is None
    assert (tmp_path / "rl" / "budgets.json").is_file()            # b0 was still estimated and kept


@pytest.mark.parametrize("kw, msg", [
    ({"save_mode": "some"}, "save_mode='some': expected one of full, weights, none"),
    ({"master_dtype": "fp8"}, "master_dtype='fp8': expected one of float32, bfloat16, float16"),
    ({"save_dtype": "int8"}, "save_dtype='int8': expected one of"),
    ({"time_limit_s": 0}, "time_limit_s=0: expected a number of seconds > 0"),
])
def test_bad_post_settings_are_named(setup, tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        sft_cfg(setup, tmp_path / "x", **kw).resolved()
    ck, _ = setup
    with pytest.raises(ValueError, match=msg):
        RLConfig(checkpoint=str(ck), out=str(tmp_path / "y"), **kw).resolved()


def test_rl_level_is_checked(setup, tmp_path):
    ck, _ = setup
    with pytest.raises(ValueError, match="level 'hard' is not one of easy, standard .domain 'coding'"):
        RLConfig(checkpoint=str(ck), out=str(tmp_path / "y"), domain="coding", level="hard").resolved()
