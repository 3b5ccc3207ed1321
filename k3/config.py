"""Model configuration: reads and writes the released Kimi-K3 `config.json` unchanged.

`K3Config` mirrors the HF `KimiK3Config` (model_type `kimi_k3`) wrapping a `kimi_linear` text config
(`K3TextConfig`) and a MoonViT vision config (`K3VisionConfig`, or None for a text-only model).
Every key we do not model explicitly is kept verbatim, in its original order, so a config round-trips.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ._atomic import atomic_write

_PRESET_DIR = Path(__file__).parent / "presets"


class _DictConfig:
    """Dataclass mix-in: `from_dict` keeps unknown keys (and key order) so `to_dict` round-trips."""

    _nested: ClassVar[dict[str, type]] = {}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        if not isinstance(d, dict):
            raise TypeError(f"{cls.__name__}.from_dict expects a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        known, extra = {}, {}
        for k, v in d.items():
            if k in names:
                sub = cls._nested.get(k)
                known[k] = sub.from_dict(v) if (sub is not None and v is not None) else copy.deepcopy(v)
            else:
                extra[k] = copy.deepcopy(v)
        obj = cls(**known)
        obj._extra = extra
        obj._order = list(d.keys())
        obj.validate()
        return obj

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                continue
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, _DictConfig) else copy.deepcopy(v)
        out.update(copy.deepcopy(self._extra))
        order = [k for k in self._order if k in out]
        return {k: out[k] for k in order + sorted(k for k in out if k not in order)}

    def validate(self) -> None:  # overridden where there is something to check
        pass


@dataclass
class LinearAttnConfig(_DictConfig):
    """`text_config.linear_attn_config`: KDA sizes and the **1-based** layer lists of the release."""

    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float = -5.0
    kda_layers: list[int] = field(default_factory=list)
    full_attn_layers: list[int] = field(default_factory=list)
    _extra: dict = field(default_factory=dict, repr=False)
    _order: list = field(default_factory=list, repr=False)


@dataclass
class K3TextConfig(_DictConfig):
    """The language model (`kimi_linear`). Defaults are the released K3 numbers."""

    _nested: ClassVar[dict[str, type]] = {"linear_attn_config": LinearAttnConfig}

    model_type: str = "kimi_linear"
    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    moe_intermediate_size: int = 3072
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    attn_res_block_size: int = 12
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    quantization_config: dict | None = None
    _extra: dict = field(default_factory=dict, repr=False)
    _order: list = field(default_factory=list, repr=False)

    # ---- derived layout -------------------------------------------------------------------------
    def is_kda_layer(self, i: int) -> bool:
        """0-based layer `i` is KDA iff `i + 1` is in the 1-based `kda_layers` list of the release."""
        return (i + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def layer_types(self) -> list[str]:
        return ["kda" if self.is_kda_layer(i) else "mla" for i in range(self.num_hidden_layers)]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def routed_experts_mxfp4(self) -> bool:
        """Whether the checkpoint stores routed experts as MXFP4 (`weight_packed` / `weight_scale`)."""
        q = self.quantization_config or {}
        return "mxfp4" in str(q.get("format", "")).lower()

    def validate(self) -> None:
        la = self.linear_attn_config
        n = self.num_hidden_layers
        for name in ("kda_layers", "full_attn_layers"):
            bad = [i for i in getattr(la, name) if not 1 <= i <= n]
            if bad:
                raise ValueError(f"linear_attn_config.{name} holds {bad}: ids are 1-based in [1, {n}]")
        both = set(la.kda_layers) & set(la.full_attn_layers)
        if both:
            raise ValueError(f"layers {sorted(both)} are in both kda_layers and full_attn_layers")
        missing = sorted(set(range(1, n + 1)) - set(la.kda_layers) - set(la.full_attn_layers))
        if missing:
            raise ValueError(f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(f"num_experts_per_token={self.num_experts_per_token} > num_experts={self.num_experts}")
        if self.attn_res_block_size < 1:
            raise ValueError(f"attn_res_block_size must be >= 1, got {self.attn_res_block_size}")
        if self.hidden_act != "situ":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (K3 uses 'situ')")
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError(f"moe_router_activation_func={self.moe_router_activation_func!r}: only 'sigmoid'")
        if la.num_heads * la.head_dim <= 0 or self.hidden_size <= 0:
            raise ValueError("hidden_size, linear_attn_config.num_heads and head_dim must be positive")


@dataclass
class K3VisionConfig(_DictConfig):
    """MoonViT-V2 tower + `patchmergerv2` projector (keys as in the release's `vision_config`)."""

    patch_size: int = 14
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    qkv_hidden_size: int = 1536
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    text_hidden_size: int = 7168
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    activation_func: str = "gelu_pytorch_tanh"
    norm_type: str = "rmsnorm"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    mlp_type: str = "mlp2"
    _extra: dict = field(default_factory=dict, repr=False)
    _order: list = field(default_factory=list, repr=False)

    def validate(self) -> None:
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            raise ValueError(
                f"qkv_hidden_size={self.qkv_hidden_size} not divisible by vt_num_attention_heads="
                f"{self.vt_num_attention_heads}")
        if self.merge_type != "sd2_tpool" or self.mm_projector_type != "patchmergerv2":
            raise ValueError(f"unsupported merge_type={self.merge_type!r} / mm_projector_type="
                             f"{self.mm_projector_type!r} (K3 uses sd2_tpool / patchmergerv2)")


@dataclass
class K3Config(_DictConfig):
    """Top-level `kimi_k3` config. `vision_config=None` means a text-only model (no vision tensors)."""

    _nested: ClassVar[dict[str, type]] = {"text_config": K3TextConfig, "vision_config": K3VisionConfig}

    architectures: list[str] = field(default_factory=lambda: ["KimiK3ForConditionalGeneration"])
    model_type: str = "kimi_k3"
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    media_placeholder_token_id: int = 163605
    image_placeholder: str = "<|kimi_image_placeholder|>"
    ignore_index: int = -100
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    text_config: K3TextConfig = field(default_factory=K3TextConfig)
    vision_config: K3VisionConfig | None = field(default_factory=K3VisionConfig)
    _extra: dict = field(default_factory=dict, repr=False)
    _order: list = field(default_factory=list, repr=False)

    PRESETS: ClassVar[tuple[str, ...]] = ("k3", "k3-small", "k3-tiny")

    def validate(self) -> None:
        if self.model_type != "kimi_k3":
            raise ValueError(f"model_type={self.model_type!r}: expected 'kimi_k3'")
        if self.vision_config is not None and self.vision_config.text_hidden_size != self.text_config.hidden_size:
            raise ValueError(f"vision_config.text_hidden_size={self.vision_config.text_hidden_size} != "
                             f"text_config.hidden_size={self.text_config.hidden_size}")

    @property
    def quantization_config(self) -> dict | None:
        """As HF `KimiK3Config`: the text config's quantization config, visible at the top level."""
        return self.text_config.quantization_config

    # ---- I/O ------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "K3Config":
        """Load from a `config.json` file or a directory holding one."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        return atomic_write(d / "config.json", json.dumps(self.to_dict(), indent=2) + "\n", mode=0o644)

    # ---- presets --------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "K3Config":
        """`k3` (the released model), `k3-small` (≈2 B, one GPU) or `k3-tiny` (a few M, CPU, every mechanism)."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(cls.PRESETS)}")
        base = cls.from_pretrained(_PRESET_DIR / "kimi-k3.json")
        if name == "k3":
            return base
        return _shrink(base, **(_SMALL if name == "k3-small" else _TINY))


