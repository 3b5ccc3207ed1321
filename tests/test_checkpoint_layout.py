"""The full `k3` preset, built on the meta device, writes exactly the release's 497,220 keys and shapes."""

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3 import K3Config
from k3.model.state_dict import checkpoint_tensors

INDEX = Path(__file__).resolve().parents[2] / "shared" / "reference" / "kimi-k3" / "model.safetensors.index.json.gz"


@pytest.fixture(scope="module")
def table():
    return checkpoint_tensors(K3Config.preset("k3"))


def expected_shape(key: str, cfg: K3Config):
    """Shapes written out from the config numbers (checkpoint.md §2), independent of the model code."""
    t, v = cfg.text_config, cfg.vision_config
    D, H, la = t.hidden_size, t.num_attention_heads, t.linear_attn_config
    HK = la.num_heads * la.head_dim
    qk = t.qk_nope_head_dim + t.qk_rope_head_dim
    L, I = t.routed_expert_hidden_size, t.moe_intermediate_size
    S = t.num_shared_experts * I
    vd, vq = v.vt_hidden_size, v.qkv_hidden_size
    p = v.patch_size
    table = {
        r"embed_tokens\.weight|lm_head\.weight": (t.vocab_size, D),
        r"model\.norm\.weight|output_attn_res_norm\.weight|input_layernorm\.weight|post_attention_layernorm\.weight"
        r"|_res_norm\.weight": (D,),
        r"_res_proj\.weight": (1, D),
        r"self_attn\.(q|k|v)_proj\.weight": (HK, D),
        r"self_attn\.(q|k|v)_conv1d\.weight": (HK, 1, la.short_conv_kernel_size),
        r"self_attn\.f_a_proj\.weight": (la.head_dim, D),
        r"self_attn\.f_b_proj\.weight": (HK, la.head_dim),
        r"self_attn\.dt_bias": (HK,),
        r"self_attn\.A_log": (128,),
        r"self_attn\.b_proj\.weight": (la.num_heads, D),
        r"self_attn\.g_proj\.weight": (HK, D),
        r"self_attn\.o_norm\.weight": (la.head_dim,),
        r"self_attn\.o_proj\.weight": (D, HK),
        r"self_attn\.q_a_proj\.weight": (t.q_lora_rank, D),
        r"self_attn\.q_a_layernorm\.weight": (t.q_lora_rank,),
        r"self_attn\.q_b_proj\.weight": (H * qk, t.q_lora_rank),
        r"self_attn\.kv_a_proj_with_mqa\.weight": (t.kv_lora_rank + t.qk_rope_head_dim, D),
        r"self_attn\.kv_a_layernorm\.weight": (t.kv_lora_rank,),
        r"self_attn\.kv_b_proj\.weight": (H * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank),
        r"mlp\.(gate|up)_proj\.weight": (t.intermediate_size, D),
        r"mlp\.down_proj\.weight": (D, t.intermediate_size),
        r"gate\.weight": (t.num_experts, D),
        r"gate\.e_score_correction_bias": (t.num_experts,),
        r"routed_expert_down_proj\.weight": (L, D),
        r"routed_expert_norm\.weight": (L,),
        r"routed_expert_up_proj\.weight": (D, L),
        r"shared_experts\.(gate|up)_proj\.weight": (S, D),
        r"shared_experts\.down_proj\.weight": (D, S),
        r"experts\.\d+\.w[13]\.weight_packed": (I, L // 2),
        r"experts\.\d+\.w[13]\.weight_scale": (I, L // 32),
        r"experts\.\d+\.w2\.weight_packed": (L, I // 2),
        r"experts\.\d+\.w2\.weight_scale": (L, I // 32),
        r"patch_embed\.proj\.weight": (vd, 3, p, p),
        r"patch_embed\.pos_emb\.weight": (v.init_pos_emb_height, v.init_pos_emb_width, vd),
        r"blocks\.\d+\.wqkv\.weight": (3 * vq, vd),
        r"blocks\.\d+\.wo\.weight": (vd, vq),
        r"blocks\.\d+\.norm[01]\.weight|final_layernorm\.weight": (vd,),
        r"mlp\.fc0\.weight": (v.vt_intermediate_size, vd),
        r"mlp\.fc1\.weight": (vd, v.vt_intermediate_size),
        r"mm_projector\.proj\.0\.weight": (4 * v.mm_hidden_size, 4 * v.mm_hidden_size),
        r"mm_projector\.proj\.2\.weight": (D, 4 * v.mm_hidden_size),
        r"mm_projector\.post_norm\.weight": (D,),
    }
    hits = [s for pat, s in table.items() if re.search(pat + "$", key)]
    assert len(hits) >= 1, key
    return hits[0]


@pytest.mark.skipif(not INDEX.is_file(), reason="shared/reference not present")
def test_key_set_equals_real_index(table):
    real = json.load(gzip.open(INDEX))
    keys = set(real["weight_map"])
    assert len(keys) == 497_220
    assert set(table) == keys
    # the byte total of the release's index follows from our shapes and dtypes
    total = sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in table.values())
    assert total == real["metadata"]["total_size"]


def test_shapes_match_config_derived_table(table):
    cfg = K3Config.preset("k3")
    cache = {}  # keys that differ only in layer / expert / block numbers share one expected shape
    for key, (shape, dtype) in table.items():
        pattern = key if key.startswith("mm_projector") else re.sub(r"\.\d+\.", ".N.", key)
        if pattern not in cache:
            cache[pattern] = expected_shape(key, cfg)
        assert shape == cache[pattern], key
        if key.endswith(("weight_packed", "weight_scale")):
            assert dtype == torch.uint8
        elif key.endswith(("A_log", "dt_bias", "o_norm.weight", "conv1d.weight", "e_score_correction_bias")):
            assert dtype == torch.float32, key
        else:
            assert dtype == torch.bfloat16, key


def test_dense_experts_variant():
    cfg = K3Config.preset("k3-tiny")
    tab = checkpoint_tensors(cfg)
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in tab
    tab = checkpoint_tensors(cfg, experts_format="mxfp4")
    assert tab["language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight_packed"][1] == torch.uint8
    # the MTP layer uses DeepSeek/vLLM names and has no AttnRes parameters
    mtp = [k for k in tab if k.startswith("language_model.model.layers.5.")]
    assert "language_model.model.layers.5.eh_proj.weight" in mtp
    assert "language_model.model.layers.5.shared_head.norm.weight" in mtp
    assert not any("_res_" in k for k in mtp)


def test_k3_info_json_matches_report():
    out = subprocess.run([sys.executable, "-m", "k3", "info", "--preset", "k3", "--json"],   # `python -m k3`
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert abs(info["total_params"] / 2.78e12 - 1) < 0.01
    assert abs(info["active_params"] / 104.2e9 - 1) < 0.01
    assert info["layer_pattern"] == ("KKKM" * 23) + "M"
    assert "embedding" in info["active_definition"]


# ---- checkpoints written by the official modeling code: A_log padding, index total_size, MTP head -----------

def _two_head_model(seed: int = 0):
    """k3-tiny with 2 KDA heads of head_dim 8: the official code stores A_log as [8] for it."""
    from conftest import randomize

    from k3 import K3ForConditionalGeneration
    cfg = K3Config.preset("k3-tiny")
    cfg.vision_config = None
    cfg.text_config.linear_attn_config.num_heads, cfg.text_config.linear_attn_config.head_dim = 2, 8
    torch.manual_seed(seed)
    model = K3ForConditionalGeneration(cfg)
    randomize(model, seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log[:2] = torch.randn(2)      # distinct, non-zero per-head values
    return model.eval()


def _rewrite(path: Path, fn) -> None:
    """Apply fn(dict of tensors) to every shard of the checkpoint at `path` (sizes may change)."""
    from safetensors.torch import load_file, save_file
    for shard in sorted(path.glob("*.safetensors")):
        tensors = load_file(shard)
        fn(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})


def _a_log_keys(path: Path) -> list[str]:
    return [k for k in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
            if k.endswith("self_attn.A_log")]


def test_official_a_log_padding_saved_and_loaded(tmp_path):
    from safetensors import safe_open

    from k3.model.state_dict import a_log_length, load_pretrained, save_pretrained
    model = _two_head_model()
    assert a_log_length(model.config) == 8 and a_log_length(K3Config.preset("k3")) == 128
    path = save_pretrained(model, tmp_path / "ckpt", max_shard_size="200KB")
    keys = _a_log_keys(path)
    assert keys
    index = json.loads((path / "model.safetensors.index.json").read_text())
    total, stored = 0, {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                total += t.numel() * t.element_size()
                stored[k] = t
    assert index["metadata"]["total_size"] == total          # tensor bytes, not file sizes
    for k in keys:                                           # the official rule: [8], zero past the 2 heads
        assert stored[k].shape == (8,) and stored[k].dtype == torch.float32
        assert torch.equal(stored[k][2:], torch.zeros(6)) and stored[k][:2].abs().min() > 0

    x = torch.randint(0, 4000, (2, 9), generator=torch.Generator().manual_seed(1))
    want = model(x).logits
    # other padded lengths load too (e.g. a multiple of 128), as long as the tail is zero
    for length in (8, 2, 128):
        def pad(tensors, length=length):
            for k in keys:
                if k in tensors:
                    t = torch.zeros(length)
                    t[:2] = tensors[k][:2]
                    tensors[k] = t
        _rewrite(path, pad)
        got = load_pretrained(path)
        for name, p in got.named_parameters():
            if name.endswith("A_log"):
                ref = dict(model.named_parameters())[name]
                assert torch.equal(p[:2], ref[:2]) and not p[2:].any(), (length, name)
        assert torch.equal(got(x).logits, want), length


@pytest.mark.parametrize("bad,match", [("tail", "entries past num_heads=2 must be 0"),
                                       ("short", r"expected \[L\] with L >= num_heads=2")])
def test_bad_a_log_is_rejected(tmp_path, bad, match):
    from k3.io.checkpoint import CheckpointError
    from k3.model.state_dict import load_pretrained, save_pretrained
    path = save_pretrained(_two_head_model(), tmp_path / "ckpt")
    key = _a_log_keys(path)[1]

    def corrupt(tensors):
        if key in tensors:
            if bad == "tail":
                tensors[key][5] = 0.25
            else:
                tensors[key] = tensors[key][:1].clone()
    _rewrite(path, corrupt)
    with pytest.raises(CheckpointError, match=match) as e:
        load_pretrained(path)
    assert key in str(e.value)


def test_save_refuses_nonzero_a_log_padding(tmp_path):
    from k3.io.checkpoint import CheckpointError
    from k3.model.state_dict import save_pretrained
    model = _two_head_model()
    with torch.no_grad():
        model.language_model.model.layers[0].self_attn.A_log[3] = 1.0
    with pytest.raises(CheckpointError, match="layers.0.self_attn.A_log"):
        save_pretrained(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_optional_mtp_shared_head_loads(tmp_path):
    from k3.model.state_dict import load_pretrained, save_pretrained
    model = _two_head_model()
    path = save_pretrained(model, tmp_path / "ckpt")
    t = model.config.text_config
    key = f"language_model.model.layers.{t.num_hidden_layers}.shared_head.head.weight"
    head = torch.randn(t.vocab_size, t.hidden_size, generator=torch.Generator().manual_seed(2))

    def add(tensors):
        if "language_model.lm_head.weight" in tensors:
            tensors[key] = head.clone()
    _rewrite(path, add)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][key] = index["weight_map"]["language_model.lm_head.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = load_pretrained(path)
    assert torch.equal(got.language_model.model.layers[t.num_hidden_layers].shared_head.head.weight, head)
    assert torch.equal(got.state_dict()[key], head)
