"""End-to-end: training step, incremental decoding, padding, generation, checkpoints, images."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny, overfit_losses, rel_rmse
from k3 import K3Cache, K3Config, K3ForConditionalGeneration
from k3.io.checkpoint import CheckpointError
from k3.model.state_dict import checkpoint_tensors
from k3.io.mxfp4 import mxfp4_fake_quantize


def test_tiny_forward_backward_every_parameter_learns():
    model = make_tiny(seed=0).train()
    ids = torch.randint(0, 4000, (2, 70))  # > 64: two KDA chunks
    out = model(ids, labels=ids)
    assert out.loss.isfinite() and out.mtp_loss.isfinite()
    (out.loss + 0.1 * out.mtp_loss).backward()
    no_grad = {n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0}
    # layer 0's pre-attention AttnRes site only ever sees the embedding (a single candidate) — as in the release
    assert no_grad == {"language_model.model.layers.0.self_attention_res_norm.weight",
                       "language_model.model.layers.0.self_attention_res_proj.weight"}


def test_gradient_checkpointing_gives_same_gradients():
    ids = torch.randint(0, 4000, (2, 40))
    grads = []
    for ckpt in (False, True):
        model = make_tiny(seed=0).train()
        model.gradient_checkpointing_enable(ckpt)
        out = model(ids, labels=ids)
        (out.loss + out.mtp_loss).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert rel_rmse(grads[0], grads[1]) < 1e-6


def logits_full(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def test_incremental_decode_equals_full_forward():
    model = make_tiny(seed=1)
    ids = torch.randint(0, 4000, (2, 40))
    full = logits_full(model, ids)
    cache = K3Cache()
    with torch.no_grad():
        steps = [model(ids[:, :13], past_key_values=cache, use_cache=True).logits]
        for t in range(13, 40):  # crosses AttnRes block boundaries (size 2) and both MLA layers
            steps.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    inc = torch.cat(steps, 1)
    assert (inc - full).abs().max() <= 1e-4
    assert cache.seen_tokens == 40 and set(cache.layer(3)) == {"c", "k_pe"}
    assert set(cache.layer(0)) == {"conv_q", "conv_k", "conv_v", "state"}


def test_chunked_prefill_equals_full_forward():
    model = make_tiny(seed=2)
    ids = torch.randint(0, 4000, (1, 150))
    full = logits_full(model, ids)
    cache = K3Cache()
    with torch.no_grad():
        parts = [model(ids[:, s:s + 37], past_key_values=cache, use_cache=True).logits for s in range(0, 150, 37)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-4


def test_left_padded_batch_rows_equal_alone():
    model = make_tiny(seed=3)
    a = torch.randint(0, 4000, (1, 20))
    b = torch.randint(0, 4000, (1, 12))
    pad = model.config.text_config.pad_token_id
    batch = torch.cat([a, torch.cat([torch.full((1, 8), pad), b], 1)])
    mask = torch.cat([torch.ones(1, 20), torch.cat([torch.zeros(1, 8), torch.ones(1, 12)], 1)]).long()
    lg = logits_full(model, batch, mask)
    assert (lg[0] - logits_full(model, a)[0]).abs().max() <= 1e-4
    assert (lg[1, 8:] - logits_full(model, b)[0]).abs().max() <= 1e-4
    # and generation from the padded batch gives each row its own greedy continuation
    gen = model.generate(batch, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(gen[0, 20:], model.generate(a, max_new_tokens=6)[0, 20:])
    assert torch.equal(gen[1, 20:], model.generate(b, max_new_tokens=6)[0, 12:])


def test_greedy_generate_matches_recompute_loop():
    model = make_tiny(seed=4)
    ids = torch.randint(0, 4000, (2, 9))
    out = model.generate(ids, max_new_tokens=8, prefill_chunk_size=4)
    seq = ids
    for _ in range(8):
        seq = torch.cat([seq, logits_full(model, seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_sampling_is_seeded_and_top_p_restricts():
    model = make_tiny(seed=5)
    ids = torch.randint(0, 4000, (1, 5))
    a = model.generate(ids, max_new_tokens=5, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(0))
    b = model.generate(ids, max_new_tokens=5, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    from k3.model.generation import sample_next
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0]])
    draws = torch.stack([sample_next(logits, 1.0, 0.5, torch.Generator().manual_seed(i)) for i in range(50)])
    assert (draws == 0).all()  # token 0 alone holds > 50 % of the mass
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, 0.0)


def test_eos_stops_generation():
    model = make_tiny(seed=6)
    ids = torch.randint(0, 4000, (1, 5))
    first = model.generate(ids, max_new_tokens=1)[0, -1].item()
    out = model.generate(ids, max_new_tokens=10, eos_token_id=first)
    assert out.shape[1] == 6 and out[0, -1] == first


# ---- checkpoints -----------------------------------------------------------------------------------
def test_save_load_round_trip_identical_logits(tmp_path):
    model = make_tiny(seed=7, vision=True)
    path = model.save_pretrained(tmp_path / "ckpt", max_shard_size="1MB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((path / s).is_file() for s in shards)
    assert set(index["weight_map"]) == set(checkpoint_tensors(model.config))
    loaded = K3ForConditionalGeneration.from_pretrained(path)
    ids = torch.randint(0, 4000, (2, 30))
    assert torch.equal(logits_full(model, ids), logits_full(loaded, ids))
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_single_unsharded_file_loads(tmp_path):
    model = make_tiny(seed=8)
    path = model.save_pretrained(tmp_path / "ckpt")
    tensors = {}
    for f in sorted(path.glob("model-*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    (path / "model.safetensors.index.json").unlink()
    save_file(tensors, path / "model.safetensors")
    loaded = K3ForConditionalGeneration.from_pretrained(path)
    ids = torch.randint(0, 4000, (1, 10))
    assert torch.equal(logits_full(model, ids), logits_full(loaded, ids))


def test_bf16_load_keeps_fp32_parameters(tmp_path):
    model = make_tiny(seed=9)
    path = model.save_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = K3ForConditionalGeneration.from_pretrained(path)
    sd = loaded.state_dict()
    assert sd["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert sd["language_model.model.layers.0.self_attn.q_conv1d.weight"].dtype == torch.float32
    assert sd["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["language_model.model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    ids = torch.randint(0, 4000, (1, 12))
    assert loaded(ids).logits.isfinite().all()


def test_mxfp4_experts_round_trip(tmp_path):
    model = make_tiny(seed=10)
    model.config.text_config.quantization_config = K3Config.preset("k3").text_config.quantization_config
    path = model.save_pretrained(tmp_path / "ckpt")
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed" in keys
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight" not in keys
    loaded = K3ForConditionalGeneration.from_pretrained(path)
    with torch.no_grad():  # the reference: the same model with fake-quantised routed experts
        for name, p in model.named_parameters():
            if ".experts.w" in name:
                p.copy_(mxfp4_fake_quantize(p))
    ids = torch.randint(0, 4000, (1, 16))
    assert (logits_full(model, ids) - logits_full(loaded, ids)).abs().max() <= 1e-5


def _corrupt(path, key, fn):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    f = path / index["weight_map"][key]
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)
    return f.name


@pytest.mark.parametrize("what", ["missing", "shape", "unexpected"])
def test_bad_checkpoints_name_tensor_and_file(tmp_path, what):
    model = make_tiny(seed=11)
    path = model.save_pretrained(tmp_path / "ckpt", max_shard_size="1MB")
    key = "language_model.model.layers.2.self_attn.k_proj.weight"
    if what == "missing":
        fname = _corrupt(path, key, lambda t: t.pop(key))
        match = key
    elif what == "shape":
        fname = _corrupt(path, key, lambda t: t.__setitem__(key, torch.zeros(3, 3)))
        match = rf"{key} in {fname}.*\[3, 3\]"
    else:
        extra = "language_model.model.layers.2.self_attn.bogus.weight"
        fname = _corrupt(path, key, lambda t: t.__setitem__(extra, torch.zeros(2)))
        match = rf"{extra} in {fname}"
    with pytest.raises(CheckpointError, match=match):
        K3ForConditionalGeneration.from_pretrained(path)


def test_truncated_shard_is_reported(tmp_path):
    model = make_tiny(seed=12)
    path = model.save_pretrained(tmp_path / "ckpt", max_shard_size="1MB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=victim.name):
        K3ForConditionalGeneration.from_pretrained(path)


def test_nonzero_a_log_tail_is_rejected(tmp_path):
    """The padding has no room on disk: saving refuses it (a file with a non-zero tail is refused on load,
    tests/test_checkpoint_layout.py)."""
    model = make_tiny(seed=13)
    with torch.no_grad():
        model.language_model.model.layers[1].self_attn.A_log[100] = 1.0
    with pytest.raises(CheckpointError, match="layers.1.self_attn.A_log"):
        model.save_pretrained(tmp_path / "ckpt")


def test_interrupted_save_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    model = make_tiny(seed=14)
    import k3.io.checkpoint as ck
    calls = {"n": 0}
    real = ck.save_file

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(ck, "save_file", flaky)
    with pytest.raises(OSError):
        model.save_pretrained(tmp_path / "ckpt", max_shard_size="1MB")
    assert list(tmp_path.iterdir()) == []


# ---- training ----------------------------------------------------------------------------------------
def test_overfit_one_batch_halves_loss():
    torch.manual_seed(0)
    model = make_tiny(seed=15).train()
    losses = overfit_losses(model, torch.randint(0, 4000, (4, 48)), 50)
    assert losses[-1] < 0.5 * losses[0], losses


# ---- images ------------------------------------------------------------------------------------------
def test_image_placeholder_expands_and_decodes_incrementally():
    from k3.model.media import media_token_count, preprocess_image
    model = make_tiny(seed=16, vision=True)
    img = torch.randint(0, 256, (3, 60, 90), dtype=torch.uint8)
    pixel_values, grid = preprocess_image(img)
    n_img = media_token_count(90, 60)
    pad_id = model.config.media_placeholder_token_id
    ids = torch.cat([torch.randint(0, 4000, (1, 4)), torch.tensor([[pad_id]]), torch.randint(0, 4000, (1, 5))], 1)
    with torch.no_grad():
        out = model(ids, pixel_values=pixel_values, grid_thws=grid)
    assert out.logits.shape[1] == ids.shape[1] - 1 + n_img
    gen = model.generate(ids, pixel_values=pixel_values, grid_thws=grid, max_new_tokens=4)
    assert gen.shape == (1, ids.shape[1] + 4)
    # the image changes the prediction
    other = torch.randint(0, 256, (3, 60, 90), dtype=torch.uint8)
    pv2, _ = preprocess_image(other)
    with torch.no_grad():
        out2 = model(ids, pixel_values=pv2, grid_thws=grid)
    assert (out.logits[:, -1] - out2.logits[:, -1]).abs().max() > 1e-4
    with pytest.raises(ValueError):
        model(torch.randint(0, 4000, (1, 6)), pixel_values=pixel_values, grid_thws=grid)


def test_generate_takes_hugging_face_arguments():
    """HF generation arguments: do_sample / top_k / top_p / temperature / eos / pad / max_length or a
    GenerationConfig-like object; unsupported options (beam search, penalties) and bad values are refused
    by name."""
    from types import SimpleNamespace
    model = make_tiny(seed=8)
    ids = torch.randint(0, 4000, (1, 5))
    greedy = model.generate(ids, max_new_tokens=6)
    # do_sample=False is greedy whatever the temperature; top_k=1 sampling is greedy too
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, temperature=0.7), greedy)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=True, top_k=1, temperature=1.3,
                                      generator=torch.Generator().manual_seed(1)), greedy)
    assert torch.equal(model.generate(ids, max_length=11), greedy)
    cfg = SimpleNamespace(max_new_tokens=6, do_sample=False, num_beams=1, repetition_penalty=1.0, top_k=50)
    assert torch.equal(model.generate(ids, generation_config=cfg), greedy)
    # seeded sampling is reproducible, and top_k restricts every draw to the k most likely tokens
    kw = dict(max_new_tokens=4, do_sample=True, temperature=1.0, top_k=3)
    a = model.generate(ids, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a, model.generate(ids, generator=torch.Generator().manual_seed(3), **kw))
    for t in range(4):
        logits = model(a[:, :5 + t]).logits[0, -1]
        assert a[0, 5 + t].item() in logits.topk(3).indices.tolist()
    # rows that finished are padded with pad_token_id
    first = greedy[0, 5].item()
    other = next(o for o in (torch.randint(0, 4000, (1, 5)) for _ in range(20))
                 if first not in model.generate(o, max_new_tokens=4)[0, 5:].tolist())
    out = model.generate(torch.cat([ids, other]), max_new_tokens=4, eos_token_id=first, pad_token_id=7)
    assert out[0, 5] == first and out[0, 6:].tolist() == [7, 7, 7]
    assert torch.equal(out[1], model.generate(other, max_new_tokens=4)[0])
    for kw, err in [(dict(num_beams=4), "num_beams"), (dict(repetition_penalty=1.2), "repetition_penalty"),
                    (dict(do_sample=True, temperature=0.0), "temperature > 0"), (dict(top_k=-1), "top_k"),
                    (dict(top_p=1.5), "top_p"), (dict(eos_token_id=10 ** 9), "outside the vocabulary"),
                    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_length=3), "max_length"),
                    (dict(temperature=float("nan")), "temperature"), (dict(do_sample="yes"), "do_sample")]:
        with pytest.raises(ValueError, match=err):
            model.generate(ids, **kw)
    with pytest.raises(TypeError, match="beam_width"):
        model.generate(ids, beam_width=2)
