"""`k3 sft` (k3.post.sft): the loss is the masked cross-entropy of whole conversations, training lowers it and
writes a loadable checkpoint, resume is bitwise exact, bad inputs are named. k3-tiny on CPU."""

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny
from k3 import K3ForConditionalGeneration
from k3.data.packing import collate
from k3.io.tokenizer import K3Tokenizer, default_tokenizer
from k3.post import cli as sft_cli
from k3.post.sft import SFTConfig, SFTTrainer, sft
from k3.post.sft_data import pack_row
from k3.train.metrics import read_log
from k3.train.state import latest_checkpoint


def conversation(i: int) -> dict:
    """i % 3 == 0: thinking (effort low); 1: thinking off; 2: a tool round trip, thinking off."""
    a, b = 3 * i + 4, 7 * i + 5
    msgs = [{"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "reasoning_content": f"{a} + {b} = {a + b}.", "content": f"{a + b}"}]
    tools = None
    if i % 3 == 2:
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
        msgs[1:1] = [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": str(a + b)}]
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    return {"task_id": f"add-{i}", "domain": "general", "messages": msgs, "tools": tools,
            "reasoning_effort": "low" if i % 3 == 0 else "none"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A k3-tiny checkpoint (weights + tokenizer, as `k3 train` writes them) and six conversations."""
    d = tmp_path_factory.mktemp("sft")
    model = make_tiny(seed=0)
    model.save_pretrained(d / "ck")
    default_tokenizer(model.config.text_config).save_pretrained(d / "ck")
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(6)))
    return d / "ck", data


def cfg(setup, out, **kw) -> SFTConfig:
    ck, data = setup
    base = dict(checkpoint=str(ck), sft_data=str(data), out=str(out), seq_len=256, batch_size=1, steps=6,
                save_every=3, eval_every=0, sample_tokens=4, tensorboard=False, progress=False, lr=3e-3)
    base.update(kw)
    return SFTConfig(**base)


def test_loss_is_masked_cross_entropy_of_whole_conversations(setup, tmp_path):
    """The trainer's loss on a packed row (three conversations + padding) equals a hand-computed mean of
    −log p(target) over the assistant tokens, each conversation run alone (fp64, |Δ| < 1e-6)."""
    tr = SFTTrainer(cfg(setup, tmp_path / "run", mtp_weight=0.0, seq_len=512))
    tr.model.double()
    exs = tr.train_examples[:3]
    assert all(e.mask.any() and not e.mask.all() for e in exs)
    b = collate([pack_row(exs, 512, tr.tokenizer.pad_token_id)])
    assert b["cu_seqlens"].numel() == 5  # three conversations and the padding
    loss, _ = tr._loss(b)
    nll, n = 0.0, 0
    tr.model.eval()
    with torch.no_grad():
        for e in exs:
            logp = torch.log_softmax(tr.model(e.ids[None]).logits[0].double(), -1)
            for t in range(len(e.ids) - 1):
                if e.mask[t + 1]:
                    nll -= logp[t, e.ids[t + 1]].item()
                    n += 1
    assert n == sum(int(e.mask[1:].sum()) for e in exs)
    assert loss.dtype == torch.float64 and abs(loss.item() - nll / n) < 1e-6, (loss.item(), nll / n)


def test_sft_lowers_loss_and_writes_a_loadable_checkpoint(setup, tmp_path, capsys):
    ck, data = setup
    out = tmp_path / "run"
    p = argparse.ArgumentParser()
    sft_cli.add_parser(p.add_subparsers())
    args = p.parse_args(["sft", "--checkpoint", str(ck), "--data", str(data), "--out", str(out), "--steps", "8",
                         "--seq-len", "256", "--batch", "1", "--lr", "3e-3", "--optimizer", "adamw",
                         "--val-data", str(data), "--eval-every", "0", "--sample-tokens", "4", "--no-tensorboard",
                         "--no-progress"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "6 conversations" in printed and "sample:\nuser: What is 12 + 30?" in printed
    vals = [r["loss"] for r in read_log(out / "log.jsonl") if r["kind"] == "val"]
    assert len(vals) == 2 and vals[-1] < vals[0] - 1.0, vals  # held-out = train set here: it must be learnt
    for name in ("training.png", "summary.json", "sft_data.json", "train_config.json"):
        assert (out / name).is_file(), name
    last = latest_checkpoint(out)
    assert last.name == "step_0000008"
    model = K3ForConditionalGeneration.from_pretrained(last)
    tok = K3Tokenizer.from_pretrained(last)
    assert tok.vocab_size == model.config.text_config.vocab_size
    before = load_file(str(ck / "model-00001-of-00001.safetensors"))
    after = model.state_dict()
    changed = [k for k, v in before.items() if k in after and not torch.equal(v, after[k].to(v.dtype))]
    assert len(changed) > len(before) // 2  # the weights moved, and the saved ones are what loads


def train_losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(Path(run) / "log.jsonl") if r["kind"] == "train"}


def test_resume_is_bitwise_exact(setup, tmp_path):
    """Stop at step 3, resume to 6: the same losses and weights as an uninterrupted run (Muon; 4 rows per epoch,
    so the resumed data position crosses an epoch boundary)."""
    full, part = tmp_path / "full", tmp_path / "part"
    sft(cfg(setup, full))
    s = sft(cfg(setup, part, stop_after=3))
    assert s["step"] == 3 and not s["finished"] and latest_checkpoint(part).name == "step_0000003"
    s = sft(cfg(setup, part))
    assert s["resumed"] and s["finished"]
    a, b = train_losses(full), train_losses(part)
    assert sorted(b) == [1, 2, 3, 4, 5, 6] and all(a[k] == b[k] for k in a), (a, b)
    wa = load_file(str(latest_checkpoint(full) / "model-00001-of-00001.safetensors"))
    wb = load_file(str(latest_checkpoint(part) / "model-00001-of-00001.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # resuming on different data is refused, not silently continued
    ck, data = setup
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(1, 7)))
    with pytest.raises(ValueError, match="fingerprint.*data or packing changed"):
        sft(cfg((ck, other), part, steps=8))


def test_bad_inputs_are_named(setup, tmp_path):
    ck, data = setup
    with pytest.raises(FileNotFoundError, match="checkpoint '.*nope' does not exist"):
        sft(cfg(setup, tmp_path / "o", checkpoint=str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        sft(cfg(setup, tmp_path / "o", checkpoint=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="data '.*missing.jsonl' does not exist"):
        sft(cfg(setup, tmp_path / "o", sft_data=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(conversation(0)) + "\n" + json.dumps({"task_id": "x9", "messages": [
        {"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: conversation 'x9' cannot be rendered.*function\.name"):
        sft(cfg(setup, tmp_path / "o", sft_data=str(bad)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no usable conversation"):
        sft(cfg(setup, tmp_path / "o", sft_data=str(empty)))
    with pytest.raises(ValueError, match="effort='extreme'"):
        sft(cfg(setup, tmp_path / "o", effort="extreme"))
    assert not (tmp_path / "o").exists()  # nothing is written before the inputs check out
    pre = tmp_path / "pretrain"  # a `k3 train` run as --out: its trainer state must not be taken for ours
    (pre / "checkpoints" / "step_0000005").mkdir(parents=True)
    (pre / "latest").write_text("step_0000005\n")
    (pre / "train_config.json").write_text(json.dumps({"preset": "k3-tiny"}))
    with pytest.raises(ValueError, match="holds a `k3 train` run, not a `k3 sft` run"):
        sft(cfg(setup, pre))
