"""Parameter accounting on the meta device (no memory): total, activated and per-component counts.

Activated parameters follow the report's convention: every non-routed parameter of the text model plus
`num_experts_per_token` routed experts per MoE layer, the LM head included, the embedding table, the vision
tower/projector and the MTP layers excluded. This reproduces the report's 104.2 B for the released config.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import torch

from .config import K3Config

_COMPONENTS = [
    ("embedding", r"^language_model\.model\.embed_tokens\."),
    ("lm_head", r"^language_model\.lm_head\."),
    ("mtp", r"^language_model\.model\.layers\.(?P<i>\d+)\.(enorm|hnorm|eh_proj|shared_head)"),
    ("vision_tower", r"^vision_tower\."),
    ("mm_projector", r"^mm_projector\."),
    ("attn_res", r"(_res_norm|_res_proj)\."),
    ("kda_attention", r"\.self_attn\.(q_proj|k_proj|v_proj|q_conv1d|k_conv1d|v_conv1d|f_a_proj|f_b_proj|A_log|dt_bias|b_proj|o_norm)"),
    ("mla_attention", r"\.self_attn\.(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)"),
    ("attention_output", r"\.self_attn\.(g_proj|o_proj)\."),
    ("dense_mlp", r"\.mlp\."),
    ("moe_router", r"\.block_sparse_moe\.gate\."),
    ("moe_routed_experts", r"\.block_sparse_moe\.experts\."),
    ("moe_latent_proj_norm", r"\.block_sparse_moe\.routed_expert_"),
    ("moe_shared_experts", r"\.block_sparse_moe\.shared_experts\."),
    ("layer_norms", r"(input_layernorm|post_attention_layernorm|model\.norm)\."),
]


def _component(name: str) -> str:
    for comp, pat in _COMPONENTS:
        if re.search(pat, name):
            return comp
    return "other"


def model_info(config: K3Config) -> dict:
    """Counts for `config`, built on the meta device. Returns a JSON-able dict."""
    from .model.k3 import K3ForConditionalGeneration

    with torch.device("meta"):
        model = K3ForConditionalGeneration(config, init=False)
    tc = config.text_config
    n_layers = tc.num_hidden_layers
    mtp_prefix = tuple(f"language_model.model.layers.{n_layers + k}." for k in range(tc.num_nextn_predict_layers))
    breakdown: dict[str, int] = OrderedDict((c, 0) for c, _ in _COMPONENTS)
    total = active = 0
    for name, p in model.state_dict().items():  # persistent tensors only (incl. the router bias)
        n = p.numel()
        comp = "mtp" if name.startswith(mtp_prefix) else _component(name)
        breakdown[comp] = breakdown.get(comp, 0) + n
        total += n
        if comp in ("embedding", "vision_tower", "mm_projector", "mtp"):
            continue
        if comp == "moe_routed_experts":
            n = n * tc.num_experts_per_token // tc.num_experts
        active += n
    types = tc.layer_types()
    moe_layers = sum(tc.is_moe_layer(i) for i in range(n_layers))
    return {
        "total_params": total,
        "active_params": active,
        "active_definition": ("non-routed text-model parameters + num_experts_per_token routed experts per MoE "
                              "layer, LM head included; embedding table, vision tower/projector and MTP excluded"),
        "layers": n_layers,
        "layer_pattern": "".join("K" if t == "kda" else "M" for t in types),
        "kda_layers": types.count("kda"),
        "mla_layers": types.count("mla"),
        "moe_layers": moe_layers,
        "dense_layers": n_layers - moe_layers,
        "mtp_layers": tc.num_nextn_predict_layers,
        "attn_res_blocks": -(-n_layers // tc.attn_res_block_size),
        "attn_res_candidates_at_output": 1 + -(-n_layers // tc.attn_res_block_size),
        "experts": f"{tc.num_experts} routed (top-{tc.num_experts_per_token}) + {tc.num_shared_experts} shared",
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "vision": config.vision_config is not None,
        "breakdown": {k: v for k, v in breakdown.items() if v},
    }


def _fmt(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def format_info(info: dict) -> str:
    lines = [
        f"layers            {info['layers']} ({info['kda_layers']} KDA, {info['mla_layers']} MLA; "
        f"{info['dense_layers']} dense + {info['moe_layers']} MoE; {info['mtp_layers']} MTP)",
        f"layer pattern     {info['layer_pattern']}   (K = KDA, M = MLA)",
        f"attn residuals    {info['attn_res_blocks']} blocks, {info['attn_res_candidates_at_output']} candidates "
        f"at the output (embedding + blocks)",
        f"experts           {info['experts']}",
        f"total params      {info['total_params']:,} ({_fmt(info['total_params'])})",
        f"activated params  {info['active_params']:,} ({_fmt(info['active_params'])})",
        f"  activated = {info['active_definition']}",
        "breakdown:",
    ]
    w = max(len(k) for k in info["breakdown"])
    for k, v in info["breakdown"].items():
        lines.append(f"  {k:<{w}}  {v:>18,}  {100 * v / info['total_params']:6.2f} %")
    return "\n".join(lines)
