import json
from pathlib import Path

import pytest

from k3 import K3Config

REAL = Path(__file__).resolve().parents[2] / "shared" / "reference" / "kimi-k3" / "config.json"


def real_config_path() -> Path:
    if REAL.is_file():
        return REAL
    return Path(__file__).resolve().parents[1] / "k3" / "presets" / "kimi-k3.json"


def test_real_config_round_trips(tmp_path):
    raw = json.loads(real_config_path().read_text())
    cfg = K3Config.from_pretrained(real_config_path())
    assert cfg.to_dict() == raw
    assert list(cfg.to_dict()) == list(raw)  # key order kept too
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == raw
    assert K3Config.from_pretrained(tmp_path).to_dict() == raw


def test_shipped_preset_is_the_release():
    if REAL.is_file():
        assert K3Config.preset("k3").to_dict() == json.loads(REAL.read_text())


def test_release_layout_is_one_based():
    tc = K3Config.preset("k3").text_config
    types = tc.layer_types()
    assert types.count("kda") == 69 and types.count("mla") == 24
    assert [i for i, t in enumerate(types) if t == "mla"] == list(range(3, 92, 4)) + [92]
    assert types[0] == "kda"
    assert tc.routed_experts_mxfp4
    assert K3Config.preset("k3").quantization_config["format"] == "mxfp4-pack-quantized"


def test_tiny_preset_has_every_mechanism():
    tc = K3Config.preset("k3-tiny").text_config
    types = tc.layer_types()
    n_blocks = -(-tc.num_hidden_layers // tc.attn_res_block_size)
    assert n_blocks >= 2
    assert tc.num_experts >= 8 and tc.num_experts_per_token >= 2 and tc.num_shared_experts >= 1
    assert types[:4] == ["kda", "kda", "kda", "mla"] and types[-1] == "mla"
    assert not tc.is_moe_layer(0) and all(tc.is_moe_layer(i) for i in range(1, tc.num_hidden_layers))
    assert tc.num_nextn_predict_layers == 1


def test_vision_null_is_text_only(tmp_path):
    d = K3Config.preset("k3-tiny").to_dict()
    d["vision_config"] = None
    cfg = K3Config.from_dict(d)
    assert cfg.vision_config is None and cfg.to_dict()["vision_config"] is None
    from k3.model.state_dict import checkpoint_tensors
    assert not any(k.startswith(("vision_tower", "mm_projector")) for k in checkpoint_tensors(cfg))


@pytest.mark.parametrize("change, match", [
    (lambda d: d["text_config"]["linear_attn_config"].update(kda_layers=[0, 1, 2]), "1-based"),
    (lambda d: d["text_config"]["linear_attn_config"].update(full_attn_layers=[4]), "neither"),
    (lambda d: d["text_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda d: d.update(model_type="llama"), "model_type"),
])
def test_bad_configs_name_the_value(change, match):
    d = K3Config.preset("k3-tiny").to_dict()
    change(d)
    with pytest.raises(ValueError, match=match):
        K3Config.from_dict(d)


def test_unknown_preset():
    with pytest.raises(ValueError, match="k3-huge"):
        K3Config.preset("k3-huge")