def _pattern(n_layers: int) -> tuple[list[int], list[int]]:
    """K3's layer pattern (1-based): every 4th layer MLA, plus a final MLA; the rest KDA."""
    full = sorted({i for i in range(4, n_layers + 1, 4)} | {n_layers})
    return [i for i in range(1, n_layers + 1) if i not in full], full


_TINY = dict(
    text=dict(vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
              num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
              num_experts_per_token=2, num_shared_experts=2, routed_expert_hidden_size=64,
              attn_res_block_size=2, num_nextn_predict_layers=1, max_position_embeddings=65536,
              bos_token_id=4000, eos_token_id=4002, pad_token_id=4095, quantization_config=None),
    kda=dict(num_heads=4, head_dim=32),
    vision=dict(vt_hidden_size=64, vt_intermediate_size=128, vt_num_attention_heads=2, vt_num_hidden_layers=2,
                qkv_hidden_size=64, init_pos_emb_height=16, init_pos_emb_width=16, mm_hidden_size=64),
    top=dict(bos_token_id=4000, eos_token_id=4002, pad_token_id=4095, media_placeholder_token_id=4021,
             dtype="float32"),
)

_SMALL = dict(
    text=dict(vocab_size=163840, hidden_size=1536, intermediate_size=6144, moe_intermediate_size=512,
              num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=12, q_lora_rank=512,
              kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=32,
              num_experts_per_token=4, num_shared_experts=2, routed_expert_hidden_size=768,
              attn_res_block_size=4, num_nextn_predict_layers=1, quantization_config=None),
    kda=dict(num_heads=12, head_dim=128),
    vision=dict(vt_hidden_size=512, vt_intermediate_size=2048, vt_num_attention_heads=8, vt_num_hidden_layers=6,
                qkv_hidden_size=512, mm_hidden_size=512),
    top=dict(),
)


def _shrink(base: K3Config, text: dict, kda: dict, vision: dict, top: dict) -> K3Config:
    d = base.to_dict()
    t = d["text_config"]
    t.update(text)
    kda_layers, full = _pattern(t["num_hidden_layers"])
    t["linear_attn_config"].update(kda, kda_layers=kda_layers, full_attn_layers=full)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in text:
            t[k] = text[k]
    v = d["vision_config"]
    v.update(vision, text_hidden_size=t["hidden_size"])
    d.update(top)
    return K3Config.from_dict(d)
